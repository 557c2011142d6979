"""What CurveZMQ encryption costs: the same client against four gateways in one run — no
security, the token (a MAC on every message), CURVE (every connection encrypted, only known
client keys admitted) and both.

    python benchmarks/bench_curve.py [--quick] [--json OUT] [--write]

Measures a small op's round trip (an ``aten::add`` and an ``rc::sync`` request), a 64 MiB upload
(16 PARTs on the bulk connection, then a sync) and a session's start. Rounds rotate over the
four gateways so that the machine's load falls on all alike. ``--write`` puts its section into
benchmarks/RESULTS.md.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results_md  # noqa: E402
from bench_auth import TOKEN, _gateway, _small_ops, _upload  # noqa: E402

SECTION = "# Part 13: encryption (benchmarks/bench_curve.py)"
KINDS = ("plain", "token", "curve", "both")


def _session(endpoint: str, token: str | None, keys: dict | None):
    """A session with the environment a client of that gateway has (token, CURVE keys)."""
    import zmq

    from remotecuda.session import Session
    from remotecuda_wire import auth, curve
    for var, value in ((auth.TOKEN_ENV, token), (curve.SECRET_ENV, keys and keys["secret"]),
                       (curve.SERVER_ENV, keys and keys["server"])):
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    t = time.perf_counter()
    s = Session(zmq.Context.instance(), endpoint, 0, 0, connect_timeout=120, cache_bytes=0)
    return s, time.perf_counter() - t


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores"


def _socket_costs(d: str) -> dict:
    """The cipher alone: 64 MiB in 4 MiB messages over a loopback TCP pair of ZeroMQ sockets in
    one process, plaintext and CURVE (best of 3); and one CURVE handshake with its ZAP request."""
    import zmq

    from remotecuda_wire import curve
    ctx = zmq.Context()
    server = curve.Server(ctx, curve.load_keypair(os.path.join(d, "gateway.key_secret")), os.path.join(d, "clients"))
    client = curve.load_keypair(os.path.join(d, "clients", "client.key_secret"))
    part = os.urandom(4 << 20)
    out: dict = {}
    try:
        for name in ("plain", "curve"):
            rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
            if name == "curve":
                server.secure(rx)
                curve.secure_client(tx, client, server.keys.public)
            port = rx.bind_to_random_port("tcp://127.0.0.1")
            t = time.perf_counter()
            tx.connect(f"tcp://127.0.0.1:{port}")
            tx.send(b"hello")
            rx.recv()
            handshake = time.perf_counter() - t
            runs = []
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(16):
                    tx.send(part, copy=False)
                for _ in range(16):
                    rx.recv(copy=False)
                runs.append(time.perf_counter() - t)
            out[name] = {"mb_s": 64 * 1.048576 / min(runs), "first_message_ms": handshake * 1e3}
            tx.close(0)
            rx.close(0)
    finally:
        server.stop()
        ctx.term()
    return out


def run(quick: bool) -> dict:
    import torch

    from remotecuda_wire import curve
    n_small, rounds = (200, 2) if quick else (1200, 4)
    with tempfile.TemporaryDirectory() as d:
        token_file = os.path.join(d, "token")
        with open(token_file, "w") as f:
            f.write(TOKEN)
        curve.make_keys(d, "gateway")
        curve.make_keys(os.path.join(d, "clients"), "client")
        keys = {"secret": os.path.join(d, "clients", "client.key_secret"), "server": os.path.join(d, "gateway.key")}
        curve_args = ("--curve-secret", os.path.join(d, "gateway.key_secret"), "--curve-clients",
                      os.path.join(d, "clients"))
        setup = {"plain": ((), None, None), "token": (("--token-file", token_file), TOKEN, None),
                 "curve": (curve_args, None, keys), "both": ((*curve_args, "--token-file", token_file), TOKEN, keys)}
        sockets = _socket_costs(d)
        procs, eps = {}, {}
        try:
            for name in KINDS:
                procs[name], eps[name] = _gateway(*setup[name][0])
            sessions = {name: _session(eps[name], *setup[name][1:])[0] for name in KINDS}
            small: dict[str, list] = {name: [] for name in KINDS}
            upload: dict[str, list] = {name: [] for name in KINDS}
            starts: dict[str, list] = {name: [] for name in KINDS}
            x = torch.randn(16 << 20)  # 64 MiB
            for s in sessions.values():  # warm up: first uploads fault memory in
                _small_ops(s, 50)
                _upload(s, x)
            for r in range(rounds):
                for name in KINDS[r % 4:] + KINDS[:r % 4]:
                    s = sessions[name]
                    small[name] += _small_ops(s, n_small // rounds)
                    x.add_(1)
                    upload[name].append(_upload(s, x))
            direct = {name: s.direct for name, s in sessions.items()}
            for s in sessions.values():
                s.close()
            for name in KINDS:
                for _ in range(3):  # session starts (a worker is ready: --spare 3)
                    time.sleep(1.0)
                    s, dt = _session(eps[name], *setup[name][1:])
                    starts[name].append(dt)
                    s.close()
        finally:  # (all stopped before their key files go with the directory)
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    out: dict = {"load": os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"),
                 "machine": _machine(), "date": datetime.date.today().isoformat(),
                 "n_small": n_small, "rounds": rounds, "direct": direct, "sockets": sockets}
    for name in KINDS:
        out[name] = {"small_us_median": statistics.median(small[name]) * 1e6,
                     "small_us_p90": statistics.quantiles(small[name], n=10)[-1] * 1e6,
                     "upload_ms_median": statistics.median(upload[name]) * 1e3,
                     "upload_mb_s": 64 * 1.048576 / statistics.median(upload[name]),
                     "start_ms_median": statistics.median(starts[name]) * 1e3}
    return out


def markdown(r: dict) -> str:
    rows = [("small op round trip (`aten::add` + `rc::sync`), median µs", "small_us_median", "{:.0f}"),
            ("small op round trip, 90th percentile µs", "small_us_p90", "{:.0f}"),
            ("64 MiB upload (16 PARTs, then a sync), median ms", "upload_ms_median", "{:.0f}"),
            ("64 MiB upload, MB/s", "upload_mb_s", "{:.0f}"),
            ("session start (HELLO to WELCOME, a worker ready), median ms", "start_ms_median", "{:.1f}")]
    table = "\n".join(f"| {label} | " + " | ".join(fmt.format(r[k][key]) for k in KINDS) + " |"
                      for label, key, fmt in rows)
    p, c, b = r["plain"], r["curve"], r["both"]
    sp, sc = r["sockets"]["plain"], r["sockets"]["curve"]
    return f"""Four `--device cpu` gateways on 127.0.0.1 — no security, `--token-file` (a MAC on every
message), `--curve-secret`/`--curve-clients` (CurveZMQ: every connection encrypted and
authenticated by libsodium, a ZAP handler admitting only known client keys) and both — and the
same client (remotecuda.session.Session, the direct path: {r['direct']['curve']}) against each,
rounds rotating over the four. {r['machine']}, {r['date']}; load average (1 min) {r['load']:.2f}
at the end: a shared machine, so the medians are the figures to read.

