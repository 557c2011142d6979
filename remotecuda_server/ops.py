"""Resolving op names from the wire to callables, safely.

Only ``aten`` ops and torch's own ``torch_nn`` custom ops (what CUDA runs for
``F.linear_cross_entropy``) are reachable, by exact ``ns::name.overload`` lookup in
``torch.ops``; nothing is evaluated or unpickled, nothing imported but the torch module
that registers a namespace's ops. Ops that could
reach the gateway's file system are refused.
"""
from __future__ import annotations

import importlib
import re

import torch

#: allowed namespaces, and the torch module that registers their ops (torch imports it lazily)
ALLOWED_NAMESPACES = {"aten": None, "torch_nn": "torch.nn.modules.linear_cross_entropy"}
_NAME = re.compile(r"^([a-z_][a-z0-9_]*)::([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?$")
#: ops that read or write files on the machine that runs them
_DENIED = frozenset({"from_file", "save", "load"})


class UnknownOpError(NotImplementedError):
    """The op is not available on this gateway (not allowed, or absent from its torch)."""


class OpResolver:
    """Name → OpOverload, with a cache, so each name is checked once per worker."""

    def __init__(self) -> None:
        self._cache: dict[str, torch._ops.OpOverload] = {}

    def resolve(self, name: str) -> torch._ops.OpOverload:
        op = self._cache.get(name)
        if op is None:
            op = self._cache[name] = self._lookup(name)
        return op

    @staticmethod
    def _lookup(name: str) -> torch._ops.OpOverload:
        m = _NAME.match(name) if isinstance(name, str) else None
        if m is None:
            raise UnknownOpError(f"malformed op name {name!r}")
        ns, op_name, overload = m.group(1), m.group(2), m.group(3) or "default"
        if ns not in ALLOWED_NAMESPACES:
            raise UnknownOpError(f"op namespace {ns!r} is not allowed on this gateway (op {name})")
        if op_name in _DENIED or op_name.startswith("__") and not op_name.endswith("__"):
            raise UnknownOpError(f"op {name} is not allowed on this gateway")
        module = ALLOWED_NAMESPACES[ns]
        if module is not None:
            importlib.import_module(module)
        packet = getattr(getattr(torch.ops, ns), op_name, None) if op_name.isidentifier() else None
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            raise UnknownOpError(
                f"the gateway's torch {torch.__version__} has no op {ns}::{op_name}")
        ov = getattr(packet, overload, None)
        if not isinstance(ov, torch._ops.OpOverload):
            raise UnknownOpError(
                f"the gateway's torch {torch.__version__} has no overload {name}")
        return ov
