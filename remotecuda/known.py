"""Values the client already knows: small integer tensors it uploaded, and what follows from them.

``generate()`` asks many questions whose answers the client could have computed: is the pad
token an EOS token (``isin(eos, pad).any()``), is the attention mask all ones, is there right
padding, and every token ``fast_all(padding_mask)`` in the attention-mask builder. Each is a
value read — a blocking round trip to the gateway — on tensors made from data the client
sent itself. So a small integer or boolean upload keeps a CPU copy of its bytes (``remember``),
and inside a decode (decode.py sets ``Dispatcher.propagate``) an op whose tensor arguments are
all known runs on those copies too (it is still sent to the gateway as usual): its integer or
boolean results become known, and a value read of a known tensor (an item, or a copy to the CPU:
``.tolist()``, ``.cpu()``, which the dispatcher's ``download`` takes from here) is answered here,
with no round trip.

A copy must be exact: the gateway computes the same bits. So an upload is kept only when it holds
integers or booleans, and inside a decode an op's results are kept when they are integers or
booleans computed from integers or booleans, or when the op is one that rounds nothing
(``_EXACT``: a float tensor made by ``ones``/``zeros``/``full``, cast, moved, selected or
compared, as BART's decoder makes its mask with ``torch.ones(..., device=...)`` and asks
``mask.bool()`` whether it is all ones): IEEE arithmetic, reductions and transcendental functions
of floats may round differently on a GPU, but a value that is only copied, converted with
round-to-nearest or compared is the same bits everywhere. A float cast to an integer type is kept
only when it is in range (out of range, CPU and CUDA differ). Random ops, ops that write their
arguments, uninitialized memory (``empty``) and the indices of ties (``sort``, ``topk``) are
never known. A read answered here is no sync point: an asynchronous error comes at the next read
that goes to the gateway. A copy is valid while the tensor's version counter (torch's, shared by
all views of one storage and bumped by every in-place write through any of them) is the one it
was taken at; any write makes it unknown. ``t.data`` has a counter of its own (PyTorch keeps its
writes from ``t``'s), ``t.data = new`` keeps ``t``'s counter, and a write through
``t.untyped_storage()`` bumps none: all three drop ``t``'s copy (``forget``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .device_type import DEVICE
from .tensor import KNOWN_KEY, RemoteTensor

#: the most elements a known value holds (a batch of prompts' ids and masks)
LIMIT = 1 << 16
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)
#: ops whose results the client cannot know from the values alone: uninitialized memory, and the
#: order of ties (which index a sort, top-k or max keeps for equal values is the kernel's choice)
_UNKNOWABLE = frozenset(("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                         "empty_permuted", "sort", "argsort", "topk", "kthvalue", "mode", "median",
                         "nanmedian", "cummax", "cummin"))
_WITH_INDICES = frozenset(("max", "min"))
#: ops that round nothing: made from a scalar, copied, cast (round-to-nearest on every device),
#: moved, selected, compared or read; the only ops whose results are kept when a float is involved
_EXACT = frozenset((
    "ones", "zeros", "full", "ones_like", "zeros_like", "full_like", "new_ones", "new_zeros", "new_full",
    "scalar_tensor", "fill", "_to_copy", "clone", "lift_fresh", "lift_fresh_copy", "detach", "alias", "view",
    "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "transpose", "t",
    "narrow", "split", "split_with_sizes", "unbind", "cat", "stack", "constant_pad_nd", "repeat", "flip",
    "index_select", "index", "gather", "where", "masked_fill", "tril", "triu", "diagonal", "eq", "ne", "lt",
    "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "logical_xor", "isnan", "isinf", "isfinite",
    "isposinf", "isneginf", "all", "any", "nonzero", "_local_scalar_dense", "is_nonzero", "equal"))
#: value reads answered from a known tensor
_READS = frozenset((torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                    torch.ops.aten.equal.default))


def remember(t: Any, cpu: torch.Tensor, floats: bool = False) -> None:
    """Keep ``cpu``'s values as remote tensor ``t``'s, if they are few integers or booleans (or
    floats, where ``floats`` says they are exact)."""
    if (cpu.dtype in _FLOATS and not floats) or cpu.numel() > LIMIT or not isinstance(t, RemoteTensor):
        return
    try:
        version = t._version
    except RuntimeError:  # an inference tensor has no version counter: its writes cannot be seen
        return
    t.__dict__[KNOWN_KEY] = (cpu.detach().clone(), version)


def forget(t: RemoteTensor) -> None:
    """Drop ``t``'s copy, and that of the tensor it is a view of, where their version counter
    cannot tell: ``t.data = new`` makes the wrapper stand for another gateway tensor and keeps the
    counter (torch's ``set_data``), a write through ``t.data`` (``mask[1].data[:2] = 0``) bumps
    another counter, and one through its storage none. (Other views of that base have copies only
    inside a decode.)"""
    t.__dict__.pop(KNOWN_KEY, None)
    with torch._C.DisableTorchFunctionSubclass():  # (remotecuda's read, not the program's: unseen by a subclass)
        base = t._base
    if isinstance(base, RemoteTensor):
        base.__dict__.pop(KNOWN_KEY, None)


def value(t: RemoteTensor) -> torch.Tensor | None:
    """The CPU copy of ``t``'s values, when the client knows them."""
    known = t.__dict__.get(KNOWN_KEY)
    if known is None:
        return None
    cpu, version = known
    return cpu if t._version == version else None


def _local(a: Any) -> Any:
    if isinstance(a, RemoteTensor):
        return value(a)
    if isinstance(a, DEVICE) and a.type != "cpu":
        return torch.device("cpu")
    if isinstance(a, str) and a.startswith("cuda"):
        return "cpu"
    return a


def _remote(args: tuple, kwargs: dict) -> list | None:
    """The op's remote tensor arguments, or None as soon as one is not known (most ops: a
    model's activations), cheaply: this runs for every op inside a decode."""
    remote = []
    for a in (*args, *kwargs.values()):
        for t in (a if type(a) in (list, tuple) else (a,)):
            if isinstance(t, RemoteTensor):
                if KNOWN_KEY not in t.__dict__:
                    return None
                remote.append(t)
    return remote


def _knowable(func: Any) -> bool:
    """Whether the op's results follow from its arguments' values, the same on any device (when
    no float is involved: ``_EXACT``)."""
    schema = func._schema
    name = schema.name.partition("::")[2]
    return not (schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags or name in _UNKNOWABLE
                or (name in _WITH_INDICES and len(schema.returns) > 1))


def run(func: Any, args: tuple, kwargs: dict, inner: Any) -> Any:
    """``inner(func, args, kwargs)`` (the dispatcher's path), with the result's values known
    when all of the op's remote arguments are; a value read of known tensors answered here."""
    remote = _remote(args, kwargs)
    if remote is None or not _knowable(func):
        return inner(func, args, kwargs)
    local_args, local_kwargs = tree_map(_local, (args, kwargs))
    values = [value(a) for a in remote]
    if any(v is None for v in values):
        return inner(func, args, kwargs)
    name = func._schema.name.partition("::")[2]
    exact = name in _EXACT
    floats = [v for v in values if v.dtype in _FLOATS]  # type: ignore[union-attr]
    if floats and not exact:
        return inner(func, args, kwargs)
    if func in _READS:
        return func(*local_args, **local_kwargs)
    out = inner(func, args, kwargs)
    try:
        local_out = func(*local_args, **local_kwargs)
    except Exception:  # (what the CPU refuses stays unknown; the gateway's answer stands)
        return out
    outs, _ = tree_flatten(out)
    local_outs, _ = tree_flatten(local_out)
    if len(outs) == len(local_outs):
        for o, lo in zip(outs, local_outs):
            if isinstance(o, RemoteTensor) and isinstance(lo, torch.Tensor) and lo.shape == o.shape \
                    and lo.dtype == o.dtype and (name != "_to_copy" or _in_range(floats, lo)):
                remember(o, lo, floats=exact)
    return out


def _in_range(floats: list[torch.Tensor], out: torch.Tensor) -> bool:
    """Whether ``out``, a cast of ``floats`` (none, or the one), is exact on every device: a float
    cast to an integer type is truncated alike in range; out of range, or NaN, each device has its own."""
    if not floats or out.dtype in _FLOATS or out.dtype == torch.bool:
        return True
    return torch.equal(out.to(floats[0].dtype), floats[0].trunc())
