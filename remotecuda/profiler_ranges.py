"""``record_function`` ranges kept out of the dispatch mode while no profiler collects.

``torch.autograd.profiler.record_function`` (every optimizer's ``step()`` and ``zero_grad()``
open one) opens and closes its range with two dispatcher ops, ``profiler::_record_function_enter_new``
and ``profiler::_record_function_exit``. While remotecuda is active both pass through its
``TorchDispatchMode`` and back through ``OpOverload.__call__``: a range cost 123k client
instructions instead of 51k, two per optimizer step (benchmarks/RESULTS.md, 2026-12-08).

The ops do nothing but begin and end a ``RecordFunction``; torch's own bindings
``_record_function_with_args_enter``/``_exit`` do the same without the dispatcher, so they give the
range to whatever RecordFunction callbacks are registered, as the ops would. What only the
dispatcher adds is an event for each op itself, seen by a profiler, and the ops' trip through
dispatch and torch-function modes: a call takes the bindings only while no profiler is enabled on
the thread and no mode other than remotecuda's would see the op; otherwise it is torch's op,
unchanged. Each call decides for itself, so a range entered before a profiler starts, or closed
after it stops, is recorded as torch records it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_profiler_enabled = torch._C._autograd._profiler_enabled
_enter = torch._C._autograd._record_function_with_args_enter
_exit = torch._C._autograd._record_function_with_args_exit
_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled


def install(p: Any, mode_type: type) -> None:
    """Route the two profiler ops that ``record_function`` calls (``p``: interception's patches;
    ``mode_type``: remotecuda's dispatch mode). The ops' Python objects stay torch's (Dynamo and
    others read their overloads): what changes is the C++ function each calls, its ``_op``."""
    enter = torch.ops.profiler._record_function_enter_new
    p.set(enter, "_op", _enter_new(enter._op, mode_type))
    exit_op = torch.ops.profiler._record_function_exit._RecordFunction
    p.set(exit_op, "_op", _exit_new(exit_op._op, mode_type))


def _direct(mode_type: type) -> Callable[[], bool]:
    """Whether nothing but the RecordFunction itself would see a range's op (see the module)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    def direct() -> bool:
        if _profiler_enabled() or _function_modes():
            return False
        n = _modes()
        return n == 0 or (n == 1 and isinstance(_get_current_dispatch_mode(), mode_type))
    return direct


def _enter_new(op: Callable, mode_type: type) -> Callable:
    direct = _direct(mode_type)

    def _record_function_enter_new(name: str, args: str | None = None) -> Any:
        if not direct():
            return op(name, args)
        return _enter(name) if args is None else _enter(name, args)
    return _record_function_enter_new


def _exit_new(op: Callable, mode_type: type) -> Callable:
    direct = _direct(mode_type)

    def _record_function_exit(record: Any) -> Any:
        if not direct():
            return op(record)
        _exit(record)
        return None
    return _record_function_exit
