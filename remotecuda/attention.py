"""``F.scaled_dot_product_attention`` as the fused kernel the gateway's device would pick.

SDPA is a composite op: on the client it would decompose (on meta tensors) into the
~22-op math path, so a GPU would run many small kernels instead of one flash or
memory-efficient attention kernel. Instead the client asks the gateway once per input
signature which backend its device picks (``aten._fused_sdp_choice``) and calls that
backend's aten op directly; those ops have meta kernels and autograd formulas, so the
backward runs the fused kernel too.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .dispatch import DISPATCHER
from .tensor import RemoteTensor

aten = torch.ops.aten
MATH, FLASH, EFFICIENT = 0, 1, 2
_choices: dict[tuple, int] = {}


def _bind(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
          scale: float | None = None, enable_gqa: bool = False) -> tuple:
    return q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa


def sdpa(func: Callable, args: tuple, kwargs: dict) -> Any:
    q, k, v, mask, p, causal, scale, gqa = _bind(*args, **kwargs)
    if not all(isinstance(t, RemoteTensor) for t in (q, k, v)) or gqa or \
            (mask is not None and not isinstance(mask, RemoteTensor)):
        return func(*args, **kwargs)
    kind = DISPATCHER.runtime.device(q._dev).props.get("kind", "cuda")
    key = (kind, q._k, k._k, v._k, None if mask is None else mask._k, p > 0, causal, scale)
    choice = _choices.get(key)
    if choice is None:
        choice = _choices[key] = int(aten._fused_sdp_choice(q, k, v, mask, p, causal, scale=scale))
    if kind == "cpu" and choice == FLASH:
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, p, causal, attn_mask=mask,
                                                                scale=scale)[0]
    if kind == "cuda" and choice == FLASH and mask is None:
        return aten._scaled_dot_product_flash_attention(q, k, v, p, causal, scale=scale)[0]
    if kind == "cuda" and choice == EFFICIENT:
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, grad, p, causal, scale=scale)[0]
    return func(*args, **kwargs)
