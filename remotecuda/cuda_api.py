"""``torch.cuda.*`` (and ``torch.Generator``) answered by the gateways.

On a CPU-only build these functions raise "Torch not compiled with CUDA enabled"; while
remotecuda is active they are replaced by the ones here (and restored on deactivation).
Device facts come from the gateways' inventories (asking for them places a device not placed
yet: ``device_count`` does not, see pool.py); memory figures, synchronisation and
event timings are requests to the session's worker, measured where the work runs. The
state torch.cuda keeps (the current device, streams, the seed for devices not used yet)
is the active runtime's (runtime.py), so it ends with it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from . import runtime
from .cuda_graphs import is_current_stream_capturing
from .device_type import DEVICE
from .generator import CudaGenerator, seed_value, state_bytes
from .pool import VirtualDevice
from .session import Session

_rt = runtime.current


def device_index(device: Any = None) -> int:
    """The index of a device argument as torch.cuda takes it (None: the current device)."""
    if device is None:
        return _rt().current_device
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, DEVICE):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return _rt().current_device if device.index is None else device.index
    raise TypeError(f"invalid device {device!r}")


def _device(device: Any = None) -> VirtualDevice:
    return _rt().device(device_index(device))


def _session(device: Any = None) -> Session:
    return _rt().session(device_index(device))


@dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` returns: the gateway GPU's facts."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    gateway: str = ""
    more: dict = field(default_factory=dict, compare=False)  # the GPU's other facts (its gateway's probe)

    def __getattr__(self, name: str) -> Any:
        """The other properties a CUDA gateway reports (``L2_cache_size``, ``warp_size``, ``uuid``...)."""
        more = self.__dict__.get("more") or {}
        if name in more:
            return more[name]
        raise AttributeError(f"'_CudaDeviceProperties' object has no attribute {name!r} (gateway {self.gateway} "
                             "does not report it" + (": its device runs on the CPU)" if not more else ")"))

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1 << 20)}MB, "
                f"multi_processor_count={self.multi_processor_count}, gateway='{self.gateway}')")


# ---------------------------------------------------------------------- device facts
def is_available() -> bool:
    """As a GPU's: asking makes the children forked from now on bad forks (``Runtime.initialized``)."""
    _rt().asked = True
    return device_count() > 0  # (none: CUDA_VISIBLE_DEVICES hid them all, visible_devices.py)


def is_initialized() -> bool:
    return True


def init() -> None:
    """CUDA initialized now, as far as forked children are concerned (``Runtime.initialized``)."""
    _rt().asked = True


def device_count() -> int:
    return len(_rt().pool.visible())


def current_device() -> int:
    return _rt().current_device


def set_device(device: Any) -> None:
    """As torch's: a device without an index (``'cuda'``) names none to make current, a ValueError
    (it made the current device stay what it was, so that later 'cuda' tensors went elsewhere)."""
    d = torch.device(device) if isinstance(device, str) else device
    if isinstance(d, DEVICE) and d.type == "cuda" and d.index is None:
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{d}")
    i = device_index(device)
    if i >= 0:
        rt = _rt()
        rt.pool.check(i)  # (an invalid index raises; the device is placed at its first need, not here)
        rt.current_device = i


def _described(device: Any) -> VirtualDevice:
    """The device whose properties are asked for: torch.cuda asserts on an index past the last."""
    i = device_index(device)
    if not 0 <= i < device_count():
        raise AssertionError("Invalid device id")
    return _device(i)


def get_device_name(device: Any = None) -> str:
    return _described(device).props["name"]


def get_device_capability(device: Any = None) -> tuple[int, int]:
    major, minor = _described(device).props["capability"]
    return (major, minor)


def get_device_properties(device: Any = None) -> DeviceProperties:
    d = _described(device)
    p = d.props
    more = dict(p.get("more") or {})
    return DeviceProperties(p["name"], p["capability"][0], p["capability"][1], p["total_memory"],
                            p["multi_processor_count"], bool(more.pop("is_integrated", False)),
                            bool(more.pop("is_multi_gpu_board", False)), d.endpoint, more)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """torch's answer for the current device: yes where it runs bfloat16 natively (the gateway's
    ``bf16``: compute capability 8.0 or more, or a CPU), else only ``including_emulation``, as
    torch then makes a bfloat16 tensor on the device to decide, which every CUDA GPU holds (a
    T4's Trainer(bf16=True) trains, emulated; code asking ``including_emulation=False`` hears no)."""
    return bool(_device().props.get("bf16", True)) or including_emulation


