"""The memory layout of a convolution's or a batch norm's output, as client and gateway both give it.

A convolution's output layout is chosen by its backend at run time (cuDNN, oneDNN, the slow
path), so no meta kernel knows it: torch's own meta kernel returns a contiguous tensor and
FakeTensor asks the real device. The client cannot ask (a round trip per op), and a gateway
whose layout differed from the client's idea of it would run later views on other strides
(``y.view(-1)`` of a channels-last output fails there). So both sides follow one rule, cuDNN's
(what a GPU gives): channels-last when the input or the weight is laid out so, except in
float64; the gateway makes its output conform where its backend chose otherwise.

Batch norm likewise: its meta kernel keeps the input's strides, but a GPU runs it by cuDNN on
``input.contiguous(input.suggest_memory_format())`` and the CPU's kernel lays its output out so
too, so a transposed input (``bn(x.transpose(1, 2))``, as SuperGlue's keypoint encoder feeds a
``BatchNorm1d``) gives a contiguous output, which a later ``view`` relies on. The rule: outputs
(forward) and input gradients (backward) in the input's suggested memory format.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._prims_common import suggest_memory_format

#: the convolution ops a client sends (conv1d/2d/3d and transposed ones arrive as these)
CONVOLUTIONS = frozenset({"aten::convolution.default", "aten::_convolution.default",
                          "aten::_convolution.deprecated", "aten::convolution_backward.default"})
#: the batch norm ops a client sends, by where their input is among the arguments (the output,
#: or the input gradient of a backward, is their first result)
BATCH_NORMS = {"aten::native_batch_norm.default": 0, "aten::_native_batch_norm_legit.default": 0,
               "aten::_native_batch_norm_legit.no_stats": 0, "aten::_native_batch_norm_legit_no_training.default": 0,
               "aten::_batch_norm_with_update.default": 0, "aten::_batch_norm_no_update.default": 0,
               "aten::native_batch_norm_backward.default": 1, "aten::batch_norm_backward.default": 1}
#: the ops whose output layout is the backend's choice, made the rule's on both sides
CHOSEN = CONVOLUTIONS | frozenset(BATCH_NORMS)


def conv_memory_format(input: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """cuDNN's choice (``cudnn_conv_suggest_memory_format``) for a convolution's outputs."""
    if torch.float64 in (input.dtype, weight.dtype):
        return torch.contiguous_format
    wanted = {4: torch.channels_last, 5: torch.channels_last_3d}.get(weight.dim())
    if wanted is not None and wanted in (suggest_memory_format(input), suggest_memory_format(weight)):
        return wanted
    return torch.contiguous_format


def conform(name: str, args: Sequence[Any], kwargs: dict, out: Any) -> Any:
    """``out`` of op ``name`` (one of ``CHOSEN``) in the rule's layout: for conv_backward the input
    and weight gradients (the bias gradient is 1-d), for a batch norm its first result, else the
    output. ``args`` are the op's own."""
    if name in BATCH_NORMS:
        first, *rest = out  # (a backward's input gradient is None where the input needs none)
        fmt = suggest_memory_format(args[BATCH_NORMS[name]])
        return (None if first is None else _laid_out(first, fmt), *rest)
    if name == "aten::convolution_backward.default":
        fmt = conv_memory_format(args[1], args[2])
        return tuple(t if t is None or i == 2 else _laid_out(t, fmt) for i, t in enumerate(out))
    return _laid_out(out, conv_memory_format(args[0], args[1]))


def _laid_out(t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    return t if t.is_contiguous(memory_format=fmt) else t.contiguous(memory_format=fmt)
