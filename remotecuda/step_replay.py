"""Automatic replay of repeated steps: ``REMOTECUDA_REPLAY=1`` or ``activate(replay=True)``.

A training or decode loop calls the same model with inputs of the same kind step after step,
and eager streaming hands every aten op of every call to Python and the wire: ~75k client
instructions per op, over half of them torch's own price for a ``__torch_dispatch__`` subclass,
which no scheme that still sees each op can avoid (benchmarks/RESULTS.md, Part 3). Replay skips
the ops instead: the second call of a top-level module with a signature seen before (shapes,
strides, dtypes, grad mode, training flags, autocast, the other arguments: compiled.py's key) is
traced once, its forward and backward defined on the gateway as programs, and every later call
with that signature is one ``rc::program_run`` for the forward and one for ``backward()``.

A call with another signature is eager or, seen twice, a trace of its own; a call the trace
cannot take (a branch on a tensor's value, ``.item()``, an op outside the allowlist, an
argument it would change, an attribute it replaces or a list it fills) runs eagerly from then
on: results are eager's either way. Calls under hooks, user dispatch modes, functorch
transforms, CUDA graph capture or autograd's backward (checkpointing's recomputation) are left
eager, as are modules with no parameter on a gateway.

Off by default: tracing a large model takes seconds, and a forward's Python effects other than
its modules' attributes (a global it counts in, a print) happen when it is traced, not at each
replayed call.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from remotecuda_wire import limits

from .compiled import Compiled, CompiledModule, _only_mode_is_remotecudas
from .tensor import RemoteTensor


def wanted(replay: bool | None) -> bool:
    """Whether to replay: ``replay`` when given, else ``REMOTECUDA_REPLAY`` (default off)."""
    if replay is not None:
        return replay
    return limits.switch("REMOTECUDA_REPLAY", os.environ.get("REMOTECUDA_REPLAY"), False)


class StepReplay:
    """``nn.Module.__call__`` while replay is on: a top-level call goes through its module's
    ``Compiled`` (kept per module, created at its first call); nested calls, and calls replay
    leaves eager, go straight to torch's ``__call__``."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call = call  # torch's own Module.__call__
        self.compiled: weakref.WeakKeyDictionary[torch.nn.Module, Compiled] = weakref.WeakKeyDictionary()
        self.depth = threading.local()

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(self.depth, "n", 0)
        self.depth.n = depth + 1
        try:
            if depth or not _free():
                return self.call(module, *args, **kwargs)
            compiled = self.compiled.get(module)
            if compiled is None:
                if not _replayable(module):
                    return self.call(module, *args, **kwargs)
                compiled = self.compiled[module] = Compiled(module, {}, automatic=True)
            tree = compiled.tree()  # (its walk of the modules, cached: see compiled.Tree)
            if not isinstance(tree.first, RemoteTensor) or tree.hooked:
                return self.call(module, *args, **kwargs)
            return compiled.call(tree, args, kwargs)
        finally:
            self.depth.n = depth


def _replayable(module: torch.nn.Module) -> bool:
    """Whether a top-level call of a module not seen before may be traced and replayed (see the
    module's docstring; a module seen before is asked the same of its ``compiled.Tree``)."""
    first = next(module.parameters(), None)
    if not isinstance(first, RemoteTensor) or isinstance(module, CompiledModule):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                   for m in module.modules())


def _free() -> bool:
    """Whether nothing around a call keeps it eager (see the module's docstring)."""
    from . import cuda_graphs
    if torch._C._current_graph_task_id() != -1 or cuda_graphs.is_current_stream_capturing():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None or torch._C._len_torch_function_stack():
        return False
    return _only_mode_is_remotecudas() and not _global_hooks()


def _global_hooks() -> bool:
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)


def install(p: Any) -> None:
    """Route ``nn.Module.__call__`` through a StepReplay (``p``: interception's patches)."""
    p.set(torch.nn.Module, "__call__", _as_method(StepReplay(torch.nn.Module.__call__)))


def _as_method(replay: StepReplay) -> Callable[..., Any]:
    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return replay(self, *args, **kwargs)
    return __call__
