"""``torch.distributed`` with 'cuda' tensors while active.

A CPU-only torch has no NCCL, and gloo's C++ reads a remote tensor's device as 'meta' and
refuses it ("unsupported device type meta"). Gloo on a GPU machine stages CUDA tensors through
host memory; its collectives do so here too: the 'cuda' tensors a call names are read, the
collective runs on the CPU copies, and the results are written back. ``DistributedDataParallel``
over a 'cuda' model, whose gradient buckets C++ reduces out of the client's reach, is made a
``StagedDDP`` (ddp.py), which reduces them in Python. The 'nccl' backend, which a CPU-only torch
lacks, runs as gloo. FSDP (``FullyShardedDataParallel``, ``fully_shard``) over a 'cuda' model is
refused by name: its shards are gathered and scattered by the process group's C++ (out of reach
like DDP's buckets) and its DTensors cannot wrap a remote tensor.
"""
from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from . import downloads
from .ddp import StagedDDP
from .tensor import RemoteTensor

#: the collectives and point-to-point calls of torch.distributed that take tensors (or lists of them);
#: torch 2.13 names all_gather_into_tensor and reduce_scatter_tensor ``*_single`` (what accelerate calls)
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv")


#: collectives with one tensor world-size times another, which NCCL takes in any shape of that many
#: elements (accelerate's gather hands it a flat one) and gloo only as the chunks stacked on dim 0
FLAT_GATHERED = {"all_gather_into_tensor": ("output_tensor", "input_tensor"),
                 "all_gather_single": ("output_tensor", "input_tensor"),
                 "reduce_scatter_tensor": ("input", "output"), "reduce_scatter_single": ("input", "output")}


