"""The warnings a session's kernels raise, kept for the client.

On a GPU machine a kernel's warning (C++ ``TORCH_WARN``, a Python ``warnings.warn`` in an op)
reaches the user's program at the call. Here the kernel runs in the session's worker, so the
worker keeps every warning it sees and the next REPLY carries them (docs/PROTOCOL.md, REPLY's
``warn``), for the client to raise. The worker passes every warning on ("always"): which are
shown, and how often, is for the client's filters to decide, as it is on a GPU machine; a C++
``TORCH_WARN_ONCE`` still fires once in the worker, which serves one session.

A C++ warning becomes a Python one only inside a torch binding that installs torch's Python
warning handler (``HANDLE_TH_ERRORS``); an ``OpOverload`` call does not, and its warnings went to
the worker's stderr. So a message's ops run inside one such binding (``within``): the handler is
the binding's for the thread, and its warnings are raised in Python when it returns. That costs
about 1 µs a message, nothing an op; ``warnings.showwarning`` is only called for a warning.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

#: distinct warnings one REPLY carries at most (a loop warning afresh each step sends each once)
MOST = 64
T = TypeVar("T")


class KernelWarnings:
    """The warnings seen since the last REPLY, each distinct (category, message) once."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], None] = {}

    def install(self) -> None:
        """Route every warning of this process here (the worker serves one session)."""
        warnings.simplefilter("always")
        warnings.showwarning = self._show

    def _show(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
              file: Any = None, line: str | None = None) -> None:
        if len(self._seen) < MOST:
            self._seen[(category.__name__, str(message))] = None

    def __bool__(self) -> bool:
        return bool(self._seen)

    def take(self) -> list[list[str]]:
        """``[[category name, message], ...]`` seen since the last call, in order."""
        seen, self._seen = self._seen, {}
        return [list(k) for k in seen]


#: the one-element tensor whose ``apply_`` is the binding ``within`` calls through
_ONE = torch.zeros(1)


def within(f: Callable[[], T]) -> T:
    """``f()`` inside a torch binding (``Tensor.apply_``, which calls its function once per element:
    about 1 µs), so that the C++ warnings it raises become Python warnings as the binding returns."""
    out: list[T] = []

    def call(v: float) -> float:
        out.append(f())
        return v

    _ONE.apply_(call)
    return out[0]
