"""Reading many remote tensors in one round trip.

Each ``.cpu()`` is a sync point: a checkpoint of 48 tensors read one by one costs 48 round
trips. Where the whole set is known up front (``torch.save``, ``Module.cpu()``/``.to('cpu')``,
safetensors' ``save_file``, a Hugging Face pipeline's outputs, ``remotecuda.fetch``), it is
fetched in one request per session (``rc::fetch_many``), and the copies wait in a per-thread
stash that the ``.cpu()`` calls made inside that scope take from (``take``, called by every
download). The stash lives only for the scope: no op of this thread runs in it between the
fetch and the reads, so the values are those the reads would have got.
"""
from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from importlib.abc import MetaPathFinder
from importlib.machinery import PathFinder
from typing import Any

import torch

from .tensor import RemoteTensor

#: one request carries at most this many bytes: the gateway holds a request's copies until it is sent
BATCH_BYTES = 256 << 20

_local = threading.local()


def take(t: RemoteTensor) -> torch.Tensor | None:
    """The CPU copy of ``t`` fetched ahead by the enclosing ``prefetching`` scope, once; else None."""
    stash = getattr(_local, "stash", None)
    return stash.pop((t._sid, t._k), None) if stash else None


@contextmanager
def prefetching(tensors: Iterable[Any]) -> Iterator[None]:
    """Fetch the remote tensors among ``tensors`` now, in one round trip per session (per
    BATCH_BYTES), for the downloads of this scope to take. A nested scope adds to the stash and
    takes back, on leaving, what it added and nobody took."""
    outer: dict | None = getattr(_local, "stash", None)
    outermost = outer is None
    stash: dict = {} if outer is None else outer
    if outermost:
        _local.stash = stash
    added: list = []
    try:
        groups: dict[Any, dict] = {}
        for t in tensors:
            if isinstance(t, RemoteTensor) and (t._sid, t._k) not in stash:
                groups.setdefault(t._s, {})[(t._sid, t._k)] = t
        for s, wanted in groups.items():
            for batch in _batches(list(wanted.values())):
                keys = [(t._sid, t._k) for t in batch]
                stash.update(zip(keys, s.fetch_many([t._h for t in batch])))
                added += keys
        yield
    finally:
        if outermost:
            _local.stash = None
        else:
            for key in added:
                stash.pop(key, None)


def _batches(tensors: list) -> Iterator[list]:
    batch: list = []
    size = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if batch and size + n > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(t)
        size += n
    if batch:
        yield batch