| | no security | token | CURVE | CURVE + token |
| --- | --- | --- | --- | --- |
{table}

({r['n_small']} round trips and {r['rounds']} uploads per gateway.) Against no security, CURVE
changed a small op's median round trip by {c['small_us_median'] - p['small_us_median']:+.0f} µs (with the token as well:
{b['small_us_median'] - p['small_us_median']:+.0f} µs); the 90th percentiles show how much of that is the machine's noise.
A 64 MiB upload ran at ×{c['upload_mb_s'] / p['upload_mb_s']:.2f} of the plain throughput (with the token as well:
×{b['upload_mb_s'] / p['upload_mb_s']:.2f}; the two costs add, each a pass over the bytes at each end). The cipher alone,
between two ZeroMQ sockets in one process over loopback TCP (64 MiB in 4 MiB messages, best of
3): {sp['mb_s']:.0f} MB/s plaintext, {sc['mb_s']:.0f} MB/s with CURVE. ZeroMQ encrypts and decrypts
(XSalsa20-Poly1305, libsodium) in a context's I/O thread, outside the GIL: one thread per
process by default, so one connection's CURVE throughput is bounded by one core at each end (in
this in-process measurement, one thread did both). A new CURVE connection's first message took
{sc['first_message_ms']:.1f} ms (handshake and ZAP request) against {sp['first_message_ms']:.1f} ms; a session start opens three
(front, direct, bulk). A 1 Gbit/s wire carries ~117 MB/s: {"faster than CURVE managed here, so on such a link CURVE bounds large transfers on this machine" if sc['mb_s'] < 117 else "slower than CURVE here, so on such a link the wire, not the cipher, bounds large transfers"}.
"""


if __name__ == "__main__":
    results_md.main(SECTION, run, markdown, "fewer round trips and uploads")
