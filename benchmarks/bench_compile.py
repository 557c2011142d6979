"""A compiled training step through a gateway: client instructions per (eager) op, and step times.

``torch.compile`` while active runs the model's forward as one gateway op and its backward as
one more (remotecuda/compiled.py), where eager code sends every aten op. This counts, under
valgrind's callgrind (counting only around the measured steps, so load-independent), the
client's instructions for the same training step (forward, cross-entropy, backward, SGD step)
run (a) locally eagerly, (b) through a gateway eagerly, (c) through a gateway compiled and (d)
through a gateway eagerly with step replay on (``activate(replay=True)``: no torch.compile in the
code; remotecuda/step_replay.py traces the model's repeated calls itself), for
an MLP and a small transformer encoder, and divides each by the number of aten ops the eager
step runs locally: the work per op the issue's target is stated in. It also reports
wall-clock step times (best of 20; a shared machine scatters them).

    python benchmarks/bench_compile.py [--steps 5] [--json PATH]
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r'''
import gc, os, subprocess, sys, time, json, torch, torch.nn as nn, torch.nn.functional as F
steps, server, how, which = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
torch.manual_seed(0)
if which == "mlp":
    layers = []
    for _ in range(8):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(64, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
else:
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
            self.enc, self.head = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(64, 10)
        def forward(self, x):
            return self.head(self.enc(x).mean(1))
    model = Net()
    x, y = torch.randn(8, 16, 64), torch.randint(0, 10, (8,))
if server != "local":
    import remotecuda
    remotecuda.activate(server, fallback="error", replay=how == "replayed")
    model, x, y = model.cuda(), x.cuda(), y.cuda()
run = torch.compile(model) if how == "compiled" else model
opt = torch.optim.SGD(model.parameters(), lr=0.01)
def step():
    opt.zero_grad()
    loss = F.cross_entropy(run(x), y)
    loss.backward()
    opt.step()
    return loss
for _ in range(3):
    step().item()
gc.collect()  # (the warm-up's garbage, a trace's above all, is not the measured steps' cost)
ops = None
if server == "local":
    from torch.utils._python_dispatch import TorchDispatchMode
    class Count(TorchDispatchMode):
        n = 0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with Count():
        step()
    ops = Count.n
best = float("inf")
if os.environ.get("BENCH_WALL"):
    for _ in range(20):
        t = time.perf_counter()
        step().item()
        best = min(best, time.perf_counter() - t)
else:
    subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], capture_output=True)
    for _ in range(steps):
        loss = step()
    subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], capture_output=True)
    loss.item()
print("RESULT " + json.dumps({"ops": ops, "best_step_s": best}))
'''

CASES = (("local", "eager"), ("remote", "eager"), ("remote", "compiled"), ("remote", "replayed"))
#: an MLP (17 layers, 34 parameters) and a 2-layer transformer encoder (more ops per parameter)
MODELS = ("mlp", "transformer")


def _child(steps: int, server: str, how: str, model: str, wall: bool) -> tuple[dict, int | None, int | None]:
    """The child's result, its instructions (all threads) and its main thread's: the pool's and
    ZeroMQ's threads wake by the clock, so their share moves from run to run; the main thread's
    does not."""
    env = dict(os.environ, **({"BENCH_WALL": "1"} if wall else {}))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        cmd = [sys.executable, "-c", CHILD, str(steps), server, how, model]
        if not wall:
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                   f"--callgrind-out-file={out}", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600, env=env)
        got = re.search(r"^RESULT (.*)$", r.stdout, re.M)
        if got is None:
            raise RuntimeError(f"{server} {how} failed:\n{r.stderr[-3000:]}")
        m = re.search(r"Collected : (\d+)", r.stderr)
        main = None
        if os.path.exists(out + "-01"):  # (thread 1: the main thread)
            with open(out + "-01") as f:
                t = re.search(r"^totals: (\d+)", f.read(), re.M)
            main = int(t.group(1)) if t else None
        return json.loads(got.group(1)), (int(m.group(1)) if m else None), main


def measure(steps: int = 5) -> dict:
    if shutil.which("valgrind") is None:
        return {"skipped": "valgrind is not installed"}
    gw = subprocess.Popen([sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
                           "--no-discovery", "--quiet", "--spare", "1"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    out: dict = {"steps": steps}
    try:
        server = gw.stdout.readline().split()[1].replace("tcp://", "")
        for model in MODELS:
            out[model] = _model(steps, server, model)
    finally:
        gw.terminate()
        gw.wait(timeout=30)
    return out


def _model(steps: int, server: str, model: str) -> dict:
    out: dict = {}
    for where, how in CASES:
        at = "local" if where == "local" else server
        info, instr, main = _child(steps, at, how, model, wall=False)
        if info["ops"] is not None:
            out["eager_ops_per_step"] = info["ops"]
        out[f"{where}_{how}_instructions_per_step"] = round(instr / steps) if instr else None
        out[f"{where}_{how}_main_thread_instructions_per_step"] = round(main / steps) if main else None
        wall, _, _ = _child(steps, at, how, model, wall=True)
        out[f"{where}_{how}_best_step_ms"] = wall["best_step_s"] * 1e3
    n = out["eager_ops_per_step"]
    for where, how in CASES:
        out[f"{where}_{how}_instructions_per_op"] = round(out[f"{where}_{how}_instructions_per_step"] / n)
    for how in ("compiled", "replayed"):
        out[f"remote_eager_over_{how}"] = (out["remote_eager_instructions_per_step"]
                                           / out[f"remote_{how}_instructions_per_step"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="write the figures to PATH as JSON")
    a = p.parse_args()
    r = measure(a.steps)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f)
    for model in MODELS:
        for k, v in r.get(model, {}).items():
            print(f"{model:12s} {k:50s} {v:.3f}" if isinstance(v, float) else f"{model:12s} {k:50s} {v:,}"
                  if isinstance(v, int) else f"{model:12s} {k:50s} {v}")
    if "skipped" in r:
        print(r["skipped"])


if __name__ == "__main__":
    main()
