"""``torch.nn.DataParallel`` over virtual devices: the batch split over them, the module
replicated to each with differentiable copies, the replicas run, their outputs gathered, and the
gradients summed back onto the original parameters.

This is PyTorch's own DataParallel (and ``replicate``, ``scatter``, ``gather``, their autograd
Functions) on Python versions of the CUDA communication primitives they call
(``torch.nn.parallel.comm``: C++ on a CUDA build, absent from a CPU one). Copies between devices
are worker-to-worker copies (transfer.py). Replicas run one after the other in the calling thread
rather than one thread each: a replica's ops only queue on its device's session, so the gateways
run the replicas at the same time anyway, and the client's dispatch state (the current device,
the dispatch mode) belongs to the calling thread.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _get_device_index, _unflatten_dense_tensors
from torch.nn.parallel import comm
from torch.nn.parallel._functions import ReduceAddCoalesced

#: torch.nn.parallel.comm's default
BUFFER_BYTES = 10485760


def _to(t: torch.Tensor, index: int) -> torch.Tensor:
    """``t`` on virtual device ``index``: itself if it is there already (``copy=False``)."""
    if t.device.type == "cuda" and t.get_device() == index:
        return t
    return t.to(torch.device("cuda", index))


def broadcast(tensor: torch.Tensor, devices: Sequence[Any] | None = None, *, out: Any = None) -> tuple:
    if (devices is None) == (out is None):
        raise RuntimeError("Exactly one of 'devices' and 'out' must be specified")
    if out is not None:
        for o in out:
            o.copy_(tensor)
        return tuple(out)
    return tuple(_to(tensor, _get_device_index(d)) for d in devices or ())


def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[Any],
                        buffer_size: int = BUFFER_BYTES) -> list[list[torch.Tensor]]:
    """Copies of ``tensors`` (all on ``devices[0]``) on each device; small ones travel
    flattened together, one copy per dtype and ``buffer_size`` bytes, as on CUDA."""
    devices = [_get_device_index(d) for d in devices]
    tensors = [comm._handle_complex(t) for t in tensors]
    for t in tensors:
        if t.get_device() != devices[0]:
            raise RuntimeError(f"All tensors must be on devices[0]: {devices[0]}")
    outputs: list[list[Any]] = [list(tensors)] + [[None] * len(tensors) for _ in devices[1:]]
    for bucket in _buckets(tensors, buffer_size):
        chunk = [tensors[i] for i in bucket]
        flat = _flatten_dense_tensors(chunk)
        for out, d in zip(outputs[1:], devices[1:]):
            for i, t in zip(bucket, _unflatten_dense_tensors(_to(flat, d), chunk)):
                out[i] = t
    return outputs


def _buckets(tensors: Sequence[torch.Tensor], limit: int) -> Iterator[list[int]]:
    """Indices of ``tensors`` grouped by dtype, each group at most ``limit`` bytes (or one tensor)."""
    open_: dict[torch.dtype, tuple[list[int], list[int]]] = {}
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        bucket = open_.get(t.dtype)
        if bucket is not None and bucket[0] and bucket[1][0] + n > limit:
            yield bucket[0]
            bucket = None
        if bucket is None:
            bucket = open_[t.dtype] = ([], [0])
        bucket[0].append(i)
        bucket[1][0] += n
    for indices, _ in open_.values():
        if indices:
            yield indices


def reduce_add(inputs: Sequence[torch.Tensor], destination: Any = None) -> torch.Tensor:
    """The sum of ``inputs`` (one per device) on ``destination``, added in PyTorch's order."""
    destination = _get_device_index(destination, optional=True)
    root = None
    for i, t in enumerate(inputs):
        if t.device.type == "cpu":
            raise AssertionError(f"reduce_add expects all inputs to be on GPUs, but input {i} is on CPU")
        if t.size() != inputs[0].size():
            raise ValueError(f"input {i} has invalid size: got {'x'.join(map(str, t.size()))}, "
                             f"but expected {'x'.join(map(str, inputs[0].size()))}")
        if t.get_device() == destination:
            root = i
    if root is None:
        raise RuntimeError("reduce_add expects destination to be on the same GPU with one of the tensors")
    if len(inputs) == 1:
        return inputs[0]
    others = [t for i, t in enumerate(inputs) if i != root]
    result = inputs[root] + _to(others[0], destination)
    for t in others[1:]:
        result.add_(_to(t, destination))
    return result


