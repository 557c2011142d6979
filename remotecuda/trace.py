"""Traces: where a program's time goes, as a Chrome trace-event file (Perfetto, chrome://tracing).

``start()`` records, for every session of the active runtime (and those opened later):

- each op: issued on the client (an "X" event from its issue to the reply that showed it done,
  on the track "cuda:N ops"), and run on the gateway (the gateway's own start and duration,
  on the gateway's process, track "GPU g (cuda:N)");
- each message sent (OPS, PART) with its bytes; each upload and download with its bytes;
- each blocking wait, with what caused it (the request: a value read, a synchronize...) and the
  line of the program that asked for it.

The gateway times ops only for messages that ask it to (``"trace": true`` in an OPS body) and
sends the spans back with its next REPLY (docs/PROTOCOL.md, "Traces"); on a CUDA device it then
synchronizes after each op, so that a span is the op's run time, not its launch's. Gateway
times are moved onto the client's clock with the offset liveness.py estimates from its PING
round trips (gateway time - (sent + received) / 2, from the shortest recent round trip; its
error is at most half that round trip, which the file records). While nothing records, each
hook in session.py costs one attribute check.

``save`` (and ``stop``) first wait for the work queued so far, so that every op recorded has
its gateway span; that wait is in the trace too, caused by the line that saved it.
"""
from __future__ import annotations

import json
import linecache
import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from . import runtime

#: what a blocking request waits for, as a trace shows it
CAUSES = {
    "rc::fetch": "a value read on the client (.item(), .cpu(), .tolist(), print, a data-dependent shape...)",
    "rc::fetch_many": "tensors read together (torch.save, Module.cpu(), remotecuda.fetch)",
    "rc::sync": "synchronize (torch.cuda.synchronize, the end of a cell or program, a trace save)",
    "rc::memory": "memory statistics (torch.cuda.memory_*)",
    "rc::event_elapsed": "Event.elapsed_time",
    "rc::sdp_choice": "the attention backend's choice",
    "aten::_local_scalar_dense.default": "a Python number read from a tensor (.item(), float(), int(), bool(), if)",
}
#: frames of these directories are the runtime's or torch's, not the program's
_OURS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
#: seconds ``save`` waits for liveness.py's first clock sample of a gateway
CLOCK_WAIT = 3.0


