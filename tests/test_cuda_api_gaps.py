"""torch.cuda's less common API through a real gateway with three simulated GPUs of 256 MiB
(``--device cpu --gpus 3``): the per-process memory fraction, NVML's figures, CUDA_VISIBLE_DEVICES,
share_memory_, DLPack between devices and the CUDA array interface, and a scan of torch.cuda's
public functions for any that fail where a GPU machine's would work."""
from __future__ import annotations

import inspect
import logging
import os
import warnings
from typing import Any

import pytest
import torch

import remotecuda
from remotecuda import cuda_api, visible_devices

from conftest import GatewayProcess, active_over, reset_fp32_precision, run_python

MiB = 2**20


@pytest.fixture(scope="module")
def sim():
    """The simulated gateway, and remotecuda active over it (its three GPUs as cuda:0..2); the
    run's own activation after."""
    gw = GatewayProcess("--spare", "1", "--gpus", "3", "--gpu-memory", "256MiB")
    try:
        with active_over(gw.address):
            yield gw
    finally:
        gw.stop()


def _reactivate(sim: GatewayProcess, visible: str | None) -> None:
    """Activate anew with CUDA_VISIBLE_DEVICES set (None: unset) as a program sets it, until the
    next call (the module's fixture restores it at the end)."""
    remotecuda.deactivate()
    if visible is None:
        os.environ.pop(visible_devices.VAR, None)
    else:
        os.environ[visible_devices.VAR] = visible
    remotecuda.activate(sim.address, fallback="error")


