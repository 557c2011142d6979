"""The gateway supervisor: one TCP port, sessions placed on workers.

The supervisor never runs an op. It checks each message's header, answers HELLO, PING
and STATUS itself (so a liveness ping is answered at once however busy the workers are:
nothing in its loop waits on a worker), and forwards a session's frames (without copying
them) to the worker process that owns the session — or, when the client reaches the
worker's own data port (the direct path, see worker.py), only places the session and keeps
its accounts. Workers are started ahead of time, one spare per device, so a new session
does not wait for ``import torch``. A session ends on BYE, after ``session_timeout``
seconds without a message (the client pings every few seconds while alive), a few seconds
after its client's connection closes (a killed client), or when its worker dies; its worker
then exits, which frees all of its memory.

It also keeps each GPU's figures (memory, utilization, queued work, sessions, op latency;
load.py) from its workers' reports, and announces the gateway with them on multicast about
once a second (announcer.py) unless discovery is off.

With a token (auth.py) every connection authenticates before anything but its first HELLO
is read, and every message is sealed; the supervisor checks the messages it acts on itself
(HELLO, PING, BYE, STATUS) and forwards a session's OPS, CANCEL and PART, unread, to its
worker, which checks them. Everything a peer can make the supervisor hold is bounded:
sessions (in all, and per peer address), one session per connection, challenges and
session-less connections, the size of what it parses, and the life of connections that
do not authenticate or serve a session (connections.py). docs/SECURITY.md has the model.
"""
from __future__ import annotations

import functools
import hmac
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq

from remotecuda_wire import auth, beacon, curve, protocol
from remotecuda_wire._version import __version__ as VERSION
from remotecuda_wire.cache import DEFAULT_BYTES as DEFAULT_CACHE_BYTES
from remotecuda_wire.cache import POLICIES
from remotecuda_wire.protocol import ProtocolError

from . import announcer, backlog, internal, memory_account, privileges
from .connections import Connections
from .devices import DeviceInfo
from .load import GpuLoad

#: worker figures that are levels, not counts: a session row shows them, totals do not add them up
_GAUGES = ("memory", "cache_entries", "partial_upload_bytes", "queued", "device_free", "device_total")
#: seconds a worker that said CLOSED may take to exit before it is killed
_EXIT_GRACE = 30.0
#: a worker's counts of direct-path traffic, and the session counters they add to
_DIRECT_KEYS = {"direct_messages_in": "messages_in", "direct_bytes_in": "bytes_in",
                "direct_bytes_out": "bytes_out"}
#: the largest body of a message the supervisor parses itself (HELLO, PING, BYE, STATUS)
SMALL_BODY = 4096
#: the largest frame a client sends: a body (MAX_BODY_BYTES), or a payload, which is under 1 MiB
#: in an OPS message and at most PART_BYTES in a PART
MAX_FRAME = max(protocol.MAX_BODY_BYTES, protocol.PART_BYTES) + 64
#: messages queued per connection on the front socket before ZeroMQ stops reading that peer
FRONT_RCVHWM = 64
#: challenges and authenticated connections without a session kept at once (oldest dropped first)
MAX_STRANGERS = 1024
#: a session whose client's connection closed ends this long after its last message
DISCONNECT_GRACE = 3.0
#: ZeroMQ heartbeats on the gateway's sockets: a peer that answers nothing this long is gone
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 2000, 10000
#: what the supervisor holds for a session's worker, forwarded and not yet read by it: past either
#: bound a client's message is refused, not queued (a flooding client meets it; the worker reads fast)
MAX_UNREAD_MESSAGES, MAX_UNREAD_BYTES = 4096, 256 << 20
#: after a worker could not start, the next try waits this long, doubling up to the maximum
SPAWN_BACKOFF, SPAWN_BACKOFF_MAX = 1.0, 30.0


@dataclass
class WorkerProc:
    ident: bytes
    device: int
    proc: subprocess.Popen
    ready: bool = False
    client: bytes | None = None
    data_port: int = 0  # the worker's direct-path port (0: none)
    slot: int | None = None  # its slot in a simulated GPU's memory account


@dataclass
class SessionState:
    client: bytes
    worker: bytes
    device: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.time)
    messages_in: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    worker_stats: dict = field(default_factory=dict)
    token: bytes = b""  # proves a second connection (the bulk one, or the direct path) is the session's
    peer: auth.Peer | None = None  # the session's keys (with a token)
    address: str = ""  # the client's IP address, for the per-peer limit
    disconnected: bool = False  # its client's connection to this port has closed
    forwarded: list = field(default_factory=lambda: [0, 0])  # messages and bytes forwarded to its worker
    read: list = field(default_factory=lambda: [0, 0])  # what of them the worker said it has read (internal.READ)


@dataclass
class Waiting:
    """A HELLO waiting for a worker."""

    client: bytes
    device: int
    address: str
    peer: auth.Peer | None


