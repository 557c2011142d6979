"""A simulated GPU's memory: one account that all the sessions on that GPU draw from.

A simulated GPU (``remotecuda start --device cpu --gpus N --gpu-memory SIZE``) runs on the
CPU, but its memory must run out where the GPU's would, for every session on it together.
Sessions are separate worker processes, so the account is a small shared file with no name
(``memfd_create``): ``SLOTS`` signed 64-bit counters, the first the GPU's total in use, each
other one a worker's share. The supervisor creates it and hands each worker on the GPU its
descriptor (inherited at spawn) and a slot of its own; the worker keeps its slot equal to the
bytes its session's tensors hold (the CPU executor counts them exactly, storage by storage:
executor.CountedHandles). Every change moves the total and the slot together under an
exclusive POSIX lock (``lockf``: held per process, so one inherited descriptor serves them
all), so two sessions can never both take the last bytes, and taking is checked against the
total alone (a lock and two stores per new tensor). A worker that ends, or is killed, leaves
its slot to the supervisor, which zeroes it and sums the total afresh: no byte stays held by a
session that is gone, however it went. The supervisor reads the total for the GPU's free
memory (STATUS, beacons) without the lock. Having no name, the file goes with the last
process that holds it: nothing is left behind, however the gateway ends.

An op's output is made on the host before it is counted, so a simulated GPU refuses an
oversized tensor after allocating it once (the host needs the room for a moment).
"""
from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import tempfile
from collections.abc import Iterator

import torch

#: the total, and a slot for each of the most workers (sessions and spares) one simulated GPU can have at once
SLOTS = 1024
_SLOT = struct.Struct("=q")


def create(name: str) -> int:
    """A new, empty account (the supervisor's, one per simulated GPU): its file descriptor."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(f"remotecuda-{name}")
    else:  # (no memfd: an unlinked temporary file)
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, SLOTS * _SLOT.size)
    return fd


def fmt_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "bytes" else f"{int(n)} bytes"
        n /= 1024
    return f"{n:.2f} GiB"


class MemoryAccount:
    """One process's view of a simulated GPU's account: read it, and (a worker) draw from its slot."""

    def __init__(self, fd: int, size: int, gpu: int, name: str, slot: int | None = None):
        self.fd, self.size, self.gpu, self.name, self.slot = fd, size, gpu, name, slot
        self._map = mmap.mmap(fd, SLOTS * _SLOT.size)
        self._slots = memoryview(self._map).cast("q")  # [0]: the total; [k]: worker k's share
        self.mine = 0  # this worker's bytes (its slot's value)

    def used(self) -> int:
        """Bytes held by all the sessions on the GPU."""
        return self._slots[0]

    def free(self) -> int:
        return max(0, self.size - self.used())

    def take(self, n: int) -> None:
        """Take ``n`` bytes for this worker, or raise the ``torch.OutOfMemoryError`` a GPU would."""
        with self._locked():
            used = self._slots[0]
            if used + n > self.size:
                others = f"; other sessions on this GPU hold {fmt_bytes(used - self.mine)}" if used > self.mine else ""
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {fmt_bytes(n)}. GPU {self.gpu} ({self.name}, "
                    f"simulated) has a total capacity of {fmt_bytes(self.size)} of which "
                    f"{fmt_bytes(max(0, self.size - used))} is free. This session has {fmt_bytes(self.mine)} "
                    f"memory in use{others}.")
            self._move(n)

    def give(self, n: int) -> None:
        """Give back ``n`` bytes."""
        with self._locked():
            self._move(-n)

    def settle(self, n: int) -> None:
        """This worker holds ``n`` bytes, as a recount found them: no check, they are there."""
        with self._locked():
            self._move(n - self.mine)

    def _move(self, delta: int) -> None:
        assert self.slot is not None, "only a worker, with a slot of its own, draws from the account"
        self.mine += delta
        self._slots[self.slot] = self.mine
        self._slots[0] += delta

    def clear(self, slot: int) -> None:
        """Take an ended worker's share off the total (the supervisor's). The total is summed
        afresh, so even a worker killed between its two stores leaves it right."""
        with self._locked():
            self._slots[slot] = 0
            self._slots[0] = sum(self._slots[1:])

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.lockf(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._slots.release()
        self._map.close()
        os.close(self.fd)
