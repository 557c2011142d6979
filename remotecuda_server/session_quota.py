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


class SessionQuota:
    """One session's limit, in front of its simulated GPU's account (if any): the handle table
    takes, gives and settles through it as through the account itself."""

    def __init__(self, limit: int, account: MemoryAccount | None = None):
        self.limit, self.account = limit, account
        self.mine = 0  # bytes this session holds

    def take(self, n: int) -> None:
        """Take ``n`` bytes, or raise the ``torch.OutOfMemoryError`` that names the quota (or the GPU's)."""
        if self.mine + n > self.limit:
            raise over_quota(self.limit, self.mine, n)
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
        if in_use + n > self.limit:
            raise over_quota(self.limit, in_use, n)
