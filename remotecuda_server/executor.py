"""Executing one session's op stream on one device.

The executor owns the session's handle table (client-assigned id → real tensor).
A view op yields a real view here, so aliasing and in-place ops on views behave as in
local PyTorch. Errors follow CUDA's model: the first failing op is remembered, the
ops after it in the stream are skipped (their outputs are marked invalid), and the
error is returned with the reply to the client's next request.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from remotecuda_wire import protocol
from remotecuda_wire.cache import ContentCache, content_key
from remotecuda_wire.compression import LinkModel
from remotecuda_wire.protocol import GeneratorRef, Handle, ProtocolError

from . import cuda_info, peer, rnn
from .graphs import CAPTURING, RecordedGraph, flatten_tensors
from .memory_account import MemoryAccount, fmt_bytes
from .ops import OpResolver, UnknownOpError
from .programs import Program
from .session_quota import FLAG as QUOTA_FLAG
from .session_quota import SessionQuota

#: torch's refusal to resize a storage it does not own (StorageImpl's ``resizable()``)
_NOT_RESIZABLE = "Trying to resize storage that is not resizable"

def _extent(t: torch.Tensor) -> int:
    """The bytes of its storage a strided tensor spans, its offset included."""
    if t.numel() == 0:
        return 0
    return (int(t.storage_offset()) + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


_LINK = LinkModel()  # the gateway does not measure its clients' links: downloads use the default


class RemoteOpError(Exception):
    """An op failed; carries what the client needs to re-raise it."""

    def __init__(self, op: str, index: int, exc: BaseException):
        super().__init__(str(exc))
        self.info = {"op": op, "index": index, "type": _error_type(exc), "msg": str(exc)}


#: the errors encoding can raise, which ``rc::refused`` raises again
_REFUSED_TYPES: dict[str, type[Exception]] = {t.__name__: t for t in protocol.UNSENDABLE}


def _error_type(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "OutOfMemoryError"
    if isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc):
        return "OutOfMemoryError"  # the CPU allocator's word for it
    if isinstance(exc, ProtocolError):
        return "ProtocolError"
    return type(exc).__name__


def _count_skipped(failure: dict, name: str) -> None:
    """Count an op skipped after ``failure`` in its report (``skipped``; ``skipped_inplace`` for
    those that were to change an existing tensor: an in-place op or an ``out=`` one), so the
    error tells the program that the work it queued after the failing op did not run, and that
    the tensors those ops were to update keep their earlier values, which no read would reveal."""
    failure["skipped"] = failure.get("skipped", 0) + 1
    op = name.rpartition("::")[2]
    base, _, overload = op.partition(".")
    if base.endswith("_") or overload.startswith("out"):
        failure["skipped_inplace"] = failure.get("skipped_inplace", 0) + 1


@dataclass
class Upload:
    """An upload the worker's I/O thread has checked and copied to the device ahead of its op."""

    tensor: torch.Tensor
    ready: Any  # the copy stream's CUDA event, or None on the CPU
    digests: list  # the verified digests of its parts
    parts: list  # its host buffers, which the content cache keeps


def assemble(parts: list, dtype: torch.dtype, shape: list, device: torch.device) -> torch.Tensor:
    """A device tensor holding these host buffers one after another."""
    flat = Assembly(sum(p.nbytes for p in parts), device)
    for p in parts:
        flat.add(flat.filled, p)
    return flat.finish(dtype, shape)


class HostBlocks:
    """Upload memory on the CPU device, recycled as the CUDA caching allocator recycles a GPU's.

    Fresh memory costs a page fault per page, more than the copy into it; a training loop
    uploads same-sized batches, so a block whose tensors have all died serves the next upload
    of its size. Each block is handed out as a fresh view, watched by a weak reference: the
    block is free again when that view (kept alive by any tensor over it) is gone."""

    def __init__(self, limit_bytes: int = 1 << 30):
        self.limit = limit_bytes
        self.blocks: list[list] = []  # [block, weak reference to the view in use], oldest first
        self.lock = threading.Lock()  # the I/O thread and the executor (cache hits) both take

    def take(self, nbytes: int) -> np.ndarray:
        with self.lock:
            for i, entry in enumerate(self.blocks):
                if entry[0].nbytes == nbytes and entry[1]() is None:
                    self.blocks.append(self.blocks.pop(i))  # most recently used last
                    return self._lend(entry)
            entry = [np.empty(nbytes, dtype=np.uint8), None]
            if nbytes < _MIN_BLOCK:
                return entry[0]
            view = self._lend(entry)
            self.blocks.append(entry)
            held = sum(e[0].nbytes for e in self.blocks)
            for e in [e for e in self.blocks if e[1]() is None]:  # over the limit: drop free ones, oldest first
                if held <= self.limit:
                    break
                self.blocks.remove(e)
                held -= e[0].nbytes
            return view

    @staticmethod
    def _lend(entry: list) -> np.ndarray:
        view = entry[0][:]
        entry[1] = weakref.ref(view)
        return view

    def free_bytes(self) -> int:
        with self.lock:
            return sum(e[0].nbytes for e in self.blocks if e[1]() is None)

    def clear(self) -> None:
        with self.lock:
            self.blocks = [e for e in self.blocks if e[1]() is not None]


_MIN_BLOCK = 1 << 20  # smaller uploads come from the allocator's own free lists
HOST_BLOCKS = HostBlocks()


class Assembly(protocol.Assembly):
    """An upload arriving in parts: into a recycled host block on the CPU, device memory on a GPU."""

    def __init__(self, nbytes: int, device: torch.device):
        if device.type == "cpu":
            super().__init__(torch.from_numpy(HOST_BLOCKS.take(nbytes)))
        else:
            super().__init__(torch.empty(nbytes, dtype=torch.uint8, device=device))


