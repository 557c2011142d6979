"""Tensor copies between two sessions' workers — on two gateways, or on two GPUs of one — that
never pass through the client.

The client names one copy with a random, single-use token and puts one small op in each
session's stream: ``rc::offer [handle, token]`` in the source's, ``rc::receive [handle, token,
peer, dtype, shape]`` in the destination's, ``peer`` being the source worker's data port as the
client reaches it. The destination *pulls*: its I/O thread, as soon as the message holding
``rc::receive`` arrives, sends ``PULL {"token", "rid"}`` to ``peer``; the source answers with the
bytes in PART messages and a REPLY once its executor has reached ``rc::offer`` (so the value is
the tensor's at that point of its stream); meanwhile it tells the puller every KEEPALIVE that it is
alive. The destination's executor takes the bytes at ``rc::receive`` — usually there already, as
they crossed while it ran earlier ops.

Why a pull, not a push: a gateway never holds bytes it did not ask for, so a token cannot be used to
push data into a session; to read one, a stranger must guess 128 random bits while the offer lives,
before its puller does. Each side's state is here; the sockets are the worker's (worker.py).
"""
from __future__ import annotations

import itertools
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from remotecuda_wire import protocol
from remotecuda_wire.compression import LinkModel
from remotecuda_wire.protocol import ProtocolError

#: an offered tensor nobody pulls (its destination died) is dropped after this many seconds
OFFER_TTL = 60.0
#: a PULL whose token no arrived op has announced waits this long for it (the source's OPS message
#: may still be on its way), then is refused
UNANNOUNCED_WAIT = 5.0
#: a source that waits for its executor to reach ``rc::offer`` tells the puller so this often
KEEPALIVE = 1.0
#: a destination that hears nothing from the source for this long gives the copy up
PEER_LIVENESS = 10.0
#: PULLs a worker keeps waiting at once; more are refused (each is a few hundred bytes)
MAX_WAITING = 1024
#: served tokens remembered, so a second PULL of one is refused at once
SPENT_REMEMBERED = 4096
TOKEN_BYTES = 16
_PEER = re.compile(r"tcp://[A-Za-z0-9.\-:\[\]]+:\d{1,5}")
_LINK = LinkModel()


class TransferError(RuntimeError):
    """A copy from another session's worker failed; the client raises it as
    ``remotecuda.TransferError`` (errors.py maps the name)."""


def expected_bytes(dtype: Any, shape: Any) -> int:
    """The byte size of a contiguous ``shape`` ``dtype`` tensor; ProtocolError if malformed."""
    if not isinstance(dtype, torch.dtype) or not (isinstance(shape, list) and
                                                  all(type(s) is int and s >= 0 for s in shape)):
        raise ProtocolError("malformed rc::receive: expected a dtype and a shape")
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    if n > protocol.MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"rc::receive of {n} bytes is over the limit of {protocol.MAX_PAYLOAD_BYTES}")
    return n


# ---------------------------------------------------------------------- the source's side
@dataclass(slots=True)
class Pull:
    """A PULL that came to this worker's data port."""

    ident: bytes  # the puller's routing identity on the data port
    rid: int
    token: bytes
    codecs: tuple[str, ...]  # what the puller decodes
    since: float
    kept_alive: float


