"""The pool: which gateways are in use, the virtual devices they provide, and
one session per virtual device, opened on first use.

Virtual device ``cuda:N`` is the N-th GPU over the gateways in the order given. When
no gateway answers, the pool starts a gateway on the local CPU (after one warning)
unless ``fallback="error"``, so unchanged code still runs.

The pool knows gateways, devices and sessions only; what a session must be told when it
opens (the seed, backend flags) is the runtime's, handed in as ``prime`` (runtime.py).
"""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from remotecuda_wire import cache, protocol
from remotecuda_wire.lifetime import die_with_parent

from .errors import GatewayUnavailableError, RemoteCUDAError
from .session import BATCH_WINDOW, PING_EVERY, STAT_KEYS, Session, connect, hello

DEFAULT_SERVER = "127.0.0.1:55555"


@dataclass
class VirtualDevice:
    index: int
    endpoint: str
    gpu: int
    props: dict  # the gateway's description of the GPU
    gateway: dict  # the gateway's WELCOME (versions)

    @property
    def kind(self) -> str:
        """"cuda" or "cpu": which device's kernels the gateway runs (the client picks fused ops by it)."""
        return self.props.get("kind", "cuda")


def endpoint(server: str) -> str:
    """'host:port' (or a tcp:// URL) → a ZeroMQ endpoint."""
    server = server.strip()
    if server.startswith("tcp://"):
        return server
    host, sep, port = server.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"remotecuda: a server is HOST:PORT, got {server!r}")
    return f"tcp://{host or '127.0.0.1'}:{port}"


