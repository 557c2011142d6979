"""A session worker: one process per client session, bound to one device.

Why a process: a sticky CUDA error (device-side assert, illegal address) poisons the
whole process's context, so it must cost one session, not everyone on the GPU; and a
session's memory is returned completely when its process ends.

The supervisor starts workers ahead of time (``import torch`` takes seconds) and
hands each one a session. The worker's main thread does socket I/O only, so an
interrupt (CANCEL) is seen while ops run; a second thread executes ops in order.
"""
from __future__ import annotations

import argparse
import os
import queue
import sys
import threading

import zmq

from remotecuda import protocol
from remotecuda.cache import ContentCache
from remotecuda.protocol import ProtocolError


class Worker:
    def __init__(self, backend: str, ident: bytes, device: str):
        import torch  # imported here so that the spare worker pays for it before a client waits

        from .executor import Executor
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.executor = Executor(self.device)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, ident)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(backend)
        self.outbox = self.ctx.socket(zmq.PULL)
        self.outbox.bind(f"inproc://out-{id(self)}")
        self.inbox: queue.Queue = queue.Queue()
        self.client: bytes | None = None
        self.cancel_upto = -1  # messages with seq <= this are dropped
        self.current_seq = -1
        self.closing = False
        self._last_stats: dict = {}

    # ------------------------------------------------------------------ I/O thread
    def serve(self) -> None:
        self.sock.send_multipart([b"READY"])
        exec_thread = threading.Thread(target=self._execute_loop, daemon=True)
        exec_thread.start()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.outbox, zmq.POLLIN)
        while True:
            events = dict(poller.poll(500))
            self._report_stats()
            if self.outbox in events:
                while True:
                    try:
                        frames = self.outbox.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if frames[0].bytes == b"DONE":
                        self.sock.send_multipart([b"CLOSED"])
                        return
                    self.sock.send_multipart([b"OUT", self.client, *frames], copy=False)
            if self.sock in events:
                frames = self.sock.recv_multipart(copy=False)
                kind = frames[0].bytes
                if kind == b"ATTACH":
                    self.client = frames[1].bytes
                    conf = protocol.unpack_body(frames[2].bytes)["cache"] if len(frames) > 2 else {}
                    if conf.get("bytes"):
                        self.executor.cache = ContentCache(conf["bytes"], conf["policy"])
                elif kind == b"MSG":
                    self._on_client_message(frames[1:])
                elif kind == b"CLOSE":
                    self.closing = True
                    self.inbox.put(None)

    def _report_stats(self) -> None:
        """Tell the supervisor this session's counters (for gateway-wide status), when they change."""
        stats = dict(self.executor.stats, memory=self.executor.sample_memory(),
                     cache_entries=len(self.executor.cache.entries) if self.executor.cache else 0,
                     cache_evictions=self.executor.cache.evictions if self.executor.cache else 0)
        if stats != self._last_stats and self.client is not None:
            self._last_stats = stats
            self.sock.send_multipart([b"STATS", protocol.pack_body(stats)])

    def _on_client_message(self, frames: list) -> None:
        try:
            msg = protocol.decode(frames)
        except ProtocolError as e:
            self.inbox.put(("error", str(e)))
            return
        if msg.type == protocol.CANCEL:
            upto = msg.body.get("upto")
            if isinstance(upto, int):
                self.cancel_upto = max(self.cancel_upto, upto)
            self.inbox.put(("cancelled", msg.body.get("rid")))
            return
        try:
            self._prepare(msg)
        except ProtocolError as e:
            self.inbox.put(("error", str(e)))
            return
        except Exception as e:  # a malformed message must never take down the I/O thread
            self.inbox.put(("error", f"malformed OPS message ({type(e).__name__}: {e})"))
            return
        self.inbox.put(("msg", msg))

    def _prepare(self, msg: protocol.Message) -> None:
        """Check and decompress payloads, and copy uploads to the device, while earlier ops run."""
        msg.payloads = [protocol.decode_payload(d, f) for d, f in msg.payloads]
        msg.prepared = {}
        if msg.type != protocol.OPS or not msg.payloads:
            return
        import torch
        ops = msg.body.get("ops")
        for op in ops if isinstance(ops, list) else ():  # the executor reports a malformed list
            if isinstance(op, list) and len(op) == 4 and op[0] == "rc::upload":
                try:
                    _, idx, dtype, shape, _key = op[1]
                    cpu = protocol.tensor_from_bytes(msg.payloads[idx], dtype, shape)
                except (ValueError, TypeError, IndexError, RuntimeError):
                    continue  # the executor reports malformed upload ops to the client
                if self.copy_stream is not None:
                    with torch.cuda.stream(self.copy_stream):
                        t = cpu.to(self.device, non_blocking=True)
                    t.record_stream(torch.cuda.current_stream(self.device))
                    msg.prepared[idx] = (t, self.copy_stream.record_event())
                else:
                    msg.prepared[idx] = (cpu.clone(), None)

    # ------------------------------------------------------------------ executor thread
    def _execute_loop(self) -> None:
        out = self.ctx.socket(zmq.PUSH)
        out.connect(f"inproc://out-{id(self)}")
        try:
            while True:
                item = self.inbox.get()
                if item is None:
                    break
                kind, value = item
                if kind == "error":
                    out.send_multipart(protocol.encode(protocol.ERROR, {"msg": value, "kind": "protocol"}))
                elif kind == "cancelled":
                    self.executor.failed = None  # the interrupt was the user's answer to it
                    out.send_multipart(protocol.encode(protocol.REPLY, {"rid": value, "res": None,
                                                                         "err": None, "cancelled": True}))
                else:
                    self._run_message(value, out)
        finally:
            out.send_multipart([b"DONE"])
            out.close(linger=1000)

    def _run_message(self, msg: protocol.Message, out: zmq.Socket) -> None:
        if msg.type != protocol.OPS:
            out.send_multipart(protocol.encode(protocol.ERROR, {
                "msg": f"unexpected message type {protocol.TYPE_NAMES[msg.type]} in a session",
                "kind": "protocol"}))
            return
        seq = msg.seq
        cancelled = lambda: seq <= self.cancel_upto  # noqa: E731 - read by the executor between ops
        try:
            result, err, payloads = self.executor.run(msg.body, msg.payloads, cancelled,
                                                      getattr(msg, "prepared", None))
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
            try:
                frames = protocol.encode(protocol.REPLY, {"rid": rid, "res": result, "err": err}, payloads)
            except Exception as e:  # e.g. a result msgpack cannot carry
                frames = protocol.encode(protocol.ERROR, {
                    "msg": f"cannot encode the reply to request {rid!r}: {e}", "kind": "protocol"})
            out.send_multipart(frames, copy=False)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="RemoteCUDA session worker (started by the gateway)")
    p.add_argument("--backend", required=True)
    p.add_argument("--ident", required=True)
    p.add_argument("--device", required=True)
    a = p.parse_args(argv)
    # a worker must not outlive its gateway
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    Worker(a.backend, a.ident.encode(), a.device).serve()
    os._exit(0)


if __name__ == "__main__":
    main()
