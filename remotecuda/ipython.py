"""The IPython extension: ``%load_ext remotecuda`` in any IPython kernel.

Loading it activates interception (``'cuda'`` means the configured gateways) and adds,
for every cell:

* an end-of-cell synchronize: the cell's remote work is flushed and waited for before
  the cell ends, so an asynchronous remote error is raised *in the cell that caused it*
  (the cell ends with status ``error``) and the next cell starts clean. A cell that was
  interrupted (or is interrupted in that wait) ends at once, as on a GPU: the work it queued
  before the interrupt is sent and runs on in the background, and the next cell's ops run
  after it (an in-place op dropped would leave its tensor silently stale);
  ``%remotecuda cancel`` drops it;
* per-cell accounting (ops, messages, bytes up/down, blocking round trips, time spent
  waiting for the gateway, the GPUs used), the difference of ``remotecuda.stats()``
  around the cell, shown by ``%remotecuda last`` and published on the Jupyter comm
  target ``remotecuda`` (messages documented in docs/JUPYTER.md).

``%unload_ext remotecuda`` deactivates: torch is exactly as before. ``%reload_ext remotecuda``
keeps the runtime, and the notebook's 'cuda' tensors with it.

Configuration (``c.RemoteCUDA.<trait>`` in ipython/ipython_kernel config), each
overridden by its environment variable: ``servers`` (REMOTECUDA_SERVERS; empty: discovery),
``devices`` (REMOTECUDA_DEVICES), ``strategy`` (REMOTECUDA_STRATEGY), ``cache_bytes``
(REMOTECUDA_CACHE_BYTES), ``fallback`` (REMOTECUDA_FALLBACK, ``cpu``|``error``), ``sync``
(REMOTECUDA_SYNC).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import os
import signal
import sys
import threading
import time
import types
import warnings
from collections.abc import Iterator
from typing import Any

from traitlets import Bool, CaselessStrEnum, Int, Unicode
from traitlets.config import Configurable

from remotecuda_wire.limits import CACHE_BYTES, switch

from .scheduler import STRATEGIES, check_strategy, parse_devices

COMM_TARGET = "remotecuda"
#: the panel's live view: at most this many seconds between two pushes (≤ 2 a second), and a push
#: at least this often while a cell runs (its clock and ops move), from a background thread
PUSH_INTERVAL = 0.5
#: the largest last-cell trace the panel is sent (serialised JSON); a larger one is refused with
#: a pointer to %remotecuda trace last FILE, which has no limit (docs/JUPYTER.md)
TRACE_MAX_BYTES = 32 * 2**20
#: per-cell counters published for each cell (differences of remotecuda.stats())
CELL_KEYS = ("ops", "messages", "bytes_up", "bytes_down", "blocking_round_trips", "uploads",
             "downloads", "cache_hits", "cache_misses", "cache_bytes_saved", "wait_seconds")


class RemoteCUDA(Configurable):
    """RemoteCUDA settings for IPython / Jupyter (``c.RemoteCUDA.servers = "host:port"``)."""

    #: the variables apply_env ignored: hidden from activate(), which would read them again and fail
    ignored_env: tuple[str, ...] = ()

    servers = Unicode("", help="Gateways, 'host:port[,host:port...]', asked directly (all their GPUs "
                               "as cuda:0..N-1). Empty: the gateways that announce themselves on "
                               "multicast (else 127.0.0.1:55555).").tag(config=True)
    devices = Unicode("", help="How many devices and where each may go (REMOTECUDA_DEVICES syntax: "
                               "'2', 'host1:55555/0,any', 'any/A100'). Empty: all the named servers' "
                               "GPUs, or one device from a discovered pool.").tag(config=True)
    strategy = CaselessStrEnum(STRATEGIES, default_value="adaptive",
                               help="How devices are placed on the pool's GPUs: adaptive, load-balancing, "
                                    "memory-aware, latency-optimized.").tag(config=True)
    cache_bytes = Int(CACHE_BYTES, help="Bound of the content-addressed upload cache, in bytes."
                      ).tag(config=True)
    fallback = CaselessStrEnum(("cpu", "error"), default_value="cpu",
                               help="'cpu': run on a local CPU gateway when none answers; "
                                    "'error': fail instead.").tag(config=True)
    sync = Bool(False, help="Make every op synchronous (debugging; like CUDA_LAUNCH_BLOCKING)."
                ).tag(config=True)

    def apply_env(self, env: Any = None) -> list[str]:
        """Environment variables win over configuration files. Returns complaints about
        values that were ignored (a bad variable must not keep a kernel from starting)."""
        env = os.environ if env is None else env
        conv = {"REMOTECUDA_SERVERS": ("servers", str.strip),
                "REMOTECUDA_DEVICES": ("devices", lambda v: parse_devices(v) and v.strip()),
                "REMOTECUDA_STRATEGY": ("strategy", lambda v: v.strip().lower()),
                "REMOTECUDA_CACHE_BYTES": ("cache_bytes", lambda v: int(v.strip())),
                "REMOTECUDA_FALLBACK": ("fallback", lambda v: v.strip().lower()),
                "REMOTECUDA_SYNC": ("sync", lambda v: switch("REMOTECUDA_SYNC", v, False))}
        bad, ignored = [], []
        for var, (trait, f) in conv.items():
            value = env.get(var)
            if value is None or (not value.strip() and trait != "sync"):
                continue
            try:
                setattr(self, trait, f(value))
            except Exception as e:  # TraitError, ValueError
                bad.append(f"remotecuda: ignored {var}={value!r} ({e})")
                ignored.append(var)
        self.ignored_env = tuple(ignored)
        return bad


# ---------------------------------------------------------------------- snapshots

def _rt() -> Any:
    """The active runtime (remotecuda/runtime.py), or None; torch is not imported for it."""
    runtime = sys.modules.get("remotecuda.runtime")
    return None if runtime is None else runtime.active()


def _per_session_ops(rt: Any) -> dict[int, int]:
    """vdev → ops issued so far (sent or queued); read without taking the session locks."""
    if rt is None:
        return {}
    return {vdev: s.counters(wait=False)["ops"] for vdev, s in list(rt.pool.sessions.items())}


def _device_info(rt: Any, d: Any) -> dict:
    """A virtual device: the GPU it is placed on (all None until placed), by which strategy, why."""
    props = d.props or {}
    s = rt.pool.sessions.get(d.index)
    return {"device": f"cuda:{d.index}", "name": props.get("name"), "gateway": d.endpoint or None,
            "gpu": d.gpu if d.placed else None, "total_memory": props.get("total_memory"),
            "kind": props.get("kind"), "simulated": bool(props.get("simulated", False)),
            "session_open": s is not None and s.connected, "placed": d.placed, "pin": str(d.pin),
            "strategy": d.strategy or None, "reason": d.reason or None}


def _rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# ---------------------------------------------------------------------- the extension

class Extension:
    """What ``%load_ext remotecuda`` sets up in one shell."""

    def __init__(self, ip: Any):
        self.ip = ip
        self.config = RemoteCUDA(parent=ip)
        self.notices: list[str] = self.config.apply_env()
        self.activation_error: str | None = None
        self._notices_shown = False
        self.last: dict | None = None
        self.comms: dict[str, Any] = {}
        self._before: tuple | None = None
        self._in_cell = False
        self._activation_pending = False
        self._cell_started: float | None = None  # time.monotonic() at the start of the running cell
        self._pusher: threading.Thread | None = None  # running while a comm is open
        self._pusher_lock = threading.Lock()
        self._push_seq = 0
        self._timeit: Any = None  # IPython's %timeit, which ours wraps while loaded

    # -------------------------------------------------------------- activation
    def activate(self) -> bool:
        import remotecuda
        self.activation_error = None
        self.notices = [n for n in self.notices if not n.startswith("remotecuda: not active")
                        and "local CPU" not in n]
        # the traits stand for the variables ignored with a notice (the pool reads REMOTECUDA_CACHE_BYTES)
        hidden = {var: os.environ.pop(var) for var in self.config.ignored_env if var in os.environ}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                rt = remotecuda.activate(self.config.servers or None, fallback=self.config.fallback,
                                         sync=self.config.sync, strategy=self.config.strategy,
                                         devices=self.config.devices or None)
            except Exception as e:  # no gateway: say so in the notebook, keep the magics usable
                self.activation_error = f"{type(e).__name__}: {e}"
                rt = None
            finally:
                os.environ.update(hidden)
        for w in caught:  # the fallback warning is worth a line in the notebook; others as usual
            if issubclass(w.category, RuntimeWarning) and str(w.message).startswith("remotecuda"):
                self.notices.append(str(w.message))
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        if rt is None:
            self.notices.append(f"remotecuda: not active ({self.activation_error}); "
                                "%remotecuda use HOST:PORT names a gateway")
            return False
        rt.pool.cache_bytes = int(self.config.cache_bytes)  # sessions open lazily, so this still applies
        return True

    def load(self, defer_activation: bool = False) -> None:
        """``defer_activation``: activate at the first execution (or panel connection), not now:
        a kernel then reaches idle without importing torch, which the first cell pays for (as it
        would with local PyTorch), and says there what activation had to say."""
        ip = self.ip
        if self.config not in ip.configurables:
            ip.configurables.append(self.config)
        ip.register_magics(RemoteCUDAMagics(ip, ext=self))
        ip.events.register("pre_execute", self.pre_execute)
        ip.events.register("pre_run_cell", self.pre_run_cell)
        ip.events.register("post_execute", self.post_execute)
        ip.events.register("post_run_cell", self.post_run_cell)
        self._register_comm_target()
        self._hook_kernel_shutdown()
        self._hide_runtime_frames()
        self._debug_frameless_errors()
        self._sync_timeit()
        if defer_activation:
            self._activation_pending, self._notices_shown = True, False
            return
        with interrupts_held():  # (one that came is raised here, at %load_ext's line)
            self.activate()
        self.show_notices()

    def _activate_if_pending(self) -> bool:
        """The kernel's deferred activation, whole: an interrupt that came during it (the first
        cell is slow: it pays for torch's import) is held until it ends. Returns whether one came."""
        if self._activation_pending:
            self._activation_pending = False
            try:
                with interrupts_held():
                    self.activate()
            except KeyboardInterrupt:
                return True
        return False

    def show_notices(self) -> None:
        for n in self.notices:
            print(n, file=sys.stderr)
        self._notices_shown = True

    def unload(self, deactivate: bool = True) -> None:
        """Undo ``load``; ``deactivate``: and close the runtime (not in ``%reload_ext``)."""
        import remotecuda
        ip = self.ip
        for name, cb in (("pre_execute", self.pre_execute), ("pre_run_cell", self.pre_run_cell),
                         ("post_execute", self.post_execute), ("post_run_cell", self.post_run_cell)):
            try:
                ip.events.unregister(name, cb)
            except ValueError:
                pass
        magics = ip.magics_manager.magics.get("line", {})
        if "remotecuda" in magics:
            del magics["remotecuda"]
        if self.config in ip.configurables:
            ip.configurables.remove(self.config)
        for c in list(self.comms.values()):
            try:
                c.close()
            except Exception:
                pass
        self.comms.clear()
        self._unregister_comm_target()
        kernel = getattr(ip, "kernel", None)
        if kernel is not None and "do_shutdown" in vars(kernel):
            del kernel.do_shutdown
        for patched in ("showtraceback", "debugger"):
            if patched in vars(ip):
                delattr(ip, patched)
        if self._timeit is not None:
            self._set_timeit(self._timeit)
            self._timeit = None
        if deactivate:
            remotecuda.deactivate()

    def _hook_kernel_shutdown(self) -> None:
        """Shutdown and restart free the gateway memory at once: every session says BYE.

        Python's atexit is no help in a kernel: its non-daemon threads keep the interpreter
        from reaching atexit until the kernel manager kills the process.
        """
        kernel = getattr(self.ip, "kernel", None)
        if kernel is None or "do_shutdown" in vars(kernel):
            return
        original = kernel.do_shutdown

        def do_shutdown(restart: bool) -> Any:
            close_sessions(timeout=5.0)
            return original(restart)
        kernel.do_shutdown = do_shutdown

    def _hide_runtime_frames(self) -> None:
        """Tracebacks end at the user's line, as with local PyTorch: without remotecuda's frames
        and the meta kernels' below them. (``__tracebackhide__`` cannot do it: IPython always
        shows the last frame, and says how many it skipped.)"""
        ip = self.ip
        if "showtraceback" in vars(ip):
            return
        original = ip.showtraceback

        def showtraceback(exc_tuple: Any = None, *args: Any, **kwargs: Any) -> Any:
            from .errors import hide_runtime_frames
            etype, value, tb = sys.exc_info() if exc_tuple is None else exc_tuple
            if isinstance(value, BaseException) and tb is not None and value.__traceback__ is tb:
                exc_tuple = (etype, value, hide_runtime_frames(value).__traceback__)
            return original(exc_tuple, *args, **kwargs)
        ip.showtraceback = showtraceback

    def _debug_frameless_errors(self) -> None:
        """``%debug`` (and ``%pdb on``) after a remote error shown with no frame (raised at the
        cell's end-of-cell sync, or while its value was shown: no line of the notebook's runs
        there) says so, and how to get one. IPython's debugger read the frame of the last
        traceback, None here, and failed with an AttributeError of its own."""
        ip = self.ip
        if "debugger" in vars(ip):
            return
        original = ip.debugger

        def debugger(force: bool = False) -> Any:
            if (force or ip.call_pdb) and hasattr(sys, "last_traceback") and sys.last_traceback is None:
                print("remotecuda: the last error has no frame to debug: the gateway raised it after "
                      "the line that issued its op had run; %remotecuda sync on, then run the cell "
                      "again, raises it at that line", file=sys.stderr)
                return None
            return original(force)
        ip.debugger = debugger

    def _sync_timeit(self) -> None:
        """``%timeit`` times the remote work, not only its issue: its clock waits for the queued
        work at the start and end of each run (of ``-n`` loops). On a GPU, the launch queue (about
        a thousand kernels) blocks a long run at the device's pace; the gateway's queue is
        unbounded, so without this ``%timeit`` reported the issue rate and its cell then waited,
        at the end-of-cell sync, for every loop it had queued."""
        ip = self.ip
        try:  # the magics instance, not the registered name (IPython 9 loads it lazily on a miss)
            original = ip.magics_manager.registry["ExecutionMagics"].timeit
        except (KeyError, AttributeError):
            return
        if self._timeit is not None:
            return
        self._timeit = original

        @functools.wraps(original)
        def timeit(line: str = "", cell: str | None = None, local_ns: Any = None) -> Any:
            import timeit as stdlib_timeit
            rt = _rt()
            clock = stdlib_timeit.default_timer  # what IPython's %timeit reads at each call
            if rt is None:
                return original(line, cell, local_ns)

            def synced_clock() -> float:
                rt.synchronize()
                return clock()
            stdlib_timeit.default_timer = synced_clock
            try:
                return original(line, cell, local_ns)
            finally:
                stdlib_timeit.default_timer = clock
        self._set_timeit(timeit)

    def _set_timeit(self, fn: Any) -> None:
        for kind in ("line", "cell"):
            self.ip.magics_manager.magics[kind]["timeit"] = fn

    # -------------------------------------------------------------- per cell
    def _snapshot(self) -> tuple | None:
        rt = _rt()
        if rt is None:
            return None
        return (rt, rt.stats(), _per_session_ops(rt), time.monotonic())

    def pre_execute(self) -> None:
        if self._activate_if_pending():  # the interrupt was meant for this cell: it ends at its first line
            self.ip.ast_transformers.append(_RaiseInterrupt(self.ip))
        self._in_cell = False
        self._before = self._snapshot()

    def pre_run_cell(self, info: Any = None) -> None:
        self._in_cell = True
        self._cell_started = time.monotonic()
        if not self._notices_shown:
            self.show_notices()

    def _needs_sync(self) -> bool:
        before = self._before
        rt = _rt()
        if rt is None:
            return False
        if before is None or before[0] is not rt:
            return True
        return _per_session_ops(rt) != before[2] or any(s.queued for s in list(rt.pool.sessions.values()))

    def _end_of_cell(self, result: Any = None) -> BaseException | None:
        """Flush and wait for the cell's remote work; the remote error, if any. The gateway's
        warnings it brings are placed at the last line of ``result``'s cell, if given."""
        rt = _rt()
        if rt is None or not self._needs_sync():
            return None
        if isinstance(getattr(result, "error_in_exec", None), KeyboardInterrupt):
            return _leave_running(rt)
        from . import remote_warnings  # (torch's: imported once a cell has used it)
        place = self._last_line(result)
        try:
            with (contextlib.nullcontext() if place is None else
                  remote_warnings.placed_at(*place, self.ip.user_global_ns)):
                rt.synchronize()
        except KeyboardInterrupt as e:  # the cell ends now, as an interrupted one does
            return _leave_running(rt) or e
        except BaseException as e:  # noqa: BLE001 - a remote error belongs to the cell
            return e
        return None

    def _last_line(self, result: Any) -> tuple[str, int] | None:
        """The file name IPython compiled ``result``'s cell under (its lines are in linecache) and
        the cell's last line: where the cell's end-of-cell sync is."""
        info = getattr(result, "info", None)
        if info is None or not info.raw_cell or not isinstance(result.execution_count, int):
            return None
        raw = info.raw_cell
        code = info.transformed_cell or raw
        name = self.ip.compile.get_code_name(raw, code, result.execution_count)
        return name, max(len(code.rstrip().splitlines()), 1)

    def post_execute(self) -> None:
        _RaiseInterrupt.remove(self.ip)  # (not used: the cell did not compile)
        if self._in_cell:
            return  # post_run_cell follows, with the result to mark
        err = self._end_of_cell()  # a silent execution (e.g. from a widget or panel)
        if err is not None:
            print(f"remotecuda: remote error in a silent execution: {type(err).__name__}: {err}",
                  file=sys.stderr)

    def post_run_cell(self, result: Any) -> None:
        self._in_cell = False
        self._cell_started = None
        failed = result is not None and not result.success
        err = self._end_of_cell(result)
        if err is None and not failed:
            self._name_display_error(result)
        if err is not None:
            if not failed:
                # show it as this cell's error, and make the cell end with status "error"
                if hasattr(err, "add_note") and not isinstance(err, KeyboardInterrupt):
                    err.add_note("[remotecuda] raised at the end of this cell, when its remote "
                                 "work was waited for; %remotecuda sync on, then run the cell "
                                 "again, raises it at the line that issued it")
                # no frames: they would be remotecuda's own, not the line that issued the op
                self.ip.showtraceback(exc_tuple=(type(err), err, None))
                result.error_in_exec = err
                self.ip.last_execution_succeeded = False
            else:
                print(f"remotecuda: also pending from this cell: {type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}", file=sys.stderr)
        self._account(result, err)

    def _name_display_error(self, result: Any) -> None:
        """A remote error met while IPython showed the cell's value (its repr read a tensor whose
        op failed: ``t[bad_index]`` as the last line) is the cell's error. ipykernel fails such a
        cell but, IPython's result holding no error, names none in its reply ("NoneType: None",
        which nbclient and papermill report); locally the op raised it at the cell's line."""
        from .errors import is_remote
        shown = getattr(sys, "last_value", None)
        if (getattr(self.ip, "_last_traceback_during_displayhook", False) and result is not None
                and result.error_in_exec is None and is_remote(shown)):
            result.error_in_exec = shown

    def _account(self, result: Any, err: BaseException | None) -> None:
        before, self._before = self._before, None
        rt = _rt()
        if before is None or rt is None or before[0] is not rt:
            return
        _, stats0, ops0, t0 = before
        stats1 = rt.stats()
        ops1 = _per_session_ops(rt)
        rec: dict = {"type": "cell", "execution_count": getattr(result, "execution_count", None)}
        for k in CELL_KEYS:
            v = stats1.get(k, 0) - stats0.get(k, 0)
            rec[k] = round(v, 6) if isinstance(v, float) else v
        rec["wall_seconds"] = round(time.monotonic() - t0, 6)
        devices = rt.pool.devices
        rec["devices"] = [dict(_device_info(rt, devices[v]), ops=n - ops0.get(v, 0))
                          for v, n in sorted(ops1.items()) if n - ops0.get(v, 0) > 0 and v < len(devices)]
        # ipykernel fails a cell whose result could not be displayed (e.g. repr met a remote
        # error) although IPython's result says success
        display_failed = bool(getattr(self.ip, "_last_traceback_during_displayhook", False))
        ok = (result is None or result.success) and not display_failed
        rec["status"] = "ok" if ok else "error"
        e = err if err is not None else (None if result is None else
                                         result.error_in_exec or result.error_before_exec)
        if e is None and display_failed:
            e = getattr(sys, "last_value", None)
        rec["error"] = None if e is None else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rec["traced"] = rt.tracer is not None and rt.tracer.recording
        if rec["traced"]:  # (%remotecuda trace on: the cell's part of it)
            rt.tracer.cells.append((rec["execution_count"], t0, time.monotonic()))
        self.last = rec
        self.publish(rec)

    # -------------------------------------------------------------- status
    def status(self) -> dict:
        import remotecuda
        rt = _rt()
        cfg = self.config
        st: dict = {"type": "status", "version": remotecuda.__version__, "active": rt is not None,
                    "error": self.activation_error, "servers": cfg.servers or
                    os.environ.get("REMOTECUDA_SERVERS") or "discovery (multicast)",
                    "devices_wanted": cfg.devices or None,
                    "strategy": rt.pool.strategy if rt is not None else cfg.strategy,
                    "fallback": cfg.fallback, "sync": self.sync_on(),
                    "cache_bytes": cfg.cache_bytes, "gateways": [], "devices": [],
                    "fallback_gateway": rt is not None and rt.pool.is_fallback,
                    "found_via": rt.pool.found_via if rt is not None else None}
        if rt is not None:
            gws: dict = {}
            for d in rt.pool.devices:
                st["devices"].append(_device_info(rt, d))
                if not d.placed:
                    continue
                g = gws.setdefault(d.endpoint, {"endpoint": d.endpoint, "devices": [],
                                                "gateway_version": (d.gateway or {}).get("gateway"),
                                                "torch": (d.gateway or {}).get("torch")})
                g["devices"].append(f"cuda:{d.index}")
            st["gateways"] = list(gws.values())
        from .session import STAT_KEYS
        # (without waiting for a session blocked in a request: a status asked for from another
        # thread must not wait for the running cell)
        tot = remotecuda.stats() if rt is None else rt.stats(wait=False)
        st["session"] = {k: round(tot[k], 6) if isinstance(tot[k], float) else tot[k] for k in STAT_KEYS}
        st["cache_hit_rate"] = _rate(tot["cache_hits"], tot["cache_misses"])
        st["metadata_cache"] = {k: v for k, v in tot.items() if k.startswith("metadata_cache_")}
        st["metadata_cache_hit_rate"] = _rate(tot["metadata_cache_hits"], tot["metadata_cache_misses"])
        st["sessions_open"] = len(rt.pool.sessions) if rt is not None else 0
        st["failovers"] = tot.get("failovers", [])  # each device moved off a failed GPU (failover.py)
        st["replay_log"] = tot.get("replay_log")
        st["tracing"] = rt is not None and rt.tracer is not None and rt.tracer.recording
        return st

    def set_tracing(self, on: bool) -> None:
        """``%remotecuda trace on|off`` for the panel (RuntimeError when not active)."""
        from . import trace
        if not on:
            trace.stop()
        elif _rt() is None:
            raise RuntimeError("remotecuda is not active: nothing to trace")
        elif not trace.is_recording():
            trace.start()

    def last_trace(self) -> dict:
        """The last traced cell's trace, as the panel downloads it (ValueError: none, or too large)."""
        import json

        from . import trace
        tracer = trace.current()
        if tracer is None or not tracer.cells:
            raise ValueError("no cell traced yet (turn tracing on, then run a cell)")
        count, since, until = tracer.cells[-1]
        data = tracer.export(since, until)
        size = len(json.dumps(data))
        if size > TRACE_MAX_BYTES:
            raise ValueError(f"the trace of cell [{count}] is {_fmt_bytes(size)}, over the panel's "
                             f"{_fmt_bytes(TRACE_MAX_BYTES)}: %remotecuda trace last FILE writes it")
        return {"type": "trace", "execution_count": count, "bytes": size, "trace": data}

    # -------------------------------------------------------------- comm
    def _register_comm_target(self) -> None:
        if getattr(self.ip, "kernel", None) is None:
            return  # a terminal IPython has no frontend to talk to
        try:
            import comm
            comm.get_comm_manager().register_target(COMM_TARGET, self._on_comm_open)
        except Exception:
            pass

    def _unregister_comm_target(self) -> None:
        if getattr(self.ip, "kernel", None) is None:
            return
        try:
            import comm
            comm.get_comm_manager().unregister_target(COMM_TARGET, self._on_comm_open)
        except Exception:
            pass

    def _on_comm_open(self, c: Any, msg: dict) -> None:
        if threading.current_thread() is threading.main_thread():  # not on a subshell: the
            self._activate_if_pending()  # interception belongs to the thread that activates
            # (an interrupt held during it is dropped: no cell runs for it to end)
        self.comms[c.comm_id] = c
        if hasattr(c, "_reply_subshell_for"):
            # ipykernel ≥ 7.2 sends a comm's incoming messages to the subshell its last outgoing one
            # came from (for widgets that await replies): here the main shell, whose parent the
            # pushes carry, so a request would wait for the running cell. The panel's requests go
            # to the subshell the frontend addressed (docs/JUPYTER.md).
            c._reply_subshell_for = lambda data, default: default

        def on_msg(m: dict) -> None:
            data = (m.get("content") or {}).get("data") or {}
            req = data.get("request")
            if req == "status":
                c.send(self.status())
            elif req == "last":
                c.send(self.last or {"type": "cell", "execution_count": None})
            elif req == "strategy":
                try:
                    self.set_strategy(str(data.get("name", "")))
                except ValueError as e:
                    c.send({"type": "error", "request": "strategy", "error": str(e)})
                c.send(self.status())
            elif req == "trace":
                try:
                    self.set_tracing(bool(data.get("on")))
                except Exception as e:  # noqa: BLE001 - said to the panel, not raised in the kernel
                    c.send({"type": "error", "request": "trace", "error": str(e)})
                c.send(self.status())
            elif req == "last_trace":
                try:
                    c.send(self.last_trace())
                except Exception as e:  # noqa: BLE001
                    c.send({"type": "error", "request": "last_trace", "error": str(e)})

        def on_close(m: dict) -> None:
            self.comms.pop(c.comm_id, None)

        c.on_msg(on_msg)
        c.on_close(on_close)
        c.send(self.status())
        if self.last is not None:
            c.send(self.last)
        self._start_pusher()

    def set_strategy(self, name: str) -> str:
        """The strategy for devices placed from now on (ValueError naming the valid ones)."""
        import remotecuda
        name = check_strategy(name)
        self.config.strategy = name
        if _rt() is not None:
            remotecuda.set_strategy(name)
        return name

    def set_sync(self, on: bool) -> None:
        """Every op synchronous (or not again) from the next one on, in the open sessions and
        those opened later: an asynchronous error is then raised at the line that issued it."""
        self.config.sync = on
        rt = _rt()
        if rt is not None:
            rt.pool.sync = on
            for sess in list(rt.pool.sessions.values()):
                sess.sync = on

    def sync_on(self) -> bool:
        """Whether ops are synchronous: the pool's, which CUDA_LAUNCH_BLOCKING=1 also turns on
        (pool.py, at the first use of a device), else the configuration's."""
        rt = _rt()
        return rt.pool.sync if rt is not None else bool(self.config.sync)

    def live(self) -> dict:
        """The running cell so far (``None`` between cells): what the panel shows while it runs."""
        started, before = self._cell_started, self._before
        if started is None:
            return {"type": "live", "seq": self._push_seq, "running": None}
        running: dict = {"seconds": round(time.monotonic() - started)}
        rt = _rt()
        if rt is not None and before is not None and before[0] is rt:
            now = rt.stats(wait=False)
            running.update({k: now.get(k, 0) - before[1].get(k, 0) for k in ("bytes_up", "bytes_down")})
            # issued, sent or still queued in a batch
            running["ops"] = sum(_per_session_ops(rt).values()) - sum(before[2].values())
        return {"type": "live", "seq": self._push_seq, "running": running}

    def _start_pusher(self) -> None:
        with self._pusher_lock:
            if self._pusher is None:
                self._pusher = threading.Thread(target=self._push_loop, name="remotecuda-panel-push", daemon=True)
                self._pusher.start()

    def _pusher_done(self) -> bool:
        """True (and the thread forgotten) when no comm is left; under the lock, so a comm opened
        meanwhile finds either this thread still going or none and starts one."""
        with self._pusher_lock:
            if self.comms:
                return False
            self._pusher = None
            return True

    def _push_loop(self) -> None:
        """While a panel listens: the status when it changed and, during a cell, its progress,
        at most every PUSH_INTERVAL, from this thread (the shell is busy with the cell; ipykernel's
        IOPub socket takes messages from any thread)."""
        sent_status: dict | None = None
        sent_live: dict | None = None
        while not self._pusher_done():
            time.sleep(PUSH_INTERVAL)
            try:
                st = self.status()
                live = self.live()
            except Exception:  # noqa: BLE001 - a runtime being replaced mid-read; next tick
                continue
            msgs = []
            if st != sent_status:
                msgs.append(st)
                sent_status = st
            if dict(live, seq=0) != sent_live:
                self._push_seq += 1
                sent_live = dict(live, seq=0)
                msgs.append(dict(live, seq=self._push_seq))
            for m in msgs:
                self.publish(m)

    def publish(self, rec: dict) -> None:
        for cid, c in list(self.comms.items()):
            try:
                c.send(rec)
            except Exception:
                self.comms.pop(cid, None)