class Tracer:
    """The events of one trace (see the module's docstring). Its hooks run on the threads that
    send (the program's, the pool's flusher), under their session's lock."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.t0 = time.monotonic()
        self.recording = True
        #: (execution count, start, end) of each notebook cell run while recording (ipython.py)
        self.cells: list[tuple[Any, float, float]] = []
        self._lock = threading.Lock()
        self._events: list[tuple] = []  # (session, track, name, start, end, args) on the client's clock
        self._spans: list[tuple] = []  # (session, op index, op name, gateway start, seconds)
        self._issued: dict[tuple[Any, int], tuple[str, float]] = {}  # (session, op index) → (name, when)
        self._inflight: dict[Any, list] = {}  # session → [(op index, name, issued, sent)]
        self._names: dict[tuple[Any, int], str] = {}  # (session, op index) → op name
        self._sending: dict[Any, float] = {}  # session → when its OPS message began

    # ------------------------------------------------------------------ hooks (session.py)
    def issued(self, s: Any, name: str) -> None:
        """The op just queued in ``s``."""
        self._issued[(s, s._op_index + len(s._ops) - 1)] = (name, time.monotonic())

    def sending(self, s: Any, body: dict) -> None:
        """``s`` is about to send the OPS message ``body``."""
        now = time.monotonic()
        self._sending[s] = now
        first = body["n0"]
        with self._lock:
            inflight = self._inflight.setdefault(s, [])
            for i, op in enumerate(body["ops"]):
                name, when = self._issued.pop((s, first + i), (op[0], now))
                self._names[(s, first + i)] = name
                inflight.append((first + i, name, when, now))

    def message(self, s: Any, kind: str, nbytes: int) -> None:
        """A message of ``s`` handed to ZeroMQ, ``nbytes`` long."""
        now = time.monotonic()
        start = self._sending.pop(s, now) if kind == "OPS" else now
        self._add(s, "messages", kind, start, now, {"bytes": nbytes})

    def transfer(self, s: Any, kind: str, nbytes: int, wire: int | None, start: float,
                 parts: int = 0, cached: bool = False) -> None:
        """An upload (queued, or sent in ``parts``) or a download of ``nbytes`` (``wire``: as sent)."""
        args: dict = {"bytes": nbytes}
        if wire is not None:
            args["wire_bytes"] = wire
        if parts:
            args["parts"] = parts
        if cached:
            args["cached"] = True  # the gateway's cache holds it: only its key was sent
        self._add(s, "transfers", kind, start, time.monotonic(), args)

    def waited(self, s: Any, name: str, index: int, start: float, spans: Any) -> None:
        """A blocking request ``name`` (op ``index``) of ``s`` answered: the wait, the ops it shows
        done (all sent before it), and the gateway's spans that came with the answer."""
        now = time.monotonic()
        self._add(s, "waits", f"wait: {name}", start, now,
                  {"cause": cause(name), "caller": _caller(), "op_index": index})
        with self._lock:
            inflight = self._inflight.get(s, [])
            done = [op for op in inflight if op[0] <= index]
            self._inflight[s] = [op for op in inflight if op[0] > index]
            for i, op_name, issued, sent in done:
                self._events.append((s, "ops", op_name, issued, now,
                                     {"op_index": i, "sent_us": round((sent - issued) * 1e6, 3)}))
            for span in spans if isinstance(spans, list) else ():
                if isinstance(span, list) and len(span) == 3:
                    i, begin, seconds = span
                    self._spans.append((s, i, self._names.get((s, i), "?"), begin, seconds))

    def _add(self, s: Any, track: str, name: str, start: float, end: float, args: dict) -> None:
        with self._lock:
            self._events.append((s, track, name, start, end, args))

    # ------------------------------------------------------------------ control
    def attach(self, sessions: Iterable[Any]) -> None:
        """Hook into ``sessions`` (under each one's lock: its hooks run under it, and read ``trace`` twice)."""
        for s in sessions:
            with s.lock:
                s.trace = self

    def collect(self) -> None:
        """Wait for the work queued so far: its ops' replies (and gateway spans) come back."""
        self.pool.synchronize()

    def stop(self) -> None:
        """Collect what is queued, then record nothing more (what was recorded stays, to save)."""
        if not self.recording:
            return
        try:
            self.collect()
        finally:
            self.recording = False
            for s in list(self.pool.sessions.values()):
                with s.lock:
                    if s.trace is self:
                        s.trace = None

    # ------------------------------------------------------------------ the file
    def export(self, since: float | None = None, until: float | None = None) -> dict:
        """The trace as a Chrome trace-event object ({"traceEvents": [...]}, times in µs from the
        trace's start); ``since``/``until`` (monotonic seconds): only the events that begin then."""
        lo, hi = (-float("inf") if since is None else since), (float("inf") if until is None else until)
        with self._lock:
            events, spans = list(self._events), list(self._spans)
        clocks = self._clocks({s.endpoint for s, *_ in spans})
        pid = os.getpid()
        out: list[dict] = [_meta("process_name", pid, 0, name=f"client {os.uname().nodename} pid {pid}"),
                           _meta("process_sort_index", pid, 0, sort_index=0)]
        tids: dict[tuple[int, str], int] = {}

        def tid(p: int, track: str) -> int:
            key = (p, track)
            if key not in tids:
                tids[key] = len(tids) + 1
                out.append(_meta("thread_name", p, tids[key], name=track))
                out.append(_meta("thread_sort_index", p, tids[key], sort_index=tids[key]))
            return tids[key]

        ops, kept = set(), set()  # the ops recorded, and those in the part exported
        for s, track, name, start, end, args in sorted(events, key=lambda e: e[3]):
            if track == "ops":
                ops.add((s, args["op_index"]))
            if lo <= start < hi:
                if track == "ops":
                    kept.add((s, args["op_index"]))
                out.append(_complete(name, track, pid, tid(pid, f"cuda:{s.vdev} {track}"), start - self.t0,
                                     end - start, dict(args, device=f"cuda:{s.vdev}")))
        gateways: dict[str, int] = {}
        for s, i, name, begin, seconds in sorted(spans, key=lambda e: e[3]):
            start = begin - clocks[s.endpoint][0]
            if (s, i) not in kept if (s, i) in ops else not lo <= start < hi:  # (an op's run goes with its issue)
                continue
            if s.endpoint not in gateways:
                gateways[s.endpoint] = gpid = pid + 1 + len(gateways)  # (ints: some viewers want them)
                out.append(_meta("process_name", gpid, 0, name=f"gateway {s.endpoint.removeprefix('tcp://')}"))
                out.append(_meta("process_sort_index", gpid, 0, sort_index=len(gateways)))
            gpid = gateways[s.endpoint]
            out.append(_complete(name, "gateway", gpid, tid(gpid, f"GPU {s.gpu} (cuda:{s.vdev})"),
                                 start - self.t0, seconds, {"op_index": i, "device": f"cuda:{s.vdev}"}))
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"clocks": {ep.removeprefix("tcp://"): {"offset_us": round(o * 1e6, 3),
                                                                     "error_bound_us": None if r is None
                                                                     else round(r / 2 * 1e6, 3)}
                                         for ep, (o, r) in clocks.items()}}}

    def _clocks(self, endpoints: set[str]) -> dict[str, tuple[float, float | None]]:
        """Each gateway's clock offset and the round trip of its estimate (None: none came; offset 0)."""
        liveness = self.pool.liveness
        deadline = time.monotonic() + CLOCK_WAIT
        out: dict[str, tuple[float, float | None]] = {}
        for ep in endpoints:
            clock = liveness.clock(ep)
            while clock is None and time.monotonic() < deadline:  # (a trace saved within a second of its start)
                time.sleep(0.05)
                clock = liveness.clock(ep)
            out[ep] = clock if clock is not None else (0.0, None)
        return out

    def save(self, path: str, since: float | None = None, until: float | None = None) -> str:
        """Write the trace (or the part of it that began between ``since`` and ``until``) to ``path``."""
        if self.recording:
            self.collect()
        data = self.export(since, until)
        with open(path, "w") as f:
            json.dump(data, f)
        return path


