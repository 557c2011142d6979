"""torch.cond, while_loop and map while active: their eager meaning, run directly.

Eagerly, torch runs these higher-order ops by compiling a wrapper with Dynamo, whose dense
kernel then reads the predicate and calls the branch (cond), loops (while_loop) or calls the
function per slice and stacks (map); Dynamo lifts the tensors a branch closes over (a module's
parameters) into operands, and the ops' autograd rules trace the branches' backward with
``make_fx``, which a remote tensor cannot enter. While active, ``torch.compile`` is
remotecuda's (compiled.py), which has no Dynamo to lift anything. So an eager call runs the
dense meaning itself, above autograd: the predicate is read (a sync, as ``bool(pred)`` on a
GPU is), the chosen function's ops stream to the gateway (or run on the CPU) and autograd
records them, so gradients reach the operands and the parameters a branch closes over, as
they do on a GPU. Calls in an export, a ``make_fx`` or a ``torch.compile`` trace (compiled.py's
fakes: the op stays a node of the graph) take torch's own path. The ops themselves (a function imported
before activation, ``torch.ops.higher_order.cond``) on remote tensors run with the same meaning,
at their autograd key (``dense``), or in the dispatch mode where autograd is off.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from .tensor import RemoteTensor

#: tensor types an eager call holds (a trace's are fakes, functional or proxied tensors)
_EAGER_TYPES = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
_TRACING_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, k) for k in ("PROXY", "FAKE", "FUNCTIONAL"))


def _eager(tree: Any) -> bool:
    """Whether a call on ``tree`` is an eager one: its tensors are remote or plain, and no
    compile, export or ``make_fx`` trace is on."""
    tensors = [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
    return all(type(t) in _EAGER_TYPES or isinstance(t, RemoteTensor) for t in tensors) and \
        not torch.compiler.is_compiling() and not torch.compiler.is_exporting() and \
        all(torch._C._get_dispatch_mode(k) is None for k in _TRACING_MODES)


def _pred(pred: Any) -> bool:
    if isinstance(pred, torch.Tensor) and pred.numel() != 1:
        raise RuntimeError(f"Expected pred to be bool or single-element tensor, but got {pred}.")
    return bool(pred)


def cond(original: Callable) -> Callable:
    @functools.wraps(original)
    def eager_cond(pred: Any, true_fn: Callable, false_fn: Callable, operands: Any = ()) -> Any:
        if not _eager((pred, operands)):
            return original(pred, true_fn, false_fn, operands)
        if not isinstance(operands, (tuple, list)):
            raise RuntimeError("Expect operands to be a tuple of possibly nested dict/list/tuple that only "
                               f"consists of tensor leaves, but got {operands}.")
        return (true_fn if _pred(pred) else false_fn)(*operands)
    return eager_cond


def _loop(cond_fn: Callable, body_fn: Callable, carried: tuple, extra: tuple = ()) -> tuple:
    """while_loop's dense kernel: the carried values, cloned when the body never runs."""
    go = cond_fn(*carried, *extra)
    if not (isinstance(go, bool) or (isinstance(go, torch.Tensor) and go.shape == () and go.dtype == torch.bool)):
        raise RuntimeError(f"cond_fn must return a boolean scalar tensor or a boolean but got {go}")
    if not go:
        return tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in carried)
    while go:
        out = body_fn(*carried, *extra)
        if not isinstance(out, tuple) or len(out) != len(carried):
            raise RuntimeError("body_fn should return a tuple of as many elements as carried_inputs, "
                               f"got {out!r}")
        carried = out
        go = cond_fn(*carried, *extra)
    return tuple(carried)


def while_loop(original: Callable) -> Callable:
    @functools.wraps(original)
    def eager_while_loop(cond_fn: Callable, body_fn: Callable, carried_inputs: Any) -> Any:
        if not _eager(carried_inputs):
            return original(cond_fn, body_fn, carried_inputs)
        flat, spec = pytree.tree_flatten(carried_inputs)

        def unflat(fn: Callable) -> Callable:
            return lambda *xs: fn(*pytree.tree_unflatten(list(xs), spec))
        return _loop(unflat(cond_fn), unflat(body_fn), tuple(flat))
    return eager_while_loop


def _map(f: Callable, xs: Any, args: Any) -> Any:
    from torch._higher_order_ops.utils import _stack_pytree, _unstack_pytree
    return _stack_pytree([f(x, *args) for x in _unstack_pytree(xs)])


def map(original: Callable) -> Callable:  # noqa: A001 (torch's name)
    @functools.wraps(original)
    def eager_map(f: Callable, xs: Any, *args: Any) -> Any:
        if not _eager((xs, args)):
            return original(f, xs, *args)
        flat = pytree.tree_leaves(xs)
        if not all(isinstance(t, torch.Tensor) for t in flat):
            raise RuntimeError(f"Mapped xs can only consist of tensors. Got xs {flat}.")
        if flat[0].shape[0] == 0:
            raise RuntimeError("Leading dimensions of mapped xs cannot be 0.")
        return _map(f, xs, args)
    return eager_map


_FUNCTIONS = {"cond": cond, "while_loop": while_loop, "map": map}
_OPS = {"cond": "cond_op", "while_loop": "while_loop_op", "map": "map_impl"}


def install(patches: Any) -> None:
    """The user-facing functions, wherever torch exposes them (``torch.cond``, the package
    ``torch._higher_order_ops`` and each op's module), and each op's dispatch at its autograd
    key: a function taken before activation reaches the op through remotecuda's
    ``torch.compile``, and the op's autograd rule would trace the branches with ``make_fx``."""
    package = sys.modules["torch._higher_order_ops"]
    for name, make in _FUNCTIONS.items():
        module = sys.modules[f"torch._higher_order_ops.{name}"]
        eager = make(getattr(module, name))
        patches.set(module, name, eager)
        patches.set(package, name, eager)
        if name == "cond":
            patches.set(torch, "cond", eager)
        op = getattr(module, _OPS[name])
        patches.set_item(vars(op), "dispatch", _above_autograd(op, op.dispatch))


def _above_autograd(op: Any, original: Callable) -> Callable:
    def dispatch(dispatch_key: Any, /, *args: Any, **kwargs: Any) -> Any:
        if dispatch_key.name.startswith("Autograd") and _eager((args, kwargs)):
            out = dense(op, args, kwargs)
            if out is not NotImplemented:
                return out
        return original(dispatch_key, *args, **kwargs)
    return dispatch


def dense(op: Any, args: tuple, kwargs: dict) -> Any:
    """The op's dense meaning, or NotImplemented for another higher-order op (or while_loop's
    stacked outputs)."""
    name = op.name()
    if name == "cond":
        pred, true_fn, false_fn, operands = args
        return (true_fn if _pred(pred) else false_fn)(*operands)
    if name == "while_loop" and not (len(args) > 4 and args[4] or kwargs.get("stack_output")):
        cond_fn, body_fn, carried, extra = args[:4]
        return _loop(cond_fn, body_fn, tuple(carried), tuple(extra))
    if name == "map_impl":
        f, xs, pos_args = args
        return _map(lambda x, *a: f(*x, *a), xs, pos_args)
    return NotImplemented

