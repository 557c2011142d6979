"""``CUDA_VISIBLE_DEVICES`` in the client's environment, read as CUDA reads it, over the virtual devices.

A program (or a launcher: a job scheduler, ``torchrun``-style wrappers) that sets
``CUDA_VISIBLE_DEVICES=1`` or ``0,2`` before its first use of a device (CUDA's initialization; the
pool reads it until then, ``Pool.visible``) means what it means on a GPU machine:
the program sees those devices only, renumbered from 0 in the order given. Here the devices
are remotecuda's virtual ones (``cuda:0..N-1`` as the pool made them, pool.py), so the variable
picks among those. It is parsed as CUDA's runtime parses it (and torch's
``_parse_visible_devices``): comma-separated ordinals, each read like ``strtoul`` (``1gpu`` is
1); a negative or unreadable entry ends the list; an ordinal past the last device ends it too
(CUDA ignores the rest); a repeated ordinal hides every device; an empty value hides them all.
UUIDs (``GPU-…``, ``MIG-…``) name a machine's physical GPUs, which a virtual device is not:
they are ignored, with a warning.

Where the client's torch is itself a CUDA (or ROCm) build, the variable is its runtime's, over
this machine's GPUs: ``CUDA_VISIBLE_DEVICES=""`` is how such a client is kept off a local GPU
(benchmarks/gpu_check.sh runs the client beside a gateway so), so it is left to that runtime.
"""
from __future__ import annotations

import os
import warnings

VAR = "CUDA_VISIBLE_DEVICES"


def _strtoul(s: str) -> int:
    """The number ``s`` starts with (an optional sign, then digits), or -1 for none."""
    n = 0
    while n < len(s) and (s[n].isdigit() or (n == 0 and s[n] in "+-")):
        n += 1
    try:
        return int(s[:n])
    except ValueError:
        return -1


def parse(value: str | None, count: int) -> list[int] | None:
    """The indices (of ``count`` devices) that ``value`` leaves visible, in its order; None: all."""
    if value is None:
        return None
    if value.strip().startswith(("GPU-", "MIG-")):
        warnings.warn(f"remotecuda: {VAR}={value!r} names GPUs by UUID, which remotecuda's virtual devices "
                      f"do not have; all {count} device(s) stay visible", RuntimeWarning, stacklevel=4)
        return None
    visible: list[int] = []
    for entry in value.split(","):
        i = _strtoul(entry.strip())
        if i in visible:
            return []
        if i < 0 or i >= count:
            break
        visible.append(i)
    return visible


def from_env(count: int) -> list[int] | None:
    """What the environment's ``CUDA_VISIBLE_DEVICES`` leaves visible of ``count`` devices (None: all)."""
    import torch
    if torch.backends.cuda.is_built():  # (the local runtime's variable)
        return None
    return parse(os.environ.get(VAR), count)