class PartedUploads:
    """Uploads of 1 MB and more: they come as PART messages on the session's bulk connection
    while its ops go on the main one, so an op never waits on the wire behind the next batch.

    The worker's I/O thread places each part as it arrives (on CUDA: on the copy stream). The
    executor takes the bytes at the upload's op, waiting first, if it must, until every PART
    the client sent before that op has come: the op names how many that is, so a part that
    never came is known to be missing, not late."""

    def __init__(self, device: torch.device, copy_stream: Any = None):
        self.device, self.copy_stream = device, copy_stream
        self.cv = threading.Condition()
        self.received = 0  # PART messages seen, well-formed or not
        self.refused = 0  # the session's messages refused before their type could be trusted (maybe PARTs)
        self.building: dict[int, tuple] = {}  # handle → (Assembly, parts, digests, ready event)
        self.failed: dict[int, BaseException] = {}  # handle → why its upload cannot finish
        self.abandoned: dict[int, int] = {}  # handle → last PART number: its parts still coming are dropped
        self.closed = False

    def add(self, h: int, offset: Any, total: Any, buf: memoryview, digest: bytes) -> None:
        """Place one checked part (I/O thread); order violations are ProtocolErrors."""
        with self.cv:
            if h in self.failed or h in self.abandoned:
                return
            entry = self.building.get(h)
        if offset == 0:
            if not isinstance(total, int) or not 0 < total <= protocol.MAX_PAYLOAD_BYTES:
                raise ProtocolError(f"upload of {total!r} bytes in parts is not allowed")
            entry = (Assembly(total, self.device), [], [], None)
        elif entry is None:
            raise ProtocolError(f"upload part at byte {offset} of tensor {h}: no upload of it is under "
                                "way (the first part starts at byte 0)")
        flat, parts, digests, _ = entry
        flat.add(offset, buf)
        parts.append(buf)
        digests.append(digest)
        if flat.filled == flat.flat.numel() and self.copy_stream is not None:
            entry = (flat, parts, digests, self.copy_stream.record_event())
        with self.cv:
            if h not in self.abandoned:
                self.building[h] = entry

    def fail(self, h: int, e: BaseException) -> None:
        with self.cv:
            self.building.pop(h, None)
            if h not in self.abandoned:
                self.failed.setdefault(h, e)

    def has_failed(self, h: int) -> bool:
        with self.cv:
            return h in self.failed

    def abandon(self, h: Any, last: Any) -> None:
        """The client stopped sending h's parts (an interrupt): drop those that came, and those
        still on their way, up to PART number ``last``."""
        if type(h) is not int or type(last) is not int:
            raise ProtocolError("malformed rc::upload_abandon: expected [handle, last PART number]")
        with self.cv:
            self.building.pop(h, None)
            self.failed.pop(h, None)
            if last > self.received:
                self.abandoned[h] = last

    def building_bytes(self) -> int:
        """Memory held by uploads whose parts are still coming."""
        with self.cv:
            return sum(entry[0].flat.numel() for entry in self.building.values())

    def arrived(self) -> None:
        """Count one PART message in, whatever became of it."""
        with self.cv:
            self.received += 1
            if self.abandoned:
                self.abandoned = {h: last for h, last in self.abandoned.items() if last > self.received}
            self.cv.notify_all()

    def lost(self) -> None:
        """A message of the session was refused before its type could be trusted: it may have
        been a PART, so an upload still short of its parts fails (after LOST_GRACE) instead of
        waiting for one that will never come."""
        with self.cv:
            self.refused += 1
            self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def take(self, h: int, last: int, dtype: torch.dtype, shape: list,
             cancelled: Callable[[], bool]) -> Upload | None:
        """Upload h, once PART messages up to number ``last`` are in; None if the session is
        cancelled or closed meanwhile."""
        with self.cv:
            short_since = None
            while self.received < last:
                if self.closed or cancelled():
                    return None
                if self.received + self.refused >= last:  # the missing parts may be among the refused
                    short_since = short_since or time.monotonic()
                    if time.monotonic() - short_since > LOST_GRACE:
                        raise ProtocolError(f"upload of tensor {h}: {last - self.received} of its PART messages "
                                            "did not arrive (a message of this session was refused)")
                self.cv.wait(0.1)
            err, entry = self.failed.pop(h, None), self.building.pop(h, None)
        if err is not None:
            raise err
        if entry is None:
            raise ProtocolError(f"upload of tensor {h}: none of its parts arrived")
        flat, parts, digests, ready = entry
        if flat.filled != flat.flat.numel():
            raise ProtocolError(f"upload of tensor {h}: {flat.filled} of its {flat.flat.numel()} bytes arrived")
        t = flat.finish(dtype, shape)
        if ready is not None:
            t.record_stream(torch.cuda.current_stream(self.device))
        return Upload(t, ready, digests, parts)


#: how long an upload short of parts still waits once refused messages could account for them
LOST_GRACE = 1.0
#: the releases of a message that has none: only ``Executor._frees``'s sentinel (read, never changed)
_NO_FREES: list = [(float("inf"), None)]


class InternalOp(NamedTuple):
    """An ``rc::`` op: the Executor method that serves it, and its argument list's shape."""

    method: Callable[[Executor, list], Any]
    args: str  # as docs/PROTOCOL.md's table of internal ops gives it
    stores: bool  # its result goes to the op's output handles, as an aten op's does


#: ``rc::<name>`` → InternalOp, filled by ``@internal_op`` on Executor's methods; internal ops
#: are served from here only, never resolved through the aten allowlist (ops.py)
INTERNAL_OPS: dict[str, InternalOp] = {}


#: internal ops a CUDA graph capture lets through (the rest synchronise or move data: CUDA refuses those)
#: (freeing what the program dropped, as a finalizer's next message may during a capture, forgets
#: Python objects only, as it does on a GPU)
CAPTURE_SAFE = frozenset({"rc::graph_end", "rc::graph_free", "rc::event_record", "rc::event_free",
                          "rc::gen_free", "rc::program_free",
                          "rc::upload", "rc::upload_cached"})  # an upload is a constant of the graph


#: what a CUDA generator's ``graphsafe_get_state``/``graphsafe_set_state`` share (a CPU device's refusal names it)
_GRAPHSAFE = "graph-safe state (graphsafe_get_state, graphsafe_set_state)"


def internal_op(name: str, args: str, stores: bool = False) -> Callable:
    """Serve ``rc::<name>`` with the decorated Executor method, called with the op's args."""
    def register(method: Callable) -> Callable:
        INTERNAL_OPS[f"rc::{name}"] = InternalOp(method, args, stores)
        return method
    return register