def close_sessions(timeout: float) -> None:
    """Close the runtime's sessions (BYE to each gateway), from any thread.

    Only the sessions: the interception modes belong to the thread that activated, and
    the process is about to end. Bounded, in case the main thread holds a session blocked
    in a request.
    """
    import threading
    rt = _rt()
    if rt is None:
        return
    t = threading.Thread(target=rt.pool.close, name="remotecuda-shutdown", daemon=True)
    t.start()
    t.join(timeout)


# ---------------------------------------------------------------------- magics

def _magics_class() -> type:
    from IPython.core.error import UsageError
    from IPython.core.magic import Magics, line_magic, magics_class

    def usage(message: str) -> UsageError:
        """A mistake in a ``%remotecuda`` line: IPython shows ``UsageError: ...`` without a traceback
        and the cell fails, so "Run all" stops there (a printed usage let the next cells run on)."""
        return UsageError(f"%remotecuda {message}")

    def no_more(args: list, command: str) -> None:
        if args:
            raise usage(f"{command} takes no argument, got {' '.join(args)!r}")

    @magics_class
    class _RemoteCUDAMagics(Magics):
        """``%remotecuda status|servers|use DEVICES|strategy [NAME]|last|cancel|fallback on|off|sync on|off|
        trace ...``"""

        def __init__(self, shell: Any, ext: Extension):
            super().__init__(shell)
            self.ext = ext

        @line_magic
        def remotecuda(self, line: str) -> None:
            """RemoteCUDA: %remotecuda status | servers | use HOST:PORT[,HOST:PORT] |
            use DEVICES (REMOTECUDA_DEVICES syntax: 2, host1:55555/0,any, any/A100) |
            strategy [adaptive|load-balancing|memory-aware|latency-optimized] | last | cancel |
            fallback on|off | sync on|off | trace on|off|save FILE|last FILE"""
            parts = line.split()
            cmd, args = (parts[0].lower(), parts[1:]) if parts else ("status", [])
            fn = getattr(self, "_cmd_" + cmd.replace("-", "_"), None)
            if fn is None:
                doc = " ".join((type(self).remotecuda.__doc__ or "").split())
                raise usage(f"has no command {parts[0]!r}; usage: {doc.removeprefix('RemoteCUDA: ')}")
            fn(args)

        def _cmd_status(self, args: list) -> None:
            no_more(args, "status")
            st = self.ext.status()
            if not st["active"]:
                print(f"remotecuda: not active{' (' + st['error'] + ')' if st['error'] else ''}; "
                      f"servers: {st['servers']}")
                return
            print(f"remotecuda {st['version']}: active{' on the LOCAL CPU FALLBACK' if st['fallback_gateway'] else ''}")
            print(f"  gateways found via {st['found_via']}")
            for g in st["gateways"]:
                print(f"  gateway {g['endpoint'].replace('tcp://', '')}  (gateway {g['gateway_version']}, "
                      f"torch {g['torch']}): {', '.join(g['devices'])}")
            for d in st["devices"]:
                if not d["placed"]:
                    print(f"  {d['device']}: not placed yet (pin {d['pin']}; placed by {st['strategy']} "
                          "at its first use)")
                    continue
                mem = f", {d['total_memory'] / 2**30:.1f} GiB" if d.get("total_memory") else ""
                print(f"  {d['device']}: {d['name']}{' [simulated]' if d['simulated'] else ''}{mem} "
                      f"(gateway {d['gateway'].replace('tcp://', '')} GPU {d['gpu']}"
                      f"{', session open' if d['session_open'] else ''})\n      {d['reason']}")
            print(f"  fallback: {st['fallback']}; sync: {st['sync']}; strategy: {st['strategy']} "
                  "(for devices placed from now on)")
            hr, mr = st["cache_hit_rate"], st["metadata_cache_hit_rate"]
            print(f"  upload cache: {'n/a' if hr is None else f'{hr:.0%}'} hit rate "
                  f"({_fmt_bytes(st['session']['cache_bytes_saved'])} not re-sent, bound "
                  f"{_fmt_bytes(st['cache_bytes'])})")
            mc = st["metadata_cache"]
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(mc["metadata_cache_bypass_reasons"].items()))
            print(f"  metadata cache: {'n/a' if mr is None else f'{mr:.0%}'} hit rate "
                  f"({mc['metadata_cache_hits']} hits, {mc['metadata_cache_misses']} misses, "
                  f"{mc['metadata_cache_entries']} entries); {mc['metadata_cache_bypasses']} ops "
                  f"described by the gateway{': ' + reasons if reasons else ''}")
            s = st["session"]
            print(f"  this session: {s['ops']} ops in {s['messages']} messages, "
                  f"{_fmt_bytes(s['bytes_up'])} up, {_fmt_bytes(s['bytes_down'])} down, "
                  f"{s['blocking_round_trips']} blocking round trips, "
                  f"{s.get('wait_seconds', 0):.3f} s waiting")
            log = st["replay_log"] or {}
            if log.get("enabled"):
                print(f"  failover: on; replay log {log['ops']} ops, {_fmt_bytes(log['bytes'])} "
                      f"({_fmt_bytes(log['bytes_spilled'])} spilled), {log['snapshots']} snapshot(s)")
            else:
                print("  failover: off (REMOTECUDA_FAILOVER=off)")
            for f in st["failovers"]:
                print(f"  failover {f['when']}: {f['device']} moved from {f['from']} to {f['to']} in "
                      f"{f['seconds']:.2f} s, {f['ops_replayed']} ops replayed ({f['cause']})")

        def _cmd_servers(self, args: list) -> None:
            no_more(args, "servers")
            st = self.ext.status()
            print(f"configured: {st['servers']}" + (f"; found via {st['found_via']}" if st["found_via"] else ""))
            rt = _rt()
            if rt is not None and rt.pool.discovery is not None:
                from .discovery import table
                heard = rt.pool.discovery.snapshot()
                print(table(heard) if heard else "  no gateway is announcing itself now")
            if not st["gateways"]:
                print("  no gateway in use")
            for g in st["gateways"]:
                print(f"  in use: {g['endpoint'].replace('tcp://', '')}: {len(g['devices'])} device(s) "
                      f"({', '.join(g['devices'])})")

        def _cmd_use(self, args: list) -> None:
            """HOST:PORT[,HOST:PORT]: these gateways, all their GPUs (as REMOTECUDA_SERVERS); anything
            else is REMOTECUDA_DEVICES syntax over the pool (a pin's HOST:PORT is asked directly)."""
            import remotecuda
            if len(args) != 1:
                raise usage("use takes one argument: HOST:PORT[,HOST:PORT...] | DEVICES "
                            "(e.g. 2, host1:55555/0,any, any/A100)" + (f", got {' '.join(args)!r}" if args else ""))
            try:
                pins = parse_devices(args[0], "%remotecuda use")
            except ValueError as e:  # (it says the syntax)
                raise UsageError(str(e)) from None
            named = all(p.host is not None and p.port is not None and p.gpu is None for p in pins)
            if remotecuda.is_active():
                print("remotecuda: deactivating; tensors on the previous gateway(s) are gone")
            remotecuda.deactivate()
            if named:
                self.ext.config.servers, self.ext.config.devices = args[0], ""
            else:
                self.ext.config.devices = args[0]
            ok = self.ext.activate()
            self.ext.show_notices()
            if ok:
                pool = remotecuda.runtime.current().pool
                print(f"remotecuda: using {args[0]} ({len(pool.devices)} GPU(s)"
                      f"{', LOCAL CPU FALLBACK' if pool.is_fallback else ''}; found via {pool.found_via})")
            else:
                raise RuntimeError(f"remotecuda: not active ({self.ext.activation_error})")

        def _cmd_strategy(self, args: list) -> None:
            rt = _rt()
            if not args:
                current = rt.pool.strategy if rt is not None else self.ext.config.strategy
                print(f"strategy: {current} (one of {', '.join(STRATEGIES)})")
                return
            if len(args) > 1:
                raise usage(f"strategy takes one name ({', '.join(STRATEGIES)}), got {' '.join(args)!r}")
            try:
                name = self.ext.set_strategy(args[0])
            except ValueError as e:  # (it lists the valid ones)
                raise usage(f"strategy: {e}") from None
            placed = [d for d in rt.pool.devices if d.placed] if rt is not None else []
            print(f"strategy: {name} (for devices placed from now on"
                  + ("; placed already: " + ", ".join(f"cuda:{d.index} on {d.endpoint[6:]} GPU {d.gpu}"
                                                       for d in placed) if placed else "") + ")")

        def _cmd_last(self, args: list) -> None:
            no_more(args, "last")
            rec = self.ext.last
            if rec is None:
                print("no cell accounted yet")
                return
            devs = ", ".join(f"{d['device']} ({d['name']} @ {d['gateway'].replace('tcp://', '')}, "
                             f"{d['ops']} ops)" for d in rec["devices"]) or "none"
            print(f"cell [{rec['execution_count']}] {rec['status']}: {rec['ops']} ops, "
                  f"{rec['messages']} messages, {_fmt_bytes(rec['bytes_up'])} up, "
                  f"{_fmt_bytes(rec['bytes_down'])} down, {rec['blocking_round_trips']} blocking "
                  f"round trips, {rec['wait_seconds']:.3f} s waiting for the gateway of "
                  f"{rec['wall_seconds']:.3f} s; GPUs: {devs}"
                  + (f"; error: {rec['error']}" if rec.get("error") else ""))

        def _cmd_trace(self, args: list) -> None:
            """on | off | save FILE (the trace since "on") | last FILE (the last cell's)."""
            from . import trace
            what = args[0].lower() if args else ""
            if what in ("save", "last") and len(args) == 2:
                tracer = trace.current()
                if tracer is None or what == "last" and not tracer.cells:
                    print("remotecuda: no trace recorded (%remotecuda trace on starts one)")
                    return
                if what == "save":
                    tracer.save(args[1])
                else:
                    _, since, until = tracer.cells[-1]
                    tracer.save(args[1], since, until)
                print(f"remotecuda: trace written to {args[1]} (open it in https://ui.perfetto.dev)")
            elif what == "on" and len(args) == 1:
                if _rt() is None:
                    print("remotecuda: not active: nothing to trace")
                    return
                trace.start()
                print("remotecuda: tracing; %remotecuda trace save FILE writes it, %remotecuda trace last "
                      "FILE the last cell's")
            elif what == "off" and len(args) == 1:
                trace.stop()
                print("remotecuda: tracing off (the trace so far stays, for %remotecuda trace save FILE)")
            elif not args:
                recording = _rt() is not None and trace.is_recording()
                print(f"trace: {'on' if recording else 'off'} "
                      "(usage: %remotecuda trace on|off|save FILE|last FILE)")
            else:
                raise usage(f"trace takes on|off|save FILE|last FILE, got {' '.join(args)!r}")

        def _cmd_cancel(self, args: list) -> None:
            """Drop the remote work still queued or running: an interrupted cell's, which runs on in
            the background (``_leave_running``), when waiting for it is not wanted."""
            no_more(args, "cancel")
            rt = _rt()
            if rt is None or not any(s.unfinished for s in list(rt.pool.sessions.values())):
                print("remotecuda: nothing queued or running to drop")
                return
            rt.pool.cancel()
            rt.synchronize()
            print("remotecuda: dropped the remote work still queued or running: what it was to compute is "
                  "marked never computed; tensors it was to change in place keep the values the part "
                  "that ran gave them")

        def _cmd_sync(self, args: list) -> None:
            if not args:
                print(f"sync: {'on' if self.ext.sync_on() else 'off'} (usage: %remotecuda sync on|off)")
                return
            if len(args) > 1 or args[0].lower() not in ("on", "off"):
                raise usage(f"sync takes on or off, got {' '.join(args)!r}")
            self.ext.set_sync(args[0].lower() == "on")
            print(f"sync: {args[0].lower()} (" + ("every op waits for the gateway: an error is raised at "
                  "its line, and cells run slower" if self.ext.config.sync else "ops run asynchronously")
                  + ")")

        def _cmd_fallback(self, args: list) -> None:
            if not args:
                print(f"fallback: {'on' if self.ext.config.fallback == 'cpu' else 'off'} "
                      "(usage: %remotecuda fallback on|off)")
                return
            if len(args) > 1 or args[0].lower() not in ("on", "off"):
                raise usage(f"fallback takes on or off, got {' '.join(args)!r}")
            self.ext.config.fallback = "cpu" if args[0].lower() == "on" else "error"
            print(f"fallback: {args[0].lower()} (applies when gateways are next connected: "
                  "%remotecuda use HOST:PORT)")

    return _RemoteCUDAMagics


