"""Liveness: which gateways in use still answer, and how far away each is.

One daemon thread per pool PINGs every gateway it watches (those its sessions are on, and the
placement candidates the pool names) about once a second, on a DEALER socket of its own per
gateway: not on the sessions' sockets, whose lock a blocked request holds for as long as it
waits. Each PONG gives a round trip (``rtt_ms``: the median of the last few, which the
latency-optimized strategy reads) and the gateway's id, random per start: a new id at the same
address means the gateway restarted and the sessions it held are gone.

A gateway that has answered nothing for ``DOWN_AFTER`` seconds is down. Every session on it is
marked lost (``Session.mark_lost``) with a ``GatewayDownError`` — a ``GatewayUnavailableError``
naming the gateway, the GPU and how long it has been silent: a thread blocked on that gateway
raises it within one poll (``Session._wait``, a blocked upload), and later calls raise it at the
next sync, as a CUDA sticky error would. Sessions on other gateways are untouched. A gateway
that discovery drops (``on_discovery``: it said it is leaving, stopped announcing, or a new id
took its address) counts as down at once.

The PINGs carry no session: the gateway answers them from its supervisor and counts them toward
no session, so they neither keep a dead session alive there nor change its session timeout. No
work is added to the per-op path: the sessions are only told, by one attribute, when a gateway
goes.
"""
from __future__ import annotations

import statistics
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import zmq

from remotecuda_wire import protocol

from .errors import GatewayAuthError, GatewayDownError
from .session import secure

if TYPE_CHECKING:
    from .session import Session

#: seconds between two PINGs to one gateway
PING_EVERY = 1.0
#: a gateway that answered nothing for this long is down (issue 14: within 3 s). Three missed
#: PINGs: one late PONG from a busy gateway or a loaded client does not end its sessions, and a
#: ping must also have had PING_EVERY to be answered (a stalled client thread blames no gateway)
DOWN_AFTER = 3.0
#: round trips kept per gateway; ``rtt_ms`` is their median (one slow PONG does not move it)
RTT_SAMPLES = 7
#: the longest the thread sleeps: how soon it follows new targets and stops (pings and verdicts are
#: timed to their own moments)
TICK = 0.1


def _key(address: str) -> str:
    """'host:port' or 'tcp://host:port' → the endpoint form the pool and sessions use."""
    address = address.strip()
    return address if address.startswith("tcp://") else f"tcp://{address}"


class _Watch:
    """What the thread knows of one gateway."""

    def __init__(self, endpoint: str, sock: zmq.Socket, now: float) -> None:
        self.endpoint, self.sock = endpoint, sock
        self.last_answer = now  # (a gateway first watched has DOWN_AFTER to answer)
        self.unanswered: float | None = None  # when the first PING since the last answer went
        self.next_ping = now
        self.rtts: deque[float] = deque(maxlen=RTT_SAMPLES)
        #: (round trip, gateway clock - client clock) from PONGs that tell the gateway's time (trace.py)
        self.clocks: deque[tuple[float, float]] = deque(maxlen=RTT_SAMPLES)
        self.id: str | None = None
        self.down: str | None = None  # why it is down, while it is

    def verdict_due(self, now: float) -> float:
        """When silence makes it down: DOWN_AFTER after its last answer, and no sooner than
        PING_EVERY after the first PING since (a client thread stalled, sending none, blames no gateway)."""
        return max(self.last_answer + DOWN_AFTER, (now if self.unanswered is None else self.unanswered) + PING_EVERY)