class Executor:
    """Runs ops in issue order against a handle table."""

    def __init__(self, device: torch.device, upload_cache: ContentCache | None = None, copy_stream: Any = None,
                 account: MemoryAccount | None = None, quota: int | None = None):
        self.device = device
        self.account = account  # a simulated GPU's memory, shared with the other sessions on it
        #: this session's limit (--session-memory), in front of the account on the CPU device
        self.quota = SessionQuota(quota, account) if quota is not None else None
        self.cache = upload_cache
        self.parts = PartedUploads(device, copy_stream)
        #: decode id → step → the default generator's state after that step (rc::rng_mark)
        self.rng_marks: dict[int, dict[int, torch.Tensor]] = {}
        self.offers = peer.Offers()  # tensors other workers pull from this session (rc::offer)
        self.receipts = peer.Receipts(lambda n: Assembly(n, device), copy_stream)  # ... and ours (rc::receive)
        self.offered: Callable[[], None] = lambda: None  # wakes the worker's I/O thread to serve PULLs
        self.pending: dict[int, tuple] = {}  # handle → (last PART, dtype, shape, key): bytes on the way
        self.dropped: set[int] = set()  # pending handles released before they landed
        self._cancelled: Callable[[], bool] = lambda: False  # the running message's: whether an interrupt dropped it
        self._prepared: dict = {}  # the running message's uploads, prepared by the I/O thread
        self._out_payloads: list = []  # the running message's reply payloads, which fetches add to
        #: on the CPU the table itself counts the bytes its tensors hold (CUDA's allocator does on a GPU)
        self.handles: dict[int, torch.Tensor] = {} if device.type == "cuda" else CountedHandles(self.quota or account)
        self.memory_fraction = 1.0  # the client's torch.cuda.set_per_process_memory_fraction
        self.invalid: dict[int, str] = {}
        self.resolver = OpResolver(device)
        self.failed: dict | None = None
        self.events: dict[int, Any] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.graphs: dict[int, RecordedGraph] = {}  # the session's CUDA graphs (graphs.py)
        self.capturing: RecordedGraph | None = None  # the graph being captured, between begin and end
        self.programs: dict[int, Program] = {}  # the session's compiled graphs (programs.py)
        self.out_parts: list[tuple[int, int, list]] = []  # the running message's downloads in parts
        #: (op index, start, seconds) of each op run from a message asking for a trace ("trace" in
        #: its body), on this host's monotonic clock; they go back with the next REPLY (``take_spans``)
        self.spans: list[tuple[int, float, float]] = []
        self.codecs: tuple[str, ...] = ()  # what the client decodes, set when the session is attached
        self.stats = dict.fromkeys(("ops", "messages", "uploads", "downloads", "cache_hits",
                                    "cache_misses", "cache_bytes_saved", "errors",
                                    "transfer_bytes_in", "transfer_bytes_out"), 0)

    # ------------------------------------------------------------------ arguments
    def _arg(self, a: Any) -> Any:
        t = type(a)
        if t is bytes or t is Handle:
            h = int.from_bytes(a, "little") if t is bytes else a.id
            x = self.handles.get(h)
            if x is None and h in self.pending:
                self._resolve(h)
                x = self.handles.get(h)
            if x is None:
                why = self.invalid.get(h)
                raise RuntimeError(why or f"remotecuda: tensor handle {h} is unknown to the gateway "
                                          "(freed, or never created)")
            return x
        if t is list:
            return [self._arg(v) for v in a]
        if t is torch._C.device:  # (torch.device, whose name a client active in this process replaces)
            return self.device if a.type == "cuda" else a
        if t is GeneratorRef:
            g = self.generators.get(a.id)
            if g is None:
                raise RuntimeError(f"remotecuda: generator {a.id} is unknown to the gateway")
            return g
        return a

    def _store(self, outs: list, result: Any) -> None:
        if type(result) is torch.Tensor and len(outs) == 1 and outs[0] is not None:  # the common case
            self.handles[outs[0]] = result
            if self.invalid:
                self.invalid.pop(outs[0], None)
            return
        flat: list = []
        flatten_tensors(result, flat)
        if len(flat) != len(outs) and isinstance(result, (tuple, list)) and len(result) == len(outs) and flat:
            # an undefined tensor result (None) where the meta kernel gives an empty one, as
            # _native_multi_head_attention's weights without need_weights: the client holds that empty one
            flat = [torch.empty(0, dtype=flat[0].dtype, device=flat[0].device) if t is None else t for t in result]
        if len(flat) != len(outs):
            raise RuntimeError(f"op produced {len(flat)} tensors, the client expected {len(outs)}")
        for h, t in zip(outs, flat):
            if h is not None:
                self.handles[h] = t
                self.invalid.pop(h, None)

    def _poison(self, outs: Any, why: str) -> None:
        if isinstance(outs, list):
            for h in outs:
                if h is not None:
                    self.handles.pop(h, None)
                    self.invalid[h] = why

    # ------------------------------------------------------------------ execution
    def run(self, body: dict, cancelled: Callable[[], bool] = lambda: False,
            prepared: dict | None = None) -> tuple[Any, dict | None, list]:
        """Execute one OPS message; return (result of the request op, error, reply payloads).
        Downloads too large for one frame are left in ``out_parts`` as (index, total bytes, payloads).

        ``prepared`` maps an uploaded handle to its ``Upload`` (or to why it could not be
        prepared), made by the worker's I/O thread from the message's payloads.
        """
        self._prepared = prepared or {}
        self._cancelled = cancelled
        self.out_parts = []
        ops = body.get("ops") or []
        first = body.get("n0", 0)
        if not isinstance(ops, list) or not isinstance(first, int):
            raise ProtocolError("malformed ops list")
        frees = self._frees(body, len(ops))
        trace = body.get("trace") is True
        k = 0
        if self.pending:
            self._resolve_arrived()
        result: Any = None
        out_payloads: list = []
        self._out_payloads = out_payloads
        for i, op in enumerate(ops):
            while frees[k][0] <= i:
                self._free(frees[k][1])
                k += 1
            if not (isinstance(op, list) and len(op) == 4 and isinstance(op[0], str)):
                raise ProtocolError(f"malformed op record at position {i}")
            name, args, kwargs, outs = op
            if self.failed is not None or cancelled():
                why = (f"remotecuda: this tensor was never computed: op {self.failed['op']} "
                       f"failed before it ({self.failed['type']}: {self.failed['msg']})"
                       if self.failed else "remotecuda: this tensor was never computed: its op was "
                                           "cancelled by an interrupt")
                self._poison(outs, why)
                self._skipped(name, args, why)
                if self.failed is not None and not isinstance(outs, dict):
                    _count_skipped(self.failed, name)
                if name == "rc::graph_end" and self.capturing is not None:  # the capture ends all the same
                    self.capturing.fail(why)
                    self.capturing.capturing, self.capturing = False, None
                continue
            try:
                if trace:
                    start = time.monotonic()
                r = self._execute(name, args or [], kwargs or {}, outs)
                if trace:
                    if self.device.type == "cuda":  # the op's run time, not its launch's
                        torch.cuda.synchronize(self.device)
                    self.spans.append((first + i, start, time.monotonic() - start))
                if isinstance(outs, dict):  # a request op: its value goes back
                    result = r
            except ProtocolError:
                raise
            except Exception as e:  # any op error belongs to the client that issued it
                if (self.quota is not None and self.quota.limit is not None and self.device.type == "cuda"
                        and isinstance(e, torch.OutOfMemoryError)):
                    e = torch.OutOfMemoryError(f"{e} This session's memory quota is "
                                               f"{fmt_bytes(self.quota.limit)} ({QUOTA_FLAG}).")
                self.failed = RemoteOpError(args[0] if name == "rc::refused" else name, first + i, e).info
                self.stats["errors"] += 1
                self._poison(outs, f"remotecuda: this tensor was never computed: op {name} failed "
                                   f"({type(e).__name__}: {e})")
        for _, h in frees[k:-1]:
            self._free(h)
        self.stats["ops"] += len(ops)
        self.stats["messages"] += 1
        err = None
        if "req" in body and self.failed is not None:
            err, self.failed = self.failed, None
            result, out_payloads, self.out_parts = None, [], []
        return result, err, out_payloads

    def take_spans(self) -> list[tuple[int, float, float]]:
        """The op spans recorded since the last call (see ``spans``)."""
        spans, self.spans = self.spans, []
        return spans

    @staticmethod
    def _frees(body: dict, n_ops: int) -> list:
        """The message's releases as (ops to run before it, handle), ending with a sentinel.
        Freeing each where the client dropped it, not after the whole message, keeps the peak
        memory of a message holding several steps at that of one step. They are taken in the
        order sent: one listed after a later position waits for it (late, never early)."""
        rel, at = body.get("rel"), body.get("rel_at")
        if rel is None and at is None:  # (a value read's message frees nothing)
            return _NO_FREES
        if not (isinstance(rel, list) and all(type(h) is int for h in rel)):
            raise ProtocolError("malformed release list (rel): expected a list of handle ids")
        if at is None:
            at = [n_ops] * len(rel)
        elif not (isinstance(at, list) and len(at) == len(rel) and all(type(n) is int for n in at)):
            raise ProtocolError("malformed release positions (rel_at): expected an op count per handle in rel")
        return [*zip(at, rel), (float("inf"), None)]

    def _free(self, h: int) -> None:
        self.handles.pop(h, None)
        self.invalid.pop(h, None)
        if h in self.pending:
            self.dropped.add(h)

    def _execute(self, name: str, args: list, kwargs: dict, outs: Any) -> Any:
        if name.startswith("rc::"):
            op = INTERNAL_OPS.get(name)
            if op is None:
                raise UnknownOpError(f"unknown internal op {name}")
            if self.capturing is not None and name not in CAPTURE_SAFE:
                self.capturing.fail(f"{name} during capture")
                raise RuntimeError(f"CUDA error: {CAPTURING} ({name} inside a CUDA graph capture)")
            result = op.method(self, args)
            if op.stores:
                self._store(outs, result)
                return None
            return result
        func = self.resolver.callable(name)  # (OpOverload._op, one frame less than calling it; or its guard)
        args = [self._arg(a) for a in args]
        if self.capturing is not None:
            return self._capture(name, func, args, {k: self._arg(v) for k, v in kwargs.items()}, outs)
        kw = {k: self._arg(v) for k, v in kwargs.items()} if kwargs else {}
        try:
            result = func(*args, **kw) if kw else func(*args)
        except RuntimeError as e:
            if _NOT_RESIZABLE not in str(e):
                raise
            result = self._on_own_storages(func, args, kw)
        if isinstance(outs, dict):
            return self._describe(outs, result)
        self._store(outs, result)
        return None

    def _capture(self, name: str, func: Callable, args: list, kwargs: dict, outs: Any) -> None:
        graph = cast(RecordedGraph, self.capturing)
        if isinstance(outs, dict):  # its output shapes depend on values: CUDA syncs for them too
            graph.fail(f"{name} during capture")
            raise RuntimeError(f"CUDA error: {CAPTURING} ({name}'s output depends on values)")
        try:
            self._store(outs, graph.record(self.resolver.resolve(name), func, args, kwargs))
        except Exception as e:
            graph.fail(f"{name}: {e}")
            raise

    def _describe(self, outs: dict, result: Any) -> Any:
        """For ops whose output the client cannot predict: store tensors from ``base`` on, describe them."""
        next_id = [outs["base"]]

        def walk(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                if v.layout is not torch.strided:  # (the client's wrapper holds shape and strides only)
                    kind = str(v.layout).removeprefix("torch.")
                    raise NotImplementedError(
                        f"remotecuda: {kind} tensors cannot be made on a remote 'cuda' device (only dense, strided "
                        f"tensors live there); use a dense tensor instead (t.to_dense(): torch.sparse.mm and @ take "
                        f"dense ones too), or keep the sparse tensor on the CPU")
                h = next_id[0]
                next_id[0] += 1
                self.handles[h] = v
                return {"h": h, "shape": list(v.shape), "stride": list(v.stride()),
                        "offset": v.storage_offset(), "dtype": v.dtype}
            if isinstance(v, (list, tuple)):
                return [walk(x) for x in v]
            if isinstance(v, (bool, int, float, complex, type(None))):
                return v
            raise TypeError(f"cannot describe a {type(v).__name__} result")
        return walk(result)

    # ------------------------------------------------------------------ internal ops
    @internal_op("upload", "[handle, payload index or nil, dtype, shape, key or nil(, last PART)]")
    def _upload(self, args: list) -> None:
        h = args[0]
        self.stats["uploads"] += 1
        if args[1] is None:  # sent in PART messages: the stream goes on while they come
            self._expect(args)
            return
        up = self._prepared.get(h)
        if isinstance(up, BaseException):  # found by the I/O thread
            raise up
        if up is None:
            raise ProtocolError(f"upload of tensor {h}: its bytes are missing")
        self._land(h, up, args[4])

    @internal_op("upload_abandon", "[handle, last PART]")
    def _upload_abandon(self, args: list) -> None:
        """An interrupt stopped the upload's PARTs."""
        self.parts.abandon(*args)

    @internal_op("upload_cached", "[handle, key, dtype, shape]")
    def _upload_cached(self, args: list) -> None:
        """The bytes came earlier: they are in the upload cache."""
        h, key, dtype, shape = args
        parts = self.cache.get(key) if self.cache is not None else None
        if parts is None:  # its first upload may still be on its way in PARTs (x.cuda() @ x.cuda())
            first = next((p for p, pending in self.pending.items() if pending[3] == key), None)
            if first is not None:
                self._resolve(first)
                parts = self.cache.get(key) if self.cache is not None else None
        if parts is None:
            raise RuntimeError("remotecuda: the gateway's upload cache lost a payload the client "
                               "expected it to hold")
        self.handles[h] = assemble(parts, dtype, shape, self.device)
        self.invalid.pop(h, None)
        self.stats["uploads"] += 1
        self.stats["cache_hits"] += 1
        self.stats["cache_bytes_saved"] += sum(p.nbytes for p in parts)

    @internal_op("fetch", "[handle]")
    def _fetch_one(self, args: list) -> dict:
        return self._fetch(args[0], 0)

    @internal_op("fetch_many", "[handle, ...]")
    def _fetch_many(self, args: list) -> list:
        """A fetch's result per handle, in one reply."""
        if not all(type(h) is int for h in args):
            raise ProtocolError("malformed rc::fetch_many: expected handle ids")
        return [self._fetch(h, i) for i, h in enumerate(args)]

    @internal_op("sync", "[]")
    def _sync(self, args: list) -> None:
        for h in list(self.pending):
            self._resolve(h)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @internal_op("computed", "[handle, ...]")
    def _computed(self, args: list) -> list[bool]:
        """Which of these tensors hold values: not those "never computed" (an op before them failed)."""
        return [h not in self.invalid and (h in self.handles or h in self.pending) for h in args]

    @internal_op("seed", "[seed]")
    def _seed(self, args: list) -> None:
        (seed,) = args
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    @internal_op("initial_seed", "[]")
    def _initial_seed(self, args: list) -> int:
        return (torch.cuda.initial_seed() if self.device.type == "cuda" else torch.initial_seed())

    @internal_op("gen_new", "[generator id, seed]")
    def _gen_new(self, args: list) -> None:
        gid, seed = args
        g = self.generators[gid] = torch.Generator(device=self.device)
        g.manual_seed(seed)

    @internal_op("gen_clone", "[generator id, source generator id or nil]")
    def _gen_clone(self, args: list) -> None:
        """``Generator.clone_state()``: a new generator in the source's state (nil: the device's
        default generator's), drawing on its own from then on."""
        gid, source = args
        g = self._default_generator() if source is None else self.generators.get(source)
        if g is None:
            raise RuntimeError(f"remotecuda: generator {source} is unknown to the gateway")
        self.generators[gid] = g.clone_state()

    @internal_op("gen_free", "[generator id, ...]")
    def _gen_free(self, args: list) -> None:
        """Device generators the client dropped."""
        for gid in args:
            self.generators.pop(gid, None)

    @internal_op("gen_seed", "[generator id, seed]")
    def _gen_seed(self, args: list) -> None:
        """Reseed a generator (made afresh if the gateway does not hold it)."""
        gid, seed = args
        g = self.generators.get(gid)
        if g is None:
            g = self.generators[gid] = torch.Generator(device=self.device)
        g.manual_seed(seed)

    @internal_op("event_record", "[event id]")
    def _event_record(self, args: list) -> None:
        (eid,) = args
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events[eid] = ev
        else:
            self.events[eid] = time.perf_counter()

    @internal_op("graph_begin", "[graph id]")
    def _graph_begin(self, args: list) -> None:
        """Start capturing (graphs.py): the ops after it are recorded, not run, until graph_end."""
        (gid,) = args
        if self.capturing is not None:
            raise RuntimeError("CUDA error: a CUDA graph is already being captured on this device")
        self.capturing = self.graphs[gid] = RecordedGraph()

    @internal_op("graph_end", "[graph id]")
    def _graph_end(self, args: list) -> None:
        (gid,) = args
        graph = self.graphs.get(gid)
        if graph is None or graph is not self.capturing:
            raise RuntimeError(f"remotecuda: CUDA graph {gid} is not being captured")
        graph.capturing, self.capturing = False, None
        if graph.error is not None:
            raise RuntimeError(f"CUDA error: the CUDA graph's capture was invalidated: {graph.error}")

    @internal_op("graph_replay", "[graph id]")
    def _graph_replay(self, args: list) -> None:
        (gid,) = args
        graph = self.graphs.get(gid)
        if graph is None:
            raise RuntimeError(f"remotecuda: CUDA graph {gid} is unknown to the gateway (reset, or never captured)")
        graph.replay()

    @internal_op("graph_free", "[graph id]")
    def _graph_free(self, args: list) -> None:
        """``CUDAGraph.reset()``, or the graph object gone: its tensors go with it."""
        graph = self.graphs.pop(args[0], None)
        if graph is not None and graph is self.capturing:
            self.capturing = None

    @internal_op("program_define", "[program id, input count, [[op name, [args], {kwargs}], ...], "
                                   "[output value index, ...], [[stride, ...] per output]]")
    def _program_define(self, args: list) -> None:
        """A compiled graph, checked against the allowlist once (programs.py)."""
        if not (isinstance(args, list) and len(args) == 5 and type(args[0]) is int):
            raise ValueError("malformed rc::program_define: expected [program id, input count, nodes, "
                             "outputs, strides]")
        self.programs[args[0]] = Program(self.resolver, self.device, *args[1:])

    @internal_op("program_run", "[program id, [input handle, ...]]", stores=True)
    def _program_run(self, args: list) -> list:
        pid, inputs = args
        program = self.programs.get(pid)
        if program is None:
            raise RuntimeError(f"remotecuda: compiled graph {pid} is unknown to the gateway (its definition "
                               "failed, or it was freed)")
        return program.run([self._arg(h) for h in inputs])

    @internal_op("program_free", "[program id, ...]")
    def _program_free(self, args: list) -> None:
        for pid in args:
            self.programs.pop(pid, None)

    @internal_op("event_elapsed", "[start id, end id]")
    def _event_elapsed(self, args: list) -> float:
        a, b = (self.events[e] for e in args)
        if self.device.type == "cuda":
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1000.0

    @internal_op("event_free", "[event id, ...]")
    def _event_free(self, args: list) -> None:
        for e in args:
            self.events.pop(e, None)

    @internal_op("storage_resize", "[handle, nbytes]")
    def _storage_resize(self, args: list) -> None:
        """``untyped_storage().resize_(nbytes)`` of a tensor's storage: FSDP's and activation
        offloading's way to free a tensor's memory while keeping the tensor (``resize_(0)``) and to
        give it memory again before refilling it. Every tensor on that storage, views included, sees
        the change, as on a GPU."""
        if not (isinstance(args, list) and len(args) == 2 and type(args[0]) is int and type(args[1]) is int
                and args[1] >= 0):
            raise ProtocolError("malformed rc::storage_resize: expected [handle, nbytes >= 0]")
        h, nbytes = args
        storage = self._arg(Handle(h)).untyped_storage()
        if not storage.resizable():
            storage = self._own_storage(storage)
        if isinstance(self.handles, CountedHandles):
            self.handles.resize(storage, nbytes)
        else:
            storage.resize_(nbytes)

    def _on_own_storages(self, func: Callable, args: list, kwargs: dict) -> Any:
        """``func`` run again after it refused to resize a storage torch cannot resize (an upload
        on a CPU gateway lands in a recycled host block): ``x.cuda().resize_(n)``, or an ``out=``
        that must grow. A GPU's storages are all resizable, so each such storage among the
        arguments is replaced by a resizable copy (``_own_storage``) first. Those kernels resize
        before they write, so the failed call wrote nothing; but torch set the resized tensor's
        new sizes before it refused its storage, so that tensor is made empty first (the call,
        made again, sizes it)."""
        tensors: list = []
        flatten_tensors([args, list(kwargs.values())], tensors)
        for t in tensors:
            storage = t.untyped_storage() if t.layout is torch.strided else None
            if storage is not None and not storage.resizable():
                if _extent(t) > storage.nbytes():
                    t.set_(storage, t.storage_offset(), (0,), (1,))
                self._own_storage(storage)
        return func(*args, **kwargs) if kwargs else func(*args)

    def _own_storage(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        """A resizable copy of a storage torch cannot resize (an upload landed in a recycled host
        block, memory NumPy owns), with the session's tensors on it moved onto the copy, so that
        they still share one storage: a GPU can resize any of its storages."""
        key = storage._cdata
        own = torch.empty(storage.nbytes(), dtype=torch.uint8, device=storage.device).untyped_storage()
        own.copy_(storage)
        for h, t in list(self.handles.items()):
            if t.layout is torch.strided and t.untyped_storage()._cdata == key:
                self.handles[h] = t.set_(own, t.storage_offset(), t.shape, t.stride())
        return own

    @internal_op("memory", "[]")
    def _memory(self, args: list) -> dict:
        return self.memory_stats()

    @internal_op("reset_peak", "[]")
    def _reset_peak(self, args: list) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            cast(CountedHandles, self.handles).reset_peak()

    @internal_op("empty_cache", "[]")
    def _empty_cache(self, args: list) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            HOST_BLOCKS.clear()

    @internal_op("memory_fraction", "[fraction or nil]")
    def _memory_fraction(self, args: list) -> float:
        """``torch.cuda.set_per_process_memory_fraction`` (a fraction) and ``get_`` (nil): the
        fraction in force. The worker serves one session, so the session is the process."""
        if args and args[0] is not None:
            fraction = float(args[0])
            if not 0.0 <= fraction <= 1.0:
                raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
            if self.device.type == "cuda":
                total = torch.cuda.get_device_properties(self.device).total_memory
                limit = self.quota.limit if self.quota is not None else None
                quota = 1.0 if limit is None else min(1.0, limit / total)
                torch.cuda.set_per_process_memory_fraction(min(fraction, quota), self.device)
            else:
                self._counted_quota().set_fraction(fraction, self.memory_stats()["total"])
            self.memory_fraction = fraction
        return self.memory_fraction

    def _counted_quota(self) -> SessionQuota:
        """The CPU device's limits in front of its handle table, made at the first need."""
        if self.quota is None:
            counted = cast(CountedHandles, self.handles)
            self.quota = SessionQuota(None, self.account)
            self.quota.mine = counted.recount()  # (already in the account: the table settled it)
            counted.account = self.quota
        return self.quota

    @internal_op("cuda_info", "[name]")
    def _cuda_info(self, args: list) -> Any:
        """``torch.cuda.<name>`` for this device, where NVML and the allocator live (cuda_info.py)."""
        return cuda_info.query(str(args[0]), self.device, self.account, self.allocated_bytes())

    @internal_op("rng_get", "[]")
    def _rng_get(self, args: list) -> bytes:
        """The default generator's state, as bytes."""
        return self._rng_state().numpy().tobytes()

    @internal_op("rng_set", "[state bytes]")
    def _rng_set(self, args: list) -> None:
        state = torch.frombuffer(bytearray(args[0]), dtype=torch.uint8)
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    # --- snapshots for failover (the client's replay_log.py): live tensors by storage, generators
    @internal_op("live", "[first handle, how many]")
    def _live(self, args: list) -> dict:
        """What a snapshot must keep, taken at one point of the stream: each live handle as
        [handle, storage number, dtype, shape, stride, offset(, math bits)] (views share their base's
        number; the bits only where set, so a client that knows six fields still reads the rest),
        storage k's bytes stored as one uint8 tensor under handle first + k (the client fetches
        them), the default generator's state and each ``rc::gen_new`` generator's."""
        base, limit = args
        self._sync([])
        numbers: dict[int, int] = {}
        rows = []
        for h, t in list(self.handles.items()):
            storage = t.untyped_storage()
            k = numbers.get(storage._cdata)
            if k is None:
                k = numbers[storage._cdata] = len(numbers)
                if k >= limit:
                    raise RuntimeError(f"remotecuda: a snapshot of more than {limit} storages")
                self.handles[base + k] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            rows.append([h, k, t.dtype, list(t.shape), list(t.stride()), t.storage_offset(), *_math_bits(t)])
        sizes = [self.handles[base + k].numel() for k in range(len(numbers))]
        return {"handles": rows, "storages": sizes, "rng": self._rng_get([]),
                "gens": [[gid, g.get_state().numpy().tobytes()] for gid, g in self.generators.items()]}

    @internal_op("restore_view", "[storage handle, dtype, shape, stride, offset(, math bits)]", stores=True)
    def _restore_view(self, args: list) -> torch.Tensor:
        """A snapshot's tensor put back: a view of a restored storage, so aliasing is kept, with
        the lazy conjugate's and negative's bits it had (``rc::live``), which give its bytes their
        meaning (a client before them sends none)."""
        src, dtype, shape, stride, offset, *bits = args
        base = self._arg(Handle(src))
        view = torch.empty(0, dtype=dtype, device=base.device).set_(base.untyped_storage(), offset, shape, stride)
        if bits:
            torch._C._set_conj(view, bool(bits[0] & 1))
            torch._C._set_neg(view, bool(bits[0] & 2))
        return view

    @internal_op("gen_get", "[generator id]")
    def _gen_get(self, args: list) -> bytes:
        """A device ``torch.Generator``'s state (its ``get_state()``), as bytes."""
        g = self.generators.get(args[0])
        if g is None:
            raise RuntimeError(f"remotecuda: generator {args[0]} is unknown to the gateway")
        return g.get_state().numpy().tobytes()

    @internal_op("gen_set", "[generator id, state bytes]")
    def _gen_set(self, args: list) -> int:
        """A generator's state put back: ``set_state()``, or a snapshot's (made if the gateway
        does not hold it). Its seed, which the state holds, is the answer."""
        gid, state = args
        g = self.generators.get(gid)
        if g is None:
            g = self.generators[gid] = torch.Generator(device=self.device)
        g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        return g.initial_seed()

    @internal_op("gen_offset", "[generator id or nil, offset or nil]")
    def _gen_offset(self, args: list) -> int | None:
        """A device generator's Philox offset (nil: the device's default generator's): read, as
        ``get_offset()``, or set when given, as ``set_offset()`` (the generator's own check, a
        multiple of 4, decides). A request both ways, so a refusal comes at the call."""
        gid, offset = args
        g = self._philox_generator(gid, "Philox offset (get_offset, set_offset)")
        if offset is None:
            return g.get_offset()
        g.set_offset(offset)
        return None

    @internal_op("gen_graphsafe_get", "[new generator id, source generator id or nil]")
    def _gen_graphsafe_get(self, args: list) -> None:
        """``graphsafe_get_state()``: a new generator sharing the source's state (nil: the device's
        default's), not a copy of it: a draw from either advances both, as a CUDA graph's
        registered generator states need."""
        gid, source = args
        self.generators[gid] = self._philox_generator(source, _GRAPHSAFE).graphsafe_get_state()

    @internal_op("gen_graphsafe_set", "[generator id or nil, state generator id or nil]")
    def _gen_graphsafe_set(self, args: list) -> None:
        """``graphsafe_set_state(state)``: the generator (nil: the device's default) draws from the
        state ``state`` holds from now on, sharing it."""
        gid, state = args
        self._philox_generator(gid, _GRAPHSAFE).graphsafe_set_state(self._philox_generator(state, _GRAPHSAFE))

    def _philox_generator(self, gid: int | None, what: str) -> torch.Generator:
        """A generator whose Philox state a program reaches (nil: the device's default): a CUDA
        generator's. A device served by the CPU has the CPU's Mersenne Twister, which has no such
        state; its refusal says so (the CPU generator's own would blame a 'CPU Generator' the
        program never made)."""
        if self.device.type != "cuda":
            raise NotImplementedError(
                f"remotecuda: this device is served by its gateway's CPU, whose generator (a Mersenne Twister, "
                f"not CUDA's Philox) has no {what}: that needs a gateway serving a GPU")
        g = self._default_generator() if gid is None else self.generators.get(gid)
        if g is None:
            raise RuntimeError(f"remotecuda: generator {gid} is unknown to the gateway")
        return g

    def _default_generator(self) -> torch.Generator:
        """The device's default generator (a worker's CUDA device always names its index)."""
        if self.device.type == "cuda":
            assert self.device.index is not None
            return torch.cuda.default_generators[self.device.index]
        return torch.default_generator

    def _rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    @internal_op("rng_mark", "[decode id, step]")
    def _rng_mark(self, args: list) -> None:
        """Keep the default generator's state as it is after a decode's step."""
        self.rng_marks.setdefault(args[0], {})[args[1]] = self._rng_state()

    @internal_op("rng_rewind", "[decode id, step or nil]")
    def _rng_rewind(self, args: list) -> None:
        """Put the default generator back as it was after that step (the steps after it are
        undone: their draws never happened); nil: none to undo. The decode's marks are dropped
        (a mark a failover's snapshot did not carry is not there: the generator stays as it is)."""
        state = self.rng_marks.pop(args[0], {}).get(args[1])
        if state is not None:
            if self.device.type == "cuda":
                torch.cuda.set_rng_state(state, self.device)
            else:
                torch.set_rng_state(state)

    @internal_op("sdp_choice", "[q, k, v, mask or nil, dropout_p, is_causal, scale, enable_gqa, grad]")
    def _sdp_choice(self, args: list) -> int:
        tensors: list[Any] = [None if h is None else self._arg(Handle(h)).detach() for h in args[:4]]
        return _sdp_choice(*tensors, *args[4:])

    @internal_op("sdpa", "[q, k, v, mask or nil, is_causal, scale, enable_gqa]", stores=True)
    def _sdpa(self, args: list) -> torch.Tensor:
        """Attention as the device's own ``scaled_dot_product_attention`` picks it, without dropout
        or autograd (a decode's step): the output contiguous."""
        q, k, v = (self._arg(a) for a in args[:3])
        mask = None if args[3] is None else self._arg(args[3])
        causal, scale, gqa = args[4:]
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa).contiguous()

    @internal_op("refused", "[op name, error type, message]")
    def _refused(self, args: list) -> None:
        """An op the client could not encode, in its place (session.py ``_sendable``): it fails
        here as the op would have, so its outputs are never computed and the error reaches the
        user at the next sync point, while the ops around it are sent."""
        _, kind, msg = args
        raise _REFUSED_TYPES.get(kind, RuntimeError)(msg)

    @internal_op("set_flags", "[{flag: value}]")
    def _set_flags(self, args: list) -> None:
        """Backend flags such as allow_tf32."""
        for key, value in args[0].items():
            _set_backend_flag(key, value)

    @internal_op("rnn", "[aten op, its arguments, needs or nil, output strides]", stores=True)
    def _rnn(self, args: list) -> Any:
        """Whole recurrent layers: their outputs go to the op's handles."""
        return rnn.forward(self.resolver, *[self._arg(a) for a in args])

    @internal_op("rnn_backward", "[[root handles], [leaf handles], [gradient handle or nil per root]]",
                 stores=True)
    def _rnn_backward(self, args: list) -> Any:
        return rnn.backward(*[self._arg(a) for a in args])

    @internal_op("offer", "[handle, token]")
    def _offer(self, args: list) -> None:
        """Offer a copy of a tensor, as it is now, to the one worker that pulls it with ``token``."""
        h, token = args
        if not (isinstance(token, bytes) and len(token) == peer.TOKEN_BYTES):
            raise ProtocolError("malformed rc::offer: expected [handle, 16-byte token]")
        try:
            host = _host_copy(self._arg(Handle(h)).detach())  # ops after this one may change the tensor
        except Exception as e:
            self.offers.fail(token, f"its source tensor could not be read: {e}")
            self.offered()
            raise
        self.offers.offer(token, host)
        self.offered()

    @internal_op("receive", "[handle, token, peer, dtype, shape]")
    def _receive(self, args: list) -> None:
        """The tensor ``rc::offer`` offered under ``token`` on the worker at ``peer``, pulled by the
        I/O thread when this op arrived: ``handle`` (contiguous) on this device."""
        h, token, _, dtype, shape = args
        t = self.receipts.take(token, dtype, shape, self._cancelled, self.device)
        self.handles[h] = t
        self.invalid.pop(h, None)
        self.stats["transfer_bytes_in"] += t.nbytes

    def _fetch(self, h: int, index: int) -> dict:
        """Tensor h's bytes for the client: a reply payload, or over DOWNLOAD_PARTS_ABOVE parts
        that the worker sends as PART messages (tagged with ``index``, the tensor's place in its
        request) ahead of the reply."""
        t = self._arg(Handle(h)).detach()
        cpu = t.to("cpu") if t.device.type != "cpu" else t
        buf = protocol.tensor_bytes(cpu)
        codec = _LINK.choose(buf, self.codecs)
        self.stats["downloads"] += 1
        if buf.nbytes > protocol.DOWNLOAD_PARTS_ABOVE:
            parts = [protocol.encode_payload(buf[i:i + protocol.PART_BYTES], codec)
                     for i in range(0, buf.nbytes, protocol.PART_BYTES)]
            self.out_parts.append((index, buf.nbytes, parts))
            return {"parts": len(parts), "nbytes": buf.nbytes, "shape": list(cpu.shape), "dtype": cpu.dtype}
        self._out_payloads.append(protocol.encode_payload(buf, codec))
        return {"pl": len(self._out_payloads) - 1, "shape": list(cpu.shape), "dtype": cpu.dtype}

    def _skipped(self, name: str, args: list, why: str) -> None:
        """A skipped upload still keeps the content cache in step with the client's mirror, and
        its parts, on their way, are still taken in (and let go), as are an abandoned one's. A
        skipped copy tells its puller why, or lets its bytes go. A compiled graph is still
        defined: it depends on no tensor, and the client runs it again after the error."""
        if name == "rc::program_define":
            try:
                self._program_define(args)
            except Exception:  # noqa: BLE001 - its own error would have come after the one reported
                pass
        elif name == "rc::offer" and isinstance(args, list) and len(args) == 2:
            self.offers.fail(args[1], f"the source session skipped it ({why})")
            self.offered()
        elif name == "rc::receive" and isinstance(args, list) and len(args) == 5:
            self.receipts.drop(args[1])
        elif name == "rc::upload_abandon" and isinstance(args, list) and len(args) == 2:
            try:
                self.parts.abandon(*args)
            except ProtocolError:
                pass
        elif name == "rc::upload" and isinstance(args, list) and len(args) >= 5 and args[1] is None:
            try:
                self._expect(args)
            except ProtocolError:
                return
            self.dropped.add(args[0])
        elif self.cache is None:
            return
        elif name == "rc::upload" and args[4] is not None:
            up = self._prepared.get(args[0])
            if isinstance(up, Upload):
                self._cache_put(args[4], up)
        elif name == "rc::upload_cached":
            self.cache.get(args[1])

    # ------------------------------------------------------------------ uploads
    def _expect(self, args: list) -> None:
        """An upload sent in PART messages: its handle is pending until the bytes are in. Ops
        that do not touch it run meanwhile, as ops do while a side stream copies (prefetch);
        the first op that does waits for it (``_arg``)."""
        h, _, dtype, shape, key = args[:5]
        last = args[5] if len(args) > 5 else None
        if type(last) is not int:
            raise ProtocolError(f"upload of tensor {h} in parts does not say how many PART messages precede it")
        self.pending[h] = (last, dtype, shape, key)
        self.handles.pop(h, None)
        self.invalid.pop(h, None)

    def _resolve(self, h: int) -> None:
        """Land pending upload h, waiting for its parts if they are not all in yet. An interrupt
        (or the session's end) stops the wait, not the upload: it stays pending, to land later."""
        last, dtype, shape, key = self.pending[h]
        try:
            up = self.parts.take(h, last, dtype, shape, self._cancelled)
            if up is not None:
                del self.pending[h]
                self._land(h, up, key)
        except Exception as e:
            self.pending.pop(h, None)
            self.invalid[h] = f"remotecuda: the upload of this tensor failed: {e}"
            raise
        finally:
            if h in self.dropped and h not in self.pending:  # released (or skipped) before it landed
                self.dropped.discard(h)
                self.handles.pop(h, None)
        if up is None:
            raise RuntimeError("remotecuda: interrupted while this tensor's upload was on its way")

    def _resolve_arrived(self) -> None:
        """Land the pending uploads whose parts are all in (at the start of each message). One
        whose parts failed (past the memory quota) is left to the first op that uses it: the error
        is that op's (raised here, it was the whole message's, a protocol error, when the parts
        happened to be in before the next message came); one released meanwhile goes with it."""
        for h, (last, *_) in list(self.pending.items()):
            if self.parts.received < last:
                continue
            released = h in self.dropped
            if self.parts.has_failed(h) and not released:
                continue
            try:
                self._resolve(h)
            except Exception:
                if not released:
                    raise

    def _land(self, h: int, up: Upload, key: bytes | None) -> None:
        if up.ready is not None:  # copied on the worker's copy stream
            torch.cuda.current_stream(self.device).wait_event(up.ready)
        if key is not None and self.cache is not None:
            if not self._cache_put(key, up):
                raise ProtocolError("upload does not match its content key")
            self.stats["cache_misses"] += 1
        self.handles[h] = up.tensor
        self.invalid.pop(h, None)

    def _cache_put(self, key: bytes, up: Upload) -> bool:
        """Enter an upload's bytes under its key; False if its verified digests do not give that key."""
        if content_key(up.digests) != key:
            return False
        assert self.cache is not None  # (keys are sent only to a session granted a cache)
        self.cache.put(key, up.parts, sum(p.nbytes for p in up.parts))
        return True

    # ------------------------------------------------------------------ memory
    def allocated_bytes(self) -> int:
        """Bytes held by the session's tensors (read by the I/O thread's stats report too)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return cast(CountedHandles, self.handles).allocated

    def memory_stats(self) -> dict:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return {"allocated": torch.cuda.memory_allocated(self.device),
                    "reserved": torch.cuda.memory_reserved(self.device),
                    "peak": torch.cuda.max_memory_allocated(self.device),
                    "free": free, "total": total, "stats": dict(torch.cuda.memory_stats(self.device))}
        counted = cast(CountedHandles, self.handles)
        alloc = counted.recount()
        if self.account is not None:
            free, total = self.account.free(), self.account.size
        else:
            import psutil
            vm = psutil.virtual_memory()
            free, total = vm.available, vm.total
        if self.quota is not None and self.quota.limit is not None:  # what this session may still take
            free = min(free, max(0, self.quota.limit - alloc))
        return {"allocated": alloc, "reserved": alloc + HOST_BLOCKS.free_bytes(), "peak": counted.peak,
                "free": free, "total": total}


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in host memory: pinned from a GPU; on the CPU device a byte copy
    into a recycled block (a fresh block's page faults, and on a busy machine torch's OpenMP
    hand-off, cost more than the copy itself), as uploads are placed."""
    if t.device.type != "cpu":
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    if t.is_contiguous() and t.numel() and not (t.is_conj() or t.is_neg() or t._is_zerotensor()):
        block = HOST_BLOCKS.take(t.numel() * t.element_size())
        np.copyto(block, np.frombuffer(protocol.tensor_bytes(t), dtype=np.uint8))
        return torch.from_numpy(block).view(t.dtype).view(t.shape)
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def _sdp_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float,
                causal: bool, scale: float | None, gqa: bool, grad: bool) -> int:
    """The SDPA backend this device picks for inputs like the client's: the executor's tensors never
    require grad, and the choice depends on it (some kernels have no backward for a case)."""
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return int(torch.ops.aten._fused_sdp_choice(q, k, v, mask, dropout, causal, scale=scale, enable_gqa=gqa))


