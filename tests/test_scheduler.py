"""Placement (remotecuda/scheduler.py): each strategy on hand-made pools, adaptive's choices and
reasons, pins, several devices, REMOTECUDA_DEVICES parsing, and invariants over random pools.
The scheduler is a pure function of what the pool knows, so these are plain unit tests; the
pool's own tests place real sessions on real gateways."""
from __future__ import annotations

import collections
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remotecuda.scheduler import (
    ANY,
    STRATEGIES,
    GpuState,
    Pin,
    PlacementError,
    SessionProfile,
    check_strategy,
    devices_from_env,
    parse_devices,
    place,
    strategy_from_env,
)

from conftest import run_python

GiB = 1 << 30


def gpu(gw: str, index: int = 0, port: int = 55555, **kw) -> GpuState:
    kw.setdefault("name", "A100")
    kw.setdefault("total_memory", 80 * GiB)
    kw.setdefault("free_memory", kw["total_memory"])
    return GpuState(gw if port == 55555 else f"{gw}:{port}", f"tcp://{gw}:{port}", index, **kw)


def placed(pool: list[GpuState], g: GpuState) -> list[GpuState]:
    """The pool after the client placed a session on ``g`` (as the pool does until the
    gateway's next report counts it)."""
    return [GpuState(**{**_fields(x), "placed": x.placed + 1}) if x.key == g.key else x for x in pool]


def _fields(g: GpuState) -> dict:
    return {f: getattr(g, f) for f in GpuState.__dataclass_fields__}


# ---------------------------------------------------------------------------- memory-aware

