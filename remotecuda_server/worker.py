"""A session worker: one process per client session, bound to one device.

Why a process: a sticky CUDA error (device-side assert, illegal address) poisons the
whole process's context, so it must cost one session, not everyone on the GPU; and a
session's memory is returned completely when its process ends.

The supervisor starts workers ahead of time (``import torch`` takes seconds) and
hands each one a session. The worker's main thread does socket I/O only, so an
interrupt (CANCEL) is seen while ops run; a second thread executes ops in order.

A session's messages reach the worker forwarded by the supervisor, or, when the
client can reach it, straight from the client on the worker's own data port (the
direct path): tensor bytes then cross one socket instead of two. The client proves it
owns the session with the token the supervisor gave it in WELCOME, and, when the gateway has
a token of its own (auth.py), with the session's key: the worker checks every message's MAC
and sequence number before it reads it, and seals what it sends.
"""
from __future__ import annotations

import argparse
import hmac
import json
import os
import queue
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from zmq.backend import zmq_poll
from zmq.utils.monitor import recv_monitor_message

from remotecuda_wire import auth, curve, fastread, protocol
from remotecuda_wire import frames as wire
from remotecuda_wire.cache import ContentCache
from remotecuda_wire.lifetime import die_with_parent
from remotecuda_wire.protocol import ProtocolError

from . import backlog, internal, peer, privileges
from .connections import Connections
from .executor import Assembly, Executor, Upload
from .kernel_warnings import KernelWarnings, within
from .memory_account import MemoryAccount

STATS_INTERVAL = 0.25  # seconds between a busy session's reports to the supervisor
#: messages queued per connection on the data port before ZeroMQ stops reading that peer
DATA_RCVHWM = 64
#: the worker tells the supervisor what it has read of the forwarded messages after this many, or this many bytes
READ_ACK_MESSAGES, READ_ACK_BYTES = 64, 8 << 20


#: the most ops a request message may hold to run on the I/O thread (longer ones go to the executor,
#: so that the I/O thread keeps serving copies and cancels meanwhile)
INLINE_OPS = 16


def _waits_on_io(ops: Any) -> bool:
    """Whether a message has an op that waits for bytes the I/O thread brings: an upload sent in
    PARTs, a copy pulled from another worker (rc::receive). Those never run on the I/O thread."""
    return any(op[0] == "rc::receive" or (op[0] == "rc::upload" and isinstance(op[1], list) and len(op[1]) > 1
                                          and op[1][1] is None)
               for op in (ops if isinstance(ops, list) else ()) if isinstance(op, list) and op)


#: the plain int of zmq's enum constant: an enum's ``&`` builds a new enum member each time
_POLLIN = int(zmq.POLLIN)


def _readable(sock: zmq.Socket) -> bool:
    """Whether a message waits on ``sock``: asked before a non-blocking read, because a read that
    finds nothing costs a raised ``zmq.Again``, several times the read itself, on every value read.
    A poll of no wait, not ``getsockopt(EVENTS)``, which looks the option up in an enum: ~4k
    instructions instead of ~10k, twice per value read (callgrind)."""
    return bool(zmq_poll([(sock, _POLLIN)], 0))


def _take(sock: zmq.Socket, handle: Any, most: int = 64) -> None:
    """Hand ``handle`` the messages waiting on ``sock``, which the poll found readable, up to
    ``most`` (the rest after the next poll). The first is read without asking: a value read is
    one message, and each question costs a call into ZeroMQ on its round trip."""
    for _ in range(most):
        try:
            frames = wire.recv(sock, zmq.NOBLOCK)
        except zmq.Again:  # (none after all: only a read tells for sure)
            return
        handle(frames)
        if not _readable(sock):
            return


def _no_wake() -> None:
    return None


