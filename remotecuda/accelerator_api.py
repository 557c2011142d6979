"""``torch.accelerator.*`` answered by the gateways.

Current PyTorch examples pick their device with ``torch.accelerator`` rather than
``torch.cuda``; on a CPU-only build it says there is no accelerator, and such code would
run on the client's CPU without a word. While remotecuda is active these functions
(also in ``torch.accelerator.memory``) are replaced by the ones here, which speak for
the virtual 'cuda' devices through ``cuda_api`` (and are restored on deactivation).
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import torch

from . import cuda_api

_CUDA = torch.device("cuda")


# the same answers as torch.cuda's (their device arguments may also be given by keyword)
device_count = cuda_api.device_count
current_device_index = cuda_api.current_device
current_stream = cuda_api.current_stream
synchronize = cuda_api.synchronize
memory_allocated = cuda_api.memory_allocated
max_memory_allocated = cuda_api.max_memory_allocated
memory_reserved = cuda_api.memory_reserved
max_memory_reserved = cuda_api.max_memory_reserved
reset_peak_memory_stats = cuda_api.reset_peak_memory_stats
reset_accumulated_memory_stats = cuda_api.reset_accumulated_memory_stats
empty_cache = cuda_api.empty_cache
get_memory_info = cuda_api.mem_get_info


is_available = cuda_api.is_available  # (False when CUDA_VISIBLE_DEVICES hides every device)


def current_accelerator(check_available: bool = False) -> torch.device | None:
    return _CUDA if not check_available or is_available() else None


def current_device_idx() -> int:
    warnings.warn("Use `current_device_index` instead.", FutureWarning, stacklevel=2)
    return current_device_index()


def set_device_index(device: Any, /) -> None:
    cuda_api.set_device(device)  # a negative index is a no-op, as in torch


def set_device_idx(device: Any, /) -> None:
    warnings.warn("Use `set_device_index` instead.", FutureWarning, stacklevel=2)
    set_device_index(device)


class device_index:
    """``with torch.accelerator.device_index(i):`` makes cuda:i current; None changes nothing."""

    def __init__(self, device: int | None, /) -> None:
        self.idx = device
        self.prev_idx = -1

    def __enter__(self) -> None:
        if self.idx is not None:
            self.prev_idx = current_device_index()
            set_device_index(self.idx)

    def __exit__(self, *exc_info: object) -> None:
        if self.idx is not None:
            set_device_index(self.prev_idx)


def set_stream(stream: cuda_api.Stream) -> None:
    """Makes ``stream`` current, and its device too (as torch does)."""
    cuda_api.set_stream(stream)
    set_device_index(stream.device.index)


def get_device_capability(device: Any = None, /) -> dict[str, Any]:
    """The dtypes a CUDA device allocates and converts between: all but the quantized ones."""
    cuda_api.device_index(device)  # (a bad device raises)
    dtypes = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    return {"supported_dtypes": {d for d in dtypes if not str(d).startswith(("torch.qint", "torch.quint"))}}


# ---------------------------------------------------------------------- torch.Stream, torch.Event
class _OnAccelerator(type):
    """A stand-in for torch's device-generic ``torch.Stream`` / ``torch.Event``: with no device
    (the current accelerator), an index or a 'cuda' one, the 'cuda' class here; torch's own for
    the CPU. (transformers' offloaded KV cache prefetches on a ``torch.Stream()``.)"""

    original: type
    on_cuda: type
    make: Any

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, (cls.original, cls.on_cuda))

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, (cls.original, cls.on_cuda))

    def __call__(cls, device: Any = None, *args: Any, **kwargs: Any) -> Any:
        if device is None or isinstance(device, int) or torch.device(device).type == "cuda":
            return cls.make(device, *args, **kwargs)
        return cls.original(device, *args, **kwargs)


class Stream(metaclass=_OnAccelerator):
    """Stands in for ``torch.Stream`` while active."""

    original, on_cuda = torch.Stream, cuda_api.Stream
    make = staticmethod(cuda_api.Stream)


class Event(metaclass=_OnAccelerator):
    """Stands in for ``torch.Event`` while active (a 'cuda' event names no device: it is
    recorded on its stream's)."""

    original, on_cuda = torch.Event, cuda_api.Event

    @staticmethod
    def make(device: Any, **kwargs: Any) -> cuda_api.Event:
        return cuda_api.Event(**kwargs)


#: what replaces torch.<name> while active
TORCH_REPLACEMENTS = {"Stream": Stream, "Event": Event}

_local_accelerator = torch._C._get_accelerator


def _get_accelerator(check: bool = False) -> torch.device:
    """``torch._C._get_accelerator``: the machine's accelerator as ``torch.get_device_module()``
    and device-generic library code (transformers' continuous batching, FSDP) ask for it."""
    return _CUDA if is_available() else _local_accelerator(check)


#: what replaces torch._C.<name> while active
C_REPLACEMENTS = {"_get_accelerator": _get_accelerator}


# ---------------------------------------------------------------------- memory
def memory_stats(device_index: Any = None, /) -> OrderedDict[str, Any]:
    return OrderedDict(sorted(cuda_api.memory_stats(device_index).items()))


def empty_host_cache() -> None:
    return None  # no page-locked host memory is ever allocated here (see interception._pin_memory)


_MEMORY = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
           "memory_stats", "reset_peak_memory_stats", "reset_accumulated_memory_stats", "empty_cache",
           "empty_host_cache", "get_memory_info")

#: what replaces torch.accelerator.<name> while active
REPLACEMENTS = {name: globals()[name] for name in (
    "is_available", "current_accelerator", "device_count", "current_device_index", "current_device_idx",
    "set_device_index", "set_device_idx", "device_index", "current_stream", "set_stream", "synchronize",
    "get_device_capability", *_MEMORY)}
#: what replaces torch.accelerator.memory.<name> while active
MEMORY_REPLACEMENTS = {name: globals()[name] for name in _MEMORY}
