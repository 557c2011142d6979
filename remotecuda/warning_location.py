"""A warning's location in the program: the line a plain call would give it, never remotecuda's.

Python places a warning at a frame: a C++ ``TORCH_WARN`` at the frame that called the torch
binding, a ``warnings.warn`` at the frame ``stacklevel`` levels out. torch's stacklevels count the
frames of a plain call, and remotecuda puts frames of its own between the program and torch: a
route's handler calling the original function (``torch.tensor(t)``), the autocast mode's
``__torch_function__`` (every torch function inside ``torch.autocast('cuda')``), ``generate()``'s
wrapper. Such a warning was placed in remotecuda's code: shown there, filtered by the rules for
remotecuda's modules and counted once per remotecuda line instead of once per line of the program.

While active, a warning placed in remotecuda's code is issued again where it belongs: at the
first frame outside remotecuda, past torch's ``__torch_function__`` hand-over when one led into
remotecuda (``handle_torch_function`` and the outer call of the function that handed over, which
a plain call does not have). The program's filters then decide at its own line, as on a GPU
machine. The hook is ``warnings._showwarnmsg``, which Python calls for every warning to show and
which ``catch_warnings`` (pytest's capture, ``record=True``) leaves in place. Python has applied
the filters at remotecuda's line by then: the registry entries that left are removed, so the count
is the program's; an "error" filter has raised already (the same warning, through remotecuda's
frames, which the traceback hook hides); an "ignore" of every such warning has dropped it, as it
would have at the program's line. Warnings of remotecuda's own threads (discovery, liveness),
with no program frame outside, stay where they are.
"""
from __future__ import annotations

import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch.overrides

#: remotecuda's own code (the package's directory)
_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: torch's ``handle_torch_function``, through which a Python torch function hands a call to a mode
_HAND_OVER = os.path.abspath(torch.overrides.__file__)


def relocating(show: Callable[[Any], None]) -> Callable[[Any], None]:
    """``warnings._showwarnmsg`` that issues a warning placed in remotecuda's code again at the
    program's line, and passes every other warning to ``show`` (the one it replaces)."""
    def _showwarnmsg(msg: Any) -> None:
        if msg.filename.startswith(_OURS):
            found = _placed(msg.filename, msg.lineno)
            outside = found and _outside(*found)
            if found and outside is not None:
                _forget(msg, found[0])
                _issue(msg, outside)
                return
        show(msg)
    return _showwarnmsg


def _placed(filename: str, lineno: int) -> tuple[types.FrameType, types.FrameType | None] | None:
    """The frame a warning was placed at (on this thread's stack: Python shows a warning as it is
    made), and the innermost frame inside it that is not remotecuda's (the torch function that
    warned, or that warned through a C++ call), if any."""
    frame: types.FrameType | None = sys._getframe(2)
    inner = None
    while frame is not None:
        code = frame.f_code
        if code.co_filename == filename and frame.f_lineno == lineno:
            return frame, inner
        if not code.co_filename.startswith(_OURS):
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


def _forget(msg: Any, frame: types.FrameType) -> None:
    """Remove what the filters recorded of ``msg`` at remotecuda's line ("default", "module",
    "once"), so that they count it at the program's line only."""
    text, category = str(msg.message), msg.category
    registry = frame.f_globals.get("__warningregistry__")
    if isinstance(registry, dict):
        for key in ((text, category, msg.lineno), (text, category, 0)):
            registry.pop(key, None)
    once = getattr(warnings, "_onceregistry", None)
    if isinstance(once, dict):
        once.pop((text, category), None)


def _issue(msg: Any, frame: types.FrameType) -> None:
    """``msg`` made again at ``frame``, as ``warnings.warn`` places one there: the filters and the
    registry of that frame's module decide whether it is shown, raised or dropped. (Not given the
    module's globals, as ``warnings.warn`` gives none: ``warn_explicit`` would ask their loader for
    the source, and ``python -c``'s ``__main__`` loader raises ImportError; the line is read from
    its file as for any warning.)"""
    module_globals = frame.f_globals
    warnings.warn_explicit(msg.message, msg.category, frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__", "<string>"),
                           registry=module_globals.setdefault("__warningregistry__", {}), source=msg.source)