def _as_gloo_takes(original: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``original``'s arguments (CPU copies) with its world-size tensor viewed as gloo takes it,
    ``(world * n, *rest)`` for a piece of shape ``(n, *rest)``, where its shape differs but its
    element count fits: a 'cuda' program written for NCCL, whose GPUs are the gateways', runs on
    gloo here (the view shares the copy's memory, whose values are written back)."""
    big, piece = FLAT_GATHERED[original.__name__]
    bound = inspect.signature(original).bind(*args, **kwargs)
    whole, part = bound.arguments.get(big), bound.arguments.get(piece)
    if isinstance(whole, torch.Tensor) and isinstance(part, torch.Tensor) and whole.is_contiguous():
        shape = (-1, *part.shape[1:]) if part.dim() else (-1,)
        if whole.shape != part.shape and whole.numel() % max(part.numel(), 1) == 0:
            bound.arguments[big] = whole.view(shape)
    return bound.args, bound.kwargs


def _staged(original: Callable) -> Callable:
    """``original`` (a collective) on CPU copies of the remote tensors among its arguments, whose
    values it then writes back into them, as gloo stages a GPU's tensors."""
    def collective(*args: Any, **kwargs: Any) -> Any:
        remote: list[tuple[RemoteTensor, torch.Tensor]] = []

        def local(a: Any) -> Any:
            if isinstance(a, RemoteTensor):
                remote.append((a, a.cpu()))
                return remote[-1][1]
            if type(a) is list and any(isinstance(t, RemoteTensor) for t in a):
                return [local(t) for t in a]
            return a
        args = tuple(local(a) for a in args)
        kwargs = {k: local(v) for k, v in kwargs.items()}
        if not remote:
            return original(*args, **kwargs)
        if original.__name__ in FLAT_GATHERED:
            args, kwargs = _as_gloo_takes(original, args, kwargs)
        work = original(*args, **kwargs)
        if work is not None and hasattr(work, "wait"):
            work.wait()  # (async_op=True: the values must be in before they are written back)
        for t, cpu in remote:
            t.copy_(cpu)
        return work
    collective.__wrapped__ = original  # type: ignore[attr-defined]
    collective.__name__ = original.__name__
    collective.__doc__ = original.__doc__
    return collective


def _init_process_group(original: Callable) -> Callable:
    """``init_process_group`` with gloo for 'nccl' (said once, in a warning: a CPU-only torch has no
    NCCL, and the GPUs are the gateways'; gloo's collectives on 'cuda' tensors go through the CPU,
    as on a GPU machine), so that a ``torchrun`` script runs unchanged; no backend is gloo alone
    (torch's default for an available CUDA, 'cuda:nccl,cpu:gloo', fails on a CPU-only build)."""
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if backend is not None and "nccl" in str(backend).lower():
            warnings.warn("remotecuda: torch.distributed's 'nccl' backend runs as 'gloo' (the GPUs are on "
                          "gateways: collectives on 'cuda' tensors go through this process's CPU)", stacklevel=2)
            backend = "gloo"
        return original("gloo" if backend is None else backend, *args, **kwargs)
    init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    return init_process_group


def _ddp_init(original: Callable) -> Callable:
    """DDP's ``__init__``, making a DDP over a 'cuda' model a ``StagedDDP`` (ddp.py)."""
    def __init__(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        if _on_cuda(module):
            if type(self) is not torch.nn.parallel.DistributedDataParallel:
                raise NotImplementedError(
                    f"remotecuda: a subclass of DistributedDataParallel ({type(self).__name__}) over a model "
                    "on 'cuda' is not supported (its gradient buckets are reduced in C++, which cannot reach "
                    "the gateway; remotecuda replaces DistributedDataParallel itself only)")
            self.__class__ = StagedDDP
            StagedDDP._stage(cast(StagedDDP, self), module, *args, **kwargs)
            return
        original(self, module, *args, **kwargs)
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


def _on_cuda(module: torch.nn.Module) -> bool:
    """Whether a parameter or buffer of ``module`` is a remote ('cuda') tensor."""
    return any(isinstance(t, RemoteTensor) for t in (*module.parameters(), *module.buffers()))


def _refuses_cuda(original: Callable, name: str, at: int) -> Callable:
    """``original`` (FSDP's constructor or ``fully_shard``, the module its argument ``at``), refusing
    a module on 'cuda' with a NotImplementedError that says so (instead of gloo's 'unsupported
    device type meta' or a RecursionError from DTensor's dispatch)."""
    def refusing(*args: Any, **kwargs: Any) -> Any:
        module = args[at] if len(args) > at else kwargs.get("module")
        if isinstance(module, torch.nn.Module) and _on_cuda(module):
            raise NotImplementedError(
                f"remotecuda: {name} over a model on 'cuda' is not supported (FSDP's shards are gathered "
                "by the process group's C++, which cannot reach the gateway); use DistributedDataParallel")
        return original(*args, **kwargs)
    refusing.__wrapped__ = original  # type: ignore[attr-defined]
    refusing.__name__ = getattr(original, "__name__", name)
    refusing.__doc__ = original.__doc__
    return refusing


def _patch_fsdp(patches: Any, fsdp: Any) -> None:
    """``torch.distributed.fsdp`` once imported (importing it at activation would slow every start)."""
    cls = fsdp.FullyShardedDataParallel
    patches.set(cls, "__init__", _refuses_cuda(cls.__init__, "FullyShardedDataParallel", 1))
    if hasattr(fsdp, "fully_shard"):
        patches.set(fsdp, "fully_shard", _refuses_cuda(fsdp.fully_shard, "fully_shard", 0))


def install(patches: Any) -> None:
    """Patch torch.distributed through ``patches`` (interception's ``_Patches``; undone by uninstall)."""
    if not dist.is_available():
        return
    for name in COLLECTIVES:
        if hasattr(dist, name):  # (the ``*_single`` names are torch 2.13's)
            patches.set(dist, name, _staged(getattr(dist, name)))
    patches.set(dist, "init_process_group", _init_process_group(dist.init_process_group))
    ddp = torch.nn.parallel.DistributedDataParallel
    patches.set(ddp, "__init__", _ddp_init(ddp.__init__))
    downloads.on_import(patches, "torch.distributed.fsdp", _patch_fsdp)
