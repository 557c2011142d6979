"""``torch.save`` / ``torch.load`` across the boundary.

Saving: a RemoteTensor pickles as a CPU tensor rebuilt on 'cuda:N' by
``torch._utils._rebuild_device_tensor_from_cpu_tensor`` (see tensor.py), which plain
torch on a GPU machine loads as a real CUDA tensor, and ``weights_only`` allows.
``torch.save`` first finds every remote tensor in the object (a pickling pass that writes
nothing and stops at tensors) and fetches them together (downloads.py): one round trip
for a whole checkpoint, not one per tensor.

Loading: a checkpoint whose storages are located on 'cuda' (written on a GPU machine)
cannot be restored by a CPU-only torch. A deserializer registered for 'cuda'
locations keeps such storages on the CPU and remembers them; ``torch.load`` then moves
the tensors built on them to the remote device, and honours ``map_location='cuda'`` by
moving every tensor.
"""
from __future__ import annotations

import pickle
import threading
from typing import Any

import torch

from . import downloads
from .tensor import RemoteTensor

_loading = threading.local()


def _tag(obj: Any) -> None:
    return None  # saving is handled by RemoteTensor.__reduce_ex__


def _deserialize(obj: Any, location: str) -> Any:
    if isinstance(location, str) and location.startswith("cuda"):
        seen = getattr(_loading, "cuda_storages", None)
        if seen is None:  # not inside remotecuda's torch.load: let torch say what it says
            return None
        seen[obj.data_ptr()] = _index(location)
        return obj
    return None


def _index(location: str) -> int:
    _, _, idx = location.partition(":")
    return int(idx) if idx.isdigit() else 0


def _map_location_device(map_location: Any) -> torch.device | None:
    if isinstance(map_location, (str, torch.device)):
        d = torch.device(map_location)
        return d
    return None


def _move(obj: Any, target: Any, seen_ptrs: dict, memo: dict) -> Any:
    """Move loaded tensors to where they belong; keeps shared tensors shared."""
    if id(obj) in memo:
        return memo[id(obj)]
    out = obj
    if isinstance(obj, torch.nn.Module):
        if target is not None and target.type == "cuda":
            obj.to(target)
        out = obj
    elif isinstance(obj, torch.Tensor):
        if isinstance(obj, RemoteTensor):
            if target is not None and target.type == "cpu":
                out = obj.cpu()
        else:
            dest = None
            if target is not None and target.type == "cuda":
                dest = target
            elif obj.numel() and obj.untyped_storage().data_ptr() in seen_ptrs:
                dest = torch.device("cuda", seen_ptrs[obj.untyped_storage().data_ptr()])
            if dest is not None:
                moved = obj.to(dest)
                if isinstance(obj, torch.nn.Parameter):
                    moved = torch.nn.Parameter(moved, requires_grad=obj.requires_grad)
                out = moved
    elif isinstance(obj, dict):
        new: Any = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            new[k] = _move(v, target, seen_ptrs, memo)
        if hasattr(obj, "_metadata"):
            new._metadata = obj._metadata
        out = new
    elif isinstance(obj, list):
        out = [_move(v, target, seen_ptrs, memo) for v in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        out = tuple(_move(v, target, seen_ptrs, memo) for v in obj)
    memo[id(obj)] = out
    return out


class _Finder(pickle.Pickler):
    """Pickles into nothing, only to list the remote tensors an object holds."""

    class _Nowhere:
        def write(self, data: Any) -> None:
            pass

    def __init__(self) -> None:
        super().__init__(self._Nowhere(), protocol=2)
        self.found: list[RemoteTensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            if isinstance(obj, RemoteTensor):
                self.found.append(obj)
            return 0  # (a tensor's contents are not walked)
        return None


def remote_tensors(obj: Any) -> list[RemoteTensor]:
    """The remote tensors that pickling ``obj`` would save; none if it does not pickle (then
    ``torch.save`` raises its own error)."""
    finder = _Finder()
    try:
        finder.dump(obj)
    except Exception:
        return []
    return finder.found


def _make_load(original: Any) -> Any:
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        target = _map_location_device(map_location)
        _loading.cuda_storages = {}
        try:
            ml = "cpu" if target is not None and target.type == "cuda" else map_location
            result = original(f, ml, *args, **kwargs)
            return _move(result, target, _loading.cuda_storages, {})
        finally:
            _loading.cuda_storages = None
    load.__doc__ = original.__doc__
    load.__wrapped__ = original  # type: ignore[attr-defined]  # (as functools.wraps sets it)
    return load


_registered = False


def install(patches: Any) -> None:
    global _registered
    if not _registered:  # torch has no unregister; the deserializer is inert unless loading
        torch.serialization.register_package(0, _tag, _deserialize)
        _registered = True
    patches.set(torch, "load", _make_load(torch.load))
    patches.set(torch, "save", downloads.prefetched(torch.save, lambda obj, *a, **kw: remote_tensors(obj)))
    patches.set(torch.serialization, "save", torch.save)
    patches.set(torch.serialization, "load", torch.load)
