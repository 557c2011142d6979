"""The 'cuda' device of the backward node being run, for the tensors C++ makes there on 'meta'.

A backward formula makes some tensors from a gradient's options (a ``chunk``'s unused half gets
zeros; autograd makes zeros for a custom Function's unused output): on a wrapper those options
name 'meta', not the device. On a GPU the engine runs each node on its device; here nodes of
several devices run in one thread, in the engine's order, and the device of the thread's last
op can be another one's ("Expected all tensors to be on the same device"). The node's device is
found from its inputs' side of the graph: the nearest leaf it leads to, or the copy between
devices or DataParallel broadcast whose output it took.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch.nn.parallel._functions import Broadcast

from .tensor import RemoteTensor
from .transfer import DeviceCopy

#: how many nodes the search visits before it gives up (the caller then takes the last op's device)
LIMIT = 64

_COPY = DeviceCopy._backward_cls  # type: ignore[attr-defined]
_BROADCAST = Broadcast._backward_cls  # type: ignore[attr-defined]


def current() -> int | None:
    """The virtual device of the backward node now running in this thread; None outside a
    backward, or when the search does not find it."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    seen = {node}
    todo: deque[Any] = deque([node])
    while todo and len(seen) <= LIMIT:
        for fn, nr in todo.popleft().next_functions:
            if fn is None or fn in seen:
                continue
            found = _device_of_output(fn, nr)
            if found is not None:
                return found
            seen.add(fn)
            todo.append(fn)
    return None


def _device_of_output(fn: Any, nr: int) -> int | None:
    """The device of output ``nr`` of the forward op of node ``fn``, where the node says it."""
    variable = getattr(fn, "variable", None)  # (AccumulateGrad: a leaf)
    if isinstance(variable, RemoteTensor):
        return variable.get_device()
    if isinstance(fn, _COPY):
        return fn.index
    if isinstance(fn, _BROADCAST):
        return fn.target_gpus[nr // fn.num_inputs]
    return None