def RemoteCUDAMagics(shell: Any, ext: Extension) -> Any:  # noqa: N802 - built lazily (IPython import)
    return _magics_class()(shell, ext)


# ---------------------------------------------------------------------- entry points

_EXTENSIONS: dict[int, Extension] = {}


def load_ipython_extension(ip: Any, defer_activation: bool = False) -> None:
    if id(ip) in _EXTENSIONS:
        return
    ext = Extension(ip)
    _EXTENSIONS[id(ip)] = ext
    ext.load(defer_activation)


def unload_ipython_extension(ip: Any) -> None:
    ext = _EXTENSIONS.pop(id(ip), None)
    deactivate = not _reloading(ip)
    if ext is not None:
        ext.unload(deactivate)
    elif deactivate:
        import remotecuda
        remotecuda.deactivate()


def _reloading(ip: Any) -> bool:
    """Whether this unload is the first half of ``%reload_ext remotecuda``: IPython's
    ``ExtensionManager.reload_extension`` unloads, reloads the module and loads it again. The
    runtime then stays active, for the load to take up (``activate()`` returns the active one):
    deactivated, it closed the sessions, and every 'cuda' tensor the notebook held (a model's
    parameters, an optimizer's state) was gone for good, where a user reloads to re-apply the
    extension, as IPython suggests to whoever runs ``%load_ext remotecuda`` a second time."""
    reload_code = getattr(getattr(type(getattr(ip, "extension_manager", None)), "reload_extension", None),
                          "__code__", None)
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and reload_code is not None:
        if frame.f_code is reload_code:
            return True
        frame = frame.f_back
    return False


