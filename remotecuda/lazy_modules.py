"""A lazy module's parameters on 'cuda' before its first forward pass (``nn.LazyLinear``, PyG's
``GCNConv(-1, 16)``, ``SAGEConv((-1, -1), 16)`` under ``to_hetero``): moved to 'cuda', then
materialized there by the first forward, as on a GPU.

An ``UninitializedParameter`` is a second Python object made on its data by ``_make_subclass``,
which a remote tensor (a wrapper that already has its Python object) cannot be. So one sent to
'cuda' stays an empty local tensor that remembers its device and names it (``.device``,
``.is_cuda``), and at ``materialize`` becomes, in place (``swap_tensors``), a remote tensor of the
shape asked for: the module, and anything that held the parameter, keep the same object.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import runtime

_INDEX = "_remotecuda_device_index"
_TENSOR_DEVICE = vars(torch._C.TensorBase)["device"].__get__


def to_cuda(t: torch.Tensor, index: int) -> torch.Tensor:
    """``t.to('cuda:index')`` of an uninitialized tensor: itself, to be materialized on that device."""
    setattr(t, _INDEX, index)
    return t


def to_local(t: torch.Tensor) -> None:
    """An uninitialized tensor moved to a local device: materialized there again."""
    vars(t).pop(_INDEX, None)


def _cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    to_local(self)
    return torch.Tensor.cpu(self, *args, **kwargs)


def _index(t: torch.Tensor) -> int | None:
    return vars(t).get(_INDEX)


def _materialize(original: Callable) -> Callable:
    def materialize(self: Any, shape: Any, device: Any = None, dtype: Any = None) -> None:
        index = _index(self)
        if index is None or (device is not None and torch.device(device).type != "cuda"):
            original(self, shape, device, dtype)
            return
        made = torch.empty(shape, device=device or torch.device("cuda", index), dtype=dtype or self.data.dtype)
        if self.cls_to_become is torch.nn.Parameter:
            made = torch.nn.Parameter(made, self.requires_grad)
        else:
            made.requires_grad_(self.requires_grad)
        to_local(self)
        vars(made).update(vars(self))  # (a buffer's ``persistent``...)
        torch.utils.swap_tensors(self, made)
    return materialize


def _new(original: Callable) -> Callable:
    """``UninitializedParameter(requires_grad, device, dtype...)`` given 'cuda'
    (``nn.LazyLinear(3, device='cuda')``)."""
    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        if device is None or not runtime.active_here() or torch.device(device).type != "cuda":
            return original(cls, *args, **kwargs)
        if "device" in kwargs:
            kwargs["device"] = None
        else:
            args = (args[0], None, *args[2:])
        index = torch.device(device).index
        return to_cuda(original(cls, *args, **kwargs), torch.cuda.current_device() if index is None else index)
    return staticmethod(new)


def _deepcopy(original: Callable) -> Callable:
    def deepcopy(self: Any, memo: dict) -> Any:
        copied = original(self, memo)
        index = _index(self)
        return copied if index is None else to_cuda(copied, index)
    return deepcopy


def _device(self: torch.Tensor) -> torch.device:
    index = _index(self)
    return _TENSOR_DEVICE(self) if index is None else torch.device("cuda", index)


def install(patches: Any) -> None:
    """After the routes: the methods a lazy tensor allows include the patched ones."""
    mixin = vars(torch.nn.parameter)["UninitializedTensorMixin"]  # (not in its stub)
    patches.set(mixin, "materialize", _materialize(mixin.materialize))
    patches.set(mixin, "device", property(_device))
    patches.set(mixin, "cpu", _cpu)
    patches.set(mixin, "is_cuda", property(lambda self: _device(self).type == "cuda"))
    # a lazy module's methods allowed before it materializes: the patched ones too
    allowed = mixin._allowed_methods
    patches.set(mixin, "_allowed_methods", [*allowed, *(getattr(torch.Tensor, f.__name__) for f in allowed
                                                        if getattr(torch.Tensor, f.__name__, f) is not f)])
    for cls in (torch.nn.UninitializedParameter, torch.nn.UninitializedBuffer):
        patches.set(cls, "__new__", _new(cls.__new__))
    param = torch.nn.UninitializedParameter
    patches.set(param, "__deepcopy__", _deepcopy(param.__deepcopy__))

