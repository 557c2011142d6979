"""Core RemoteCUDA benchmarks, all measured in one run on this machine.

    python benchmarks/bench_core.py [--quick]

Starts its own gateway (``remotecuda start --device cpu`` on 127.0.0.1, a free port) and
measures, against local CPU eager PyTorch in the same process:

1. the client's cost per op for a chain of small elementwise ops (one sync at the end);
2. training steps of an MLP (Linear 32->64->64->1, Adam, batch 256) and of a small transformer
   (2 encoder layers, d_model 64, AdamW);
3. upload / download throughput for 4 KB, 1 MB and 64 MB float32 tensors, against a raw
   loopback TCP socket (sendall / recv_into of the same sizes) as the ceiling;
4. start-up: ``remotecuda run python`` against ``python`` for a script that imports torch and
   makes one tensor (on 'cuda' and on the CPU respectively).

Prints a table and writes benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHAIN_ITERS = 2000  # x = x * 1.0001 + 0.0001: two aten ops per iteration
SIZES = [(4 << 10, "4 KB", 200), (1 << 20, "1 MB", 20), (64 << 20, "64 MB", 3)]


# ---------------------------------------------------------------------------- workloads

def chain(device: str, iters: int = CHAIN_ITERS) -> tuple[float, float, torch.Tensor, float]:
    """(client seconds until the last op is issued, seconds including the final sync, result,
    CPU seconds this process spent issuing them, all threads: not inflated by waiting for a CPU)."""
    x = torch.ones(64, 8, device=device)
    if device != "cpu":
        torch.cuda.synchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        x = x * 1.0001 + 0.0001
    t1, c1 = time.perf_counter(), time.process_time()
    if device != "cpu":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0, x, c1 - c0


def small_mlp(device: str, init_scale: float | None = 0.1):
    """The benchmark MLP (32-64-64-1, Adam, batch 256) on ``device``; returns its training step."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if init_scale is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * init_scale)
    x = torch.randn(256, 32, generator=g)
    y = x[:, :1].sin()
    model, x, y = model.to(device), x.to(device), y.to(device)
    return train_step(model, torch.optim.Adam(model.parameters(), lr=1e-3), x, y)


def small_transformer(device: str):
    """The benchmark's small transformer (2 encoder layers, d_model 64, 4 heads, feed-forward 256,
    batch 16 of 32 tokens, AdamW) on ``device``; returns its training step."""
    torch.manual_seed(0)  # the layers' initialisation: the same weights locally and remote
    layer = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                torch.nn.Linear(64, 1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, 64, generator=g)
    y = x.mean(-1, keepdim=True).sin()
    model, x, y = model.to(device), x.to(device), y.to(device)
    return train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), x, y)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    """One MSE training step on fixed data, as a function returning the loss."""
    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def train_steps(model: str, device: str, sync_every_step: bool = False) -> tuple[float, float]:
    """(seconds per step, final loss) of a benchmark model ("mlp" or "transformer") over its
    timed steps, after its warm-up steps."""
    make, warmup, steps, _ = MODELS[model]
    step = make(device)
    for _ in range(warmup):
        step()
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
        if sync_every_step:
            loss.item()
    final = loss.item()
    return (time.perf_counter() - t0) / steps, final


def step_times(model: str, device: str, repeats: int) -> dict:
    """A model's step: best of ``repeats`` runs without a read per step and with ``loss.item()``
    each step (ms), its final loss, and (remote) the ops a step sends."""
    import remotecuda
    train_steps(model, device)  # warm-up: first calls, caches
    counting = remotecuda.is_active()
    if counting:
        remotecuda.stats(reset=True)
    plain = min(train_steps(model, device)[0] for _ in range(repeats))
    ops = remotecuda.stats()["ops"] / repeats / (MODELS[model][1] + MODELS[model][2]) if counting else None
    item_runs = [train_steps(model, device, sync_every_step=True) for _ in range(repeats)]
    return {"ms": plain * 1e3, "item_ms": min(r[0] for r in item_runs) * 1e3, "loss": item_runs[0][1],
            "ops_per_step": ops}