def fetch(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``[t.cpu() for t in tensors]`` in one round trip per gateway session (CPU tensors are
    returned as they are), e.g. ``dict(zip(sd, remotecuda.fetch(sd.values())))``."""
    tensors = list(tensors)
    with prefetching(tensors):
        return [t.cpu() for t in tensors]


def localized(tree: Any, detach: bool = False) -> Any:
    """``tree`` (nested lists, tuples and dicts) with each cuda tensor in it replaced by a CPU
    copy, all fetched in one round trip; ``tree`` itself when it holds none."""
    found: list[RemoteTensor] = []
    _collect(tree, found)
    if not found:
        return tree
    copies = dict(zip(map(id, found), fetch([t.detach() for t in found] if detach else found)))
    return _with_copies(tree, copies)


# (module functions, not closures calling themselves: such a cycle would keep the tensors found,
# and their gateway memory, alive until the garbage collector ran)
def _collect(x: Any, found: list) -> None:
    if isinstance(x, RemoteTensor):
        found.append(x)
    elif type(x) is list or type(x) is tuple:
        for v in x:
            _collect(v, found)
    elif type(x) is dict:
        for v in x.values():
            _collect(v, found)


def _with_copies(x: Any, copies: dict) -> Any:
    if isinstance(x, RemoteTensor):
        return copies[id(x)]
    if type(x) is list or type(x) is tuple:
        return type(x)(_with_copies(v, copies) for v in x)
    if type(x) is dict:
        return {k: _with_copies(v, copies) for k, v in x.items()}
    return x


def module_tensors(m: torch.nn.Module) -> list[torch.Tensor]:
    """What ``Module._apply`` converts: parameters, their gradients, buffers."""
    params = list(m.parameters())
    return [*params, *(p.grad for p in params if p.grad is not None), *m.buffers()]


def prefetched(original: Callable, tensors_of: Callable) -> Callable:
    """``original`` with the tensors ``tensors_of(*args, **kwargs)`` names fetched up front, for its
    reads to take (the scopes of ``torch.save``, ``Module.cpu()``, safetensors' saves)."""
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        with prefetching(tensors_of(*args, **kwargs)):
            return original(*args, **kwargs)
    return call


def _module_to_cpu(self: torch.nn.Module, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    device = torch._C._nn._parse_to(*args, **kwargs)[0]
    return module_tensors(self) if device is not None and device.type == "cpu" else []


def _safetensors_tensors(tensors: Any, *args: Any, **kwargs: Any) -> Iterable[Any]:
    """safetensors' ``save``/``save_file`` (and so Hugging Face's ``save_pretrained``) read
    their tensors through ``_flatten_as_ptr``, one ``.to('cpu')`` each."""
    return tensors.values() if isinstance(tensors, dict) else ()


def _pipeline_tensors(pipeline: Any, inputs: Any, device: Any = None) -> list[torch.Tensor]:
    """A transformers pipeline moves each batch's outputs (and the inputs its postprocessing reads:
    token classification's ids, offsets and masks) to the CPU with ``_ensure_tensor_on_device``,
    one ``.to('cpu')`` each: a round trip per tensor, six a batch for token classification."""
    found: list[torch.Tensor] = []
    if device is not None and torch.device(device).type == "cpu":
        _nested_tensors(inputs, found)
    return found


def _nested_tensors(x: Any, found: list) -> None:
    """The tensors where ``_ensure_tensor_on_device`` looks: in mappings (dicts, ``ModelOutput``,
    ``BatchEncoding``), lists and tuples."""
    if isinstance(x, torch.Tensor):
        found.append(x)
    elif isinstance(x, Mapping):
        for v in x.values():
            _nested_tensors(v, found)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _nested_tensors(v, found)


class _OnImport(MetaPathFinder):
    """Patches a module when it is imported (importing it here would slow every start): calls
    ``patch(patches, module)`` once ``name`` has run. Deactivation turns ``active`` off (through
    the patches); the finder then removes itself."""

    active = False

    def __init__(self, patches: Any, name: str, patch: Callable[[Any, Any], None]):
        self.patches, self.name, self.patch = patches, name, patch

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if not self.active:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            return None
        if name != self.name:
            return None
        spec = PathFinder.find_spec(name, path)
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            if self.active:
                self.patch(self.patches, module)
        setattr(loader, "exec_module", exec_and_patch)  # (this spec's own loader)  # noqa: B010
        return spec


def on_import(patches: Any, name: str, patch: Callable[[Any, Any], None]) -> None:
    """``patch(patches, module)`` for module ``name``: now if it is imported, else when it is."""
    if name in sys.modules:
        patch(patches, sys.modules[name])
    else:
        finder = _OnImport(patches, name, patch)
        patches.set(finder, "active", True)
        sys.meta_path.insert(0, finder)


def _patch_safetensors(patches: Any, module: Any) -> None:
    if hasattr(module, "_flatten_as_ptr") and not hasattr(module._flatten_as_ptr, "__wrapped__"):
        patches.set(module, "_flatten_as_ptr", prefetched(module._flatten_as_ptr, _safetensors_tensors))


def _patch_pipelines(patches: Any, module: Any) -> None:
    pipeline = getattr(module, "Pipeline", None)
    move = getattr(pipeline, "_ensure_tensor_on_device", None)
    if move is not None and not hasattr(move, "__wrapped__"):
        patches.set(pipeline, "_ensure_tensor_on_device", prefetched(move, _pipeline_tensors))


def install(patches: Any) -> None:
    """Batch the reads of Module.cpu()/.to('cpu'), of safetensors and of transformers' pipelines
    while remotecuda is active."""
    patches.set(torch.nn.Module, "cpu", prefetched(torch.nn.Module.cpu, module_tensors))
    patches.set(torch.nn.Module, "to", prefetched(torch.nn.Module.to, _module_to_cpu))
    on_import(patches, "safetensors.torch", _patch_safetensors)
    on_import(patches, "transformers.pipelines.base", _patch_pipelines)
