"""What a CUDA graph saves: one training step of a small MLP through a CPU gateway, eager (every
op streamed) against ``g.replay()`` of the same step captured once, in one run.

    python benchmarks/bench_graphs.py [--quick] [--json OUT] [--write]

Per step: wall time, the client's CPU time (what the laptop spends issuing the step), and the
ops it sends. Eager and replayed steps alternate in rounds so that the machine's load falls on
both alike; each round ends with a value read, so queued work is counted in the round's time.
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results_md  # noqa: E402
from bench_core import start_gateway  # noqa: E402

SECTION = "# Part 10: CUDA graphs (benchmarks/bench_graphs.py)"


def run(quick: bool) -> dict:
    import torch
    from torch import nn

    import remotecuda
    proc, address = start_gateway()
    try:
        remotecuda.activate(servers=[address], fallback="error")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                              nn.Linear(256, 10)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")

        def eager() -> None:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        for _ in range(3):
            eager()
        g = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(g):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        steps, rounds = (20, 3) if quick else (100, 7)
        figures: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": [], "ops": []} for k in ("eager", "graph")}
        for _ in range(rounds):
            for kind, step in (("eager", eager), ("graph", g.replay)):
                ops0 = remotecuda.stats()["ops"]
                w, c = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    step()
                model[0].weight[0, 0].item()
                f = figures[kind]
                f["wall"].append((time.perf_counter() - w) / steps * 1e3)
                f["cpu"].append((time.process_time() - c) / steps * 1e3)
                f["ops"].append((remotecuda.stats()["ops"] - ops0) / steps)
        remotecuda.deactivate()
    finally:
        proc.terminate()
        proc.wait()
    r = {k: {m: statistics.median(v) for m, v in f.items()} for k, f in figures.items()}
    r["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    r["date"] = time.strftime("%Y-%m-%d")
    r["steps"], r["rounds"] = steps, rounds
    return r


def markdown(r: dict) -> str:
    e, g = r["eager"], r["graph"]
    return (f"{r['date']}, {r['machine']}; a CPU gateway on loopback; an MLP 64-256-256-10, batch 32, SGD "
            f"with momentum; medians of {r['rounds']} alternating rounds of {r['steps']} steps.\n\n"
            "| per training step | eager (ops streamed) | `g.replay()` | ratio |\n|---|---|---|---|\n"
            f"| wall time | {e['wall']:.2f} ms | {g['wall']:.2f} ms | {e['wall'] / g['wall']:.1f}× |\n"
            f"| client CPU time | {e['cpu']:.2f} ms | {g['cpu']:.3f} ms | {e['cpu'] / g['cpu']:.0f}× |\n"
            f"| ops sent (incl. reads) | {e['ops']:.1f} | {g['ops']:.2f} | |\n\n"
            "A replay is one `rc::graph_replay` op: the client no longer issues the step's ops, so its "
            "CPU time per step falls to almost nothing; the gateway runs the same ops (a recorded "
            "sequence on a CPU gateway, remotecuda_server/graphs.py), so wall time falls by the "
            "client's share of the step.\n")


if __name__ == "__main__":
    results_md.main(SECTION, run, markdown, "20 steps × 3 rounds instead of 100 × 7")
