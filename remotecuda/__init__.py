"""RemoteCUDA: unchanged PyTorch 'cuda' code, run on GPU gateways over the network.

    import remotecuda
    remotecuda.activate()            # gateways found by multicast, or REMOTECUDA_SERVERS=host:port;
                                     # also `remotecuda run`, %load_ext remotecuda
    model.cuda(); loss.backward()    # runs on the gateway
    remotecuda.deactivate()          # torch is exactly as before
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from remotecuda_wire import limits
from remotecuda_wire._version import __version__ as __version__  # the one definition (pyproject.toml reads it)

from .errors import (
    GatewayAuthError,
    GatewayLostError,
    GatewayProtocolError,
    GatewayUnavailableError,
    RemoteCUDAError,
    TransferError,
)


def __getattr__(name: str) -> Any:
    """``remotecuda.prefetch``, ``remotecuda.runtime`` (the module: ``runtime.active()`` is the
    active Runtime or None) and ``remotecuda.trace`` (start/stop/save a trace), imported on first
    use: they need torch, and ``import remotecuda`` (the RemoteCUDA kernel's start) does not wait for torch."""
    if name == "prefetch":
        from .prefetch import prefetch
        globals()["prefetch"] = prefetch
        return prefetch
    if name in ("runtime", "trace"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'remotecuda' has no attribute {name!r}")


def server_decode(model: Any, input_ids: Any, max_new_tokens: int, **kwargs: Any) -> Any:
    """Decode ``max_new_tokens`` tokens with one blocking round trip per call (see decode.py)."""
    from .decode import server_decode as decode
    return decode(model, input_ids, max_new_tokens, **kwargs)


def fetch(tensors: Any) -> list:
    """``[t.cpu() for t in tensors]`` in one round trip per gateway session (see downloads.py)."""
    from .downloads import fetch as fetch_all
    return fetch_all(tensors)


__all__ = ["activate", "deactivate", "is_active", "stats", "synchronize", "runtime", "trace", "prefetch", "fetch",
           "gateway_status", "set_strategy", "checkpoint", "server_decode",
           "RemoteCUDAError", "GatewayUnavailableError", "GatewayAuthError", "GatewayLostError",
           "GatewayProtocolError", "TransferError"]


def activate(servers: str | list[str] | None = None, *, fallback: str | None = None,
             sync: bool | None = None, strategy: str | None = None, devices: str | None = None,
             replay: bool | None = None) -> Any:
    """Turn interception on: 'cuda' now means the GPU pool. Returns the runtime (runtime.py), or
    the active one when remotecuda is active already.

    ``servers``: "host:port[,host:port]" or a list, asked directly (no multicast); default
    ``REMOTECUDA_SERVERS``, else the gateways that announce themselves on multicast (else one at
    127.0.0.1:55555). ``devices``: how many devices the program sees and where each may go
    (``REMOTECUDA_DEVICES`` syntax: "2", "host1:55555/0,any", "any/A100"); default: all the named
    servers' GPUs in order, or one device from a discovered pool. ``strategy``: how devices are
    placed (``REMOTECUDA_STRATEGY``; adaptive, load-balancing, memory-aware, latency-optimized).
    ``fallback``: "cpu" (default; warn once and run on a local CPU gateway when none answers) or
    "error" (``REMOTECUDA_FALLBACK``). ``sync``: make every op synchronous for debugging
    (``REMOTECUDA_SYNC=1``). ``replay``: trace a model's repeated calls once and replay them on the
    gateway as one op each (``REMOTECUDA_REPLAY=1``; off by default, see remotecuda/step_replay.py).
    docs/POOL.md says more.
    """
    from . import interception, lazydynamo, runtime
    active = runtime.active()
    if active is not None:
        return active
    chosen = _settings(servers, fallback=fallback, sync=sync, strategy=strategy, devices=devices, replay=replay)
    lazydynamo.install()  # the first op on 'cuda' must not wait ~1 s for torch._dynamo
    return runtime.start(install=interception.install, **chosen)


def _settings(servers: str | list[str] | None = None, *, fallback: str | None = None, sync: bool | None = None,
              strategy: str | None = None, devices: str | None = None, replay: bool | None = None) -> dict[str, Any]:
    """``activate()``'s arguments, each defaulted from its ``REMOTECUDA_*`` variable, checked (ValueError,
    OSError for a malformed one: before any gateway is asked), as ``runtime.start`` takes them.
    ``remotecuda run LAUNCHER`` checks the environment so too before the launcher runs, as its
    workers would each refuse it at their ``import torch``."""
    from . import children, progress, step_replay
    from .discovery import servers_from_env
    from .scheduler import check_strategy, devices_from_env, parse_devices, strategy_from_env
    told = children.settings(servers, devices, strategy, fallback, sync, replay)  # (before the defaults fill them)
    if fallback is None:
        fallback = os.environ.get("REMOTECUDA_FALLBACK", "cpu").strip().lower() or "cpu"
    if fallback not in ("cpu", "error"):
        raise ValueError(f"REMOTECUDA_FALLBACK must be 'cpu' or 'error', not {fallback!r}")
    if sync is None:
        sync = limits.switch("REMOTECUDA_SYNC", os.environ.get("REMOTECUDA_SYNC"), False)
    chosen = {"servers": servers_from_env(servers), "fallback": fallback, "sync": sync,
              "strategy": strategy_from_env() if strategy is None else check_strategy(strategy),
              "devices": devices_from_env() if devices is None else parse_devices(devices, "devices"),
              "replay": step_replay.wanted(replay), "told": told}
    progress.after()  # a malformed REMOTECUDA_PROGRESS is refused now, not at the first long transfer
    return chosen


def set_strategy(name: str) -> None:
    """Place the devices placed from now on by strategy ``name`` (adaptive, load-balancing,
    memory-aware, latency-optimized; case ignored; ValueError for others). Devices placed
    already stay where they are. Before ``activate()``: pass ``strategy=`` or set
    ``REMOTECUDA_STRATEGY``."""
    from .scheduler import check_strategy
    strategy = check_strategy(name)
    rt = _active()
    if rt is None:
        from .runtime import NotActiveError
        raise NotActiveError("remotecuda is not active: activate(strategy=...) or REMOTECUDA_STRATEGY "
                             "chooses the strategy before activation")
    rt.pool.strategy = strategy


def deactivate() -> None:
    """Turn interception off and close every session (gateway memory is freed). Everything the
    runtime held goes with it: the next ``activate()`` starts afresh."""
    runtime = sys.modules.get(f"{__name__}.runtime")  # (never imported: never active; torch stays unloaded)
    if runtime is not None:
        runtime.stop()


def _release_in_forked_child() -> None:
    """A forked child (a DataLoader worker) gets plain torch, as a forked child of a CUDA process
    cannot use CUDA: the parent's sessions are not the child's (their sockets are the parent's, and
    a lock that another thread held at the fork stays held: DataLoader's workers seed torch first
    thing, which would queue an op on such a session and hang)."""
    runtime = sys.modules.get(f"{__name__}.runtime")
    if runtime is not None:
        runtime.release_in_forked_child()


os.register_at_fork(after_in_child=_release_in_forked_child)


def _active() -> Any:
    """The active Runtime (remotecuda/runtime.py), or None, without importing torch."""
    runtime = sys.modules.get(f"{__name__}.runtime")
    return None if runtime is None else runtime.active()


def is_active() -> bool:
    return _active() is not None


def synchronize() -> None:
    """Wait for all queued remote work; raise the first pending remote error."""
    rt = _active()
    if rt is not None:
        rt.synchronize()


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext remotecuda``: see remotecuda/ipython.py."""
    from .ipython import load_ipython_extension as load
    load(ip)


def unload_ipython_extension(ip: Any) -> None:
    """``%unload_ext remotecuda``: deactivate; torch is exactly as before."""
    from .ipython import unload_ipython_extension as unload
    unload(ip)


def stats(reset: bool = False) -> dict:
    """Cumulative counters of this process's sessions (ops, messages, bytes, round trips...) and of
    the dispatch cache (``metadata_cache_*``: hits, misses, bypasses by reason; see dispatch_cache.py),
    since activation (or the last ``reset``); all zero while not active. ``devices``: each virtual
    device, where it is placed (gateway, GPU, name), by which strategy and why (pool.py)."""
    from .dispatch_cache import CacheInfo
    from .session import STAT_KEYS
    rt = _active()
    if rt is not None:
        return rt.stats(reset=reset)
    return {**dict.fromkeys(STAT_KEYS, 0), **CacheInfo(0, 0).as_stats(), "devices": []}


def checkpoint() -> None:
    """Snapshot every session's live tensors now, so that a failover (a gateway or its worker
    failing; failover.py) replays only the ops issued after this; a no-op while not active or with
    REMOTECUDA_FAILOVER=off. Snapshots are also taken by themselves when a session's replay log
    passes REMOTECUDA_SNAPSHOT_BYTES."""
    rt = _active()
    if rt is not None:
        rt.checkpoint()


def gateway_status(server: str | None = None, timeout: float = 5.0) -> dict:
    """A gateway's inventory and per-session / total counters (default: that of cuda:0 once placed,
    else the first named server, else 127.0.0.1:55555)."""
    import zmq

    from .discovery import servers_from_env
    from .pool import DEFAULT_SERVER, endpoint
    from .session import gateway_status as ask
    rt = _active()
    if server is None and rt is not None:
        pool = rt.pool
        known = ([d.endpoint for d in pool.devices if d.placed] or pool.named
                 or [g.address for g in (pool.discovery.snapshot() if pool.discovery is not None else [])])
        ep = (known or [endpoint(DEFAULT_SERVER)])[0]
    else:
        ep = endpoint(server or (servers_from_env(None) or [DEFAULT_SERVER])[0])
    return ask(zmq.Context.instance(), ep, timeout)
