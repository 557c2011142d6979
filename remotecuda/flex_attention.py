"""FlexAttention on 'cuda': the math that a GPU's eager run computes, as plain aten ops.

``torch.nn.attention.flex_attention`` calls a higher-order op whose eager CUDA kernel is its
"dense" math (scores, the user's ``score_mod``/``mask_mod`` under vmap, a safe softmax). That op
cannot reach the gateway as one op (it carries Python callables), and its autograd rule traces
``score_mod`` with a FakeTensorMode of its own, which a remote tensor cannot enter. So, while
active, the module's op is replaced by a function that computes the same dense math from
ordinary ops on remote tensors (which stream like any others, and which autograd records, so
``backward()`` works as it does on a GPU), and inside ``torch.compile`` traces (compiled.py),
where those ops become part of the graph. Other calls (CPU tensors) take torch's op unchanged.
"""
from __future__ import annotations

from typing import Any

import torch

from . import downloads
from .tensor import RemoteTensor

MODULE = "torch.nn.attention.flex_attention"


def install(patches: Any) -> None:
    downloads.on_import(patches, MODULE, _patch)


def _patch(patches: Any, module: Any) -> None:
    hop = getattr(module, "flex_attention_hop", None)
    if hop is not None:
        patches.set(module, "flex_attention_hop", _dense_on_cuda(hop))


def _dense_on_cuda(hop: Any) -> Any:
    from torch._higher_order_ops.flex_attention import sdpa_dense
    from torch._subclasses.fake_tensor import FakeTensor

    def flex_attention_hop(query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # (a FakeTensor here is compiled.py's trace of a 'cuda' call: torch's op would stay one node)
        if isinstance(query, (RemoteTensor, FakeTensor)):
            return sdpa_dense(query, *args, **kwargs)
        return hop(query, *args, **kwargs)
    return flex_attention_hop


def compiles_to_itself(fn: Any) -> bool:
    """Whether ``torch.compile(fn)`` is best ``fn`` itself: torch compiling a higher-order op's
    wrapper with its eager backend (as ``flex_attention`` does on every eager call), or
    ``flex_attention`` compiled by the user, whose fused kernel is the dense math above (a trace
    could not take it: the trace's stand-ins are CPU tensors, for which flex_attention refuses
    gradients)."""
    from torch._higher_order_ops.utils import _in_hop_compile
    return bool(_in_hop_compile()) or (getattr(fn, "__module__", None) == MODULE
                                       and getattr(fn, "__name__", None) == "flex_attention")
