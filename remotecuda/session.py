"""A session: one virtual CUDA device's op stream to one GPU of one gateway.

Ops are queued and sent in batches without waiting; output handles are chosen here,
so creating a tensor never needs a reply. The session blocks only in ``request``:
when a value is needed on the client, when an output's shape depends on data, or at
an explicit synchronize. An error in an asynchronous op comes back with the reply to
the next request and is raised there, as CUDA does.
"""
from __future__ import annotations

import _signal  # signal's functions without its enum conversions: ~12 µs less per send
import itertools
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import zmq
from zmq.backend import zmq_poll
from zmq.utils.monitor import recv_monitor_message

from remotecuda_wire import auth, cache, curve, fastread, protocol
from remotecuda_wire import frames as wire
from remotecuda_wire.admin import read_admin_token
from remotecuda_wire.compression import LinkModel
from remotecuda_wire.protocol import ProtocolError

from . import remote_warnings
from .errors import (
    GatewayAuthError,
    GatewayDownError,
    GatewayLostError,
    GatewayProtocolError,
    GatewayUnavailableError,
    TransferError,
    remote_exception,
)
from .progress import Progress
from .replay_log import UPLOAD_OPS, ReplayLog, Snapshot
from .scheduler import SessionProfile

#: flush when this many ops are queued
BATCH_OPS = 256
#: flush when this many payload bytes are queued; uploads this large go out at once, on the bulk connection
BATCH_BYTES = 1 << 20
#: uploads travel on the bulk connection in parts of this size, so the gateway's work overlaps the transfer
#: flush ops that have waited this long (seconds), so the GPU is not kept idle
BATCH_WINDOW = 0.002
#: how many ops the client may have sent ahead of what its gateway has run, about a GPU's launch
#: queue: past it, issuing the next op waits for the gateway to catch up, as a launch waits on a
#: full queue. Without it a loop that never reads a value ran ever further ahead: an interrupted
#: cell left all that work running (the next read waited for it), and past the gateway's bound
#: (``--max-queued``) a message was refused
RUN_AHEAD = 8192
PING_EVERY = 2.0
#: a gateway that answers nothing (not even a ping) for this long while a request waits is gone; the
#: pool's heartbeats (liveness.py) find a silent gateway sooner (DOWN_AFTER) and wake the wait
LIVENESS = 20.0
#: with no connection to the gateway at all, a send gives up after this long
SEND_TIMEOUT = 5.0
#: how long a new session tries the direct path before it settles for the forwarded one
DIRECT_TIMEOUT = 1.5
#: how long a value read's answer is waited for with interrupts held (Session._read_round_trip):
#: a Ctrl-C meanwhile is raised at most this late
READ_POLL_MS = 100

#: an op that does nothing, in the place of one a replay must skip (message positions stay as logged)
NOOP: list = ["rc::event_free", [], None, None]
#: handles a snapshot reserves for the storages it downloads: the most storages one may hold
SNAPSHOT_STORAGES = 1 << 20
#: a snapshot downloads at most this many bytes per request (as ``remotecuda.fetch`` does)
FETCH_BYTES = 256 << 20

STAT_KEYS = ("ops", "messages", "bytes_up", "bytes_down", "blocking_round_trips", "uploads",
             "downloads", "cache_hits", "cache_misses", "cache_bytes_saved", "compressed_bytes_saved",
             "fast_reads", "wait_seconds")  # wait_seconds: wall time spent blocked in request()
#: (fast_reads: the blocking round trips that were value reads answered by a VALUE, fastread.py)

#: places a session not placed yet (the pool's): (the session, what it shows at its first need,
#: why it needs its device now) → the gateway endpoint and its GPU index
Locate = Callable[["Session", SessionProfile, str], tuple[str, int]]
#: moves a session whose gateway or worker failed to another GPU (failover.py's ``Failover.recover``):
#: (the session, what failed) → None once it runs there, or raises GatewayUnavailableError
Recover = Callable[["Session", BaseException], None]


