"""Other libraries' wrapper subclasses over 'cuda' tensors (PyG's ``EdgeIndex``, ``Index`` and
``HashTensor``, a user's own ``__torch_dispatch__`` class).

Such a class holds a plain tensor and makes itself with ``Tensor._make_wrapper_subclass``: a C++
tensor with no data, on the device it is given, which the class takes from the tensor it wraps
(``device=data.device``: 'cuda:N' for a remote one). On a CPU-only torch a C++ tensor on 'cuda'
fails at the first thing C++ does with that device: indexing's device guard raises "PyTorch is
not linked with support for cuda devices", and autograd, recording one that requires grad,
aborts the process. So while remotecuda is active a wrapper asked for on 'cuda' is made on
'meta', as RemoteTensor is, and keeps the device it was asked for, which ``Tensor.device``,
``is_cuda`` and ``get_device`` answer with (interception's identity properties). Its ops still
reach its own ``__torch_dispatch__`` first, which unwraps it into ops on the remote tensors.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: the ``__dict__`` key under which a wrapper made on 'meta' keeps the 'cuda' device it stands for
DEVICE_KEY = "_remotecuda_device"
_META = torch.device("meta")
#: the device's place among the positional arguments (cls, size, strides, storage_offset,
#: memory_format, dtype, layout, device, ...), where torch's parser also takes it
_DEVICE_AT = 7


def make(original: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    """``Tensor._make_wrapper_subclass(cls, size, ..., device=...)``: on 'meta' when the device is
    'cuda' (its index the current device's when it names none, as CUDA's factories read it)."""
    positional = len(args) > _DEVICE_AT
    device = args[_DEVICE_AT] if positional else kwargs.get("device")
    if device is None or torch.device(device).type != "cuda":
        return original(*args, **kwargs)
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if positional:
        out = original(*args[:_DEVICE_AT], _META, *args[_DEVICE_AT + 1:], **kwargs)
    else:
        out = original(*args, **{**kwargs, "device": _META})
    out.__dict__[DEVICE_KEY] = device
    return out


def device_of(t: torch.Tensor) -> Any:
    """The 'cuda' device a wrapper made by ``make`` stands for, or None (any other tensor)."""
    return t.__dict__.get(DEVICE_KEY)
