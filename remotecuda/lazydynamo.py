"""torch's Python meta kernels, without importing torch._dynamo on their first call.

Many meta kernels are wrapped in ``torch._disable_dynamo``, whose wrapper imports
torch._dynamo (~1 s, and torch.distributed with it) the first time it runs, to turn
Dynamo's tracing off around the kernel. Until torch._dynamo is imported nothing can be
tracing, so calling the kernel directly is the same; ``install`` gives each such wrapper
that already exists a stand-in that does so, and hands over to Dynamo's own wrapper once
torch._dynamo is loaded (``torch.compile``). Wrappers torch creates later keep torch's
behaviour, as does a torch whose wrapper is not the one this was written for (2.x).
"""
from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from types import FunctionType
from typing import Any

import torch

_ATTR = "__dynamo_disable"  # where torch._compile's wrapper caches Dynamo's wrapper of fn


def _until_dynamo(fn: Callable, recursive: bool) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        disable = getattr(sys.modules.get("torch._dynamo"), "disable", None)
        if disable is None:
            return fn(*args, **kwargs)
        real = disable(fn, recursive, wrapping=False)
        setattr(fn, _ATTR, real)
        return real(*args, **kwargs)
    return call


def install() -> None:
    if "torch._dynamo" in sys.modules:
        return
    code = torch._compile._disable_dynamo(lambda: None).__code__
    if code.co_freevars != ("fn", "recursive"):
        return
    for o in gc.get_objects():
        if type(o) is FunctionType and o.__code__ is code and o.__closure__ is not None:
            fn, recursive = (cell.cell_contents for cell in o.__closure__)
            if getattr(fn, _ATTR, None) is None:
                setattr(fn, _ATTR, _until_dynamo(fn, recursive))
