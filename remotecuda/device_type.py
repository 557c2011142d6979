"""``torch.device`` while active: ``torch.device(0)`` is 'cuda:0', as on a GPU machine.

A bare index means the machine's accelerator, and a CPU-only torch's C++ constructor refuses it
("Cannot access accelerator device when none is available"). Libraries build devices from
indices all the time (transformers' ``device_map={"": 0}`` and ``device_map="auto"``,
accelerate's ``infer_auto_device_map``), so ``torch.device`` is replaced by a stand-in whose
instances are torch's own devices, as ``torch.Generator``'s is (cuda_api.py). Devices pickle by
the name ``torch.device``, so their reducer names whichever class that is at the moment.
"""
from __future__ import annotations

import copyreg
from typing import Any

import torch

#: torch's own class (``torch._C.device``), whatever ``torch.device`` names at the moment
DEVICE = torch._C.device


class _DeviceType(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, DEVICE)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, DEVICE)

    # equal to torch's class, so that tables keyed by it (torch.library's schema inference reads
    # a ``torch.device`` annotation) find the stand-in too
    def __eq__(cls, other: object) -> bool:
        return other is cls or other is DEVICE

    def __hash__(cls) -> int:
        return hash(DEVICE)

    def __call__(cls, *args: Any, **kwargs: Any) -> torch.device:
        if len(args) == 1 and not kwargs and _is_index(args[0]):
            return DEVICE("cuda", int(args[0]))
        return DEVICE(*args, **kwargs)


def _is_index(a: Any) -> bool:
    return not isinstance(a, (bool, str, DEVICE)) and hasattr(type(a), "__index__")


class Device(metaclass=_DeviceType):
    """Stands in for ``torch.device`` while active: a bare index is 'cuda:N'."""


Device.__module__, Device.__qualname__, Device.__name__ = "torch", "device", "device"


def _reduce(d: torch.device) -> tuple:
    return torch.device, (d.type,) if d.index is None else (d.type, d.index)


def install(patches: Any) -> None:
    patches.set(torch, "device", Device)
    patches.set_item(copyreg.dispatch_table, DEVICE, _reduce)