def runtime_version() -> str | None:
    """What ``torch.version.cuda`` says while active: the CUDA runtime of the current device's
    gateway (None where it runs on the CPU). Code reads it to tell a CUDA machine, e.g.
    transformers before it turns TF32 on; asked, like the device's properties, it places the device."""
    return _device().props.get("cuda_version") if is_available() else None


def get_arch_list() -> list[str]:
    """The architectures the current device's gateway's torch was built for ([] on a CPU gateway)."""
    return list(_info("get_arch_list"))


def get_gencode_flags() -> str:
    return str(_info("get_gencode_flags"))


def can_device_access_peer(device: Any, peer_device: Any) -> bool:
    """Copies between two devices go gateway to gateway (remotecuda_server/peer.py), never through
    this process; a device is not its own peer (CUDA's answer)."""
    a, b = device_index(device), device_index(peer_device)
    n = device_count()
    if not 0 <= a < n:
        raise AssertionError("Invalid device id")
    if not 0 <= b < n:
        raise AssertionError("Invalid peer device id")
    return a != b


def get_sync_debug_mode() -> int:
    return 0


def set_sync_debug_mode(debug_mode: int | str) -> None:
    """Only the default: remotecuda does not yet report the operations that synchronise."""
    if debug_mode not in (0, "default"):
        raise NotImplementedError(f"remotecuda: torch.cuda.set_sync_debug_mode({debug_mode!r}) is not supported "
                                  "yet (only 0, 'default'); remotecuda.stats() counts the sync points")


def _local_only(name: str, why: str) -> Any:
    """A function of a local GPU's runtime that has no remote meaning: it says so when called."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"remotecuda: torch.cuda.{name} {why}; it is not supported")
    refuse.__name__ = name.rpartition(".")[2]
    return refuse


_RAW = "gives raw memory or handles of a GPU in this process, and the GPUs are on gateways"
#: local-runtime functions replaced by a clear refusal while active (else torch._C lacks them)
LOCAL_ONLY = {
    "caching_allocator_alloc": _local_only("caching_allocator_alloc", _RAW),
    "caching_allocator_delete": _local_only("caching_allocator_delete", _RAW),
    "caching_allocator_enable": _local_only("caching_allocator_enable", "switches this process's allocator"),
    "change_current_allocator": _local_only("change_current_allocator", "switches this process's allocator"),
    "current_blas_handle": _local_only("current_blas_handle", _RAW),
    "current_solver_handle": _local_only("current_solver_handle", _RAW),
    "get_stream_from_external": _local_only("get_stream_from_external", _RAW),
    # (torch.cuda.memory's: the memory visualizer's history; memory_snapshot() is the gateway's)
    **{name: _local_only(f"memory.{name}", "records the allocator history of a GPU in this process, and the "
                         "GPUs are on gateways (memory_stats() and memory_snapshot() report theirs)")
       for name in ("_record_memory_history", "_snapshot", "_dump_snapshot")},
}
#: torch._C's jiterator entry point (``torch.cuda.jiterator``'s functions call it when run)
JITERATOR = _local_only("jiterator", "compiles CUDA C++ in this process, and gateways run only known aten ops")


# ---------------------------------------------------------------------- NVML, on the gateway
def _info(name: str, device: Any = None) -> Any:
    """``torch.cuda.<name>`` answered by the device's worker (remotecuda_server/cuda_info.py)."""
    return _session(device).request("rc::cuda_info", [name])


def utilization(device: Any = None) -> int:
    return int(_info("utilization", device))


def memory_usage(device: Any = None) -> int:
    return int(_info("memory_usage", device))


def temperature(device: Any = None) -> int:
    return int(_info("temperature", device))


def power_draw(device: Any = None) -> int:
    return int(_info("power_draw", device))


def clock_rate(device: Any = None) -> int:
    return int(_info("clock_rate", device))


def device_memory_used(device: Any = None) -> int:
    return int(_info("device_memory_used", device))


def list_gpu_processes(device: Any = None) -> str:
    return str(_info("list_gpu_processes", device))


class device:
    """``with torch.cuda.device(i):`` makes cuda:i the current device."""

    def __init__(self, device: Any):
        self.idx = -1 if device is None else device_index(device)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = _rt().current_device
        if self.idx >= 0:
            set_device(self.idx)

    def __exit__(self, *exc: Any) -> None:
        if self.idx >= 0:
            _rt().current_device = self.prev


class device_of(device):
    def __init__(self, obj: Any):
        super().__init__(obj.get_device() if getattr(obj, "is_cuda", False) else -1)


# ---------------------------------------------------------------------- synchronisation
def synchronize(device: Any = None) -> None:
    """Wait for all queued work on the device (and raise its pending error, if any)."""
    _session(device).synchronize()


