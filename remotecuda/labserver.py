"""The jupyter_server extension behind JupyterLab's "GPU pool" panel.

The panel shows the pool before any RemoteCUDA kernel runs, so the pool is heard by the
Jupyter server itself: one ``Discovery`` listener (the beacons, or the named servers of
``REMOTECUDA_SERVERS``) and a few minutes of each GPU's load, served as JSON at
``GET {base_url}remotecuda/pool`` to the users Jupyter lets in (``APIHandler`` and
``@tornado.web.authenticated``, as Jupyter's own handlers). Enabled by
``etc/jupyter/jupyter_server_config.d/remotecuda.json``, which ``pip install`` puts in place.
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from typing import Any

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from .discovery import Discovery, GatewayInfo

#: how far back each GPU's load is kept (the panel's sparkline)
HISTORY_SECONDS = 300.0
#: at most one sample per GPU this often (beacons come every second)
SAMPLE_EVERY = 2.0


class PoolWatch:
    """The gateways heard of now and each GPU's recent load, updated by the discovery thread."""

    def __init__(self, discovery: Discovery | None = None):
        self.error: str | None = None
        self._lock = threading.Lock()
        self._history: dict[str, deque[tuple[float, float, float]]] = {}  # "address/gpu" → (time, util, mem)
        try:
            self.discovery: Discovery | None = discovery if discovery is not None else Discovery()
        except OSError as e:  # no multicast here: say so in the panel rather than failing the server
            self.discovery, self.error = None, f"discovery unavailable: {e}"
            return
        self.discovery.subscribe(self._on_event)

    def _on_event(self, kind: str, gw: GatewayInfo) -> None:
        now = time.time()
        with self._lock:
            if kind == "left":
                for key in [k for k in self._history if k.startswith(gw.address + "/")]:
                    del self._history[key]
                return
            for gpu in gw.gpus:
                h = self._history.setdefault(f"{gw.address}/{gpu.get('index')}", deque())
                if h and now - h[-1][0] < SAMPLE_EVERY:
                    continue
                h.append((now, _num(gpu.get("utilization")), _memory_fraction(gpu)))
                while h and now - h[0][0] > HISTORY_SECONDS:
                    h.popleft()

    def snapshot(self) -> dict:
        """What ``GET /remotecuda/pool`` answers (documented in docs/JUPYTER.md)."""
        now_wall, now = time.time(), time.monotonic()
        out: dict[str, Any] = {"time": now_wall, "error": self.error, "history_seconds": HISTORY_SECONDS,
                               "source": None, "gateways": []}
        if self.discovery is None:
            return out
        out["source"] = self.discovery.source.describe()
        with self._lock:
            for g in self.discovery.snapshot():
                d = g.as_dict(now)
                d["gpus"] = [dict(gpu, history=[[round(t - now_wall, 1), u, m] for t, u, m in
                                                self._history.get(f"{g.address}/{gpu.get('index')}", ())])
                             for gpu in g.gpus]
                out["gateways"].append(d)
        return out

    def close(self) -> None:
        if self.discovery is not None:
            self.discovery.close()


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else 0.0


def _memory_fraction(gpu: dict) -> float:
    total, free = gpu.get("total_memory"), gpu.get("free_memory")
    if isinstance(total, int) and total > 0 and isinstance(free, int):
        return round(max(0, total - free) / total, 4)
    return 0.0


class PoolHandler(APIHandler):
    """``GET /remotecuda/pool``: the pool as JSON."""

    @tornado.web.authenticated
    def get(self) -> None:
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(self.settings["remotecuda_pool"].snapshot()))


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "remotecuda.labserver"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    watch = PoolWatch()
    web_app = serverapp.web_app
    web_app.settings["remotecuda_pool"] = watch
    route = url_path_join(web_app.settings["base_url"], "remotecuda", "pool")
    web_app.add_handlers(".*$", [(route, PoolHandler)])
    heard = watch.discovery.source.describe() if watch.discovery is not None else watch.error
    serverapp.log.info("remotecuda: GPU pool served at %s (%s)", route, heard)
