"""Copies between two gateways: worker to worker vs through the client, measured in one run.

    python benchmarks/bench_cross_gateway.py [--sizes-mb 1,16,64] [--reps 3] [--json PATH]

Starts two gateways (``remotecuda start --device cpu --spare 0`` on 127.0.0.1) as cuda:0 and
cuda:1, and times ``y = x.to('cuda:1'); remotecuda.synchronize()`` for float32 tensors of each size, with the
copy pulled by cuda:1's worker from cuda:0's (the default) and, for comparison, with cuda:0's
data port hidden from the copy so that it goes down to the client and up again (what a session
whose client cannot reach the worker's data port does). Also reports the client's bytes per copy.
On one machine both paths cross loopback; between machines the pull also saves the client's link.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MB = 1 << 20


def start_gateway() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
                             "--spare", "0", "--no-discovery", "--quiet"],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=ROOT)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"gateway did not start: {line!r}")
    return proc, line.split()[1].removeprefix("tcp://")


def time_copies(x: torch.Tensor, reps: int) -> tuple[float, float]:
    """Median seconds per copy, and the client's bytes per copy (new values each time: the upload
    cache would otherwise spare the through-the-client path its upload)."""
    import remotecuda
    times, nbytes = [], 0
    for _ in range(reps):
        x.add_(1)
        remotecuda.synchronize()
        remotecuda.stats(reset=True)
        t0 = time.perf_counter()
        y = x.to("cuda:1")
        remotecuda.synchronize()
        times.append(time.perf_counter() - t0)
        del y  # (its gateway memory is used again by the next copy)
        st = remotecuda.stats()
        nbytes += st["bytes_up"] + st["bytes_down"]
    return statistics.median(times), nbytes / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="1,16,64")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    gateways = [start_gateway() for _ in range(2)]
    import remotecuda
    rows = []
    try:
        remotecuda.activate([addr for _, addr in gateways], fallback="error")
        torch.zeros(1, device="cuda:1").item()  # both sessions open before timing
        for mb in (float(s) for s in a.sizes_mb.split(",")):
            x = torch.randn(int(mb * MB) // 4).cuda(0)
            x[:1].item()
            pulled, pulled_bytes = time_copies(x, a.reps)
            src = x._s
            endpoint, src.data_endpoint = src.data_endpoint, None  # the copy then goes through the client
            try:
                client, client_bytes = time_copies(x, a.reps)
            finally:
                src.data_endpoint = endpoint
            rows.append({"mb": mb, "pulled_s": pulled, "pulled_client_bytes": pulled_bytes,
                         "through_client_s": client, "through_client_bytes": client_bytes})
            print(f"{mb:7.1f} MB  worker to worker {pulled * 1000:8.1f} ms ({pulled_bytes / 1024:7.1f} KiB via the "
                  f"client)  through the client {client * 1000:8.1f} ms ({client_bytes / MB:7.1f} MiB)", flush=True)
    finally:
        remotecuda.deactivate()
        for proc, _ in gateways:
            proc.terminate()
            proc.wait(timeout=20)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