#: model → (its step's maker, warm-up steps, timed steps, its row's label)
MODELS = {"mlp": (small_mlp, 10, 50, "MLP 32-64-64-1, Adam, batch 256"),
          "transformer": (small_transformer, 3, 15,
                          "Transformer encoder 2 layers, d 64, 4 heads, ff 256, AdamW, batch 16×32 tokens")}


def transfers(nbytes: int, reps: int) -> tuple[float, float]:
    """Median (upload seconds, download seconds) for one float32 tensor of nbytes, after one
    untimed warm-up (a session's first large transfers also pay for its buffers' first use)."""
    n = nbytes // 4
    up, down = [], []
    g = torch.Generator().manual_seed(nbytes)
    for i in range(reps + 1):
        t = torch.randn(n, generator=g)  # float noise: sent raw, like real weights
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = t.to("cuda")
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        back = r.cpu()
        t2 = time.perf_counter()
        if i == 0:
            assert torch.equal(back, t)
        else:
            up.append(t1 - t0)
            down.append(t2 - t1)
        del r
    return statistics.median(up), statistics.median(down)


class RawTCP:
    """The ceiling: plain Python sockets over loopback (sendall / recv_into, 1-byte ack for
    uploads), buffers allocated and touched once, so no page faults are timed."""

    def __init__(self, biggest: int):
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(1)
        threading.Thread(target=self._serve, args=(biggest,), daemon=True).start()
        self.c = socket.create_connection(self.srv.getsockname())
        self.c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.data = memoryview(os.urandom(biggest))
        self.rbuf = memoryview(bytearray(biggest))

    def _serve(self, biggest: int) -> None:
        conn, _ = self.srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(bytearray(biggest))
        while True:
            hdr = conn.recv(9, socket.MSG_WAITALL)
            if len(hdr) < 9:
                return
            op, n = hdr[:1], int.from_bytes(hdr[1:], "little")
            if op == b"U":  # client uploads n bytes
                got = 0
                while got < n:
                    got += conn.recv_into(view[got:n])
                conn.sendall(b"k")
            else:  # client downloads n bytes
                conn.sendall(view[:n])

    def up(self, nbytes: int) -> float:
        t0 = time.perf_counter()
        self.c.sendall(b"U" + nbytes.to_bytes(8, "little"))
        self.c.sendall(self.data[:nbytes])
        self.c.recv(1)
        return time.perf_counter() - t0

    def down(self, nbytes: int) -> float:
        t0 = time.perf_counter()
        self.c.sendall(b"D" + nbytes.to_bytes(8, "little"))
        got = 0
        while got < nbytes:
            got += self.c.recv_into(self.rbuf[got:nbytes])
        return time.perf_counter() - t0

    def close(self) -> None:
        self.c.close()
        self.srv.close()


def raw_socket_ceiling(sizes: list, reduce=statistics.median) -> dict:
    """Seconds (median of the runs, or ``reduce``) to move nbytes each way over loopback TCP."""
    raw = RawTCP(max(s for s, _, _ in sizes))
    out = {}
    for nbytes, _, reps in sizes:
        ups, downs = [], []
        for _ in range(max(reps, 5)):
            ups.append(raw.up(nbytes))
            downs.append(raw.down(nbytes))
        out[nbytes] = (reduce(ups), reduce(downs))
    raw.close()
    return out


# ---------------------------------------------------------------------------- machine

def machine() -> dict:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram = "unknown"
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
            ram = f"{kb / 2**20:.1f} GiB"
    except (OSError, StopIteration):
        pass
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip() or str(os.cpu_count())
    date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    import zmq
    return {"nproc": nproc, "cpu": model, "ram": ram, "torch": torch.__version__, "python": platform.python_version(),
            "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "date": date,
            "torch_threads": torch.get_num_threads()}


