"""Discovery: which gateways are there, kept as a table the pool reads.

Gateways announce themselves by multicast beacons (remotecuda_wire/beacon.py); a client
listens passively, so finding 200 gateways costs it 200 small datagrams a second and no
round trip. A gateway joins the table at its first beacon and leaves it at a ``leaving``
beacon, or when none was heard for ``beacon.EXPIRY``: joins and leaves are seen within 3 s.
Where the user names the gateways (``REMOTECUDA_SERVERS`` / ``--server``), no multicast is
used: those gateways are asked instead, once per beacon interval. Each way of hearing of
gateways is a ``Source``, polled by the one thread of a ``Discovery``.
"""
from __future__ import annotations

import os
import select
import socket
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from remotecuda_wire import auth, beacon, curve

#: how often the table looks for gateways gone quiet: the most a drop is late past EXPIRY
SWEEP = 0.25
#: how long a listener lets beacons gather after one wakes it: one wake-up per ~10 of 200 gateways' beacons
GATHER = 0.05
#: how long a named server has to answer one query
ASK_TIMEOUT = 1.0


class GatewayInfo:
    """One gateway as last heard of. ``info`` is its description ("gateway" version, "host",
    "sessions", "gpus" with their load, ...), decoded from the beacon on first use: a listener
    hearing 200 gateways a second reads only the beacons' envelopes."""

    __slots__ = ("id", "address", "last_seen", "seq", "_info", "_raw")

    def __init__(self, id: str, address: str, info: dict | None = None, last_seen: float = 0.0, seq: int = 0,
                 raw: bytes | None = None):
        self.id = id  # the beacon's id (random per gateway start); a named server's endpoint
        self.address = address  # the endpoint clients connect to, "tcp://host:port"
        self.last_seen = last_seen  # time.monotonic() of the last beacon or answer
        self.seq = seq  # the beacon's count (for a named server, the queries answered)
        self._info = info
        self._raw = raw  # the beacon ``info`` is decoded from (kept: two threads may read it at once)

    @property
    def info(self) -> dict:
        if self._info is None:
            body = beacon.decode(self._raw) if self._raw is not None else None
            self._info = {k: v for k, v in body.items()
                          if k not in beacon.ENVELOPE and k not in beacon.SIGNATURE} if body else {}
        return self._info

    def __repr__(self) -> str:
        return f"GatewayInfo(id={self.id!r}, address={self.address!r}, seq={self.seq})"

    @property
    def gpus(self) -> list[dict]:
        return self.info.get("gpus", [])

    @property
    def host(self) -> str:
        """The gateway's host name, or the host of its address when it gave none."""
        return self.info.get("host") or self.address.rpartition("//")[2].rpartition(":")[0]

    @property
    def version(self) -> str:
        return str(self.info.get("gateway", "?"))

    @property
    def sessions(self) -> int | None:
        n = self.info.get("sessions")
        return n if isinstance(n, int) else len(n) if isinstance(n, list) else None

    def as_dict(self, now: float | None = None) -> dict:
        """Plain data for ``remotecuda servers --json``: the description, with id, address, seq and age."""
        age = (time.monotonic() if now is None else now) - self.last_seen
        return dict(self.info, id=self.id, address=self.address, seq=self.seq, age_s=round(age, 2))


class Heard(NamedTuple):
    gateway: GatewayInfo
    leaving: bool = False


class Source(Protocol):
    """A way of hearing of gateways. ``poll`` waits at most ``timeout`` seconds and returns
    what was heard meanwhile (possibly nothing); it is called from one thread only."""

    def poll(self, timeout: float) -> list[Heard]: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


