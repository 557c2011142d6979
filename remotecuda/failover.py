"""Failover: a session whose gateway (or worker) fails carries on on another GPU.

A session's tensors on its gateway are a pure function of the op stream the client sent, and
the client names every handle. So the session is rebuilt elsewhere by sending that stream again
(replay_log.py keeps it): a new session on a healthy GPU gets the last snapshot's tensors back
under their own handles, then every message logged since, in order, with the same handles, the
same seeds and the same uploads. Its tensors then hold what the old ones held, bit for bit on
the same kind of device, and the program's tensors stay valid: they name the same handles of
the same ``Session`` object, which only changed its connections.

How a failure is found: liveness.py's heartbeats mark a silent gateway down within 3 s
(``Session.mark_lost``), a send that cannot go out fails, or the gateway reports the session's
worker gone (``session_lost``). The session's next flush, upload or request then calls
``Failover.recover`` (with its lock held, on the user's thread), which

1. asks the pool for a GPU (``Pool.relocate``: the scheduler's choice among the GPUs that answer
   STATUS now, the same model preferred, enough free memory for the snapshot required);
2. greets it (``Session.reconnect``), restores the snapshot (``Session.restore``) and resends the
   log (``Session.resend``): requests already answered ask nothing back, so values the user read
   are not downloaded again; the request the program is waiting on, if any, is sent last and
   answered as usual;
3. warns once, naming the device, where it moved from and to, how long it took and how many ops
   it replayed, and records the same in ``events`` (``remotecuda.stats()["failovers"]``).

An attempt that fails (that GPU fails too, none answers) is retried, ``REMOTECUDA_RETRIES``
attempts in all (3); then a ``GatewayUnavailableError`` (a ``GatewayDownError``, which is also a
``GatewayLostError``) says what was tried, and the session is lost as without failover.
``REMOTECUDA_FAILOVER=off`` keeps the old behaviour: no log is kept, and a lost gateway is an
error at the next sync.

Limits: copies between virtual devices (``rc::offer``/``rc::receive``) cannot be replayed (their
source's one-time token is spent); CUDA events recorded before a snapshot are not kept; a
generator's state is kept across a snapshot, its ``initial_seed`` is what the client remembers.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from remotecuda_wire import protocol
from remotecuda_wire.limits import env_number, switch

from .errors import GatewayDownError

if TYPE_CHECKING:
    from .session import Session

#: attempts at moving a session before it is given up (REMOTECUDA_RETRIES)
RETRIES = 3
#: seconds between two attempts: the n-th waits n times this
BACKOFF = 0.5

log = logging.getLogger("remotecuda")

#: (session, bytes it needs) → (gateway endpoint, GPU index, one line on the choice)
Relocate = Callable[["Session", int], tuple[str, int, str]]


def enabled() -> bool:
    """Whether failover is on (``REMOTECUDA_FAILOVER``: on unless off, 0, false or no)."""
    return switch("REMOTECUDA_FAILOVER", os.environ.get("REMOTECUDA_FAILOVER"), True)


def retries() -> int:
    return int(env_number("REMOTECUDA_RETRIES", RETRIES, least=1))


class Failover:
    """Moves failed sessions (see the module's docstring); ``relocate`` is the pool's placement."""

    def __init__(self, relocate: Relocate, attempts: int | None = None) -> None:
        self.relocate = relocate
        self.attempts = attempts if attempts is not None else retries()
        #: one dict per failover, oldest first: when, device, from, to, seconds, ops_replayed, ...
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # events, read by other threads (status)

    def recover(self, s: Session, cause: BaseException) -> None:
        """Rebuild ``s`` on another GPU and return once its stream is resent; raise
        GatewayDownError (a GatewayUnavailableError) after ``attempts`` failed attempts (the session is then lost)."""
        assert s.log is not None
        t0, when = time.perf_counter(), datetime.datetime.now(datetime.UTC)
        old = f"{s.endpoint[6:]} GPU {s.gpu}"
        tried: list[str] = []
        for attempt in range(1, self.attempts + 1):
            s.unlogged = True
            try:
                need = s.log.snapshot.nbytes if s.log.snapshot is not None else 0
                endpoint, gpu, why = self.relocate(s, need + s.log.upload_bytes)
                s.reconnect(endpoint, gpu)
                ops = self._replay(s)
            except Exception as e:  # any failure ends this attempt; the next tries anew
                tried.append(f"attempt {attempt}: {type(e).__name__}: {e}")
                s.unlogged = False
                if attempt < self.attempts:
                    time.sleep(BACKOFF * attempt)
                continue
            s.unlogged = False
            seconds = time.perf_counter() - t0
            event = {"when": when.isoformat(timespec="seconds"), "device": f"cuda:{s.vdev}", "from": old,
                     "to": f"{endpoint[6:]} GPU {gpu}", "seconds": round(seconds, 3), "ops_replayed": ops,
                     "snapshot_bytes": need, "attempts": attempt, "cause": str(cause), "placement": why}
            with self._lock:
                self.events.append(event)
            warnings.warn(f"remotecuda: cuda:{s.vdev} moved from {old} to {event['to']} in {seconds:.2f} s "
                          f"({ops} ops replayed{f', from a snapshot of {need} bytes' if need else ''}) "
                          f"after: {cause}", RuntimeWarning, stacklevel=2)
            return
        s.failover = None  # given up: the session is lost, as without failover
        s.lost = s.lost or str(cause)
        s.closed = True
        raise GatewayDownError(
            f"remotecuda: cuda:{s.vdev} lost its GPU ({old}: {cause}) and could not be moved to another "
            f"in {self.attempts} attempts (REMOTECUDA_RETRIES): " + "; ".join(tried)) from None

    @staticmethod
    def _replay(s: Session) -> int:
        """The snapshot, then every logged message, on ``s``'s new connection; the ops replayed."""
        assert s.log is not None
        if s.log.snapshot is not None:
            s.restore(s.log.snapshot, s.log.sticky)
        ops = 0
        for entry in s.log.entries:
            ops += s.resend(protocol.unpack_body(entry.body), entry.answered)
        return ops

    def info(self) -> list[dict[str, Any]]:
        """The failovers so far (for ``remotecuda.stats()["failovers"]`` and the panel)."""
        with self._lock:
            return [dict(e) for e in self.events]