def scatter(tensor: torch.Tensor, devices: Sequence[Any] | None = None, chunk_sizes: Sequence[int] | None = None,
            dim: int = 0, streams: Any = None, *, out: Any = None) -> tuple:
    """Chunks of ``tensor`` along ``dim``, one per device (``streams`` are not needed: each
    session's ops run in order)."""
    tensor = comm._handle_complex(tensor)
    if out is not None:
        if devices is not None or chunk_sizes is not None:
            raise RuntimeError("'devices' and 'chunk_sizes' must not be specified when 'out' is specified")
        for o, c in zip(out, tensor.split([o.size(dim) for o in out], dim)):
            o.copy_(c)
        return tuple(out)
    devices = [_get_device_index(d) for d in devices or ()]
    if chunk_sizes is not None:
        if len(chunk_sizes) != len(devices):
            raise RuntimeError(f"Expected devices and chunk_sizes to be of same length, but got "
                               f"len(chunk_sizes) == {len(chunk_sizes)} and len(devices) == {len(devices)}")
        chunks = tensor.split(list(chunk_sizes), dim)
    else:
        chunks = tensor.chunk(len(devices), dim)
    return tuple(_to(c, d) for c, d in zip(chunks, devices))


def _scatter_forward(ctx: Any, target_gpus: Sequence[Any], chunk_sizes: Sequence[int] | None, dim: int,
                     input: torch.Tensor) -> tuple:
    """``torch.nn.parallel._functions.Scatter.forward`` without its side streams for copies from
    the CPU (which a CPU build cannot make): each session runs its ops in order."""
    ctx.dim = dim
    ctx.input_device = input.get_device() if input.device.type != "cpu" else -1
    outputs = scatter(input, target_gpus, chunk_sizes, dim)
    return tuple(torch.view_as_complex(o) for o in outputs) if input.is_complex() else outputs


def _broadcast_backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
    """``torch.nn.parallel._functions.Broadcast.backward`` with each gradient on its replica's
    device. Autograd makes zeros for a copy no replica used (a parameter unused in the forward);
    it builds them from the wrapper's C++ device (meta), which names no 'cuda' one, so they land
    on the device of the thread's last op, and the sum of one parameter's gradients would mix
    devices."""
    n = ctx.num_inputs
    grads = tuple(g if g is None or g.get_device() == ctx.target_gpus[i // n]
                  else torch.zeros_like(g, device=torch.device("cuda", ctx.target_gpus[i // n]))
                  for i, g in enumerate(grad_outputs))
    return (None, *ReduceAddCoalesced.apply(ctx.input_device, n, *grads))


def gather(tensors: Sequence[torch.Tensor], dim: int = 0, destination: Any = None, *, out: Any = None) -> torch.Tensor:
    """``tensors`` concatenated along ``dim`` on ``destination`` (a device index, or the CPU)."""
    tensors = [comm._handle_complex(t) for t in tensors]
    if out is not None:
        if destination is not None:
            raise RuntimeError("'destination' must not be specified when 'out' is specified")
        offset = 0
        for t in tensors:
            out.narrow(dim, offset, t.size(dim)).copy_(t)
            offset += t.size(dim)
        return out
    destination = _get_device_index(destination, allow_cpu=True, optional=True)
    if destination == -1:
        return torch.cat([t.cpu() for t in tensors], dim)
    return torch.cat([_to(t, destination) for t in tensors], dim)


def parallel_apply(modules: Sequence[torch.nn.Module], inputs: Sequence[Any],
                   kwargs_tup: Sequence[dict] | None = None, devices: Sequence[Any] | None = None) -> list:
    """``torch.nn.parallel.parallel_apply`` in the calling thread (see the module's docstring)."""
    from torch.nn.parallel.parallel_apply import get_a_var
    if len(modules) != len(inputs):
        raise AssertionError(f"The number of modules {len(modules)} is not equal to the number of inputs {len(inputs)}")
    kwargs_tup = kwargs_tup if kwargs_tup is not None else ({},) * len(modules)
    devices = devices if devices is not None else [None] * len(modules)
    outputs = []
    for i, (module, args, kwargs, device) in enumerate(zip(modules, inputs, kwargs_tup, devices)):
        if device is None:
            t = get_a_var(args)
            if t is None:
                raise RuntimeError(f"in replica {i}, no device was provided and no tensor input was found; "
                                   "device cannot be resolved")
            device = t.get_device()
        index = _get_device_index(device, True)
        if not isinstance(args, (list, tuple)):
            args = (args,)
        try:
            with torch.cuda.device(index):
                outputs.append(module(*args, **kwargs))
        except Exception as e:
            e.add_note(f"in replica {i} on device {index}")
            raise
    return outputs


def install(p: Any) -> None:
    """Patch torch.nn.parallel through ``p`` (interception's ``_Patches``; undone by uninstall)."""
    import torch.cuda.comm as cuda_comm
    from torch.nn import parallel
    from torch.nn.parallel import _functions
    # (the package's attribute of that name is the function data_parallel, not the module)
    data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")
    for module in (comm, cuda_comm):
        for name, fn in (("broadcast", broadcast), ("broadcast_coalesced", broadcast_coalesced),
                         ("reduce_add", reduce_add), ("scatter", scatter), ("gather", gather)):
            p.set(module, name, fn)
    p.set(_functions.Scatter, "forward", staticmethod(_scatter_forward))
    p.set(_functions.Broadcast, "backward", staticmethod(_broadcast_backward))
    p.set(data_parallel, "parallel_apply", parallel_apply)
    p.set(parallel, "parallel_apply", parallel_apply)