def test_memory_aware_picks_most_free_and_avoids_a_nearly_full_gpu():
    pool = [gpu("10.0.0.1", free_memory=30 * GiB), gpu("10.0.0.2", free_memory=70 * GiB),
            gpu("10.0.0.3", free_memory=GiB // 2)]
    p = place(pool, SessionProfile(allocated_bytes=2 * GiB), "memory-aware")
    assert p.gpus[0].address == "tcp://10.0.0.2:55555" and p.strategy == "memory-aware"
    assert p.reason == ("memory-aware: session holds 2.0 GiB; 1 GPU(s) without 2.0 GiB free left out; "
                        "gw 10.0.0.2 GPU 0 (A100) has 70.0 GiB free")
    # the nearly full GPU is never chosen, not even pinned
    with pytest.raises(PlacementError, match="no GPU has the 2.0 GiB"):
        place(pool, SessionProfile(allocated_bytes=2 * GiB), "memory-aware", devices=[Pin("10.0.0.3")])


def test_memory_aware_among_near_equals_takes_the_emptier():
    pool = [gpu("a", free_memory=80 * GiB, sessions=3), gpu("b", free_memory=79 * GiB, sessions=1),
            gpu("c", free_memory=40 * GiB)]
    assert place(pool, None, "memory-aware").gpus[0].gateway_id == "b"


def test_memory_aware_when_nothing_fits():
    pool = [gpu("a", free_memory=GiB), gpu("b", free_memory=3 * GiB)]
    with pytest.raises(PlacementError, match=r"most free: gw b GPU 0 \(A100\), 3.0 GiB"):
        place(pool, SessionProfile(allocated_bytes=4 * GiB), "memory-aware")


# ---------------------------------------------------------------------------- load-balancing

@pytest.mark.parametrize("gpus_per_gateway", [1, 2])
def test_load_balancing_spreads_six_sessions_over_three_gateways(gpus_per_gateway):
    pool = [gpu(gw, i) for gw in ("10.0.0.1", "10.0.0.2", "10.0.0.3") for i in range(gpus_per_gateway)]
    counts = collections.Counter()
    for _ in range(6):
        p = place(pool, None, "load-balancing")
        counts[p.gpus[0].gateway_id] += 1
        pool = placed(pool, p.gpus[0])
    assert sorted(counts.values()) == [2, 2, 2]
    assert all(g.placed == 6 // len(pool) for g in pool)  # and over the GPUs too


def test_load_balancing_weighs_sessions_queue_and_utilization():
    pool = [gpu("a", sessions=2), gpu("b", sessions=1, queued=5000, latency_ms=1.0),
            gpu("c", sessions=1, utilization=0.9), gpu("d", sessions=1, placed=1)]
    p = place(pool, None, "load-balancing")
    assert p.gpus[0].gateway_id == "c"
    assert p.reason == "load-balancing: gw c GPU 0 (A100) has 1 session(s), 0 op(s) queued, 90% busy"


# ---------------------------------------------------------------------------- latency-optimized

def test_latency_optimized_avoids_a_high_rtt_gateway():
    pool = [gpu("far", rtt_ms=40.0), gpu("near", rtt_ms=0.3, sessions=2), gpu("mid", rtt_ms=8.0)]
    p = place(pool, None, "latency-optimized")
    assert p.gpus[0].gateway_id == "near"
    assert p.reason == "latency-optimized: gw near GPU 0 (A100): rtt 0.3 ms + queue ~0.0 ms"


def test_latency_optimized_counts_the_queue_and_distrusts_unmeasured():
    pool = [gpu("near", rtt_ms=0.3, queued=200, latency_ms=0.5), gpu("other", rtt_ms=5.0),
            gpu("unmeasured")]
    assert place(pool, None, "latency-optimized").gpus[0].gateway_id == "other"
    # within the band, the less loaded one
    pool = [gpu("a", rtt_ms=0.30, sessions=4), gpu("b", rtt_ms=0.35, sessions=1), gpu("c", rtt_ms=9.0)]
    assert place(pool, None, "latency-optimized").gpus[0].gateway_id == "b"


# ---------------------------------------------------------------------------- adaptive

MIXED = [gpu("10.0.0.1", 0, name="T4", total_memory=16 * GiB, free_memory=15 * GiB, bf16=False,
             capability=(7, 5), rtt_ms=0.2),
         gpu("10.0.0.2", 1, name="A100", simulated=True, total_memory=80 * GiB, free_memory=70 * GiB,
             capability=(8, 0), rtt_ms=12.0, sessions=3),
         gpu("10.0.0.3", 0, name="A10", total_memory=24 * GiB, free_memory=20 * GiB, capability=(8, 6),
             rtt_ms=6.0, bf16=True)]


def test_adaptive_large_footprint_goes_memory_aware():
    p = place(MIXED, SessionProfile(allocated_bytes=int(1.2 * GiB), ops=40, syncs=1))
    assert (p.strategy, p.requested) == ("memory-aware", "adaptive")
    assert p.gpus[0].name == "A100"
    assert p.reason == ("adaptive → memory-aware: session holds 1.2 GiB; "
                        "gw 10.0.0.2 GPU 1 (A100 simulated) has 70.0 GiB free")


def test_adaptive_large_relative_to_the_smallest_gpu():
    small = [gpu("a", total_memory=GiB, free_memory=GiB, sessions=0),
             gpu("b", total_memory=2 * GiB, free_memory=2 * GiB, sessions=5)]
    p = place(small, SessionProfile(allocated_bytes=300 << 20))  # 300 MiB: over a quarter of 1 GiB
    assert p.strategy == "memory-aware" and p.gpus[0].gateway_id == "b"


def test_adaptive_sync_heavy_goes_latency_optimized():
    p = place(MIXED, SessionProfile(allocated_bytes=4096, ops=9, syncs=3))
    assert p.strategy == "latency-optimized" and p.gpus[0].name == "T4"
    assert p.reason.startswith("adaptive → latency-optimized: a sync every 3 op(s) (3 in 9 ops); gw 10.0.0.1 ")


def test_adaptive_bf16_session_goes_to_a_bf16_gpu():
    p = place(MIXED, SessionProfile(allocated_bytes=4096, ops=9, syncs=3, dtypes={"torch.bfloat16"}))
    assert p.strategy == "latency-optimized" and p.gpus[0].bf16 and p.gpus[0].name == "A10"
    assert "bfloat16 → only GPUs with bf16 (2 of 3)" in p.reason
    # with no bf16 GPU at all, it still gets one
    assert place([MIXED[0]], SessionProfile(dtypes={"bfloat16"})).gpus[0].name == "T4"
    # the explicit strategies do what they say
    assert place(MIXED, SessionProfile(dtypes={"bfloat16"}), "latency-optimized").gpus[0].name == "T4"


def test_adaptive_otherwise_balances_the_load():
    p = place(MIXED, SessionProfile())  # placement before any op: nothing known yet
    assert p.strategy == "load-balancing" and p.gpus[0].sessions == 0
    assert p.reason.startswith("adaptive → load-balancing: nothing stands out (0 op(s), 0 sync(s), 0 B held); ")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cpu_gateways_serve_only_when_no_gpu_can(strategy):
    cpu = GpuState("cpu", "tcp://10.0.0.9:55555", 0, "CPU (x86_64, 64 cores)", kind="cpu",
                   total_memory=512 * GiB, free_memory=500 * GiB, rtt_ms=0.1)
    sim = gpu("sim", name="sim24", kind="cpu", simulated=True, total_memory=24 * GiB, sessions=4, rtt_ms=9.0)
    p = place([cpu, sim], SessionProfile(), strategy)
    assert p.gpus[0].gateway_id == "sim" and "1 CPU gateway(s) left out" in p.reason
    assert place([cpu], SessionProfile(), strategy).gpus[0].gateway_id == "cpu"
    assert place([cpu, sim], None, strategy, devices=[Pin("10.0.0.9")]).gpus[0].gateway_id == "cpu"
    # two devices, one GPU: they share it rather than make a CPU gateway cuda:1
    assert [g.gateway_id for g in place([cpu, sim], None, strategy, devices=2).gpus] == ["sim", "sim"]


# ---------------------------------------------------------------------------- devices and pins

def test_several_devices_prefer_distinct_gpus():
    pool = [gpu(gw, i) for gw in ("a", "b") for i in range(2)]
    p = place(pool, None, "load-balancing", devices=4)
    assert len({g.key for g in p.gpus}) == 4
    assert [g.gateway_id for g in p.gpus[:2]] == ["a", "b"]  # spread over gateways first
    assert p.reason.count("cuda:") == 4
    p = place(pool[:1], None, "memory-aware", devices=3)  # fewer GPUs than devices: shared
    assert [g.key for g in p.gpus] == [("a", 0)] * 3


def test_latency_optimized_keeps_several_devices_near():
    pool = [gpu("near", i, rtt_ms=0.2) for i in range(2)] + [gpu("far", i, rtt_ms=30.0) for i in range(4)]
    p = place(pool, None, "latency-optimized", devices=2)
    assert [g.key for g in p.gpus] == [("near", 0), ("near", 1)]


def test_pins():
    pool = [gpu("h1", 0, port=55555), gpu("h1", 1, port=55555, name="NVIDIA A10"),
            gpu("h1", 0, port=55600, name="H100"), gpu("h2", 0, name="H100")]
    p = place(pool, None, "load-balancing", devices=parse_devices("h1:55555/1,any,any/h100"))
    # pinned devices first; then 'any' goes to the gateway with nothing placed yet
    assert [(g.address, g.index) for g in p.gpus] == [("tcp://h1:55555", 1), ("tcp://h2:55555", 0),
                                                      ("tcp://h1:55600", 0)]
    assert place(pool, None, devices=[Pin("H2")]).gpus[0].gateway_id == "h2"
    assert place(pool, None, devices=[Pin(gpu="a10")]).gpus[0].name == "NVIDIA A10"
    with pytest.raises(PlacementError, match=r"cuda:1 is pinned to h3/0, which matches none of the 4"):
        place(pool, None, devices=[ANY, Pin("h3", gpu=0)])


def test_ties_are_stable_and_spread_by_the_client_key():
    pool = [gpu(gw) for gw in "dcba"]
    picks = [place(pool, None, s, spread=k).gpus[0].gateway_id for s in STRATEGIES for k in range(4)]
    assert picks == list("abcd") * 4
    assert place(pool[::-1], None, spread=2) == place(pool, None, spread=2)


def test_no_gpus_and_bad_requests():
    with pytest.raises(PlacementError, match="no GPU is known"):
        place([], None)
    with pytest.raises(ValueError, match="at least 1 device"):
        place(MIXED, None, devices=[])


# ---------------------------------------------------------------------------- configuration

def test_strategy_names():
    assert check_strategy(" Memory-Aware ") == "memory-aware"
    with pytest.raises(ValueError, match="valid: adaptive, load-balancing, memory-aware, latency-optimized"):
        check_strategy("fastest")
    with pytest.raises(ValueError, match="valid:"):
        place(MIXED, None, "round-robin")
    assert strategy_from_env({}) == "adaptive"
    assert strategy_from_env({"REMOTECUDA_STRATEGY": "LATENCY-OPTIMIZED"}) == "latency-optimized"
    with pytest.raises(ValueError, match="REMOTECUDA_STRATEGY: unknown scheduling strategy 'x'"):
        strategy_from_env({"REMOTECUDA_STRATEGY": "x"})


def test_parse_devices():
    assert parse_devices("2") == (ANY, ANY)
    assert parse_devices(" host1:55555/0 , any ") == (Pin("host1", 55555, 0), ANY)
    assert parse_devices("tcp://10.0.0.2:6000,*/A100,gpu-box/RTX 4090,box") == (
        Pin("10.0.0.2", 6000), Pin(gpu="A100"), Pin("gpu-box", gpu="RTX 4090"), Pin("box"))
    assert str(Pin("h", 1, "A100")) == "h:1/A100" and str(ANY) == "any"
    assert devices_from_env({}) is None and devices_from_env({"REMOTECUDA_DEVICES": "3"}) == (ANY,) * 3


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ("0", "at least 1 device"),
    ("a,,b", "an empty item"),
    ("2,any", "a count stands alone"),
    ("host:port", "no valid port"),
    ("host:70000", "no valid port"),
    ("[::1]:55555", "no valid port"),
    ("/0", "has no host"),
    (":55555", "has no host"),
    ("any:55555", "a port needs a host"),
    ("host/", "one GPU index or name after '/'"),
    ("host/0/1", "one GPU index or name after '/'"),
    ("ho st/0", "is not a host name"),
])
def test_parse_devices_errors(text, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_devices(text)
    assert str(e.value).startswith("REMOTECUDA_DEVICES") and "e.g. 'host1:55555/0,any'" in str(e.value)


def test_from_report():
    g = GpuState.from_report("id1", "tcp://10.0.0.2:55555", {
        "index": 1, "name": "A100", "kind": "cpu", "simulated": True, "capability": [8, 0], "bf16": True,
        "total_memory": 80 * GiB, "free_memory": 70 * GiB, "utilization": 0.12, "queued": 3, "sessions": 2,
        "latency_ms": 0.5}, rtt_ms=0.4, placed=1)
    assert g.capability == (8, 0) and g.free_memory == 70 * GiB and g.queue_ms == 1.5 and g.placed == 1
    assert g.label() == "gw 10.0.0.2 GPU 1 (A100 simulated)" and g.is_gpu
    bare = GpuState.from_report("id2", "10.0.0.3:6000", {"index": 0, "total_memory": GiB})
    assert bare.free_memory == GiB and bare.rtt_ms is None and bare.label() == "gw 10.0.0.3:6000 GPU 0"


def test_import_needs_no_torch():
    r = run_python("import sys, remotecuda.scheduler; assert 'torch' not in sys.modules, 'torch imported'")
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------- invariants

gpu_states = st.builds(
    lambda gw, i, total, frac, sessions, queued, rtt, bf16, kind: GpuState(
        f"gw{gw}", f"tcp://10.0.0.{gw}:55555", i, f"GPU{total}", kind=kind, bf16=bf16,
        capability=(8, 0) if bf16 else (7, 5), total_memory=total * GiB,
        free_memory=int(total * GiB * frac), queued=queued, sessions=sessions, latency_ms=0.5, rtt_ms=rtt),
    st.integers(1, 6), st.integers(0, 3), st.sampled_from([16, 24, 40, 80]), st.floats(0, 1),
    st.integers(0, 5), st.integers(0, 500), st.none() | st.floats(0.05, 50), st.booleans(),
    st.sampled_from(["cuda", "cuda", "cpu"]))
pools = st.lists(gpu_states, min_size=1, max_size=12, unique_by=lambda g: g.key)
profiles = st.builds(SessionProfile, st.integers(0, 100 * GiB), st.integers(0, 200), st.integers(0, 20),
                     st.sets(st.sampled_from(["float32", "bfloat16", "float16", "float8_e4m3fn"])))


@settings(max_examples=300, deadline=None)
@given(pools, profiles, st.sampled_from(STRATEGIES), st.integers(1, 4), st.integers(0, 7), st.randoms())
def test_placement_invariants(pool, profile, strategy, n, spread, rnd):
    try:
        p = place(pool, profile, strategy, devices=n, spread=spread)
    except PlacementError:
        # only memory-aware refuses, and only when no GPU has the footprint free
        assert max(g.free_memory for g in pool) < profile.allocated_bytes
        assert strategy == "memory-aware" or (strategy == "adaptive" and profile.allocated_bytes > 0)
        return
    assert len(p.gpus) == n and all(g in pool for g in p.gpus)
    assert p.strategy in STRATEGIES[1:] and p.requested == strategy and "\n" not in p.reason
    fitting = [g for g in pool if g.free_memory >= profile.allocated_bytes]
    if p.strategy == "memory-aware":  # never too small: rather twice on one GPU
        assert all(g.free_memory >= profile.allocated_bytes for g in p.gpus)
    usable = fitting if strategy in ("memory-aware", "adaptive") else pool
    if len([g for g in usable if g.is_gpu] or usable) >= n:
        assert len({g.key for g in p.gpus}) == n  # distinct GPUs while there are enough
    shuffled = list(pool)
    rnd.shuffle(shuffled)
    assert place(shuffled, profile, strategy, devices=n, spread=spread) == p  # input order does not matter


@settings(max_examples=200, deadline=None)
@given(pools, st.integers(0, 100 * GiB))
def test_adaptive_never_picks_a_gpu_too_small_when_one_fits(pool, need):
    if max(g.free_memory for g in pool) < need:
        return
    p = place(pool, SessionProfile(allocated_bytes=need))
    assert p.gpus[0].free_memory >= need


def test_random_pools_keep_load_balancing_even():
    rnd = random.Random(0)
    pool = [gpu(f"gw{k}", i) for k in range(5) for i in range(rnd.randint(1, 3))]
    for _ in range(3 * len(pool)):
        pool = placed(pool, place(pool, None, "load-balancing").gpus[0])
    assert {g.placed for g in pool} == {3}