class _Direct:
    """The executor's outbox as a request run on the I/O thread sees it: straight to the client."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def send_multipart(self, frames: list, copy: bool = True) -> None:
        self.worker._to_client(frames)


# ---------------------------------------------------------------------- the executor's inbox
@dataclass(frozen=True, slots=True)
class Run:
    """A session message for the executor to run, its payloads checked by the I/O thread."""

    msg: protocol.Message
    prepared: dict  # uploaded handle → its Upload, already on the device, or why it could not be
    ops: int = 0  # how many ops it holds (the queued work a GPU reports, until they have run)
    nbytes: int = 0  # the bytes of its uploads (in the session's backlog until it has run)


@dataclass(frozen=True, slots=True)
class Rejected:
    """A message the I/O thread refused: the executor answers ERROR in its turn."""

    why: str
    ops: int = 0  # the ops its message held (counted in the session's backlog until answered)
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class Cancelled:
    """A CANCEL: the executor clears a pending op error and answers the interrupted request."""

    rid: Any
    ops: int = 0
    nbytes: int = 0


#: what the I/O thread queues for the executor thread, in order; None: the session is over
InboxItem = Run | Rejected | Cancelled | None


class Worker:
    def __init__(self, backend: str, ident: bytes, device: str, host: str | None = None,
                 max_frame: int = protocol.MAX_BODY_BYTES + 64, account: MemoryAccount | None = None,
                 idle_timeout: float = 30.0, quota: int | None = None, max_queued: int = backlog.DEFAULT,
                 curve_keys: tuple[str, str] | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            if quota is not None:  # (this process serves one session: its allocator's memory is the session's)
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, quota / total), self.device)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.executor = Executor(self.device, copy_stream=self.copy_stream, account=account, quota=quota)
        self.kernel_warnings = KernelWarnings()  # what the kernels warn, for the next REPLY (installed by main)
        #: the load this session puts on its GPU, which the I/O thread reports: ops received (counted
        #: by the I/O thread) and run (by the executor thread), within the session's bound; and the
        #: executor's seconds on finished messages with the running one's start (None when idle),
        #: one tuple so that it is read whole
        self.backlog = backlog.Backlog(max_queued)
        self._busy: tuple[float, float | None] = (0.0, None)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, ident)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(backend)
        #: with CURVE (the gateway's key pair file, the client keys directory): this process's own
        #: ZAP handler, for its data port; and its pulls from other workers use the gateway's key pair
        self.curve = curve.Server(self.ctx, curve.load_keypair(curve_keys[0]), curve_keys[1]) \
            if curve_keys is not None else None
        self.data, self.data_port = None, 0  # the direct path's socket, on the gateway's host
        self.conns: Connections | None = None
        if host:
            self.data = self.ctx.socket(zmq.ROUTER)
            for opt, v in ((zmq.ROUTER_MANDATORY, 1), (zmq.ROUTER_HANDOVER, 1), (zmq.LINGER, 0),
                           (zmq.SNDHWM, 0), (zmq.RCVHWM, DATA_RCVHWM), (zmq.MAXMSGSIZE, max_frame),
                           (zmq.HEARTBEAT_IVL, 2000), (zmq.HEARTBEAT_TIMEOUT, 10000)):
                self.data.setsockopt(opt, v)
            if self.curve is not None:
                self.curve.secure(self.data)
            self.data_port = self.data.bind_to_random_port(f"tcp://{host}")
            self.conns = Connections(self.data, idle_timeout)
        self.token = b""
        self.keys: auth.Peer | None = None  # the session's keys, when the gateway has a token
        self.early: list = []  # data-port messages that came before ATTACH
        self.direct_client: bytes | None = None  # the client's identity on the data socket
        self.bulk_client: bytes | None = None  # its bulk connection's (PART messages only)
        self.direct_counts = {"direct_messages_in": 0, "direct_bytes_in": 0, "direct_bytes_out": 0}
        self.client_messages = 0  # the client's messages that passed every check (the supervisor's sign of life)
        self.forwarded = [0, 0]  # messages and bytes the supervisor forwarded that this worker has read
        self._acked = [0, 0]  # what of that the supervisor was last told
        self.outbox = self.ctx.socket(zmq.PULL)
        self.outbox.bind(f"inproc://out-{id(self)}")
        self.executor_ended = False  # the executor thread sent DONE (the session is over)
        self._inline_out = _Direct(self)  # where a request run on the I/O thread replies
        self.poller = zmq.Poller()
        self.max_frame = max_frame
        self.peers: dict[str, zmq.Socket] = {}  # source workers this session pulls copies from, by endpoint
        self.peer_monitors: dict[zmq.Socket, str] = {}  # each one's connection news → its endpoint
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.client: bytes | None = None
        self.cancel_upto = -1  # messages with seq <= this are dropped
        self.current_seq = -1
        self.closing = False
        self._last_stats: dict = {}
        self._stats_at = 0.0

    # ------------------------------------------------------------------ I/O thread
    def serve(self) -> None:
        self.sock.send_multipart([internal.READY, str(self.data_port).encode()])
        exec_thread = threading.Thread(target=self._execute_loop, daemon=True)
        exec_thread.start()
        poller = self.poller
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.outbox, zmq.POLLIN)
        if self.data is not None:
            poller.register(self.data, zmq.POLLIN)
        if self.conns is not None:
            poller.register(self.conns.monitor, zmq.POLLIN)
        # in inference mode as the executor thread (see _execute_loop), entered once: the short
        # requests this thread runs itself (_run_inline) then pay nothing for it
        with torch.inference_mode():
            self._serve_loop()

    def _serve_loop(self) -> None:
        poller = self.poller
        while True:
            events = dict(poller.poll(500))
            if time.monotonic() - self._stats_at >= STATS_INTERVAL:
                self._report_stats()
                if self.conns is not None:
                    self.conns.events()
                    self.conns.expire(self._in_use)
            if self.outbox in events:
                self._forward_outbox()
            if self.executor_ended:
                self.sock.send_multipart([internal.CLOSED])
                if self.data is not None:
                    self.data.disable_monitor()
                for sock in self.peers.values():
                    sock.disable_monitor()
                return
            if self.executor.offers.busy():
                self._serve_pulls()
            for endpoint, sock in self.peers.items():
                if sock in events:
                    self._on_peer(endpoint, sock)
            for mon, endpoint in self.peer_monitors.items():
                if mon in events:
                    self._on_peer_monitor(endpoint, mon)
            if self.data in events:
                if self.conns is not None and self.conns.monitor in events:
                    self.conns.events()  # (news of a connection before its messages)
                _take(self.data, self._on_direct)
            if self.sock in events:
                _take(self.sock, self._on_supervisor)  # (a batch: the supervisor forwards faster than one a poll)

    def _on_supervisor(self, frames: list) -> None:
        """A message from the supervisor: the session, a client's forwarded message, its end."""
        kind = frames[0].bytes
        if kind == internal.ATTACH:
            self.client = frames[1].bytes
            conf = protocol.unpack_body(frames[2].bytes) if len(frames) > 2 else {}
            cache = conf.get("cache") or {}
            if cache.get("bytes"):
                self.executor.cache = ContentCache(cache["bytes"], cache["policy"])
            self.token = conf.get("token") or b""
            if conf.get("key"):
                self.keys = auth.Peer(conf["key"], auth.G2C)
            self.executor.codecs = tuple(conf.get("codecs") or ())
            for early in self.early:
                self._on_direct(early)
            self.early = []
        elif kind == internal.MSG:
            self._read_forwarded(frames[1:])
            self._on_client_message(frames[1:])
        elif kind == internal.CLOSE:
            self._close()
            self.inbox.put(None)
        elif kind == internal.LOST:
            self.executor.parts.lost()

    def _read_forwarded(self, frames: list) -> None:
        """Count a forwarded message read, and tell the supervisor now and then (internal.READ): it
        holds what it forwarded and this worker has not read, up to a bound (gateway.MAX_UNREAD_*)."""
        self.forwarded[0] += 1
        self.forwarded[1] += sum(map(len, frames))
        if self.forwarded[0] - self._acked[0] >= READ_ACK_MESSAGES \
                or self.forwarded[1] - self._acked[1] >= READ_ACK_BYTES:
            self._acked = list(self.forwarded)
            self.sock.send_multipart([internal.READ, *(str(n).encode() for n in self.forwarded)])

    def _forward_outbox(self) -> None:
        """Send the executor's messages on to the client, noting when its thread has ended."""
        while not self.executor_ended and _readable(self.outbox):
            frames = wire.recv(self.outbox, zmq.NOBLOCK)
            kind = frames[0].bytes
            if kind == internal.DONE:
                self.executor_ended = True
            elif kind != internal.OFFERED:
                self._to_client(frames)

    def _in_use(self, ident: bytes) -> bool:
        """Whether a data-port connection serves the session, or waits for a copy it pulls."""
        return ident in (self.direct_client, self.bulk_client) or \
            any(p.ident == ident for p in self.executor.offers.waiting)

    def _close(self) -> None:
        """The session is over (BYE, or the supervisor's CLOSE): work queued for it is dropped."""
        self.closing = True
        self.executor.parts.close()
        self.executor.receipts.close()

    def _seal(self, frames: list, channel: int) -> list:
        return self.keys.seal(frames, channel | auth.WORKER) if self.keys is not None else frames

    def _to_client(self, frames: list, copy: bool = False) -> None:
        """A message of the executor's for the client, sealed here, in the order it is sent;
        ``copy``: a small one (a VALUE), cheaper copied than wrapped (remotecuda_wire/frames.py)."""
        if self.direct_client is None:
            wire.send(self.sock, [internal.OUT, self.client, *self._seal(frames, auth.FRONT)], copy=copy)
            return
        frames = self._seal(frames, auth.DIRECT)
        self.direct_counts["direct_bytes_out"] += sum(map(len, frames))
        try:
            wire.send(self.data, [self.direct_client, *frames], copy=copy)
        except zmq.ZMQError:  # the client's connection is gone; the session times out
            pass

    def _on_direct(self, frames: list) -> None:
        """A message on the data port: the session's own connections after their HELLO, another
        gateway worker's PULL of a copy, else refused."""
        ident = frames[0].bytes
        if ident not in (self.direct_client, self.bulk_client) and self._is_pull(frames):
            self._on_pull(frames[0], frames[1:])
            return
        if self.client is None:  # a HELLO may overtake the supervisor's ATTACH: keep it for then
            if len(self.early) < 8:  # (a spare's port has no business with anyone else)
                self.early.append(frames)
            return
        first, frames = frames[0], frames[1:]
        channel = auth.DIRECT if ident == self.direct_client else auth.BULK if ident == self.bulk_client else None
        try:
            if not frames:
                raise ProtocolError("empty message")
            head = protocol.decode_header(frames[0])
            if channel is None:
                self._greet(ident, head, frames)
                if self.conns is not None:
                    self.conns.seen(first, ident, True)
                return
            if self.keys is not None:
                self.keys.open(frames, (channel,), head)
            if channel == auth.BULK and head.type not in (protocol.PART, protocol.PING):
                raise ProtocolError(f"a bulk connection carries PART messages, not {protocol.TYPE_NAMES[head.type]}")
            if head.type == protocol.BYE:
                protocol.decode(frames, 4096)  # a malformed BYE is an error, not a goodbye
        except ProtocolError as e:
            if channel is not None:
                self.executor.parts.lost()
            self._reply_direct(ident, protocol.ERROR, {"msg": str(e), "kind": "protocol"})
            return
        if self.conns is not None:
            self.conns.seen(first, ident, True)
        self.client_messages += 1
        self.direct_counts["direct_messages_in"] += 1
        self.direct_counts["direct_bytes_in"] += sum(map(len, frames))
        if head.type == protocol.PART:
            self._on_part(frames)
        elif head.type == protocol.READ:
            self._on_read(frames, head)
        elif head.type in (protocol.OPS, protocol.CANCEL):
            self._on_client_message(frames, head)
        elif head.type == protocol.PING:
            self._reply_direct(ident, protocol.PONG, {})
        elif head.type == protocol.BYE:
            self._close()
            self.sock.send_multipart([internal.BYE])
        else:
            self._reply_direct(ident, protocol.ERROR, {
                "msg": f"unexpected message type {protocol.TYPE_NAMES[head.type]} in a session",
                "kind": "protocol"})

    # ------------------------------------------------------------------ copies between workers
    def _on_pull(self, first: zmq.Frame, frames: list) -> None:
        """Another worker pulls a tensor this session offers (peer.py): served when offered."""
        ident = first.bytes
        try:
            p = peer.parse_pull(ident, protocol.decode(frames).body, time.monotonic())
        except ProtocolError as e:
            self._reply_direct(ident, protocol.ERROR, {"msg": str(e), "kind": "protocol"})
            return
        why = self.executor.offers.pull(p)
        if why is not None:
            self._send_peer(ident, peer.refusal(p, why))
        elif self.conns is not None:
            self.conns.seen(first, ident, True)  # (its connection stays while the pull waits)
        self._serve_pulls()

    @staticmethod
    def _is_pull(frames: list) -> bool:
        try:
            return len(frames) > 1 and protocol.decode_header(frames[1])[0] == protocol.PULL
        except ProtocolError:
            return False  # answered as any stranger's message

    def _serve_pulls(self) -> None:
        """Serve, refuse or keep alive the waiting PULLs, as their offers stand now."""
        serve, refuse, alive = self.executor.offers.due(time.monotonic())
        for p, host in serve:
            for frames in peer.answer(p, host):
                self._send_peer(p.ident, frames)
            self.executor.stats["transfer_bytes_out"] += host.nbytes
        for p, why in refuse:
            self._send_peer(p.ident, peer.refusal(p, why))
        for p in alive:
            self._send_peer(p.ident, peer.keepalive(p))

    def _send_peer(self, ident: bytes, frames: list) -> None:
        try:
            self.data.send_multipart([ident, *frames], copy=False)
        except zmq.ZMQError:  # the puller is gone; its copy fails there
            pass

    def _start_pull(self, args: Any) -> None:
        """An ``rc::receive`` arrived: ask its source for the bytes now, so that they cross while
        the executor runs the ops before it."""
        started = self.executor.receipts.start(args)
        if started is None:
            return
        r, token = started
        sock = self.peers.get(r.peer)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            for opt, v in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0),
                           (zmq.MAXMSGSIZE, self.max_frame + 64)):
                sock.setsockopt(opt, v)
            if self.curve is not None:  # (the client asks CURVE gateways for copies between their own workers only)
                curve.secure_client(sock, self.curve.keys, self.curve.keys.public)
            try:
                sock.connect(r.peer)
            except zmq.ZMQError as e:  # (an address that does not resolve): the op fails in its turn
                sock.close()
                r.error = f"cannot reach {r.peer}: {e}"
                return
            self.peers[r.peer] = sock
            self.poller.register(sock, zmq.POLLIN)
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
            self.peer_monitors[mon] = r.peer
            self.poller.register(mon, zmq.POLLIN)
        sock.send_multipart(protocol.encode(protocol.PULL, {"token": token, "rid": r.rid,
                                                            "codecs": list(protocol.CODECS)}))

    def _on_peer(self, endpoint: str, sock: zmq.Socket) -> None:
        """Messages from a source worker: the parts of our copies, their REPLYs, keep-alives."""
        for _ in range(64):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = protocol.decode(frames)
            except ProtocolError as e:
                self.executor.receipts.fail_peer(endpoint, f"a damaged message from the source: {e}")
                continue
            if msg.type == protocol.ERROR:
                self.executor.receipts.fail_peer(endpoint, f"the source refused: {msg.body.get('msg')}")
                continue
            with self._on_copy_stream():
                self.executor.receipts.on_message(msg)

    def _on_peer_monitor(self, endpoint: str, mon: zmq.Socket) -> None:
        """The connection to a source worker closed, or was refused: its process stopped or was
        killed (a worker never closes a puller's connection itself). What it was sending us is lost
        with the connection, so the copies pulled from it fail now, not after PEER_LIVENESS of
        silence (which still covers a host that vanished without closing anything)."""
        while True:
            try:
                ev = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            if ev["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):
                how = "closed" if ev["event"] == zmq.EVENT_DISCONNECTED else "was refused"
                self.executor.receipts.fail_peer(
                    endpoint, f"the connection to the gateway worker holding the source tensor ({endpoint}) "
                              f"{how}: it stopped")

    def _greet(self, ident: bytes, head: protocol.Header, frames: list) -> None:
        """A HELLO from a new connection: it becomes the session's op stream or its bulk connection
        when it names the session's token (and, with a gateway token, is sealed with the session's
        key: checked before it is read). A reconnect (new identity) with them takes over."""
        if head.type != protocol.HELLO or head.n_payloads or head.body_len > 4096:
            raise ProtocolError("this port serves one session: send HELLO with its token first")
        if self.keys is not None:
            self.keys.open(frames, (auth.DIRECT, auth.BULK), head)
        body = protocol.decode(frames, 4096).body
        token = body.get("token")
        if not (self.token and isinstance(token, bytes) and hmac.compare_digest(token, self.token)):
            raise ProtocolError("this port serves one session: send HELLO with its token first")
        bulk = bool(body.get("bulk"))
        if self.keys is not None and head.channel != (auth.BULK if bulk else auth.DIRECT):
            raise auth.AuthError("HELLO sealed for another connection")
        self.client_messages += 1
        if bulk:
            self.bulk_client = ident
            self._reply_direct(ident, protocol.WELCOME, {"bulk": True})
        else:
            self.direct_client = ident
            self._reply_direct(ident, protocol.WELCOME, {"direct": True, "fast_read": fastread.OFFER})

    def _reply_direct(self, ident: bytes, msg_type: int, body: dict) -> None:
        frames = protocol.encode(msg_type, body)
        if ident == self.direct_client:
            frames = self._seal(frames, auth.DIRECT)
        elif ident == self.bulk_client:
            frames = self._seal(frames, auth.BULK)
        self.direct_counts["direct_bytes_out"] += sum(map(len, frames))
        try:
            self.data.send_multipart([ident, *frames])
        except zmq.ZMQError:
            pass

    def _report_stats(self) -> None:
        """Tell the supervisor this session's counters (for gateway-wide status), when they change;
        at most every STATS_INTERVAL: summing the session's memory after each message cost the
        I/O thread as much as placing a large upload's part."""
        self._stats_at = time.monotonic()
        done, since = self._busy
        stats = dict(self.executor.stats, **self.direct_counts, client_messages=self.client_messages,
                     memory=self.executor.allocated_bytes(),
                     cache_entries=len(self.executor.cache.entries) if self.executor.cache else 0,
                     cache_evictions=self.executor.cache.evictions if self.executor.cache else 0,
                     parts_in=self.executor.parts.received, partial_upload_bytes=self.executor.parts.building_bytes(),
                     queued=self.backlog.queued(), queue_refused=self.backlog.refused, run_s=done,
                     busy_s=done + (time.perf_counter() - since if since is not None else 0.0))
        if self.device.type == "cuda":
            stats["device_free"], stats["device_total"] = torch.cuda.mem_get_info(self.device)
        if stats != self._last_stats and self.client is not None:
            self._last_stats = stats
            self.sock.send_multipart([internal.STATS, protocol.pack_body(stats)])

    def _on_client_message(self, frames: list, checked: protocol.Header | None = None) -> None:
        """OPS, CANCEL or PART; forwarded by the supervisor unless ``checked``, the header the
        direct path has checked already."""
        head = checked
        try:
            if head is None:
                head = self.keys.open(frames, (auth.FRONT, auth.BULK)) if self.keys is not None \
                    else protocol.decode_header(frames[0]) if frames else None
                if head is None:
                    raise ProtocolError("empty message")
                self.client_messages += 1
                if head.type == protocol.PART:
                    self._on_part(frames)
                    return
            msg = protocol.decode(frames, head=head)
        except ProtocolError as e:
            if checked is None:
                self.executor.parts.lost()
            self._queue(Rejected(str(e)))
            return
        if msg.type == protocol.CANCEL:
            upto = msg.body.get("upto")
            if isinstance(upto, int):
                self.cancel_upto = max(self.cancel_upto, upto)
            self.backlog.received += 1  # (never refused: it is how a client empties its queue)
            self.inbox.put(Cancelled(msg.body.get("rid")))
            return
        self._on_ops(msg)

    def _on_ops(self, msg: protocol.Message) -> None:
        """An OPS message (or another type, which the executor refuses in its turn), checked: admitted
        to the backlog, its payloads prepared, then run here (a short request, the executor idle) or
        queued for the executor thread."""
        ops = msg.body.get("ops") if msg.type == protocol.OPS else None
        n = len(ops) if isinstance(ops, list) else 0
        sizes = _upload_sizes(ops, len(msg.payloads)) if msg.payloads else []  # (a value read has none)
        nbytes = sum(size for size in sizes if size is not None)
        idle = self.backlog.queued() == 0  # (the executor has answered everything before this message)
        if not self._admit(n, nbytes):  # before its payloads are decompressed and placed
            return
        try:
            prepared = self._prepare(msg, sizes, nbytes)
        except ProtocolError as e:
            self.inbox.put(Rejected(str(e), n, nbytes))
            return
        except Exception as e:  # a malformed message must never take down the I/O thread
            self.inbox.put(Rejected(f"malformed OPS message ({type(e).__name__}: {e})", n, nbytes))
            return
        run = Run(msg, prepared, n, nbytes)
        if (idle and n <= INLINE_OPS and "req" in msg.body and not self.closing and not self.executor.pending
                and not _waits_on_io(ops)):
            self._run_inline(run)
        else:
            self.inbox.put(run)

    def _on_read(self, frames: list, head: protocol.Header) -> None:
        """A READ on the direct path (fastread.py), its header, MAC and sequence number checked:
        answered here with a VALUE when the session is idle and the read is a plain one; otherwise
        run as the one-op OPS request it stands for, so that it waits its turn, and its errors and
        warnings are those of the general path."""
        try:
            read = fastread.decode_read(frames, head)
        except ProtocolError as e:
            self._queue(Rejected(str(e)))
            return
        body = self._read_now(read, head.seq)
        if body is None:
            self._on_ops(protocol.Message(protocol.OPS, fastread.as_ops(read), [], head.seq))
            return
        self._forward_outbox()  # (what the executor sent before goes first)
        self._to_client(fastread.encode_value(body), copy=True)
        stats = self.executor.stats
        stats["ops"] += 1
        stats["messages"] += 1
        if read.kind == fastread.FETCH:
            stats["downloads"] += 1

    def _read_now(self, read: fastread.Read, seq: int) -> bytes | None:
        """The VALUE body answering ``read`` at once, or None where the general path must answer:
        anything queued or pending before it, a pending error or warning, a cancelled sequence
        number, a graph being captured, a tensor the read would refuse (several elements, a sparse
        or unknown one) or whose value the layout cannot carry."""
        ex = self.executor
        if (self.backlog.queued() or self.closing or ex.pending or ex.failed is not None or self.kernel_warnings
                or ex.capturing is not None or ex.spans or seq <= self.cancel_upto):
            return None
        t = ex.handles.get(read.handle)
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return None
        if read.kind == fastread.FETCH:
            return fastread.value_body(read.rid, t.detach().cpu()) if t.nbytes <= fastread.MAX_FETCH_BYTES else None
        if t.numel() != 1:
            return None
        return fastread.value_body(read.rid, t.item())

    def _run_inline(self, item: Run) -> None:
        """A short request with nothing queued before it (a value read, a sync): run here, on the
        I/O thread, sparing the hops to the executor thread and back (benchmarks/bench_sync.py).
        The executor thread is idle meanwhile: only this thread gives it work."""
        self._forward_outbox()  # (what the executor sent before goes first)
        wake, self.executor.offered = self.executor.offered, _no_wake  # (this thread serves PULLs next)
        try:
            self._run_counted(item, self._inline_out)  # (in inference mode, as all of this thread: serve)
        finally:
            self.executor.offered = wake

    def _admit(self, n: int, nbytes: int = 0) -> bool:
        """Count a message of ``n`` ops and ``nbytes`` of uploads into the session's backlog, or
        refuse it at once (backlog.py)."""
        why = self.backlog.admit(n, nbytes)
        if why is not None:
            self._to_client(protocol.encode(protocol.ERROR, {"msg": why, "kind": "limit"}))
        return why is None

    def _queue(self, item: Rejected) -> None:
        """A refusal for the executor to answer in order, within the session's backlog."""
        if self._admit(0):
            self.inbox.put(item)

    def _on_part(self, frames: list) -> None:
        """One part of a large upload: checked and copied into place here, as it arrives, while
        the executor runs earlier ops; a part's error waits for its upload op."""
        h = None
        try:
            msg = protocol.decode(frames)
            body = msg.body
            if not (type(body.get("h")) is int and type(body.get("off")) is int and len(msg.payloads) == 1):
                raise ProtocolError("malformed PART message: it needs h, off, total and one payload")
            h = body["h"]
            if body["off"] == 0 and type(body.get("total")) is int:
                self._check_quota(body["total"])
            desc, frame = msg.payloads[0]
            buf = protocol.decode_payload(desc, frame, protocol.PART_BYTES)  # (a part is at most that)
            with self._on_copy_stream():
                self.executor.parts.add(h, body["off"], body.get("total"), buf, desc[2])
        except Exception as e:  # (a part too big for memory included) never the I/O thread's end
            if h is None:
                self._queue(Rejected(str(e)))
            else:
                self.executor.parts.fail(h, e)
        finally:
            self.executor.parts.arrived()

    def _prepare(self, msg: protocol.Message, sizes: list, nbytes: int) -> dict:
        """Check and decompress payloads, and copy uploads to the device, while earlier ops run;
        return the prepared uploads (handle → ``Upload``, or the error the executor raises in order).
        Copies from other workers start here too: ``rc::receive`` sends its PULL, ``rc::offer``
        tells PULLs that come before the executor reaches it to wait (peer.py).

        Each payload's digest is checked once, here; the executor finds the verified
        digests (and so the content key) in the ``Upload`` it gets."""
        ops = msg.body.get("ops") if msg.type == protocol.OPS else None
        digests: list = []
        over: dict = {}
        if msg.payloads:
            digests, over = self._check_payloads(msg, ops, sizes, nbytes)
        prepared: dict = {}
        if msg.type != protocol.OPS:
            return prepared
        for op in ops if isinstance(ops, list) else ():  # the executor reports a malformed list
            if not (isinstance(op, list) and len(op) == 4 and isinstance(op[1], list) and len(op[1]) >= 2):
                continue
            if op[0] == "rc::receive":
                self._start_pull(op[1])
            elif op[0] == "rc::offer":
                self.executor.offers.announce(op[1][1])
            if op[0] != "rc::upload" or op[1][1] is None:
                continue  # (an upload in parts is taken by the executor from executor.parts)
            if op[1][1] in over:
                prepared[op[1][0]] = over[op[1][1]]
                continue
            try:
                with self._on_copy_stream():
                    prepared[op[1][0]] = self._finish_upload(op[1], msg, digests)
            except (ProtocolError, ValueError, TypeError, IndexError, KeyError, RuntimeError) as e:
                prepared[op[1][0]] = e  # the executor raises it in order
        return prepared

    def _check_payloads(self, msg: protocol.Message, ops: Any, sizes: list, nbytes: int) -> tuple[list, dict]:
        """Check the payloads' sizes against their uploads and the session's quota, then decompress
        them in place (those past the quota are not); return their digests and the uploads past the
        quota (payload → the error its upload raises in order)."""
        digests = [d[2] if isinstance(d, list) and len(d) == 3 else None for d, _ in msg.payloads]
        for i, (desc, _) in enumerate(msg.payloads):  # before anything is decompressed
            if sizes[i] is None:
                raise ProtocolError(f"payload {i} is not named by a well-formed rc::upload of its message")
            if isinstance(desc, list) and desc and type(desc[0]) is int \
                    and 0 <= desc[0] <= protocol.MAX_PAYLOAD_BYTES and desc[0] != sizes[i]:
                raise ProtocolError(f"payload {i} declares {desc[0]!r} bytes; its upload's dtype and shape "
                                    f"hold {sizes[i]}")
        # uploads queued ahead of this message count against the quota too; on a GPU they are
        # already on the device, in memory_allocated
        queued = self.backlog.bytes - nbytes if self.device.type != "cuda" else 0
        over = self._over_quota(ops, sizes, queued)
        msg.payloads = [None if i in over else protocol.decode_payload(d, f) for i, (d, f) in enumerate(msg.payloads)]
        return digests, over

    def _check_quota(self, n: int) -> None:
        """Refuse an upload of ``n`` bytes past the session's memory quota (torch.OutOfMemoryError),
        counting the tensors held and the uploads still arriving in parts."""
        quota = self.executor.quota
        if quota is not None:
            quota.check_upload(self.executor.allocated_bytes() + self.executor.parts.building_bytes(), n)

    def _over_quota(self, ops: Any, sizes: list, queued: int) -> dict:
        """A message's payloads that would take the session past its quota (payload → the error
        its upload raises in order), with ``queued`` bytes of uploads ahead of them, found before
        any is decompressed: those are not."""
        over: dict = {}
        quota = self.executor.quota
        if quota is None or not isinstance(ops, list):
            return over
        held = self.executor.allocated_bytes() + self.executor.parts.building_bytes() + queued
        for i, n in enumerate(sizes):
            try:
                quota.check_upload(held, n)
            except torch.OutOfMemoryError as e:
                over[i] = e
            else:
                held += n
        return over

    def _on_copy_stream(self) -> Any:
        return torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else nullcontext()

    def _finish_upload(self, args: list, msg: protocol.Message, digests: list) -> Upload:
        _h, idx, dtype, shape, _key = args
        part, digest = msg.payloads[idx], digests[idx]
        flat = Assembly(part.nbytes, self.device)
        flat.add(0, part)
        t = flat.finish(dtype, shape)
        ready = None
        if self.copy_stream is not None:
            t.record_stream(torch.cuda.current_stream(self.device))
            ready = self.copy_stream.record_event()
        return Upload(t, ready, [digest], [part])

    # ------------------------------------------------------------------ executor thread
    def _execute_loop(self) -> None:
        """Runs every op of the session. In inference mode: the client's autograd records the
        graph and sends the backward as plain ops, so nothing here needs one, and skipping the
        autograd layers of the dispatcher cuts the gateway's cost per op by ~20%."""
        out = self.ctx.socket(zmq.PUSH)
        out.connect(f"inproc://out-{id(self)}")
        self.executor.offered = lambda: out.send(internal.OFFERED)  # wakes the I/O thread to serve PULLs
        try:
            with torch.inference_mode():
                self._serve_inbox(out)
        finally:
            out.send_multipart([internal.DONE])
            out.close(linger=1000)

    def _serve_inbox(self, out: zmq.Socket) -> None:
        while True:
            item: InboxItem = self.inbox.get()
            if item is None:
                break
            if self.closing:  # BYE or CLOSE: what was queued before it is dropped
                self.backlog.ran(item.ops, item.nbytes)
                continue
            if type(item) is Run:
                self._run_counted(item, out)
                continue
            if type(item) is Rejected:
                out.send_multipart(protocol.encode(protocol.ERROR, {"msg": item.why, "kind": "protocol"}))
            else:
                self.executor.failed = None  # the interrupt was the user's answer to it
                out.send_multipart(protocol.encode(protocol.REPLY, {"rid": item.rid, "res": None,
                                                                     "err": None, "cancelled": True}))
            # counted run once its answer is in the outbox: a request the I/O thread then finds
            # idle (_run_inline) forwards the outbox first, so its reply comes after this answer
            self.backlog.ran(item.ops, item.nbytes)

    def _run_counted(self, item: Run, out: Any) -> None:
        """Run one message, counting its time for the load the I/O thread reports, and its ops out
        of the backlog once its replies are sent."""
        done = self._busy[0]
        start = time.perf_counter()
        self._busy = (done, start)
        try:
            self._run_message(item, out)
        finally:
            self._busy = (done + time.perf_counter() - start, None)
            self.backlog.ran(item.ops, item.nbytes)

    def _run_message(self, item: Run, out: zmq.Socket) -> None:
        msg = item.msg
        if msg.type != protocol.OPS:
            out.send_multipart(protocol.encode(protocol.ERROR, {
                "msg": f"unexpected message type {protocol.TYPE_NAMES[msg.type]} in a session",
                "kind": "protocol"}))
            return
        seq = msg.seq
        cancelled = lambda: seq <= self.cancel_upto or self.closing  # noqa: E731 - read by the executor between ops
        try:
            result, err, payloads = within(lambda: self.executor.run(msg.body, cancelled, item.prepared))
        except ProtocolError as e:
            self.executor.failed = None
            out.send_multipart(protocol.encode(protocol.ERROR, {"msg": str(e), "kind": "protocol"}))
            return
        except Exception as e:  # a bad message must cost an error reply, never the session
            self.executor.failed = None
            out.send_multipart(protocol.encode(protocol.ERROR, {
                "msg": f"malformed OPS message ({type(e).__name__}: {e})", "kind": "protocol"}))
            return
        rid = msg.body.get("req")
        if rid is not None and not cancelled():
            for index, total, parts in self.executor.out_parts:  # large downloads: PARTs, then the reply
                for i, payload in enumerate(parts):
                    out.send_multipart(protocol.encode(protocol.PART, {
                        "rid": rid, "i": index, "off": i * protocol.PART_BYTES, "total": total}, [payload]),
                        copy=False)
            self.executor.out_parts = []
            reply = {"rid": rid, "res": result, "err": err}
            if self.executor.spans:  # the session traces its ops (docs/PROTOCOL.md, "Traces")
                reply["spans"] = self.executor.take_spans()
            if self.kernel_warnings:  # (kernel_warnings.py)
                reply["warn"] = self.kernel_warnings.take()
            try:
                frames = protocol.encode(protocol.REPLY, reply, payloads)
            except Exception as e:  # e.g. a result msgpack cannot carry
                frames = protocol.encode(protocol.ERROR, {
                    "msg": f"cannot encode the reply to request {rid!r}: {e}", "kind": "protocol"})
            out.send_multipart(frames, copy=False)


def _upload_sizes(ops: Any, n: int) -> list[int | None]:
    """For each of a message's n payloads, the bytes its ``rc::upload`` says it holds (dtype ×
    shape), checked against what the payload declares before it is decompressed; None for a
    payload no well-formed upload names, which is refused."""
    sizes: list[int | None] = [None] * n
    for op in ops if isinstance(ops, list) else ():
        if not (isinstance(op, list) and len(op) == 4 and op[0] == "rc::upload" and isinstance(op[1], list)
                and len(op[1]) >= 4):
            continue
        _h, idx, dtype, shape = op[1][:4]
        if type(idx) is int and 0 <= idx < n and isinstance(dtype, torch.dtype) and isinstance(shape, list) \
                and all(type(d) is int and d >= 0 for d in shape):
            numel = 1
            for d in shape:
                numel *= d
            sizes[idx] = numel * dtype.itemsize
    return sizes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="RemoteCUDA session worker (started by the gateway)")
    p.add_argument("--backend", required=True)
    p.add_argument("--ident", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--host", default="", help="bind a data port on this address for the direct path")
    p.add_argument("--max-frame", type=int, default=protocol.MAX_BODY_BYTES + 64)
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds a data-port connection that serves no session may stay")
    p.add_argument("--parent", type=int, help="the gateway's pid: a worker must not outlive it")
    p.add_argument("--account-fd", type=int, default=-1,
                   help="a simulated GPU's memory account, an inherited file descriptor (memory_account.py)")
    p.add_argument("--slot", type=int, default=0, help="this worker's slot in the account")
    p.add_argument("--session-memory", type=int, default=None, help="the session's memory quota, in bytes")
    p.add_argument("--max-queued", type=int, default=backlog.DEFAULT, help="the session's bound on ops queued, not run")
    p.add_argument("--curve-secret", default=None, help="the gateway's CURVE key pair file (with --curve-clients)")
    p.add_argument("--curve-clients", default=None, help="the directory of client public keys the data port admits")
    p.add_argument("--gpu", default="{}", help="the simulated GPU's description (JSON: index, name, total_memory)")
    a = p.parse_args(argv)
    die_with_parent()
    privileges.drop()
    if a.parent is not None and os.getppid() != a.parent:  # it ended while we imported torch
        os._exit(0)
    # the I/O thread must get the GIL soon while the executor thread runs Python op after op:
    # a part or a CANCEL waiting out the default 5 ms would stall the transfer it overlaps
    sys.setswitchinterval(0.0005)
    account = None
    if a.account_fd >= 0:
        gpu = json.loads(a.gpu)
        account = MemoryAccount(a.account_fd, gpu["total_memory"], gpu["index"], gpu["name"], a.slot)
    torch.sparse.check_sparse_tensor_invariants.enable()  # a client's sparse tensors are checked as they are made
    worker = Worker(a.backend, a.ident.encode(), a.device, a.host, a.max_frame, account, a.idle_timeout,
                    a.session_memory, a.max_queued, (a.curve_secret, a.curve_clients) if a.curve_secret else None)
    worker.kernel_warnings.install()
    worker.serve()
    os._exit(0)


if __name__ == "__main__":
    main()

