"""The legacy tensor API on 'cuda': ``torch.cuda.FloatTensor`` and its kin, and ``Tensor.new``.

Older code (GAN and RL tutorials) picks a type once, ``Tensor = torch.cuda.FloatTensor if cuda
else torch.FloatTensor``, then builds with it (``Tensor(n, 1).fill_(1.0)``), converts with it
(``imgs.type(Tensor)``) and tests with it (``isinstance(x, torch.cuda.FloatTensor)``). A CPU-only
torch's types refuse to build ("Torch not compiled with CUDA enabled") and know no remote tensor,
so each is replaced by a class that builds on the current 'cuda' device and recognises remote
tensors of its dtype; ``Tensor.type`` given one (or its name) moves a CPU tensor there. The
sparse ones (``torch.cuda.sparse.FloatTensor(indices, values, size)``) build sparse COO tensors.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import flags, runtime
from .tensor import LEGACY_TYPES, RemoteTensor


class _CudaTensorType(type):
    """The metaclass of the replacements: calling one builds a 'cuda' tensor, as the legacy
    constructor does (sizes: uninitialised; data: copied), and isinstance matches remote tensors
    of its dtype, as ``torch.cuda.FloatTensor`` matches CUDA float tensors."""

    dtype: torch.dtype

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, RemoteTensor) and obj.dtype == cls.dtype

    def __call__(cls, *args: Any, device: Any = None) -> torch.Tensor:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        target = torch.device("cuda", torch.cuda.current_device() if d.index is None else d.index)
        if len(args) == 1 and isinstance(args[0], torch.Tensor):
            other = args[0]
            if not isinstance(other, RemoteTensor) or other.dtype != cls.dtype:
                raise TypeError(f"expected torch.cuda.{cls.__name__} (got {other.type()})")
            return other.detach().view_as(other)
        if all(isinstance(a, int) for a in args) or (len(args) == 1 and isinstance(args[0], torch.Size)):
            return torch.empty(*args, dtype=cls.dtype, device=target)
        return getattr(torch, cls.__name__)(*args).to(target)


#: torch.cuda.<name> while active
REPLACEMENTS = {name: _CudaTensorType(name, (), {"__module__": "torch.cuda", "dtype": dtype, "is_cuda": True,
                                                 "is_sparse": False, "layout": torch.strided})
                for name, dtype in LEGACY_TYPES.items()}


class _CudaSparseType(type):
    """``torch.cuda.sparse.FloatTensor`` and its kin while active (older GNN code builds its
    adjacency with ``torch.cuda.sparse.FloatTensor(indices, values, size)``): a sparse COO tensor
    on the current 'cuda' device; sizes alone give one with no entries."""

    dtype: torch.dtype

    def __instancecheck__(cls, obj: Any) -> bool:
        return obj.is_sparse and obj.is_cuda and obj.dtype == cls.dtype if isinstance(obj, torch.Tensor) else False

    def __call__(cls, *args: Any, device: Any = None) -> torch.Tensor:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        target = torch.device("cuda", torch.cuda.current_device() if d.index is None else d.index)
        if len(args) in (2, 3) and all(isinstance(a, torch.Tensor) for a in args[:2]):
            indices, values = (a.to(target) for a in args[:2])
            return torch.sparse_coo_tensor(indices, values, *args[2:], device=target)  # (values' dtype, as torch's)
        if all(isinstance(a, int) for a in args) or (len(args) == 1 and isinstance(args[0], torch.Size)):
            shape = list(args[0] if args and isinstance(args[0], torch.Size) else args) or [0]
            return torch.sparse_coo_tensor(torch.zeros(len(shape), 0, dtype=torch.long, device=target),
                                           torch.zeros(0, dtype=cls.dtype, device=target), shape)
        raise NotImplementedError(f"remotecuda: torch.cuda.sparse.{cls.__name__} takes (indices, values[, size]) or "
                                  "sizes on a remote 'cuda' device; use torch.sparse_coo_tensor(..., device='cuda')")


#: torch.cuda.sparse.<name> while active
SPARSE_REPLACEMENTS = {name: _CudaSparseType(name, (), {"__module__": "torch.cuda.sparse", "dtype": dtype,
                                                        "is_cuda": True, "is_sparse": True,
                                                        "layout": torch.sparse_coo})
                       for name, dtype in LEGACY_TYPES.items() if hasattr(torch.cuda.sparse, name)}


def tensor_type(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``Tensor.type`` of a CPU tensor given a CUDA type or its name ('torch.cuda.FloatTensor'):
    the tensor moved to the current 'cuda' device with that dtype. Asked for its name, a C++ meta
    tensor that stands for a 'cuda' one (another library's wrapper subclass, a nested tensor over
    remote values: its ``is_cuda`` says so) names the CUDA type, as on a GPU."""
    dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
    if dtype is None and args[0].is_cuda:
        return func(*args, **kwargs).replace("torch.meta.", "torch.cuda.", 1)
    name = dtype if isinstance(dtype, str) else \
        f"{dtype.__module__}.{dtype.__name__}" if isinstance(dtype, _CudaTensorType) else None
    legacy = LEGACY_TYPES.get(name.removeprefix("torch.cuda.")) if name and name.startswith("torch.cuda.") else None
    if legacy is None:
        return func(*args, **kwargs)
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return args[0].to(torch.device("cuda", torch.cuda.current_device()), legacy, non_blocking=non_blocking)


