"""The ``torch.cuda`` figures that live where the GPU is: NVML's sensors, the allocator's
snapshot, the architectures the gateway's torch was built for (``rc::cuda_info``).

On a CPU-only client torch reads these from a local NVML (pynvml) or a local CUDA build, neither
of which is there; the session's worker answers them for its device instead. On a CUDA device it
calls torch's own function, so the values (and the errors, e.g. without pynvml) are the
gateway's torch's. A CPU device (``remotecuda start --device cpu``, simulated GPUs included) has
no NVML: the memory in use is known (the simulated GPU's account, or the host's), the sensors
are not, and asking for them raises as torch does where the driver cannot be loaded.
"""
from __future__ import annotations

from typing import Any

import torch

from .memory_account import MemoryAccount

#: NVML's sampled figures, which a CPU device does not have
SENSORS = frozenset({"utilization", "memory_usage", "temperature", "power_draw", "clock_rate"})
#: those that take no device argument
GLOBAL = frozenset({"get_arch_list", "get_gencode_flags", "memory_snapshot", "get_allocator_backend"})
#: every name ``rc::cuda_info`` answers
NAMES = SENSORS | GLOBAL | {"device_memory_used", "list_gpu_processes"}


def query(name: str, device: torch.device, account: MemoryAccount | None, allocated: int) -> Any:
    """``torch.cuda.<name>`` for ``device`` (``account``: a simulated GPU's memory; ``allocated``:
    the bytes this session holds)."""
    if name not in NAMES:
        raise ValueError(f"remotecuda: rc::cuda_info does not answer {name!r}")
    if device.type == "cuda":
        if name in GLOBAL:
            return getattr(torch.cuda, name)()
        return getattr(torch.cuda, name)(device)
    if name in SENSORS:
        raise RuntimeError(f"torch.cuda.{name}() reads NVML, and this gateway runs on the CPU (remotecuda start "
                           "--device cpu): it has no GPU sensors to read")
    if name == "device_memory_used":
        if account is not None:
            return account.used()
        import psutil
        vm = psutil.virtual_memory()
        return vm.total - vm.available
    if name == "list_gpu_processes":
        gpu = account.gpu if account is not None else 0
        return f"GPU:{gpu}\nno NVML on this gateway (it runs on the CPU): this session holds {allocated / 2**20:.3f} MB"
    if name == "get_gencode_flags":
        return ""
    if name == "get_allocator_backend":
        return "native"
    return []  # no CUDA architectures, no caching-allocator segments
