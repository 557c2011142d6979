"""A process forked while remotecuda was active: CUDA's "bad fork", as on a GPU machine.

A GPU's CUDA state does not survive ``fork``. Once a process has asked CUDA anything (even
``torch.cuda.is_available()``), torch marks the children it forks as in a bad fork: a child's
first CUDA use (``.cuda()``, ``.to('cuda')``, a factory function given ``device='cuda'`` or a
default device of 'cuda') raises ``RuntimeError: Cannot re-initialize CUDA in forked subprocess.
To use CUDA with multiprocessing, you must use the 'spawn' start method``, while
``torch.cuda.is_available()`` and ``device_count()`` still give the parent's answers (CUDA
counted its devices before the fork) and ``torch.manual_seed`` leaves the CUDA generators alone.
A DataLoader worker whose ``collate_fn`` moves a batch to 'cuda' meets exactly this.

The child of a remotecuda program drops the parent's runtime (runtime.release_in_forked_child:
its sessions' sockets are the parent's) and gets the CPU build's torch back, but not quite as it
was before activation: torch's C++ remembers that CUDA's lazy initialization ran (remotecuda's
``torch.cuda._lazy_init`` succeeded in the parent) and never asks Python again, so a 'cuda'
tensor went straight to the kernels a CPU build lacks ("Could not run 'aten::empty.memory_format'
with arguments from the 'CUDA' backend", "PyTorch is not linked with support for cuda devices").
``enter`` does in the child what a CUDA build's own fork handler does (``in_bad_fork = true;
set_requires_device_init(kCUDA, true)``): C++ asks ``torch.cuda._lazy_init`` again, which raises
torch's own error because ``torch.cuda._is_in_bad_fork()`` now says so. ``leave`` undoes the Python
side when the child activates remotecuda itself, which it may (it gets its own sessions).

This is the process's state, not an activation's: it outlives the runtime it came from, and a
child forked from this child inherits it as a GPU's would.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

#: the C++ function a CUDA build's fork handler calls (torch/csrc/utils/device_lazy_init.h)
_REQUIRE_INIT = "_ZN5torch5utils24set_requires_device_initEN3c1010DeviceTypeEb"
_CUDA = 1  # c10::DeviceType::CUDA

#: (attribute of torch.cuda, torch's own value) for each attribute ``enter`` replaced
_saved: list[tuple[str, Any]] = []
_forked = False


def forked() -> bool:
    """Whether this process was forked from one where remotecuda was active (its 'cuda' tensors
    are the parent's, and unusable here)."""
    return _forked


def enter(device_count: int) -> None:
    """Make this freshly forked child a bad fork of a parent that saw ``device_count`` devices."""
    global _forked
    _forked = True
    _require_lazy_init()
    for name, value in (("_is_in_bad_fork", lambda: True), ("is_available", lambda: device_count > 0),
                        ("device_count", lambda: device_count)):
        _saved.append((name, getattr(torch.cuda, name)))
        setattr(torch.cuda, name, value)


def leave() -> None:
    """torch.cuda as torch made it, for an activation in this child (whose C++ already asks
    ``_lazy_init`` again, which interception answers)."""
    while _saved:
        name, value = _saved.pop()
        setattr(torch.cuda, name, value)


def _require_lazy_init() -> None:
    """Tell torch's C++ that CUDA must be initialized (by ``torch.cuda._lazy_init``) before its
    next use. The function has no Python binding; where this build of torch does not export it,
    the child's CUDA use fails with the CPU build's errors instead of torch's bad-fork one."""
    try:
        require = getattr(ctypes.CDLL(torch._C.__file__), _REQUIRE_INIT)
    except (OSError, AttributeError):
        return
    require.argtypes = [ctypes.c_int8, ctypes.c_bool]
    require.restype = None
    require(_CUDA, True)
