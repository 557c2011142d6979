"""A warning's location in the program: the line a plain call would give it, never remotecuda's.

Python places a warning at a frame: a C++ ``TORCH_WARN`` at the frame that called the torch
binding, a ``warnings.warn`` at the frame ``stacklevel`` levels out. torch's stacklevels count the
frames of a plain call, and remotecuda puts frames of its own between the program and torch: a
route's handler calling the original function (``torch.tensor(t)``), the autocast mode's
``__torch_function__`` (every torch function inside ``torch.autocast('cuda')``), ``generate()``'s
wrapper. Such a warning was placed in remotecuda's code: filtered by the rules for remotecuda's
modules and lines, counted once per remotecuda line, and shown there.

The program's filters must meet it at the program's line, before anything is decided: an "error"
filter raises there, an "ignore" for the program's module or line drops it there, the default
filters show a DeprecationWarning placed in ``__main__`` and hide one placed in a library. The one
hook Python gives before the filters decide is the filters themselves: it asks each entry of
``warnings.filters`` in turn whether it matches (its message pattern's ``match(text)``, its module
pattern's ``match(module)``, ``issubclass(category, its category)``). So while active, an entry of
remotecuda's is first in the list, matching only a warning placed in remotecuda's code: it finds
the first frame outside remotecuda (past torch's ``__torch_function__`` hand-over when one led into
remotecuda: ``handle_torch_function`` and the outer call of the function that handed over, which a
plain call does not have), and its action is "always", so nothing is decided or recorded at
remotecuda's line and Python hands the warning to ``warnings._showwarnmsg``. remotecuda's
``_showwarnmsg`` issues that warning (the instance made, which may carry more than its text and
need more to be built) again at the frame found, with that frame's module and registry, where the
program's filters decide and its once-per-location count applies. The entry matches nothing else;
warnings of remotecuda's own threads (discovery, liveness), with no program frame outside, stay
where they are.

The entry is kept first by ``warnings._filters_mutated``, which every change of the filters made
through ``warnings`` calls (``simplefilter``, ``filterwarnings``, ``resetwarnings``,
``catch_warnings`` entering and leaving).
"""
from __future__ import annotations

import os
import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch.overrides

#: remotecuda's own code (the package's directory)
_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: torch's ``handle_torch_function``, through which a Python torch function hands a call to a mode
_HAND_OVER = os.path.abspath(torch.overrides.__file__)
#: the warning the filters are being asked about, as far as this thread has been told of it, and
#: the frame the entry found for the warning Python is about to show (``pending``)
_asked = threading.local()


class _Text:
    """The entry's message pattern: matches every text, and notes it for the category check."""

    def match(self, text: str) -> bool:
        _asked.text = text
        return True

    def __repr__(self) -> str:
        return "<any text>"


class _Module:
    """The entry's module pattern: matches remotecuda's modules, and notes the one asked about."""

    def match(self, module: str) -> bool:
        _asked.module = module
        return _ours(module)

    def __repr__(self) -> str:
        return f"<{__package__}'s modules>"


class _Relocated:
    """The entry's category: the warnings, placed in remotecuda's code, that have a program frame
    outside (Python asks it last, after the message and module patterns); the frame is kept for
    ``_showwarnmsg``, which Python calls next."""

    def __subclasscheck__(self, category: type) -> bool:
        text, module = getattr(_asked, "text", None), getattr(_asked, "module", None)
        _asked.text = _asked.module = None
        if not active or text is None or module is None or not _ours(module):
            return False
        found = _placed(module)
        outside = found and _outside(*found)
        if not found or outside is None:
            return False
        _asked.pending = outside
        return True

    def __repr__(self) -> str:
        return "<warnings made again at the program's line>"


#: remotecuda's entry in ``warnings.filters``
ENTRY = ("always", _Text(), _Relocated(), _Module(), 0)
#: whether the entry acts (a list that ``catch_warnings`` saved may keep it after ``uninstall``)
active = False


