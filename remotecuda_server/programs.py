"""Compiled graphs on a gateway: an aten graph defined once, run as one op per call.

``torch.compile`` on the client (remotecuda/compiled.py) traces a model into ATen FX graphs
(AOTAutograd: a forward, and a backward when gradients are wanted) and sends each one here
once, with ``rc::program_define``, as plain data: a list of nodes, each an op name and its
arguments, an argument naming an earlier value (an input or a node's result) by a HANDLE
value holding its index. Nothing in it is code: every op name goes through the same aten
allowlist (and guards) as a streamed op does, plus ``getitem`` (one result of a
multi-result op). Each ``rc::program_run`` then runs the whole graph on its input handles.

On a CUDA device the graph is also handed to ``torch.compile`` (inductor), falling back to
running it op by op if that fails; on the CPU device it always runs op by op — inductor
there needs a C++ toolchain and minutes per graph, which would stall the session.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from remotecuda_wire.protocol import Handle

from .ops import OpResolver

#: the most nodes a graph may have (a large transformer's training step has a few thousand)
MAX_NODES = 200_000
#: the one non-aten node a graph may hold: one result of an op returning several
GETITEM = "getitem"
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format,
          torch.layout)


def _resolved(v: Any, values: list) -> Any:
    """An argument with each _Ref (in lists too) replaced by its value in ``values``."""
    if type(v) is _Ref:
        return values[v.i]
    if type(v) is list:
        return [_resolved(x, values) for x in v]
    return v


class _Ref:
    """An argument that is an earlier value of the graph (an input, or a node's result)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


class Program:
    """One defined graph: its steps, the values each step frees, and its outputs' strides."""

    def __init__(self, resolver: OpResolver, device: torch.device, n_inputs: Any, nodes: Any,
                 outputs: Any, strides: Any) -> None:
        if not (type(n_inputs) is int and 0 <= n_inputs <= MAX_NODES):
            raise ValueError("malformed graph: the input count must be a small non-negative int")
        if not isinstance(nodes, list) or len(nodes) > MAX_NODES:
            raise ValueError(f"malformed graph: nodes must be a list of at most {MAX_NODES}")
        self.device = device
        self.n_inputs = n_inputs
        self.steps: list[tuple[Callable, list, dict]] = []
        self.names: list[str] = []
        self.targets: list[Callable] = []  # what an FX graph of it calls (the OpOverloads)
        self.guarded = False  # whether some op runs behind a guard (then inductor is not used)
        for k, node in enumerate(nodes):
            if not (isinstance(node, list) and len(node) == 3 and isinstance(node[0], str)
                    and isinstance(node[1], list) and isinstance(node[2], dict)):
                raise ValueError(f"malformed graph: node {k} is not [op name, [args], {{kwargs}}]")
            name, args, kwargs = node
            known = n_inputs + k  # a node may name inputs and earlier nodes only
            args = [self._value(a, known, k) for a in args]
            kwargs = {str(key): self._value(v, known, k) for key, v in kwargs.items()}
            if name == GETITEM:
                if not (len(args) == 2 and isinstance(args[0], _Ref) and type(args[1]) is int and not kwargs):
                    raise ValueError(f"malformed graph: node {k} getitem takes [value, index]")
                fn: Callable = operator.getitem
                target: Callable = fn
            else:
                fn = resolver.callable(name)  # the allowlist: UnknownOpError for anything else
                target = resolver.resolve(name)
                self.guarded = self.guarded or fn is not target._op
            self.steps.append((fn, args, kwargs))
            self.targets.append(target)
            self.names.append(name)
        n_values = n_inputs + len(nodes)
        if not (isinstance(outputs, list) and all(type(o) is int and 0 <= o < n_values for o in outputs)):
            raise ValueError("malformed graph: outputs must be value indices")
        if not (isinstance(strides, list) and len(strides) == len(outputs)
                and all(isinstance(s, list) and all(type(x) is int for x in s) for s in strides)):
            raise ValueError("malformed graph: one stride list per output")
        self.outputs, self.strides = outputs, strides
        self.frees = self._last_uses()
        self.compiled: Callable | None = None
        self.compile_error: str | None = None
        self.runs = 0

    def _value(self, v: Any, known: int, k: int) -> Any:
        t = type(v)
        if t is Handle:
            if not 0 <= v.id < known:
                raise ValueError(f"malformed graph: node {k} names value {v.id}, not defined before it")
            return _Ref(v.id)
        if t is list:
            return [self._value(x, known, k) for x in v]
        # (torch._C.device is torch.device: a client active in this process replaces the name)
        if t is torch._C.device:  # the client traced on stand-ins: any device named is this gateway's
            return self.device
        if isinstance(v, _PLAIN):
            return v
        raise ValueError(f"malformed graph: node {k} has an argument of type {t.__name__}")

    def _last_uses(self) -> list[list[int]]:
        """Per step, the values no later step or output needs (freed as the graph runs, so a
        graph's peak memory is that of the ops, as when they are streamed)."""
        last: dict[int, int] = {}

        def see(v: Any, k: int) -> None:
            if isinstance(v, _Ref):
                last[v.i] = k
            elif isinstance(v, list):
                for x in v:
                    see(x, k)
        for k, (_, args, kwargs) in enumerate(self.steps):
            see(args, k)
            see(list(kwargs.values()), k)
        kept = set(self.outputs)
        frees: list[list[int]] = [[] for _ in self.steps]
        for i, k in last.items():
            if i not in kept:
                frees[k].append(i)
        return frees

    def run(self, inputs: list) -> list:
        if len(inputs) != self.n_inputs:
            raise RuntimeError(f"remotecuda: this compiled graph takes {self.n_inputs} tensors, got {len(inputs)}")
        self.runs += 1
        if self.device.type == "cuda" and not self.guarded and self.compile_error is None:
            outs = self._run_compiled(inputs)
            if outs is not None:
                return self._laid_out(outs)
        env: list[Any] = list(inputs) + [None] * len(self.steps)

        def arg(v: Any) -> Any:
            return _resolved(v, env)
        n = self.n_inputs
        for k, (fn, args, kwargs) in enumerate(self.steps):
            try:
                env[n + k] = fn(*[arg(a) for a in args], **{key: arg(v) for key, v in kwargs.items()})
            except Exception as e:
                raise _located(e, f"in compiled graph node {k}, {self.names[k]}") from e
            for i in self.frees[k]:
                env[i] = None
        return self._laid_out([env[i] for i in self.outputs])

    def _laid_out(self, outs: list) -> list:
        """The outputs with the strides the client was told (a copy only where they differ)."""
        fixed = []
        for t, stride in zip(outs, self.strides):
            if not isinstance(t, torch.Tensor):
                raise RuntimeError(f"remotecuda: a compiled graph's output is a {type(t).__name__}, not a tensor")
            if list(t.stride()) != stride and t.numel() > 1:
                t = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
            fixed.append(t)
        return fixed

    def _run_compiled(self, inputs: list) -> list | None:
        """The graph through inductor (a CUDA device only); None where that failed (it then
        runs op by op from now on, and ``compile_error`` says why)."""
        try:
            if self.compiled is None:
                import torch._inductor.config as inductor_config  # (the executor sets it once loaded)
                inductor_config.deterministic = torch.are_deterministic_algorithms_enabled()
                self.compiled = torch.compile(self.graph_module(), dynamic=False)
            return list(self.compiled(*inputs))
        except Exception as e:  # noqa: BLE001 - any inductor failure: the graph still runs op by op
            self.compile_error = f"{type(e).__name__}: {e}"
            self.compiled = None
            return None

    def graph_module(self) -> torch.fx.GraphModule:
        """The graph as an FX GraphModule (what inductor compiles), built from the checked steps."""
        g = torch.fx.Graph()
        values: list[Any] = [g.placeholder(f"in_{i}") for i in range(self.n_inputs)]

        def arg(v: Any) -> Any:
            return _resolved(v, values)
        for target, (_, args, kwargs) in zip(self.targets, self.steps):
            values.append(g.call_function(target, tuple(arg(a) for a in args), {k: arg(v) for k, v in kwargs.items()}))
        g.output(tuple(values[i] for i in self.outputs))
        return torch.fx.GraphModule(torch.nn.Module(), g)


def _located(e: Exception, where: str) -> Exception:
    """``e`` of the same type (the client raises that type), saying where in the graph it happened."""
    try:
        return type(e)(f"{e} ({where})")
    except Exception:  # noqa: BLE001 - a type that takes other arguments
        return RuntimeError(f"{type(e).__name__}: {e} ({where})")
