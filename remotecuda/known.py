"""Values the client already knows: small integer tensors it uploaded, and what follows from them.

``generate()`` asks many questions whose answers the client could have computed: is the pad
token an EOS token (``isin(eos, pad).any()``), is the attention mask all ones, is there right
padding, and every token ``fast_all(padding_mask)`` in the attention-mask builder. Each is a
value read — a blocking round trip to the gateway — on tensors made from data the client
sent itself. So a small integer or boolean upload keeps a CPU copy of its bytes (``remember``),
and inside a decode (decode.py sets ``Dispatcher.propagate``) an op whose tensor arguments are
all known runs on those copies too (it is still sent to the gateway as usual): its integer or
boolean results become known, and a value read of a known tensor is answered here, with no
round trip.

Only integer and boolean values are kept, so a copy is exact: the gateway computes the same
bits. Random ops, ops that write their arguments, uninitialized memory (``empty``) and the
indices of ties (``sort``, ``topk``) are never known. A read answered here is no sync point:
an asynchronous error comes at the next read that goes to the gateway. A copy is valid while
the tensor's version counter (torch's, shared by all views of one storage and bumped by every
in-place write through any of them) is the one it was taken at; any write makes it unknown
(but one through ``.data``, which PyTorch keeps from the counter too).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .device_type import DEVICE
from .tensor import RemoteTensor

#: the most elements a known value holds (a batch of prompts' ids and masks)
LIMIT = 1 << 16
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)
#: ops whose results the client cannot know from the values alone: uninitialized memory, and the
#: order of ties (which index a sort, top-k or max keeps for equal values is the kernel's choice)
_UNKNOWABLE = frozenset(("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                         "empty_permuted", "sort", "argsort", "topk", "kthvalue", "mode", "median",
                         "nanmedian", "cummax", "cummin"))
_WITH_INDICES = frozenset(("max", "min"))
#: value reads answered from a known tensor
_READS = frozenset((torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                    torch.ops.aten.equal.default))


def remember(t: Any, cpu: torch.Tensor) -> None:
    """Keep ``cpu``'s values as remote tensor ``t``'s, if they are few integers or booleans."""
    if cpu.dtype in _FLOATS or cpu.numel() > LIMIT or not isinstance(t, RemoteTensor):
        return
    try:
        version = t._version
    except RuntimeError:  # an inference tensor has no version counter: its writes cannot be seen
        return
    t.__dict__["_known"] = (cpu.detach().clone(), version)


def value(t: RemoteTensor) -> torch.Tensor | None:
    """The CPU copy of ``t``'s values, when the client knows them."""
    known = t.__dict__.get("_known")
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
                if "_known" not in t.__dict__:
                    return None
                remote.append(t)
    return remote


def _knowable(func: Any) -> bool:
    """Whether the op's results follow from its arguments' values, the same on any device."""
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
    if any(value(a) is None for a in remote):
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
                    and lo.dtype == o.dtype:
                remember(o, lo)
    return out