# ---------------------------------------------------------------------- memory fraction
def test_memory_fraction_caps_the_session_as_cuda_does(sim):
    assert torch.cuda.get_per_process_memory_fraction(1) == 1.0
    held = torch.ones(16 * MiB // 4, device="cuda:1")
    torch.cuda.set_per_process_memory_fraction(0.25, 1)  # 64 MiB of the 256
    assert torch.cuda.get_per_process_memory_fraction("cuda:1") == 0.25
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0  # another device's session is unaffected
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 60\.00 MiB.*64\.00 MiB allowed.*"
                                                     r"set_per_process_memory_fraction\(0\.25\)"):
        torch.empty(60 * MiB // 4, device="cuda:1").sum().item()
    with pytest.raises(torch.OutOfMemoryError, match="set_per_process_memory_fraction"):  # an upload too
        torch.zeros(60 * MiB // 4).to("cuda:1")
        torch.cuda.synchronize(1)
    assert torch.empty(100 * MiB // 4, device="cuda:0").fill_(1).sum().item() == 100 * MiB // 4
    fits = torch.full((40 * MiB // 4,), 2.0, device="cuda:1")  # the session goes on, under its cap
    assert fits.sum().item() == 2 * 40 * MiB // 4 and held.sum().item() == 16 * MiB // 4
    torch.cuda.set_per_process_memory_fraction(1.0, 1)
    del fits
    assert torch.empty(150 * MiB // 4, device="cuda:1").fill_(1).sum().item() == 150 * MiB // 4
    with pytest.raises(ValueError, match="Allowed range"):
        torch.cuda.set_per_process_memory_fraction(1.5, 1)
    with pytest.raises(TypeError, match="must be `float`"):
        torch.cuda.set_per_process_memory_fraction(1, 1)


# ---------------------------------------------------------------------- NVML and allocator figures
def test_nvml_figures_come_from_the_gateway(sim):
    for name in ("utilization", "memory_usage", "temperature", "power_draw", "clock_rate"):
        with pytest.raises(RuntimeError, match=f"torch.cuda.{name}\\(\\) reads NVML.*runs on the CPU"):
            getattr(torch.cuda, name)()
    x = torch.ones(8 * MiB // 4, device="cuda:2")
    used = torch.cuda.device_memory_used(2)  # the simulated GPU's account: every session's bytes on it
    free, total = torch.cuda.mem_get_info(2)
    assert used >= 8 * MiB and used == total - free
    assert torch.cuda.list_gpu_processes(2).startswith("GPU:2\n")
    assert torch.cuda.get_arch_list() == [] and torch.cuda.get_gencode_flags() == ""
    assert torch.cuda.memory_snapshot() == [] and torch.cuda.get_allocator_backend() == "native"
    nested = torch.cuda.memory_stats_as_nested_dict(2)
    assert nested["allocated_bytes"]["all"]["current"] == torch.cuda.memory_allocated(2) >= 8 * MiB
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] == 0
    assert torch.cuda.host_memory_stats_as_nested_dict()["allocations"]["peak"] == 0
    del x


def test_more_of_torch_cuda(sim):
    assert torch.cuda.can_device_access_peer(0, 1) and not torch.cuda.can_device_access_peer(1, 1)
    with pytest.raises(AssertionError, match="Invalid peer device id"):  # (torch.cuda's own check)
        torch.cuda.can_device_access_peer(0, 5)
    torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.get_sync_debug_mode() == 0
    with pytest.raises(NotImplementedError, match="set_sync_debug_mode"):
        torch.cuda.set_sync_debug_mode("warn")
    s = torch.cuda.Stream()
    assert s.cuda_stream != torch.cuda.default_stream().cuda_stream
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    props = torch.cuda.get_device_properties(0)  # a simulated GPU reports a GPU's facts but these
    assert not props.is_integrated and props.multi_processor_count > 0
    with pytest.raises(AttributeError, match="L2_cache_size.*does not report it: its device runs on the CPU"):
        getattr(props, "L2_cache_size")  # noqa: B009 (the attribute read is the test)
    with pytest.raises(NotImplementedError, match="raw memory"):
        torch.cuda.caching_allocator_alloc(1024)
    double = torch.cuda.jiterator._create_jit_fn("template <typename T> T twice(T x) { return x + x; }")
    with pytest.raises(NotImplementedError, match="jiterator compiles CUDA C"):
        double(torch.ones(2, device="cuda"))


def test_tensors_made_after_another_go_to_the_device_named(sim):
    """``zeros_like(x, device='cuda:1')`` and ``x.new_zeros(n, device=1)`` are made on the device
    named, not x's; ``y.type_as(x)`` goes to x's device, not the one used last."""
    x = torch.arange(6.0, device="cuda:0").view(2, 3)
    for d in ("cuda:1", 1, torch.device("cuda", 1)):
        made = [torch.zeros_like(x, device=d), torch.full_like(x, 2.0, device=d), torch.empty_like(x, device=d),
                torch.randint_like(x, 5, device=d), x.new_zeros(3, device=d), x.new_full((3,), 2.0, device=d),
                x.new_empty_strided((2,), (1,), device=d)]
        assert [str(t.device) for t in made] == ["cuda:1"] * len(made)
        assert made[1].tolist() == [[2.0] * 3] * 2 and made[5].tolist() == [2.0] * 3
    assert torch.ones_like(x, device="cuda").device == torch.device("cuda:0")  # (the current device)
    last = torch.ones(2, device="cuda:2") * 3
    assert torch.ones(2).type_as(x).device == x.device
    moved = last.type_as(x.long())
    assert moved.device == x.device and moved.dtype == torch.int64 and moved.tolist() == [3, 3]


def test_default_generators_are_the_devices_own(sim):
    """``torch.cuda.default_generators[i]`` (Megatron's and DeepSpeed's RNG trackers save and
    restore it by its state; it was an empty tuple): device i's default generator, seeded, read
    and restored as torch.cuda's functions do, and the default when given as ``generator=``."""
    gens = torch.cuda.default_generators
    assert len(gens) == torch.cuda.device_count() and gens[1] is torch.cuda.default_generators[1]
    assert gens[1].device == torch.device("cuda", 1) and torch.cuda._get_generator(torch.device("cuda:1")) is gens[1]
    gens[1].manual_seed(123)
    assert gens[1].initial_seed() == 123
    with torch.cuda.device(1):
        assert torch.cuda.initial_seed() == 123
    state = gens[1].get_state()
    assert torch.equal(state, torch.cuda.get_rng_state(1))
    a = torch.rand(4, device="cuda:1")
    gens[1].set_state(state)
    assert torch.equal(torch.rand(4, device="cuda:1"), a)
    gens[1].set_state(state)
    assert torch.equal(torch.rand(4, device="cuda:1", generator=gens[1]), a)


def test_a_generator_of_another_device_is_refused_at_the_call(sim):
    """A cuda:1 generator given to an op on cuda:0 is refused at its line, naming the remedy; the
    gateway failed the op later, reported at whatever op synchronized next."""
    gen = torch.Generator("cuda:1").manual_seed(0)
    with pytest.raises(NotImplementedError, match=r"torch.Generator\('cuda:0'\)"):
        torch.randn(2, device="cuda:0", generator=gen)
    with pytest.raises(NotImplementedError, match="a generator of cuda:1"):
        torch.ones(3, device="cuda:0").normal_(generator=gen)
    assert torch.ones(2, device="cuda:0").sum().item() == 2.0
    assert torch.randn(2, device="cuda:1", generator=gen).device == torch.device("cuda:1")


def test_a_cuda_machine_by_every_sign_libraries_read(sim):
    """Library code tells a CUDA machine by ``torch.version.cuda`` (transformers refused
    ``TrainingArguments(tf32=True)``: "--tf32 requires Ampere or a newer GPU arch") and takes the
    machine's accelerator from ``torch.get_device_module()`` (which caches its answer: one read
    before activation named the CPU); both are the GPUs' while active, the CPU's after."""
    assert torch.version.cuda == "12.8"  # (what a simulated GPU reports; a CUDA gateway, its own)
    assert torch.get_device_module() is torch.cuda
    assert torch._C._get_accelerator() == torch.device("cuda")
    transformers = pytest.importorskip("transformers")
    from transformers.utils import import_utils
    import_utils.is_torch_tf32_available.cache_clear()  # (cached by whatever test asked first)
    reset_fp32_precision()
    try:
        args = transformers.TrainingArguments(output_dir="unused", tf32=True, report_to=[])
        assert args.tf32 and torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:  # (set through the new API, the legacy getters refuse to answer until it says none)
        reset_fp32_precision()
        import_utils.enable_tf32.cache_clear()


def test_flop_counter_imported_while_active_says_nothing_of_triton(sim, caplog):
    """``torch.utils.flop_counter`` (imported by Lightning and MFU estimates), seeing a CUDA
    runtime, warns at import that triton is missing, which a GPU machine's torch always has."""
    import importlib

    import torch.utils.flop_counter as flop_counter
    with caplog.at_level(logging.WARNING, logger="torch.utils.flop_counter"):
        importlib.reload(flop_counter)
    assert "triton" not in caplog.text
    x = torch.ones(4, 8, device="cuda")
    with flop_counter.FlopCounterMode(display=False) as counter:
        x @ x.T
    assert counter.get_total_flops() == 2 * 4 * 8 * 4


def test_a_cpu_gateway_is_no_cuda_runtime(gateway):
    out = run_python(f"""
import torch, remotecuda
before = torch.get_device_module()  # (cached here, before activation)
remotecuda.activate({gateway.address!r}, fallback="error")
during = torch.version.cuda, torch.get_device_module()
remotecuda.deactivate()
print(before.__name__, during[0], during[1].__name__, torch.version.cuda, torch.get_device_module().__name__)
""")
    assert out.stdout.split() == ["torch.cpu", "None", "torch.cuda", "None", "torch.cpu"], out.stderr


def test_no_public_torch_cuda_function_fails_for_want_of_local_cuda(sim):
    """Every torch.cuda / torch.cuda.memory / torch.cuda.random function callable without
    arguments works, but the NVML sensors (a CPU gateway has none: tested above) and raw handles
    and allocator controls of a local GPU, which say that they are not supported."""
    local_only = set(cuda_api.LOCAL_ONLY)
    sensors = {"utilization", "memory_usage", "temperature", "power_draw", "clock_rate"}
    for name in local_only:
        with pytest.raises(NotImplementedError, match=rf"remotecuda: torch\.cuda\.(memory\.)?{name} .*not supported"):
            getattr(torch.cuda, name)()
    failed = {}
    for mod in (torch.cuda, torch.cuda.memory, torch.cuda.random):
        for name in getattr(mod, "__all__", []):
            f = getattr(mod, name, None)
            if name in local_only | sensors or not inspect.isfunction(f):
                continue
            if any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                   for p in inspect.signature(f).parameters.values()):
                continue
            try:
                with warnings.catch_warnings():  # (the *_cached names are deprecated)
                    warnings.simplefilter("ignore", FutureWarning)
                    f()
            except Exception as e:
                failed[f"{mod.__name__}.{name}"] = f"{type(e).__name__}: {e}"
    assert not failed


# ---------------------------------------------------------------------- share_memory_ and DLPack
def test_share_memory_is_a_no_op_and_the_cuda_array_interface_says_why_not(sim):
    x = torch.arange(4.0, device="cuda")
    assert x.share_memory_() is x and x.is_shared()  # as for a CUDA tensor
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    # the CUDA array interface would hand CuPy or Numba a device pointer to read here: hasattr is False
    assert not hasattr(x, "__cuda_array_interface__")
    with pytest.raises(AttributeError, match="memory is on its gateway.*__cuda_array_interface__"):
        x.__cuda_array_interface__  # noqa: B018


def test_dlpack_across_devices(sim):
    """A capsule is made on the current device only (torch's refusal); asked for another device's,
    it is a copy there, and ``torch.from_dlpack(t, device=)`` moves the alias as torch does."""
    y = torch.arange(3.0, device="cuda:1")
    with pytest.raises(BufferError, match="different CUDA device index. Expected: 1. Current device: 0"):
        torch.from_dlpack(y)
    with torch.cuda.device(1):
        z = torch.from_dlpack(y)
        moved = torch.from_dlpack(y.__dlpack__(dl_device=(2, 2)))
    z[0] = 7
    assert z.device == torch.device("cuda:1") and y.tolist() == [7.0, 1.0, 2.0]
    assert moved.device == torch.device("cuda:2") and moved.tolist() == [0.0, 1.0, 2.0]
    x = torch.arange(2.0, device="cuda")
    assert torch.from_dlpack(x, device="cuda:2").device == torch.device("cuda:2")
    with pytest.raises(ValueError, match="cannot move DLPack tensor from device"):
        torch.from_dlpack(x, device="cuda:1", copy=False)


# ---------------------------------------------------------------------- torch.compile's TF32 note
def test_compiling_float32_products_for_an_ampere_gpu_warns_that_tf32_is_off(sim):
    """Inductor warns, compiling a graph with float32 matrix products for a GPU from Ampere on
    (the simulated GPUs say 8.0), that TF32 would speed them up; remotecuda's trace has CPU
    values, whose device inductor's check of the graph reads, so it never warned."""
    assert torch.cuda.get_device_capability() >= (8, 0)

    def compile_and_run(dtype: torch.dtype, **options: Any) -> list:
        model = torch.compile(torch.nn.Linear(4, 3).to("cuda", dtype), **options)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model(torch.ones(2, 4, device="cuda", dtype=dtype)).sum().backward()
        return [str(w.message) for w in seen if w.category is UserWarning and "TensorFloat32" in str(w.message)]
    assert compile_and_run(torch.float32)[0].startswith(
        "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled. "
        "Consider setting `torch.set_float32_matmul_precision('high')`")
    assert compile_and_run(torch.float64) == []
    assert compile_and_run(torch.float32, backend="aot_eager") == []  # (inductor's warning alone)
    torch.set_float32_matmul_precision("high")
    try:
        assert compile_and_run(torch.float32) == []
    finally:
        reset_fp32_precision()


# ---------------------------------------------------------------------- CUDA_VISIBLE_DEVICES
@pytest.mark.parametrize(("value", "count", "expected"), [
    (None, 3, None), ("1", 3, [1]), ("2,0", 3, [2, 0]), (" 1 , 0", 3, [1, 0]), ("1gpu,0x", 3, [1, 0]),
    ("0,5,1", 3, [0]), ("1,-1,0", 3, [1]), ("", 3, []), ("0,0", 3, []), ("none", 3, [])])
def test_visible_devices_are_read_as_cuda_reads_them(value, count, expected):
    assert visible_devices.parse(value, count) == expected


def test_visible_devices_by_uuid_are_ignored_with_a_warning():
    with pytest.warns(RuntimeWarning, match="by UUID"):
        assert visible_devices.parse("GPU-0a1b2c,GPU-3d4e", 2) is None


def test_cuda_visible_devices_picks_and_renumbers_the_virtual_devices(sim):
    try:
        _reactivate(sim, "2,0")
        assert torch.cuda.device_count() == 2 and torch.cuda.is_available()
        assert [d.gpu for d in remotecuda.runtime.current().pool.devices] == [2, 0]
        a = torch.ones(3, device="cuda:0")
        b = torch.full((3,), 2.0, device="cuda:1")
        assert (a + b.to("cuda:0")).tolist() == [3.0] * 3
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.ones(1, device="cuda:2")
        _reactivate(sim, "")
        assert torch.cuda.device_count() == 0 and not torch.cuda.is_available()
        assert not torch.accelerator.is_available() and torch.accelerator.current_accelerator(True) is None
        with pytest.raises(RuntimeError, match="No CUDA GPUs are available.*CUDA_VISIBLE_DEVICES=''"):
            torch.ones(1, device="cuda")
    finally:
        _reactivate(sim, None)
    assert torch.cuda.device_count() == 3


def test_cuda_launch_blocking_raises_an_error_at_its_line(sim):
    """CUDA_LAUNCH_BLOCKING=1, which torch's CUDA errors advise, makes every op synchronous as on
    a GPU (it was ignored: the error came at a later sync); read at the first use of a device, as
    CUDA reads it, so a notebook's first cell may set it."""
    try:
        _reactivate(sim, None)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CUDA_LAUNCH_BLOCKING", "1")
            x = torch.zeros(2, device="cuda")
            with pytest.raises(IndexError, match="out of bounds"):
                x[torch.tensor([5], device="cuda")]
            assert (x + 1).tolist() == [1.0, 1.0]
    finally:
        _reactivate(sim, None)


def test_cuda_visible_devices_set_before_the_first_use_applies(sim):
    """CUDA reads the variable at its initialization (the first use of a device), and torch's
    device_count() reads it afresh until then: a notebook's first cell sets it, after the RemoteCUDA
    kernel activated (the count stayed the pool's, every device visible)."""
    try:
        _reactivate(sim, None)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(visible_devices.VAR, "2")
            assert torch.cuda.device_count() == 1 and torch.cuda.is_available()
            mp.setenv(visible_devices.VAR, "")
            assert not torch.cuda.is_available()
            mp.setenv(visible_devices.VAR, "1,0")
            assert torch.cuda.device_count() == 2
            x = torch.full((2,), 3.0, device="cuda:1")  # the first use: read no more
            mp.setenv(visible_devices.VAR, "2")
            assert torch.cuda.device_count() == 2
            assert [d.gpu for d in remotecuda.runtime.current().pool.devices] == [1, 0]
            assert x.sum().item() == 6.0
    finally:
        _reactivate(sim, None)
    assert torch.cuda.device_count() == 3


def test_a_dropped_event_or_graph_is_forgotten_without_the_sessions_lock(remote):
    """A finalizer runs wherever a garbage collection starts: on a thread that holds the session's
    lock in the middle of a flush (its free op then went into a message half encoded, and was
    counted as sent: a trace's op count and the stats' came apart), or on another thread, which
    waited for that lock. It only notes the id now; the next message frees it."""
    import threading

    from remotecuda import runtime
    ev = torch.cuda.Event()
    ev.record()
    g = torch.cuda.CUDAGraph()
    x = torch.ones(2, device="cuda")
    with torch.cuda.graph(g):
        y = x * 2
    g.replay()
    s = runtime.current().session(torch.cuda.current_device())
    torch.cuda.synchronize()
    held, done, freed_while_held = threading.Event(), threading.Event(), []

    def hold() -> None:
        with s.lock:
            held.set()
            freed_while_held.append(done.wait(10))

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    del ev, g
    done.set()
    t.join()
    assert freed_while_held == [True]
    assert sorted(op for op, _ in s._forgotten) == ["rc::event_free", "rc::graph_free"]
    assert torch.equal((y + 1).cpu(), torch.full((2,), 3.0))  # (the next message frees them)
    assert s._forgotten == []
