"""What a value read costs: ``x.item()`` and ``torch.cuda.synchronize()`` through a CPU gateway on
loopback, side by side with a bare ZeroMQ echo (DEALER → ROUTER in another process, the same
transport with no work) in one run.

    python benchmarks/bench_sync.py [--quick] [--json OUT] [--write]

Rounds alternate between the three so that the machine's load falls on each alike; the figures
are medians of per-call times in microseconds.
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results_md  # noqa: E402
from bench_core import start_gateway  # noqa: E402

SECTION = "# Part 11: the cost of a value read (benchmarks/bench_sync.py)"
ECHO = """
import sys, zmq
s = zmq.Context().socket(zmq.ROUTER)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    s.send_multipart(s.recv_multipart())
"""


def _timed(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return times


def run(quick: bool) -> dict:
    import torch
    import zmq

    import remotecuda
    echo = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    proc, address = start_gateway()
    try:
        port = int(echo.stdout.readline()) if echo.stdout else 0
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        payload = b"x" * 64

        def ping() -> None:
            dealer.send(payload)
            dealer.recv()
        remotecuda.activate(servers=[address], fallback="error")
        x = torch.ones(1, device="cuda")
        x.item()
        n, rounds = (200, 3) if quick else (1000, 7)
        samples: dict[str, list[float]] = {"echo": [], "item": [], "synchronize": []}
        for _ in range(rounds):
            samples["echo"] += _timed(ping, n)
            samples["item"] += _timed(x.item, n)
            samples["synchronize"] += _timed(torch.cuda.synchronize, n)
        remotecuda.deactivate()
    finally:
        proc.terminate()
        echo.kill()
        proc.wait()
    r: dict = {k: statistics.median(v) for k, v in samples.items()}
    r["p90"] = {k: statistics.quantiles(v, n=10)[-1] for k, v in samples.items()}
    r["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    r["date"] = time.strftime("%Y-%m-%d")
    r["n"], r["rounds"] = n, rounds
    return r


def markdown(r: dict) -> str:
    e = r["echo"]
    rows = "".join(f"| {name} | {r[key]:.0f} µs | {r['p90'][key]:.0f} µs | {r[key] / e:.1f}× |\n"
                   for name, key in (("bare ZeroMQ echo (64 B)", "echo"), ("`x.item()`", "item"),
                                     ("`torch.cuda.synchronize()`", "synchronize")))
    return (f"{r['date']}, {r['machine']}; a CPU gateway on loopback; {r['rounds']} alternating rounds of "
            f"{r['n']} calls each.\n\n| call | median | p90 | vs echo |\n|---|---|---|---|\n{rows}\n"
            "A read with nothing queued or unanswered goes as a READ message (remotecuda_wire/fastread.py), "
            "answered with a VALUE by the worker's I/O thread; `synchronize()` with nothing sent since the "
            "last reply is answered without a round trip.\n")


if __name__ == "__main__":
    results_md.main(SECTION, run, markdown, "200 calls × 3 rounds instead of 1000 × 7")