STARTUP_SCRIPT = "import sys, torch\nprint(torch.ones(3, device=sys.argv[1]).sum().item())\n"


def startup(address: str, repeats: int) -> tuple[float, float]:
    """Median wall time of ``python`` and of ``remotecuda run python`` for STARTUP_SCRIPT."""
    env = dict(os.environ, REMOTECUDA_SERVERS=address, REMOTECUDA_FALLBACK="error")
    rc = os.path.join(os.path.dirname(sys.executable), "remotecuda")
    times: dict[str, list] = {"cpu": [], "cuda": []}
    for _ in range(repeats):
        for dev, cmd in (("cpu", [sys.executable]), ("cuda", [rc, "run", "python"])):
            t = time.perf_counter()
            subprocess.run(cmd + ["-c", STARTUP_SCRIPT, dev], env=env, check=True, capture_output=True)
            times[dev].append(time.perf_counter() - t)
    return statistics.median(times["cpu"]), statistics.median(times["cuda"])


def start_gateway(spare: int = 0, host: str = "127.0.0.1") -> tuple[subprocess.Popen, str]:
    """A CPU gateway on a loopback address, a free port. ``spare=0``: the session's worker starts on demand
    and no further spare is started, so no ``import torch`` competes with the measurements."""
    p = subprocess.Popen([sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--host", host,
                          "--port", "0", "--no-discovery", "--quiet", "--spare", str(spare)], stdout=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, cwd=ROOT)
    line = p.stdout.readline()
    if not line.startswith("READY "):
        p.kill()
        raise SystemExit(f"the gateway did not start: {line!r}")
    return p, line.split()[1].replace("tcp://", "")


# ---------------------------------------------------------------------------- main

def mbps(nbytes: int, secs: float) -> float:
    return nbytes / secs / 1e6


def measure(quick: bool = False) -> dict:
    """Run every core measurement (starts and stops its own gateway); the figures as a dict."""
    repeats = 1 if quick else 3
    t_start = time.perf_counter()
    info = machine()
    load_before = os.getloadavg()

    # --- local CPU eager, before remotecuda is active: torch untouched
    chain("cpu", 200)
    chain_repeats = local_repeats = 2 * repeats + 1  # the minimum filters out other load
    local_runs = [chain("cpu") for _ in range(local_repeats)]
    local_chain, local_chain_cpu = min(r[0] for r in local_runs), min(r[3] for r in local_runs)
    chain_ref = chain("cpu")[2]
    local_steps = {m: step_times(m, "cpu", local_repeats) for m in MODELS}
    tcp = raw_socket_ceiling(SIZES)

    # --- remote
    gw, address = start_gateway()
    try:
        import remotecuda
        remotecuda.activate(address, fallback="error")
        chain("cuda", 200)
        runs = [chain("cuda") for _ in range(chain_repeats)]  # as many as locally
        remote_chain_client = min(r[0] for r in runs)
        remote_chain_total = min(r[1] for r in runs)
        remote_chain_cpu = min(r[3] for r in runs)
        assert torch.allclose(runs[0][2].cpu(), chain_ref)
        remote_steps = {m: step_times(m, "cuda", repeats) for m in MODELS}
        for m, r in remote_steps.items():
            local_loss = local_steps[m]["loss"]
            assert abs(r["loss"] - local_loss) <= 1e-4 * max(1.0, abs(local_loss)), (m, r["loss"], local_loss)
        xfer = {n: transfers(n, reps if not quick else min(reps, 3)) for n, _, reps in SIZES}
        stats = remotecuda.stats()
        remotecuda.deactivate()
        start_local, start_remote = startup(address, 5)
    finally:
        gw.terminate()
        try:
            gw.wait(timeout=20)
        except subprocess.TimeoutExpired:
            gw.kill()
    elapsed = time.perf_counter() - t_start
    load_after = os.getloadavg()
    info["load average (1 min) before / after"] = f"{load_before[0]:.2f} / {load_after[0]:.2f}"
    n_ops = 2 * CHAIN_ITERS
    return {
        "info": info, "repeats": repeats, "local_repeats": local_repeats, "elapsed_s": elapsed,
        "load_before": list(load_before), "load_after": list(load_after),
        "chain_ops": n_ops,
        "local_chain_us_per_op": local_chain / n_ops * 1e6,
        "remote_chain_client_us_per_op": remote_chain_client / n_ops * 1e6,
        "remote_chain_total_us_per_op": remote_chain_total / n_ops * 1e6,
        "local_chain_cpu_us_per_op": local_chain_cpu / n_ops * 1e6,
        "remote_chain_client_cpu_us_per_op": remote_chain_cpu / n_ops * 1e6,
        "local_steps": local_steps, "remote_steps": remote_steps,
        "transfers": [{"nbytes": n, "label": label, "up_s": xfer[n][0], "down_s": xfer[n][1],
                       "tcp_up_s": tcp[n][0], "tcp_down_s": tcp[n][1]} for n, label, _ in SIZES],
        "stats": {k: stats[k] for k in ("ops", "messages", "blocking_round_trips", "bytes_up", "bytes_down")},
        "startup_local_s": start_local, "startup_remote_s": start_remote,
    }


