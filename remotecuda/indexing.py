"""Python sequences in the index of a 'cuda' tensor, read as PyTorch reads them.

C++ turns a list, tuple or range in an index into an index tensor made with the indexed
tensor's options, which for a wrapper say 'meta': the indices would be lost. So the index is
rewritten first, with torch's rules (python_variable_indexing.cpp): a tuple indexes several
dimensions; a list (or other sequence) does too when it is short and holds a tensor, a
sequence, a slice, ``...`` or ``None`` (with torch's deprecation warning), else it is one index
tensor; each sequence part becomes a CPU index tensor (long, or a mask when its values are
bools or bytes), which the gateway receives as a GPU receives a CPU index.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

#: what torch's C++ warns when it reads a non-tuple sequence as several dimensions' indices
_AS_TUPLE_WARNING = ("Using a non-tuple sequence for multidimensional indexing is deprecated and will be changed "
                     "in pytorch 2.9; use x[tuple(seq)] instead of x[seq]. In pytorch 2.9 this will be interpreted "
                     "as tensor index, x[torch.tensor(seq)], which will result either in an error or a different "
                     "result")


def index_parts(idx: Any) -> Any:
    """``idx`` with its sequences made CPU index tensors, as C++ would make them (on the CPU)."""
    if type(idx) is tuple:
        return tuple(_part(i) for i in idx)
    if _is_sequence(idx) and _as_tuple(idx):
        warnings.warn(_AS_TUPLE_WARNING, UserWarning, stacklevel=1)  # (at the program's line: warning_location.py)
        return tuple(_part(i) for i in idx)
    return _part(idx)


def _is_sequence(x: Any) -> bool:
    return type(x) is list or type(x) is tuple or type(x) is range


def _as_tuple(seq: Sequence) -> bool:
    """torch's (NumPy's) heuristic: a short sequence holding what only a tuple index would hold."""
    return len(seq) < 32 and any(
        x is None or x is Ellipsis or isinstance(x, (torch.Tensor, slice, Sequence)) or getattr(x, "ndim", 0) > 0
        for x in seq)


def _part(x: Any) -> Any:
    if not _is_sequence(x):
        return x
    t = torch.tensor(x)
    return t if t.dtype in (torch.bool, torch.uint8, torch.int64) else t.long()