_ids = itertools.count(1)


class Stream:
    """A CUDA stream. Ops are executed in issue order per session, so a stream only orders
    (never overlaps) work; its methods behave as on a GPU whose streams ran serially."""

    device: torch.device
    priority: int
    stream_id: int

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        self = object.__new__(cls)
        self.device = torch.device("cuda", device_index(device))
        self.priority = priority
        self.stream_id = next(_ids)
        return self

    @property
    def cuda_stream(self) -> int:
        """The stream's number, unique in this process (there is no local CUDA stream to point to)."""
        return self.stream_id

    def synchronize(self) -> None:
        synchronize(self.device)

    def query(self) -> bool:
        synchronize(self.device)
        return True

    def wait_stream(self, stream: Any) -> None:
        return None

    def is_capturing(self) -> bool:
        return is_current_stream_capturing()

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    @property
    def device_type(self) -> int:
        return 1  # c10::DeviceType::CUDA, as torch.Stream gives it

    @property
    def device_index(self) -> int:
        return self.device.index

    def __enter__(self) -> Stream:
        """``with stream:`` (torch.Stream's form): current on its device for the block."""
        self.__dict__.setdefault("_outer", []).append(current_stream(self.device))
        set_stream(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        set_stream(self.__dict__["_outer"].pop())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash((self.device, self.stream_id))

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device={self.device} cuda_stream={self.stream_id:#x}>"


def default_stream(device: Any = None) -> Stream:
    i = device_index(device)
    streams = _rt().default_streams
    if i not in streams:
        streams[i] = Stream(i)
    return streams[i]


def current_stream(device: Any = None) -> Stream:
    i = device_index(device)
    return _rt().current_streams.get(i) or default_stream(i)


def set_stream(stream: Stream) -> None:
    _rt().current_streams[stream.device.index] = stream


class StreamContext:
    def __init__(self, stream: Stream | None):
        self.stream: Stream | None = stream
        self.prev: Stream | None = None

    def __enter__(self) -> Stream | None:
        if self.stream is not None:
            self.prev = current_stream(self.stream.device)
            set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        if self.stream is not None and self.prev is not None:
            set_stream(self.prev)


def stream(stream: Stream | None) -> StreamContext:
    return StreamContext(stream)


class Event:
    """A CUDA event recorded in the op stream; ``elapsed_time`` is measured on the gateway."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self.id = next(_ids)
        self.session: Any = None

    def record(self, stream: Stream | None = None) -> None:
        dev = stream.device if stream is not None else None
        self.session = _session(dev)
        self.session.enqueue("rc::event_record", [self.id], None, None)

    def wait(self, stream: Stream | None = None) -> None:
        return None

    def query(self) -> bool:
        self.synchronize()
        return True

    def synchronize(self) -> None:
        if self.session is not None:
            self.session.synchronize()

    def elapsed_time(self, end_event: Event) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.session is None or end_event.session is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return float(self.session.request("rc::event_elapsed", [self.id, end_event.id]))

    def __del__(self) -> None:
        s = self.session
        if s is not None and not s.closed:
            s.drop_object("rc::event_free", self.id)


# ---------------------------------------------------------------------- memory
def _memory(device: Any = None) -> dict:
    return _session(device).request("rc::memory", [])


def memory_allocated(device: Any = None) -> int:
    return _memory(device)["allocated"]


def memory_reserved(device: Any = None) -> int:
    return _memory(device)["reserved"]


def max_memory_allocated(device: Any = None) -> int:
    return _memory(device)["peak"]


def max_memory_reserved(device: Any = None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


#: the counters CUDA's caching allocator reports (``torch.cuda.memory_stats``), each pool's and
#: metric's: code that reads one by name (a trainer's memory monitor) finds it
_POOL_STATS = ("allocation", "allocated_bytes", "segment", "reserved_bytes", "active", "active_bytes",
               "inactive_split", "inactive_split_bytes", "requested_bytes")
_METRICS = ("current", "peak", "allocated", "freed")
_COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
             "num_oom_rejections", "max_split_size")


def memory_stats(device: Any = None) -> dict[str, int]:
    """The allocator's counters by CUDA's names. A CUDA gateway sends its allocator's own; a CPU
    one knows the bytes its session holds (current and peak) and what it keeps for reuse, so the
    byte figures say those and the counters it does not keep are 0."""
    m = _memory(device)
    if "stats" in m:
        return dict(sorted(m["stats"].items()))
    stats = dict.fromkeys([f"{k}.{pool}.{w}" for k in _POOL_STATS for pool in ("all", "large_pool", "small_pool")
                           for w in _METRICS] + [f"oversize_{k}.{w}" for k in ("allocations", "segments")
                                                 for w in _METRICS] + list(_COUNTERS), 0)
    for k in ("allocated_bytes", "active_bytes", "requested_bytes"):
        stats[f"{k}.all.current"], stats[f"{k}.all.peak"] = m["allocated"], m["peak"]
    stats["reserved_bytes.all.current"] = m["reserved"]
    stats["reserved_bytes.all.peak"] = max(m["reserved"], m["peak"])
    stats["max_split_size"] = -1  # (CUDA's value when no max_split_size_mb is configured)
    return dict(sorted(stats.items()))


def memory_stats_as_nested_dict(device: Any = None) -> dict:
    nested: dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        *path, leaf = key.split(".")
        level = nested
        for part in path:
            level = level.setdefault(part, {})
        level[leaf] = value
    return nested


def memory_snapshot(mempool_id: Any = None) -> list:
    """The current device's gateway allocator's segments (none on a CPU gateway)."""
    return list(_info("memory_snapshot"))


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Caps what the device's session may allocate at ``fraction`` of the GPU's memory, on the
    gateway (its worker is the process): past it, allocating raises ``torch.OutOfMemoryError``."""
    i = device_index(device)
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _session(i).request("rc::memory_fraction", [fraction])


def get_per_process_memory_fraction(device: Any = None) -> float:
    return float(_session(device).request("rc::memory_fraction", [None]))


# page-locked host memory is never allocated here (interception._pin_memory): its counters stay 0
_HOST_STATS = [f"{k}.{w}" for k in ("allocations", "allocated_bytes", "active_requests", "active_bytes")
               for w in ("current", "peak", "allocated", "freed")] + ["num_host_alloc", "num_host_free"] + [
    f"{k}.{w}" for k in ("host_alloc_time", "host_free_time") for w in ("total", "max", "min", "count", "avg")]


def host_memory_stats() -> dict[str, Any]:
    return dict.fromkeys(_HOST_STATS, 0)


def host_memory_stats_as_nested_dict() -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key in _HOST_STATS:
        head, _, leaf = key.partition(".")
        if leaf:
            nested.setdefault(head, {})[leaf] = 0
        else:
            nested[head] = 0
    return nested


def reset_peak_host_memory_stats() -> None:
    return None


def reset_accumulated_host_memory_stats() -> None:
    return None


def get_allocator_backend() -> str:
    return str(_info("get_allocator_backend"))


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A readable table of the gateway's memory figures for the device (what ``rc::memory``
    reports: CUDA's allocator has more counters than a gateway sends)."""
    dev = _device(device)
    m = _memory(device)

    def mib(n: int) -> str:
        return f"{n / 2**20:12.1f} MiB"
    rows = [("Allocated memory", mib(m["allocated"])), ("Peak allocated", mib(m["peak"])),
            ("Reserved memory", mib(m["reserved"])), ("Free on the GPU", mib(m["free"])),
            ("GPU total", mib(m["total"]))]
    line = "|" + "=" * 75 + "|"
    title = f" RemoteCUDA memory summary, device ID {dev.index}: {get_device_name(device)}"
    return "\n".join([line, f"|{title[:75]:<75}|", line]
                     + [f"| {k:<30}|{v:>43}|" for k, v in rows] + [line]) + "\n"


def reset_peak_memory_stats(device: Any = None) -> None:
    _session(device).request("rc::reset_peak", [])


def reset_accumulated_memory_stats(device: Any = None) -> None:
    device_index(device)  # memory_stats has no accumulated counters (only current and peak) to reset


def empty_cache() -> None:
    for s in list(_rt().pool.sessions.values()):
        if s.connected:  # (a session not placed yet holds no memory)
            s.request("rc::empty_cache", [])


def mem_get_info(device: Any = None) -> tuple[int, int]:
    m = _memory(device)
    return (m["free"], m["total"])


def ipc_collect() -> None:
    return None


# ---------------------------------------------------------------------- random numbers
def manual_seed(seed: int) -> None:
    _session().enqueue("rc::seed", [seed_value(seed)], None, None)


def manual_seed_all(seed: int) -> None:
    rt = _rt()
    rt.seed = seed_value(seed)
    for s in list(rt.pool.sessions.values()):
        s.enqueue("rc::seed", [rt.seed], None, None)


def seed() -> None:
    import random
    manual_seed(random.getrandbits(63))


def seed_all() -> None:
    import random
    manual_seed_all(random.getrandbits(63))


def initial_seed() -> int:
    return int(_session().request("rc::initial_seed", []))


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    """The gateway generator's state (activation checkpointing and ``fork_rng`` restore it to
    replay dropout exactly)."""
    return torch.frombuffer(bytearray(_session(device).request("rc::rng_get", [])), dtype=torch.uint8)


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    _session(device).enqueue("rc::rng_set", [state_bytes(new_state)], None, None)


def default_generators() -> tuple[torch._C.Generator, ...]:
    """``torch.cuda.default_generators`` while active: one per device, the same objects each time."""
    from .generator import DefaultCudaGenerator
    made = _rt().default_generators
    for i in range(device_count()):
        if i not in made:
            made[i] = DefaultCudaGenerator(i, _session)
    return tuple(made[i] for i in range(device_count()))


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: Any) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


_ORIGINAL_GENERATOR = torch._C.Generator


class _GeneratorType(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _ORIGINAL_GENERATOR)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _ORIGINAL_GENERATOR)

    def __call__(cls, device: Any = "cpu") -> torch._C.Generator:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if d.type == "cuda":
            return CudaGenerator(_rt().session(d.index))
        return _ORIGINAL_GENERATOR(device)