def install(patches: Any) -> None:
    """Put the entry first in ``warnings.filters``, and keep it there; issue the warnings it
    matches again at the program's line (``patches`` undoes both).

    sympy is imported here, where the filters change anyway: torch's Python reference kernels,
    which remotecuda runs for a 'cuda' tensor's shapes and dtypes, import it at their first call,
    and its import adds a filter, which makes Python forget which warnings each line has shown:
    the program's first op on 'cuda' would show them all again (a GPU runs no such kernel)."""
    global active
    import sympy  # noqa: F401
    active = True
    patches.set(warnings, "_showwarnmsg", _relocating(warnings._showwarnmsg))  # type: ignore[attr-defined]
    patches.set(warnings, "_filters_mutated", _keeping_first(warnings._filters_mutated))  # type: ignore[attr-defined]
    warnings._filters_mutated()  # type: ignore[attr-defined]


def uninstall() -> None:
    """Take the entry out of ``warnings.filters`` (after ``install``'s patches are undone)."""
    global active
    active = False
    _take_out(_filters())
    warnings._filters_mutated()  # type: ignore[attr-defined]


def _keeping_first(mutated: Callable[[], None]) -> Callable[[], None]:
    """``warnings._filters_mutated`` that first moves remotecuda's entry to the front of the list."""
    def _filters_mutated() -> None:
        filters = _filters()
        if not filters or filters[0] is not ENTRY:
            _take_out(filters)
            filters.insert(0, ENTRY)
        mutated()
    return _filters_mutated


def _relocating(show: Callable[[Any], None]) -> Callable[[Any], None]:
    """``warnings._showwarnmsg`` that issues the warning the entry matched again at the frame it
    found (the matched warning is the next one shown on its thread: its action is "always")."""
    def _showwarnmsg(msg: Any) -> None:
        frame = getattr(_asked, "pending", None)
        _asked.pending = None
        if frame is None or not msg.filename.startswith(_OURS):
            show(msg)
            return
        _issue(msg.message, frame)
    return _showwarnmsg


def _filters() -> list[Any]:
    """The list of filters Python reads now (``catch_warnings`` puts a copy in place, and back)."""
    return cast(list, warnings.filters)


def _take_out(filters: list[Any]) -> None:
    while ENTRY in filters:
        filters.remove(ENTRY)


def _ours(module: str) -> bool:
    """Whether ``module`` is remotecuda's (the name Python gives a warning placed in its code)."""
    return module == __package__ or module.startswith(f"{__package__}.")


def _placed(module: str) -> tuple[types.FrameType, types.FrameType | None] | None:
    """The frame a warning was placed at (on this thread's stack: the filters are asked as the
    warning is made): the innermost of ``module``'s, and the innermost frame inside it that is not
    remotecuda's (the torch function that warned, or that warned through a C++ call), if any."""
    frame: types.FrameType | None = sys._getframe(2)
    inner = None
    while frame is not None:
        ours = frame.f_code.co_filename.startswith(_OURS)
        if ours and frame.f_globals.get("__name__") == module:
            return frame, inner
        if not ours:
            inner = frame
        frame = frame.f_back
    return None


def _outside(frame: types.FrameType, inner: types.FrameType | None) -> types.FrameType | None:
    """The first frame out from ``frame`` that a plain call would have had, or None when only
    remotecuda's thread machinery is there. A function handed over to a mode is called again by
    it, once per mode on the stack (nested ``torch.autocast('cuda')`` blocks stack an autocast
    mode each): every such outer call, with the mode's frames around it, is passed."""
    f: types.FrameType | None = frame
    while True:
        handed_over = False
        while f is not None and (f.f_code.co_filename.startswith(_OURS) or f.f_code.co_filename == _HAND_OVER):
            handed_over = handed_over or f.f_code.co_filename == _HAND_OVER
            f = f.f_back
        if not (handed_over and f is not None and inner is not None and f.f_code is inner.f_code):
            break
        f = f.f_back  # (the outer call of the function that handed itself to the mode)
    if f is None or f.f_globals.get("__name__") == "threading":
        return None
    return f


def _issue(message: Warning, frame: types.FrameType) -> None:
    """The warning made again at ``frame``, as ``warnings.warn`` places one there: the filters and
    the registry of that frame's module decide whether it is shown, raised or dropped. (Not given
    the module's globals, as ``warnings.warn`` gives none: ``warn_explicit`` would ask their loader
    for the source, and ``python -c``'s ``__main__`` loader raises ImportError; the line is read
    from its file as for any warning.)"""
    module_globals = frame.f_globals
    warnings.warn_explicit(message, type(message), frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__", "<string>"),
                           registry=module_globals.setdefault("__warningregistry__", {}))
