"""A bound on a session's queued work (``remotecuda start --max-queued N``).

A session's worker reads its client's messages as they come (its I/O thread) and runs them in
order (its executor thread); what is read and not yet run waits in memory, the payloads with it.
A client that sends faster than its ops run, or sends on while its executor waits, would grow
that without end. The backlog counts ops in (each message at least one) and ops run, and the
bytes of the uploads those ops carry (their dtype × shape, before anything is decompressed); a
message that would take either past its bound is refused at once, its payloads untouched, with a
clear error (kind ``limit``), and counted (``queue_refused`` in STATUS). A session's memory quota
counts its queued uploads too (worker.py), so queued messages cannot carry it past the quota. A CANCEL, which empties
the queue, is never refused; nor is a message that finds the queue empty, however many ops it holds.

Each session is its own worker process, so one session's backlog delays no other session's ops:
what sessions share is the supervisor, which forwards without reading (and whose receive buffers
are bounded per connection), and the device.
"""
from __future__ import annotations

from remotecuda_wire.limits import MAX_QUEUED

#: ops queued per session by default: seconds of small ops, far more than a client that
#: synchronises now and then (a loss's ``.item()``, a print) has in flight
DEFAULT = MAX_QUEUED
#: upload bytes queued per session: an OPS message carries uploads under 1 MiB (larger ones come
#: in PARTs, placed as they arrive), so a client that is not flooding has far less in its queue
MAX_BYTES = 1 << 30
FLAG = "remotecuda start --max-queued"


class Backlog:
    """Ops read and not yet run: ``received`` counted by the I/O thread, ``done`` by the executor."""

    def __init__(self, limit: int = DEFAULT):
        if limit < 1:
            raise ValueError(f"--max-queued must be at least 1, not {limit}")
        self.limit = limit
        self.received = 0
        self.done = 0
        self.bytes = 0  # upload bytes queued
        self.refused = 0  # messages refused for the bound

    def queued(self) -> int:
        return self.received - self.done

    def admit(self, n: int, nbytes: int = 0) -> str | None:
        """Take a message of ``n`` ops carrying ``nbytes`` of uploads in (None), or refuse it: the error's text."""
        queued = self.queued()
        if queued and queued + max(n, 1) > self.limit:
            self.refused += 1
            return (f"this session has {queued} ops queued, not run yet, and this message's {n} would pass "
                    f"the gateway's bound of {self.limit} ({FLAG}); the message was refused: synchronise "
                    "more often (e.g. torch.cuda.synchronize()), or ask for a larger bound")
        if queued and self.bytes + nbytes > MAX_BYTES:
            self.refused += 1
            return (f"this session has {self.bytes} bytes of uploads queued, not run yet, and this message's "
                    f"{nbytes} would pass the gateway's bound of {MAX_BYTES}; the message was refused: "
                    "synchronise more often (e.g. torch.cuda.synchronize())")
        self.received += max(n, 1)
        self.bytes += nbytes
        return None

    def ran(self, n: int, nbytes: int = 0) -> None:
        self.done += max(n, 1)
        self.bytes -= nbytes