class Generator(metaclass=_GeneratorType):
    """Stands in for ``torch.Generator`` while active: 'cuda' ones live on the gateway
    (generator.py), CPU generators are made as before."""


def _lazy_init() -> None:
    """CUDA initialized now, as far as forked children are concerned (``Runtime.initialized``)."""
    _rt().asked = True


#: activation checkpointing saves and restores the device generators only once CUDA is initialised
_initialized = True


# ---------------------------------------------------------------------- NVTX
# profiler ranges mark a local GPU's timeline; there is none here (a CPU-only torch raises)
def range_push(msg: str) -> int:
    return 0


def range_pop() -> int:
    return 0


def range_start(msg: str) -> int:
    return 0


def range_end(range_id: int) -> None:
    return None


def mark(msg: str) -> None:
    return None


class _Cudart:
    """``torch.cuda.cudart()``, the CUDA runtime a program calls itself: ``cudaProfilerStart`` and
    ``Stop`` (``torch.cuda.profiler.start``, ``profile()``) bound a local profiler's capture
    (``nsys --capture-range=cudaProfilerApi``) as NVTX ranges mark its timeline, and there is no
    local GPU to capture, so they succeed doing nothing; the rest would act on a local GPU."""

    class cudaError:  # noqa: N801  (what torch.cuda.check_error compares with)
        success = 0

    @staticmethod
    def cudaProfilerStart() -> int:  # noqa: N802  (CUDA's name)
        return 0

    @staticmethod
    def cudaProfilerStop() -> int:  # noqa: N802
        return 0

    def __getattr__(self, name: str) -> Any:
        raise NotImplementedError(f"remotecuda: torch.cuda.cudart().{name} calls the CUDA runtime of a GPU in this "
                                  "process, and the GPUs are on gateways; it is not supported")


