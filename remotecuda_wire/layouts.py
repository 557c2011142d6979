"""Output layouts that torch's meta kernels get wrong, as client and gateway both give them.

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

A few elementwise ops have Python meta kernels (decompositions registered over the structured
C++ ones) that return contiguous outputs, where their kernels on every device are TensorIterator
loops whose output follows the inputs' layout: ``softplus_backward`` of a transposed gradient is
transposed on the CPU and on a GPU, contiguous on 'meta'. The client's metadata follows
TensorIterator's rule for these (``ELEMENTWISE``); the gateway's kernel already does. Left as
the meta kernel said, autograd keeps such a gradient as ``.grad`` (its layout looks like the
parameter's) and a later ``.grad.view(...)`` fails on the gateway. The reverse holds for three
losses' backward (``CONTIGUOUS``): their kernels (Loss.cpp, shared by CPU and CUDA) write into
``zeros_like(input, contiguous)``, their meta kernels follow a transposed input, and
``F.mse_loss(pred.transpose(1, 2), ...)`` then failed its backward's ``view`` on the gateway. So
do a few more (found by tests/scripts/layout_sweep.py): log-softmax's and layer norm's input
gradients of a transposed input, ``torch.pow(2, x)``, ``isin`` and the gamma sampler. And the
channel shuffle, whose meta kernel (torch's reference) returns a view of its input when there is
one group or one channel a group, which CUDA's kernel (``.contiguous()`` of a permutation that
moves a dimension of size one) gives only for a contiguous input: ShuffleNet's backward shuffles
the all-zero-stride gradient of ``y.sum()``, and a gateway asked for that layout could not write
the output into it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._prims_common import compute_elementwise_output_strides, suggest_memory_format

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

#: elementwise ops whose meta kernel ignores the layout their TensorIterator kernels give (found by
#: comparing meta and CPU strides over transposed, channels-last and broadcast inputs; their
#: CUDA kernels are the same TensorIterator loops)
ELEMENTWISE = frozenset({
    "aten::softplus_backward.default", "aten::hardsigmoid_backward.default", "aten::hardswish_backward.default",
    "aten::logit_backward.default", "aten::xlogy.Tensor", "aten::special_xlog1py.default",
    "aten::copysign.Tensor", "aten::floor_divide.default"})

#: ops whose kernels, on every device, return contiguous tensors where their Python meta kernels
#: follow the inputs' strides: the losses' backward above; pow of a scalar base, isin and
#: log-softmax's backward, whose structured kernels' shared C++ meta function allocates a
#: contiguous output; the gamma sampler and layer norm's backward, whose CPU and CUDA kernels
#: both allocate theirs contiguous; the channel shuffle, whose CUDA kernel does (the CPU's
#: keeps a channels-last input's layout: the gateway conforms it, remotecuda_server/cuda_kernels.py)
CONTIGUOUS = frozenset({"aten::channel_shuffle.default", "aten::native_channel_shuffle.default",
                        "aten::mse_loss_backward.default", "aten::huber_loss_backward.default",
                        "aten::smooth_l1_loss_backward.default", "aten::pow.Scalar",
                        "aten::isin.Tensor_Tensor", "aten::isin.Tensor_Scalar",
                        "aten::_log_softmax_backward_data.default", "aten::_standard_gamma.default",
                        "aten::native_layer_norm_backward.default"})


def elementwise(args: Sequence[Any], out: torch.Tensor) -> torch.Tensor:
    """``out`` (a meta tensor) with the strides TensorIterator gives an op of ``args``."""
    inputs = [a.expand(out.shape) for a in args if isinstance(a, torch.Tensor)]
    strides = compute_elementwise_output_strides(*inputs)
    if tuple(out.stride()) == strides:
        return out
    return torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device)


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


def contiguous(out: Any) -> Any:
    """``out`` (the results of one of ``CONTIGUOUS``: a tensor, or a tuple of tensors and Nones)
    made contiguous."""
    if isinstance(out, torch.Tensor):
        return out.contiguous()
    return tuple(None if t is None else t.contiguous() for t in out)


def _laid_out(t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    return t if t.is_contiguous(memory_format=fmt) else t.contiguous(memory_format=fmt)
