"""torch's per-sample gradients by expanded weights on 'cuda' parameters.

``torch.nn.utils._per_sample_grad.call_for_per_sample_grads`` (Opacus' ``grad_sample_mode="ew"``)
wraps each parameter in an ``ExpandedWeight``, made by ``Tensor._make_subclass(cls, weight)``: a
second Python object for the weight's own C++ tensor. A parameter on 'cuda' is a wrapper that
already has its Python object (the ``RemoteTensor``), so C++ refuses the second. The
``ExpandedWeight`` never reads its own storage (its ``__torch_function__`` hands every op its
``orig_weight``; dtype, shape and device are read from it), so for a remote weight it is built on
a plain meta stand-in with the weight's metadata instead, and computes the same per-sample
gradients (``grad_sample``) as on a GPU.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import downloads
from .dispatch import meta_stand_in
from .tensor import RemoteTensor

MODULE = "torch.nn.utils._expanded_weights.expanded_weights_impl"


def _new(original: Callable) -> Callable:
    def new(cls: type, orig_weight: Any, batch_size: int, loss_reduction: str) -> torch.Tensor:
        if isinstance(orig_weight, RemoteTensor) and orig_weight.requires_grad:
            return torch.Tensor._make_subclass(cls, meta_stand_in(orig_weight), True)
        return original(cls, orig_weight, batch_size, loss_reduction)  # its own checks and errors
    return new


def _patch(patches: Any, module: Any) -> None:
    cls = module.ExpandedWeight
    patches.set(cls, "__new__", staticmethod(_new(cls.__new__)))


def install(patches: Any) -> None:
    """Patch ``ExpandedWeight.__new__`` now if torch's module is imported, else when it is."""
    downloads.on_import(patches, MODULE, _patch)
