"""CUDA graphs on a gateway: a captured op sequence, replayed by one small message.

A CUDA graph fixes the addresses of everything it touches: after capture, its outputs are
"static" tensors that each replay overwrites in place, so a program keeps reading the same
tensors (and views of them) step after step. ``RecordedGraph`` keeps that contract with
recorded ops instead of a driver graph:

* while capturing, an op that mutates its inputs (``add_``, ``out=``, an optimizer's
  ``_foreach_*_``) is only recorded — capture must not change state, as on a GPU, where
  captured kernels do not run; its new outputs are allocated from its meta kernel;
* any other op runs once, for real (it changes nothing) so that its outputs exist; a view op
  is not recorded at all: the storage it views is fixed, so the view stays right;
* a replay runs the recorded ops in order and copies each functional op's result into the
  tensor captured for it, so every static tensor keeps its identity.

Everything a graph uses is held by it (the private memory pool of a CUDA graph), so temporaries
that the client freed during capture stay alive for the next replay. On a GPU gateway the
sequence is replayed op by op too; a driver-level graph there is future work.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

#: the error CUDA raises for a synchronising call made while a stream captures
CAPTURING = "operation not permitted when stream is capturing"


class GraphStep(NamedTuple):
    """One recorded op: what it calls with the tensors it was captured with, and where each
    tensor result of a replay goes (None: an alias of an input, already written in place)."""

    func: Callable
    args: tuple
    kwargs: dict
    targets: tuple


class RecordedGraph:
    """A captured op sequence whose tensors keep their identity across replays."""

    def __init__(self) -> None:
        self.steps: list[GraphStep] = []
        self.capturing = True
        self.error: str | None = None  # why the capture is invalid (replay raises it)
        self.replays = 0

    def record(self, op: torch._ops.OpOverload, func: Callable, args: list, kwargs: dict) -> Any:
        """Capture one op; return the outputs the client's handles bind to."""
        schema = op._schema
        if schema.is_mutable:
            result = _allocate_outputs(op, args, kwargs)
        else:
            result = func(*args, **kwargs)
            if _is_view(schema):
                return result
        flat: list = []
        flatten_tensors(result, flat)
        targets = tuple(None if _aliases_input(t, args, kwargs) else t for t in flat)
        self.steps.append(GraphStep(func, tuple(args), dict(kwargs), targets))
        return result

    def fail(self, why: str) -> None:
        """Invalidate the capture, as CUDA does after an error inside one."""
        if self.error is None:
            self.error = why

    def replay(self) -> None:
        if self.capturing:
            raise RuntimeError("CUDA graph replay before capture_end: the graph is still capturing")
        if self.error is not None:
            raise RuntimeError(f"this CUDA graph's capture failed, it cannot be replayed: {self.error}")
        for step in self.steps:
            result = step.func(*step.args, **step.kwargs)
            if not any(t is not None for t in step.targets):
                continue
            flat: list = []
            flatten_tensors(result, flat)
            for target, value in zip(step.targets, flat):
                if target is not None and value is not target:
                    target.copy_(value)
        self.replays += 1


def _is_view(schema: torch._C.FunctionSchema) -> bool:
    """Whether an op's results are views of its inputs (and it writes nothing)."""
    return any(r.alias_info is not None for r in schema.returns)


def _aliases_input(t: Any, args: list, kwargs: dict) -> bool:
    """Whether ``t`` is one of the op's tensor arguments (an in-place op's or out= result)."""
    flat: list = []
    flatten_tensors(list(args) + list(kwargs.values()), flat)
    return any(t is a for a in flat)


def _allocate_outputs(op: torch._ops.OpOverload, args: list, kwargs: dict) -> Any:
    """A mutating op's results without running it: its aliased inputs, and fresh tensors shaped
    by its meta kernel for the rest (as a GPU's capture allocates them from the graph's pool)."""
    inputs: list = []
    flatten_tensors(list(args) + list(kwargs.values()), inputs)
    to_meta = {id(t): _meta(t) for t in inputs}

    def meta(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return to_meta[id(v)]
        if isinstance(v, (list, tuple)):
            return type(v)(meta(x) for x in v)
        return v
    out = op(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})
    back = {id(to_meta[id(t)]): t for t in inputs}
    device = inputs[0].device if inputs else torch.device("cpu")

    def real(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            t = back.get(id(v))
            return t if t is not None else torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
        if isinstance(v, (list, tuple)):
            return type(v)(real(x) for x in v)
        return v
    return real(out)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def flatten_tensors(v: Any, out: list) -> None:
    """The tensors of an op's result or arguments, in order (as the client lists its handles)."""
    if isinstance(v, torch.Tensor):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            flatten_tensors(x, out)
