"""Liveness: how soon a gateway that stops answering is marked down, and what watching costs.

    python benchmarks/bench_liveness.py [--quick] [--json OUT] [--write]

Real gateways (``remotecuda start --device cpu``) on 127.0.0.1; the client is a session per
gateway and a ``remotecuda.liveness.Liveness`` in this process, as a pool has them. Each
repetition opens a session, lets the heartbeats run for a random part of a second past 2 s (so
the signal lands anywhere in the ping interval), then sends the gateway's supervisor and workers
SIGKILL (the TCP connections close) or SIGSTOP (the connections stay open, nothing answers), and
a thread blocks in a request on that session. Measured: from the signal to the session being marked lost, and to the
blocked request raising. Also: the round trips liveness measures, and its thread's CPU per second
while watching several gateways (no gateway marked down meanwhile: no false alarm).

``--write`` appends (or replaces) its section in benchmarks/RESULTS.md.
"""
from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import results_md  # noqa: E402

sys.path.insert(0, ROOT)
import zmq  # noqa: E402

SECTION = "# Part 8: liveness (benchmarks/bench_liveness.py)"


class Gateway:
    """A ``remotecuda start --device cpu`` process on a free loopback port."""

    def __init__(self) -> None:
        cmd = [sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0", "--no-discovery",
               "--quiet"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=ROOT)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"gateway did not start: {line!r}")
        self.endpoint = line.split()[1]

    def tree(self) -> list[psutil.Process]:
        p = psutil.Process(self.proc.pid)
        return [p, *p.children(recursive=True)]

    def end(self) -> None:
        for p in self.tree() if self.proc.poll() is None else []:
            try:
                p.kill()
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=20)