_CUDART = _Cudart()


def cudart() -> _Cudart:
    return _CUDART


#: what replaces torch.cuda.<name> while active
REPLACEMENTS = LOCAL_ONLY | {name: obj for name, obj in dict(globals()).items() if name in {
    "is_available", "is_initialized", "init", "device_count", "current_device", "set_device",
    "get_device_name", "get_device_capability", "get_device_properties", "is_bf16_supported",
    "get_arch_list", "device", "device_of", "synchronize", "Stream", "Event", "stream",
    "StreamContext", "current_stream", "default_stream", "set_stream", "memory_allocated",
    "memory_reserved", "max_memory_allocated", "max_memory_reserved", "memory_stats",
    "reset_peak_memory_stats", "reset_accumulated_memory_stats", "empty_cache",
    "mem_get_info", "memory_summary", "memory_stats_as_nested_dict", "memory_snapshot",
    "set_per_process_memory_fraction", "get_per_process_memory_fraction", "get_allocator_backend",
    "get_gencode_flags", "can_device_access_peer", "get_sync_debug_mode", "set_sync_debug_mode",
    "utilization", "memory_usage", "temperature", "power_draw", "clock_rate", "device_memory_used",
    "list_gpu_processes", "host_memory_stats", "host_memory_stats_as_nested_dict", "reset_peak_host_memory_stats",
    "reset_accumulated_host_memory_stats",
    "ipc_collect", "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state",
    "set_rng_state", "get_rng_state_all", "set_rng_state_all", "_lazy_init", "_initialized", "cudart"}}
#: what replaces torch.cuda.nvtx.<name> while active (``nvtx.range`` uses these)
NVTX_REPLACEMENTS = {name: globals()[name] for name in ("range_push", "range_pop", "range_start", "range_end", "mark")}