class Liveness:
    """Heartbeats to the gateways the pool uses (see the module's docstring).

    ``sessions``: the pool's sessions (read on the thread, about once per tick); ``candidates``:
    endpoints to watch besides the sessions' (gateways the pool may place on).
    """

    def __init__(self, ctx: zmq.Context, sessions: Callable[[], Iterable[Session]],
                 candidates: Callable[[], Iterable[str]] = lambda: ()) -> None:
        self.ctx = ctx
        self.sessions = sessions
        self.candidates = candidates
        self._watches: dict[str, _Watch] = {}
        self._lock = threading.Lock()  # the watches' state, read by other threads
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="remotecuda-liveness", daemon=True)

    def start(self) -> Liveness:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread; it closes its sockets (before the pool's context is terminated)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ queries (any thread)
    def rtt_ms(self, address: str) -> float | None:
        """The gateway's round trip in ms (median of the last RTT_SAMPLES PONGs); None before one."""
        with self._lock:
            w = self._watches.get(_key(address))
            samples = list(w.rtts) if w is not None else []
        return statistics.median(samples) * 1e3 if samples else None

    def clock(self, address: str) -> tuple[float, float] | None:
        """How far the gateway's monotonic clock is ahead of this client's, in seconds, and the round
        trip that estimate came from (its error is at most half of it): the PONG of the shortest
        recent round trip, offset = gateway time - (sent + received) / 2. None before such a PONG."""
        with self._lock:
            w = self._watches.get(_key(address))
            samples = list(w.clocks) if w is not None else []
        if not samples:
            return None
        rtt, offset = min(samples)
        return offset, rtt

    def gateway_id(self, address: str) -> str | None:
        """The id the gateway gave in its last PONG (random per start); None before one."""
        with self._lock:
            w = self._watches.get(_key(address))
            return w.id if w is not None else None

    def down(self, address: str) -> str | None:
        """Why the gateway is down, or None while it answers (or is not watched)."""
        with self._lock:
            w = self._watches.get(_key(address))
            return w.down if w is not None else None

    def check(self, address: str) -> None:
        """Raise GatewayDownError when the gateway is down (before opening a session there)."""
        why = self.down(address)
        if why is not None:
            raise GatewayDownError(f"gateway {_key(address)[6:]} is unavailable: {why}")

    def on_discovery(self, kind: str, gw: Any) -> None:
        """For ``Discovery.subscribe``: a gateway that left the table is down."""
        if kind == "left":
            self._go_down(_key(gw.address), "discovery dropped it (it left, stopped announcing, "
                          "or another gateway took its address)", time.monotonic())

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        by_sock: dict[zmq.Socket, _Watch] = {}
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._follow_targets(now, poller, by_sock)
                for w in list(by_sock.values()):
                    if now >= w.next_ping:
                        self._ping(w, now)
                due = [w.next_ping for w in by_sock.values()]
                due += [w.verdict_due(now) for w in by_sock.values() if w.down is None]
                wait = min([TICK, *(d - now for d in due)])
                for sock, _ in poller.poll(max(1, int(wait * 1000) + 1)):
                    self._drain(by_sock[sock])
                now = time.monotonic()
                for w in list(by_sock.values()):
                    if w.down is None and w.unanswered is not None and now >= w.verdict_due(now):
                        self._go_down(w.endpoint, f"it has not answered a heartbeat for {now - w.last_answer:.1f} s "
                                      f"(down after {DOWN_AFTER:.0f} s)", now)
        finally:
            for sock in by_sock:
                sock.close(linger=0)

    def _follow_targets(self, now: float, poller: zmq.Poller, by_sock: dict[zmq.Socket, _Watch]) -> None:
        """Watch the gateways the sessions and candidates name now; forget the others."""
        targets = {s.endpoint for s in list(self.sessions()) if s.endpoint} | {_key(a) for a in self.candidates()}
        with self._lock:
            for ep in targets - self._watches.keys():
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IMMEDIATE, 1)  # no PINGs queued for a gateway not connected
                sock.setsockopt(zmq.SNDHWM, 4)
                try:
                    secure(sock, ep)  # (a CURVE gateway hears only encrypted PINGs)
                except GatewayAuthError:
                    sock.close(linger=0)
                    continue  # (its sessions could not have connected either)
                sock.connect(ep)
                self._watches[ep] = by_sock[sock] = _Watch(ep, sock, now)
                poller.register(sock, zmq.POLLIN)
            for ep in self._watches.keys() - targets:
                w = self._watches.pop(ep)
                poller.unregister(w.sock)
                del by_sock[w.sock]
                w.sock.close(linger=0)

    def _ping(self, w: _Watch, now: float) -> None:
        w.next_ping = now + PING_EVERY
        if w.unanswered is None:
            w.unanswered = now
        try:
            w.sock.send_multipart(protocol.encode(protocol.PING, {"t": now}), zmq.NOBLOCK)
        except zmq.Again:  # not connected (refused, or gone): it counts as unanswered
            pass

    def _drain(self, w: _Watch) -> None:
        while True:
            try:
                frames = w.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError:
                continue
            if msg.type != protocol.PONG:
                continue
            now = time.monotonic()
            sent, gid, theirs = msg.body.get("t"), msg.body.get("id"), msg.body.get("now")
            with self._lock:
                w.last_answer, w.unanswered, w.down = now, None, None
                if isinstance(sent, float) and now - sent < DOWN_AFTER:  # (not a PONG held up by a reconnect)
                    w.rtts.append(now - sent)
                    if isinstance(theirs, float):
                        w.clocks.append((now - sent, theirs - (sent + now) / 2))
                if isinstance(gid, str):
                    w.id = gid
            if isinstance(gid, str):  # a session opened under another id: the gateway restarted since
                self._lose_sessions(w.endpoint, f"it restarted (its id is now {gid}), and the sessions it held "
                                    "ended with it", current_id=gid)

    def _go_down(self, endpoint: str, why: str, now: float) -> None:
        with self._lock:
            w = self._watches.get(endpoint)
            if w is not None:
                if w.down is not None:
                    return
                w.down = why
        self._lose_sessions(endpoint, why)

    def _lose_sessions(self, endpoint: str, why: str, current_id: str | None = None) -> None:
        """Mark the sessions on ``endpoint`` lost, saying why and where; with ``current_id``, only
        those greeted by a gateway of another id there (an earlier start of it)."""
        lost = []
        for s in list(self.sessions()):
            if (s.endpoint == endpoint and not s.closed and s.lost is None
                    and (current_id is None or _welcome(s).get("id") not in (None, current_id))):
                s.mark_lost(f"gateway {endpoint[6:]} ({_gpu(s)}) is unavailable: {why}; this session's "
                            f"tensors (cuda:{s.vdev}) are gone")
                lost.append(f"cuda:{s.vdev}")
        if lost:
            warnings.warn(f"remotecuda: gateway {endpoint[6:]} is unavailable ({why}): {', '.join(lost)} lost",
                          RuntimeWarning, stacklevel=1)


def _welcome(s: Session) -> dict:
    """The session's WELCOME; empty while it is still being greeted (placed lazily, see Session.open)."""
    return getattr(s, "info", None) or {}


def _gpu(s: Session) -> str:
    """'GPU 0, NAME' for the session's GPU, as the gateway described it."""
    for d in _welcome(s).get("devices") or ():
        if isinstance(d, dict) and d.get("index") == s.gpu:
            return f"GPU {s.gpu}, {d.get('name')}"
    return f"GPU {s.gpu}"