def _table(header: tuple, body: list) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(out)


def tables(r: dict) -> tuple[str, str]:
    """(per-op / training-step table, transfer table) in markdown."""
    rows = []
    rows.append((f"Elementwise chain, client cost per op (64x8 f32, {r['chain_ops']} ops, 1 sync)",
                 f"{r['local_chain_us_per_op']:.1f} µs/op", f"{r['remote_chain_client_us_per_op']:.1f} µs/op",
                 f"{r['remote_chain_client_us_per_op'] / r['local_chain_us_per_op']:.2f}x"))
    rows.append(("Elementwise chain, client CPU time per op (all client threads, `time.process_time`)",
                 f"{r['local_chain_cpu_us_per_op']:.1f} µs/op", f"{r['remote_chain_client_cpu_us_per_op']:.1f} µs/op",
                 f"{r['remote_chain_client_cpu_us_per_op'] / r['local_chain_cpu_us_per_op']:.2f}x"))
    rows.append(("Elementwise chain incl. final sync (gateway done)",
                 f"{r['local_chain_us_per_op']:.1f} µs/op", f"{r['remote_chain_total_us_per_op']:.1f} µs/op",
                 f"{r['remote_chain_total_us_per_op'] / r['local_chain_us_per_op']:.2f}x"))
    for m, (*_, label) in MODELS.items():
        loc, rem = r["local_steps"][m], r["remote_steps"][m]
        rows.append((f"{label} train step (sync at end)", f"{loc['ms']:.3f} ms", f"{rem['ms']:.3f} ms",
                     f"{rem['ms'] / loc['ms']:.2f}x"))
        rows.append((f"{label} train step with loss.item() every step", f"{loc['item_ms']:.3f} ms",
                     f"{rem['item_ms']:.3f} ms", f"{rem['item_ms'] / loc['item_ms']:.2f}x"))
    if "startup_local_s" in r:
        rows.append(("Start-up: `python` vs `remotecuda run python`, a script that imports torch and "
                     "makes one tensor (median of 5)", f"{r['startup_local_s']:.2f} s",
                     f"{r['startup_remote_s']:.2f} s", f"+{r['startup_remote_s'] - r['startup_local_s']:.2f} s"))
    xrows = []
    for x in r["transfers"]:
        n, up, down, tup, tdown = x["nbytes"], x["up_s"], x["down_s"], x["tcp_up_s"], x["tcp_down_s"]
        xrows.append((x["label"], f"{mbps(n, up):,.0f} MB/s ({up * 1e3:.2f} ms)",
                      f"{mbps(n, down):,.0f} MB/s ({down * 1e3:.2f} ms)",
                      f"{mbps(n, tup):,.0f} / {mbps(n, tdown):,.0f} MB/s",
                      f"{up / tup:.1f}x / {down / tdown:.1f}x"))
    t1 = _table(("benchmark", "local CPU eager", "remote (gateway --device cpu)", "remote / local"), rows)
    t2 = _table(("tensor (float32)", "upload (.to('cuda') + sync)", "download (.cpu())",
                 "raw loopback TCP up / down", "remote time / TCP time (up / down)"), xrows)
    return t1, t2