class CountedHandles(dict):
    """A CPU device's handle table (handle → tensor) that counts the bytes of the storages its
    tensors hold as they come and go, each storage once however many views share it: the
    memory figures, peak included, are exact at every op, as CUDA's allocator keeps them, not
    sampled between messages. A storage is known by its StorageImpl (``_cdata``), which an
    in-place resize keeps; such a resize is counted at the next ``recount`` (a memory query)."""

    def __init__(self, account: MemoryAccount | SessionQuota | None = None) -> None:
        super().__init__()
        self.storages: dict[int, list] = {}  # StorageImpl → [tensors in the table on it, bytes counted]
        self.held: dict[int, tuple] = {}  # handle → the StorageImpls counted for its tensor
        self.allocated = self.peak = 0
        #: a simulated GPU's shared account: new storages are taken from it (or refused), freed ones given back
        self.account = account

    def __setitem__(self, h: int, t: torch.Tensor) -> None:
        held = self.held
        if h in held:
            self._drop(h)
        if t.layout is torch.strided:  # (the common case, inline: this runs for every op's output)
            s = t.untyped_storage()
            key = s._cdata
            entry = self.storages.get(key)
            if entry is None:
                n = s.nbytes()
                if self.account is not None:
                    self.account.take(n)  # (a refusal leaves the handle out of the table)
                self.storages[key] = [1, n]
                self.allocated += n
                if self.allocated > self.peak:
                    self.peak = self.allocated
            else:
                entry[0] += 1
            held[h] = key
            dict.__setitem__(self, h, t)
            return
        storages = _storages(t)
        new = {s._cdata: s.nbytes() for s in storages if s._cdata not in self.storages}
        if self.account is not None and new:
            self.account.take(sum(new.values()))
        keys = []
        for s in storages:
            keys.append(s._cdata)
            entry = self.storages.setdefault(s._cdata, [0, s.nbytes()])
            if entry[0] == 0:
                self.allocated += entry[1]
            entry[0] += 1
        held[h] = tuple(keys)
        self.peak = max(self.peak, self.allocated)
        dict.__setitem__(self, h, t)

    def pop(self, h: int, default: Any = None) -> Any:
        if h in self.held:
            self._drop(h)
        return dict.pop(self, h, default)

    def __delitem__(self, h: int) -> None:
        self.pop(h)

    def _drop(self, h: int) -> None:
        keys = self.held.pop(h)
        for key in (keys,) if type(keys) is int else keys:
            entry = self.storages[key]
            entry[0] -= 1
            if entry[0] == 0:
                del self.storages[key]
                self.allocated -= entry[1]
                if self.account is not None:
                    self.account.give(entry[1])

    def resize(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """``storage.resize_(nbytes)``, counted at once as CUDA's allocator counts it: growth is
        taken from the account (or refused with its OutOfMemoryError), a shrink given back."""
        entry = self.storages.get(storage._cdata)
        if entry is None:  # (no tensor in the table holds it: nothing counted, nothing to count)
            storage.resize_(nbytes)
            return
        delta = nbytes - entry[1]
        if delta > 0 and self.account is not None:
            self.account.take(delta)
        try:
            storage.resize_(nbytes)
        except BaseException:
            if delta > 0 and self.account is not None:
                self.account.give(delta)
            raise
        if delta < 0 and self.account is not None:
            self.account.give(-delta)
        entry[1] = nbytes
        self.allocated += delta
        self.peak = max(self.peak, self.allocated)

    def recount(self) -> int:
        """Count again from the storages as they are now (catching in-place resizes)."""
        held = list(self.items())
        self.storages, self.held, self.allocated = {}, {}, 0
        account, self.account = self.account, None  # (the bytes are there: settled below, not taken)
        try:
            for h, t in held:
                dict.__delitem__(self, h)
                self[h] = t
        finally:
            self.account = account
        if account is not None:
            account.settle(self.allocated)
        self.peak = max(self.peak, self.allocated)
        return self.allocated

    def reset_peak(self) -> None:
        self.peak = self.allocated


#: what ``torch.set_default_dtype`` takes, by name
_DEFAULT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                   "float64": torch.float64}

