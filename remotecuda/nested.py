"""Jagged nested tensors (``torch.nested``, ``layout=torch.jagged``) over 'cuda' values.

A jagged ``NestedTensor`` is a Python wrapper of two dense tensors, its values and offsets, and
its own ``__torch_dispatch__`` turns each op on it into ops on them, which on 'cuda' are ops on
RemoteTensors (the dispatcher lets the wrapper go first: ``tensor.wrapper_type``). Its C++
device is the one ``values.device`` gives when it is built, and a C++ tensor on 'cuda' aborts a
CPU-only build as soon as autograd records it (a model's gradient, ``requires_grad=True``): so a
nested tensor of remote values is built on meta stand-ins of them (its ragged size the one torch
keys on the real offsets), and ``Tensor.device``/``is_cuda`` answer for it with
its values' device (``inner_remote``), as a GPU's does.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from . import downloads
from .dispatch import meta_stand_in
from .tensor import RemoteTensor

MODULE = "torch.nested._internal.nested_tensor"


def _new(original: Callable, module: Any) -> Callable:
    def new(cls: type, values: Any, offsets: Any, *, lengths: Any = None, **kwargs: Any) -> torch.Tensor:
        if not isinstance(values, RemoteTensor) or not isinstance(offsets, RemoteTensor):
            return original(cls, values, offsets, lengths=lengths, **kwargs)  # its own checks and errors
        source = offsets if lengths is None else lengths
        stand_ins = {"offsets": meta_stand_in(offsets), "lengths": None if lengths is None else meta_stand_in(lengths)}
        # the ragged size torch keys on the real offsets (or lengths), given to their stand-in
        module._tensor_symint_registry[stand_ins["offsets" if lengths is None else "lengths"]] = \
            module.get_tensor_symint(source, coeff=1)
        return original(cls, meta_stand_in(values), stand_ins["offsets"], lengths=stand_ins["lengths"], **kwargs)
    return new


def _patch(patches: Any, module: Any) -> None:
    cls = module.NestedTensor
    patches.set(cls, "__new__", staticmethod(_new(cls.__new__, module)))


def install(patches: Any) -> None:
    """Patch ``NestedTensor.__new__`` now if torch's module is imported, else when it is."""
    downloads.on_import(patches, MODULE, _patch)


def inner_remote(t: torch.Tensor) -> RemoteTensor | None:
    """The remote values of a jagged nested tensor built on their stand-in, else None."""
    values = t.__dict__.get("_values")
    return values if isinstance(values, RemoteTensor) and t.layout is torch.jagged else None


def sdpa(dense: Callable, q: Any, k: Any, v: Any, mask: Any, p: float, causal: bool, scale: float | None,
         gqa: bool) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of jagged (batch, heads, ragged, dim) tensors: each
    sequence's attention by ``dense``, as one dense (1, heads, length, dim) batch. torch's own
    jagged path runs the math backend on strided nested tensors, which have no remote form (a GPU
    runs flash or memory-efficient attention on the packed values instead, where it can)."""
    if mask is not None or q._lengths is not None:
        raise NotImplementedError("remotecuda: scaled_dot_product_attention of jagged nested tensors on 'cuda' "
                                  "takes no attn_mask and no query made by torch.nested.narrow; pad them "
                                  "(to_padded_tensor) and pass a mask instead")
    outs = [dense(qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), dropout_p=p, is_causal=causal, scale=scale,
                  enable_gqa=gqa)[0].transpose(0, 1) for qi, ki, vi in zip(q.unbind(), k.unbind(), v.unbind())]
    module = sys.modules[MODULE]
    return module.nested_view_from_values_offsets(  # the query's offsets: its ragged size, as torch's path keeps
        torch.cat(outs), q.offsets(), min_seqlen=q._maybe_min_seqlen, max_seqlen=q._maybe_max_seqlen).transpose(1, 2)