def markdown(r: dict, heading: str = "##") -> str:
    """The core figures as markdown sections (without the machine section)."""
    t1, t2 = tables(r)
    st = r["stats"]
    h = heading
    ops = "; ".join(f"{m} ~{r['remote_steps'][m]['ops_per_step']:.0f}" for m in MODELS)
    losses = "; ".join(f"{m} {r['local_steps'][m]['loss']:.6f} vs {r['remote_steps'][m]['loss']:.6f}" for m in MODELS)
    return f"""{h} Per-op cost and training step

{t1}

- client cost per op = time for the Python loop to issue the ops (they are queued and sent in
  batches without waiting); "incl. final sync" adds the wait until the gateway has executed all of them.
  The CPU-time row counts what the client process itself spent (its Python thread, flusher and ZeroMQ
  threads), which time spent waiting for a CPU held by the gateway's worker or other load does not inflate.
- ops sent to the gateway per step (forward, backward, optimizer; setup included): {ops}.
  Final losses, local vs remote: {losses}.
- best of {r['local_repeats']} runs each for the elementwise chain; the training rows best of {r['repeats']} runs
  remote and {r['local_repeats']} local ({MODELS['mlp'][2]} MLP steps, {MODELS['transformer'][2]} transformer
  steps per run, after warm-up steps).

{h} Transfers (core sizes)

{t2}

- medians after one untimed warm-up transfer; the raw TCP ceiling is plain Python sockets over loopback in the same run (sendall / recv_into,
  one-byte ack for uploads); remote transfers go through the client library and ZeroMQ straight to the
  session's worker process (the direct path), and include one blocking round trip.
- random float32 data: not compressible, sent raw.

Client counters over the remote part of the core run: ops {st['ops']}, messages {st['messages']},
blocking round trips {st['blocking_round_trips']}, bytes up {st['bytes_up']:,}, bytes down {st['bytes_down']:,}.
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    ap.add_argument("--no-write", action="store_true", help="do not write RESULTS.md")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON (benchmarks/run_all.py)")
    a = ap.parse_args()
    r = measure(quick=a.quick)
    info = r["info"]
    t1, t2 = tables(r)
    machine_lines = "\n".join(f"- {k}: {v}" for k, v in info.items())
    report = f"""# RemoteCUDA core benchmarks

Produced by `python benchmarks/bench_core.py` (one run; gateway and client on the same machine,
over 127.0.0.1; the gateway runs aten ops on the CPU, `--device cpu`). Total benchmark time {r['elapsed_s']:.0f} s.
Client, gateway supervisor and session worker share the machine's CPUs; other work running at the
same time (see the load average) inflates every figure, the remote ones most.
(`python benchmarks/run_all.py` writes the full report, with the transfer suite.)

## Machine

{machine_lines}

{markdown(r)}"""
    print(f"\nmachine: {info['cpu']}, {info['nproc']} CPUs, {info['ram']}, torch {info['torch']}, {info['date']}\n")
    print(t1)
    print()
    print(t2)
    print(f"\ntotal {r['elapsed_s']:.0f} s")
    if a.json:
        import json
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    if not a.no_write:
        with open(os.path.join(HERE, "RESULTS.md"), "w") as f:
            f.write(report)
        print(f"wrote {os.path.join(HERE, 'RESULTS.md')}")


if __name__ == "__main__":
    main()