_FLAGS = {
    "matmul.allow_tf32": lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", bool(v)),
    "cudnn.allow_tf32": lambda v: setattr(torch.backends.cudnn, "allow_tf32", bool(v)),
    "cudnn.benchmark": lambda v: setattr(torch.backends.cudnn, "benchmark", bool(v)),
    "cudnn.deterministic": lambda v: setattr(torch.backends.cudnn, "deterministic", bool(v)),
    "float32_matmul_precision": lambda v: torch.set_float32_matmul_precision(str(v)),
    "cudnn.enabled": lambda v: setattr(torch.backends.cudnn, "enabled", bool(v)),
    "matmul.allow_fp16_reduced_precision_reduction":
        lambda v: setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", _reduction(v)),
    "matmul.allow_bf16_reduced_precision_reduction":
        lambda v: setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", _reduction(v)),
    "deterministic_algorithms": lambda v: _set_deterministic(bool(v[0]), bool(v[1])),
    "cublas_workspace_config": lambda v: _set_cublas_workspace_config(v),
    "fill_uninitialized_memory": lambda v: torch._C._set_deterministic_fill_uninitialized_memory(bool(v)),
    "matmul.allow_fp16_accumulation": lambda v: torch._C._set_cublas_allow_fp16_accumulation(bool(v)),
    "preferred_linalg_library": lambda v: _prefer("_set_linalg_preferred_backend", torch._C._LinalgBackend, v),
    "preferred_blas_library": lambda v: _prefer("_set_blas_preferred_backend", torch._C._BlasBackend, v),
    "default_dtype": lambda v: torch.set_default_dtype(_DEFAULT_DTYPES[str(v)]),
    # which attention backends ``_fused_sdp_choice`` may pick (``sdpa_kernel``), and in what order
    "sdp.flash": lambda v: torch._C._set_sdp_use_flash(bool(v)),
    "sdp.mem_efficient": lambda v: torch._C._set_sdp_use_mem_efficient(bool(v)),
    "sdp.math": lambda v: torch._C._set_sdp_use_math(bool(v)),
    "sdp.cudnn": lambda v: torch._C._set_sdp_use_cudnn(bool(v)),
    "sdp.overrideable": lambda v: torch._C._set_sdp_use_overrideable(bool(v)),
    "sdp.priority_order": lambda v: torch._C._set_sdp_priority_order([int(x) for x in v]),
    "sdp.math_fp16_bf16_reduction": lambda v: torch._C._set_math_sdp_allow_fp16_bf16_reduction(bool(v)),
}