class Gateway:
    def __init__(self, devices: list[DeviceInfo], host: str = "127.0.0.1", port: int = 55555,
                 spare: int = 1, session_timeout: float = 60.0, max_frame: int = MAX_FRAME,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, direct: bool = True, discovery: bool = False,
                 advertise: str | None = None, discovery_iface: str | None = None, token: bytes | None = None,
                 max_sessions: int = 64, max_sessions_per_peer: int = 16, idle_timeout: float = 30.0,
                 session_memory: int | None = None, admin_token: bytes | None = None,
                 max_queued: int = backlog.DEFAULT,
                 curve_secret: str | None = None, curve_clients: str | None = None):
        """``discovery``: announce on multicast (group from REMOTECUDA_DISCOVERY), from
        ``discovery_iface`` (else REMOTECUDA_DISCOVERY_IFACE, else announcer.interface's choice),
        giving ``advertise`` (HOST:PORT) as the address, else the bound one. ``token``: clients must
        prove they hold it (auth.py); the limits are those of ``remotecuda start``
        (``session_memory``: each session's memory quota in bytes, session_quota.py; ``max_queued``:
        each session's bound on ops queued, backlog.py).
        ``admin_token``: per-session STATUS rows only to a connection that proved it (admin.py).
        ``curve_secret`` (its key pair file) with ``curve_clients`` (a directory of the client public
        keys it admits): every port of the gateway and its workers is CURVE-encrypted (curve.py)."""
        self.devices = devices
        self.id = secrets.token_hex(8)  # this start's: a restarted gateway is another one
        self.direct = direct
        self.max_frame = max_frame
        self.spare = spare
        self.session_timeout = session_timeout
        self.token_key = auth.token_key(token) if token is not None else None
        self.max_sessions, self.max_sessions_per_peer = max_sessions, max_sessions_per_peer
        self.idle_timeout = idle_timeout
        self.session_memory = session_memory
        self.max_queued = backlog.Backlog(max_queued).limit  # (checked here, not in each worker)
        if admin_token is not None and token is None:
            raise ValueError("an admin token needs a session token")
        self.admin_key = auth.token_key(admin_token) if admin_token is not None else None
        #: the keys of connections that proved the admin token (they go with their connections)
        self.admins: weakref.WeakSet[auth.Peer] = weakref.WeakSet()
        self.ctx = zmq.Context()
        if (curve_secret is None) != (curve_clients is None):
            raise ValueError("CURVE needs both --curve-secret (the gateway's key pair) and --curve-clients "
                             "(the client keys it admits)")
        #: the supervisor's CURVE keys and ZAP handler; and what each worker is told to load
        self.curve = curve.Server(self.ctx, curve.load_keypair(curve_secret), curve_clients) \
            if curve_secret is not None and curve_clients is not None else None
        self.curve_args = ["--curve-secret", os.path.abspath(str(curve_secret)),
                           "--curve-clients", os.path.abspath(str(curve_clients))] \
            if self.curve is not None else []
        self.front = self.ctx.socket(zmq.ROUTER)
        if self.curve is not None:
            self.curve.secure(self.front)
        self.front.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.setsockopt(zmq.MAXMSGSIZE, max_frame)
        self.front.setsockopt(zmq.SNDHWM, 0)
        self.front.setsockopt(zmq.RCVHWM, FRONT_RCVHWM)
        self.front.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.front.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.conns = Connections(self.front, idle_timeout)
        if port == 0:
            self.port = self.front.bind_to_random_port(f"tcp://{host}")
        else:
            self.front.bind(f"tcp://{host}:{port}")
            self.port = port
        self.host = host
        self._tmp = tempfile.TemporaryDirectory(prefix="remotecuda-gw-")
        self.back = self.ctx.socket(zmq.ROUTER)
        self.back.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.setsockopt(zmq.SNDHWM, 0)
        self.back.setsockopt(zmq.RCVHWM, 0)
        self.backend = f"ipc://{self._tmp.name}/backend"
        self.back.bind(self.backend)
        self.workers: dict[bytes, WorkerProc] = {}
        self.sessions: dict[bytes, SessionState] = {}
        self.waiting: list[Waiting] = []  # HELLOs waiting for a worker
        #: with a token: challenges sent (connection → (its nonce, ours)), authenticated connections without a session
        self.challenges: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
        self.peers: OrderedDict[bytes, auth.Peer] = OrderedDict()
        self.refused: dict[str, int] = {}  # rejections by reason, in STATUS's totals
        self._spawn_after = 0.0  # no worker is started before this (monotonic), after a failure
        self._spawn_backoff = SPAWN_BACKOFF
        self.cache_requests: dict[bytes, Any] = {}
        self.client_codecs: dict[bytes, tuple[str, ...]] = {}  # what each waiting client decodes
        self.bulk_links: dict[bytes, bytes] = {}  # a session's bulk connection → the session's client
        self.totals = {"messages_in": 0, "bytes_in": 0, "bytes_out": 0}
        self.finished: dict[str, int] = {}  # worker counters of sessions that have ended
        self.cache_bytes = cache_bytes
        self._n = 0
        self.running = True
        self.exiting: list[tuple[subprocess.Popen, float]] = []  # workers that said CLOSED, until they exit
        self.worker_tmps: dict[int, str] = {}  # a worker's pid → its private TMPDIR, removed once it has exited
        now = time.monotonic()
        self.loads = [GpuLoad(now) for _ in devices]
        self.accounts: dict[int, memory_account.MemoryAccount] = {}  # simulated GPU → its memory account
        self.free_slots: dict[int, list[int]] = {}
        for d in devices:
            if d.simulated:
                fd = memory_account.create(f"gpu{d.index}")
                self.accounts[d.index] = memory_account.MemoryAccount(fd, d.total_memory, d.index, d.name)
                self.free_slots[d.index] = list(range(1, memory_account.SLOTS))  # ([0]: the total)
        self.announcer: announcer.Announcer | None = None
        if discovery:
            group, gport = beacon.group_from_env()
            iface = announcer.interface(host, discovery_iface or beacon.iface_from_env())
            addr = announcer.address(host, self.port, advertise, iface, group)
            self.announcer = announcer.Announcer(self.id, addr, group, gport, iface,
                                                 auth.beacon_key(self.token_key) if self.token_key else None)

    # ------------------------------------------------------------------ workers
    def _spawn(self, device: int) -> bool:
        """Start a worker for ``device``; False (and the waiting clients told) if it cannot start."""
        if time.monotonic() < self._spawn_after:
            return False
        self._n += 1
        ident = f"w{self._n}".encode()
        cmd = [sys.executable, "-m", "remotecuda_server.worker", "--backend", self.backend,
               "--ident", ident.decode(), "--device", self.devices[device].torch_device,
               "--max-frame", str(self.max_frame), "--idle-timeout", str(self.idle_timeout),
               "--parent", str(os.getpid())]
        if self.direct:
            cmd += ["--host", self.host]
        cmd += self.curve_args
        if self.session_memory is not None:
            cmd += ["--session-memory", str(self.session_memory)]
        if self.max_queued != backlog.DEFAULT:
            cmd += ["--max-queued", str(self.max_queued)]
        slot = None
        account = self.accounts.get(device)
        if account is not None:
            if not self.free_slots[device]:
                return False  # (every slot taken: the HELLO waits for a worker to end)
            slot = self.free_slots[device].pop(0)
            d = self.devices[device]
            cmd += ["--account-fd", str(account.fd), "--slot", str(slot),
                    "--gpu", json.dumps({"index": d.index, "name": d.name, "total_memory": d.total_memory})]
        tmp = None
        try:
            tmp = privileges.private_tmp(self._tmp.name, ident.decode())
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=dict(worker_env(), TMPDIR=tmp),
                                    pass_fds=(account.fd,) if account is not None else ())
        except OSError as e:  # (too many open files, out of memory, ...): this HELLO fails, not the gateway
            if slot is not None:
                self.free_slots[device].append(slot)
            if tmp is not None:
                privileges.remove_tmp(tmp)
            self._spawn_failed(device, f"{type(e).__name__}: {e}")
            return False
        self.worker_tmps[proc.pid] = tmp
        self.workers[ident] = WorkerProc(ident, device, proc, slot=slot)
        return True

    def _retire(self, w: WorkerProc) -> None:
        """A worker is gone, or will run no more ops: its share of a simulated GPU is free."""
        self.workers.pop(w.ident, None)
        if w.slot is not None:
            self.accounts[w.device].clear(w.slot)
            self.free_slots[w.device].append(w.slot)
            w.slot = None

    def _spawn_failed(self, device: int, why: str) -> None:
        """Back off, and answer the HELLOs that waited for a worker of ``device`` with an error."""
        print(f"remotecuda gateway: a session worker could not start ({why}); retrying in "
              f"{self._spawn_backoff:.0f} s", file=sys.stderr, flush=True)
        self._spawn_after = time.monotonic() + self._spawn_backoff
        self._spawn_backoff = min(self._spawn_backoff * 2, SPAWN_BACKOFF_MAX)
        idle = sum(1 for w in self.workers.values() if w.device == device and w.client is None)
        waiting = [h for h in self.waiting if h.device == device]
        for h in waiting[idle:]:
            self.waiting.remove(h)
            self._refuse(h.client, f"the gateway could not start a session worker ({why})", "internal", h.peer)

    def _maintain_spares(self) -> None:
        for dev in range(len(self.devices)):
            idle = sum(1 for w in self.workers.values() if w.device == dev and w.client is None)
            wanted = self.spare + sum(1 for h in self.waiting if h.device == dev)
            for _ in range(wanted - idle):
                if not self._spawn(dev):
                    break

    def _reap(self) -> None:
        for w in list(self.workers.values()):
            code = w.proc.poll()
            if code is None:
                continue
            self._exited(w.proc)
            self._retire(w)
            if w.client is not None and w.client in self.sessions:
                self._lose_session(w.client, f"the gateway's session worker exited (code {code})")
            elif not w.ready:
                self._spawn_failed(w.device, f"it exited with code {code} before it was ready")
        now = time.monotonic()
        still = []
        for proc, deadline in self.exiting:
            if proc.poll() is None:
                if now > deadline:
                    proc.kill()
                still.append((proc, deadline))
            else:
                self._exited(proc)
        self.exiting = still

    def _exited(self, proc: subprocess.Popen) -> None:
        """A worker process has ended: its private temporary directory goes."""
        tmp = self.worker_tmps.pop(proc.pid, None)
        if tmp is not None:
            privileges.remove_tmp(tmp)

    def _assign(self) -> None:
        still = []
        for h in self.waiting:
            w = next((w for w in self.workers.values()
                      if w.device == h.device and w.ready and w.client is None), None)
            if w is None:
                still.append(h)
                continue
            client = h.client
            w.client = client
            token = secrets.token_bytes(16)
            self.sessions[client] = SessionState(client, w.ident, h.device, token=token, peer=h.peer,
                                                 address=h.address)
            self._spawn_backoff = SPAWN_BACKOFF  # workers start again
            conf = self._cache_conf(self.cache_requests.pop(client, None))
            codecs = list(self.client_codecs.pop(client, ()))
            self.back.send_multipart([w.ident, internal.ATTACH, client, protocol.pack_body(
                {"cache": conf, "token": token, "codecs": codecs, "key": h.peer.key if h.peer else None})])
            welcome = dict(self._inventory(session=True), cache=conf, token=token)
            if w.data_port:
                welcome["direct"] = {"port": w.data_port, "token": token}
            self._say(client, protocol.WELCOME, welcome)
        self.waiting = still

    def _cache_conf(self, asked: Any) -> dict:
        """The upload cache a session gets: what it asked for, within this gateway's limit."""
        asked = asked if isinstance(asked, dict) else {}
        size = asked.get("bytes", self.cache_bytes)
        policy = asked.get("policy") if asked.get("policy") in POLICIES else "lru"
        size = min(size, self.cache_bytes) if isinstance(size, int) and size >= 0 else self.cache_bytes
        return {"bytes": size, "policy": policy}

    # ------------------------------------------------------------------ messages
    def _inventory(self, session: bool = False) -> dict:
        return {"gateway": VERSION, "protocol": protocol.VERSION, "torch": _torch_version(), "id": self.id,
                "devices": [d.as_dict() for d in self.devices], "session": session,
                "sessions": len(self.sessions), "codecs": list(protocol.CODECS),
                "auth": "token" if self.token_key is not None else None, "curve": self._curve_key()}

    def _curve_key(self) -> str | None:
        """The gateway's CURVE public key (Z85), or None without CURVE."""
        return self.curve.keys.public.decode() if self.curve is not None else None

    def gpus(self) -> list[dict]:
        """Each GPU's facts and current figures (STATUS's and the beacon's ``gpus``)."""
        now = time.monotonic()
        out = []
        for d, load in zip(self.devices, self.loads):
            rows = [st.worker_stats for st in self.sessions.values() if st.device == d.index]
            out.append({"index": d.index, "name": d.name, "kind": d.kind, "simulated": d.simulated,
                        "capability": d.capability, "bf16": d.bf16, "total_memory": d.total_memory,
                        "free_memory": self._free_memory(d, rows), "utilization": load.utilization(now),
                        "queued": sum(r.get("queued", 0) for r in rows), "sessions": len(rows),
                        "latency_ms": load.latency()})
        return out

    def _free_memory(self, d: DeviceInfo, rows: list[dict]) -> int:
        """A simulated GPU's from its account; a GPU's as its workers last saw it (cudaMemGetInfo),
        else its size less what sessions hold; the CPU's, the host's available memory."""
        if d.simulated:
            return self.accounts[d.index].free()
        if d.kind == "cpu":
            import psutil
            return psutil.virtual_memory().available
        seen = [r["device_free"] for r in rows if "device_free" in r]
        return min(seen) if seen else max(0, d.total_memory - sum(r.get("memory", 0) for r in rows))

    def _beacon_info(self) -> dict:
        return {"gateway": VERSION, "protocol": protocol.VERSION, "torch": _torch_version(),
                "host": socket.gethostname(), "sessions": len(self.sessions), "gpus": self.gpus(),
                "curve": self._curve_key()}

    def status(self, full: bool = True) -> dict:
        """Per-session and gateway-wide counters, and each GPU's figures: what the pool's
        scheduler and panel read. Not ``full`` (a peer that has not authenticated, with a token;
        one that has not proven the admin token, with an admin token):
        the inventory and the GPUs' figures alone, which beacons announce anyway."""
        if not full:
            return dict(self._inventory(), gpus=self.gpus())
        sessions = []
        total = dict(self.totals)
        for st in self.sessions.values():
            row = {"device": st.device, "age_s": round(time.time() - st.started, 1),
                   "path": "direct" if st.worker_stats.get("direct_messages_in") else "forwarded",
                   "messages_in": st.messages_in, "bytes_in": st.bytes_in, "bytes_out": st.bytes_out}
            for k, v in st.worker_stats.items():
                k = _DIRECT_KEYS.get(k, k)
                row[k] = row[k] + v if k in _DIRECT_KEYS.values() else v
                if isinstance(v, int) and k not in _GAUGES:
                    total[k] = total.get(k, 0) + v
            sessions.append(row)
        for k, v in self.finished.items():
            total[k] = total.get(k, 0) + v
        total["connections_closed"] = self.conns.shut_count
        return dict(self._inventory(), sessions=sessions, totals=dict(total, refused=dict(self.refused)),
                    gpus=self.gpus())

    def _send_client(self, client: bytes, frames: list) -> None:
        try:
            self.front.send_multipart([client, *frames], copy=False)
        except zmq.ZMQError:  # the client is gone (ROUTER_MANDATORY says so rather than dropping)
            pass

    def _keys_for(self, ident: bytes) -> tuple[auth.Peer | None, int]:
        """The keys a connection's messages are sealed with, and its channel (None: not authenticated)."""
        link = self.bulk_links.get(ident)
        if link is not None:
            st = self.sessions.get(link)
            return (st.peer if st else None), auth.BULK
        st = self.sessions.get(ident)
        if st is not None:
            return st.peer, auth.FRONT
        h = next((h for h in self.waiting if h.client == ident), None)
        return (h.peer if h is not None else self.peers.get(ident)), auth.FRONT

    def _say(self, ident: bytes, msg_type: int, body: dict, peer: Any = False) -> None:
        """Send one message of the supervisor's, sealed with the connection's keys when it has any."""
        frames = protocol.encode(msg_type, body)
        keys, channel = self._keys_for(ident) if peer is False else (peer, auth.FRONT)
        if keys is not None:
            frames = keys.seal(frames, channel | auth.SUPERVISOR)
        self._send_client(ident, frames)

    def _error(self, client: bytes, msg: str, kind: str = "protocol", peer: Any = False) -> None:
        self._say(client, protocol.ERROR, {"msg": msg, "kind": kind}, peer)

    def _refuse(self, client: bytes, msg: str, kind: str, peer: Any = False) -> None:
        """Refuse a request before any work: counted by kind, answered with a clear error."""
        self.refused[kind] = self.refused.get(kind, 0) + 1
        self._error(client, msg, kind, peer)

    def _on_front(self, frames: list) -> None:
        first, client, frames = frames[0], frames[0].bytes, frames[1:]
        try:
            if not frames:
                raise ProtocolError("empty message")
            head = protocol.decode_header(frames[0])
        except ProtocolError as e:
            self.conns.seen(first, client, False)
            self._lost(client)
            self._error(client, str(e))
            return
        bulk = client in self.bulk_links
        state = self.sessions.get(self.bulk_links[client] if bulk else client)
        n = sum(len(f) for f in frames)
        self.totals["messages_in"] += 1
        self.totals["bytes_in"] += n
        if state is not None:
            state.messages_in += 1
            state.bytes_in += n
        if self.token_key is None:  # no token: every well-formed message counts
            self.conns.seen(first, client, True)
            if state is not None:
                state.last_seen = time.monotonic()
        elif state is not None and head.type in (protocol.OPS, protocol.CANCEL, protocol.PART):
            if head.channel != (auth.BULK if bulk else auth.FRONT):  # (its MAC is the worker's to check)
                self._error(client, "message sealed for another connection", "auth")
                return
        else:  # the supervisor's own messages are checked here, and only they count as activity
            keys = self._keys_for(client)[0]
            if keys is None:
                self.conns.seen(first, client, False)
                self._on_stranger(client, first, head, frames)
                return
            try:
                keys.open(frames, (auth.BULK if bulk else auth.FRONT,), head)
            except ProtocolError as e:
                self.conns.seen(first, client, False)
                self._lost(client)
                self._refuse(client, str(e), "auth")
                return
            self.conns.seen(first, client, True)
            if state is not None:
                state.last_seen = time.monotonic()
            elif client in self.peers:
                self.peers.move_to_end(client)
        if bulk:
            self._on_bulk(client, head.type, frames, state)
            return
        if head.type in (protocol.OPS, protocol.CANCEL, protocol.PART):
            if state is None:
                self._error(client, "no session: send HELLO first", "no_session")
                return
            self._forward(state, frames, client, head.type)
            return
        try:
            msg = protocol.decode(frames, SMALL_BODY)
        except ProtocolError as e:
            self._lost(client)
            self._error(client, str(e))
            return
        self._on_message(client, first, msg, state)

    def _on_message(self, client: bytes, first: zmq.Frame, msg: protocol.Message, state: SessionState | None) -> None:
        """A checked message the supervisor answers itself."""
        if msg.type == protocol.PING:
            self._say(client, protocol.PONG, {"t": msg.body.get("t"), "id": self.id, "now": time.monotonic()})
        elif msg.type == protocol.HELLO:
            self._on_hello(client, first, msg.body)
        elif msg.type == protocol.STATUS:
            admin = self.admin_key is None or self._keys_for(client)[0] in self.admins
            self._say(client, protocol.STATUS, self.status(full=admin))
        elif msg.type == protocol.BYE:
            self._close_session(client)
        else:
            self._error(client, f"unexpected message type {protocol.TYPE_NAMES[msg.type]}")

    def _on_stranger(self, client: bytes, first: zmq.Frame, head: protocol.Header, frames: list) -> None:
        """A message from a connection that has not authenticated (with a token): a HELLO that
        starts the handshake (answered by a challenge) or ends it (sealed with the key both ends
        derive), a session's bulk connection (sealed with its session's key), or a STATUS or PING,
        answered with what is public (the inventory and GPU figures; the gateway's id, for a liveness
        check). Nothing else is read."""
        if head.type not in (protocol.HELLO, protocol.STATUS, protocol.PING):
            self._refuse(client, "this gateway requires a token: the client sets REMOTECUDA_TOKEN or "
                                 "REMOTECUDA_TOKEN_FILE (see docs/SECURITY.md)", "auth")
            return
        if head.n_payloads or head.body_len > SMALL_BODY:
            self._refuse(client, "a greeting over the size limit", "limit")
            return
        if head.type == protocol.STATUS:
            self._say(client, protocol.STATUS, self.status(full=False), None)
            return
        if head.type == protocol.PING:
            try:
                t = protocol.decode(frames, SMALL_BODY).body.get("t")
            except ProtocolError as e:
                self._error(client, str(e), peer=None)
                return
            self._say(client, protocol.PONG, {"t": t if isinstance(t, (int, float)) else None, "id": self.id,
                                              "now": time.monotonic()}, None)
            return
        if not head.flags & protocol.SEALED:  # the handshake's first step
            try:
                mine = protocol.decode(frames, SMALL_BODY).body.get("auth")
            except ProtocolError as e:
                self._error(client, str(e), peer=None)
                return
            if not (isinstance(mine, bytes) and len(mine) == auth.NONCE_BYTES):
                self._refuse(client, "this gateway requires a token: the client sets REMOTECUDA_TOKEN or "
                                     "REMOTECUDA_TOKEN_FILE (see docs/SECURITY.md)", "auth", None)
                return
            ours = auth.nonce()
            self.challenges[client] = (mine, ours)
            self.challenges.move_to_end(client)
            while len(self.challenges) > MAX_STRANGERS:
                self.challenges.popitem(last=False)
            self._say(client, protocol.CHALLENGE, {"nonce": ours}, None)
            return
        nonces = self.challenges.pop(client, None)
        if nonces is not None:  # the handshake's second step: a valid MAC proves the token
            assert self.token_key is not None
            peer = None
            for key in (self.token_key, self.admin_key):  # (the admin token opens the connection too)
                if key is None:
                    continue
                candidate = auth.Peer(auth.session_key(key, *nonces), auth.G2C)
                try:
                    candidate.open(frames, (auth.FRONT,), head)
                    msg = protocol.decode(frames, SMALL_BODY)
                except ProtocolError:
                    continue
                peer = candidate
                if key is self.admin_key:
                    self.admins.add(peer)
                break
            if peer is None:
                self._refuse(client, "authentication failed: this client's token is not the gateway's", "auth", None)
                return
            self.conns.seen(first, client, True)
            self.peers[client] = peer
            while len(self.peers) > MAX_STRANGERS:
                self.peers.popitem(last=False)
            self._on_message(client, first, msg, None)
            return
        for st in list(self.sessions.values()):  # a session's bulk connection: its key tells which
            if st.peer is None:
                continue
            try:
                st.peer.open(frames, (auth.BULK,), head)
            except ProtocolError:
                continue
            self.conns.seen(first, client, True)
            self._on_hello(client, first, protocol.decode(frames, SMALL_BODY).body, st)
            return
        self._refuse(client, "authentication failed: no handshake or session matches this message", "auth", None)

    def _lost(self, client: bytes) -> None:
        """A session's connection sent something that was refused before its type could be
        trusted: its worker learns of it, so an upload that waits for a PART that will not come
        fails instead of waiting forever."""
        st = self.sessions.get(self.bulk_links.get(client, client))
        if st is not None:
            try:
                self.back.send_multipart([st.worker, internal.LOST])
            except zmq.ZMQError:
                pass

    def _on_bulk(self, link: bytes, msg_type: int, frames: list, state: SessionState | None) -> None:
        """A message on a session's bulk connection: PARTs go to its worker like its ops."""
        if state is None:
            del self.bulk_links[link]
            self._error(link, "no session: this bulk connection's session has ended", "no_session", None)
        elif msg_type == protocol.PING:
            self._say(link, protocol.PONG, {})
        elif msg_type != protocol.PART:
            self._lost(link)
            self._error(link, f"a bulk connection carries PART messages, not {protocol.TYPE_NAMES[msg_type]}")
        else:
            self._forward(state, frames, link, msg_type)

    def _forward(self, state: SessionState, frames: list, ident: bytes, msg_type: int) -> None:
        """A session's message to its worker, unless the worker is that far behind (MAX_UNREAD_*)."""
        n = sum(len(f) for f in frames)
        if state.forwarded[0] - state.read[0] >= MAX_UNREAD_MESSAGES \
                or state.forwarded[1] - state.read[1] + n > MAX_UNREAD_BYTES:
            if msg_type == protocol.PART:
                self._lost(ident)
            self._refuse(ident, f"this session's worker has not yet read {state.forwarded[0] - state.read[0]} "
                                "messages forwarded to it: this one was refused (send less at once)", "limit")
            return
        state.forwarded[0] += 1
        state.forwarded[1] += n
        try:
            self.back.send_multipart([state.worker, internal.MSG, *frames], copy=False)
        except zmq.ZMQError:  # the worker has just gone (ROUTER_MANDATORY says so)
            self._lose_session(state.client, "the gateway's session worker is gone")

    def _on_hello(self, client: bytes, first: zmq.Frame, body: dict, bulk_of: SessionState | None = None) -> None:
        if body.get("bulk"):  # a session's second connection, for its large uploads
            token = body.get("token")
            state = next((st for st in self.sessions.values() if isinstance(token, bytes) and st.token
                          and hmac.compare_digest(st.token, token)), None)
            if bulk_of is not None and state is not bulk_of:
                state = None  # (sealed with one session's key, naming another's token)
            if state is None or client in self.sessions or client in self.peers:
                self._error(client, "no session holds this token (a bulk connection needs its session's token)"
                            if state is None else "this connection already has a session", peer=None)
                return
            self.bulk_links[client] = state.client
            self._say(client, protocol.WELCOME, {"bulk": True})
            return
        dev = body.get("device")
        if dev is None:
            self._say(client, protocol.WELCOME, self._inventory())
            return
        if not isinstance(dev, int) or not 0 <= dev < len(self.devices):
            self._error(client, f"this gateway has no device {dev!r} (it has {len(self.devices)})")
            return
        if client in self.sessions or client in self.bulk_links or any(h.client == client for h in self.waiting):
            self._refuse(client, "this connection already has a session (one session per connection)", "limit")
            return
        address = _peer_address(first)
        held = [st.address for st in self.sessions.values()] + [h.address for h in self.waiting]
        if len(held) >= self.max_sessions:
            self._refuse(client, f"this gateway serves its limit of {self.max_sessions} sessions "
                                 "(remotecuda start --max-sessions)", "limit")
            return
        if held.count(address) >= self.max_sessions_per_peer:
            self._refuse(client, f"this gateway serves its limit of {self.max_sessions_per_peer} sessions "
                                 f"for {address} (remotecuda start --max-sessions-per-peer)", "limit")
            return
        try:  # downloads use only codecs the client decodes
            self.client_codecs[client] = protocol.common_codecs(body.get("codecs"))
        except ProtocolError as e:
            self._error(client, str(e))
            return
        self.cache_requests[client] = body.get("cache")
        self.waiting.append(Waiting(client, dev, address, self.peers.pop(client, None)))
        self._assign()

    def _keep_totals(self, state: SessionState) -> None:
        for k, v in state.worker_stats.items():
            k = _DIRECT_KEYS.get(k, k)
            if isinstance(v, int) and k not in _GAUGES:
                self.finished[k] = self.finished.get(k, 0) + v

    def _forget_bulk_links(self, client: bytes) -> None:
        for link in [k for k, v in self.bulk_links.items() if v == client]:
            del self.bulk_links[link]

    def _lose_session(self, client: bytes, why: str) -> None:
        peer = self._keys_for(client)[0]
        state = self.sessions.pop(client, None)
        self._forget_bulk_links(client)
        if state is not None:
            self._keep_totals(state)
        self._error(client, f"{why}; this session's tensors are lost", "session_lost", peer)

    def _close_session(self, client: bytes) -> None:
        state = self.sessions.pop(client, None)
        self._forget_bulk_links(client)
        if state is not None:
            self._keep_totals(state)
            try:
                self.back.send_multipart([state.worker, internal.CLOSE])
            except zmq.ZMQError:
                pass

    def _on_back(self, frames: list) -> None:
        ident, kind = frames[0].bytes, frames[1].bytes
        w = self.workers.get(ident)
        if w is None:
            return
        if kind == internal.READY:
            w.ready = True
            w.data_port = int(frames[2].bytes) if len(frames) > 2 else 0
            self._assign()
        elif kind == internal.READ:
            state = self.sessions.get(w.client) if w.client is not None else None
            if state is not None and state.worker == ident:
                state.read = [int(frames[2].bytes), int(frames[3].bytes)]
        elif kind == internal.BYE:  # the client said goodbye on the direct path
            if w.client is not None:
                self._close_session(w.client)
        elif kind == internal.OUT:
            client = frames[2].bytes
            state = self.sessions.get(client)
            if state is not None and client == w.client:  # a worker speaks to its own client only
                n = sum(len(f) for f in frames[3:])
                state.bytes_out += n
                self.totals["bytes_out"] += n
                self._send_client(client, frames[3:])
        elif kind == internal.STATS:
            state = self.sessions.get(w.client) if w.client is not None else None
            if state is not None:
                stats = protocol.unpack_body(frames[2].bytes)
                if stats.get("client_messages") != state.worker_stats.get("client_messages"):
                    state.last_seen = time.monotonic()  # the worker heard its client (checked)
                self.loads[state.device].report(state.worker_stats, stats)
                state.worker_stats = stats
        elif kind == internal.CLOSED:
            # its executor has stopped and the process exits next: reaped later, never waited for
            # here, where every client's message (a liveness PING too) would wait with it
            self._retire(w)
            self.exiting.append((w.proc, time.monotonic() + _EXIT_GRACE))
            if w.client is not None and w.client in self.sessions \
                    and self.sessions[w.client].worker == ident:  # it ended without a CLOSE
                self._lose_session(w.client, "the gateway's session worker ended")

    def _in_use(self, ident: bytes) -> bool:
        """Whether a connection serves a session (or waits for one): idle connections that do not are closed."""
        return ident in self.sessions or ident in self.bulk_links or any(h.client == ident for h in self.waiting)

    def _on_disconnect(self, ident: bytes) -> None:
        """A connection closed (a client that ended, or was killed): what it held goes."""
        self.challenges.pop(ident, None)
        self.peers.pop(ident, None)
        self.bulk_links.pop(ident, None)
        self.waiting = [h for h in self.waiting if h.client != ident]
        st = self.sessions.get(ident)
        if st is not None:
            st.disconnected = True

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        poller.register(self.conns.monitor, zmq.POLLIN)
        self._maintain_spares()
        last_maint = time.monotonic()
        trim_at = 0.0  # when to give freed memory back, after connections closed
        while self.running:
            wait = 200 if self.announcer is None else \
                max(0, min(200, int((self.announcer.next_at - time.monotonic()) * 1000) + 1))
            events = dict(poller.poll(wait))
            if self.back in events:
                for _ in range(256):
                    try:
                        self._on_back(self.back.recv_multipart(zmq.NOBLOCK, copy=False))
                    except zmq.Again:
                        break
            if self.conns.monitor in events or self.front in events:  # (news of a connection before its messages)
                for ident in self.conns.events():
                    self._on_disconnect(ident)
                if self.conns.closed:
                    self.conns.closed, trim_at = 0, time.monotonic() + 0.5
            if self.front in events:
                for _ in range(256):
                    try:
                        frames = self.front.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._on_front(frames)
                    except Exception:  # one client's message must never stop the gateway
                        import traceback
                        traceback.print_exc()
                        self._error(frames[0].bytes, "the gateway could not handle this message", "internal", None)
            now = time.monotonic()
            if self.announcer is not None and now >= self.announcer.next_at:
                self.announcer.send(self._beacon_info())
            if now - last_maint > 0.5:
                last_maint = now
                for load in self.loads:
                    load.sample(now)
                self._reap()
                for client, st in list(self.sessions.items()):
                    if now - st.last_seen > (DISCONNECT_GRACE if st.disconnected else self.session_timeout):
                        self._close_session(client)
                        self.conns.close(client)
                self.conns.expire(self._in_use)
                if trim_at and now >= trim_at:  # what closed connections held (unfinished messages) goes back
                    trim_at = 0.0
                    _trim_heap()
                self._maintain_spares()
                self._assign()

    def shutdown(self) -> None:
        self.running = False
        if self.announcer is not None:
            self.announcer.send(self._beacon_info(), leaving=True)
            self.announcer.close()
        procs = [w.proc for w in self.workers.values()] + [proc for proc, _ in self.exiting]
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.front.disable_monitor()
        self.conns.stop()
        self.front.close()
        self.back.close()
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()
        self._tmp.cleanup()
        for account in self.accounts.values():
            account.close()


