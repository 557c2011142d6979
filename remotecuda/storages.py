"""A storage made on 'cuda' by its constructor.

``torch.UntypedStorage(n, device='cuda')``, and through it every TypedStorage made on the device
(``torch.TypedStorage(n, dtype=..., device='cuda')``, the legacy ``torch.cuda.FloatStorage(n)``,
both of which build their bytes with it), is refused by a CPU-only torch's C++ ("Storage device
not recognized: cuda"). A storage on a remote device is the storage of a byte tensor made there
(tensor.py's ``RemoteStorage``), which holds the gateway's memory as a GPU's storage holds its
own: so the constructor makes that tensor and gives its storage.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch


def untyped_storage_new(original: Callable, args: tuple, kwargs: dict) -> Any:
    """``UntypedStorage.__new__(cls, [size | sequence], *, device=...)``: on 'cuda', ``size``
    uninitialized bytes, or a sequence's bytes (read and checked by C++ on the CPU, then moved),
    on the device named (the current one for a bare 'cuda'); elsewhere torch's own."""
    device = kwargs.get("device")
    if device is None or torch.device(device).type != "cuda":
        return original(*args, **kwargs)
    _, *rest = args  # (the class: a subclass's, RemoteStorage's own among them, is made as UntypedStorage's)
    try:
        size = operator.index(rest[0]) if len(rest) == 1 else None
    except TypeError:
        size = None
    if size is not None and len(kwargs) == 1:
        return torch.empty(size, dtype=torch.uint8, device=device).untyped_storage()
    on_cpu = original(torch.UntypedStorage, *rest, **{**kwargs, "device": "cpu"})
    return torch.empty(0, dtype=torch.uint8).set_(on_cpu).to(device).untyped_storage()
