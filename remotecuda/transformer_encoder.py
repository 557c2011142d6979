"""``nn.TransformerEncoder``'s eval fast path on 'cuda': padded positions come out as zeros.

In eval under ``no_grad``, given a left-aligned ``src_key_padding_mask``, the encoder packs the
batch into a nested tensor of the strided layout, runs its layers on the sequences alone and pads
the result back with zeros (before its final norm). That nested tensor cannot cross the wire, so
the layers run on the dense batch with the padding mask instead (their unpadded positions equal
the nested path's), and the padded positions are set to zero as the nested path leaves them:
mean-pooling over all positions, as many users write it, then gives a GPU's value. torch's own
forward decides whether it would nest (dispatch.py's ``_nested_from_mask`` raises
``NestingAsked`` where it would), so its conditions are not copied here; the one that reads the
mask's values (is it left-aligned) is answered on the gateway, without a round trip.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from . import runtime
from .dispatch import NestingAsked
from .tensor import RemoteTensor


def _bind(self: torch.nn.TransformerEncoder, src: torch.Tensor, mask: torch.Tensor | None = None,
          src_key_padding_mask: torch.Tensor | None = None, is_causal: bool | None = None) -> tuple:
    return self, src, mask, src_key_padding_mask, is_causal


def forward(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The route of ``nn.TransformerEncoder.forward``."""
    self, src, _, padding, is_causal = _bind(*args, **kwargs)
    if not isinstance(src, RemoteTensor) or padding is None:
        return func(*args, **kwargs)
    local = runtime.current().dispatcher.local
    outer, local.encoder = local.encoder, True
    try:
        return func(*args, **kwargs)
    except NestingAsked as nesting:
        aligned = nesting.aligned
    finally:
        local.encoder = outer
    return _padded(self, src, padding, is_causal, aligned)


def _padded(self: torch.nn.TransformerEncoder, src: torch.Tensor, padding: torch.Tensor,
            is_causal: bool | None, aligned: torch.Tensor) -> torch.Tensor:
    """The forward torch's nested path computes, on the dense batch: the layers as it calls them
    (no ``mask``: with one it does not nest), then zeros where the mask pads, then the norm. A
    mask that is not left-aligned keeps torch's batch dense, and nothing is zeroed: ``aligned``
    decides on the gateway, so that no value is read."""
    mask = F._canonical_mask(mask=padding, mask_name="src_key_padding_mask", other_type=None,
                             other_name="mask", target_type=src.dtype)
    assert mask is not None
    output = src
    for layer in self.layers:
        output = layer(output, src_mask=None, is_causal=is_causal is True, src_key_padding_mask=mask)
    output = output.masked_fill((mask.ne(0) & aligned).unsqueeze(-1), 0.0)  # (torch: valid where logical_not)
    if self.norm is not None:
        output = self.norm(output)
    return output