def _trim_heap() -> None:
    """Give freed heap memory back to the system (glibc keeps it otherwise: the large receive
    buffers' tunables, MALLOC_TUNABLES below, tell it not to trim on its own)."""
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def _peer_address(frame: zmq.Frame) -> str:
    """The IP address a message came from (ZeroMQ's Peer-Address property)."""
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return ""


def raise_open_file_limit() -> None:
    """Each connection costs the supervisor a file descriptor: take the hard limit, not the soft one."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 20
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


#: malloc, which ZeroMQ's receive buffers use: huge pages, and buffers up to 32 MiB (an upload
#: part is 4) from the heap, which keeps freed ones for reuse instead of unmapping them
MALLOC_TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432"
                   ":glibc.malloc.trim_threshold=4294967295")


def worker_env() -> dict:
    """Large host buffers (received payloads, CPU-device tensors) on transparent huge pages and
    reused once freed: faulting in fresh 4 KiB pages costs more than the copies themselves
    (64 MiB: ~55 ms vs ~17 ms). A session's memory still returns to the system when it ends."""
    env = dict(os.environ)
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # torch's CPU allocator
    env.setdefault("GLIBC_TUNABLES", MALLOC_TUNABLES)
    return env


@functools.cache
def _torch_version() -> str:
    from importlib.metadata import version
    try:
        return version("torch")
    except Exception:
        return "unknown"