def extension(ip: Any = None) -> Extension | None:
    """The loaded extension of ``ip`` (default: the running IPython), or None."""
    if ip is None:
        from IPython import get_ipython
        ip = get_ipython()
    return _EXTENSIONS.get(id(ip))


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT held off while the body runs, and raised as KeyboardInterrupt when it ends.

    For activation, which imports torch: an interrupt there leaves torch half initialized, for
    good (a later ``import torch`` fails or crashes the process: a kernel that had to be
    restarted, its next cell never answered). Only in the main thread, where Python runs handlers,
    and where SIGINT has a handler that Python can put back."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    came: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if came:
        raise KeyboardInterrupt


class _RaiseInterrupt(ast.NodeTransformer):
    """An IPython AST transformer that makes the next cell raise KeyboardInterrupt at its first
    line, once: how an interrupt held off in ``pre_execute`` (whose callbacks' exceptions IPython
    prints and then runs the cell anyway) ends the cell it was meant for, as it would have."""

    def __init__(self, ip: Any):
        self.ip = ip

    def visit_Module(self, node: ast.Module) -> ast.Module:  # noqa: N802 - ast.NodeTransformer's name
        self.remove(self.ip)  # (appended last: IPython's loop over the transformers then ends)
        raise_it = ast.Raise(exc=ast.Name("KeyboardInterrupt", ast.Load()), cause=None)
        node.body.insert(0, ast.copy_location(raise_it, node.body[0]) if node.body else raise_it)
        return ast.fix_missing_locations(node)

    @staticmethod
    def remove(ip: Any) -> None:
        if any(isinstance(t, _RaiseInterrupt) for t in ip.ast_transformers):
            ip.ast_transformers[:] = [t for t in ip.ast_transformers if not isinstance(t, _RaiseInterrupt)]


def _leave_running(rt: Any) -> BaseException | None:
    """An interrupted cell's end: its queued ops sent, not waited for, as on a GPU, where an
    interrupted cell ends at once and the kernels it launched finish in the background. The
    next cell's ops run after them, so a tensor changed in place holds every update issued
    before the interrupt (dropped, it would be silently stale), and an error of theirs is raised
    at the next wait. Said in one line, with the way to drop them: the gateway may be up to two
    RUN_AHEADs of ops behind, where a GPU's launch queue holds about a second of work.
    Returns the error that sending met (a gateway gone), if any."""
    try:
        rt.pool.flush()
    except Exception as e:  # noqa: BLE001 - the cell's error, as a remote one is
        return e
    if any(s.unfinished for s in list(rt.pool.sessions.values())):
        print("remotecuda: interrupted; the remote work queued before the interrupt runs on in the "
              "background, as on a GPU, and the next cell's ops run after it (%remotecuda cancel "
              "drops it)", file=sys.stderr, flush=True)
    return None
