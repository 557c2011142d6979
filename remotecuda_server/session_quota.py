"""A session's memory quota (``remotecuda start --session-memory SIZE``): the most one session may hold.

A GPU's size (or a simulated GPU's account, memory_account.py) bounds all the sessions on it
together; the quota bounds each alone, so one session cannot take a shared GPU from the others.
It is a second limit checked at the same point as the account: on the CPU device, the handle
table (executor.CountedHandles) takes each new storage from the quota, which checks its own
limit and then draws from the account behind it; on a CUDA device, the worker's share of the
caching allocator is capped (``torch.cuda.set_per_process_memory_fraction``: a worker process
serves one session, so its ``memory_allocated`` is that session's), and the executor names the
quota in the error. Past it, the op that allocates fails with the ``torch.OutOfMemoryError`` a
GPU raises, for that session alone, which goes on. Uploads are checked against what is left
before they are decompressed or placed (worker.py).

A client's ``torch.cuda.set_per_process_memory_fraction`` is a third limit, the session's own
(its worker process is the "process"): on a CUDA device the worker sets the fraction itself
(the lower of it and the quota's); on the CPU device it is a ``cap`` here, checked beside the quota.
"""
from __future__ import annotations

import torch

from .memory_account import MemoryAccount, fmt_bytes

#: where the limit comes from, in every message that names it
FLAG = "remotecuda start --session-memory"


def over_quota(limit: int, in_use: int, n: int) -> torch.OutOfMemoryError:
    """The error for an allocation of ``n`` bytes by a session holding ``in_use`` of ``limit``."""
    return torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {fmt_bytes(n)}. This session's memory quota is "
        f"{fmt_bytes(limit)} ({FLAG}), of which {fmt_bytes(in_use)} is in use and "
        f"{fmt_bytes(max(0, limit - in_use))} is free.")


def over_fraction(cap: int, fraction: float, total: int, in_use: int, n: int) -> torch.OutOfMemoryError:
    """The error CUDA's allocator raises past ``set_per_process_memory_fraction``'s share of ``total``."""
    return torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {fmt_bytes(n)}. GPU has a total capacity of {fmt_bytes(total)}. "
        f"{fmt_bytes(in_use)} is allocated by PyTorch, with {fmt_bytes(cap)} allowed "
        f"(torch.cuda.set_per_process_memory_fraction({fraction})).")


class SessionQuota:
    """One session's limits (``limit``: the quota, None without one; and the fraction's ``cap``),
    in front of its simulated GPU's account (if any): the handle table takes, gives and settles
    through it as through the account itself."""

    def __init__(self, limit: int | None, account: MemoryAccount | None = None):
        self.limit, self.account = limit, account
        self.mine = 0  # bytes this session holds
        self.cap: int | None = None  # fraction × total, once the client set a fraction
        self.fraction, self.total = 1.0, 0

    def set_fraction(self, fraction: float, total: int) -> None:
        """``torch.cuda.set_per_process_memory_fraction(fraction)`` of a device of ``total`` bytes."""
        self.fraction, self.total = fraction, total
        self.cap = int(fraction * total)

    def allowed(self) -> int | None:
        """The most this session may hold, or None when nothing but the GPU's size bounds it."""
        caps = [c for c in (self.limit, self.cap) if c is not None]
        return min(caps) if caps else None

    def check(self, in_use: int, n: int) -> None:
        """Raise the ``torch.OutOfMemoryError`` for ``n`` more bytes beside ``in_use`` past a limit."""
        if self.limit is not None and in_use + n > self.limit:
            raise over_quota(self.limit, in_use, n)
        if self.cap is not None and in_use + n > self.cap:
            raise over_fraction(self.cap, self.fraction, self.total, in_use, n)

    def take(self, n: int) -> None:
        """Take ``n`` bytes, or raise the ``torch.OutOfMemoryError`` that names the limit (or the GPU's)."""
        self.check(self.mine, n)
        if self.account is not None:
            self.account.take(n)
        self.mine += n

    def give(self, n: int) -> None:
        if self.account is not None:
            self.account.give(n)
        self.mine -= n

    def settle(self, n: int) -> None:
        """The session holds ``n`` bytes, as a recount found them: no check, they are there."""
        if self.account is not None:
            self.account.settle(n)
        self.mine = n

    def check_upload(self, in_use: int, n: int) -> None:
        """Refuse an upload of ``n`` bytes that cannot fit beside the ``in_use`` bytes held (and
        uploads under way) before anything is decompressed or placed."""
        self.check(in_use, n)
