"""``torch.cuda.CUDAGraph`` on a gateway: capture once, replay with one small op.

Between ``capture_begin`` and ``capture_end`` the client streams ops as usual; the gateway
records them instead of running what would change state (remotecuda_server/graphs.py), so
``torch.cuda.graph(g)``, ``make_graphed_callables`` and whole-step capture (forward, backward,
``optimizer.step()``) behave as on a GPU: the tensors made inside the capture are static, and
each ``g.replay()`` — one ``rc::graph_replay`` in the stream — refills them in place. A
synchronising call inside a capture (``.item()``, ``.cpu()``) fails as CUDA's does.
"""
from __future__ import annotations

import itertools
from typing import Any

from . import runtime
from .session import Session

_ids = itertools.count(1)


class CUDAGraph:
    """A CUDA graph recorded on the gateway of the device it was captured on."""

    def __init__(self, keep_graph: bool = False) -> None:
        self.id = next(_ids)
        self.session: Session | None = None
        self.captured = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global", **kwargs: Any) -> None:
        rt = runtime.current()
        if rt.capturing is not None:
            raise RuntimeError("CUDA error: a CUDA graph is already being captured (one capture at a time)")
        if self.session is not None:
            self.reset()
        self.session = rt.session(rt.current_device)
        self.session.enqueue("rc::graph_begin", [self.id], None, None)
        rt.capturing = self

    def capture_end(self) -> None:
        rt = runtime.current()
        if rt.capturing is not self or self.session is None:
            raise RuntimeError("CUDA error: capture_end without a capture_begin on this graph")
        rt.capturing = None
        self.captured = True
        self.session.enqueue("rc::graph_end", [self.id], None, None)

    def instantiate(self) -> None:
        return None  # the gateway's recorded sequence needs no instantiation

    def replay(self) -> None:
        if not self.captured or self.session is None:
            raise RuntimeError("CUDA graph replay: the graph has not been captured")
        self.session.enqueue("rc::graph_replay", [self.id], None, None)

    def reset(self) -> None:
        s, self.session, self.captured = self.session, None, False
        if s is not None and not s.closed:
            s.enqueue("rc::graph_free", [self.id], None, None)

    def pool(self) -> tuple[int, int]:
        """An opaque memory-pool token (graphs always share the gateway's memory here)."""
        return (0, self.id)

    def enable_debug_mode(self) -> None:
        return None

    def debug_dump(self, debug_path: str) -> None:
        raise RuntimeError("remotecuda: a gateway's CUDA graph is a recorded op sequence; it has no "
                           "cudaGraph to dump")

    def __del__(self) -> None:
        s = getattr(self, "session", None)
        if s is not None and not s.closed:
            s.drop_object("rc::graph_free", self.id)


def graph_pool_handle() -> tuple[int, int]:
    """``torch.cuda.graph_pool_handle()``: an opaque token graphs may share."""
    return (0, 0)


def _host_empty_cache() -> None:
    """``torch._C._host_emptyCache``, which ``torch.cuda.graph`` calls: a CPU-only build lacks it,
    and there is no pinned-memory cache here to empty."""


def is_current_stream_capturing() -> bool:
    """Whether a CUDA graph is being captured (the optimizers ask before every ``step()``)."""
    rt = runtime.active()
    return rt is not None and rt.capturing is not None


#: what replaces ``torch.cuda.<name>`` and ``torch.cuda.graphs.<name>`` while active
REPLACEMENTS = {"CUDAGraph": CUDAGraph, "graph_pool_handle": graph_pool_handle,
                "is_current_stream_capturing": is_current_stream_capturing}
