"""Resolving op names from the wire to callables, safely: the op allowlist.

What a client may run is derived from the gateway's torch, in this one place:

* the ops of the allowed namespaces (``aten``, and torch's own ``torch_nn`` custom ops, what
  CUDA runs for ``F.linear_cross_entropy``), found by exact ``ns::name.overload`` lookup in
  ``torch.ops`` — nothing is evaluated or unpickled, nothing imported but the torch module
  that registers a namespace's ops;
* minus the groups in ``REFUSED``, each named with why: ops that reach the file system or the
  gateway's log, nested tensors (the protocol has no nested layout, and their views trust
  their offsets), internal helpers of ops that run whole, and names that are not ops;
* with the ops whose kernels trust their inputs (guards.py: sparse constructors, pooling
  indices, saved statistics, …) run behind a check of those inputs.

Everything a client's dispatcher sends is an op of that set: it sends the aten ops its
programs call (tests/test_security.py checks names from the OpInfo suite against it).
"""
from __future__ import annotations

import importlib
import re
from collections.abc import Callable

import torch

from remotecuda_wire import layouts, protocol

from .cuda_kernels import cuda_like
from .guards import guarded

#: allowed namespaces (the protocol's), and the torch module that registers their ops (torch imports it lazily)
ALLOWED_NAMESPACES = {ns: {"torch_nn": "torch.nn.modules.linear_cross_entropy"}.get(ns)
                      for ns in sorted(protocol.OP_NAMESPACES)}
_NAME = re.compile(r"^([a-z_][a-z0-9_]*)::([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?$")
#: groups of ops a client may not run: (pattern on the op's name without overload, why)
REFUSED: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^(from_file|save|load)$"), "it reaches the gateway's file system"),
    (re.compile(r"^_print$"), "it writes to the gateway's log"),
    (re.compile(r"^_?nested_"), "nested tensors do not cross the wire (and their views trust their offsets)"),
    (re.compile(r"^_cum(max|min)_helper$"), "an internal helper of cummax/cummin, which run whole"),
    (re.compile(r"^__(?!.*__$)"), "not an op"),
)


class UnknownOpError(NotImplementedError):
    """The op is not available on this gateway (not allowed, or absent from its torch)."""


class OpResolver:
    """Name → OpOverload, with a cache, so each name is checked once per worker."""

    def __init__(self, device: torch.device | None = None) -> None:
        #: whether the ops run on the CPU (then as CUDA's kernels run them where the CPU's refuse)
        self.on_cpu = device is None or device.type == "cpu"
        self._cache: dict[str, torch._ops.OpOverload] = {}
        self._callables: dict[str, Callable] = {}

    def resolve(self, name: str) -> torch._ops.OpOverload:
        op = self._cache.get(name)
        if op is None:
            op = self._cache[name] = self._lookup(name)
        return op

    def callable(self, name: str) -> Callable:
        """What running op ``name`` calls: its kernel, behind its guard if it has one (guards.py),
        on the CPU as CUDA's kernel runs it where the CPU's would refuse (cuda_kernels.py)."""
        fn = self._callables.get(name)
        if fn is None:
            op = self.resolve(name)
            fn = guarded(op)
            if self.on_cpu:
                fn = cuda_like(op, fn)
            if name in layouts.CHOSEN:
                fn = _conforming(name, fn)
            self._callables[name] = fn
        return fn

    @staticmethod
    def _lookup(name: str) -> torch._ops.OpOverload:
        m = _NAME.match(name) if isinstance(name, str) else None
        if m is None:
            raise UnknownOpError(f"malformed op name {name!r}")
        ns, op_name, overload = m.group(1), m.group(2), m.group(3) or "default"
        if ns not in ALLOWED_NAMESPACES:
            raise UnknownOpError(f"op namespace {ns!r} is not allowed on this gateway (op {name})")
        for pattern, why in REFUSED:
            if pattern.search(op_name):
                raise UnknownOpError(f"op {name} is not allowed on this gateway: {why}")
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


def _conforming(name: str, fn: Callable) -> Callable:
    """A convolution or batch norm whose outputs take the layout the client expects (remotecuda_wire/layouts.py)."""
    def run(*args: object, **kwargs: object) -> object:
        return layouts.conform(name, args, kwargs, fn(*args, **kwargs))
    return run