class MulticastSource:
    """Beacons on a multicast group, heard on ``iface`` (an IPv4 address; None: the system's choice).

    With ``key`` (``auth.beacon_key`` of the client's token) only beacons signed with it are
    heard, each with a ``seq`` larger than the last one heard from its gateway (a replay within
    ``beacon.MAX_SKEW`` is refused; an older one is stale); without, only unsigned ones.
    ``refused`` counts the others by reason (``beacon.check``'s, and "replayed")."""

    def __init__(self, group: str, port: int, iface: str | None, key: bytes | None = None):
        self.group, self.port, self.iface, self.key = group, port, iface, key
        self.refused: Counter[str] = Counter()
        self._last: dict[str, tuple[int, float]] = {}  # gateway id → (seq, monotonic) of its last signed beacon
        self._pruned = time.monotonic()
        self.sock = beacon.receiver(group, port, iface)
        try:  # room for a burst: 200 gateways whose beacons happen to come together
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        except OSError:
            pass
        self._poller = select.poll()
        self._poller.register(self.sock, select.POLLIN)

    @classmethod
    def from_env(cls) -> MulticastSource:
        """``REMOTECUDA_DISCOVERY`` (GROUP:PORT), ``REMOTECUDA_DISCOVERY_IFACE``, and the token
        (``REMOTECUDA_TOKEN`` / ``REMOTECUDA_TOKEN_FILE``) beacons must be signed with."""
        group, port = beacon.group_from_env()
        token = auth.read_token()
        return cls(group, port, beacon.iface_from_env(), auth.beacon_key(auth.token_key(token)) if token else None)

    def describe(self) -> str:
        return (f"multicast {self.group}:{self.port} (UDP) on "
                + (f"interface {self.iface}" if self.iface else "the system's default interface")
                + (", signed beacons only" if self.key is not None else ""))

    def poll(self, timeout: float) -> list[Heard]:
        if not self._poller.poll(timeout * 1000):
            return []
        time.sleep(GATHER)  # the beacons that follow this one come in the same wake-up
        heard: list[Heard] = []
        now, wall = time.monotonic(), time.time()
        if self.key is not None and now - self._pruned > beacon.MAX_SKEW:
            self._pruned = now  # (a replay of a beacon heard before this is stale by its own time)
            self._last = {g: last for g, last in self._last.items() if now - last[1] <= 2 * beacon.MAX_SKEW}
        while True:  # everything queued now, in one wake-up
            try:
                data, (src, _) = self.sock.recvfrom(beacon.MAX_BYTES + 1, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return heard
            env = beacon.decode_envelope(data)
            if env is None:
                continue  # not a beacon this version reads: another program, a newer gateway
            why = beacon.check(data, self.key, wall)
            if why is None and self.key is not None:
                last = self._last.get(env["id"])
                if last is not None and env["seq"] <= last[0]:
                    why = "replayed"
                else:
                    self._last[env["id"]] = (env["seq"], now)
            if why is not None:
                self.refused[why] += 1
                continue
            addr = env["addr"]
            if "//0.0.0.0:" in addr:  # bound to every interface: reachable where the beacon came from
                addr = addr.replace("//0.0.0.0:", f"//{src}:", 1)
            heard.append(Heard(GatewayInfo(env["id"], addr, None, now, env["seq"], data), bool(env["leaving"])))
            if self.key is not None and os.environ.get(curve.SECRET_ENV):  # a token-signed key: pinned
                curve.pin(addr, (beacon.decode(data) or {}).get("curve"))

    def close(self) -> None:
        self.sock.close()


class ServerListSource:
    """Gateways named by the user, asked for their status (inventory and load) once per beacon
    interval; one that does not answer is not heard, and expires as a silent one does."""

    def __init__(self, servers: list[str]):
        import zmq

        from .pool import endpoint
        self.endpoints = list(dict.fromkeys(endpoint(s) for s in servers))
        self.ctx = zmq.Context()
        self.rounds = 0
        self._next = 0.0  # time.monotonic() of the next round

    def describe(self) -> str:
        return "the named servers " + ", ".join(self.endpoints)

    def poll(self, timeout: float) -> list[Heard]:
        wait = self._next - time.monotonic()
        if wait > 0:
            time.sleep(min(wait, timeout))
            return []
        self._next = time.monotonic() + beacon.INTERVAL
        self.rounds += 1
        answers = ask(self.ctx, self.endpoints, ASK_TIMEOUT)
        now = time.monotonic()
        return [Heard(GatewayInfo(ep, ep, _as_beacon_info(a.status), now, self.rounds))
                for ep, a in zip(self.endpoints, answers) if a is not None]

    def close(self) -> None:
        self.ctx.term()


class Answer(NamedTuple):
    status: dict  # the gateway's STATUS: its inventory, its GPUs' figures, its sessions
    rtt_ms: float  # from sending the question to reading the answer


def ask(ctx: Any, endpoints: list[str], timeout: float, why: dict[str, str] | None = None) -> list[Answer | None]:
    """The one place discovery talks to a gateway: a STATUS to each, all at once; each answer
    with its round trip (what latency-optimized placement weighs), or None where none came
    within ``timeout`` seconds. ``why`` gets, by endpoint, why a connection's security
    handshake failed (CURVE: ZeroMQ itself says nothing)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from remotecuda_wire import protocol

    from .errors import GatewayAuthError
    from .session import connect
    socks: list[Any] = []
    for ep in endpoints:
        try:
            socks.append(connect(ctx, ep))
        except GatewayAuthError as e:  # (no CURVE key known for it): it is not asked
            socks.append(None)
            if why is not None:
                why[ep] = str(e)
    monitors = {curve.watch(s): (s, ep) for s, ep in zip(socks, endpoints) if s}
    sent: dict[Any, float] = {}
    answers: dict[Any, Answer] = {}
    failed: set = set()
    try:
        deadline = time.monotonic() + timeout
        while len(answers) + len(failed) < len(monitors) and time.monotonic() < deadline:
            for mon in zmq.select(list(monitors), [], [], 0)[0]:
                s, ep = monitors[mon]
                failure = curve.handshake_failure(recv_monitor_message(mon)["event"],
                                                  s.getsockopt(zmq.MECHANISM) == zmq.CURVE)
                if failure is not None:
                    failed.add(s)
                    if why is not None:
                        why[ep] = f"gateway {ep}: {failure}"
            for sock, _ in monitors.values():
                if sock in sent:
                    continue
                try:  # (IMMEDIATE: a send fails, rather than queueing, until the TCP link is up)
                    sock.send_multipart(protocol.encode(protocol.STATUS, {}), zmq.NOBLOCK)
                    sent[sock] = time.perf_counter()
                except zmq.Again:
                    pass
            waiting = [s for s in sent if s not in answers and s not in failed]
            if not waiting:
                time.sleep(0.005)
                continue
            for sock in zmq.select(waiting, [], [], 0.02)[0]:
                try:
                    msg = protocol.decode(sock.recv_multipart())
                except protocol.ProtocolError:
                    continue
                if msg.type == protocol.STATUS and isinstance(msg.body, dict):
                    answers[sock] = Answer(msg.body, (time.perf_counter() - sent[sock]) * 1000)
        return [answers.get(s) if s is not None else None for s in socks]
    finally:
        for mon, (sock, _) in monitors.items():
            curve.unwatch(sock, mon)
            sock.close(linger=0)


def _as_beacon_info(status: dict) -> dict:
    """A STATUS answer read as a beacon's description (an older gateway lists its GPUs, without
    their load, as "devices" only)."""
    info = dict(status)
    info.setdefault("gpus", info.get("devices", []))
    return info


def servers_from_env(servers: str | list[str] | None = None) -> list[str]:
    """``servers`` (``--server``) or ``REMOTECUDA_SERVERS`` as a list of addresses (an entry's
    ``@KEY``, its CURVE public key, is curve.py's); empty: use multicast."""
    if servers is None:
        servers = os.environ.get("REMOTECUDA_SERVERS", "")
    if isinstance(servers, str):
        servers = servers.split(",")
    out = []
    for s in servers:
        address, key = curve.split_server(s)
        if key:
            curve.name(address, key)
        if address:
            out.append(address)
    return out


def source_from_env(servers: str | list[str] | None = None) -> Source:
    """The named servers when there are any (an explicit list skips multicast), else the beacons."""
    named = servers_from_env(servers)
    return ServerListSource(named) if named else MulticastSource.from_env()


Listener = Callable[[str, GatewayInfo], None]


class Discovery:
    """The table of gateways heard of, kept by one daemon thread.

    ``snapshot()`` reads it, ``wait()`` waits for enough gateways, ``subscribe(fn)`` calls
    ``fn(kind, gateway)`` on the thread for each "joined", "updated" (a newer beacon) and
    "left" (a leaving beacon, silence past ``expiry``, or a new gateway at its address)."""

    def __init__(self, source: Source | None = None, expiry: float = beacon.EXPIRY):
        self.source = source if source is not None else source_from_env()
        self.expiry = expiry
        self._table: dict[str, GatewayInfo] = {}
        self._by_address: dict[str, str] = {}  # address → id: a restarted gateway replaces its old self
        self._changed = threading.Condition()
        self._listeners: list[Listener] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="remotecuda-discovery", daemon=True)
        self._thread.start()

    def snapshot(self) -> list[GatewayInfo]:
        """The gateways heard of now, by address."""
        with self._changed:
            return sorted(self._table.values(), key=lambda g: g.address)

    def wait(self, min_gateways: int, timeout: float) -> list[GatewayInfo]:
        """The snapshot once it holds ``min_gateways``, or as it is after ``timeout`` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._table) >= min_gateways or self._stop.is_set(), timeout)
        return self.snapshot()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(kind, gateway)`` on each change; returns the function that stops it."""
        with self._changed:
            self._listeners.append(listener)
        return lambda: self._unsubscribe(listener)

    def _unsubscribe(self, listener: Listener) -> None:
        with self._changed:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._changed:
            self._changed.notify_all()
        if not self._thread.is_alive():  # else the thread still polls it: the process's exit closes it
            self.source.close()

    def __enter__(self) -> Discovery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        swept = time.monotonic()
        while not self._stop.is_set():
            try:
                heard = self.source.poll(SWEEP)
            except OSError as e:  # the socket went away under us (closed at exit)
                warnings.warn(f"remotecuda: discovery stopped: {e}", RuntimeWarning, stacklevel=1)
                return
            now = time.monotonic()
            events: list[tuple[str, GatewayInfo]] = []
            with self._changed:
                for h in heard:
                    self._apply(h, events)
                if now - swept >= SWEEP:
                    swept = now
                    for gid in [gid for gid, g in self._table.items() if now - g.last_seen > self.expiry]:
                        events.append(("left", self._remove(gid)))
                if events:
                    self._changed.notify_all()
                listeners = list(self._listeners) if events else []
            for kind, gw in events:
                for fn in listeners:
                    try:
                        fn(kind, gw)
                    except Exception as e:  # noqa: BLE001 - a listener's bug must not stop discovery
                        warnings.warn(f"remotecuda: a discovery listener failed: {e!r}", RuntimeWarning,
                                      stacklevel=1)

    def _apply(self, h: Heard, events: list[tuple[str, GatewayInfo]]) -> None:
        g = h.gateway
        old = self._table.get(g.id)
        if h.leaving:
            if old is not None:
                events.append(("left", self._remove(g.id)))
            return
        if old is not None:
            if g.seq <= old.seq:
                return  # a duplicate, or one overtaken on the way
            if old.address != g.address:
                del self._by_address[old.address]
        other = self._by_address.get(g.address)
        if other is not None and other != g.id:
            events.append(("left", self._remove(other)))
        self._table[g.id] = g
        self._by_address[g.address] = g.id
        events.append(("updated" if old is not None else "joined", g))

    def _remove(self, gid: str) -> GatewayInfo:
        g = self._table.pop(gid)
        del self._by_address[g.address]
        return g