def set_default_tensor_type(func: Callable, args: tuple, kwargs: dict) -> None:
    """``torch.set_default_tensor_type('torch.cuda.FloatTensor')`` (nerf-pytorch's first line): the
    dtype as torch sets it (with its deprecation warning and its refusal of non-float types), and
    'cuda' as the default device, which is what the type's backend means, for the factories and
    for the legacy ``torch.Tensor(...)`` (``tensor_base_new``); a CPU type undoes that."""
    t = args[0] if args else kwargs["t"]
    name = t if isinstance(t, str) else f"{t.__module__}.{t.__name__}"
    rt = runtime.current()
    if name.startswith("torch.cuda.") and name.removeprefix("torch.cuda.") in LEGACY_TYPES:
        func(getattr(torch, name.removeprefix("torch.cuda.")))
        flags.changed()  # the default dtype, which C++ set without torch.set_default_dtype
        torch.set_default_device("cuda")
        rt.default_type_cuda = True
        return
    func(t)
    flags.changed()
    if rt.default_type_cuda:
        torch.set_default_device(None)
        rt.default_type_cuda = False


def tensor_base_new(original: Callable) -> Callable:
    """``torch.Tensor(...)``, the legacy constructor, builds with the default tensor type: on 'cuda'
    after ``set_default_tensor_type`` named a CUDA type (nerf-pytorch's ``torch.Tensor([1e10])``),
    which a CPU-only torch cannot take, so the CPU tensor it builds is moved there."""
    def __new__(*args: Any, **kwargs: Any) -> Any:  # (a wildcard signature: dynamo's polyfill of it checks)
        out = original(*args, **kwargs)
        rt = runtime.active()
        if args[0] is torch.Tensor and rt is not None and rt.default_type_cuda and runtime.active_here() \
                and not isinstance(out, RemoteTensor):
            return out.to("cuda")
        return out
    return __new__


def tensor_new(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``x.new([1, 2])``, the legacy constructor from data: a tensor of ``x``'s dtype on its device,
    as the C++ constructor makes it; for a wrapper C++ would make it on 'meta' (the data lost).
    Sizes (``x.new(2, 3)``, a ``torch.Size``) and the other forms are C++'s own."""
    self = args[0]
    if self.is_sparse and self.is_cuda and len(args) in (3, 4) and isinstance(args[1], torch.Tensor):
        # grad.new(indices, values, size): SparseAdam's (and SGD's) update of a sparse gradient
        return torch.sparse_coo_tensor(*args[1:], dtype=self.dtype, **kwargs)
    d = kwargs.get("device")
    d = torch.device("cuda", d) if isinstance(d, int) else None if d is None else torch.device(d)
    if not isinstance(self, RemoteTensor) or d is not None and d.type != "cuda":
        return func(*args, **kwargs)  # (C++ words the refusal of another device type)
    target = self.device if d is None else torch.device("cuda", torch.cuda.current_device() if d.index is None
                                                         else d.index)
    if len(args) == 2 and type(args[1]) in (list, tuple):
        return torch.tensor(args[1], dtype=self.dtype, device=target)
    # (C++ takes the wrapper's device type, meta, for its own: 'cuda' is left to the move)
    out = func(*args, **{k: v for k, v in kwargs.items() if k != "device"})
    return out if out.device == target else out.to(target)
