"""TorchScript archives of modules on 'cuda'.

TorchScript's serializer and loader are C++: they read and make a tensor's storage directly,
past ``__torch_dispatch__``. Saving a module whose tensors are remote would write the bytes of
their local metadata stand-ins (a corrupt archive), so ``torch.jit.save`` refuses, naming the
remedy. Loading goes through the CPU: an archive loaded with ``map_location`` naming 'cuda',
or one saved on a GPU machine (storages located on 'cuda', which a CPU-only torch cannot make),
is loaded onto the CPU and its module moved to the device, as ``ScriptModule.to`` moves it.

``torch.jit.trace`` records a convolution only below ``aten::convolution`` (its tracer kernel
leaves it to ``_convolution``), which an active dispatch mode never lets run under the tracer:
the mode records it itself (``record``), or the trace would lose every conv layer.
"""
from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from .device_type import DEVICE
from .tensor import RemoteTensor

#: the op the tracer leaves unrecorded that reaches the dispatch mode (see ``record``)
UNRECORDED = torch.ops.aten.convolution.default


def record(state: torch._C.TracingState, func: Any, args: tuple, run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``run()``, the op ``func(*args)``, appended to the graph ``torch.jit.trace`` is recording.
    ``run`` may compute metadata with Python code whose ``size()`` calls the tracer records:
    those dead nodes are dropped, or a first trace and its check would name the parameters
    differently; the arguments' graph values (a parameter's ``GetAttr``) are taken before, so
    that they are not among them."""
    graph = state.graph()
    inputs = [torch._C._get_value_trace(a) if isinstance(a, torch.Tensor) else None for a in args]
    last = graph.insertPoint().prev()
    out = run()
    _drop_since(last, graph.insertPoint())
    node = graph.create(func._schema.name, 1)
    for a, v in zip(args, inputs):
        node.addInput(v if v is not None else graph.insertConstant(a))
    graph.insertNode(node)
    node.output().inferTypeFrom(out)
    torch._C._set_value_trace(out, node.output())
    return out


def _drop_since(last: torch._C.Node, point: torch._C.Node) -> None:
    """The nodes recorded after ``last`` (the metadata code's dead ``size()`` calls) removed, so
    the names they took (a parameter's, say) are free again, as in a trace that ran none."""
    node = point.prev()
    while node != last and not any(v.uses() for v in node.outputs()):
        node, dead = node.prev(), node
        dead.destroy()


def _refuse_remote_save(original: Any) -> Any:
    def save(self: Any, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(t, RemoteTensor) for t in (*self.parameters(), *self.buffers())):
            raise NotImplementedError(
                "remotecuda: a TorchScript module with tensors on 'cuda' cannot be saved (TorchScript's "
                "C++ serializer reads tensor memory directly): move it to the CPU first (module.cpu()), "
                "save it, and load it with torch.jit.load(f, map_location='cuda')")
        return original(self, *args, **kwargs)
    save.__doc__ = original.__doc__
    return save


def _cuda_target(map_location: Any) -> torch.device | None:
    where = torch.device(map_location) if isinstance(map_location, (str, int)) else map_location
    if isinstance(where, DEVICE) and where.type == "cuda":
        return where if where.index is not None else DEVICE("cuda", torch.cuda.current_device())
    return None


class _Anything:
    """Whatever an archive's pickle names: only its storages' locations are wanted."""
    def __init__(self, *args: Any, **kwargs: Any) -> None: pass
    def __setstate__(self, state: Any) -> None: pass
    def __setitem__(self, key: Any, value: Any) -> None: pass
    def append(self, value: Any) -> None: pass
    def extend(self, values: Any) -> None: pass


class _Locations(pickle.Unpickler):
    """Reads where an archive's pickle says its storages live (``('storage', type, key,
    location, numel)``, TorchScript's persistent ids), making nothing."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.found: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        return _Anything

    def persistent_load(self, pid: Any) -> None:
        self.found.append(str(pid[3]))


def _saved_on_cuda(archive: bytes) -> torch.device | None:
    """The first 'cuda' device an archive's storages were saved on (a GPU machine's archive)."""
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        for name in z.namelist():
            if name.endswith(("/data.pkl", "/constants.pkl")):
                reader = _Locations(z.read(name))
                reader.load()
                cuda = [where for where in reader.found if where.startswith("cuda")]
                if cuda:
                    return DEVICE(cuda[0])
    return None


def _make_load(original: Any) -> Any:
    def load(f: Any, map_location: Any = None, _extra_files: Any = None, *args: Any, **kwargs: Any) -> Any:
        target = _cuda_target(map_location)
        if target is None and map_location is None:
            if isinstance(f, (str, os.PathLike)):
                with open(f, "rb") as file:
                    f = io.BytesIO(file.read())
            else:
                f = io.BytesIO(f.read())
            target = _cuda_target(_saved_on_cuda(f.getvalue()))
        if target is None:
            return original(f, map_location, _extra_files, *args, **kwargs)
        return original(f, "cpu", _extra_files, *args, **kwargs).to(target)
    load.__doc__ = original.__doc__
    load.__wrapped__ = original  # type: ignore[attr-defined]  # (as functools.wraps sets it)
    return load


def convert(module: torch.jit.RecursiveScriptModule, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``module._apply(fn)`` across the boundary for one TorchScript module (not its children).

    Its tensors are its C++ module's attributes, which neither a swap (C++ holds a reference)
    nor ``param.data = ...`` can turn remote: each attribute gets its converted tensor instead."""
    with torch.no_grad():
        for key, p in module._parameters.items():
            if p is not None:
                module._parameters[key] = fn(p).requires_grad_(p.requires_grad)
        for key, b in module._buffers.items():
            if b is not None:
                module._buffers[key] = fn(b)
    return module


def install(patches: Any) -> None:
    for script in (torch.jit.ScriptModule, torch.jit.RecursiveScriptModule):  # (both define them)
        patches.set(script, "save", _refuse_remote_save(script.__dict__["save"]))
        patches.set(script, "save_to_buffer", _refuse_remote_save(script.__dict__["save_to_buffer"]))
    patches.set(torch.jit, "load", _make_load(torch.jit.load))