def _set_deterministic(mode: bool, warn_only: bool) -> None:
    """``torch.use_deterministic_algorithms`` but for its import of inductor (and Dynamo), which
    held the session's ops for seconds where no graph may ever be compiled: inductor's own setting
    is set here once it is loaded, and by programs.py before it compiles."""
    config: Any = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.deterministic = mode
    torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)


#: the worker's own ``CUBLAS_WORKSPACE_CONFIG`` (the gateway's environment), what a client's unset restores
_CUBLAS_WORKSPACE_CONFIG = os.environ.get("CUBLAS_WORKSPACE_CONFIG")


def _set_cublas_workspace_config(value: str | None) -> None:
    """The program's ``CUBLAS_WORKSPACE_CONFIG`` (None: it has none), in this worker's environment,
    where torch reads it: at the first cuBLAS call, deterministic algorithms on, a value other than
    ``:4096:8`` or ``:16:8`` makes every cuBLAS op raise, and the workspace is sized by it. Left in
    the client's environment only, a program that set it (transformers' ``enable_full_determinism``
    does) had every matmul on a GPU gateway refused."""
    value = _CUBLAS_WORKSPACE_CONFIG if value is None else str(value)
    if value is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = value


def _prefer(setter: str, enum: Any, name: Any) -> None:
    """A CUDA library choice (cuSOLVER or MAGMA, cuBLAS or cuBLASLt), by its enum member's name, made
    where CUDA runs; a gateway without CUDA has neither library (its torch would refuse the choice)
    and its CPU kernels use neither."""
    if torch.cuda.is_available():
        getattr(torch._C, setter)(getattr(enum, str(name)))