class Session:
    #: why the gateway is gone, once liveness.py found it down or restarted (``mark_lost``)
    lost: str | None = None
    #: said with "this remotecuda session is closed" once ``close`` ended it
    closed_why = ""
    #: whether the session's worker answers READ (fastread.py): offered on the direct path only
    fast_read = False

    def __init__(self, ctx: zmq.Context, endpoint: str | None, gpu: int | None, vdev: int,
                 connect_timeout: float = 5.0, sync: bool = False,
                 cache_bytes: int = cache.DEFAULT_BYTES, cache_policy: str = "lru",
                 codecs: Sequence[str] = protocol.CODECS, wake: Any = None,
                 locate: Locate | None = None):
        """``endpoint`` and ``gpu``: where the session goes, greeted now. None (with ``locate``): not
        placed yet; ops queue here, and at the session's first need (a value read, an upload, a
        full batch; see ``open``) ``locate`` places it, knowing what it queued and why."""
        self.endpoint, self.gpu, self.vdev, self.sync = endpoint or "", gpu, vdev, sync
        self.wake = wake  # tells the background flusher that ops are waiting
        #: the runtime's trace.Tracer while it records (trace.py): told of each op, message, transfer
        #: and wait; None otherwise, and then each hook costs one attribute check (an instance's: fast)
        self.trace: Any = None
        self.lock = threading.RLock()
        self.ctx, self.connect_timeout, self.locate = ctx, connect_timeout, locate
        self.want_cache = {"bytes": cache_bytes, "policy": cache_policy}
        #: the codecs this session offers: what downloads may come in
        self.offered = tuple(codecs)
        #: the worker's data port, when this client reaches it: where another worker pulls copies from
        self.data_endpoint: str | None = None
        #: the session's keys when the gateway authenticates (a token): every message sealed
        self.peer: auth.Peer | None = None
        self._channels: dict[zmq.Socket, tuple[int, frozenset]] = {}  # socket → (its channel, channels it receives)
        self.link = LinkModel()
        self._handles = itertools.count(1)
        self._ops: list = []
        self._payloads: list = []
        self._pending_bytes = 0
        self._first_pending = 0.0
        self._release: list[tuple[int, int]] = []  # (ops queued before it, handle)
        self._forgotten: list[tuple[str, int]] = []  # (free op, id) of objects dropped: sent with the next flush
        self._inflight: list = []  # (tracker, tensor): zero-copy uploads zmq has not sent yet
        self._seq = 0  # the last sequence number sent
        self._parts_sent = 0  # PART messages so far: an upload's op names how many precede it
        self._rid = 0
        #: request id → its reply's body, once come (None until then): the ``request_later`` ones
        self._later: dict[int, dict | None] = {}
        #: requests an interrupt stopped waiting for (their replies kept in ``_later``): the error
        #: a reply carries is reported once, so it is raised at the next wait, not dropped
        self._abandoned: set[int] = set()
        #: the pacing marker (RUN_AHEAD): a ``request_later`` sent when ``_pace_at`` ops had been sent
        self._pace_rid: int | None = None
        self._pace_at = 0
        #: whether every OPS message sent has been answered by an error-free reply since (the
        #: gateway then has nothing of ours left to run): a sync needs no round trip
        self._settled = True
        self._loss_told = False  # see ``loss_told``
        #: sessions a copy queued here pulls from (transfer.py), until a reply: one whose gateway is
        #: found down ends a wait at once, as its copy cannot come (a failover moves the source, not its offer)
        self.sources: list[Session] = []
        self._op_index = 0
        self._last_send = time.monotonic()
        self._stats: dict[str, float] = dict.fromkeys(STAT_KEYS, 0)  # counts, and wait_seconds (counters())
        self.closed = False
        #: whether the session is greeted and connected (else it is not placed yet, see ``open``)
        self.connected = False
        #: the op stream since the last snapshot, and who moves the session when its gateway fails
        #: (both set by the pool unless REMOTECUDA_FAILOVER=off; failover.py)
        self.log: ReplayLog | None = None
        self.failover: Recover | None = None
        #: while a snapshot is taken or the log replayed: nothing sent is logged, no failover nests
        self.unlogged = False
        self._snapshotting = False
        if endpoint is not None and gpu is not None:
            self._connect(endpoint, gpu)
        elif locate is None:
            raise ValueError("Session: an endpoint and GPU, or locate")

    def _connect(self, endpoint: str, gpu: int) -> None:
        """Greet the gateway's GPU ``gpu`` (HELLO → WELCOME) and open the op stream's connections."""
        ctx = self.ctx
        self.endpoint, self.gpu = endpoint, gpu
        self.front = connect(ctx, endpoint)  # the gateway's port: placement, and word of a lost worker
        try:
            self.info, self.peer = handshake(self.front, {"device": gpu, "cache": self.want_cache,
                                                          "codecs": list(self.offered)}, self.connect_timeout, endpoint)
        except BaseException:
            self.front.close(linger=0)
            raise
        self._channels = {self.front: (auth.FRONT, _FROM_GATEWAY[auth.FRONT])}
        #: the codecs uploads may use: ours that the gateway decodes
        self.codecs = protocol.common_codecs(self.info.get("codecs"), self.offered)
        self.direct_failure: str | None = None
        self.bulk_failure: str | None = None
        self.fast_read = False
        self.sock, self.bulk = self._open_connections(ctx)  # the op stream's, and large transfers'
        if self.peer is not None:
            self._seq = self.peer.seq  # (the greetings used the first numbers)
        self._poller = zmq.Poller()
        for sock in {self.sock, self.front, self.bulk}:
            self._poller.register(sock, zmq.POLLIN)
        granted = self.info.get("cache") or {}
        self.cache = (cache.CacheMirror(granted["bytes"], granted["policy"])
                      if granted.get("bytes") else None)  # the mirror of the gateway's
        self._last_send = time.monotonic()
        self.connected = True

    def open(self, why: str = "open", upload: torch.Tensor | None = None) -> None:
        """Place and greet a session not placed yet, now that it needs its device: ``why`` says
        what for ("rc::fetch" and other requests are value reads; "upload" with ``upload``, the
        tensor; "flush", "synchronize"). Called under the lock, at the first flush, upload or
        request; a failure (no GPU, the gateway refused) leaves it unplaced, to try again."""
        if self.connected or self.closed:
            return
        assert self.locate is not None
        endpoint, gpu = self.locate(self, self.first_need(why, upload), why)
        self._connect(endpoint, gpu)

    def first_need(self, why: str, upload: torch.Tensor | None = None) -> SessionProfile:
        """What this unplaced session shows of itself at its first need: the ops queued, a sync
        when it needs a value (any request but the pool's own synchronize), the dtypes its ops
        name (``dtype=`` of factories and casts) and the tensor it uploads."""
        dtypes = {str(a) for op in self._ops for a in (*op[1], *(op[2] or {}).values())
                  if isinstance(a, torch.dtype)}
        nbytes = 0
        if upload is not None:
            dtypes.add(str(upload.dtype))
            nbytes = upload.nelement() * upload.element_size()
        syncs = 0 if why in ("upload", "flush", "synchronize", "properties") else 1
        return SessionProfile(allocated_bytes=nbytes, ops=len(self._ops), syncs=syncs, dtypes=frozenset(dtypes))

    def counters(self, reset: bool = False, wait: bool = True) -> dict[str, float]:
        """This session's counters (STAT_KEYS), "ops" counting the ops still queued too.

        ``reset``: count from zero again (ops queued now are not counted again when they are
        sent). ``wait=False``: read without the session's lock, for a status asked from another
        thread while this one is blocked in a request (exact but for an op being queued).
        """
        if not wait:
            if reset:
                raise ValueError("Session.counters: reset needs the lock (wait=True)")
            out = dict(self._stats)
            out["ops"] += self.queued
            return out
        with self.lock:
            out = dict(self._stats)
            pending = len(self._ops)
            out["ops"] += pending
            if reset:
                self._stats = dict.fromkeys(STAT_KEYS, 0)
                self._stats["ops"] = -pending
            return out

    @property
    def queued(self) -> int:
        """How many ops are queued, not sent yet (read without the lock)."""
        return len(self._ops)

    @property
    def unfinished(self) -> bool:
        """Whether work was queued or sent that no reply has answered yet (read without the lock):
        what the interpreter's exit waits for (``Pool.finish``)."""
        if self._loss_told and self.failover is None:
            return False  # (the program heard of the loss already, perhaps before liveness.py did)
        return bool(self._ops) or not self._settled or bool(self._abandoned)

    @property
    def direct(self) -> bool:
        """Whether the op stream goes straight to the session's worker (else through the gateway's port)."""
        return self.connected and self.sock is not self.front

    def _open_connections(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
        """The op stream's socket and the bulk one, greeted together (one round trip, not two).

        The op stream goes to the session worker's own data port when this client can reach it:
        tensor bytes then cross one socket, not two. Behind a tunnel or firewall that passes only
        the gateway's port that HELLO goes unanswered, and the session stays on the forwarded
        path. Large transfers get a second connection on the same path: TCP delivers a
        connection's bytes in order, so on one connection an op issued after a prefetched batch
        would wait for the whole batch to cross the link. Without it (a gateway that does not
        offer one), parts go on the op stream."""
        offer, token = self.info.get("direct"), self.info.get("token")
        if not isinstance(token, bytes):
            token = None
        if isinstance(offer, dict) and os.environ.get("REMOTECUDA_DIRECT", "1") != "0":
            endpoint = f"{self.endpoint.rsplit(':', 1)[0]}:{offer.get('port')}"
            greetings = [(self._open(ctx, endpoint, auth.DIRECT), {"token": offer.get("token")})]
            if token is not None:
                greetings.append((self._open(ctx, endpoint, auth.BULK), {"token": token, "bulk": True}))
            answers = greet(greetings, DIRECT_TIMEOUT, endpoint, self._sealer, self._opener)
            if isinstance(answers[0], protocol.Message):
                self.data_endpoint = endpoint
                self.fast_read = answers[0].body.get("fast_read") == fastread.OFFER
                bulk = self._bulk_or_none(greetings[-1][0], answers[-1]) if token is not None else None
                return greetings[0][0], bulk or greetings[0][0]
            self.direct_failure = str(answers[0])  # why this session took the forwarded path
            for sock, _ in greetings:
                self._forget(sock)
        if token is None:
            return self.front, self.front
        sock = self._open(ctx, self.endpoint, auth.BULK, via_supervisor=True)
        answer = greet([(sock, {"token": token, "bulk": True})], DIRECT_TIMEOUT, self.endpoint,
                       self._sealer, self._opener)[0]
        return self.front, self._bulk_or_none(sock, answer) or self.front

    def _open(self, ctx: zmq.Context, endpoint: str, channel: int, via_supervisor: bool = False) -> zmq.Socket:
        """A further connection of the session: to the worker's data port (a fixed routing id, so a
        reconnect keeps it), or for the bulk connection on the gateway's port."""
        sock = connect(ctx, endpoint, routing_id=None if via_supervisor else os.urandom(16), server=self.endpoint)
        self._channels[sock] = (channel, frozenset({channel | (auth.SUPERVISOR if via_supervisor else auth.WORKER)}))
        return sock

    def _forget(self, sock: zmq.Socket) -> None:
        self._channels.pop(sock, None)
        sock.close(linger=0)

    def _bulk_or_none(self, sock: zmq.Socket, answer: protocol.Message | Exception) -> zmq.Socket | None:
        if isinstance(answer, protocol.Message):
            return sock
        self.bulk_failure = str(answer)
        self._forget(sock)
        return None

    def _sealer(self, frames: list, sock: zmq.Socket) -> list:
        """Frames as they go out on ``sock``: sealed, with the session's next sequence number,
        when the session is authenticated (callers hold the lock, or are the constructor)."""
        if self.peer is None:
            return frames
        self.peer.seq += 1
        return self.peer.seal(frames, self._channels[sock][0], self.peer.seq)

    def _opener(self, frames: list, sock: zmq.Socket) -> None:
        """Check a received message's MAC and sequence number (authenticated sessions only)."""
        if self.peer is not None:
            self.peer.open(frames, self._channels[sock][1])

    # ------------------------------------------------------------------ hot path
    def new_handle(self) -> int:
        return next(self._handles)

    def enqueue(self, name: str, args: list, kwargs: dict | None, outs: list | None) -> None:
        with self.lock:
            if not self._ops:
                self._first_pending = time.monotonic()
                if self.wake is not None:
                    self.wake()
                if self._op_index - self._pace_at >= RUN_AHEAD and not self.sync:  # (once a batch)
                    self._keep_pace()
            self._ops.append([name, args, kwargs, outs])
            if self.trace is not None:
                self.trace.issued(self, name)
            if self.sync:
                self.request("rc::sync", [])
            elif len(self._ops) >= BATCH_OPS:
                self.flush()

    def _keep_pace(self) -> None:
        """RUN_AHEAD more ops were sent: wait until the gateway has run those sent before the last
        marker (its reply), and send a new one. At most about two RUN_AHEADs are ever ahead."""
        rid, self._pace_rid = self._pace_rid, None
        if rid in self._abandoned and self._later.get(rid) is None and self.lost is None and not self.closed:
            body = self._wait(rid)[0].body
            self._abandoned.discard(rid)
            self._later.pop(rid, None)
            if body.get("err"):  # (the gateway reports a failure once, in its next reply: this one)
                raise remote_exception(body["err"])
            if body.get("warn"):
                remote_warnings.raise_again(body["warn"])
        self._abandoned_errors()  # (its reply came during another wait)
        self._pace_at = self._op_index
        self._pace_rid = self.request_later("rc::sync", [])
        if self._pace_rid is not None:  # its reply is taken, and its error raised, at whichever wait meets it
            self._abandoned.add(self._pace_rid)

    def reserve(self, n: int) -> int:
        """A block of n handles for outputs the gateway will describe; returns the first."""
        with self.lock:
            base = next(self._handles)
            self._handles = itertools.count(base + n)
            return base

    def release(self, handle: int) -> None:
        """Called from finalizers on any thread: only an atomic append here. It records how many
        ops were queued then: the gateway frees the tensor right after them, not at the end of
        the message, so a batch of several steps peaks at the memory of one, as it would locally."""
        self._release.append((len(self._ops), handle))

    def drop_object(self, free_op: str, oid: int) -> None:
        """A gateway object dropped (a generator, event, graph or compiled program): its finalizer
        calls this, on any thread, maybe while this very thread is inside ``flush`` with the lock
        held (a garbage collection runs finalizers wherever it starts). So only an atomic append
        here, as in ``release``: queueing ``free_op`` then would put an op into a message half sent
        and count it as sent. The next message frees it, after every op queued before."""
        self._forgotten.append((free_op, oid))

    def upload(self, t: torch.Tensor, non_blocking: bool = False, handle: int | None = None) -> int:
        """Queue a CPU tensor's bytes for the gateway; return its handle.

        A payload the gateway's content cache already holds is sent as its key only.
        Large payloads go out at once, straight from the tensor's memory (zero-copy), in
        parts of protocol.PART_BYTES, each its own message: the gateway checks and places part k
        while part k+1 is on the wire. A blocking upload then waits until ZeroMQ has let
        go of that memory, as a synchronous host-to-device copy would. ``handle``: upload
        under this one (a replay, failover.py), not a new one.
        """
        h = self.new_handle() if handle is None else handle
        t = t.detach()
        buf = protocol.tensor_bytes(t)
        n = buf.nbytes
        dtype, shape = t.dtype, list(t.shape)
        with self.lock:
            self.open("upload", t)
            if not self._ops:
                self._first_pending = time.monotonic()
                if self.wake is not None:
                    self.wake()
            if self.lost is not None and self._may_recover():
                self._recover(GatewayDownError(self.lost))
            self._stats["uploads"] += 1
            mirror = self.cache if n >= cache.MIN_BYTES else None
            digests = [protocol.payload_digest(buf[:protocol.PART_BYTES])]
            if self.log is not None and not self.unlogged:  # a replay sends these bytes again
                if n > protocol.PART_BYTES:
                    digests = cache.part_digests(buf, protocol.PART_BYTES)
                self.log.upload(h, cache.content_key(digests), buf, dtype, shape)
            if mirror is not None and (n <= protocol.PART_BYTES or mirror.may_hold((n, digests[0]))):
                if n > protocol.PART_BYTES and len(digests) == 1:  # it may be cached: hash it all before deciding
                    digests = cache.part_digests(buf, protocol.PART_BYTES)
                key = cache.content_key(digests)
                if mirror.get(key) is not None:
                    self._stats["cache_hits"] += 1
                    self._stats["cache_bytes_saved"] += n
                    self._ops.append(["rc::upload_cached", [h, key, dtype, shape], None, None])
                    if self.trace is not None:
                        self.trace.transfer(self, "upload", n, 0, time.monotonic(), cached=True)
                    if self.sync:
                        self.request("rc::sync", [])
                    return h
            send = self._send_whole if n < BATCH_BYTES else self._send_parts
            try:
                send(h, buf, digests, self.link.choose(buf, self.codecs), dtype, shape, mirror, non_blocking, t)
            except GatewayLostError as e:
                if not self._may_recover():
                    raise
                queued = any(op[0] == "rc::upload" and op[1][0] == h for op in self._ops)
                self._ops = [op for op in self._ops if not (op[0] == "rc::upload_abandon" and op[1][0] == h)]
                self._recover(e)  # replays the queued ops, this upload among them if it was queued
                if not queued:
                    self.upload(t, non_blocking, handle=h)
        return h

    def _enter(self, mirror: cache.CacheMirror | None, digests: list, n: int) -> bytes | None:
        """Count a payload into the cache mirror (as the gateway will at its upload op); its key."""
        if mirror is None:
            return None
        key = cache.content_key(digests)
        mirror.put(key, (n, digests[0]), n)
        self._stats["cache_misses"] += 1
        return key

    def _send_whole(self, h: int, buf: memoryview, digests: list, codec: str | None, dtype: torch.dtype,
                    shape: list, mirror: cache.CacheMirror | None, non_blocking: bool, t: torch.Tensor) -> None:
        """A small payload: it waits in the batch, as a copy (the caller may overwrite the tensor
        as soon as we return)."""
        n = buf.nbytes
        desc, frame = protocol.encode_payload(buf, codec, digests[0])
        if frame is buf:
            frame = bytes(buf)
        sent = _size(frame)
        key = self._enter(mirror, digests, n)
        self._ops.append(["rc::upload", [h, len(self._payloads), dtype, shape, key], None, None])
        self._payloads.append((desc, frame))
        self._pending_bytes += sent
        self._stats["compressed_bytes_saved"] += n - sent
        if self.trace is not None:
            self.trace.transfer(self, "upload", n, sent, time.monotonic())
        if self.unlogged:  # (a replay keeps each logged message whole)
            return
        if self._pending_bytes >= BATCH_BYTES:
            self.flush()
        elif self.sync:
            self.request("rc::sync", [])

    def _send_parts(self, h: int, buf: memoryview, digests: list, codec: str | None, dtype: torch.dtype,
                    shape: list, mirror: cache.CacheMirror | None, non_blocking: bool, t: torch.Tensor) -> None:
        """A large payload: each part a PART message on the bulk connection, straight from the
        tensor's memory, hashed just before it goes if that is not done yet. The upload op
        joins the queued ops, naming how many PARTs precede it."""
        n, t0, sent, trackers, first = buf.nbytes, time.perf_counter(), 0, [], self._parts_sent
        began = time.monotonic()
        try:
            for i in range(-(-n // protocol.PART_BYTES)):
                part = buf[i * protocol.PART_BYTES:(i + 1) * protocol.PART_BYTES]
                if i == len(digests):
                    digests.append(protocol.payload_digest(part))
                desc, frame = protocol.encode_payload(part, codec, digests[i])
                self._seq += 1
                frames = self._seal(protocol.encode(protocol.PART, {"h": h, "off": i * protocol.PART_BYTES,
                                                                    "total": n}, [(desc, frame)], self._seq), self.bulk)
                with HeldInterrupts():  # a part handed to ZeroMQ is counted
                    trackers.append((self._send_frames(self.bulk, frames, track=frame is part), part.nbytes))
                    self._parts_sent += 1
                sent += _size(frame)
                self._stats["messages"] += 1
                self._stats["bytes_up"] += sum(_size(f) for f in frames)
                if self.trace is not None:
                    self.trace.message(self, "PART", sum(_size(f) for f in frames))
        except BaseException:  # (an interrupt): the worker drops the parts sent, when they are in
            if self._parts_sent > first:
                self._ops.append(["rc::upload_abandon", [h, self._parts_sent], None, None])
            raise
        key = self._enter(mirror, digests, n)
        self._ops.append(["rc::upload", [h, None, dtype, shape, key, self._parts_sent], None, None])
        self._stats["compressed_bytes_saved"] += n - sent
        try:
            self._settle(trackers, n, sent, t0, non_blocking, t)
        except BaseException as e:  # interrupted while ZeroMQ sent: no tensor will ever hold h
            if not (isinstance(e, GatewayLostError) and self._may_recover()):  # (a failover replays it: it will)
                self.release(h)
            raise
        if self.trace is not None:
            self.trace.transfer(self, "upload", n, sent, began, parts=len(trackers))
        if self.sync:
            self.request("rc::sync", [])

    def _settle(self, parts: list, n: int, sent: int, t0: float, non_blocking: bool, t: torch.Tensor) -> None:
        """Hold a zero-copy upload's source until ZeroMQ is done with it: the caller's return
        (blocking copy) or the tensor's life (non_blocking, as with pinned memory and CUDA).
        ``parts``: (tracker, or None for a part sent as a copy; its bytes). A blocking upload that
        takes long shows its progress (progress.py)."""
        trackers = [tr for tr, _ in parts if tr is not None]
        if non_blocking:
            self._inflight.extend((tr, t) for tr in trackers)
            return
        progress = Progress("upload", n)
        try:
            for tr, size in parts:
                while tr is not None and not tr.done:  # (a gateway that stops reading never lets go: liveness)
                    if self.lost is not None:
                        raise self._loss_error()
                    try:
                        tr.wait(0.1)
                    except zmq.NotDone:
                        pass
                    progress.update(0)
                progress.update(size)
        finally:
            progress.close()
        if trackers:
            self.link.observe(sent, time.perf_counter() - t0)

    # ------------------------------------------------------------------ sending
    def flush(self, req: int | None = None) -> None:
        with self.lock:
            if not self._ops and not self._release and req is None:
                return
            if not self.connected:
                self.open("flush")
                if not self.connected:
                    raise GatewayLostError(f"this remotecuda session is closed{self.closed_why}")
            if self._forgotten:  # (after every op queued before they were dropped)
                by_op: dict[str, list[int]] = {}
                for free_op, oid in _take(self._forgotten):
                    by_op.setdefault(free_op, []).append(oid)
                self._ops.extend([free_op, ids, None, None] for free_op, ids in by_op.items())
            if self.lost is not None and self._may_recover():  # the queued ops go with the replay
                self._recover(GatewayDownError(self.lost), req)
                return
            body: dict = {"ops": self._ops, "n0": self._op_index}
            if self._release:
                rel = _take(self._release)
                body["rel"] = [h for _, h in rel]
                body["rel_at"] = [n for n, _ in rel]
            if req is not None:
                body["req"] = req
            if self.trace is not None:
                body["trace"] = True  # the gateway times each op (docs/PROTOCOL.md, "Traces")
                self.trace.sending(self, body)
            try:
                with HeldInterrupts():  # the queue is cleared and sent as one step
                    frames = self._encoded(body)
                    self._seq += 1  # (after the encoding: one that raises sends nothing, skips no number)
                    frames = self._seal(frames, self.sock)
                    self._settled = False
                    try:  # sent first, the books after: a value read waits for no bookkeeping
                        self._send_frames(self.sock, frames)
                    finally:  # (sent or not: a lost gateway's replay sends it from the log)
                        if self.log is not None and not self.unlogged:
                            self.log.record(frames[1], self._ops, req is not None)
                        self._op_index += len(self._ops)
                        self._stats["ops"] += len(self._ops)
                        self._stats["messages"] += 1
                        self._stats["bytes_up"] += sum(map(_size, frames))
                        self._ops, self._payloads, self._pending_bytes = [], [], 0
                        self._last_send = time.monotonic()
                        if self._inflight:
                            self._inflight = [(tr, t) for tr, t in self._inflight if not tr.done]
            except GatewayLostError as e:
                if not self._may_recover():
                    raise
                self._recover(e)  # (the message is logged: the replay sends it)
                return
            if self.trace is not None:
                self.trace.message(self, "OPS", sum(_size(f) for f in frames))
            if req is None:
                self._maybe_snapshot()

    def _encoded(self, body: dict) -> list:
        """The frames of an OPS message. Should an op hold an argument the wire cannot carry (a
        numpy scalar a module passed on, an int over 64 bits), that op alone is refused: kept in
        the queue it would fail every later flush, breaking the program for good."""
        try:
            return protocol.encode(protocol.OPS, body, self._payloads, self._seq + 1)
        except protocol.UNSENDABLE:
            self._ops[:] = [_sendable(op) for op in self._ops]
            return protocol.encode(protocol.OPS, body, self._payloads, self._seq + 1)

    def _send_frames(self, sock: zmq.Socket, frames: list, track: bool = False, copy: bool = False) -> Any:
        """Send without copying (``copy``: a small message, cheaper copied); the MessageTracker
        when ``track``. A send that waited out SEND_TIMEOUT means the gateway is gone."""
        if self.lost is not None:  # nothing more goes to a gateway found down
            raise self._loss_error()
        try:  # (callers hold interrupts: half a message must never stay queued)
            return wire.send(sock, frames, copy=copy, track=track)
        except zmq.Again:
            self.closed = True
            raise GatewayLostError(f"gateway {self.endpoint} is not connected "
                                   f"(a send waited {SEND_TIMEOUT:.0f} s)") from None

    def maybe_flush(self, now: float) -> bool:
        """Called by the pool's background thread: flush old ops, keep the session alive.

        Returns True when ops are still waiting (the session was busy), so the caller looks again.
        """
        if not self.lock.acquire(blocking=False):
            return bool(self._ops)
        try:
            if self.closed or not self.connected or self.lost is not None:  # (not placed: its ops wait
                return False  # for its first need; lost: the user's next call moves it)
            if ((self._ops and now - self._first_pending >= BATCH_WINDOW)
                    or (self._release and len(self._release) > 1024)):
                self.flush()
            elif now - self._last_send > PING_EVERY:
                self._send(protocol.PING, {"t": now})
            return bool(self._ops)
        finally:
            self.lock.release()

    def _send(self, msg_type: int, body: dict) -> None:
        with HeldInterrupts():
            self._seq += 1
            self._send_frames(self.sock, self._seal(protocol.encode(msg_type, body, (), self._seq), self.sock))
            self._last_send = time.monotonic()

    def _seal(self, frames: list, sock: zmq.Socket) -> list:
        """Seal with the message's own sequence number (``_seq``, one counter for all connections)."""
        if self.peer is None:
            return frames
        return self.peer.seal(frames, self._channels[sock][0], self._seq)

    # ------------------------------------------------------------------ sync points
    def request(self, name: str, args: list, kwargs: dict | None = None, base: int | None = None) -> Any:
        """Run an op whose result the client needs, after everything queued; block for it."""
        with self.lock:
            if self.closed:
                if self.lost is not None:
                    raise self._loss_error()
                raise GatewayLostError(f"this remotecuda session is closed{self.closed_why}")
            self.open(name)
            kind = fastread.KIND.get(name)
            if kind is not None and not kwargs and self._reads_fast(kind, args):
                return self._read(kind, name, args)
            index = self._op_index + len(self._ops)  # this op's number in the session's stream
            self._ops.append([name, args, kwargs, {"base": base}])
            self._rid += 1
            rid = self._rid
            t0 = time.perf_counter()
            self.flush(req=rid)
            self._stats["blocking_round_trips"] += 1
            t_wait = time.monotonic()
            try:
                while True:
                    try:
                        msg, downloads = self._wait(rid)
                        break
                    except GatewayLostError as e:
                        if not self._may_recover():
                            raise
                        self._recover(e)  # replays the stream, this request last: wait for it there
            finally:
                self._stats["wait_seconds"] += time.monotonic() - t_wait
            if self.log is not None and not self.unlogged:
                self.log.answered()
                self._maybe_snapshot()
            if self._later:
                self._raise_later_error()
            return self._result(name, args, index, msg, downloads, t0, t_wait)

    def _result(self, name: str, args: list, index: int, msg: protocol.Message, downloads: dict[int, Download],
                t0: float, t_wait: float) -> Any:
        """The value a request's reply carries (op ``index`` of the stream): its error raised, with
        the kernels' warnings; a fetch's tensor built."""
        body = msg.body
        if self.trace is not None:
            self.trace.waited(self, name, index, t_wait, body.get("spans"))
        warned = body.get("warn")  # the kernels' warnings since the last reply (remote_warnings.py)
        if body.get("err"):  # this op's own error, or (with a note) an earlier one's
            err = body["err"]
            try:
                if warned:
                    remote_warnings.raise_again(warned)
            finally:
                raise remote_exception(err, asynchronous=err.get("index") != index and not self.sync)
        self._settled = not self._ops  # (this request was the last thing sent, and all of it ran)
        res = body.get("res")
        if name == "rc::fetch":
            res = self._downloaded(res, msg, downloads.get(0))
        elif name == "rc::fetch_many":
            if not (isinstance(res, list) and len(res) == len(args)):
                raise GatewayProtocolError(f"gateway {self.endpoint} answered a fetch of {len(args)} "
                                           "tensors with something else")
            res = [self._downloaded(r, msg, downloads.get(i)) for i, r in enumerate(res)]
        nbytes = sum(t.nbytes for t in (res if isinstance(res, list) else [res]) if isinstance(t, torch.Tensor))
        if nbytes:
            self.link.observe(nbytes, time.perf_counter() - t0)
            if self.trace is not None:
                self.trace.transfer(self, "download", nbytes, None, t_wait)
        if warned:
            remote_warnings.raise_again(warned)
        return res

    def _reads_fast(self, kind: int, args: list) -> bool:
        """Whether a read of one tensor may go as a READ (fastread.py): the worker offered it, and
        nothing of this session is queued, unanswered or pending here (ops, requests whose answers
        wait, copies from other sessions), nor traced: its answer then depends on nothing sent
        before it. Tensors freed meanwhile stay to be freed with the next OPS message (a read frees
        nothing). Its place in the failover log is none: a read changes nothing a replay must
        rebuild."""
        return (self.fast_read and self._settled and not self._ops
                and not self._forgotten and not self._later and not self._abandoned and not self.sources
                and self.trace is None and self.lost is None and len(args) == 1
                and type(args[0]) is (int if kind == fastread.FETCH else bytes))

    def _read(self, kind: int, name: str, args: list) -> Any:
        """A value read as a READ, answered by a VALUE (or, should the worker find it not idle,
        by the general REPLY); counted as the one-op request it stands for. A gateway lost
        meanwhile: the read goes again by the general path, after the failover."""
        handle = args[0] if kind == fastread.FETCH else int.from_bytes(args[0], "little")
        self._rid += 1
        rid = self._rid
        t0 = time.perf_counter()
        index = self._op_index
        stats = self._stats
        try:
            msg = self._read_round_trip(kind, rid, index, handle)
        except GatewayLostError as e:
            if not self._may_recover():
                raise
            self._recover(e)
            return self.request(name, args)
        finally:
            stats["wait_seconds"] += time.perf_counter() - t0
        if msg.type == protocol.VALUE:
            stats["fast_reads"] += 1
            if kind == fastread.ITEM:  # (a plain answer: no error, warning, trace or download to take)
                self._settled = True  # (nothing was queued: a read is sent only then)
                return msg.body["res"]
        return self._result(name, args, index, msg, {}, t0, t0)

    def _read_round_trip(self, kind: int, rid: int, index: int, handle: int) -> protocol.Message:
        """Send READ ``rid`` and take its answer. Interrupts are held from the send to the answer
        when it comes at once (the common case, within READ_POLL_MS): one hold, where a
        hold for the send and another for the receive cost a signal handler's swap each (a
        KeyboardInterrupt is raised after the answer is taken, and the books then agree with it).
        An answer not come by then, or preceded by another message, is waited for by the general
        wait, which an interrupt stops at once."""
        stats = self._stats
        answer = None
        try:
            with HeldInterrupts():  # (half a message must never stay queued, nor half of one be read)
                self._seq += 1
                frames = self._seal(fastread.encode_read(kind, rid, index, handle, self._seq), self.sock)
                self._settled = False
                self._send_frames(self.sock, frames, copy=True)  # (a few dozen bytes: cheaper copied)
                stats["ops"] += 1
                stats["messages"] += 1
                stats["blocking_round_trips"] += 1
                stats["bytes_up"] += sum(map(len, frames))
                if zmq_poll([(self.sock, _POLLIN)], READ_POLL_MS):
                    answer, _ = self._took(self._read_answer(), rid, {}, None)
        except KeyboardInterrupt:  # (as in _wait: its answer is taken, and its error raised, at the next wait)
            if answer is None:
                self._later.setdefault(rid, None)
                self._abandoned.add(rid)
            raise
        return answer if answer is not None else self._wait(rid)[0]

    def _read_answer(self) -> protocol.Message:
        """The message come on the session's socket after a READ, decoded: its header taken as
        bytes, then a VALUE's body as bytes too (its header says it has no payload frames), any
        other message's frames as ``zmq.Frame``s (a REPLY's payloads stay uncopied). A
        ``zmq.Frame`` costs several times the copy of a VALUE's few dozen bytes."""
        sock = self.sock
        first = wire.recv_bytes(sock, zmq.NOBLOCK)
        head = self._header(first)
        try:
            rest = [wire.recv_bytes(sock, zmq.NOBLOCK)] if head.type == protocol.VALUE else wire.recv(sock, zmq.NOBLOCK)
        except zmq.Again:  # (ZeroMQ delivers a message whole: its header alone is a malformed one)
            raise GatewayProtocolError(f"gateway {self.endpoint} sent a message this client refuses: "
                                       "a header without its body") from None
        return self._decoded([first, *rest], sock, head)

    def _header(self, frame: Any) -> protocol.Header:
        try:
            return protocol.decode_header(frame)
        except ProtocolError as e:
            raise GatewayProtocolError(f"gateway {self.endpoint} sent a message this client "
                                       f"refuses: {e}") from None

    def synchronize(self) -> None:
        """Wait for everything queued and sent (``rc::sync``), raising a pending remote error.
        When nothing was sent since the last error-free reply, the gateway has nothing of ours
        left to run and the answer is known without a round trip, as an idle GPU's
        ``cudaDeviceSynchronize`` returns in microseconds (torch.utils.benchmark's timers sync at
        every reading, and size their blocks by what an empty reading costs). Tensors freed
        since are freed on the gateway first, as a GPU's allocator frees them at once. While a
        trace records, each sync is asked, and shown in it."""
        with self.lock:
            if (self._settled and self.connected and not self.closed and self.lost is None
                    and self.trace is None and not self._ops and not self._release
                    and not self._later and not self._abandoned):
                self._drain()  # (a message the gateway sent meanwhile: its error is raised)
                return
            self.request("rc::sync", [])

    def request_later(self, name: str, args: list) -> int | None:
        """Queue a request whose answer (a Python value: ``_local_scalar_dense`` and the like) is
        collected later with ``answer``, without waiting: a read the program can do without, if
        it comes in time (decode.py's early stop). Its id; None on a session not placed yet, or
        while a trace records (its replies carry the gateway's spans, which ``request`` collects)."""
        with self.lock:
            if self.closed or not self.connected or self.trace is not None:
                return None
            self._ops.append([name, args, None, {"base": None}])
            self._rid += 1
            rid = self._rid
            self._later[rid] = None
            self.flush(req=rid)
            return rid

    def answer(self, rid: int) -> tuple[bool, Any]:
        """(True, the value) if request ``rid``'s reply has come (it is then forgotten), else
        (False, None); never waits. A reply carrying an error raises it: the gateway reports a
        failure once, in its next reply, so dropped here (as it was) it was lost, and the ops after
        it failed on "never computed" tensors, each naming the one before (an OOM in ``generate``)."""
        with self.lock:
            if self._later.get(rid) is None and not self.closed:
                self._drain()
            body = self._later.get(rid)
            if body is None:
                return False, None
            del self._later[rid]
            if body.get("warn"):
                remote_warnings.raise_again(body["warn"])
            if body.get("err"):
                raise remote_exception(body["err"])
            return True, body.get("res")

    def _raise_later_error(self) -> None:
        """Raise the error that the reply of a ``request_later`` carried, come during a wait:
        the gateway reports the first failure once, in its next reply, so it is the first, and the
        failure this request met if any (a tensor "never computed" because of it) only follows
        from it. Left for ``answer``, it lost to that one, and the program saw a RuntimeError
        nesting "never computed" messages where a GPU raised an OutOfMemoryError."""
        for body in self._later.values():
            if body is not None and body.get("err"):
                err, body["err"] = body["err"], None
                raise remote_exception(err)

    def forget(self, rid: int) -> None:
        """Stop waiting for request ``rid``'s reply (``request_later``). An error it carries (an
        earlier op's, which the gateway reports once) is still raised, at the next wait."""
        with self.lock:
            if rid in self._later:
                self._abandoned.add(rid)

    def _drain(self) -> None:
        """Take the messages that have come, without waiting: replies to ``request_later``."""
        for sock in dict(self._poller.poll(0)):
            while True:
                try:
                    frames = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = self._decoded(frames, sock)
                if msg.type in _REPLIES and msg.body.get("rid") in self._later:
                    self._later[msg.body["rid"]] = msg.body
                elif msg.type == protocol.ERROR:
                    self._raise_error(msg.body)

    def _decoded(self, frames: list, sock: zmq.Socket, head: protocol.Header | None = None) -> protocol.Message:
        """A message from the gateway, counted, opened (signed links) and decoded; a VALUE as the
        REPLY it answers (fastread.py). ``head``: its header, decoded already."""
        self._stats["bytes_down"] += sum(map(len, frames))
        try:
            if head is None:
                head = protocol.decode_header(frames[0]) if frames else None
            if head is None:
                raise ProtocolError("empty message")
            if self.peer is not None:
                self.peer.open(frames, self._channels[sock][1], head)
            if head.type == protocol.VALUE:
                return fastread.decode_value(frames, head)
            return protocol.decode(frames, head=head)
        except ProtocolError as e:
            raise GatewayProtocolError(f"gateway {self.endpoint} sent a message this client "
                                       f"refuses: {e}") from None

    def fetch_many(self, handles: list[int]) -> list[torch.Tensor]:
        """CPU copies of several gateway tensors (contiguous), in one round trip."""
        return self.request("rc::fetch_many", list(handles))

    def _downloaded(self, res: Any, msg: protocol.Message, download: Download | None) -> torch.Tensor:
        """The CPU tensor a fetch result describes: a reply payload, or PARTs assembled already;
        or the tensor itself, which a VALUE holds (fastread.py)."""
        if type(res) is torch.Tensor and msg.type == protocol.VALUE:
            self._stats["downloads"] += 1
            return res
        if not isinstance(res, dict) or not ("pl" in res or "parts" in res):
            raise GatewayProtocolError(f"gateway {self.endpoint} answered a fetch with something else")
        self._stats["downloads"] += 1
        if "parts" in res:
            return (download or Download(self.offered)).finish(res["parts"], res["dtype"], res["shape"])
        if not 0 <= res["pl"] < len(msg.payloads):
            raise GatewayProtocolError(f"gateway {self.endpoint}: a fetch names a payload its reply lacks")
        desc, frame = msg.payloads[res["pl"]]
        return protocol.tensor_from_bytes(protocol.decode_payload(desc, frame, accepted=self.offered),
                                          res["dtype"], res["shape"])

    def _wait(self, rid: int) -> tuple[protocol.Message, dict[int, Download]]:
        """The REPLY to request ``rid``, and the PARTs that came ahead of it (large downloads),
        by their place in the request."""
        downloads: dict[int, Download] = {}
        last_heard = time.monotonic()
        last_ping = last_heard
        progress: Progress | None = None  # (large downloads: their parts come ahead of the reply)
        try:
            while True:
                for sock in dict(self._poller.poll(100)):
                    # pyzmq looks for signals as a message's frames are freed, where an exception
                    # cannot be raised: an interrupt met there was lost (a loop of downloads ran
                    # on). Held while a message is taken in, and its frames freed, it is raised after
                    reply = None
                    try:
                        with HeldInterrupts():
                            reply, progress = self._received(sock, rid, downloads, progress)
                    except KeyboardInterrupt:
                        if reply is not None:  # (come: its error, if any, is raised at the next wait)
                            self._later[rid] = reply.body
                        raise
                    last_heard = time.monotonic()
                    if reply is not None:
                        if self.sources:  # (a value read without copies pays nothing here)
                            self._copies_failed(reply)
                            self.sources.clear()  # (the copies queued before it ran, or failed in it)
                        if self._abandoned:
                            self._abandoned_errors()
                        return reply, downloads
                if self._abandoned:
                    self._abandoned_errors(waiting=rid)
                if self.lost is not None:  # liveness.py found the gateway down, or restarted
                    self._settled = True  # (nothing will answer what was sent: the error says so once)
                    raise self._loss_error()
                gone = next((src for src in self.sources if src.lost is not None), None)
                if gone is not None:  # (the reply, an error after the worker's own pull timeout, is not waited for)
                    self.sources.clear()
                    gone.loss_told()
                    raise TransferError(f"remotecuda: the copy of this tensor from another device failed: the "
                                        f"gateway holding the source tensor ({gone.endpoint}) is down: {gone.lost}")
                now = time.monotonic()
                if now - last_heard > LIVENESS:
                    self.closed = True
                    raise GatewayLostError(f"gateway {self.endpoint} stopped answering "
                                           f"(nothing for {LIVENESS:.0f} s)")
                if now - last_ping > PING_EVERY:
                    self._send(protocol.PING, {"t": now})
                    last_ping = now
        except KeyboardInterrupt:
            # as on a GPU, the work queued before the interrupt still runs (an in-place op
            # dropped would leave its tensor silently stale); ``cancel`` is what drops it
            self._later.setdefault(rid, None)
            self._abandoned.add(rid)
            raise
        finally:
            if progress is not None:
                progress.close()

    def _received(self, sock: zmq.Socket, rid: int, downloads: dict[int, Download],
                  progress: Progress | None) -> tuple[protocol.Message | None, Progress | None]:
        """Take in one message that has come: the REPLY to request ``rid`` (returned), a PART of its
        download, another request's reply, an ERROR (raised), or a PONG."""
        return self._took(self._decoded(wire.recv(sock), sock), rid, downloads, progress)

    def _took(self, msg: protocol.Message, rid: int, downloads: dict[int, Download],
              progress: Progress | None) -> tuple[protocol.Message | None, Progress | None]:
        """What ``_received`` does with the message it took in."""
        if msg.type in _REPLIES and msg.body.get("rid") == rid:
            return msg, progress
        if msg.type in _REPLIES and msg.body.get("rid") in self._later:
            self._later[msg.body["rid"]] = msg.body
        if msg.type == protocol.PART and msg.body.get("rid") == rid:
            download = downloads.setdefault(msg.body.get("i", 0), Download(self.offered))
            download.add(msg)
            progress = progress or Progress("download", 0)
            progress.update(download.last, sum(d.total for d in downloads.values()))
        if msg.type == protocol.ERROR:
            self._raise_error(msg.body)
        return None, progress

    def _abandoned_errors(self, waiting: int | None = None) -> None:
        """Raise the error the reply of a request abandoned by an interrupt (or of a pace marker)
        carried (an earlier op's, or its own): the gateway reports a failure once, in its next
        reply; and the kernels' warnings it carried. Raised while
        request ``waiting`` waits, that request is abandoned in its turn."""
        for rid in [r for r in self._abandoned if self._later.get(r) is not None]:
            self._abandoned.discard(rid)
            body = self._later.pop(rid)
            if body is None:
                continue
            failure: BaseException | None = None
            if body.get("warn"):  # (a pace marker's reply carries the warnings of the ops before it)
                try:
                    remote_warnings.raise_again(body["warn"])
                except Warning as e:  # (a filter made it an error)
                    failure = e
            if body.get("err"):
                failure = remote_exception(body["err"])
            if failure is not None:
                if waiting is not None:
                    self._later[waiting] = None
                    self._abandoned.add(waiting)
                raise failure

    def cancel(self) -> None:
        """Drop this session's queued work (``%remotecuda cancel``, ipython.py): ops the
        gateway has not run yet are skipped (their outputs marked never computed); requests
        abandoned before get no reply then."""
        with self.lock:
            for rid in self._abandoned:
                self._later.pop(rid, None)
            self._abandoned.clear()
            if self.closed or not self.connected:  # (not placed: nothing of it runs yet)
                return
            try:
                self.flush()
                self._send(protocol.CANCEL, {"rid": None, "upto": self._seq})
            except zmq.ZMQError:
                pass

    def _raise_error(self, body: dict) -> None:
        kind, text = body.get("kind"), body.get("msg", "")
        if kind == "session_lost" or kind == "no_session":
            self.closed = True
            raise GatewayLostError(f"gateway {self.endpoint}: {text}")
        raise GatewayProtocolError(f"gateway {self.endpoint} rejected a message: {text}")

    # ------------------------------------------------------------------ failover (failover.py)
    def _may_recover(self) -> bool:
        return self.failover is not None and self.log is not None and not self.unlogged

    def _recover(self, cause: BaseException, req: int | None = None) -> None:
        """Move to another GPU (``failover``): the queued ops (with request ``req``, if one is
        being sent) join the log first, so the replay sends them with the rest."""
        assert self.failover is not None and self.log is not None
        if self._ops or self._release or req is not None:
            body: dict = {"ops": self._ops, "n0": self._op_index}
            if self._release:
                rel = _take(self._release)
                body["rel"], body["rel_at"] = [h for _, h in rel], [n for n, _ in rel]
            if req is not None:
                body["req"] = req
            self.log.record(protocol.pack_body(body), self._ops, req is not None)
            self._op_index += len(self._ops)
            self._ops, self._payloads, self._pending_bytes = [], [], 0
        self.failover(self, cause)

    def reconnect(self, endpoint: str, gpu: int) -> None:
        """Drop the failed connections and greet ``gpu`` of ``endpoint`` afresh (the handle
        counter, the request ids and the op index go on: the replay reuses the client's ids)."""
        for sock in list(self._channels):
            self._forget(sock)
        self._channels, self.peer, self.data_endpoint = {}, None, None
        self._parts_sent, self._inflight = 0, []
        # the new address first, with no WELCOME yet: liveness must not judge it by the old gateway's id
        self.info, self.endpoint, self.gpu = {}, endpoint, gpu
        self.connected, self.closed, self.lost, self._settled = False, False, None, False
        self._connect(endpoint, gpu)

    def restore(self, snap: Snapshot, sticky: list[list]) -> None:
        """Put a snapshot back on a fresh session: each storage uploaded once, each tensor a view
        of it under its own handle, the flags set so far, the generators' states."""
        assert self.log is not None
        storages, landed = {}, []
        for sid, (key, n) in snap.storages.items():
            landed.append(self.upload(torch.frombuffer(bytearray(self.log.blob(key)), dtype=torch.uint8)
                                      if n else torch.empty(0, dtype=torch.uint8)))
            storages[sid] = self.new_handle()  # a storage of its own (an upload may land inside a larger one)
            self._ops.append(["aten::clone.default", [protocol.handle_ext(landed[-1])], None, [storages[sid]]])
        for h, sid, *view in snap.handles:  # (dtype, shape, stride, offset(, math bits))
            self._ops.append(["rc::restore_view", [storages[sid], *view], None, [h]])
        self._ops.extend(sticky)
        self._ops.append(["rc::rng_set", [snap.rng], None, None])
        for gid, state in snap.generators:
            self._ops.append(["rc::gen_set", [gid, state], None, None])
        self._release = [(len(self._ops), h) for h in (*landed, *storages.values())]
        self._op_index = snap.op_index - len(self._ops)
        self.flush()

    def resend(self, body: dict, answered: bool) -> int:
        """Send one logged OPS message again, on this (new) connection: its uploads from the log's
        bytes, its releases where they were. A request already answered asks nothing back (a
        fetch becomes a sync); one not answered keeps its request id, for the caller waiting on
        it. Returns the number of ops sent."""
        assert self.log is not None
        ops = body.get("ops") or []
        req = body.get("req")
        for i, op in enumerate(ops):
            name = op[0]
            if name in UPLOAD_OPS:
                key, dtype, shape = self.log.uploads[op[1][0]]
                data = self.log.blob(key)
                self.upload(protocol.tensor_from_bytes(memoryview(bytearray(data)), dtype, shape)
                            if data else torch.empty(shape, dtype=dtype), handle=op[1][0])
            elif name == "rc::upload_abandon":  # (its parts went to the old gateway)
                self._ops.append(NOOP)
            elif req is not None and answered and i == len(ops) - 1 and name in ("rc::fetch", "rc::fetch_many"):
                self._ops.append(["rc::sync", [], None, op[3]])
            else:
                self._ops.append(op)
        rel, at = body.get("rel") or [], body.get("rel_at") or []
        self._release = list(zip(at, rel)) + self._release  # (a finalizer's meanwhile: after the replay's)
        self._op_index = body.get("n0", self._op_index)
        if req is not None and answered:
            self._rid += 1
            req = self._rid
        self.flush(req)
        return len(ops)

    def _maybe_snapshot(self) -> None:
        if self.log is not None and not self.unlogged and not self._snapshotting and self.log.due():
            self.snapshot()

    def snapshot(self) -> Snapshot | None:
        """Download the live tensors (by storage, so views keep their aliasing) and the generators'
        states, and truncate the log to them: a failover then replays only what follows. None
        without a log or a connection. A gateway failing meanwhile moves the session instead."""
        with self.lock:
            if self.log is None or not self.connected or self.closed or self.unlogged:
                return None
            t0 = time.perf_counter()
            self._snapshotting = True  # (the flush below must not start another)
            try:
                self.flush()  # logged: should the gateway fail during the snapshot, the log is whole
            finally:
                self._snapshotting = False
            self.unlogged = True
            try:
                base = self.reserve(SNAPSHOT_STORAGES)
                try:
                    live = self.request("rc::live", [base, SNAPSHOT_STORAGES])
                except GatewayLostError:
                    raise
                except Exception:  # an earlier op's error, reported here, which cleared it on the
                    # gateway: a replay must clear it at the same point (an answered sync request)
                    ops: list = [["rc::sync", [], None, {"base": None}]]
                    self.log.record(protocol.pack_body({"ops": ops, "n0": self._op_index - 1, "req": 0}), ops, True)
                    self.log.answered()
                    raise
                whole, data, nbytes = [base + k for k in range(len(live["storages"]))], [], 0
                batch: list[int] = []
                for h, n in zip(whole, live["storages"]):  # (fetched in requests of at most FETCH_BYTES)
                    if batch and nbytes + n > FETCH_BYTES:
                        data += self.fetch_many(batch)
                        batch, nbytes = [], 0
                    batch.append(h)
                    nbytes += n
                if batch:
                    data += self.fetch_many(batch)
                for h in whole:
                    self.release(h)
                snap = Snapshot(self._op_index + len(self._ops), handles=live["handles"], rng=live["rng"],
                                generators=live["gens"])
                for k, t in enumerate(data):
                    key = b"snapshot-%d-%d" % (self.log.snapshots, k)  # (the last one's blobs stay until then)
                    self.log.blobs.put(key, protocol.tensor_bytes(t))
                    snap.storages[k] = (key, t.nbytes)
            except GatewayLostError as e:
                self.unlogged = False
                if self.failover is None:
                    raise
                self._recover(e)  # (the log is whole: no snapshot this time)
                return None
            finally:
                self.unlogged = False
            snap.seconds = time.perf_counter() - t0
            self.log.truncate(snap)
            return snap

    # ------------------------------------------------------------------ lifetime
    def mark_lost(self, why: str) -> None:
        """The gateway is down or restarted (liveness.py, from its own thread, without the lock):
        a wait blocked on it raises GatewayDownError(why) within a poll, and so does every later
        request, as a CUDA sticky error does; nothing more is sent to it. With failover the
        session stays open: its next flush or request moves it to another GPU instead."""
        self.lost = why
        if self.failover is None:
            self.closed = True

    def loss_told(self) -> None:
        """An error saying this session's gateway is down reached the program (another session's
        copy from it failed, perhaps before liveness.py found it down): without failover, what it
        never answered does not count as unfinished, so the interpreter's exit does not wait for
        it and report the loss a second time. (Without the lock: the caller waits holding another's.)"""
        self._loss_told = True

    def _loss_error(self) -> GatewayDownError:
        """The error that tells the program this session's gateway is down (``loss_told``)."""
        assert self.lost is not None
        self._loss_told = True
        return GatewayDownError(self.lost)

    def _copies_failed(self, reply: protocol.Message) -> None:
        """A reply whose error is a copy that failed because its source's worker stopped: that
        source's loss is told (``loss_told``)."""
        err = reply.body.get("err")
        msg = err.get("msg") if isinstance(err, dict) else None
        if isinstance(msg, str) and "holding the source tensor" in msg:
            for src in self.sources:
                if src.data_endpoint is not None and f"({src.data_endpoint})" in msg:
                    src.loss_told()

    def close(self) -> None:
        with self.lock:
            self.failover = None  # (a gateway gone at exit is no reason to move)
            self.closed_why = (" (remotecuda was deactivated or reconnected since: deactivate(), "
                               "%unload_ext remotecuda, %remotecuda use); the data of its 'cuda' "
                               "tensors is gone")
            if not self.connected:  # never placed: its queued ops never ran, nothing to say BYE to
                self.closed = True
                return
            if not self.closed and self.lost is None:
                try:
                    self.sock.setsockopt(zmq.SNDTIMEO, 1000)  # a gone gateway must not hang the exit
                    self.flush()
                    self._send(protocol.BYE, {})
                except (zmq.ZMQError, GatewayLostError):
                    pass
            self.closed = True
            for sock in (self.bulk, self.sock, self.front):
                if not sock.closed:
                    sock.close(linger=1000 if self.lost is None else 0)
            if self.log is not None:
                self.log.close()


SIGINT = int(signal.SIGINT)


class HeldInterrupts:
    """Holds a KeyboardInterrupt (Ctrl-C, Jupyter's interrupt) back until a message is handed to
    ZeroMQ whole and the session's books agree with it: raised between two frames it would leave
    half a message queued, to be joined to the next one; between clearing the op queue and
    sending it, the ops would be lost. Only the main thread gets KeyboardInterrupt, so elsewhere
    (the flusher) this does nothing; a send blocked on a gone gateway holds Ctrl-C for at most
    SEND_TIMEOUT."""

    def __enter__(self) -> None:
        self.previous, self.tripped = None, False
        if threading.current_thread() is threading.main_thread():
            previous = _signal.getsignal(SIGINT)
            if previous is not None:  # (None: a handler not set from Python, which we could not put back)
                self.previous = previous
                _signal.signal(SIGINT, self._trip)

    def _trip(self, signum: int, frame: Any) -> None:
        self.tripped = True

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            _signal.signal(SIGINT, self.previous)
            if self.tripped:
                signal.raise_signal(SIGINT)  # now, to whoever handled it before


class Download:
    """A large download arriving as PART messages ahead of its REPLY, each checked and copied
    into fresh memory as it comes; a bad part is reported at the REPLY, once the rest of the
    stream has been read past."""

    def __init__(self, accepted: Sequence[str] = protocol.CODECS) -> None:
        self.accepted = accepted  # the codecs its parts may come in
        self.assembly: protocol.Assembly | None = None
        self.parts = 0
        self.error: ProtocolError | None = None
        #: the tensor's bytes, and those of the last part added (for progress)
        self.total = self.last = 0

    def add(self, msg: protocol.Message) -> None:
        self.parts += 1
        self.last = 0
        if self.error is not None:
            return
        try:
            off, total = msg.body.get("off"), msg.body.get("total")
            if len(msg.payloads) != 1 or not isinstance(off, int) or not isinstance(total, int):
                raise ProtocolError("malformed PART message (it needs int off and total and one payload)")
            self.total = total
            self.last = min(protocol.PART_BYTES, max(total - off, 0))
            if self.assembly is None:
                if off != 0 or not 0 < total <= protocol.MAX_PAYLOAD_BYTES:
                    raise ProtocolError(f"download part at byte {off} of {total}: no download of it is under way")
                # numpy's memory: large blocks get transparent huge pages, few faults to fill
                self.assembly = protocol.Assembly(torch.from_numpy(np.empty(total, dtype=np.uint8)))
            desc, frame = msg.payloads[0]
            self.assembly.add(off, protocol.decode_payload(desc, frame, total, accepted=self.accepted))
        except ProtocolError as e:
            self.error = e

    def finish(self, parts: Any, dtype: torch.dtype, shape: list) -> torch.Tensor:
        try:
            if self.error is not None:
                raise self.error
            if self.parts != parts or self.assembly is None:
                raise ProtocolError(f"download of {parts} parts: {self.parts} arrived")
            return self.assembly.finish(dtype, shape)
        except ProtocolError as e:
            raise GatewayProtocolError(f"a download from the gateway was damaged: {e}") from None


def _take(items: list) -> list:
    """What ``items`` holds now, taken out of it: ``del`` of a slice is one step under the GIL,
    so an item a finalizer appends meanwhile, on another thread, stays for the next taker (a
    swap for a new list, ``taken, items = items, []``, could lose it)."""
    n = len(items)
    taken = items[:n]
    del items[:n]
    return taken


def _sendable(op: list) -> list:
    """``op``, or where the wire cannot carry its arguments an ``rc::refused`` in its place: the
    gateway raises the error there, as an op that failed on it (its outputs never computed, the
    error reported at the next sync point, or at the call under REMOTECUDA_SYNC)."""
    try:
        protocol.pack_body({"op": op})
    except protocol.UNSENDABLE as e:
        kind = next(t.__name__ for t in protocol.UNSENDABLE if isinstance(e, t))  # (UnicodeEncodeError: ValueError)
        return ["rc::refused", [op[0], kind, f"remotecuda could not send op {op[0]} to the gateway: {e}"], None, op[3]]
    return op


def _size(frame: Any) -> int:
    return len(frame) if isinstance(frame, bytes) else frame.nbytes


def connect(ctx: zmq.Context, endpoint: str, routing_id: bytes | None = None,
            server: str | None = None) -> zmq.Socket:
    """A DEALER to a gateway. With ``routing_id`` (a session's direct connection) a reconnect keeps
    the peer's identity, and messages wait for it: the session's worker, if it died, is reported
    on the gateway's port at once, instead of a send blocking until SEND_TIMEOUT. ``server``: the
    gateway's front endpoint, for a connection to one of its workers' ports (see ``secure``)."""
    sock = ctx.socket(zmq.DEALER)
    try:
        secure(sock, server or endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    else:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT * 1000))  # a send never blocks forever on a dead link
    sock.connect(endpoint)
    return sock


def secure(sock: zmq.Socket, gateway: str) -> None:
    """With a CURVE key pair (``REMOTECUDA_CURVE_SECRET``), make ``sock`` (not connected yet) an
    encrypted connection to the gateway whose front endpoint is ``gateway`` (remotecuda_wire/curve.py):
    GatewayAuthError when that gateway's public key is not known."""
    try:
        keys = curve.client_keys()
        if keys is None:
            return
        key = curve.server_key(gateway)
    except (OSError, ValueError) as e:
        raise GatewayAuthError(f"CURVE keys: {e}") from None
    if key is None:
        raise GatewayAuthError(f"{curve.SECRET_ENV} is set but no public key is known for gateway {gateway} "
                               f"(set {curve.SERVER_ENV}, or name it HOST:PORT@KEYFILE in REMOTECUDA_SERVERS)")
    curve.secure_client(sock, keys, key)


#: the messages that answer a request: a REPLY, and a VALUE answering a READ (fastread.py)
_REPLIES = (protocol.REPLY, protocol.VALUE)
_POLLIN = int(zmq.POLLIN)  # (the plain int: an enum member is made at each use otherwise)
#: the channels a client accepts on the gateway's port: the supervisor's messages and its worker's, forwarded
_FROM_GATEWAY = {auth.FRONT: frozenset({auth.FRONT | auth.SUPERVISOR, auth.FRONT | auth.WORKER})}


def hello(sock: zmq.Socket, body: dict, timeout: float, endpoint: str) -> dict:
    """Greet a gateway; the WELCOME body (inventory) or GatewayUnavailableError."""
    return handshake(sock, body, timeout, endpoint)[0]


def handshake(sock: zmq.Socket, body: dict, timeout: float, endpoint: str,
              token: bytes | None = None) -> tuple[dict, auth.Peer | None]:
    """Greet a gateway on a new connection: the WELCOME body, and the connection's keys when this
    client holds a token (``REMOTECUDA_TOKEN`` / ``REMOTECUDA_TOKEN_FILE``). The token is proven
    by answering the gateway's challenge, never sent; the gateway proves it holds it too (its
    WELCOME is sealed with the key both derive), so a client with a token uses no gateway without.
    ``token``: prove this one instead (the admin token, for STATUS)."""
    token = token or auth.read_token()
    if token is None:
        msg = _answer(greet([(sock, body)], timeout, endpoint)[0])
        if msg.type != protocol.WELCOME:
            raise GatewayUnavailableError(f"gateway {endpoint} answered HELLO with {protocol.TYPE_NAMES[msg.type]}")
        return msg.body, None
    deadline = time.monotonic() + timeout
    mine = auth.nonce()
    msg = _answer(greet([(sock, dict(body, auth=mine))], timeout, endpoint)[0])
    theirs = msg.body.get("nonce")
    if msg.type != protocol.CHALLENGE or not (isinstance(theirs, bytes) and len(theirs) == auth.NONCE_BYTES):
        raise GatewayAuthError(f"gateway {endpoint} does not authenticate (it runs without a token), and this "
                               "client holds one (REMOTECUDA_TOKEN / REMOTECUDA_TOKEN_FILE): it uses only "
                               "gateways that prove they share it")
    peer = auth.Peer(auth.session_key(auth.token_key(token), mine, theirs), auth.C2G)
    try:
        msg = _answer(greet([(sock, body)], max(deadline - time.monotonic(), 0.5), endpoint,
                            lambda frames, _: peer.seal(frames, auth.FRONT),
                            lambda frames, _: peer.open(frames, _FROM_GATEWAY[auth.FRONT]))[0])
    except auth.AuthError as e:
        raise GatewayAuthError(f"gateway {endpoint} did not prove it holds this client's token ({e})") from None
    if msg.type != protocol.WELCOME:
        raise GatewayUnavailableError(f"gateway {endpoint} answered HELLO with {protocol.TYPE_NAMES[msg.type]}")
    return msg.body, peer


def _answer(answer: protocol.Message | Exception) -> protocol.Message:
    if isinstance(answer, Exception):
        raise answer
    return answer


Sealer = Callable[[list, zmq.Socket], list]
Checker = Callable[[list, zmq.Socket], Any]


def greet(greetings: list[tuple[zmq.Socket, dict]], timeout: float, endpoint: str,
          seal: Sealer | None = None, check: Checker | None = None) -> list[protocol.Message | Exception]:
    """Send each socket its HELLO and wait for all the answers at once; for each, the WELCOME (or
    CHALLENGE) message or the error saying why none came (GatewayUnavailableError,
    GatewayAuthError, ProtocolError). ``seal`` and ``check``, an authenticated session's, seal each
    HELLO for its socket and check each answer (an unsealed ERROR still counts as a refusal)."""
    client = {"host": socket.gethostname(), "pid": os.getpid(), "torch": torch.__version__,
              "protocol": protocol.VERSION}
    deadline = time.monotonic() + timeout
    unsent = {sock: dict(body, client=client) for sock, body in greetings}
    answers: dict[zmq.Socket, protocol.Message | Exception] = {}
    # a failed security handshake (CURVE) closes the connection without a word: the monitor hears it
    monitors = {curve.watch(sock): sock for sock, _ in greetings}
    try:
        while len(answers) < len(greetings) and time.monotonic() < deadline:
            _greet_round(unsent, answers, monitors, greetings, endpoint, seal, check)
    finally:
        for mon, sock in monitors.items():
            curve.unwatch(sock, mon)
    return [answers[sock] if sock in answers else GatewayUnavailableError(
        f"no RemoteCUDA gateway answered at {endpoint} within {timeout:.1f} s") for sock, _ in greetings]


def _greet_round(unsent: dict, answers: dict, monitors: dict, greetings: list, endpoint: str,
                 seal: Sealer | None, check: Checker | None) -> None:
    """One turn of ``greet``: send what can be sent, take the answers and handshake failures that came."""
    for mon in zmq.select(list(monitors), [], [], 0)[0]:
        sock = monitors[mon]
        why = curve.handshake_failure(recv_monitor_message(mon)["event"],
                                      sock.getsockopt(zmq.MECHANISM) == zmq.CURVE)
        if why is not None and sock not in answers:
            answers[sock] = GatewayAuthError(f"gateway {endpoint}: {why}")
    for sock, body in list(unsent.items()):
        frames = protocol.encode(protocol.HELLO, body)
        try:  # with IMMEDIATE, a send fails (rather than queueing) until the TCP link is up
            sock.send_multipart(seal(frames, sock) if seal is not None else frames, zmq.NOBLOCK)
            del unsent[sock]
        except zmq.Again:
            pass
    waiting = [sock for sock, _ in greetings if sock not in unsent and sock not in answers]
    if not waiting:
        time.sleep(0.02)
        return
    ready, _, _ = zmq.select(waiting, [], [], 0.05)
    for sock in ready:
        frames = sock.recv_multipart()
        try:
            head = protocol.decode_header(frames[0]) if frames else None
            if check is not None and not (head is not None and head.type == protocol.ERROR
                                          and not head.flags & protocol.SEALED):
                check(frames, sock)
            msg = protocol.decode(frames)
        except protocol.ProtocolError as e:
            answers[sock] = e
            continue
        if msg.type in (protocol.WELCOME, protocol.CHALLENGE):
            answers[sock] = msg
        elif msg.type == protocol.ERROR:
            error = GatewayAuthError if msg.body.get("kind") == "auth" else GatewayUnavailableError
            answers[sock] = error(f"gateway {endpoint} refused the session: {msg.body.get('msg')}")


def gateway_status(ctx: zmq.Context, endpoint: str, timeout: float) -> dict:
    """A gateway's STATUS answer (its inventory, per-session and total counters), asked on a
    connection of its own; GatewayUnavailableError when none comes within ``timeout``. With a
    token the connection authenticates first (HELLO without a device) and the exchange is sealed;
    without one, a gateway that has a token answers with its public inventory only. A gateway with
    an admin token gives the per-session rows only to a client proving it (REMOTECUDA_ADMIN_TOKEN,
    REMOTECUDA_ADMIN_TOKEN_FILE; remotecuda_wire/admin.py): a client holding one proves it first,
    and where the gateway does not take it, asks again as a token holder."""
    admin = read_admin_token()
    if admin is not None:
        try:
            return _ask_status(ctx, endpoint, timeout, admin)
        except GatewayAuthError:
            pass
    return _ask_status(ctx, endpoint, timeout, auth.read_token())


def _ask_status(ctx: zmq.Context, endpoint: str, timeout: float, token: bytes | None) -> dict:
    sock = connect(ctx, endpoint)
    try:
        peer = handshake(sock, {"device": None}, timeout, endpoint, token)[1] if token else None
        frames = protocol.encode(protocol.STATUS, {}, seq=2 if peer is not None else 0)
        sock.send_multipart(peer.seal(frames, auth.FRONT) if peer is not None else frames)
        if not sock.poll(int(timeout * 1000)):
            raise GatewayUnavailableError(f"no RemoteCUDA gateway answered at {endpoint}")
        frames = sock.recv_multipart()
        if peer is not None:
            peer.open(frames, _FROM_GATEWAY[auth.FRONT])
        msg = protocol.decode(frames)
        if msg.type == protocol.ERROR:
            error = GatewayAuthError if msg.body.get("kind") == "auth" else GatewayUnavailableError
            raise error(f"gateway {endpoint} refused STATUS: {msg.body.get('msg')}")
        return msg.body
    finally:
        sock.close(linger=0)
