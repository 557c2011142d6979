"""RemoteCUDA: unchanged PyTorch 'cuda' code, run on GPU gateways over the network.

    import remotecuda
    remotecuda.activate()            # or REMOTECUDA_SERVERS=host:port, `remotecuda run`, %load_ext
    model.cuda(); loss.backward()    # runs on the gateway
    remotecuda.deactivate()          # torch is exactly as before
"""
from __future__ import annotations

import os
import sys
from typing import Any

from remotecuda_wire._version import __version__ as __version__  # the one definition (pyproject.toml reads it)

from .errors import (
    GatewayLostError,
    GatewayProtocolError,
    GatewayUnavailableError,
    RemoteCUDAError,
    install_excepthook,
    uninstall_excepthook,
)


def __getattr__(name: str) -> Any:
    """``remotecuda.prefetch``, imported on first use: it needs torch, and ``import remotecuda``
    (the RemoteCUDA kernel's start) does not wait for torch."""
    if name == "prefetch":
        from .prefetch import prefetch
        globals()["prefetch"] = prefetch
        return prefetch
    raise AttributeError(f"module 'remotecuda' has no attribute {name!r}")


def fetch(tensors: Any) -> list:
    """``[t.cpu() for t in tensors]`` in one round trip per gateway session (see downloads.py)."""
    from .downloads import fetch as fetch_all
    return fetch_all(tensors)


__all__ = ["activate", "deactivate", "is_active", "stats", "synchronize", "runtime", "prefetch", "fetch",
           "gateway_status",
           "RemoteCUDAError", "GatewayUnavailableError", "GatewayLostError", "GatewayProtocolError"]


def activate(servers: str | list[str] | None = None, *, fallback: str | None = None,
             sync: bool | None = None) -> Any:
    """Turn interception on: 'cuda' now means the gateways in ``servers``.

    ``servers``: "host:port[,host:port]" or a list; default ``REMOTECUDA_SERVERS``, else
    127.0.0.1:55555. ``fallback``: "cpu" (default; warn once and run on a local CPU
    gateway when none answers) or "error" (``REMOTECUDA_FALLBACK``). ``sync``: make every
    op synchronous for debugging (``REMOTECUDA_SYNC=1``).
    """
    from . import interception
    from .dispatch import DISPATCHER
    from .pool import Pool, servers_from_env
    if DISPATCHER.runtime is not None:
        return DISPATCHER.runtime
    if fallback is None:
        fallback = os.environ.get("REMOTECUDA_FALLBACK", "cpu").strip().lower() or "cpu"
    if fallback not in ("cpu", "error"):
        raise ValueError(f"REMOTECUDA_FALLBACK must be 'cpu' or 'error', not {fallback!r}")
    if sync is None:
        sync = os.environ.get("REMOTECUDA_SYNC", "") not in ("", "0")
    from . import lazydynamo
    lazydynamo.install()  # the first op on 'cuda' must not wait ~1 s for torch._dynamo
    DISPATCHER.runtime = Pool(servers_from_env(servers), fallback=fallback, sync=sync)
    interception.install()
    install_excepthook()
    return DISPATCHER.runtime


def deactivate() -> None:
    """Turn interception off and close every session (gateway memory is freed)."""
    from . import interception
    from .dispatch import DISPATCHER
    rt = DISPATCHER.runtime
    if rt is None:
        return
    interception.uninstall()
    uninstall_excepthook()
    DISPATCHER.runtime = None
    rt.close()


def _release_in_forked_child() -> None:
    """A forked child (a DataLoader worker) gets plain torch, as a forked child of a CUDA process
    cannot use CUDA: the parent's sessions are not the child's (their sockets are the parent's, and
    a lock that another thread held at the fork stays held: DataLoader's workers seed torch first
    thing, which would queue an op on such a session and hang)."""
    dispatch = sys.modules.get(f"{__name__}.dispatch")
    if dispatch is None or dispatch.DISPATCHER.runtime is None:
        return
    from . import interception
    interception.uninstall()
    uninstall_excepthook()
    dispatch.DISPATCHER.runtime = None  # (not closed: its sockets belong to the parent)


os.register_at_fork(after_in_child=_release_in_forked_child)


def is_active() -> bool:
    from .dispatch import DISPATCHER
    return DISPATCHER.runtime is not None


def runtime() -> Any:
    from .dispatch import DISPATCHER
    return DISPATCHER.runtime


def synchronize() -> None:
    """Wait for all queued remote work; raise the first pending remote error."""
    from .dispatch import DISPATCHER
    rt = DISPATCHER.runtime
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
    the dispatch cache (``metadata_cache_*``: hits, misses, bypasses by reason; see dispatch_cache.py)."""
    from .dispatch import DISPATCHER
    from .session import STAT_KEYS
    rt = DISPATCHER.runtime
    total = dict.fromkeys(STAT_KEYS, 0)
    if rt is not None:
        for s in rt.sessions.values():
            with s.lock:
                pending = len(s._ops)
                for k in STAT_KEYS:
                    total[k] += s.stats[k]
                total["ops"] += pending
                if reset:
                    s.stats = dict.fromkeys(STAT_KEYS, 0)
                    s.stats["ops"] = -pending
    total.update(DISPATCHER.cache.info().as_stats())  # hits, misses, bypasses by reason...
    if reset:
        DISPATCHER.cache.reset_counters()
    return total


def gateway_status(server: str | None = None, timeout: float = 5.0) -> dict:
    """A gateway's inventory and per-session / total counters (default: the first in use)."""
    import zmq

    from remotecuda_wire import protocol

    from .pool import endpoint, servers_from_env
    from .session import _connect
    ep = endpoint(server or servers_from_env(None)[0]) if server or runtime() is None \
        else runtime().devices[0].endpoint
    ctx = zmq.Context.instance()
    sock = _connect(ctx, ep)
    try:
        sock.send_multipart(protocol.encode(protocol.STATUS, {}))
        if not sock.poll(int(timeout * 1000)):
            raise GatewayUnavailableError(f"no RemoteCUDA gateway answered at {ep}")
        return protocol.decode(sock.recv_multipart()).body
    finally:
        sock.close(linger=0)