def cause(request: str) -> str:
    """What made the program wait for the request ``request``, in words."""
    if request in CAUSES:
        return CAUSES[request]
    if request.startswith("aten::"):
        return f"{request}, whose outputs the gateway describes (their shape depends on the data, or no meta kernel)"
    return request


def _complete(name: str, cat: str, pid: int, tid: int, start: float, seconds: float, args: dict) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": round(start * 1e6, 3),
            "dur": round(max(seconds, 0.0) * 1e6, 3), "args": args}


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _caller() -> str | None:
    """'file:line: source' of the program's innermost frame (the first outside remotecuda and torch)."""
    torch_dir = os.path.dirname(sys.modules["torch"].__file__ or "") + os.sep if "torch" in sys.modules else None
    f: Any = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_OURS) or (torch_dir and name.startswith(torch_dir)) or name.startswith("<frozen")):
            line = linecache.getline(name, f.f_lineno).strip()
            return f"{name}:{f.f_lineno}" + (f": {line}" if line else "")
        f = f.f_back
    return None


# ---------------------------------------------------------------------- the API
def start() -> Tracer:
    """Start a new trace of the active runtime's sessions (those opened later too)."""
    rt = runtime.current()
    if rt.tracer is not None and rt.tracer.recording:
        rt.tracer.stop()
    rt.tracer = tracer = Tracer(rt.pool)
    tracer.attach(list(rt.pool.sessions.values()))
    return tracer


def current() -> Tracer | None:
    """The active runtime's trace (recording or stopped), or None."""
    rt = runtime.active()
    return rt.tracer if rt is not None else None


def is_recording() -> bool:
    tracer = current()
    return tracer is not None and tracer.recording


def stop() -> None:
    """Stop recording (after the work queued so far); the trace stays, for ``save``."""
    tracer = current()
    if tracer is not None:
        tracer.stop()


def save(path: str) -> str:
    """Write the trace so far to ``path`` (Chrome trace-event JSON; open it in https://ui.perfetto.dev)."""
    tracer = current()
    if tracer is None:
        raise RuntimeError("remotecuda: no trace to save (remotecuda.trace.start() begins one)")
    return tracer.save(path)


def last_cell() -> dict | None:
    """The trace-event object of the last notebook cell run while tracing (``%remotecuda trace
    on``), or None: what the JupyterLab panel shows as "the last cell's trace"."""
    tracer = current()
    if tracer is None or not tracer.cells:
        return None
    _, since, until = tracer.cells[-1]
    return tracer.export(since, until)
