"""Checks for the aten ops whose kernels trust their inputs.

Some kernels take auxiliary inputs that their forward made (pooling indices, saved statistics,
bag offsets, CTC alignments) or build a tensor from raw parts (sparse indices), and index
memory with them unchecked: given forged values they write or read outside their buffers.
They were found by calling each suspect op with out-of-range or mis-sized inputs in a child
process (torch 2.13, CPU): the guarded ones segfaulted, aborted or silently read out of
bounds. A client's values are untrusted, so these ops run behind a guard that checks what
the kernel assumes and raises the error PyTorch raises for such input elsewhere (``IndexError``,
``RuntimeError``). A sparse tensor's index tensors are handed out as copies, so a sparse tensor
the gateway checked once stays valid.

Shape checks run everywhere; checks of values run where the values are on the CPU. On a GPU an
out-of-bounds access stays inside the session worker's own CUDA context (the session is lost,
no one else is touched), and reading the values back would cost a device synchronisation.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

#: op name (all its overloads) → the guard: given the op and its arguments bound by name, it
#: raises on input the kernel would misuse, or returns the function to call instead of the op
GUARDS: dict[str, Callable[[Any, dict], Callable | None]] = {}


def _guard(*names: str) -> Callable:
    def register(fn: Callable) -> Callable:
        for name in names:
            GUARDS[name] = fn
        return fn
    return register


def guarded(op: Any) -> Callable:
    """``op``'s callable, behind its guard if it has one."""
    check = GUARDS.get(op._schema.name.split("::", 1)[1])
    if check is None:
        return op._op
    names = [a.name for a in op._schema.arguments]
    defaults = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}

    def run(*args: Any, **kwargs: Any) -> Any:
        bound = dict(defaults, **dict(zip(names, args)), **kwargs)
        instead = check(op, bound)
        return (instead or op._op)(*args, **kwargs)
    return run


