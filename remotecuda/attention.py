"""``F.scaled_dot_product_attention`` as the fused kernel the gateway's device would pick.

SDPA is a composite op: on the client it would decompose (on meta tensors) into the
~22-op math path, so a GPU would run many small kernels instead of one flash, memory-efficient
or cuDNN attention kernel. Instead the client asks the gateway once per input signature which
backend its device picks (``aten._fused_sdp_choice``; the answers are kept by the runtime,
as they depend on the gateways' GPUs) and then does what PyTorch's own
``scaled_dot_product_attention`` (aten/src/ATen/native/transformers/attention.cpp) does for
that backend: the same mask conversion and padding, then the backend's aten op. Those ops
have meta kernels and autograd formulas, so the backward runs the fused kernel too.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from . import flags, nested, runtime
from .tensor import RemoteTensor, contiguous_strides, layout, wrap

aten = torch.ops.aten
MATH, FLASH, EFFICIENT, CUDNN = 0, 1, 2, 3


def _bind(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
          scale: float | None = None, enable_gqa: bool = False) -> tuple:
    """The arguments by ``F.scaled_dot_product_attention``'s own names: diffusers' attention
    dispatch passes ``query=``, ``key=``, ``value=`` by keyword."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _additive(mask: Any, dtype: torch.dtype, fill: float) -> Any:
    """A boolean mask (True: attend) as the additive float mask the kernels take
    (``convert_boolean_attn_mask``; cuDNN's variant fills -65504 instead of -inf)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype, device=mask.device))


def _efficient_mask(mask: Any, q: Any, k: Any) -> Any:
    """``preprocess_mask``: the memory-efficient kernel wants the bias's rows 8-aligned in memory
    (pad, then slice back) and the bias expanded to (batch, heads, L, S)."""
    if not (all(s % 8 == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1):
        n = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - n % 8))[..., :n]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _cuda_flash(q: Any, k: Any, v: Any, p: float, causal: bool, scale: float | None) -> Any:
    """CUDA flash attention: head dims padded to a multiple of 8, the scale taken from the
    original head dim, the output sliced back."""
    e = q.shape[-1]
    if e % 8:
        q, k, v = (F.pad(t, (0, 8 - e % 8)) for t in (q, k, v))
    out = aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False,
                                                  scale=scale if scale is not None else 1.0 / math.sqrt(e))[0]
    return out[..., :e] if out.shape[-1] != e else out


def _on_gateway(q: Any, k: Any, v: Any, mask: Any, causal: bool, scale: float | None, gqa: bool) -> Any:
    """One ``rc::sdpa``: the gateway's own ``scaled_dot_product_attention`` (its backend its
    device's pick), the output contiguous. A decode's every step has a new key length, so asking
    for the choice (``rc::sdp_choice``) would be a round trip per token."""
    s = q._s
    h = s.new_handle()
    s.enqueue("rc::sdpa", [q._w, k._w, v._w, None if mask is None else mask._w, causal, scale, gqa], None, [h])
    return wrap(s, h, _dense((*q.shape[:-1], v.shape[-1]), q.dtype))


def _dense(shape: tuple, dtype: torch.dtype) -> tuple:
    return layout(shape, contiguous_strides(shape), 0, dtype)


def sdpa(func: Callable, args: tuple, kwargs: dict) -> Any:
    if torch._C._get_tracing_state() is not None:
        # torch.jit.trace records the one ``aten::scaled_dot_product_attention`` a GPU's trace holds,
        # which runs anywhere the module goes; a backend's op picked here would tie the graph to the
        # gateway's device (and a pick that depends on whether the mask needs a gradient gave the
        # trace's check, run without gradients, another graph)
        return func(*args, **kwargs)
    try:
        q, k, v, mask, p, causal, scale, gqa = _bind(*args, **kwargs)
    except TypeError:
        return func(*args, **kwargs)  # a misnamed or missing argument: torch's parser's TypeError, in its words
    if type(causal) is not bool or type(gqa) is not bool:
        return func(*args, **kwargs)  # torch's argument parser refuses it (a numpy bool): its TypeError
    # as torch's parser takes them: a numpy scalar or a one-element tensor is a float (each would
    # reach the gateway's rc:: ops as an argument the wire cannot carry)
    p, scale = float(p), None if scale is None else float(scale)
    if type(q) is not RemoteTensor and nested.inner_remote(q) is not None and q.dim() == 4 and q._ragged_idx == 2:
        return nested.sdpa(F.scaled_dot_product_attention, q, k, v, mask, p, causal, scale, gqa)
    if not all(isinstance(t, RemoteTensor) for t in (q, k, v)) or \
            (mask is not None and not isinstance(mask, RemoteTensor)):
        return func(*args, **kwargs)
    rt = runtime.current()
    kind = rt.device(q._dev).kind
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    key = (kind, q._k, k._k, v._k, None if mask is None else mask._k, p > 0, causal, scale, gqa, grad,
           flags.sdp_backends())
    if kind == "cpu" and mask is not None and mask.requires_grad:
        return func(*args, **kwargs)  # CPU's check_attn_mask_shape; the gateway's mask has no grad
    if rt.decoding and not grad and not p:
        return _on_gateway(q, k, v, mask, causal, scale, gqa)
    choice = rt.sdpa_choices.get(key)
    if choice is None:  # asked with `grad`: the gateway's tensors never require it, and the choice depends on it
        choice = rt.sdpa_choices[key] = int(q._s.request("rc::sdp_choice", [
            t._h if t is not None else None for t in (q, k, v, mask)] + [p, causal, scale, gqa, grad]))
    if choice == CUDNN and kind == "cuda":
        return aten._scaled_dot_product_cudnn_attention(q, k, v, _additive(mask, q.dtype, -65504.0), grad, p,
                                                        causal, False, scale=scale)[0]
    if choice == FLASH and kind == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, p, causal, attn_mask=_additive(mask, q.dtype, -math.inf), scale=scale)[0]
    if choice == FLASH and kind == "cuda":
        return _cuda_flash(q, k, v, p, causal, scale)  # (flash is never chosen with a mask)
    if choice == EFFICIENT and kind == "cuda":
        mask = _additive(mask, q.dtype, -math.inf)
        if mask is not None:
            mask = _efficient_mask(mask, q, k)
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, grad, p, causal, scale=scale)[0]
    return func(*args, **kwargs)  # the math path, which the composite takes on the client too
