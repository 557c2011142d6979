"""Placement cost: how long the scheduler takes to place a session in a large pool.

    python benchmarks/bench_placement.py [--quick] [--json OUT] [--write]

Builds a simulated pool of 200 gateways with 4-8 GPUs each (mixed models, sizes, capabilities,
loads and round trips; a fixed seed), then times 1,000 placements per strategy, each followed by
the client counting the session as placed (as the pool does until the gateway reports it; not
timed), and placements of 4 devices. Also: the cost of turning the gateways' reports into
``GpuState`` (once per placement if the pool converts on demand), how the decision time grows
with the pool, and the size of a beacon carrying 4 or 8 GPUs (for the traffic estimate in
docs/POOL.md). No gateway, no network, no torch: ``remotecuda.scheduler`` is pure.

``--write`` appends (or replaces) its section in benchmarks/RESULTS.md.
"""
from __future__ import annotations

import os
import platform
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results_md  # noqa: E402

sys.path.insert(0, os.path.dirname(HERE))
from remotecuda.scheduler import STRATEGIES, GpuState, SessionProfile, place  # noqa: E402
from remotecuda_wire import beacon  # noqa: E402

SECTION = "# Part 7: placement at scale (benchmarks/bench_placement.py)"
GiB = 1 << 30
#: (name, memory GiB, capability, bf16): the GPU models the simulated pool mixes
MODELS = [("NVIDIA H100 80GB HBM3", 80, (9, 0), True), ("NVIDIA A100-SXM4-80GB", 80, (8, 0), True),
          ("NVIDIA A100-SXM4-40GB", 40, (8, 0), True), ("NVIDIA A10", 24, (8, 6), True),
          ("NVIDIA L4", 24, (8, 9), True), ("NVIDIA GeForce RTX 4090", 24, (8, 9), True),
          ("Tesla V100-SXM2-32GB", 32, (7, 0), False), ("Tesla T4", 16, (7, 5), False)]
#: what adaptive is given in turn: before any op, a large model, a sync-heavy loop, a bf16 session
PROFILES = [SessionProfile(), SessionProfile(allocated_bytes=8 * GiB, ops=200, syncs=1),
            SessionProfile(allocated_bytes=64 << 20, ops=12, syncs=4),
            SessionProfile(allocated_bytes=256 << 20, ops=100, dtypes=frozenset({"bfloat16"}))]


def reports(gateways: int, seed: int = 0) -> list[tuple[str, str, list[dict], float | None]]:
    """What the client would know of ``gateways`` gateways: (id, address, gpus as reported, rtt)."""
    rnd = random.Random(seed)
    out = []
    for k in range(gateways):
        name, mem, cap, bf16 = rnd.choice(MODELS)
        gpus = []
        for i in range(rnd.randint(4, 8)):
            total = mem * GiB
            gpus.append({"index": i, "name": name, "kind": "cuda", "simulated": rnd.random() < 0.1,
                         "capability": list(cap), "bf16": bf16, "total_memory": total,
                         "free_memory": int(total * rnd.random()), "utilization": round(rnd.random(), 2),
                         "queued": rnd.choice([0, 0, 0, rnd.randint(1, 2000)]), "sessions": rnd.randint(0, 4),
                         "latency_ms": round(rnd.uniform(0.02, 2.0), 3)})
        rtt = None if rnd.random() < 0.1 else round(rnd.uniform(0.1, 5.0), 3)
        out.append((f"{k:08x}", f"tcp://10.{k // 250}.{k % 250}.1:55555", gpus, rtt))
    return out


def pool_of(reps: list) -> list[GpuState]:
    return [GpuState.from_report(gid, addr, g, rtt) for gid, addr, gpus, rtt in reps for g in gpus]


def time_placements(pool: list[GpuState], strategy: str, n: int, devices: int = 1) -> list[float]:
    """Seconds per decision for ``n`` placements, the client counting each as placed."""
    pool = list(pool)
    where = {g.key: i for i, g in enumerate(pool)}
    times = []
    for k in range(n):
        profile = PROFILES[k % len(PROFILES)] if strategy == "adaptive" else PROFILES[0]
        t0 = time.perf_counter()
        p = place(pool, profile, strategy, devices=devices, spread=k)
        times.append(time.perf_counter() - t0)
        for g in p.gpus:
            i = where[g.key]
            old = pool[i]
            pool[i] = GpuState.from_report(old.gateway_id, old.address, _report(old), old.rtt_ms, old.placed + 1)
    return times


def _report(g: GpuState) -> dict:
    return {f: getattr(g, f) for f in ("index", "name", "kind", "simulated", "capability", "bf16", "total_memory",
                                       "free_memory", "utilization", "queued", "sessions", "latency_ms")}


