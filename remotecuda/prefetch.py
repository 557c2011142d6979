"""``remotecuda.prefetch(loader)``: keep the next batches on their way to the GPU.

Uploads are asynchronous already; what makes a training loop serial is that batch i+1
is only handed to ``.cuda()`` after step i was issued. Moving the next ``depth``
batches ahead of time lets the gateway receive them while it computes, so a step costs
about max(transfer, compute) rather than their sum.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def to_device(batch: Any, device: Any = "cuda") -> Any:
    """Move every tensor in a (nested) batch with ``non_blocking=True``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def prefetch(loader: Iterable, device: Any = "cuda", depth: int = 2) -> Iterator:
    """Yield the loader's batches already on ``device``, ``depth`` batches ahead."""
    ahead: deque = deque()
    for batch in loader:
        ahead.append(to_device(batch, device))
        if len(ahead) > depth:
            yield ahead.popleft()
    while ahead:
        yield ahead.popleft()
