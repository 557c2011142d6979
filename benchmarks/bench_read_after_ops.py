"""What a value read costs the client when ops are queued before it (``loss.item()`` after a step),
against the READ that a read with nothing queued takes (remotecuda_wire/fastread.py): instructions of
the client's main thread (valgrind/callgrind, ``--separate-threads=yes``), counted only inside
``callgrind_control -i on/off`` windows, so the figures do not depend on the machine's load.

    python benchmarks/bench_read_after_ops.py [--steps 50] [--reads 100]

Modes, each in a process of its own against one CPU gateway on loopback, per iteration:

- ``step``: a training step of a small MLP (zero_grad, forward, MSE, backward, SGD) and
  ``loss.item()``: the read goes with the step's queued ops, answered by the general REPLY;
- ``step_noread``: the same steps without the read (the pool's background thread sends the ops:
  its encoding is not in the main thread's count, which is why ``step - step_noread`` is an upper
  bound of the read's share, OPS encoding included);
- ``sum_item``: ``x.sum().item()``, one op queued before the read;
- ``empty``: the window alone (what switching the count on and off costs), taken off the others;
- ``idle_general`` / ``idle_fast``: ``x.item()`` with nothing queued, by the general path (the
  session's READ offer ignored) and as a READ. Their difference bounds what carrying a read in the
  OPS message and answering it with a VALUE could save: such a read still pays the OPS message
  it goes with, and saves at most the general wait, REPLY decoding and result handling.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_core import start_gateway  # noqa: E402

MODES = ("empty", "step", "step_noread", "sum_item", "idle_general", "idle_fast")

CHILD = r'''
import os, subprocess, sys, torch
import remotecuda, remotecuda.session
mode, server, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
remotecuda.session.DIRECT_TIMEOUT = 120.0  # (the direct path's greeting, slow under valgrind)
remotecuda.activate(server, fallback="error")
torch.manual_seed(0)
def counting(on):
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())], capture_output=True)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 16).cuda(), torch.randn(8, 1).cuda()
def step():
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss
for _ in range(5):
    step().item()
loss = step()
loss.item()
x._s.fast_read = x._s.fast_read and mode != "idle_general"
remotecuda.stats(reset=True)
counting(True)
for _ in range(n):
    if mode == "step":
        step().item()
    elif mode == "step_noread":
        loss = step()
    elif mode == "empty":
        break
    elif mode == "sum_item":
        x.sum().item()
    else:
        loss.item()
counting(False)
loss.item()
st = remotecuda.stats()
print("STATS", st["blocking_round_trips"], st["fast_reads"], file=sys.stderr)
'''


def _instructions(mode: str, n: int, server: str) -> tuple[int, int, int]:
    """The client main thread's instructions in the window, its blocking round trips and fast reads."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        r = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                            f"--callgrind-out-file={out}", sys.executable, "-c", CHILD, mode, server, str(n)],
                           capture_output=True, text=True, cwd=ROOT, timeout=1800)
        stats = re.search(r"STATS (\d+) (\d+)", r.stderr)
        main = glob.glob(out + "-01")
        if not stats or not main:
            raise RuntimeError(f"callgrind gave no count:\n{r.stderr[-2000:]}")
        with open(main[0]) as f:
            total = re.search(r"^totals: (\d+)", f.read(), re.M)
        if total is None:
            raise RuntimeError(f"no totals in {main[0]}")
        return int(total.group(1)), int(stats.group(1)), int(stats.group(2))


def measure(steps: int = 50, reads: int = 100) -> dict:
    if shutil.which("valgrind") is None:
        return {"skipped": "valgrind is not installed"}
    gw, server = start_gateway()
    try:
        window = _instructions("empty", 1, server)[0]  # (the switches' own cost: callgrind_control's run)
        res = {}
        for mode in MODES[1:]:
            n = steps if mode.startswith("step") else reads
            total, trips, fast = _instructions(mode, n, server)
            res[mode] = {"instructions": round((total - window) / n), "round_trips": trips, "fast_reads": fast,
                         "n": n}
    finally:
        gw.terminate()
        gw.wait(timeout=30)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--reads", type=int, default=100)
    a = p.parse_args()
    for mode, r in measure(a.steps, a.reads).items():
        print(f"{mode:14s} {r}")


if __name__ == "__main__":
    main()