def _reduction(v: Any) -> bool | tuple:
    """A reduced-precision-reduction setting: a bool, or (allow_reduced_precision, allow_splitk)."""
    return tuple(bool(x) for x in v) if isinstance(v, (list, tuple)) else bool(v)


#: the (backend, op) pairs of torch's fp32_precision API a client sets (remotecuda/flags.py)
_FP32_PRECISION = {"generic.all", "cuda.all", "cuda.matmul", "cuda.conv", "cuda.rnn"}


def _set_backend_flag(key: str, value: Any) -> None:
    kind, _, pair = key.partition(".")
    if kind == "fp32_precision" and pair in _FP32_PRECISION:
        backend, op = pair.split(".")
        torch._C._set_fp32_precision_setter(backend, op, str(value))  # type: ignore[call-arg]  # (stub: 2)
        return
    setter = _FLAGS.get(key)
    if setter is None:
        raise UnknownOpError(f"unknown backend flag {key!r}")
    setter(value)


def _math_bits(t: torch.Tensor) -> list[int]:
    """A tensor's lazy conjugate (1) and negative (2) bits, as a snapshot row keeps them: none
    when neither is set (the row a client before them expects)."""
    bits = int(t.is_conj()) | int(t.is_neg()) << 1
    return [bits] if bits else []


def _storages(t: torch.Tensor) -> list:
    """The storages holding a tensor's data; sparse layouts have no storage of their own."""
    if t.layout is torch.strided:
        return [t.untyped_storage()]
    if t.layout is torch.sparse_coo:
        return [x.untyped_storage() for x in (t._indices(), t._values())]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values())
    elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    else:
        return []
    return [x.untyped_storage() for x in parts]
