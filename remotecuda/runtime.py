"""The runtime: everything an active remotecuda holds, in one object.

``remotecuda.activate()`` starts a ``Runtime`` (``start``) and ``deactivate()`` stops it
(``stop``): it closes its sessions, undoes interception and is dropped, so nothing it held
outlives it, and the next ``activate()`` begins afresh. What it owns:

- ``pool``: the gateways, the virtual devices, where each is placed, one session per device
  and the background flusher (pool.py);
- ``dispatcher``: the op dispatcher, with its op table, its metadata cache and counters, and
  its per-thread state (dispatch.py);
- ``interception``: torch's patched functions and the dispatch mode, undone by ``close``
  (interception.py; installed by ``start``, which is given the installer, so that this
  module sits below the ones that reach the runtime);
- torch.cuda's process state: ``current_device``, the current and default streams, and what a
  session opened later must start with (``seed``, the backend ``flags``; see ``prime``);
- ``sdpa_choices``: the attention backend each device picks, per input signature
  (attention.py), which depends on the gateways' GPUs;
- ``codecs``: the payload codecs this client offers (``REMOTECUDA_CODECS``, read at start);
- ``tracer``: the trace being recorded, or the last one recorded (trace.py), or None;
- ``log_handler``: where the "remotecuda" logger's lines (a device's placement) go while no
  logging is configured (``log_to_stderr``).

Modules keep no state of their own that belongs to it. Code that runs only while remotecuda
is active (the ``torch.cuda`` replacements, the patched torch functions) reaches it with
``current()``; code that asks whether it is active uses ``active()``. On the per-op path the
dispatcher is reached without either: the dispatch mode and ``RemoteTensor.dispatch`` hold
the runtime's ``Dispatcher.dispatch`` while it is installed.
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from remotecuda_wire import protocol

from . import children, forked_child
from .dispatch import Dispatcher
from .dispatch_cache import DispatchCache
from .errors import RemoteCUDAError
from .pool import Pool, VirtualDevice
from .scheduler import DEFAULT_STRATEGY, Pin
from .session import Session


class NotActiveError(RemoteCUDAError):
    """A remotecuda function was called while remotecuda is not active."""


class Installed(Protocol):
    """What installing interception leaves: ``remove`` puts torch back as it was;
    ``adopt_thread`` gives the calling thread the dispatch mode if it was started before."""

    def remove(self) -> None: ...

    def adopt_thread(self) -> bool: ...


class Runtime:
    """One activation of remotecuda (see the module's docstring for what it owns)."""

    def __init__(self, servers: list[str], *, fallback: str = "cpu", sync: bool = False,
                 strategy: str = DEFAULT_STRATEGY, devices: Sequence[Pin] | None = None,
                 told: dict[str, str] | None = None, replay: bool = False) -> None:
        #: whether repeated top-level module calls are traced and replayed (step_replay.py)
        self.replay = replay
        #: the options the program gave ``activate()``, as the environment variables that the
        #: processes it starts are told of (children.py)
        self.told = told or {}
        #: the program asked CUDA what makes a GPU's children forked from now on bad forks
        #: (``is_available``...; the first use of a device is the pool's ``initialized``)
        self.asked = False
        self.current_device = 0
        #: the last ``manual_seed``/``manual_seed_all``, for sessions opened later
        self.seed: int | None = None
        #: the backend flags set so far (flags.py), for sessions opened later
        self.flags: dict[str, Any] = {}
        #: device index → its current stream (``torch.cuda.set_stream``), and its default stream
        self.current_streams: dict[int, Any] = {}
        self.default_streams: dict[int, Any] = {}
        #: device index → its default generator's stand-in (``torch.cuda.default_generators``)
        self.default_generators: dict[int, Any] = {}
        #: the CUDA graph being captured (cuda_graphs.py), or None
        self.capturing: Any = None
        #: inside a decode (decode.py): attention runs as the gateway's own SDPA, with no choice asked
        self.decoding = False
        #: ``torch.set_default_tensor_type`` named a CUDA type (legacy_types.py): 'cuda' is the default
        #: device by it, and ``torch.Tensor(...)`` builds there
        self.default_type_cuda = False
        #: another library's tensor subclass → the class of remote tensors that are one (tensor_subclasses.py)
        self.remote_subclasses: dict[type, type] = {}
        #: (device kind, input layouts and options) → the attention backend the gateway picked
        self.sdpa_choices: dict[tuple, int] = {}
        #: each optimizer whose step on 'cuda' parameters waited for the work before it → the
        #: dispatcher's ``largest_new`` then (interception: it waits again once that grows)
        self.stepped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        #: the dispatcher's ``largest_new`` when a backward pass on 'cuda' tensors last waited for
        #: its forward pass's work; -1 before the first (interception)
        self.backward_waited_at = -1
        self.codecs = protocol.enabled_codecs(os.environ.get("REMOTECUDA_CODECS"))
        check = os.environ.get("REMOTECUDA_CHECK_CACHE", "") not in ("", "0")
        self.dispatcher = Dispatcher(self.session, DispatchCache(check=check))
        self.log_handler = log_to_stderr()
        self._make_pool = functools.partial(Pool, servers=servers, devices=devices, strategy=strategy,
                                            fallback=fallback, sync=sync, codecs=self.codecs, prime=self.prime)
        try:
            self._pool: Pool | None = self._make_pool()
        except BaseException:
            self._unlog()
            raise
        self.interception: Installed | None = None
        #: the trace (trace.Tracer) recording, or the last one recorded, for ``save``; None before one
        self.tracer: Any = None

    @property
    def pool(self) -> Pool:
        """The pool; in a child forked before CUDA's initialization, made at its first need
        (``forked_before_initialization``)."""
        pool = self._pool
        if pool is None:
            pool = self._pool = self._make_pool()
        return pool

    def initialized(self) -> bool:
        """Whether CUDA is initialized as a GPU's fork handler sees it (torch's ``poison_fork``):
        a device was used, or ``is_available()`` asked. A child forked after that is a bad fork."""
        return self.asked or (self._pool is not None and self._pool.initialized)

    def forked_before_initialization(self) -> None:
        """In a child forked before CUDA's initialization, which may use CUDA as a GPU's may:
        the parent's pool is dropped (its sockets are the parent's), and the child gets one of its
        own, with its own sessions, at its first need, placed by the parent's strategy now. The rest
        of the runtime is the child's as torch.cuda's state is a GPU child's: the parent's seed and
        flags apply to its sessions (a GPU's torch queues them until CUDA initializes). A parent on
        the local fallback gateway hands it to the child, which would start another."""
        parent = self._pool
        if parent is None:
            return
        parent.abandon()
        self._make_pool = functools.partial(self._make_pool, strategy=parent.strategy)
        if parent.fallback_endpoint is not None:
            self._make_pool = functools.partial(self._make_pool, servers=[parent.fallback_endpoint], devices=None)
        self._pool = None

    def device(self, index: int | None = None) -> VirtualDevice:
        """Virtual device ``cuda:index`` (default: the current one), placed if it is not yet (its
        properties are the placed GPU's); an invalid index raises as CUDA does."""
        return self.pool.device(self.current_device if index is None else index)

    def session(self, index: int | None = None) -> Session:
        """The session of ``cuda:index`` (default: the current device), opened on first use."""
        return self.pool.session(self.current_device if index is None else index)

    def prime(self, session: Session) -> None:
        """Bring a newly opened session up to what was set before it opened: the trace recording,
        the seed, the flags."""
        if self.tracer is not None and self.tracer.recording:
            session.trace = self.tracer
        if self.seed is not None:
            session.enqueue("rc::seed", [self.seed], None, None)
        if self.flags:
            session.enqueue("rc::set_flags", [dict(self.flags)], None, None)

    def synchronize(self) -> None:
        """Wait for all queued remote work; raise the first pending remote error."""
        if self._pool is not None:  # (a forked child's pool not made yet: no work)
            self._pool.synchronize()

    def stats(self, reset: bool = False, wait: bool = True) -> dict[str, Any]:
        """The sessions' counters (session.STAT_KEYS) summed, and the dispatch cache's
        (``metadata_cache_*``). ``reset``: start them all from zero again. ``wait=False``: do not
        wait for a session that is blocked in a request (for a status asked from another thread)."""
        total: dict[str, Any] = self.pool.counters(reset=reset, wait=wait)
        total.update(self.dispatcher.cache.info().as_stats())
        if reset:
            self.dispatcher.cache.reset_counters()
        total["devices"] = self.pool.placements()
        total["failovers"] = self.failovers()
        total["replay_log"] = self.replay_log()
        return total

    def failovers(self) -> list[dict[str, Any]]:
        """Each failover so far, oldest first (failover.py): ``when`` (UTC, ISO 8601), ``device``,
        ``from`` and ``to`` ("host:port GPU i"), ``seconds``, ``ops_replayed``, ``snapshot_bytes``,
        ``attempts``, ``cause``, ``placement``. Empty with REMOTECUDA_FAILOVER=off."""
        return self.pool.failover.info() if self.pool.failover is not None else []

    def replay_log(self) -> dict[str, Any]:
        """The replay logs of all sessions together (replay_log.py's ``info``), and whether
        failover is on."""
        total: dict[str, Any] = {"enabled": self.pool.failover is not None, "entries": 0, "ops": 0, "bytes": 0,
                                 "bytes_in_memory": 0, "bytes_spilled": 0, "snapshots": 0, "snapshot_bytes": 0}
        for s in list(self.pool.sessions.values()):
            if s.log is not None:
                for k, v in s.log.info().items():
                    total[k] += v
        return total

    def checkpoint(self) -> None:
        """Snapshot every open session now (``Session.snapshot``): a failover after this replays
        only what follows. Nothing to do with REMOTECUDA_FAILOVER=off."""
        for s in list(self._pool.sessions.values()) if self._pool is not None else []:
            s.snapshot()

    def at_exit(self) -> None:
        """The interpreter's end (an atexit handler, run before the pool's ``close``): wait for the
        work still queued or running, as a CUDA program's end waits for its kernels, so that an
        error in it (the last op's, never read) is not lost. It is printed as an uncaught exception
        is, and the process exits with status 1 once the other exit handlers have run (an exit
        handler's own exception changes no exit status). A gateway found down ends the wait (its
        sessions are lost: liveness.py). A program ended by an interrupt does not wait (below)."""
        if isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
            self._drop_interrupted_work()
            return
        try:
            if self._pool is not None:  # (a forked child that used no device: no pool to make now)
                self._pool.finish()
            return
        except Exception as e:  # noqa: BLE001 - shown as Python shows an uncaught one
            sys.excepthook(type(e), e.with_traceback(None), None)
        atexit.unregister(self.at_exit)
        atexit._run_exitfuncs()  # the others (the pool's close among them), as the exit would
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)

    def _drop_interrupted_work(self) -> None:
        """A program that Ctrl-C ended (an uncaught KeyboardInterrupt, which the interpreter
        leaves in ``sys.last_value``) ends without waiting for its queued remote work: the pool's
        close then ends its sessions, which drop it. The exit waited for all of it in silence
        (up to two RUN_AHEADs of ops: minutes of large matmuls) and only a second Ctrl-C, with a
        traceback of remotecuda's frames, ended it; a GPU's program ends at once (its launch
        queue holds a second of work at most). Said in one line, as the work is lost."""
        if any(s.unfinished for s in list(self.pool.sessions.values())):
            print("remotecuda: interrupted: the remote work the program had queued is dropped, not waited for",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        """Undo interception, then close every session (gateway memory is freed)."""
        if self.interception is not None:
            self.interception.remove()
            self.interception = None
        if self._pool is not None:
            self._pool.close()
        self._unlog()

    def _unlog(self) -> None:
        if self.log_handler is not None:
            logging.getLogger("remotecuda").removeHandler(self.log_handler)
            self.log_handler = None


class _UntilConfigured(logging.StreamHandler):
    """stderr, while the program has configured no logging of its own (then its handlers have the lines)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def log_to_stderr() -> logging.Handler | None:
    """The "remotecuda" logger's level and output: ``REMOTECUDA_LOG`` (a level name: DEBUG, INFO,
    WARNING...) sets its level; where the program configured no logging (the root logger has no
    handler) its lines from INFO (or that level) go to stderr, as "remotecuda: ...", through the
    handler returned (the runtime removes it when it stops); else the program's configuration
    decides, as for any library."""
    logger = logging.getLogger("remotecuda")
    name = os.environ.get("REMOTECUDA_LOG", "").strip().upper()
    if name:
        level = logging.getLevelName(name)
        if not isinstance(level, int):
            raise ValueError(f"REMOTECUDA_LOG={name!r}: a logging level is DEBUG, INFO, WARNING, ERROR or CRITICAL")
        logger.setLevel(level)
    if logging.getLogger().handlers or any(isinstance(h, _UntilConfigured) for h in logger.handlers):
        return None
    if not name and logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    handler = _UntilConfigured(sys.stderr)
    handler.setFormatter(logging.Formatter("remotecuda: %(message)s"))
    logger.addHandler(handler)
    return handler


_current: Runtime | None = None


def current() -> Runtime:
    """The active runtime; NotActiveError when remotecuda is not active."""
    rt = _current
    if rt is None:
        raise NotActiveError("remotecuda is not active (remotecuda.activate() turns it on)")
    return rt


def active() -> Runtime | None:
    """The active runtime, or None."""
    return _current


_mode_stack_len = torch._C._len_torch_dispatch_stack


def active_here() -> bool:
    """Whether 'cuda' means the pool in this thread: remotecuda's dispatch mode is on its stack,
    or the thread is one started before activation (a ``ThreadPoolExecutor``'s worker, used for
    CPU work first), which takes the mode now, as a GPU is every thread's once initialized.
    (The mode is per thread; threads started while active take it at their start.)"""
    if _mode_stack_len():
        return True
    rt = _current
    return rt is not None and rt.interception is not None and rt.interception.adopt_thread()


def start(servers: list[str], install: Callable[[Runtime], Installed], *, fallback: str = "cpu",
          sync: bool = False, strategy: str = DEFAULT_STRATEGY, devices: Sequence[Pin] | None = None,
          told: dict[str, str] | None = None, replay: bool = False) -> Runtime:
    """Make a runtime for ``servers`` (empty: discovery), make it current, and install interception
    with ``install``; the active runtime, if there is one already."""
    global _current
    if _current is not None:
        return _current
    forked_child.leave()  # (a forked child activating itself: torch.cuda is interception's again)
    rt = Runtime(servers, fallback=fallback, sync=sync, strategy=strategy, devices=devices, told=told,
                 replay=replay)
    _current = rt
    try:
        rt.interception = install(rt)
    except BaseException:
        _current = None
        rt.close()
        raise
    atexit.register(rt.at_exit)  # (after the pool's close, so run before it)
    return rt


def stop() -> None:
    """Drop the active runtime and close it; nothing of it stays reachable from here."""
    global _current
    rt, _current = _current, None
    if rt is not None:
        atexit.unregister(rt.at_exit)
        rt.close()


def release_in_forked_child() -> None:
    """In a forked child of an active runtime. Forked before CUDA's initialization, the child
    keeps remotecuda active with a pool of its own (``Runtime.forked_before_initialization``), as
    a GPU's child may initialize CUDA itself. Forked after: drop the parent's runtime without
    closing it (its sockets are the parent's, and a lock another thread held at the fork stays
    held), undoing interception, and leave the child unable to use 'cuda' as a GPU's child is
    (forked_child.py)."""
    global _current
    rt = _current
    if rt is None:
        return
    if not rt.initialized():
        rt.forked_before_initialization()
        return
    _current = None
    atexit.unregister(rt.at_exit)
    if rt.interception is not None:
        rt.interception.remove()
    children.tell_forked(rt.told, rt.pool.fallback_endpoint)
    rt.pool.abandon()
    forked_child.enter(len(rt.pool.devices))
