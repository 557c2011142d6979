"""The gateway kernels' warnings, raised again in the user's program.

A kernel that warns on a GPU machine (index_reduce's "beta" note, a deterministic-algorithms
``warn_only`` alert, a deprecation) warns in the program at the call. Here the kernel runs on
the gateway, whose worker keeps its warnings (remotecuda_server/kernel_warnings.py) and sends
them with the next REPLY; the session raises each here at that sync point, with its category and
message, attributed to the first frame of the user's code, so ``warnings.catch_warnings``,
``pytest.warns`` and the program's filters see them as they would see a GPU's.

A sync point with no frame of the program on the stack has its place given (``placed_at``): the
end of a notebook cell, where the Jupyter extension waits for the cell's work from IPython's
event hook.
"""
from __future__ import annotations

import builtins
import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

#: frames in these directories are remotecuda's or torch's, not the program's
_OURS = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep)
#: this thread's ``placed_at`` place, if any: (filename, line, the module's globals)
_place = threading.local()


@contextlib.contextmanager
def placed_at(filename: str, lineno: int, module_globals: dict) -> Iterator[None]:
    """The warnings raised in the block belong at ``filename:lineno`` of the module whose globals
    are ``module_globals`` (its filters and once-per-location registry decide), not at the first
    frame outside remotecuda: a notebook cell's end-of-cell sync runs in IPython's event hook,
    whose line Python would show, and whose registry would then hide the warning in every later
    cell."""
    before = getattr(_place, "at", None)
    _place.at = (filename, lineno, module_globals)
    try:
        yield
    finally:
        _place.at = before


def raise_again(entries: Any) -> None:
    """Raise each ``[category name, message]`` a REPLY's ``warn`` carries."""
    if not isinstance(entries, list):
        return
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
            continue
        place = getattr(_place, "at", None)
        if place is None:
            warnings.warn(entry[1], _category(entry[0]), stacklevel=_user_level())
            continue
        filename, lineno, module_globals = place
        # (not given module_globals: their loader would be asked for the source, and a
        # notebook's ``__main__`` has none; the cell's lines are in linecache)
        warnings.warn_explicit(entry[1], _category(entry[0]), filename, lineno,
                               module=module_globals.get("__name__", "<string>"),
                               registry=module_globals.setdefault("__warningregistry__", {}))


def _category(name: str) -> type[Warning]:
    """A built-in warning class by name (all that torch's kernels raise); UserWarning otherwise."""
    c = getattr(builtins, name, None)
    return c if isinstance(c, type) and issubclass(c, Warning) else UserWarning


def _user_level() -> int:
    """The ``stacklevel`` that names the innermost frame outside remotecuda and torch."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OURS):
        frame, level = frame.f_back, level + 1
    return level