def summary(times: list[float]) -> dict:
    us = sorted(t * 1e6 for t in times)
    return {"median_us": statistics.median(us), "mean_us": statistics.fmean(us),
            "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))], "max_us": us[-1], "n": len(us)}


def beacon_bytes(gpus: int) -> int:
    """One beacon of a gateway with ``gpus`` GPUs, with the fields a gateway announces
    (remotecuda_server/gateway.py: versions, host, sessions, each GPU's facts and load)."""
    rep = reports(1)[0][2][:1] * gpus
    info = {"gateway": "1.0.0", "protocol": 9, "torch": "2.13.0+cu128", "host": "gpu-node-017", "sessions": 12,
            "gpus": [dict(g, index=i) for i, g in enumerate(rep)]}
    return len(beacon.encode("0123456789abcdef", "tcp://10.0.0.1:55555", 123456, info))


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "nproc": os.cpu_count(), "python": platform.python_version(),
            "date": subprocess.run(["date"], capture_output=True, text=True).stdout.strip(),
            "load average (1 min) before": round(os.getloadavg()[0], 2)}


def run(quick: bool) -> dict:
    n = 200 if quick else 1000
    reps = reports(200)
    pool = pool_of(reps)
    r: dict = {"machine": machine(), "gateways": len(reps), "gpus": len(pool), "placements": n,
               "models": len({g.name for g in pool}), "single": {}, "four": {}, "growth": {}}
    t0 = time.perf_counter()
    for _ in range(20):
        pool_of(reps)
    r["convert_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    for s in STRATEGIES:
        r["single"][s] = summary(time_placements(pool, s, n))
        r["four"][s] = summary(time_placements(pool, s, n // 5, devices=4))
    for gw in (25, 200, 1000):
        p = pool_of(reports(gw, seed=1))
        r["growth"][str(gw)] = {"gpus": len(p), **summary(time_placements(p, "adaptive", n // 5))}
    r["beacon_bytes"] = {str(g): beacon_bytes(g) for g in (1, 4, 8)}
    r["machine"]["load average (1 min) after"] = round(os.getloadavg()[0], 2)
    return r


def markdown(r: dict) -> str:
    m = r["machine"]
    rows = "\n".join(f"| {s} | {r['single'][s]['median_us']:.0f} | {r['single'][s]['mean_us']:.0f} | "
                     f"{r['single'][s]['p99_us']:.0f} | {r['four'][s]['median_us']:.0f} |" for s in STRATEGIES)
    growth = "\n".join(f"| {gw} | {v['gpus']} | {v['median_us']:.0f} | {v['median_us'] / v['gpus'] * 1e3:.0f} |"
                       for gw, v in r["growth"].items())
    b = r["beacon_bytes"]
    return f"""Machine: {m['cpu']}, {m['nproc']} CPUs, Python {m['python']}, {m['date']}; load average (1 min)
{m['load average (1 min) before']} before, {m['load average (1 min) after']} after. A shared machine: other sessions
run tests meanwhile, which inflates the means and the p99 (a decision preempted); the medians are the figures to read.

A simulated pool of {r['gateways']} gateways with 4-8 GPUs each ({r['gpus']} GPUs, {r['models']} models from T4 to
H100, bf16 or not, random free memory, sessions, queues, utilization and round trips, 10% unmeasured),
{r['placements']:,} placements per strategy, each counted as placed on its GPU before the next (as the client
does until the gateway reports it). Adaptive cycles through four profiles (nothing yet, an 8 GiB model, a sync
every 3 ops, bf16). Time per decision, µs:

| strategy | median | mean | p99 | 4 devices, median |
| --- | --- | --- | --- | --- |
{rows}

Turning the {r['gateways']} gateways' reports into `GpuState`s (`GpuState.from_report`, which the pool does
when it places): {r['convert_ms']:.2f} ms for all {r['gpus']} GPUs.

Adaptive's decision time grows linearly with the pool (a placement is once per session, next to a session
start that costs a round trip and a worker process, so no index is needed at this size):

| gateways | GPUs | median µs | ns per GPU |
| --- | --- | --- | --- |
{growth}

A beacon (msgpack, with the fields the gateway announces) is {b['1']} bytes with 1 GPU, {b['4']} with 4, {b['8']}
with 8: at one per gateway per second, 1,000 GPUs on 125 8-GPU gateways send {125 * b['8'] / 1024:.0f} KiB/s to the
group.
"""



if __name__ == "__main__":
    results_md.main(SECTION, run, markdown, "200 placements instead of 1,000")