def _on_cpu(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() > 0


def _within(t: Any, low: int, high: int, what: str) -> None:
    """Every value of ``t`` in [low, high) (CPU values only)."""
    if _on_cpu(t):
        lo, hi = torch.aminmax(t.detach().reshape(-1))
        if int(lo) < low or int(hi) >= high:
            raise IndexError(f"{what} out of range: values from {int(lo)} to {int(hi)}, expected [{low}, {high})")


def _same_shape(a: Any, b: Any, what: str) -> None:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
        raise RuntimeError(f"{what}: expected shape {tuple(b.shape)}, got {tuple(a.shape)}")


def _numel(t: Any, n: int, what: str) -> None:
    if isinstance(t, torch.Tensor) and t.numel() != n:
        raise RuntimeError(f"{what} has {t.numel()} elements, expected {n}")


# ---------------------------------------------------------------------------- sparse tensors
@_guard("_sparse_coo_tensor_with_dims_and_tensors", "_sparse_coo_tensor_unsafe")
def _sparse_coo(op: Any, a: dict) -> None:
    indices, values, size = a["indices"], a["values"], a["size"]
    if "sparse_dim" in a and (indices.dim() != 2 or indices.size(0) != a["sparse_dim"]
                              or len(size) != a["sparse_dim"] + a["dense_dim"]):
        raise RuntimeError("sparse COO tensor: indices, sparse_dim, dense_dim and size disagree")
    torch._validate_sparse_coo_tensor_args(indices, values, size, a.get("is_coalesced"))


_COMPRESSED = {"_sparse_csr_tensor_unsafe": ("crow_indices", "col_indices", torch.sparse_csr),
               "_sparse_csc_tensor_unsafe": ("ccol_indices", "row_indices", torch.sparse_csc),
               "_sparse_bsr_tensor_unsafe": ("crow_indices", "col_indices", torch.sparse_bsr),
               "_sparse_bsc_tensor_unsafe": ("ccol_indices", "row_indices", torch.sparse_bsc),
               "_sparse_compressed_tensor_unsafe": ("compressed_indices", "plain_indices", None)}


@_guard(*_COMPRESSED)
def _sparse_compressed(op: Any, a: dict) -> None:
    compressed, plain, layout = _COMPRESSED[op._schema.name.split("::", 1)[1]]
    layout = layout or a.get("layout")
    if layout is None:
        raise RuntimeError("a compressed sparse tensor needs its layout")
    torch._validate_sparse_compressed_tensor_args(a[compressed], a[plain], a["values"], a["size"], layout)


@_guard("_indices", "indices", "crow_indices", "col_indices", "ccol_indices", "row_indices")
def _index_copy(op: Any, a: dict) -> Callable:
    """A copy, not the live index tensor: an in-place write to it would unmake the checks."""
    return lambda *args, **kwargs: op._op(*args, **kwargs).clone()


@_guard("_coalesced_")
def _coalesced(op: Any, a: dict) -> None:
    t = a["self"]
    if a["coalesced"] and t.layout is torch.sparse_coo:
        torch._validate_sparse_coo_tensor_args(t._indices(), t._values(), t.shape, True)


# ---------------------------------------------------------------------------- views
@_guard("_reshape_alias")
def _reshape_alias(op: Any, a: dict) -> Callable:
    """as_strided checks the view against its storage; _reshape_alias does not."""
    return lambda t, size, stride: torch.ops.aten.as_strided.default(t, size, stride, t.storage_offset())


# ---------------------------------------------------------------------------- pooling indices
@_guard("max_pool2d_with_indices_backward", "adaptive_max_pool2d_backward")
def _pool2d_indices(op: Any, a: dict) -> None:
    _pool_indices(a, 2)


@_guard("max_pool3d_with_indices_backward", "adaptive_max_pool3d_backward")
def _pool3d_indices(op: Any, a: dict) -> None:
    _pool_indices(a, 3)


def _pool_indices(a: dict, dims: int) -> None:
    _same_shape(a["indices"], a["grad_output"], "pooling indices")
    _within(a["indices"], 0, math.prod(a["self"].shape[-dims:]), "pooling index")


# ---------------------------------------------------------------------------- embeddings
@_guard("embedding_dense_backward")
def _embedding_backward(op: Any, a: dict) -> None:
    grad, indices = a["grad_output"], a["indices"]
    if grad.dim() == 0 or grad.numel() != indices.numel() * grad.size(-1):
        raise RuntimeError("embedding backward: the gradient does not match the indices")
    _within(indices, 0, a["num_weights"], "embedding index")


@_guard("_embedding_bag_backward", "_embedding_bag_dense_backward", "_embedding_bag_sparse_backward",
        "_embedding_bag_per_sample_weights_backward")
def _embedding_bag_backward(op: Any, a: dict) -> None:
    grad, indices, offset2bag = a["grad"], a["indices"], a["offset2bag"]
    n_weights = a["weight"].size(0) if "weight" in a else a["num_weights"]
    _within(indices, 0, n_weights, "embedding_bag index")
    if offset2bag.numel():  # (empty where the kernel works it out from the offsets)
        _numel(offset2bag, indices.numel(), "embedding_bag offset2bag")
        _within(offset2bag, 0, grad.size(0), "embedding_bag offset2bag")
    if a.get("offsets") is not None:
        _within(a["offsets"], 0, indices.numel() + 1, "embedding_bag offset")
    if "bag_size" in a:
        _numel(a["bag_size"], grad.size(0), "embedding_bag bag_size")
    if a.get("maximum_indices") is not None and a.get("mode") == 2:  # max mode
        _same_shape(a["maximum_indices"], grad, "embedding_bag maximum_indices")
        _within(a["maximum_indices"], -1, n_weights, "embedding_bag maximum index")


# ---------------------------------------------------------------------------- CTC loss
@_guard("_ctc_loss", "_ctc_loss_backward")
def _ctc(op: Any, a: dict) -> None:
    log_probs, targets = a["log_probs"], a["targets"]
    if log_probs.dim() not in (2, 3):
        raise RuntimeError("ctc_loss: log_probs must be (T, N, C) or (T, C)")
    classes = log_probs.size(-1)
    _within(targets, 0, classes, "ctc_loss target")
    if not 0 <= a["blank"] < classes:
        raise RuntimeError("blank must be in label range")  # (LossCTC.cpp's and LossCTC.cu's words)
    lengths = a["target_lengths"]
    lengths = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    if any(n < 0 for n in lengths):
        raise RuntimeError("ctc_loss: negative target length")
    if targets.dim() == 2 and lengths and max(lengths) > targets.size(1) \
            or targets.dim() == 1 and sum(lengths) > targets.numel():
        raise RuntimeError("ctc_loss: target lengths exceed the targets")
    if "log_alpha" in a:
        batch = log_probs.size(1) if log_probs.dim() == 3 else 1
        want = (batch, log_probs.size(0), 2 * max(lengths, default=0) + 1)
        if tuple(a["log_alpha"].shape) != want or a["neg_log_likelihood"].numel() != batch:
            raise RuntimeError("ctc_loss backward: the saved alignment does not match the inputs")


# ---------------------------------------------------------------------------- fused optimizers
@_guard("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
def _fused_optimizer(op: Any, a: dict) -> None:
    params = a["self"]
    for name in ("grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "momentum_buffer_list", "state_sums"):
        state = a.get(name)
        if not state:
            continue
        if len(state) != len(params):
            raise RuntimeError(f"{op._schema.name}: {name} has {len(state)} tensors for {len(params)} parameters")
        for p, s in zip(params, state):
            _same_shape(s, p, f"{op._schema.name} {name}")
    for step in a.get("state_steps") or ():
        _numel(step, 1, f"{op._schema.name} state step")


# ---------------------------------------------------------------------------- saved statistics
@_guard("native_batch_norm_backward")
def _batch_norm_backward(op: Any, a: dict) -> None:
    x = a["input"]
    _same_shape(a["grad_out"], x, "batch_norm backward gradient")
    channels = x.size(1) if x.dim() > 1 else 1
    for name in ("weight", "running_mean", "running_var", "save_mean", "save_invstd"):
        if a.get(name) is not None and (a["train"] or name not in ("save_mean", "save_invstd")):
            _numel(a[name], channels, f"batch_norm backward {name}")


@_guard("native_layer_norm_backward")
def _layer_norm_backward(op: Any, a: dict) -> None:
    x = a["input"]
    _same_shape(a["grad_out"], x, "layer_norm backward gradient")
    inner = math.prod(a["normalized_shape"])
    rows = x.numel() // inner if inner else 0
    for name in ("mean", "rstd"):
        _numel(a[name], rows, f"layer_norm backward {name}")
    for name in ("weight", "bias"):
        if a.get(name) is not None:
            _numel(a[name], inner, f"layer_norm backward {name}")


@_guard("_log_softmax_backward_data")
def _log_softmax_backward(op: Any, a: dict) -> None:
    _same_shape(a["grad_output"], a["output"], "log_softmax backward gradient")


@_guard("_segment_reduce_backward")
def _segment_reduce_backward(op: Any, a: dict) -> None:
    data, axis = a["data"], a["axis"]
    _same_shape(a["grad"], a["output"], "segment_reduce backward gradient")
    size = data.size(axis)
    lengths: Any = a.get("lengths")
    offsets: Any = a.get("offsets")
    if _on_cpu(lengths) and (bool((lengths < 0).any()) or bool((lengths.sum(-1) != size).any())):
        raise RuntimeError("segment_reduce backward: lengths must be non-negative and sum to the data's size")
    if _on_cpu(offsets) and (bool((offsets[..., 0] < 0).any()) or bool((offsets.diff(dim=-1) < 0).any())
                             or bool((offsets[..., -1] > size).any())):
        raise RuntimeError("segment_reduce backward: offsets must rise from 0 within the data's size")