class Pool:
    """The gateways in use, their GPUs as virtual devices, and a session per device.

    ``codecs``: the payload codecs sessions offer; ``prime``: called with each session as it
    opens, before any other op is queued on it.
    """

    def __init__(self, servers: list[str], fallback: str = "cpu", sync: bool = False,
                 connect_timeout: float = 3.0, codecs: Sequence[str] = protocol.CODECS,
                 prime: Callable[[Session], Any] | None = None):
        self.ctx = zmq.Context()
        self.sync = sync
        self.codecs = tuple(codecs)
        self.prime = prime
        #: the upload cache bound that sessions opened from now on ask the gateway for
        self.cache_bytes = int(os.environ.get("REMOTECUDA_CACHE_BYTES", cache.DEFAULT_BYTES))
        self.cache_policy = os.environ.get("REMOTECUDA_CACHE_POLICY", "lru").lower()
        self.devices: list[VirtualDevice] = []
        self.sessions: dict[int, Session] = {}
        self.fallback_gateway: subprocess.Popen | None = None
        self._lock = threading.Lock()
        unreachable = []
        for server in servers:
            ep = endpoint(server)
            try:
                self._add_gateway(ep, connect_timeout)
            except GatewayUnavailableError as e:
                unreachable.append(str(e))
        if not self.devices:
            if fallback == "error":
                raise GatewayUnavailableError(
                    "no RemoteCUDA gateway is reachable (" + "; ".join(unreachable) + "); "
                    "REMOTECUDA_FALLBACK=error forbids running on the local CPU")
            warnings.warn("remotecuda: no gateway is reachable (" + "; ".join(unreachable) + "); "
                          "running 'cuda' work on the local CPU instead", RuntimeWarning, stacklevel=3)
            self._start_local_gateway()
        self._stop = threading.Event()
        self._pending = threading.Event()
        self._flusher = threading.Thread(target=self._background, name="remotecuda-flush", daemon=True)
        self._flusher.start()
        atexit.register(self.close)

    @property
    def is_fallback(self) -> bool:
        return self.fallback_gateway is not None

    def _add_gateway(self, ep: str, timeout: float) -> None:
        sock = connect(self.ctx, ep)
        try:
            info = hello(sock, {"device": None}, timeout, ep)
        finally:
            sock.close(linger=0)
        for d in info["devices"]:
            self.devices.append(VirtualDevice(len(self.devices), ep, d["index"], d, info))

    def _start_local_gateway(self) -> None:
        cmd = [sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
               "--no-discovery", "--quiet"]
        # its own session: Jupyter's "Interrupt kernel" signals the kernel's whole process group,
        # and a SIGINT stops a gateway (ipykernel still terminates it at kernel shutdown)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True, preexec_fn=die_with_parent)  # a killed client's helper
        line = proc.stdout.readline() if proc.stdout else ""  # "READY tcp://127.0.0.1:PORT" once it listens
        if not line.startswith("READY "):
            proc.kill()
            raise GatewayUnavailableError("could not start a local CPU gateway for the fallback")
        self.fallback_gateway = proc
        self._add_gateway(line.split()[1], 60.0)
        for d in self.devices:
            d.props = dict(d.props, name=d.props["name"] + " [local fallback]")

    # ------------------------------------------------------------------ sessions
    def device(self, index: int) -> VirtualDevice:
        """Virtual device ``cuda:index``; an invalid index raises as CUDA does."""
        if not 0 <= index < len(self.devices):
            raise RuntimeError(f"CUDA error: invalid device ordinal (cuda:{index}; remotecuda has "
                               f"{len(self.devices)} device(s))")
        return self.devices[index]

    def session(self, index: int) -> Session:
        """The session of ``cuda:index``, opened (and primed) on first use."""
        s = self.sessions.get(index)
        if s is None:
            with self._lock:
                s = self.sessions.get(index)
                if s is None:
                    d = self.device(index)
                    s = Session(self.ctx, d.endpoint, d.gpu, index, connect_timeout=60.0, sync=self.sync,
                                cache_bytes=self.cache_bytes, cache_policy=self.cache_policy,
                                codecs=self.codecs, wake=self._pending.set)
                    if self.prime is not None:
                        self.prime(s)
                    self.sessions[index] = s
        return s

    def _background(self) -> None:
        """Flush ops that waited a batch window while the user's code did something else, and
        keep idle sessions alive; asleep (no wake-ups) while nothing is queued."""
        while not self._stop.is_set():
            if self._pending.wait(PING_EVERY):
                self._pending.clear()
                time.sleep(BATCH_WINDOW)
            now = time.monotonic()
            for s in list(self.sessions.values()):
                try:
                    if s.maybe_flush(now):
                        self._pending.set()  # it was busy: look again after another window
                except (zmq.ZMQError, RemoteCUDAError):
                    pass  # the session is marked lost; the user's next call says so

    def synchronize(self) -> None:
        """Wait for every session's queued work; raise the first pending remote error."""
        for s in list(self.sessions.values()):
            if not s.closed:
                s.request("rc::sync", [])

    def cancel(self) -> None:
        """Drop every session's queued work (an interrupted cell's), as an interrupt does."""
        for s in list(self.sessions.values()):
            s.cancel()

    def counters(self, reset: bool = False, wait: bool = True) -> dict[str, Any]:
        """The sessions' counters (session.STAT_KEYS) summed; see ``Session.counters``."""
        total: dict[str, Any] = dict.fromkeys(STAT_KEYS, 0)
        for s in list(self.sessions.values()):
            for k, v in s.counters(reset=reset, wait=wait).items():
                total[k] += v
        return total

    def close(self) -> None:
        """Close every session (BYE: the gateway frees its memory) and the local fallback gateway."""
        if getattr(self, "_stop", None) is None or self._stop.is_set():
            return
        atexit.unregister(self.close)
        self._stop.set()
        self._pending.set()  # wake the flusher, which then ends
        if self._flusher is not threading.current_thread():
            self._flusher.join(timeout=1.0)  # (a send to a gone gateway may hold it; it ends after)
        for s in list(self.sessions.values()):
            try:
                s.close()
            except Exception:  # closing must never raise at exit
                pass
        self.sessions.clear()
        if self.fallback_gateway is not None:
            self.fallback_gateway.terminate()
            try:
                self.fallback_gateway.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.fallback_gateway.kill()
        self.ctx.term()

    def abandon(self) -> None:
        """In a forked child: forget the parent's sessions without touching their sockets."""
        atexit.unregister(self.close)
        self.sessions = {}


def servers_from_env(servers: str | list[str] | None) -> list[str]:
    if servers is None:
        servers = os.environ.get("REMOTECUDA_SERVERS") or DEFAULT_SERVER
    if isinstance(servers, str):
        servers = [s for s in servers.split(",") if s.strip()]
    return list(servers)
