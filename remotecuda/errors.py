"""Exceptions; turning a gateway's error report back into the one PyTorch would raise; and
tracebacks that show the user's code, not the runtime's."""
from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Any

import remotecuda_wire


class RemoteCUDAError(RuntimeError):
    """Base class for RemoteCUDA's own failures (not an op's)."""


class GatewayUnavailableError(RemoteCUDAError):
    """No gateway answered, and fallback to the local CPU is off."""


class GatewayAuthError(GatewayUnavailableError):
    """The gateway and this client do not share a token: the gateway wants one this client lacks
    or refused this client's, or this client holds one and the gateway did not prove it has it."""


class GatewayLostError(RemoteCUDAError):
    """The gateway or this session's worker stopped answering; the session's tensors are gone."""


class GatewayDownError(GatewayUnavailableError, GatewayLostError):
    """A gateway in use stopped answering heartbeats, left the pool or restarted (liveness.py):
    its sessions' tensors are gone. Both kinds at once: the gateway is unavailable, and each
    session on it is lost (code that catches either keeps working)."""


class GatewayProtocolError(RemoteCUDAError):
    """The gateway rejected a message as malformed."""


class TransferError(RemoteCUDAError):
    """A copy between two virtual devices failed on its way from one gateway worker to the other
    (the source's gateway stopped answering, or refused the copy's token)."""


_TYPES: dict[str, type[BaseException]] = {
    "RuntimeError": RuntimeError, "IndexError": IndexError, "ValueError": ValueError,
    "TypeError": TypeError, "NotImplementedError": NotImplementedError,
    "UnknownOpError": NotImplementedError, "ZeroDivisionError": ZeroDivisionError,
    "OverflowError": OverflowError, "KeyError": KeyError, "AssertionError": AssertionError,
    "ProtocolError": GatewayProtocolError, "TransferError": TransferError,
}
#: torch's own exception types (``except torch.linalg.LinAlgError``, ``torch.AcceleratorError``: a GPU's
#: device-side assert), found in ``torch._C`` when raised: this module does not import torch, so a kernel
#: starts without it
_TORCH_TYPES = ("OutOfMemoryError", "_LinAlgError", "AcceleratorError")


def accelerator_error(msg: str) -> RuntimeError:
    """The error a CUDA call's failure raises (``torch.AcceleratorError``, a RuntimeError: an
    invalid device ordinal), made without importing torch before it is needed."""
    import torch
    return torch.AcceleratorError(msg)


#: what the gateway says of a tensor whose op a CANCEL dropped (remotecuda_server/executor.py)
_CANCELLED = "cancelled by an interrupt"


#: the attribute that marks an exception raised on the gateway (its client frames are all ours)
_REMOTE = "_remotecuda_remote"


def is_remote(e: object) -> bool:
    """Whether ``e`` was raised on the gateway (``remote_exception`` made it)."""
    return getattr(e, _REMOTE, False) is True


def remote_exception(info: dict, asynchronous: bool = True) -> BaseException:
    """The exception local PyTorch would raise: the gateway's type and message, unchanged.

    Where it is raised matters to the reader, so a note says why when that is not the line
    that caused it: an op that failed asynchronously (raised at a later sync point), or a
    tensor whose op ``%remotecuda cancel`` dropped (raised where the tensor is next used).
    """
    name = info.get("type", "")
    if name in _TORCH_TYPES:
        import torch
        cls: type[BaseException] = getattr(torch._C, name, RuntimeError)
    else:
        cls = _TYPES.get(name, RuntimeError)
    msg = str(info.get("msg", ""))
    e = (RuntimeError if cls is KeyError else cls)(msg)  # KeyError would quote the message
    setattr(e, _REMOTE, True)
    if _CANCELLED in msg:
        e.add_note("[remotecuda] the work an interrupted cell left running was dropped (%remotecuda "
                   "cancel) before the op that was to compute this tensor ran; run the code that "
                   "computes it again")
    elif asynchronous:
        e.add_note(f"[remotecuda] raised by op {info.get('op')} (#{info.get('index')}) on the "
                   "gateway; ops run asynchronously, so the Python line that issued it may be "
                   "earlier than this one (set REMOTECUDA_SYNC=1 to raise at the call site)")
    skipped = info.get("skipped")
    if isinstance(skipped, int) and skipped > 0:
        e.add_note(_skipped_note(skipped, info.get("skipped_inplace")))
    return e