class Offers:
    """Tokens announced by arriving ``rc::offer`` ops, the tensors the executor offered under them,
    and the PULLs waiting for them. The I/O thread announces and serves; the executor offers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.announced: set[bytes] = set()  # its rc::offer has arrived, not yet run
        self.ready: dict[bytes, tuple[torch.Tensor, float]] = {}  # token → (host copy, when offered)
        self.failed: dict[bytes, tuple[str, float]] = {}  # token → why its rc::offer did not run, when
        self.spent: OrderedDict[bytes, None] = OrderedDict()  # served already: single use
        self.waiting: list[Pull] = []

    def announce(self, token: Any) -> None:
        if isinstance(token, bytes):
            with self.lock:
                self.announced.add(token)

    def offer(self, token: bytes, host: torch.Tensor) -> None:
        with self.lock:
            self.announced.discard(token)
            self.ready[token] = (host, time.monotonic())

    def fail(self, token: Any, why: str) -> None:
        if isinstance(token, bytes):
            with self.lock:
                self.announced.discard(token)
                self.failed[token] = (why, time.monotonic())

    def pull(self, p: Pull) -> str | None:
        """Queue a PULL; why it is refused at once, or None."""
        with self.lock:
            if p.token in self.spent:
                return "this transfer's token was used already (a token serves one copy)"
            if len(self.waiting) >= MAX_WAITING:
                return f"this gateway worker has {MAX_WAITING} transfers waiting already"
            self.waiting.append(p)
        return None

    def due(self, now: float) -> tuple[list[tuple[Pull, torch.Tensor]], list[tuple[Pull, str]], list[Pull]]:
        """What the I/O thread must do now: PULLs to serve (each offer handed out once), PULLs to
        refuse, PULLs to keep alive. Offers nobody pulled within OFFER_TTL are dropped."""
        serve, refuse, alive = [], [], []
        with self.lock:
            for table in (self.ready, self.failed):
                for token in [t for t, (_, at) in table.items() if now - at > OFFER_TTL]:
                    del table[token]
            still = []
            for p in self.waiting:
                if p.token in self.ready:
                    serve.append((p, self.ready.pop(p.token)[0]))
                    self.spent[p.token] = None
                    if len(self.spent) > SPENT_REMEMBERED:
                        self.spent.popitem(last=False)
                elif p.token in self.failed:
                    refuse.append((p, self.failed.pop(p.token)[0]))
                elif p.token not in self.announced and now - p.since > UNANNOUNCED_WAIT:
                    refuse.append((p, "no transfer with this token on this gateway worker (never offered, "
                                      "used already, or expired)"))
                else:
                    if now - p.kept_alive >= KEEPALIVE:
                        p.kept_alive = now
                        alive.append(p)
                    still.append(p)
            self.waiting = still
        return serve, refuse, alive

    def busy(self) -> bool:
        """Whether ``due`` has anything to do: PULLs waiting, or offers to serve or drop in time."""
        return bool(self.waiting or self.ready or self.failed)


def parse_pull(ident: bytes, body: dict, now: float) -> Pull:
    token, rid = body.get("token"), body.get("rid")
    if not (isinstance(token, bytes) and len(token) == TOKEN_BYTES and type(rid) is int):
        raise ProtocolError("malformed PULL: it needs a 16-byte token and an int rid")
    return Pull(ident, rid, token, protocol.common_codecs(body.get("codecs")), now, now)


def answer(p: Pull, host: torch.Tensor) -> Iterator[list]:
    """The messages that carry an offered tensor to its puller: PARTs, then the REPLY."""
    buf = protocol.tensor_bytes(host)
    n = buf.nbytes
    codec = _LINK.choose(buf, p.codecs)
    parts = 0
    for off in range(0, n, protocol.PART_BYTES):
        payload = protocol.encode_payload(buf[off:off + protocol.PART_BYTES], codec)
        yield protocol.encode(protocol.PART, {"rid": p.rid, "off": off, "total": n}, [payload])
        parts += 1
    yield protocol.encode(protocol.REPLY, {"rid": p.rid, "res": {"parts": parts, "nbytes": n}, "err": None})


def refusal(p: Pull, why: str) -> list:
    return protocol.encode(protocol.REPLY, {"rid": p.rid, "res": None,
                                            "err": {"type": "TransferError", "msg": why}})


def keepalive(p: Pull) -> list:
    return protocol.encode(protocol.PONG, {"rid": p.rid})


# ---------------------------------------------------------------------- the destination's side
@dataclass(slots=True)
class Receipt:
    """One pull under way: its bytes, assembled as they come."""

    rid: int
    peer: str
    nbytes: int
    heard: float  # when the source last said anything (the PULL's sending, at first)
    assembly: Any = None
    parts: int = 0
    done: bool = False
    error: str | None = None
    ready: Any = None  # the copy stream's event once the bytes are in (CUDA)


class Receipts:
    """The copies this session is receiving. The I/O thread starts each pull when its
    ``rc::receive`` arrives and places the parts; the executor takes the tensor at the op."""

    def __init__(self, assembly: Callable[[int], protocol.Assembly], copy_stream: Any = None):
        self.assembly = assembly  # a buffer of n bytes on the device
        self.copy_stream = copy_stream
        self.cv = threading.Condition()
        self.by_token: dict[bytes, Receipt] = {}
        self.by_rid: dict[int, Receipt] = {}
        self._rids = itertools.count(1)
        self.closed = False

    def start(self, args: Any) -> tuple[Receipt, bytes] | None:
        """A receipt for an arriving ``rc::receive``'s args; with the token, when a PULL is to go out.
        A malformed op gets a receipt holding its error, which the executor raises in order."""
        token = args[1] if isinstance(args, list) and len(args) == 5 else None
        if not (isinstance(token, bytes) and len(token) == TOKEN_BYTES):
            return None  # the executor reports it
        peer = args[2]
        r = Receipt(next(self._rids), str(peer), 0, time.monotonic())
        try:
            r.nbytes = expected_bytes(args[3], args[4])
            if not (isinstance(peer, str) and _PEER.fullmatch(peer)):
                raise ProtocolError(f"rc::receive names no peer a gateway connects to ({peer!r})")
        except ProtocolError as e:
            r.error = str(e)
        with self.cv:
            if token in self.by_token:
                return None  # a token serves one copy: the second rc::receive fails at its turn
            self.by_token[token] = r
            self.by_rid[r.rid] = r
        return (r, token) if r.error is None else None

    def on_message(self, msg: protocol.Message) -> None:
        """A PART, REPLY or PONG from a source (I/O thread)."""
        with self.cv:
            r = self.by_rid.get(msg.body.get("rid"))  # type: ignore[arg-type]
        if r is None:
            return  # a dropped receipt's, or a stranger's
        r.heard = time.monotonic()
        if r.error is not None or r.done:
            return
        try:
            if msg.type == protocol.PART:
                self._part(r, msg)
            elif msg.type == protocol.REPLY:
                err = msg.body.get("err")
                if err:
                    r.error = str(err.get("msg") if isinstance(err, dict) else err)
                else:
                    res = msg.body.get("res") or {}
                    if res.get("parts") != r.parts or res.get("nbytes") != r.nbytes:
                        raise ProtocolError(f"{res.get('parts')} parts of {res.get('nbytes')} bytes sent, "
                                            f"{r.parts} of {r.nbytes} expected")
                    if r.assembly is None:  # an empty tensor
                        r.assembly = self.assembly(0)
                    if self.copy_stream is not None:
                        r.ready = self.copy_stream.record_event()
                    r.done = True
        except Exception as e:  # (a part too big for memory included) never the I/O thread's end
            r.error = f"the transfer was damaged: {e}"
        with self.cv:
            self.cv.notify_all()

    def _part(self, r: Receipt, msg: protocol.Message) -> None:
        off, total = msg.body.get("off"), msg.body.get("total")
        if len(msg.payloads) != 1 or type(off) is not int or total != r.nbytes:
            raise ProtocolError(f"a part of {total!r} bytes for a tensor of {r.nbytes}")
        if r.assembly is None:
            r.assembly = self.assembly(r.nbytes)
        desc, frame = msg.payloads[0]
        r.assembly.add(off, protocol.decode_payload(desc, frame, r.nbytes))
        r.parts += 1

    def fail_peer(self, peer: str, why: str) -> None:
        """The source at ``peer`` refused our PULLs as a whole (an ERROR: not a PULL it knows), or
        the connection to it closed."""
        with self.cv:
            for r in self.by_rid.values():
                if r.peer == peer and not r.done and r.error is None:
                    r.error = why
            self.cv.notify_all()

    def take(self, token: Any, dtype: torch.dtype, shape: list, cancelled: Callable[[], bool],
             device: torch.device) -> torch.Tensor:
        """The received tensor, once its bytes are in (executor thread). Raises TransferError when
        the source refused, or fell silent for PEER_LIVENESS."""
        with self.cv:
            r = self.by_token.get(token) if isinstance(token, bytes) else None
            if r is None:
                raise ProtocolError("rc::receive: malformed, or a second receive under one token")
            while not r.done and r.error is None:
                if self.closed or cancelled():
                    self._forget(token)
                    raise RuntimeError("remotecuda: interrupted while this tensor was copied from "
                                       "another device")
                if time.monotonic() - r.heard > PEER_LIVENESS:
                    r.error = (f"the gateway worker holding the source tensor ({r.peer}) did not answer "
                               f"for {PEER_LIVENESS:.0f} s")
                    break
                self.cv.wait(0.1)
            self._forget(token)
        if r.error is not None:
            raise TransferError(f"remotecuda: the copy of this tensor from another device failed: {r.error}")
        t = r.assembly.finish(dtype, shape)
        if r.ready is not None:  # assembled on the worker's copy stream
            torch.cuda.current_stream(device).wait_event(r.ready)
            t.record_stream(torch.cuda.current_stream(device))
        return t

    def drop(self, token: Any) -> None:
        """The ``rc::receive`` was skipped: parts still coming are let go."""
        with self.cv:
            self._forget(token)

    def _forget(self, token: Any) -> None:
        r = self.by_token.pop(token, None)
        if r is not None:
            self.by_rid.pop(r.rid, None)

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
