"""Copies between virtual devices, gateway worker to gateway worker: the client sends two small
ops, never the bytes.

``x.to('cuda:1')`` for ``x`` on ``cuda:0`` queues ``rc::offer`` in ``cuda:0``'s session and
``rc::receive`` in ``cuda:1``'s, tied by a random single-use token, and the destination's worker
pulls the bytes from the source worker's data port (remotecuda_server/peer.py). Two GPUs of one
gateway are two workers of it, and copy the same way, through that gateway's host memory; on real
GPUs a CUDA IPC device-to-device copy between the two workers is the next step (not done yet).
Where this client does not reach the source worker's data port (a tunnel passing one port,
``--no-direct``), or the source is on loopback and the destination is not (they are not on one
machine), the copy goes through the client as before.

``DeviceCopy`` makes such a copy differentiable as on a GPU: its backward copies the gradient
back. (The aten ``_to_copy`` that ``Tensor.to`` records keeps the wrapper's C++ device, ``meta``,
so its backward would leave the gradient on the destination device.)
"""
from __future__ import annotations

import secrets
from typing import Any

import torch

from .tensor import RemoteTensor, contiguous_strides, make

#: the unpatched ``Tensor.to``: a copy to another cuda device reaches the dispatcher's ``_to_copy``
_TO = torch._C.TensorBase.to
#: hosts of an endpoint that only its own machine reaches
_LOOPBACK = ("127.", "localhost", "[::1]")


def move(src: RemoteTensor, dst: Any) -> torch.Tensor | None:
    """``src``'s values in session ``dst``, copied from worker to worker; None where the two
    workers cannot reach each other (the caller then copies through the client). A dense layout
    keeps its strides, as ``preserve_format`` does; others arrive contiguous."""
    peer = _peer(src._s, dst)
    if peer is None:
        return None
    order = _memory_order(src)
    base: Any = src.permute(order) if order is not None else src  # contiguous bytes, no copy on the gateway
    token = secrets.token_bytes(16)
    src._s.enqueue("rc::offer", [base._h, token], None, None)
    src._s.flush()  # the destination's PULL then finds the offer announced
    h = dst.new_handle()
    shape = list(base.shape)
    dst.enqueue("rc::receive", [h, token, peer, base.dtype, shape], None, None)
    if src._s not in dst.sources:
        dst.sources.append(src._s)
    out = make(dst, h, shape, contiguous_strides(tuple(shape)), 0, base.dtype)
    return out.permute([order.index(d) for d in range(len(order))]) if order is not None else out


def _peer(src: Any, dst: Any) -> str | None:
    """Where the destination's worker pulls from: the source worker's data port as this client
    reaches it, or None. Both sessions are placed first (a device is placed at its first need)."""
    for s in (src, dst):
        with s.lock:
            s.open("flush")
    peer = src.data_endpoint
    if peer is None or (_loopback(peer) and not _loopback(dst.endpoint)):
        return None
    if (src.info.get("curve") or dst.info.get("curve")) and src.endpoint != dst.endpoint:
        return None  # a CURVE gateway's workers pull only from each other (they hold its key, not others')
    return peer


def _loopback(endpoint: str) -> bool:
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    return host.startswith(_LOOPBACK)


def _memory_order(t: RemoteTensor) -> list[int] | None:
    """The permutation of a dense, non-contiguous ``t``'s dims that makes it contiguous, or None."""
    _, shape, stride, _ = t._k
    if t.is_contiguous() or t.dim() < 2:
        return None
    order = sorted(range(t.dim()), key=lambda d: (-stride[d], -shape[d]))
    meta = torch.empty_strided(shape, stride, device="meta")
    return order if meta.permute(order).is_contiguous() else None


class DeviceCopy(torch.autograd.Function):
    """``x`` on virtual device ``index``; the gradient goes back to ``x``'s device."""

    @staticmethod
    def forward(ctx: Any, x: RemoteTensor, index: int) -> Any:
        ctx.source, ctx.index = x.get_device(), index
        return _TO(x, torch.device("cuda", index))

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return (None if grad is None else DeviceCopy.apply(grad, ctx.source)), None


def to_device(t: RemoteTensor, index: int, dtype: torch.dtype | None = None,
              memory_format: torch.memory_format | None = None) -> Any:
    """``t.to('cuda:index', dtype, memory_format=...)`` for ``t`` on another virtual device."""
    out = DeviceCopy.apply(t, index)
    if (dtype is not None and dtype != out.dtype) or memory_format not in (None, torch.preserve_format):
        out = _TO(out, dtype=dtype or out.dtype, memory_format=memory_format or torch.preserve_format)
    return out