# ---------------------------------------------------------------------- the table a person reads
BAR = 10


def table(gateways: list[GatewayInfo]) -> str:
    """Gateways and their GPUs as ``nvidia-smi`` shows GPUs: one line per gateway, one per GPU."""
    blocks = []
    for g in gateways:
        n = g.sessions
        head = (f"{g.address}  host {g.host}  RemoteCUDA {g.version}"
                + (f"  {n} session{'s' if n != 1 else ''}" if n is not None else ""))
        rows: list[tuple[str, ...]] = [("GPU", "Name", "Memory used / total", "Util", "Queued", "Sessions", "Latency")]
        rows += [_gpu_row(d) for d in g.gpus]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  " + "  ".join(c.ljust(w) if i in (1, 2) else c.rjust(w) for i, (c, w) in
                                  enumerate(zip(r, widths))).rstrip() for r in rows]
        blocks.append("\n".join([head, *lines] if g.gpus else [head, "  (no GPUs)"]))
    return "\n\n".join(blocks)


def _gpu_row(d: dict) -> tuple[str, ...]:
    name = str(d.get("name", "?")) + (" [simulated]" if d.get("simulated") else "")
    total, free = d.get("total_memory"), d.get("free_memory")
    if isinstance(total, int) and total > 0 and isinstance(free, int):
        used = max(0, total - free)
        filled = min(BAR, round(BAR * used / total))
        memory = f"[{'#' * filled}{'.' * (BAR - filled)}] {used / 2**30:5.1f} / {total / 2**30:.1f} GiB"
    elif isinstance(total, int):
        memory = f"{'':{BAR + 2}} {'-':>5} / {total / 2**30:.1f} GiB"
    else:
        memory = "-"
    util, latency = d.get("utilization"), d.get("latency_ms")
    return (str(d.get("index", "?")), name, memory,
            f"{util * 100:.0f} %" if isinstance(util, (int, float)) else "-",
            str(d.get("queued", "-")), str(d.get("sessions", "-")),
            f"{latency:.1f} ms" if isinstance(latency, (int, float)) else "-")
