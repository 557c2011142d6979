"""The gateway supervisor: one TCP port, sessions placed on workers.

The supervisor never runs an op. It checks each message's header, answers HELLO, PING
and STATUS itself (so a liveness ping is answered at once however busy the workers are:
nothing in its loop waits on a worker), and forwards a session's frames (without copying
them) to the worker process that owns the session — or, when the client reaches the
worker's own data port (the direct path, see worker.py), only places the session and keeps
its accounts. Workers are started ahead of time, one spare per device, so a new session
does not wait for ``import torch``. A session ends on BYE, after ``session_timeout``
seconds without a message (the client pings every few seconds while alive), or when its
worker dies; its worker then exits, which frees all of its memory.

It also keeps each GPU's figures (memory, utilization, queued work, sessions, op latency;
load.py) from its workers' reports, and announces the gateway with them on multicast about
once a second (announcer.py) unless discovery is off.
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
from dataclasses import dataclass, field
from typing import Any

import zmq

from remotecuda_wire import beacon, protocol
from remotecuda_wire._version import __version__ as VERSION
from remotecuda_wire.cache import DEFAULT_BYTES as DEFAULT_CACHE_BYTES
from remotecuda_wire.cache import POLICIES
from remotecuda_wire.protocol import ProtocolError

from . import announcer, internal, memory_account
from .devices import DeviceInfo
from .load import GpuLoad

#: worker figures that are levels, not counts: a session row shows them, totals do not add them up
_GAUGES = ("memory", "cache_entries", "partial_upload_bytes", "queued", "device_free", "device_total")
#: seconds a worker that said CLOSED may take to exit before it is killed
_EXIT_GRACE = 30.0
#: a worker's counts of direct-path traffic, and the session counters they add to
_DIRECT_KEYS = {"direct_messages_in": "messages_in", "direct_bytes_in": "bytes_in",
                "direct_bytes_out": "bytes_out"}


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


class Gateway:
    def __init__(self, devices: list[DeviceInfo], host: str = "127.0.0.1", port: int = 55555,
                 spare: int = 1, session_timeout: float = 60.0, max_frame: int = protocol.MAX_PAYLOAD_BYTES,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, direct: bool = True, discovery: bool = False,
                 advertise: str | None = None, discovery_iface: str | None = None):
        """``discovery``: announce on multicast (group from REMOTECUDA_DISCOVERY), from
        ``discovery_iface`` (else REMOTECUDA_DISCOVERY_IFACE, else announcer.interface's choice),
        giving ``advertise`` (HOST:PORT) as the address, else the bound one."""
        self.devices = devices
        self.id = secrets.token_hex(8)  # this start's: a restarted gateway is another one
        self.direct = direct
        self.max_frame = max_frame
        self.spare = spare
        self.session_timeout = session_timeout
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.setsockopt(zmq.MAXMSGSIZE, max_frame + 64)
        self.front.setsockopt(zmq.SNDHWM, 0)
        self.front.setsockopt(zmq.RCVHWM, 0)
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
        self.waiting: list[tuple[bytes, int]] = []  # (client, device) HELLOs waiting for a worker
        self.cache_requests: dict[bytes, Any] = {}
        self.client_codecs: dict[bytes, tuple[str, ...]] = {}  # what each waiting client decodes
        self.bulk_links: dict[bytes, bytes] = {}  # a session's bulk connection → the session's client
        self.totals = {"messages_in": 0, "bytes_in": 0, "bytes_out": 0}
        self.finished: dict[str, int] = {}  # worker counters of sessions that have ended
        self.cache_bytes = cache_bytes
        self._n = 0
        self.running = True
        self.exiting: list[tuple[subprocess.Popen, float]] = []  # workers that said CLOSED, until they exit
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
            self.announcer = announcer.Announcer(self.id, addr, group, gport, iface)

    # ------------------------------------------------------------------ workers
    def _spawn(self, device: int) -> None:
        self._n += 1
        ident = f"w{self._n}".encode()
        cmd = [sys.executable, "-m", "remotecuda_server.worker", "--backend", self.backend,
               "--ident", ident.decode(), "--device", self.devices[device].torch_device,
               "--max-frame", str(self.max_frame), "--parent", str(os.getpid())]
        if self.direct:
            cmd += ["--host", self.host]
        slot = None
        account = self.accounts.get(device)
        if account is not None:
            if not self.free_slots[device]:
                return  # (every slot taken: the HELLO waits for a worker to end)
            slot = self.free_slots[device].pop(0)
            d = self.devices[device]
            cmd += ["--account-fd", str(account.fd), "--slot", str(slot),
                    "--gpu", json.dumps({"index": d.index, "name": d.name, "total_memory": d.total_memory})]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=worker_env(),
                                pass_fds=(account.fd,) if account is not None else ())
        self.workers[ident] = WorkerProc(ident, device, proc, slot=slot)

    def _retire(self, w: WorkerProc) -> None:
        """A worker is gone, or will run no more ops: its share of a simulated GPU is free."""
        self.workers.pop(w.ident, None)
        if w.slot is not None:
            self.accounts[w.device].clear(w.slot)
            self.free_slots[w.device].append(w.slot)
            w.slot = None

    def _maintain_spares(self) -> None:
        for dev in range(len(self.devices)):
            idle = sum(1 for w in self.workers.values() if w.device == dev and w.client is None)
            wanted = self.spare + sum(1 for _, d in self.waiting if d == dev)
            for _ in range(wanted - idle):
                self._spawn(dev)

    def _reap(self) -> None:
        for w in list(self.workers.values()):
            code = w.proc.poll()
            if code is None:
                continue
            self._retire(w)
            if w.client is not None and w.client in self.sessions:
                self._lose_session(w.client, f"the gateway's session worker exited (code {code})")
        now = time.monotonic()
        still = []
        for proc, deadline in self.exiting:
            if proc.poll() is None:
                if now > deadline:
                    proc.kill()
                still.append((proc, deadline))
        self.exiting = still

    def _assign(self) -> None:
        still = []
        for client, dev in self.waiting:
            w = next((w for w in self.workers.values()
                      if w.device == dev and w.ready and w.client is None), None)
            if w is None:
                still.append((client, dev))
                continue
            w.client = client
            token = secrets.token_bytes(16)
            self.sessions[client] = SessionState(client, w.ident, dev, token=token)
            conf = self._cache_conf(self.cache_requests.pop(client, None))
            codecs = list(self.client_codecs.pop(client, ()))
            self.back.send_multipart([w.ident, internal.ATTACH, client,
                                      protocol.pack_body({"cache": conf, "token": token, "codecs": codecs})])
            welcome = dict(self._inventory(session=True), cache=conf, token=token)
            if w.data_port:
                welcome["direct"] = {"port": w.data_port, "token": token}
            self._send_client(client, protocol.encode(protocol.WELCOME, welcome))
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
                "sessions": len(self.sessions), "codecs": list(protocol.CODECS)}

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
                "host": socket.gethostname(), "sessions": len(self.sessions), "gpus": self.gpus()}

    def status(self) -> dict:
        """Per-session and gateway-wide counters, and each GPU's figures: what the pool's
        scheduler and panel read."""
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
        return dict(self._inventory(), sessions=sessions, totals=total, gpus=self.gpus())

    def _send_client(self, client: bytes, frames: list) -> None:
        try:
            self.front.send_multipart([client, *frames], copy=False)
        except zmq.ZMQError:  # the client is gone (ROUTER_MANDATORY says so rather than dropping)
            pass

    def _error(self, client: bytes, msg: str, kind: str = "protocol") -> None:
        self._send_client(client, protocol.encode(protocol.ERROR, {"msg": msg, "kind": kind}))

    def _on_front(self, frames: list) -> None:
        client, frames = frames[0].bytes, frames[1:]
        try:
            if not frames:
                raise ProtocolError("empty message")
            msg_type = protocol.decode_header(frames[0])[0]
        except ProtocolError as e:
            self._error(client, str(e))
            return
        bulk = client in self.bulk_links
        state = self.sessions.get(self.bulk_links[client] if bulk else client)
        n = sum(len(f) for f in frames)
        if state is not None:
            state.last_seen = time.monotonic()
            state.messages_in += 1
            state.bytes_in += n
        self.totals["messages_in"] += 1
        self.totals["bytes_in"] += n
        if bulk:
            self._on_bulk(client, msg_type, frames, state)
            return
        if msg_type in (protocol.OPS, protocol.CANCEL, protocol.PART):
            if state is None:
                self._error(client, "no session: send HELLO first", "no_session")
                return
            self._forward(state, frames)
            return
        try:
            msg = protocol.decode(frames)
        except ProtocolError as e:
            self._error(client, str(e))
            return
        if msg_type == protocol.PING:
            self._send_client(client, protocol.encode(protocol.PONG, {"t": msg.body.get("t"), "id": self.id}))
        elif msg_type == protocol.HELLO:
            self._on_hello(client, msg.body)
        elif msg_type == protocol.STATUS:
            self._send_client(client, protocol.encode(protocol.STATUS, self.status()))
        elif msg_type == protocol.BYE:
            self._close_session(client)
        else:
            self._error(client, f"unexpected message type {protocol.TYPE_NAMES[msg_type]}")

    def _on_bulk(self, link: bytes, msg_type: int, frames: list, state: SessionState | None) -> None:
        """A message on a session's bulk connection: PARTs go to its worker like its ops."""
        if state is None:
            del self.bulk_links[link]
            self._error(link, "no session: this bulk connection's session has ended", "no_session")
        elif msg_type == protocol.PING:
            self._send_client(link, protocol.encode(protocol.PONG, {}))
        elif msg_type != protocol.PART:
            self._error(link, f"a bulk connection carries PART messages, not {protocol.TYPE_NAMES[msg_type]}")
        else:
            self._forward(state, frames)

    def _forward(self, state: SessionState, frames: list) -> None:
        try:
            self.back.send_multipart([state.worker, internal.MSG, *frames], copy=False)
        except zmq.ZMQError:  # the worker has just gone (ROUTER_MANDATORY says so)
            self._lose_session(state.client, "the gateway's session worker is gone")

    def _on_hello(self, client: bytes, body: dict) -> None:
        if body.get("bulk"):  # a session's second connection, for its large uploads
            token = body.get("token")
            state = next((st for st in self.sessions.values() if isinstance(token, bytes) and st.token
                          and hmac.compare_digest(st.token, token)), None)
            if state is None or client in self.sessions:
                self._error(client, "no session holds this token (a bulk connection needs its session's token)"
                            if state is None else "this connection already has a session")
                return
            self.bulk_links[client] = state.client
            self._send_client(client, protocol.encode(protocol.WELCOME, {"bulk": True}))
            return
        dev = body.get("device")
        if dev is None:
            self._send_client(client, protocol.encode(protocol.WELCOME, self._inventory()))
            return
        if not isinstance(dev, int) or not 0 <= dev < len(self.devices):
            self._error(client, f"this gateway has no device {dev!r} (it has {len(self.devices)})")
            return
        if client in self.sessions:
            self._error(client, "this connection already has a session")
            return
        try:  # downloads use only codecs the client decodes
            self.client_codecs[client] = protocol.common_codecs(body.get("codecs"))
        except ProtocolError as e:
            self._error(client, str(e))
            return
        self.cache_requests[client] = body.get("cache")
        self.waiting.append((client, dev))
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
        state = self.sessions.pop(client, None)
        self._forget_bulk_links(client)
        if state is not None:
            self._keep_totals(state)
        self._send_client(client, protocol.encode(protocol.ERROR, {
            "kind": "session_lost", "msg": f"{why}; this session's tensors are lost"}))

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
        elif kind == internal.BYE:  # the client said goodbye on the direct path
            if w.client is not None:
                self._close_session(w.client)
        elif kind == internal.OUT:
            client = frames[2].bytes
            state = self.sessions.get(client)
            if state is not None:
                n = sum(len(f) for f in frames[3:])
                state.bytes_out += n
                self.totals["bytes_out"] += n
                self._send_client(client, frames[3:])
        elif kind == internal.STATS:
            state = self.sessions.get(w.client) if w.client is not None else None
            if state is not None:
                stats = protocol.unpack_body(frames[2].bytes)
                if stats.get("direct_messages_in") != state.worker_stats.get("direct_messages_in"):
                    state.last_seen = time.monotonic()  # the client is alive on the direct path
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

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        self._maintain_spares()
        last_maint = time.monotonic()
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
                        self._error(frames[0].bytes, "the gateway could not handle this message", "internal")
            now = time.monotonic()
            if self.announcer is not None and now >= self.announcer.next_at:
                self.announcer.send(self._beacon_info())
            if now - last_maint > 0.5:
                last_maint = now
                for load in self.loads:
                    load.sample(now)
                self._reap()
                for client, st in list(self.sessions.items()):
                    if now - st.last_seen > self.session_timeout:
                        self._close_session(client)
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
        self.front.close()
        self.back.close()
        self.ctx.term()
        self._tmp.cleanup()
        for account in self.accounts.values():
            account.close()


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