def detect(ctx: zmq.Context, gw: Gateway, how: str) -> dict:
    """One repetition: seconds from the signal to the session marked lost and to a blocked request raising."""
    from remotecuda.errors import GatewayUnavailableError
    from remotecuda.liveness import PING_EVERY, Liveness
    from remotecuda.session import Session
    s = Session(ctx, gw.endpoint, 0, 0, connect_timeout=120)
    live = Liveness(ctx, lambda: [s]).start()
    try:
        time.sleep(2 + random.random() * PING_EVERY)
        rtt = live.rtt_ms(gw.endpoint)
        raised: list[float] = []
        outcome: list[str] = []

        def blocked() -> None:
            try:
                s.request("rc::sync", [])
                outcome.append("answered")
            except GatewayUnavailableError:
                raised.append(time.monotonic())
                outcome.append("GatewayDownError")
            except Exception as e:
                outcome.append(type(e).__name__)

        procs = gw.tree()  # the supervisor and its workers: nothing of the gateway answers the request
        t0 = time.monotonic()
        for p in procs:
            p.send_signal(signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        waiter = threading.Thread(target=blocked)
        waiter.start()
        while s.lost is None and time.monotonic() - t0 < 30:
            time.sleep(0.005)
        marked = time.monotonic() - t0
        waiter.join(timeout=30)
        return {"marked_s": marked, "raised_s": raised[0] - t0 if raised else None, "rtt_ms": rtt,
                "outcome": outcome[0] if outcome else "still blocked"}
    finally:
        live.close()
        s.close()


def watch_cost(ctx: zmq.Context, gws: list[Gateway], seconds: float) -> dict:
    """Liveness watching ``gws`` (a session on each) for ``seconds``: its thread's CPU per second,
    the round trips it measured, and how many gateways it marked down (none answer late here)."""
    from remotecuda.liveness import Liveness
    from remotecuda.session import Session
    sessions = [Session(ctx, g.endpoint, 0, i, connect_timeout=120) for i, g in enumerate(gws)]
    live = Liveness(ctx, lambda: sessions).start()
    try:
        time.sleep(1.5)
        nid = next(t.native_id for t in threading.enumerate() if t.name == "remotecuda-liveness")

        def cpu() -> float:  # the thread's time on a CPU, in ns (psutil's counts 10 ms ticks)
            with open(f"/proc/self/task/{nid}/schedstat") as f:
                return int(f.read().split()[0]) / 1e9
        c0, t0 = cpu(), time.monotonic()
        time.sleep(seconds)
        per_s = (cpu() - c0) / (time.monotonic() - t0)
        rtts = [live.rtt_ms(g.endpoint) for g in gws]
        return {"gateways": len(gws), "seconds": seconds, "thread_cpu_ms_per_s": per_s * 1e3,
                "rtt_ms": [r for r in rtts if r is not None],
                "marked_down": sum(live.down(g.endpoint) is not None for g in gws)}
    finally:
        live.close()
        for s in sessions:
            s.close()


def summary(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def run(quick: bool) -> dict:
    """(The client's modules, which import torch, are imported where used: run_all.py imports this
    file for ``markdown`` only.)"""
    from remotecuda.liveness import DOWN_AFTER, PING_EVERY
    reps = 2 if quick else 5
    load0 = os.getloadavg()
    with ThreadPoolExecutor(reps + 1) as ex:  # a gateway per kill, and one the freezes share
        gws = list(ex.map(lambda _: Gateway(), range(reps + 1)))
    ctx = zmq.Context()
    r: dict = {"reps": reps, "down_after_s": DOWN_AFTER, "ping_every_s": PING_EVERY}
    try:
        r["watch"] = watch_cost(ctx, gws, 5 if quick else 10)
        stopped = gws[0]
        r["stop"] = []
        for _ in range(reps):
            r["stop"].append(detect(ctx, stopped, "stop"))
            for p in stopped.tree():
                p.send_signal(signal.SIGCONT)
        r["kill"] = [detect(ctx, g, "kill") for g in gws[1:]]
    finally:
        for g in gws:
            g.end()
        ctx.term()
    r["load"] = {"before": load0, "after": os.getloadavg()}
    r["date"] = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    with open("/proc/cpuinfo") as f:
        r["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    return r


def markdown(r: dict) -> str:
    def row(name: str, key: str) -> str:
        m = summary([x["marked_s"] for x in r[key]])
        raised = [x["raised_s"] for x in r[key] if x["raised_s"] is not None]
        w = summary(raised) if raised else None
        woke = f"{w['min']:.2f} / {w['median']:.2f} / {w['max']:.2f}" if w else "never"
        other = [x["outcome"] for x in r[key] if x["outcome"] != "GatewayDownError"]
        return (f"| {name} | {m['n']} | {m['min']:.2f} / {m['median']:.2f} / {m['max']:.2f} | {woke} "
                f"({len(raised)} of {m['n']}{'; else: ' + ', '.join(other) if other else ''}) |")
    w = r["watch"]
    rtts = w["rtt_ms"]
    rtt = f"{min(rtts):.2f}–{max(rtts):.2f} ms" if rtts else "none measured"
    lb, la = r["load"]["before"], r["load"]["after"]
    return f"""Real gateways (`--device cpu`) on 127.0.0.1, a session on each and `remotecuda.liveness.Liveness`
in the benchmark's process, as a pool has them: a PING every {r['ping_every_s']:.0f} s per gateway, down after
{r['down_after_s']:.0f} s without an answer. Each repetition lets the heartbeats run 2-3 s (the signal lands
anywhere in the ping interval), then sends the gateway's supervisor and workers SIGKILL (the TCP connections
close) or SIGSTOP (the connections stay open and nothing answers), while a thread blocks in a request on that
session. Measured on {r['date']} ({r['cpu']}, {os.cpu_count()} CPUs; load average {lb[0]:.2f} before,
{la[0]:.2f} after; the machine is shared). Seconds from the signal, min / median / max:

| gateway | repetitions | session marked lost | blocked request raised `GatewayDownError` |
| --- | --- | --- | --- |
{row("killed (`kill -9`)", "kill")}
{row("frozen (`SIGSTOP`)", "stop")}

Watching {w['gateways']} gateways for {w['seconds']:.0f} s: the liveness thread used {w['thread_cpu_ms_per_s']:.2f} ms
of CPU per second, round trips (median of the last 7 PONGs) {rtt}, gateways marked down meanwhile: {w['marked_down']}.

Reading: a gateway is marked down {r['down_after_s']:.0f} s after its last answer, so 2-3 s after it stops (where the
signal falls between two pings), killed or frozen alike: a frozen gateway's open connection changes nothing,
since the verdict is the missing PONG, not the socket. A request blocked on it wakes within its 0.1 s poll of
being marked. Watching costs a PING and a PONG per gateway per second on the thread, nothing per op.
"""



if __name__ == "__main__":
    results_md.main(SECTION, run, markdown, "2 repetitions each instead of 5")