def _skipped_note(skipped: int, inplace: Any) -> str:
    """What became of the ops queued after the failing one (the gateway skips them all, as a GPU
    would never have run the lines after the one that raised): tensors they were to make raise
    "never computed" when used, but those they were to change in place keep their earlier values
    silently, unless this says so."""
    ops = f"{skipped} op{'s' if skipped != 1 else ''}"
    note = (f"[remotecuda] the {ops} queued after it, up to this line, did not run: tensors they were "
            "to compute are never computed")
    if isinstance(inplace, int) and inplace > 0:
        note += (f"; {inplace} of them were to update existing tensors in place (an optimizer's step, "
                 "`x += ...`), which keep their earlier values")
    return note


# ---------------------------------------------------------------------- tracebacks

#: the runtime's packages: remotecuda and the wire it shares with the gateway (in a checkout these
#: are not under sys.prefix, so a wire frame - an interrupt while an upload is hashed - is not a library's)
_PACKAGES = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, remotecuda_wire.__file__))
_LIBRARIES = tuple({os.path.join(p, "") for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                    sys.base_exec_prefix)})


def _ours(tb: TracebackType) -> bool:
    return tb.tb_frame.f_code.co_filename.startswith(_PACKAGES)


def _library(tb: TracebackType) -> bool:
    """Installed code; also compiled (Cython) frames, whose file names are relative."""
    name = tb.tb_frame.f_code.co_filename
    return name.startswith(_LIBRARIES) or name.startswith("<frozen ") or \
        not (os.path.isabs(name) or name.startswith("<"))


def user_traceback(tb: TracebackType | None, remote: bool = False) -> TracebackType | None:
    """``tb`` as local PyTorch would have it: without the runtime's frames.

    Dropped: remotecuda's own frames, those above the user's code (``remotecuda run``,
    runpy), and the library frames below a remotecuda frame (meta kernels, ZeroMQ: where
    local PyTorch is in C++), generated code's among them (a dataclass's ``__eq__``, file
    ``<string>``, where an interrupt may land). The last frame shown is then the line that called torch.
    A traceback with no frame of the user's (a bug of remotecuda's) is left whole, unless
    ``remote``: the gateway's error, raised where no user code is on the stack (Jupyter showing
    a cell's value): then no frame is shown, as for the error of a cell's end.
    """
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    kept: list[TracebackType] = []
    user = below_ours = False
    for t in frames:
        if _ours(t):
            below_ours = user
        elif not user and t.tb_frame.f_code.co_filename == "<frozen runpy>":
            continue
        elif not (below_ours and (_library(t) or t.tb_frame.f_code.co_filename == "<string>")):
            kept.append(t)
            if not _library(t):
                user, below_ours = True, False
    if not user:
        return None if remote or not frames else frames[0]
    out = None
    for t in reversed(kept):
        out = TracebackType(out, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return out


def hide_runtime_frames(e: BaseException, _seen: set | None = None) -> BaseException:
    """``e``, and the exceptions chained to it, with ``user_traceback``s; returns ``e``."""
    seen = set() if _seen is None else _seen
    if e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = user_traceback(e.__traceback__, getattr(e, _REMOTE, False))
        for chained in (e.__cause__, e.__context__):
            if chained is not None:
                hide_runtime_frames(chained, seen)
    return e


def excepthook(etype: type, value: BaseException, tb: TracebackType | None) -> Any:
    """sys.excepthook while remotecuda is active: the hook it replaced, shown the user's frames."""
    if isinstance(value, BaseException):  # Python's hook prints value.__traceback__, not tb
        value.__traceback__ = tb
        tb = hide_runtime_frames(value).__traceback__
    return _previous_hook(etype, value, tb)


_previous_hook = sys.excepthook


def install_excepthook() -> None:
    global _previous_hook
    if sys.excepthook is not excepthook:
        _previous_hook, sys.excepthook = sys.excepthook, excepthook


def uninstall_excepthook() -> None:
    if sys.excepthook is excepthook:
        sys.excepthook = _previous_hook
