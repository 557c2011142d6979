"""Client cost per op in CPU instructions (valgrind/callgrind), immune to a busy machine.

Wall-clock µs/op on a shared 2-core machine swings by 2-5x with what else runs; the
number of instructions the client executes per op does not. This runs the same chain of
small elementwise ops locally and through a gateway under callgrind, counting only the
chain (``callgrind_control -i on/off`` around it), and reports instructions per op, the
ratio, and that ratio applied to the local µs/op measured in this run (min of 5). A third run
(the floor) counts a tensor subclass whose ``__torch_dispatch__`` only makes each op's output
wrapper: what any per-op interception costs before doing any work of its own.

    python benchmarks/bench_instructions.py [--ops 2000] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r'''
import os, subprocess, sys, torch
n, server = int(sys.argv[1]), sys.argv[2]
class Floor(torch.Tensor):
    """The least any __torch_dispatch__ interception costs: a new output wrapper per op, no other work."""
    @staticmethod
    def __new__(cls, shape, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype)
    __torch_function__ = torch._C._disabled_torch_function_impl
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return Floor(args[0].shape, args[0].dtype)
def chain(x):
    for _ in range(n // 2):
        x = x * 1.0001 + 0.0001
    return x
def read(y):
    return None if server == "floor" else y.sum().item()
x = torch.randn(64, 8)
if server == "floor":
    x = Floor((64, 8), torch.float32)
elif server != "local":
    import remotecuda
    remotecuda.activate(server, fallback="error")
    x = x.cuda()
for _ in range(2):
    read(chain(x))
subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], capture_output=True)
y = chain(x)
subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], capture_output=True)
read(y)
'''


def _instructions(n: int, server: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        r = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                            f"--callgrind-out-file={out}", sys.executable, "-c", CHILD, str(n), server],
                           capture_output=True, text=True, cwd=ROOT, timeout=1800)
        m = re.search(r"Collected : (\d+)", r.stderr)
        if not m:
            raise RuntimeError(f"callgrind gave no count:\n{r.stderr[-2000:]}")
        return int(m.group(1))


def _local_us_per_op(n: int) -> float:
    import torch
    x = torch.randn(64, 8)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        y = x
        for _ in range(n // 2):
            y = y * 1.0001 + 0.0001
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def measure(n: int = 2000) -> dict:
    if shutil.which("valgrind") is None:
        return {"skipped": "valgrind is not installed"}
    gw = subprocess.Popen([sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
                           "--no-discovery", "--quiet", "--spare", "1"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        server = gw.stdout.readline().split()[1].replace("tcp://", "")
        local = _instructions(n, "local") / n
        floor = _instructions(n, "floor") / n
        remote = _instructions(n, server) / n
    finally:
        gw.terminate()
        gw.wait(timeout=30)
    us = _local_us_per_op(n)
    return {"ops": n, "local_instructions_per_op": round(local), "remote_instructions_per_op": round(remote),
            "floor_instructions_per_op": round(floor), "ratio": remote / local, "local_us_per_op": us, "remote_us_per_op_equivalent": us * remote / local}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--json", metavar="PATH", help="write the figures to PATH as JSON")
    p.add_argument("--quick", action="store_true", help="fewer ops")
    a = p.parse_args()
    r = measure(500 if a.quick else a.ops)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f)
    for k, v in r.items():
        print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")


if __name__ == "__main__":
    main()
