"""'cuda' storages where torch's Python meets them: made by a constructor, saved and pickled.

``torch.UntypedStorage(n, device='cuda')``, and through it every TypedStorage made on the device
(``torch.TypedStorage(n, dtype=..., device='cuda')``, the legacy ``torch.cuda.FloatStorage(n)``,
both of which build their bytes with it), is refused by a CPU-only torch's C++ ("Storage device
not recognized: cuda"). A storage on a remote device is the storage of a byte tensor made there
(tensor.py's ``RemoteStorage``), which holds the gateway's memory as a GPU's storage holds its
own: so the constructor makes that tensor and gives its storage.

Such a storage is a ``RemoteStorage``, which ``torch.is_storage`` (a lookup of the exact class
among torch's storage classes) did not know: ``torch.save`` and ``pickle`` of one then took it
for a plain object and recursed through ``_StorageBase.__reduce__`` (which saves it again). While
active ``torch.is_storage`` knows it, and it is saved under ``UntypedStorage``'s name, as a GPU's
storage is. (It is not added to ``torch._storage_classes`` itself: the weights-only unpickler
makes every class there a legacy storage type it can name, and a RemoteStorage is none.)
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from .tensor import RemoteStorage


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


def _normalize_storage_type(original: Callable) -> Callable:
    """``torch.serialization.normalize_storage_type``, the class a saved storage names by its name
    in ``torch``: a RemoteStorage is saved as the ``UntypedStorage`` it stands for."""
    def normalize_storage_type(storage_type: type) -> Any:
        return original(torch.UntypedStorage if issubclass(storage_type, RemoteStorage) else storage_type)
    return normalize_storage_type


def _is_storage(original: Callable) -> Callable:
    """``torch.is_storage``: a RemoteStorage is one, as a GPU's storage is."""
    def is_storage(obj: Any) -> bool:
        return type(obj) is RemoteStorage or original(obj)
    return is_storage


def _typed_iter(original: Callable) -> Callable:
    """``TypedStorage.__iter__`` (``tolist()``, ``list(s)``): over a RemoteStorage, its elements
    from one copy to the host, where torch's reads one element a round trip."""
    def __iter__(self: torch.TypedStorage) -> Any:
        if isinstance(self._untyped_storage, RemoteStorage):
            return iter(self.cpu())
        return original(self)
    return __iter__


def _typed_str(original: Callable) -> Callable:
    """``TypedStorage.__str__`` (and its repr): over a RemoteStorage, torch's text of one copy of
    its elements, with its own class, dtype, device and size, where torch's reads one element a
    round trip."""
    def __str__(self: torch.TypedStorage) -> str:
        if not isinstance(self._untyped_storage, RemoteStorage):
            return original(self)
        text = original(self.cpu())
        info = f"[{torch.typename(self)}(dtype={self.dtype}, device={self.device}) of size {len(self)}]"
        return text[:text.rindex("\n") + 1] + info
    return __str__


def install(patches: Any) -> None:
    """A RemoteStorage known to ``torch.is_storage``, saved as an ``UntypedStorage``; a TypedStorage
    over one read whole."""
    patches.set(torch, "is_storage", _is_storage(torch.is_storage))
    patches.set(torch.TypedStorage, "__iter__", _typed_iter(torch.TypedStorage.__iter__))
    patches.set(torch.TypedStorage, "__str__", _typed_str(torch.TypedStorage.__str__))
    patches.set(torch.serialization, "normalize_storage_type",
                _normalize_storage_type(torch.serialization.normalize_storage_type))
