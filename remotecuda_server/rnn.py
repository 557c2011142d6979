"""Recurrent layers (``aten::lstm``/``gru``/``rnn_tanh``/``rnn_relu``) run whole on the gateway.

These ops are composite: decomposed on the client they become several ops per time step
and layer. The client sends each call as one ``rc::rnn`` op instead; here the device runs
its own implementation (cuDNN on CUDA, oneDNN or the native loop on the CPU). When the
client needs gradients, the op runs under autograd on cloned inputs (the executor's tensors
are inference tensors, which autograd cannot save) and the graph stays here, reachable
from handles the client saves for its backward, which ``rc::rnn_backward`` runs.
"""
from __future__ import annotations

import torch

from .ops import OpResolver, UnknownOpError

#: the ops ``rc::rnn`` runs
OPS = frozenset(f"aten::{n}.{o}" for n in ("lstm", "gru", "rnn_tanh", "rnn_relu") for o in ("input", "data"))


def _laid_out(t: torch.Tensor, stride: list) -> torch.Tensor:
    """``t`` with the strides the client was told (a copy only where the device's differ)."""
    if list(t.stride()) == stride:
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def forward(resolver: OpResolver, name: str, args: list, needs: list | None, strides: list) -> list:
    """Run ``name`` (an ``aten::`` RNN overload) on ``args``; returns the outputs for the user,
    then, if ``needs`` (which of input, hidden state and weights want a gradient) is given, the
    same outputs as graph roots and the leaves that want a gradient."""
    if name not in OPS:
        raise UnknownOpError(f"rc::rnn runs recurrent layers only, not {name!r}")
    func = resolver.resolve(name)
    args = list(args)
    if name.endswith(".data"):
        args[1] = torch.tensor(args[1], dtype=torch.int64)  # batch sizes live on the CPU
    if needs is None:
        return [_laid_out(t, s) for t, s in zip(func(*args), strides)]
    hx_at = 2 if name.endswith(".data") else 1
    lstm = isinstance(args[hx_at], list)
    hx = args[hx_at] if lstm else [args[hx_at]]
    tensors = [args[0], *hx, *args[hx_at + 1]]
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [t.clone(memory_format=torch.contiguous_format).requires_grad_(need)
                  for t, need in zip(tensors, needs)]
        n_hx = len(hx)
        args[0] = leaves[0]
        args[hx_at] = leaves[1:1 + n_hx] if lstm else leaves[1]
        args[hx_at + 1] = leaves[1 + n_hx:]
        outs = [_laid_out(t, s) for t, s in zip(func(*args), strides)]
    return [*(t.detach() for t in outs), *outs, *(t for t, need in zip(leaves, needs) if need)]


def backward(roots: list, leaves: list, grads: list) -> list:
    """Gradients of ``leaves`` from the graph ``forward`` kept, given the roots' gradients
    (None where a root got none). The graph is kept for a second backward (retain_graph): it
    goes when the client lets its handles go, as autograd frees saved tensors locally."""
    pairs = [(r, g) for r, g in zip(roots, grads) if g is not None]
    with torch.inference_mode(False):
        got = torch.autograd.grad([r for r, _ in pairs], leaves, [g for _, g in pairs],
                                  retain_graph=True, allow_unused=True)
    return [torch.zeros_like(leaf) if g is None else g.contiguous() for g, leaf in zip(got, leaves)]
