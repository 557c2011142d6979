"""Catching 'cuda' in unchanged PyTorch code.

* ``RemoteDispatchMode`` (a TorchDispatchMode, pushed while remotecuda is active) sees
  every aten call. Ops on remote tensors go to the dispatcher; factories asked for on
  'cuda' become remote factories; factories C++ builds on 'meta' from a remote tensor's
  options (``where(c, x, 0.)``, backward formulas) become remote too, unless the user
  asked for 'meta' (the patched factories below mark those).
* What fails in C++ *before* any dispatch on a CPU-only build — ``torch.tensor(...,
  device='cuda')``, ``t.cuda()``, ``t.to('cuda')`` on CPU tensors — and what would be
  silently wrong below it — list indices and ``new_tensor`` (their data is lost in a meta
  tensor), ``p.data = ...`` (the wrapper's handle would go stale) — is caught by patching
  those few Python-level functions, not by a TorchFunctionMode: a mode is called for
  every op and costs ~8 µs on each (a third of the client's per-op cost).
* CUDA autocast needs every matmul, softmax... seen at the Python level; its function
  mode (``AutocastMode``) is pushed only while a ``torch.autocast('cuda')`` block runs.

``install(runtime)`` also swaps in the ``torch.cuda`` and ``torch.accelerator``
replacements, the backend-flag setters (flags.py) and the few torch settings the wrapper
needs; the ``Interception`` it returns belongs to the runtime, whose ``close`` calls its
``remove``, which puts everything back exactly as it was.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import re
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch._ops import HigherOrderOperator
from torch.jit import _builtins as jit_builtins
from torch.nn.parameter import is_lazy
from torch.overrides import TorchFunctionMode
from torch.overrides import _get_current_function_mode_stack as _function_modes
from torch.utils import _device as device_context
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from . import (
    accelerator_api,
    autocast,
    backward_device,
    children,
    compiled,
    control_flow,
    cuda_api,
    cuda_graphs,
    data_parallel,
    decode,
    device_type,
    distributed,
    distributions,
    dlpack,
    downloads,
    expanded_weights,
    flags,
    flex_attention,
    generator,
    hub_kernels,
    indexing,
    known,
    lazy_modules,
    legacy_types,
    library_caches,
    nested,
    profiler_ranges,
    rnn,
    runtime,
    serialization,
    sparse,
    step_replay,
    storages,
    tensor_subclasses,
    torchscript,
    transfer,
    transformer_encoder,
    value_reads,
    warning_location,
)
from .device_type import DEVICE
from .dispatch import Dispatcher, meta_stand_in, not_dense, strided_nested
from .errors import install_excepthook, uninstall_excepthook
from .runtime import Runtime
from .tensor import OWN_KEYS, RemoteTensor, cuda_device, follow, is_pinned, wrapper_type

_mode_stack_len = torch._C._len_torch_dispatch_stack  # > 0: our mode is on this thread's stack
_active_here = runtime.active_here
_DATA: Any = torch._C.TensorBase.data  # the getset descriptor
#: the unpatched ``Tensor.to``, for calls made on the user's behalf
_TO = torch._C.TensorBase.to
#: torch.tensor itself (the name ``torch.tensor`` is the route while active)
_TENSOR = torch._C._VariableFunctions.tensor
#: torch.asarray itself
_ASARRAY = torch._C._VariableFunctions.asarray


class _UserMeta:
    """Marks a factory the user asked for on 'meta': it stays meta (other 'meta' factories
    come from C++ building on a remote tensor's options, and become remote)."""

    def __enter__(self) -> None:
        self.local = runtime.current().dispatcher.local
        self.local.user_meta += 1

    def __exit__(self, *exc: object) -> None:
        self.local.user_meta -= 1


def _is_meta(d: Any) -> bool:
    return d == "meta" or getattr(d, "type", None) == "meta"


def _context_device() -> torch.device | None:
    """The device of the innermost ``with torch.device(...)`` (a function mode that fills in
    ``device=`` only after our patched factories have looked at their arguments)."""
    if torch._C._len_torch_function_stack() == 0:  # the common case, and cheap
        return None
    for mode in reversed(_function_modes()):
        if isinstance(mode, device_context.DeviceContext):
            return mode.device
    return None


def _device(d: Any) -> torch.device | None:
    if d is None or isinstance(d, DEVICE):
        return d
    if isinstance(d, int):
        return torch.device("cuda", d)
    return torch.device(d)


def _cuda_index(d: torch.device) -> int:
    return runtime.current().current_device if d.index is None else d.index


# ---------------------------------------------------------------------- function-level handlers

def to_cuda(t: torch.Tensor, index: int, dtype: Any = None, non_blocking: bool = False,
            memory_format: Any = None) -> torch.Tensor:
    """``t.to('cuda:index')`` for a CPU tensor (a RemoteTensor), through aten so autograd records the
    copy (past any function mode: ``with torch.device('cuda')`` would hand it to the patched ``to``)."""
    if is_lazy(t):
        return lazy_modules.to_cuda(t, index)
    if t.is_meta and not isinstance(t, RemoteTensor):
        # (C++ would copy it meta to meta, a remote tensor's C++ device, and hand back a meta
        # tensor: a GPU's copy_ refuses it, aten/src/ATen/native/Copy.cpp, and nn.Module.to
        # adds its hint, to_empty(), to this error)
        raise NotImplementedError("Cannot copy out of meta tensor; no data!")
    local = runtime.current().dispatcher.local
    prev = local.target
    local.target = index
    try:
        kw: dict = {"non_blocking": non_blocking}
        if dtype is not None:
            kw["dtype"] = dtype
        if memory_format is not None:
            kw["memory_format"] = memory_format
        with torch._C.DisableTorchFunction():
            return _TO(t, torch.device("meta"), **kw)
    finally:
        local.target = prev


def _made_here(func: Callable, args: tuple, kwargs: dict, meta: bool) -> Any:
    """``func`` for a tensor the user asked for on 'cpu' or 'meta': made here, with a remote
    ``self`` replaced by its meta stand-in, as only its metadata matters."""
    self = args[0]
    args = (meta_stand_in(self) if isinstance(self, RemoteTensor) else self, *args[1:])
    if meta:
        with _UserMeta():
            return func(*args, **kwargs)
    return func(*args, **kwargs)


def _subclass_first(t: Any) -> bool:
    """Whether ``t``, the ``self`` of a routed Tensor method, is of a subclass whose
    ``__torch_function__`` comes first (or a function mode is on). The C++ method a route replaces
    calls it before anything else (torch's default one keeps ``sub.new_tensor(...)`` a ``Sub``; a
    tagged tensor's hook sees ``copy_``, ``type``, ``__setitem__`` by their names; MONAI's
    MetaTensor carries its metadata over), and the route must too: ``_routed`` hands the call to
    it, and its ``super()`` calls back, with subclasses' overrides off, into the route's handler."""
    return type(t) is not torch.Tensor and isinstance(t, torch.Tensor) and torch.overrides.has_torch_function_unary(t)


def _tensor_to(func: Callable, args: tuple, kwargs: dict) -> Any:
    self = args[0]
    kw = dict(kwargs)
    copy = kw.pop("copy", False)
    rest = args[1:]
    if rest and isinstance(rest[0], torch.Tensor):  # x.to(other): other's device and dtype
        other = rest[0]
        device, dtype = other.device, other.dtype
        non_blocking = kw.get("non_blocking", rest[1] if len(rest) > 1 else False)
        copy = rest[2] if len(rest) > 2 else copy
        memory_format = None
    else:
        # copy given positionally: to(dtype, non_blocking, copy) / to(device, dtype, non_blocking, copy);
        # _parse_to refuses it
        n = 3 if rest and isinstance(rest[0], torch.dtype) else 4
        if len(rest) >= n:
            copy, rest = rest[n - 1], rest[:n - 1]
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kw)
    if device is not None and device.type == "meta":  # (a remote tensor's C++ device is meta already)
        return _made_here(func, args, kwargs, meta=True)
    if device is None or device.type != "cuda":
        if device is not None and is_lazy(self):
            lazy_modules.to_local(self)
        return func(*args, **kwargs)
    index = _cuda_index(device)
    if isinstance(self, RemoteTensor):
        if index == self._dev:
            if not copy and (dtype is None or dtype == self.dtype) and memory_format in (None, torch.preserve_format):
                return self
            return _TO(self, dtype=dtype or self.dtype, non_blocking=non_blocking, copy=copy,
                                   memory_format=memory_format or torch.preserve_format)
        return transfer.to_device(self, index, dtype, memory_format)
    return to_cuda(self, index, dtype, non_blocking, memory_format)


def _parse_to(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``to(0)``, ``to(device=0)``: an int device means the accelerator, which C++ says is absent
    ("Cannot access accelerator device"), so make it 'cuda:0' (``model.to(local_rank)``)."""
    if args and type(args[0]) is int:
        args = (torch.device("cuda", args[0]), *args[1:])
    if type(kwargs.get("device")) is int:
        kwargs = dict(kwargs, device=torch.device("cuda", kwargs["device"]))
    return func(*args, **kwargs)


def _tensor_copy_(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``dst.copy_(src)`` from another virtual device, where src wants a gradient: src moves with
    ``transfer.to_device`` first, so its gradient goes back to its own device (C++'s copy_ backward
    sees the wrappers' meta device and would leave it on dst's)."""
    dst, src = args[0], args[1]
    if (isinstance(src, RemoteTensor) and isinstance(dst, RemoteTensor) and src._dev != dst._dev
            and src.requires_grad and torch.is_grad_enabled()):
        return func(dst, transfer.to_device(src, dst._dev), *args[2:], **kwargs)
    return func(*args, **kwargs)


def _ctc_loss(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``torch.ctc_loss`` with lengths as CPU tensors (``F.ctc_loss``'s usual call): CUDA reads them
    as lists; a remote ``log_probs`` would take the tensor subclasses' path, which divides the
    gateway's loss by the CPU tensor of target lengths."""
    remote = args and isinstance(args[0], RemoteTensor)
    if remote or (args and _remote_under_transform(args[0]) is not None):
        args = tuple(a.tolist() if i in (2, 3) and isinstance(a, torch.Tensor) and not isinstance(a, RemoteTensor)
                     else a for i, a in enumerate(args))
        if not remote:
            return _ctc_loss_composite(*args, **kwargs)
    return func(*args, **kwargs)


def _ctc_loss_composite(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Any, target_lengths: Any,
                        blank: int = 0, reduction: int = 1, zero_infinity: bool = False) -> torch.Tensor:
    """``ctc_loss`` as C++'s composite computes it off cuDNN, for torch.func's wrappers of a remote
    ``log_probs`` (per-sample or input gradients of a CTC loss): C++ would build the tensor of target
    lengths on the wrappers' meta device from host data, which it cannot."""
    batched = log_probs.dim() == 3
    lp = log_probs if batched else log_probs.unsqueeze(1)
    def as_list(n: Any) -> list[int]:
        return [int(v) for v in (n.reshape(-1).tolist() if isinstance(n, torch.Tensor) else n)]
    lengths = as_list(target_lengths)
    res = torch._ctc_loss(lp, targets.to(torch.long), as_list(input_lengths), lengths, blank, zero_infinity)[0]
    if zero_infinity:
        res = torch.where(res == float("inf"), res.new_zeros(()), res)
    if reduction == 1:  # mean
        return (res / torch.tensor(lengths, dtype=res.dtype, device=res.device).clamp_min(1)).mean()
    if reduction == 2:  # sum
        return res.sum()
    return res if batched else res.squeeze(0)


def _tensor_split(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``tensor_split`` given its indices or sections in a 'cuda' tensor: C++ refuses it before any
    dispatch (it reads them on the host), naming the tensor's device, which for a wrapper is
    'meta': the refusal names its 'cuda:N', as on a GPU."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as e:
        split = kwargs.get("tensor_indices_or_sections", args[1] if len(args) > 1 else None)
        if not isinstance(split, RemoteTensor) or not str(e).endswith("to be on cpu, but it's on meta"):
            raise
        raise RuntimeError(f"{str(e).removesuffix('meta')}{split.device}") from None


def _export(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``torch.export``/``torch.onnx.export`` of a model on 'cuda' would end this process (C++
    aborts making autograd metadata for a CUDA fake tensor on a CPU-only build): refuse first."""
    leaves = pytree.tree_leaves((args, kwargs))
    modules = [x for x in leaves if isinstance(x, torch.nn.Module)]
    tensors = [*leaves, *(t for m in modules for t in itertools.chain(m.parameters(), m.buffers()))]
    if any(isinstance(t, RemoteTensor) for t in tensors):
        raise NotImplementedError(
            f"remotecuda: {func.__module__}.{func.__name__} of a model or inputs on 'cuda' is not supported: "
            "export it on the CPU (model.cpu(), CPU example inputs)")
    return func(*args, **kwargs)


def _opcheck(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``torch.library.opcheck`` on 'cuda' inputs: its AOTAutograd checks make fake tensors of
    them, and a fake 'cuda' tensor with autograd ends this process (as ``_export`` says). Those
    checks run on CPU copies of the inputs instead, which test the same registrations (the fake
    kernel, the autograd formula) through the op's CPU kernel; the others on 'cuda'."""
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    utils = bound.arguments["test_utils"]
    utils = (utils,) if isinstance(utils, str) else tuple(utils)
    inputs = (bound.arguments["args"], bound.arguments["kwargs"])
    aot = tuple(u for u in utils if u.startswith("test_aot_dispatch"))
    if not aot or not any(isinstance(t, RemoteTensor) for t in pytree.tree_leaves(inputs)):
        return func(*args, **kwargs)

    def cpu(t: Any) -> Any:
        return t.detach().cpu().requires_grad_(t.requires_grad) if isinstance(t, RemoteTensor) else t
    results: dict[str, Any] = {}
    for chosen, (op_args, op_kwargs) in ((tuple(u for u in utils if u not in aot), inputs),
                                         (aot, pytree.tree_map(cpu, inputs))):
        if chosen:
            got = func(**{**bound.arguments, "args": op_args, "kwargs": op_kwargs, "test_utils": chosen})
            results.update(got or {})
    return {u: results[u] for u in utils if u in results}


def _tensor_cuda(func: Callable, args: tuple, kwargs: dict) -> Any:
    self = args[0]
    device = args[1] if len(args) > 1 else kwargs.get("device")
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    d = _device(device) or torch.device("cuda")
    if d.type != "cuda":
        raise RuntimeError(f"Invalid device, must be cuda device, got {d}")
    mf = kwargs.get("memory_format", torch.preserve_format)
    return _tensor_to(_TO, (self, torch.device("cuda", _cuda_index(d))),
                      {"non_blocking": non_blocking, "memory_format": mf})


def _data_factory(func: Callable, args: tuple, kwargs: dict) -> Any:
    """torch.tensor / as_tensor / asarray with device='cuda': build on the CPU, then upload."""
    args, kwargs = _read_remote_elements(args, kwargs)
    d = _device(kwargs.get("device")) or _context_device()
    if func is _ASARRAY and kwargs.get("copy") is False:
        _refuse_alias_across_devices(args[0] if args else kwargs.get("obj"), d)
    if d is None or d.type != "cuda":
        if d is not None and d.type == "meta":
            with _UserMeta():
                return func(*args, **kwargs)
        return func(*args, **_unpinned(kwargs))
    kw = dict(kwargs, device="cpu")
    requires_grad = kw.pop("requires_grad", False)
    src = args[0] if args else kw.get("obj", kw.get("data"))
    if isinstance(src, RemoteTensor) and func is _ASARRAY:
        return _asarray_of(src, torch.device("cuda", _cuda_index(d)), kwargs)
    if isinstance(src, RemoteTensor):
        copies = func is _TENSOR  # (as_tensor and asarray give ``src`` itself, when it is already as asked)
        if copies:
            _warn_copy_construct("torch.tensor")
        out = (src.detach() if copies else src).to(device=torch.device("cuda", _cuda_index(d)),
                                                   dtype=kw.get("dtype"), copy=copies)
    else:
        out = to_cuda(func(*args, **kw), _cuda_index(d))
    return _requiring_grad(out, True) if requires_grad else out


def _refuse_alias_across_devices(src: Any, d: torch.device | None) -> None:
    """``torch.asarray(t, device=..., copy=False)`` of a 'cuda' tensor asked onto another device
    (the CPU, another GPU): torch's refusal, in its words. C++ would read the wrapper's meta
    device (and name it), and the upload here would copy to another GPU where torch refuses."""
    if isinstance(src, RemoteTensor) and d is not None:
        d = torch.device("cuda", _cuda_index(d)) if d.type == "cuda" else d  # (torch gives 'cuda' its index)
        if d != src.device:
            raise ValueError(f"can't alias tensor from device '{src.device}' to '{d}'.")


def _asarray_of(src: RemoteTensor, device: torch.device, kwargs: dict) -> torch.Tensor:
    """``torch.asarray`` of a 'cuda' tensor onto a GPU, decided as torch's C++ decides it (which,
    handed the wrapper, would compare the wrapper's 'meta' device): a copy for ``copy=True`` (a
    clone on the same GPU) or for another dtype or GPU, else the tensor itself; ``requires_grad``,
    unless given, is the tensor's (with torch's once-a-process note), set on the result, on the
    tensor itself when it is the result, as torch sets it; a result that is no leaf and is not to
    require grad is detached."""
    dtype, copy, requires_grad = kwargs.get("dtype"), kwargs.get("copy"), kwargs.get("requires_grad")
    if requires_grad is None and src.requires_grad:
        _ASARRAY(torch.empty(0, requires_grad=True), device="cpu")  # (torch's note, counted as torch counts it)
    if copy is False and dtype is not None and dtype != src.dtype:  # (another GPU was refused already)
        raise ValueError(f"can't alias tensor with dtype '{_scalar_type(src.dtype)}' "
                         f"into dtype '{_scalar_type(dtype)}'.")
    moves = device != src.device or (dtype is not None and dtype != src.dtype)
    out = src.to(device=device, dtype=dtype, copy=bool(copy)) if moves else src.clone() if copy else src
    grad = src.requires_grad if requires_grad is None else bool(requires_grad)
    if not out.is_leaf and not grad:
        return out.detach()
    return _requiring_grad(out, grad)


def _requiring_grad(t: torch.Tensor, flag: bool) -> torch.Tensor:
    """``t`` with requires_grad set as a factory's ``requires_grad=`` sets it (C++'s
    ``set_requires_grad``, whose refusal of an integer tensor words it otherwise than
    ``requires_grad_``)."""
    if flag and not (t.is_floating_point() or t.is_complex()):
        raise RuntimeError("Only Tensors of floating point and complex dtype can require gradients")
    return t.requires_grad_(flag)


def _scalar_type(dtype: torch.dtype) -> str:
    """C++'s name of a dtype ('Float' for torch.float32), as torch's messages print it."""
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")


def _warn_copy_construct(name: str) -> None:
    """torch's C++ warning for ``torch.tensor(t)`` / ``t.new_tensor(t)`` of a tensor, which the call
    made here never reaches (placed here, shown at the program's line: warning_location.py)."""
    warnings.warn("To copy construct from a tensor, it is recommended to use sourceTensor.detach().clone() or "
                  f"sourceTensor.detach().clone().requires_grad_(True), rather than {name}(sourceTensor).",
                  UserWarning, stacklevel=1)


def _sparse_factory(func: Callable, args: tuple, kwargs: dict) -> Any:
    """torch.sparse_*_tensor on 'cuda', or of 'cuda' indices and values: a COO one is a
    RemoteSparse (sparse.py); C++ would say of the others that the device is absent: say why."""
    d = _device(kwargs.get("device")) or _context_device()
    remote = any(isinstance(a, RemoteTensor) for a in itertools.chain(args, kwargs.values()))
    if (d is None or d.type != "cuda") and not remote:
        return func(*args, **kwargs)
    lay = kwargs.get("layout") or _SPARSE_LAYOUTS[func.__name__]
    if lay is not torch.sparse_coo:
        raise not_dense(lay, "made on")
    if kwargs.get("requires_grad"):
        raise NotImplementedError("remotecuda: sparse 'cuda' tensors that require grad are not supported; "
                                  "make a dense one (t.to_dense()) or keep it on the CPU")
    if d is not None and not remote:
        kw = {k: v for k, v in kwargs.items() if k != "pin_memory"}
        return to_cuda(func(*args, **dict(kw, device="cpu")), _cuda_index(d))  # (cpu: past a device context)
    return sparse.build(*args, **kwargs)


_SPARSE_LAYOUTS = {"sparse_coo_tensor": torch.sparse_coo, "sparse_csr_tensor": torch.sparse_csr,
                   "sparse_csc_tensor": torch.sparse_csc, "sparse_bsr_tensor": torch.sparse_bsr,
                   "sparse_bsc_tensor": torch.sparse_bsc, "sparse_compressed_tensor": torch.sparse_csr}


def _read_remote_elements(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A factory's data with the 'cuda' tensors inside its lists (``torch.tensor([loss_a, loss_b])``)
    read into CPU copies, in one round trip: torch reads each element's value, as from a GPU; a
    wrapper would be a sequence to C++ (its ``__getitem__`` is Python) and a 0-d one has no len()."""
    data = args[0] if args else kwargs.get("obj", kwargs.get("data"))
    if type(data) is not list and type(data) is not tuple:
        return args, kwargs
    local = downloads.localized(data)  # (requires_grad kept: torch warns of it)
    if local is data:
        return args, kwargs
    if args:
        return (local, *args[1:]), kwargs
    return args, {k: local if v is data else v for k, v in kwargs.items()}


def _new_tensor(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``t.new_tensor(data)`` of a 'cuda' ``t``: a 'cuda' tensor of ``data``, ``t`` a remote tensor
    or torch.func's wrapper of one (inside ``grad``/``vmap``/``jvp``), on ``t``'s device."""
    self = args[0]
    d = _device(kwargs.get("device"))
    remote = _remote_inside(self)
    if d is None and remote is not None:
        index = remote._dev
    elif d is not None and d.type == "cuda":
        index = _cuda_index(d)
    else:
        return _made_here(func, args, kwargs, meta=d is not None and d.type == "meta")  # (or a CPU tensor's)
    kw = dict(kwargs)
    requires_grad = kw.pop("requires_grad", False)
    kw.pop("device", None)
    kw.setdefault("dtype", self.dtype)
    data = args[1] if len(args) > 1 else kw.pop("data")
    if isinstance(data, torch.Tensor):
        _warn_copy_construct("tensor.new_tensor")
        cpu = data.detach().cpu().to(kw["dtype"]).clone()
    else:
        cpu = torch.tensor(data, **kw)
    out = to_cuda(cpu, index)
    return _requiring_grad(out, True) if requires_grad else out


def _getitem(func: Callable, args: tuple, kwargs: dict) -> Any:
    if isinstance(args[0], RemoteTensor):
        args = (args[0], indexing.index_parts(args[1]), *args[2:])
    return func(*args, **kwargs)


def _setitem(func: Callable, args: tuple, kwargs: dict) -> Any:
    self = args[0]
    remote = _remote_inside(self)
    if remote is not None:
        value = args[2]
        if isinstance(value, (int, float, bool, complex)):
            value = torch.tensor(value, dtype=self.dtype)  # C++ would build a plain meta scalar
        elif isinstance(value, torch.Tensor) and _remote_inside(value) is None and value.dim() > 0:
            value = to_cuda(value, remote._dev)
        args = (self, indexing.index_parts(args[1]), value)
        try:
            return func(*args, **kwargs)
        except TypeError as e:  # "can't assign a str to a torch.meta.FloatTensor": name the cuda type
            if "torch.meta." not in str(e):
                raise
            raise TypeError(str(e).replace("torch.meta.", "torch.cuda.")) from None
    return func(*args, **kwargs)


def _set_data(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``p.data = new``: the wrapper must follow the new handle, not only the new metadata. It takes
    new's lazy conjugate and negative bits first (``p.data = z.conj()`` makes p one, as on a GPU):
    C++ refuses wrappers whose keys differ, where a GPU's tensors of one backend are compatible."""
    self, new = args
    if isinstance(self, RemoteTensor) and not isinstance(new, RemoteTensor):
        new = to_cuda(new.detach(), self._dev)
    if isinstance(new, RemoteTensor):
        if not isinstance(self, RemoteTensor):  # p.data = p.data.cuda(): p becomes a cuda tensor
            fresh = new.detach()
            fresh.requires_grad_(self.requires_grad)
            saved = {k: v for k, v in self.__dict__.items() if k not in OWN_KEYS}  # (all its attributes)
            if type(self) is torch.nn.Parameter:
                saved["_is_param"] = True  # Parameter's isinstance check for subclass-backed parameters
            else:  # a library's subclass stays one, as on a GPU (the swap gives self fresh's class)
                tensor_subclasses.become(fresh, type(self))
            torch.utils.swap_tensors(self, fresh)
            self.__dict__.update(saved)
            return None
        bits = self.is_conj(), self.is_neg()
        torch._C._set_conj(self, new.is_conj())
        torch._C._set_neg(self, new.is_neg())
        try:
            func(self, new)
        except BaseException:
            torch._C._set_conj(self, bits[0])
            torch._C._set_neg(self, bits[1])
            raise
        follow(self, new)
        known.forget(self)
        return None
    return func(*args, **kwargs)


def _type_as(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``x.type_as(other)``: ``x.to(other's device and dtype)``, as torch defines it; C++ would
    take the device from the wrapper's options, 'meta', which names no 'cuda' device."""
    other = args[1] if len(args) > 1 else kwargs.get("other")
    if isinstance(other, RemoteTensor):
        return args[0].to(other.device, other.dtype)
    return func(*args, **kwargs)


def _pin_memory(func: Callable, args: tuple, kwargs: dict) -> Any:
    if isinstance(args[0], RemoteTensor):
        return func(*args, **kwargs)
    return args[0]  # page-locked memory is a local-GPU notion; the gateway receives from the socket


def _is_pinned(func: Callable, args: tuple, kwargs: dict) -> bool:
    return is_pinned(*args, **kwargs)


def _unpinned(kwargs: dict) -> dict:
    """A factory's ``pin_memory=True`` gives plain memory, as ``_pin_memory`` does: a CPU-only
    torch has no page-locked allocator and would raise."""
    return dict(kwargs, pin_memory=False) if kwargs.get("pin_memory") else kwargs


def _factory(func: Callable, args: tuple, kwargs: dict) -> Any:
    """A factory called by the user: ``device=0`` means the accelerator, which C++ says is
    absent, so make it 'cuda:0'; on 'meta' (given, or ``with torch.device('meta')``) it stays meta."""
    kwargs = _unpinned(kwargs)
    d = kwargs.get("device")
    if d is not None and isinstance(kwargs.get("out"), RemoteTensor):
        # (C++ checks the device's type against the ``out=``'s, whose own is meta here: the check
        # as a GPU's, and the ``out=`` then decides the device, as it does there)
        kind = cast(torch.device, _device(d)).type
        if kind != "cuda":
            raise RuntimeError(f"device type {kind} does not match device type of out parameter (cuda)")
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        d = None
    if type(d) is int:
        kwargs = dict(kwargs, device=torch.device("cuda", d))
    elif _is_meta(d if d is not None else _context_device()):
        with _UserMeta():
            return func(*args, **kwargs)
    return func(*args, **kwargs)


def _range(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The deprecated ``torch.range`` on 'cuda': made on the CPU and uploaded (its C++ binding
    takes a guard of the device before dispatch, which a CPU-only build refuses)."""
    d = _device(kwargs.get("device")) or _context_device()
    if d is None or d.type != "cuda":
        return _factory(func, args, kwargs)
    kw = dict(_unpinned(kwargs), device="cpu")
    requires_grad = kw.pop("requires_grad", False)
    return to_cuda(func(*args, **kw), _cuda_index(d)).requires_grad_(requires_grad)


def _nested_factory(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``torch.nested.nested_tensor(..., device='cuda')`` of the strided layout: say what to use
    (C++ guards the device first and would say only that CUDA is absent)."""
    d = _device(kwargs.get("device")) or _context_device()
    if d is not None and d.type == "cuda" and kwargs.get("layout") in (None, torch.strided):
        raise strided_nested()
    return func(*args, **kwargs)


def _cpu_only(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``Tensor.apply_``/``map_``/``map2_`` (a Python function per element) of a 'cuda' tensor: the
    TypeError a GPU's torch raises; C++ skips a meta tensor's ``apply_`` silently (the values stayed
    as they were) and refuses ``map_`` of a subclass in words of its own."""
    name = func.__name__
    if isinstance(args[0], RemoteTensor) and not (name == "apply_" and args[0].requires_grad):
        raise TypeError(f"{name} is only implemented on CPU tensors")
    return func(*args, **kwargs)


def _dropout(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``dropout`` as a GPU runs it: C++ picks the fused ``native_dropout`` kernel by the input's
    device, which on the client is meta, so it would take the CPU's ``bernoulli_`` path. A GPU
    gateway gets the fused op (one kernel, and the random numbers a local GPU draws); a CPU
    gateway keeps the CPU's path, as the local CPU reference does."""
    x, p, train = _dropout_args(*args, **kwargs)
    if train and 0 < p < 1 and isinstance(x, RemoteTensor) and x.numel() > 0 and \
            runtime.current().device(x._dev).kind == "cuda":
        return torch.ops.aten.native_dropout(x, p, train)[0]
    return func(*args, **kwargs)


def _dropout_args(input: Any, p: float, train: bool) -> tuple:
    return input, p, train


def _values_suffice(A: Any) -> bool:
    """Whether a values-only linalg call on ``A`` may skip the vectors, as it does for a plain
    tensor: C++ asks for them whenever a gradient may need them (``_may_require_fw_or_bw_grad``),
    which it assumes of every tensor subclass, so a cuda tensor always had them computed."""
    return isinstance(A, RemoteTensor) and not (torch.is_grad_enabled() and A.requires_grad) and \
        torch.autograd.forward_ad._current_level < 0


def _eigvalsh(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``linalg.eigvalsh`` as a GPU computes it, the eigenvalues alone: the gateway computed the
    eigenvectors too (``_values_suffice``), an ``eigh``'s cost, and values that differ from a
    values-only computation in the last bits."""
    A, uplo, out = _eigvalsh_args(*args, **kwargs)
    if out is not None or not _values_suffice(A):
        return func(*args, **kwargs)
    return torch.ops.aten._linalg_eigh(A, uplo, False)[0]


def _eigvalsh_args(A: Any, UPLO: str = "L", *, out: Any = None) -> tuple:
    return A, UPLO, out


def _svdvals(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``linalg.svdvals`` as a GPU computes it, the singular values alone (see ``_eigvalsh``)."""
    A, driver, out = _svdvals_args(*args, **kwargs)
    if out is not None or not _values_suffice(A):
        return func(*args, **kwargs)
    return torch.ops.aten._linalg_svd(A, False, False, driver=driver)[1]


def _svdvals_args(A: Any, *, driver: str | None = None, out: Any = None) -> tuple:
    return A, driver, out


def _matrix_rank(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``linalg.matrix_rank(..., out=)``: ATen's composite, given a tensor subclass (as a remote
    tensor is to C++) or under a dispatch mode (as remotecuda's is, while active, for CPU tensors
    too), takes its Composite Compliance branch, which returns a new tensor and leaves ``out`` as it
    was (uninitialized memory, silently); torch's plain path sums the singular values above the
    tolerance into ``out`` (``sum_out``), as this does with the rank."""
    out = kwargs.get("out")
    if out is None:
        return func(*args, **kwargs)
    rank = func(*args, **{k: v for k, v in kwargs.items() if k != "out"})
    return torch.sum(rank.unsqueeze(-1), -1, out=out)


def _one_hot(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.one_hot`` as CUDA's kernel computes it: C++ takes a meta-keyed tensor's traceable path,
    which compares with ``arange(num_classes)`` and so gave a row of zeros for a class out of range
    (a label of -1, or one past ``num_classes``), silently; CUDA's scatter refuses it (a
    device-side assert), as the gateway's scatter does."""
    x, n = _one_hot_args(*args, **kwargs)
    if not isinstance(x, RemoteTensor) or x.dtype != torch.int64:
        return func(*args, **kwargs)
    if x.numel() == 0:
        if n <= 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        return x.new_empty((*x.shape, n))
    if n == -1:
        n = int(x.max().item()) + 1
    elif n < 1:
        raise RuntimeError("num_classes should be positive")
    return x.new_zeros((*x.shape, n)).scatter_(-1, x.unsqueeze(-1), 1)


def _one_hot_args(tensor: Any, num_classes: int = -1) -> tuple:
    return tensor, num_classes


#: how C++ names a wrapper's type ("MetaFloatType"), where a GPU's torch says "torch.cuda.FloatTensor"
_META_TYPE = re.compile(r"\bMeta(\w+)Type\b")


def _engine_run_backward(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The autograd engine (``backward()``, ``autograd.grad``) as a GPU's. It skips its check of a
    given gradient's device for tensor subclasses: ``y.backward(torch.ones(3))`` for a 'cuda' ``y``
    left a CPU ``x.grad``, where a GPU refuses the gradient (and under torch.func, whose wrapper of
    a 'cuda' output C++ saw as 'meta': "expected device meta"). And its errors name a 'cuda' tensor by
    its wrapper's C++ type: a tensor modified in place after it was saved is "[MetaFloatType [3]]",
    not "[torch.cuda.FloatTensor [3]]"."""
    outputs, grads = (args[0], args[1]) if len(args) > 1 else (args[0] if args else (), ())
    for i, (out, grad) in enumerate(zip(outputs, grads)):
        if not (isinstance(out, torch.Tensor) and isinstance(grad, torch.Tensor)) or grad.dim() == 0 \
                or grad.device.type == "meta":
            continue  # (a GradientEdge; a 0-d gradient, which C++ moves; vmap's batched 'cuda' gradient)
        if (_stands_for_remote(out) or _stands_for_remote(grad)) and grad.device != out.device:
            raise RuntimeError(f"invalid gradient at index {i} - expected device {out.device} but got {grad.device}")
    trial = _backward_waits(outputs)
    try:
        result = func(*args, **kwargs)
    except RuntimeError as e:
        if type(e) is not RuntimeError or not any(isinstance(t, RemoteTensor) for t in outputs) or \
                not _META_TYPE.search(str(e)):
            raise
        raise RuntimeError(_META_TYPE.sub(r"torch.cuda.\1Tensor", str(e))) from None
    if trial is not None:
        _backward_ran(trial, outputs)
    return result


def _checked_function_backward(original: Callable) -> Callable:
    """A custom ``autograd.Function``'s backward whose gradient for a 'cuda' input is on another
    device (``torch.ones(n)`` where ``torch.ones_like(g)`` was meant) is refused as a GPU refuses
    it: C++ skips that check for tensor subclasses, and the input's ``.grad`` came out on the CPU."""
    @functools.wraps(original)
    def apply(self: Any, *args: Any) -> Any:
        grads = original(self, *args)
        remote = next((a.device for a in args if isinstance(a, RemoteTensor)), None)
        for i, (grad, (node, nr)) in enumerate(zip(grads if isinstance(grads, tuple) else (grads,),
                                                   self.next_functions)):
            if node is None or not isinstance(grad, torch.Tensor) or grad.dim() == 0 or \
                    torch._C._functorch.is_legacy_batchedtensor(grad):
                continue  # (autograd's vmap's batched gradient: is_grads_batched, jacobian(vectorize=True),
                # whose device is its C++ wrapper's, 'meta' for a 'cuda' one)
            leaf = getattr(node, "variable", None)
            if leaf is not None:
                expected = leaf.device
                bad = grad.device != expected and (_stands_for_remote(grad) or _stands_for_remote(leaf))
            else:  # (a wrapper's C++ device is 'meta': a 'cuda' tensor, on which device it does not say)
                expected = node._input_metadata[nr].device
                bad = _stands_for_remote(grad) != (expected.type == "meta") and grad.device.type != "meta"
                if expected.type == "meta":
                    expected = remote or torch.device("cuda", torch.cuda.current_device())
            if bad:
                raise RuntimeError(f"Function {type(self).__name__} returned an invalid gradient at index {i} - "
                                   f"expected device {expected} but got {grad.device}")
        return grads
    return apply


def _backward_waits(outputs: Any) -> torch.device | None:
    """A backward pass on 'cuda' tensors waits for its forward pass's work, until one has
    succeeded, and again once the program has made a tensor larger than any before it (a larger
    batch: Lightning's batch-size finder doubles it until a trial runs out of memory). A GPU
    raises an out-of-memory error at the forward's failing line, inside the
    ``try: loss = model(batch); loss.backward() except torch.cuda.OutOfMemoryError:`` that
    retries with a smaller batch; here it came at a later read, outside it. Raised here, before the
    backward runs (so no gradient is made from skipped ops); passes making nothing larger do not
    wait. The device waited on when this pass is such a trial (``_backward_ran`` waits after it
    too), else None."""
    rt = runtime.current()
    largest = rt.dispatcher.largest_new
    if rt.backward_waited_at >= largest or rt.capturing is not None or not _active_here():
        return None
    out = next((o for o in outputs if isinstance(o, RemoteTensor)), None)
    if out is None:
        return None
    torch.cuda.synchronize(out.device)
    rt.backward_waited_at = largest
    return out.device


def _backward_ran(device: torch.device, outputs: Any) -> None:
    """A trial backward pass (``_backward_waits``) waits for its own work too: a GPU's allocator
    fails inside ``loss.backward()``, which raises the OutOfMemoryError, where here it came at the
    optimizer's step or a later read, outside a ``try`` around the backward. The gradients the
    failed pass was to make are then None, as on a GPU where it stopped before making them."""
    try:
        torch.cuda.synchronize(device)
    except Exception:
        _forget_uncomputed_grads(_leaves(outputs))
        raise


def _leaves(outputs: Any) -> list:
    """The leaf tensors a backward pass from ``outputs`` accumulates gradients into (its graph's
    AccumulateGrad nodes), walked on an error path only."""
    seen: set = set()
    leaves = []
    stack: list = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None:
            leaves.append(leaf)
        stack.extend(n for n, _ in node.next_functions)
    return leaves


def _step_waits(opt: Any, args: tuple, kwargs: dict) -> None:
    """An optimizer's first step on 'cuda' parameters waits for the work queued before it, and
    so does its first step after the program has made a tensor larger than any before (as
    ``_backward_waits``). A GPU raises an error at the failing line: out of memory in the forward
    or backward pass, caught to retry with a smaller batch (``except torch.cuda.OutOfMemoryError``).
    Here it came at a later sync, and the step between made the optimizer's state (``exp_avg``...)
    from ops skipped after the failure: the retry's step then failed on tensors "never computed".
    Raised here, before the state is made; other steps do not wait."""
    rt = runtime.current()
    largest = rt.dispatcher.largest_new
    if rt.stepped.get(opt, -1) >= largest or rt.capturing is not None or not _active_here():
        return  # (nothing may wait while a CUDA graph is captured)
    for group in opt.param_groups:
        for p in group["params"]:
            if isinstance(p, RemoteTensor) and p.grad is not None:
                try:
                    torch.cuda.synchronize(p.device)
                except Exception:
                    _forget_uncomputed_grads([q for g in opt.param_groups for q in g["params"]])
                    raise
                rt.stepped[opt] = largest
                return


def _forget_uncomputed_grads(params: Iterable) -> None:
    """After a failure before an optimizer's step or at the end of a backward pass, the gradients
    of ``params`` made from ops skipped after it are None, as on a GPU where that backward pass
    never ran or stopped (the forward's or its own OOM): the
    common loop ``backward(); step(); zero_grad()`` never reaches its ``zero_grad``, and the
    retry's backward accumulated into them, failing again. One question per gateway."""
    held: dict[Any, list] = {}
    for p in params:
        if isinstance(p, RemoteTensor) and isinstance(p.grad, RemoteTensor) and not p.grad._s.closed:
            held.setdefault(p.grad._s, []).append(p)
    for session, mine in held.items():
        computed = session.request("rc::computed", [p.grad._h for p in mine])
        for p, ok in zip(mine, computed):
            if not ok:
                p.grad = None


def _get_default_device(func: Callable, args: tuple, kwargs: dict) -> torch.device:
    """Under ``set_default_device('cuda')`` torch finds the index by making ``torch.tensor([])``
    there: an upload; the current device says it without one."""
    d = _context_device()
    if d is not None and d.type == "cuda" and d.index is None:
        return torch.device("cuda", runtime.current().current_device)
    return func(*args, **kwargs)


#: factories taking a ``device=``, in ``torch`` and as ``Tensor.new_*``
_FACTORIES = ("zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "arange",
              "linspace", "logspace", "eye", "empty_strided", "empty_permuted", "normal", "scalar_tensor",
              "tril_indices", "triu_indices", "zeros_like", "ones_like", "empty_like", "full_like",
              "rand_like", "randn_like", "randint_like", "hann_window", "hamming_window", "bartlett_window",
              "blackman_window", "kaiser_window")
_NEW_FACTORIES = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_zeros")

#: (owner, attribute, handler): the Python-level functions replaced while active; a handler
#: gets the original function, the positional arguments and the keyword arguments
_ROUTES: list[tuple[Any, str, Callable]] = [
    *((torch, name, _factory) for name in _FACTORIES),
    *((torch.Tensor, name, _factory) for name in _NEW_FACTORIES),
    (torch, "range", _range),
    (torch.nested, "nested_tensor", _nested_factory),
    (torch.nested, "as_nested_tensor", _nested_factory),
    *((torch.Tensor, name, _cpu_only) for name in ("apply_", "map_", "map2_")),
    (torch.fft, "fftfreq", _factory),
    (torch.fft, "rfftfreq", _factory),
    (torch.Tensor, "to", _tensor_to),
    (torch.Tensor, "type_as", _type_as),
    (torch._C._nn, "_parse_to", _parse_to),  # what Tensor.to (above) and Module.to read their arguments with
    (torch.Tensor, "cuda", _tensor_cuda),
    (torch.Tensor, "copy_", _tensor_copy_),
    (torch, "ctc_loss", _ctc_loss),
    (torch, "tensor", _data_factory),
    (torch, "as_tensor", _data_factory),
    (torch, "asarray", _data_factory),
    (torch.Tensor, "new_tensor", _new_tensor),
    *((torch, name, _sparse_factory) for name in _SPARSE_LAYOUTS),
    (torch.Tensor, "type", legacy_types.tensor_type),
    (torch.Tensor, "new", legacy_types.tensor_new),
    (torch, "set_default_tensor_type", legacy_types.set_default_tensor_type),
    # on RemoteTensor only: a Python ``__getitem__`` on torch.Tensor would make every tensor a
    # sequence to C++, and ``torch.tensor([a, b])`` of 0-d tensors would take len() of them
    (RemoteTensor, "__getitem__", _getitem),
    (torch.Tensor, "__setitem__", _setitem),
    (torch.nn.functional, "scaled_dot_product_attention", autocast.sdpa),
    *((torch._VF, name, rnn.rnn) for name in rnn.NAMES),  # what nn.LSTM/GRU/RNN call
    (torch._VF, "dropout", _dropout),  # what F.dropout calls
    (torch, "dropout", _dropout),
    (torch.linalg, "eigvalsh", _eigvalsh),
    (torch.linalg, "svdvals", _svdvals),
    (torch.linalg, "matrix_rank", _matrix_rank),
    (torch.nn.functional, "one_hot", _one_hot),
    (torch.autograd, "_engine_run_backward", _engine_run_backward),  # what backward() and grad() call
    (torch._C._nn, "one_hot", _one_hot),
    (torch, "get_default_device", _get_default_device),
    (torch, "tensor_split", _tensor_split),
    (torch.Tensor, "tensor_split", _tensor_split),
    (torch.export, "export", _export),
    (torch.export, "draft_export", _export),
    (torch.library, "opcheck", _opcheck),
    (torch.nn.TransformerEncoder, "forward", transformer_encoder.forward),
    (torch.utils.data._utils.collate, "collate", tensor_subclasses.collate),  # what default_collate calls
]


#: routes taken in every thread: a CPU-only torch cannot pin memory in any thread once the
#: accelerator is said to exist (DataLoader(pin_memory=True) pins in a thread of its own)
_ROUTES_EVERY_THREAD: list[tuple[Any, str, Callable]] = [
    (torch.Tensor, "pin_memory", _pin_memory),
    (torch.Tensor, "is_pinned", _is_pinned),
]


def _routed(original: Callable, handler: Callable, method: bool = False) -> Callable:
    """``original`` through ``handler`` in threads where remotecuda is active (the dispatch mode
    is per thread; the patch is not): elsewhere plain PyTorch, not a stray meta tensor.
    ``method``: ``original`` is a Tensor method, whose ``self``'s ``__torch_function__`` is
    called first, with the routed method as the function (``_subclass_first``)."""
    stack_len, active_here = _mode_stack_len, runtime.active_here
    first = _subclass_first if method else None
    handle = torch.overrides.handle_torch_function

    def routed(*args: Any, **kwargs: Any) -> Any:
        if stack_len() or active_here():  # (the C call first: the common case)
            if first is not None and args and first(args[0]):
                return handle(public, args[:1], *args, **kwargs)
            return handler(original, args, kwargs)
        return original(*args, **kwargs)
    public = functools.wraps(original)(_with_globals_of(original, routed))
    return public


def _adopting(dispatch: Callable) -> Callable:
    """``Dispatcher.dispatch`` for RemoteTensor's own ``__torch_dispatch__``, which handles a remote
    tensor's op in a thread without the dispatch mode: a thread started before activation takes
    the mode at its first op (``runtime.active_here``), so that the factories of the ops after it
    (an index read from a list, a number made a tensor) are remote, not stray meta tensors.
    (Where the mode is on, it handles every op before this is asked.)"""
    stack_len, active_here = _mode_stack_len, runtime.active_here

    def adopting(func: Any, args: tuple, kwargs: dict) -> Any:
        if not stack_len():
            active_here()
        return dispatch(func, args, kwargs)
    return adopting


def _with_globals_of(original: Callable, fn: Callable) -> Callable:
    """``fn`` (whose code reads no globals) with ``original``'s module globals, where it has them:
    ``torch.jit.script`` of a module whose ``forward`` is routed (``nn.TransformerEncoder``)
    compiles the original's source (found through ``__wrapped__``) with the names of the
    function it was given, and ``F``, ``Tensor``... are the original module's."""
    names = getattr(original, "__globals__", None)
    if names is None:
        return fn
    return types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)


def _everywhere(original: Callable, handler: Callable) -> Callable:
    """``original``, a Tensor method, through ``handler`` in every thread, after its ``self``'s
    ``__torch_function__`` as in ``_routed``."""
    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        if args and _subclass_first(args[0]):
            return torch.overrides.handle_torch_function(routed, args[:1], *args, **kwargs)
        return handler(original, args, kwargs)
    return routed


def _data_property() -> property:
    """``Tensor.data`` with a setter that keeps a wrapper's handle in step (``p.data = x``), and a
    getter that drops a remote tensor's known values (known.py): PyTorch gives ``t.data`` a
    version counter of its own, so a write through it (``mask.data[1, :2] = 0``) would not show
    in ``t``'s, and the old copy would still pass for ``t``'s values."""
    def get_data(self: torch.Tensor) -> torch.Tensor:
        if isinstance(self, RemoteTensor):
            known.forget(self)
        return _DATA.__get__(self)

    def set_data(self: torch.Tensor, new: torch.Tensor) -> None:
        _set_data(_DATA.__set__, (self, new), {})
    return property(get_data, set_data, doc=_DATA.__doc__)


def _grad_property() -> property:
    """``Tensor.grad`` whose setter names 'cuda' where C++ names a wrapper's device ('meta') in its
    refusal of a gradient on another device (``p.grad = torch.zeros(n)`` for a cuda ``p``)."""
    getset = vars(torch._C.TensorBase)["grad"]

    def set_grad(self: torch.Tensor, new: Any) -> None:
        try:
            getset.__set__(self, new)
        except RuntimeError as e:
            if "device type 'meta'" not in str(e):
                raise
            raise RuntimeError(str(e).replace("device type 'meta'", "device type 'cuda'")) from None
    return property(getset.__get__, set_grad, getset.__delete__, doc=getset.__doc__)


_IS_META: Any = vars(torch._C.TensorBase)["is_meta"].__get__
_has_torch_function_unary = torch._C._has_torch_function_unary
_functorch = torch._C._functorch


def _remote_under_transform(t: torch.Tensor) -> RemoteTensor | None:
    """The remote tensor that torch.func's wrappers (vmap, grad, jvp, functionalize) hold, or a
    jagged nested tensor's remote values (nested.py), or None. A wrapper is a C++ tensor on its
    inner tensor's C++ device: meta, for a remote one."""
    if not _IS_META(t):
        return None
    if not _functorch.is_functorch_wrapped_tensor(t):
        return nested.inner_remote(t)
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t if isinstance(t, RemoteTensor) else None


def _remote_inside(t: torch.Tensor) -> RemoteTensor | None:
    """``t`` if it is a remote tensor, the remote tensor inside it if it is torch.func's wrapper of
    one (``t`` inside ``grad``/``vmap``/``jvp``), else None. C++ makes what a call on a wrapper
    builds (a list index, ``new_tensor``'s data) on the wrapper's C++ device, meta."""
    if isinstance(t, RemoteTensor):
        return t
    return _remote_under_transform(t) if _functorch.is_functorch_wrapped_tensor(t) else None


def _stands_for_remote(t: torch.Tensor) -> bool:
    """Whether ``t`` is a 'cuda' tensor: a remote one, or torch.func's wrapper of one (the
    gradient a custom Function's backward gets and returns under ``torch.func.grad``)."""
    return isinstance(t, RemoteTensor) or _remote_under_transform(t) is not None


def _remote_device(t: torch.Tensor) -> torch.device | None:
    """The 'cuda' device a C++ meta tensor stands for: that of the remote tensor inside it
    (``_remote_under_transform``), or the one another library's wrapper subclass was made for
    (tensor_subclasses.py); None for any other tensor."""
    if not _IS_META(t):
        return None
    remote = _remote_under_transform(t)
    return remote.device if remote is not None else tensor_subclasses.device_of(t)


#: what each identity property says of a tensor that stands for a 'cuda' device
_OF_REMOTE: dict[str, Callable[[torch.device], Any]] = {
    "device": lambda d: d, "is_cuda": lambda d: True, "is_meta": lambda d: False}


def _identity_property(name: str) -> property:
    """``Tensor.<name>`` (device, is_cuda, is_meta) answering for the remote tensor inside a
    torch.func wrapper, as a GPU's wrapper does (per-sample gradients run model code such as
    ``torch.arange(n, device=x.device)`` and ``.to(other)`` under vmap and grad), and for another
    library's wrapper subclass made for 'cuda'. Handed to a subclass's or a mode's
    ``__torch_function__`` first, as C++'s getter is, so that it sees the one read a program
    makes, not this one's own look (``is_meta``) too."""
    getset = vars(torch._C.TensorBase)[name]
    plain = getset.__get__
    of_remote = _OF_REMOTE[name]

    def get(self: torch.Tensor) -> Any:
        if _has_torch_function_unary(self):
            return torch.overrides.handle_torch_function(prop.__get__, (self,), self)
        device = _remote_device(self)
        return plain(self) if device is None else of_remote(device)
    prop = property(get, doc=getset.__doc__)
    return prop


@functools.wraps(torch._C.TensorBase.get_device)  # (the name a __torch_function__ is shown, as torch's)
def _get_device(self: torch.Tensor) -> int:
    if _has_torch_function_unary(self):  # (as C++'s method: see _identity_property)
        return torch.overrides.handle_torch_function(_get_device, (self,), self)
    device = _remote_device(self)
    return torch._C.TensorBase.get_device(self) if device is None else device.index


def _profile_init(original: Callable) -> Callable:
    """``torch.autograd.profiler.profile`` (what ``torch.profiler.profile`` runs) without CUDA
    timing: a CPU-only torch has no CUDA profiler and falls back to recording CUDA events,
    warning with a C++ stack at every op; the ops' CPU side is profiled as before."""
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, use_cuda: bool = False, use_device: Any = None, **kwargs: Any) -> None:
        if use_cuda or use_device == "cuda":
            use_cuda, use_device = False, None
        original(self, *args, use_cuda=use_cuda, use_device=use_device, **kwargs)
    return __init__


def _linearize(original: Callable) -> Callable:
    """``torch.func.linearize`` refusing 'cuda' primals: it traces with make_fx, whose tracer passes
    over the wrapper subclass, so its jvp function held the value the tangent had while tracing
    (a constant)."""
    @functools.wraps(original)
    def linearize(func: Callable, *primals: Any) -> Any:
        if any(isinstance(t, RemoteTensor) for t in torch.utils._pytree.tree_leaves(primals)):
            raise NotImplementedError("remotecuda: torch.func.linearize cannot trace 'cuda' tensors (make_fx "
                                      "passes over them); torch.func.jvp computes the same products")
        return original(func, *primals)
    return linearize


def _emit_nvtx_enter(self: Any) -> Any:
    """``emit_nvtx``: NVTX ranges are no-ops here, as ``torch.cuda.nvtx``'s are (there is no local
    GPU timeline to mark; a CPU-only torch refuses the NVTX profiler)."""
    return self


def _emit_nvtx_exit(self: Any, *exc: Any) -> bool:
    return False


class AutocastMode(TorchFunctionMode):
    """CUDA autocast's casting policies, active only inside a ``torch.autocast('cuda')`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: dict[Callable, Callable] = {}  # see autocast.body
        self.running: set[Callable] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        policy = autocast.POLICY.get(func)
        if policy is not None:
            return autocast.apply(policy, func, args, kwargs)
        inner = autocast.decomposition(func, args, kwargs, _UserMeta)
        if inner is not None:
            with self:  # (its inner calls meet the policies)
                return inner(*args, **kwargs)
        if func not in self.running and autocast.composite(func) and torch.is_autocast_enabled("cuda") \
                and autocast.has_remote(args, kwargs):
            body = self.bodies.get(func) or self.bodies.setdefault(func, autocast.body(func))
            self.running.add(func)  # (a callee that hands the same function back to the mode runs it plainly)
            try:
                with self:  # its own calls (multi_head_attention_forward's linear) meet the policies too
                    return body(*args, **kwargs)
            finally:
                self.running.discard(func)
        return func(*args, **kwargs)


def _autocast_enter(original: Callable) -> Callable:
    def __enter__(self: Any) -> Any:
        out = original(self)
        if self.device == "cuda":
            mode = AutocastMode()
            mode.__enter__()
            self.__dict__.setdefault("_remotecuda_modes", []).append(mode)  # a decorator re-enters
        return out
    return __enter__


def _autocast_exit(original: Callable) -> Callable:
    def __exit__(self: Any, *exc: Any) -> Any:
        modes = self.__dict__.get("_remotecuda_modes")
        if modes:
            modes.pop().__exit__(None, None, None)
        return original(self, *exc)
    return __exit__


_REMOTE_ONLY = (RemoteTensor,)
_UNRECORDED = torchscript.UNRECORDED
_NUMBERS = (bool, int, float, complex)


def _numbers_as_tensors(func: Any, args: tuple) -> tuple | None:
    """``args`` with numbers in Tensor places made tensors again, or None if there are none.

    A mode receives torch's wrapped-number tensors (the constants of a TorchScript graph: ``x * 2``
    traced) as plain numbers, and only torch's arithmetic ops take a number back in a Tensor
    place: TorchScript's own passes (``equal`` of two constants, printing one) would fail under
    any active mode. Made as torch makes them (int64, float64, complex128), they run as before."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    places = [i for i, (a, arg) in enumerate(zip(args, schema.arguments))
              if type(a) in _NUMBERS and isinstance(arg.type, torch.TensorType)]
    if not places:
        return None
    return tuple(torch.tensor(a) if i in places else a for i, a in enumerate(args))


class RemoteDispatchMode(TorchDispatchMode):
    """Sends ops on remote tensors, and factories headed for 'cuda', to the runtime's dispatcher."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        super().__init__()
        self.dispatcher = dispatcher
        self.dispatch = dispatcher.dispatch  # bound once: called for every op

    #: higher-order ops (flex_attention, cond, ...) come here too, with no types: see ``_higher_order``
    supports_higher_order_operators = True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # Dynamo runs only with this mode stepped aside (compiled.py); its guard costs ~9 us per op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _UNRECORDED and torch._C._get_tracing_state() is not None:  # (torch.jit.trace)
            return torchscript.record(torch._C._get_tracing_state(), func, args, lambda: self.dispatch(
                func, args, kwargs) if RemoteTensor in types else func(*args, **kwargs))
        if types == _REMOTE_ONLY:  # (one comparison on the common path)
            return self.dispatch(func, args, kwargs)
        if types:
            wrapper = wrapper_type(types)
            if wrapper is not None:  # (a nested tensor: its ops on its parts, and the factories it calls, come here)
                return self.again(lambda: wrapper.__torch_dispatch__(func, types, args, kwargs))
            if RemoteTensor in types:
                return self.dispatch(func, args, kwargs)
        d = kwargs.get("device")
        if d is not None:
            if d.type == "cuda":
                return self.dispatcher.factory(func, args, kwargs, d.index)
            local = self.dispatcher.local
            if d.type == "meta" and not local.user_meta and not _stays_meta(func, args, kwargs):
                target = local.target
                if target is None and len(runtime.current().pool.sessions) > 1:
                    target = backward_device.current()  # (made by a backward formula: its node's device)
                return self.dispatcher.factory(func, args, kwargs, target if target is not None else local.vdev)
        if isinstance(func, HigherOrderOperator) and \
                any(isinstance(x, RemoteTensor) for x in pytree.tree_leaves((args, kwargs))):
            out = self.again(lambda: control_flow.dense(func, args, kwargs))
            if out is NotImplemented:
                _refuse_remote_higher_order(func)
            return out
        if "generator" in kwargs and generator.on_cuda(kwargs["generator"]):
            # (the carrier is a CPU generator, which would draw from its own seed, not the user's)
            raise RuntimeError("Expected a 'cpu' device type for generator but found 'cuda'")
        try:
            return func(*args, **kwargs)
        except RuntimeError:
            try:
                tensors = _numbers_as_tensors(func, args)
                if tensors is not None:
                    return func(*tensors, **kwargs)
            except Exception:  # (an int no int64 tensor holds: torch's error is the op's own)
                pass
            raise

    def again(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` with the mode on: torch takes it off the stack while it handles an op (one
        mode object per thread's stack: a fresh one)."""
        if isinstance(_get_current_dispatch_mode(), RemoteDispatchMode):
            return fn()
        with RemoteDispatchMode(self.dispatcher):
            return fn()


#: the dtypes of a Python number made a tensor (a "wrapped number")
_NUMBER_DTYPES = (torch.int64, torch.float64, torch.complex128, torch.bool)


def _stays_meta(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a 'meta' factory of C++ is one of forward-mode AD's shape checks on 'meta'
    (``mul_zerotensor``: ``dual * 2``): the zero tangent of a Python number moved there, or a
    plain meta tensor's copy. (The zero result then made for a remote tensor becomes remote.)"""
    if func is torch.ops.aten._efficientzerotensor.default:
        return not args[0] and kwargs.get("dtype") in _NUMBER_DTYPES
    return any(type(a) is torch.Tensor and a.is_meta for a in args)


def _refuse_remote_higher_order(op: HigherOrderOperator) -> None:
    """A higher-order op other than control_flow's on remote tensors: torch would say only that
    it has no rule for RemoteTensor."""
    raise NotImplementedError(
        f"remotecuda: torch's higher-order op {op.name()} is not supported on 'cuda' tensors yet "
        "(flex_attention, torch.cond, while_loop and map are): run it on CPU tensors, or write it "
        "with plain tensor ops")


class _Installed:
    """Whether the interception is still installed, for the threads that took its dispatch mode
    (``_thread_start``, ``Interception.adopt_thread``), and whether this thread took it: its stack
    is empty while the mode handles an op, which must not be read as a thread never given it."""

    def __init__(self) -> None:
        self.on = True
        self.threads = threading.local()

    def took(self) -> None:
        """Mark the calling thread as one that has the mode (for as long as it runs)."""
        self.threads.took = True

    def taken_here(self) -> bool:
        return getattr(self.threads, "took", False)


class _ThreadMode(RemoteDispatchMode):
    """The dispatch mode of a thread other than the installing one: plain PyTorch once deactivated
    (its stack is its own, so ``remove`` cannot pop it), the next activation's when there is one
    (a pool's worker thread outlives activations)."""

    def __init__(self, dispatcher: Dispatcher, installed: _Installed) -> None:
        super().__init__(dispatcher)
        self.installed = installed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.installed.on and not self._follow():
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _follow(self) -> bool:
        """Take the active interception's dispatcher, if remotecuda was activated again; whether it was.
        (The thread is marked as having the mode before any op it handles runs: ``adopt_thread``
        must not push another one while this one is off the stack.)"""
        rt = runtime.active()
        if rt is None or not isinstance(rt.interception, Interception):
            return False
        self.installed = rt.interception.installed
        self.installed.took()
        self.dispatcher, self.dispatch = rt.dispatcher, rt.dispatcher.dispatch
        return True


def _thread_start(original: Callable, dispatcher: Dispatcher, installed: _Installed) -> Callable:
    """``Thread.start``: a thread started by an active thread is active while it runs, as a GPU
    is the whole process's (libraries move weights to 'cuda' in thread pools: transformers'
    ``from_pretrained(device_map=...)``). remotecuda's own threads (``remotecuda-*``) stay plain."""
    @functools.wraps(original)
    def start(self: threading.Thread) -> None:
        if _mode_stack_len() and not self.name.startswith("remotecuda-"):
            run = self.run

            def active_run() -> None:
                if not installed.on:
                    return run()
                installed.took()
                with _ThreadMode(dispatcher, installed):
                    return run()
            self.run = active_run  # type: ignore[method-assign]
        return original(self)
    return start


# ---------------------------------------------------------------------- install / uninstall

def _entry(obj: Any, name: str) -> tuple[Any, bool]:
    """An attribute as ``_Patches`` saves it: the raw entry of a class or module, and whether it is there."""
    if isinstance(obj, (type, types.ModuleType)):
        return vars(obj).get(name), name in vars(obj)
    return getattr(obj, name, None), hasattr(obj, name)


def _put(obj: Any, name: str, value: Any, had: bool) -> None:
    if had:
        setattr(obj, name, value)
    elif _entry(obj, name)[1]:
        delattr(obj, name)


class _Patches:
    """Attribute replacements, remembered so that uninstall restores torch exactly.

    A replaced torch builtin stays one for TorchScript: ``torch.jit.script`` compiles a call to
    ``torch.zeros_like`` as ``aten::zeros_like`` by the function's identity, and would otherwise
    try to read the replacement's Python source (and fail: forward-mode AD scripts such
    functions when it first loads its decompositions)."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any, bool]] = []
        self.items: list[tuple[MutableMapping, Any, Any, bool]] = []
        self.builtins: list[int] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        seen = getattr(obj, name, None)  # (what code reads: torch._VF's functions are its __getattr__'s)
        if isinstance(obj, (type, types.ModuleType)):  # the raw entry: a descriptor, not what it gives
            had, old = name in vars(obj), vars(obj).get(name)
        else:
            had, old = hasattr(obj, name), seen
        self.saved.append((obj, name, old, had))
        setattr(obj, name, value)
        op = jit_builtins._find_builtin(seen) if callable(seen) else None
        if op is not None and jit_builtins._find_builtin(value) is None:
            jit_builtins._register_builtin(value, op)
            self.builtins.append(id(value))

    def remove(self, obj: Any, name: str) -> None:
        """``del obj.name`` (so that a module's ``__getattr__`` answers for it), undone by restore."""
        self.saved.append((obj, name, getattr(obj, name), True))
        delattr(obj, name)

    def set_item(self, table: MutableMapping, key: Any, value: Any) -> None:
        """``table[key] = value`` (``copyreg.dispatch_table``, ``os.environ``), undone by restore."""
        self.items.append((table, key, table.get(key), key in table))
        table[key] = value

    @contextlib.contextmanager
    def originals(self) -> Iterator[None]:
        """torch's own attributes (``set``, ``remove``) for the block, the replacements after."""
        now = [(obj, name, *_entry(obj, name)) for obj, name, _, _ in self.saved]
        for obj, name, value, had in reversed(self.saved):
            _put(obj, name, value, had)
        try:
            yield
        finally:
            for obj, name, value, had in now:
                _put(obj, name, value, had)

    def restore(self) -> None:
        for obj, name, value, had in reversed(self.saved):
            if had:
                setattr(obj, name, value)
            else:
                delattr(obj, name)
        self.saved.clear()
        for table, key, value, had in reversed(self.items):
            if had:
                table[key] = value
            else:
                table.pop(key, None)
        self.items.clear()
        table = jit_builtins._get_builtin_table()
        for key in self.builtins:
            table.pop(key, None)
        self.builtins.clear()


def _seeding_devices_too(original: Callable) -> Callable:
    """``torch.manual_seed`` seeds every CUDA device too."""
    def manual_seed(seed: int) -> Any:
        gen = original(seed)
        cuda_api.manual_seed_all(int(seed))
        return gen
    return manual_seed


def _group_by_device(original: Callable) -> Callable:
    """foreach grouping keys by the C++ device, meta for every remote tensor: split those groups by
    the tensors' cuda devices, so that a model spread over two devices steps each on its own."""
    def grouped(tensorlistlist: Any, with_indices: bool = False) -> Any:
        result = original(tensorlistlist, with_indices)
        fixed = {}
        for (device, dtype), (lists, indices) in result.items():
            if device.type != "meta" or not lists or not lists[0]:
                fixed[(device, dtype)] = (lists, indices)
                continue
            one = _one_device(lists[0])
            if one is not None:  # (the common case, a model on one device: no per-tensor regrouping)
                fixed[(one, dtype)] = (lists, indices)
                continue
            positions: dict[torch.device, list[int]] = {}
            for k in range(len(lists[0])):
                t = next((lst[k] for lst in lists if lst and isinstance(lst[k], RemoteTensor)), None)
                positions.setdefault(t.device if t is not None else device, []).append(k)
            for dev, ks in positions.items():
                fixed[(dev, dtype)] = ([[lst[k] for k in ks] if lst else lst for lst in lists],
                                       [indices[k] for k in ks] if indices else indices)
        return fixed
    return grouped


def _one_device(tensors: list) -> torch.device | None:
    """The cuda device of ``tensors`` when all are remote ones on that one device, else None."""
    devices = {t.__dict__.get("_dev") if isinstance(t, RemoteTensor) else None for t in tensors}
    if len(devices) != 1:
        return None
    dev = devices.pop()
    return None if dev is None else cuda_device(dev)


def _precomputed(fn: Callable, done: dict[int, Any]) -> Callable:
    """``fn``, answering the results in ``done`` (tensor id → already converted) once each."""
    def once(t: torch.Tensor) -> Any:
        applied = done.pop(id(t), None)
        return fn(t) if applied is None else applied
    return once


def _module_apply(original: Callable) -> Callable:
    """``Module._apply`` (``.cuda()``, ``.to()``, ``.double()``...) that swaps each parameter for its
    converted self (``swap_tensors``: an optimizer built before ``model.cuda()`` keeps training the
    same, now remote, parameters) only when the conversion crosses between here and the gateway,
    as a GPU's ``param.data = ...`` does; every other conversion is exactly torch's own. A live
    autograd graph holding a parameter forbids the swap: that module is then converted as torch
    does without it (new Parameter objects), not refused.

    While the outermost module converts, the pool holds its footprint as a hint: a device placed
    meanwhile (at the first parameter's upload) is placed knowing the whole model's size and dtypes."""
    def _apply(self: torch.nn.Module, fn: Callable, recurse: bool = True) -> torch.nn.Module:
        if not _active_here() or torch.__future__.get_swap_module_params_on_conversion():
            return original(self, fn, recurse)  # another thread, or the user's own choice of swap
        if not recurse:
            return convert(self, fn)
        with runtime.current().pool.hint(lambda: _footprint(self)):
            for module in self.children():
                module._apply(fn)
            return convert(self, fn)

    def convert(self: torch.nn.Module, fn: Callable) -> torch.nn.Module:
        # whether the conversion crosses, asked of one parameter on each side: a module can hold
        # both (a bias tied to a child's, which converted first), and all must keep their identity
        params = [p for p in self._parameters.values() if p is not None]
        probes = {id(p): p for p in (next((p for p in params if not isinstance(p, RemoteTensor)), None),
                                     next((p for p in params if isinstance(p, RemoteTensor)), None))
                  if p is not None}
        if not probes:
            return original(self, fn, False)
        with torch.no_grad():
            done = {i: fn(p) for i, p in probes.items()}
        crosses = any(isinstance(done[i], RemoteTensor) != isinstance(p, RemoteTensor) for i, p in probes.items())
        fn_once = _precomputed(fn, done)
        if not crosses:
            return original(self, fn_once, False)
        give_back = tensor_subclasses.keep_parameters(self)  # (a swap makes each a new Parameter first)
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            converted = original(self, fn_once, False)
        except RuntimeError as e:
            if "Couldn't swap" not in str(e):
                raise
        else:
            give_back()
            return converted
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
        if isinstance(self, torch.jit.RecursiveScriptModule):
            return torchscript.convert(self, fn)
        converted = original(self, fn, False)  # parameters swapped already convert to themselves
        give_back()
        return converted
    return _apply


def _footprint(module: torch.nn.Module) -> tuple[int, set[str]]:
    """The bytes and dtypes of a module's local parameters and buffers (those a move to 'cuda' uploads)."""
    tensors = [t for t in (*module.parameters(), *module.buffers())
               if not isinstance(t, RemoteTensor) and not is_lazy(t)]  # (a lazy module's has no shape yet)
    return sum(t.nelement() * t.element_size() for t in tensors), {str(t.dtype) for t in tensors}


def _cudnn_is_acceptable(tensor: torch.Tensor) -> bool:
    """The gateway's cuDNN takes what a GPU's would (the client has none to initialise)."""
    from torch.backends import cudnn
    return (torch._C._get_cudnn_enabled() and tensor.device.type == "cuda"
            and tensor.dtype in cudnn.CUDNN_TENSOR_DTYPES)


class Interception:
    """What ``install`` changed in torch and the process, for ``remove`` to undo: the patches,
    the dispatch mode pushed on the installing thread, and RemoteTensor's place in the foreach lists."""

    def __init__(self, patches: _Patches, mode: RemoteDispatchMode, foreach: list[list],
                 installed: _Installed) -> None:
        self.patches, self.mode, self.foreach, self.installed = patches, mode, foreach, installed

    def adopt_thread(self) -> bool:
        """Push the dispatch mode, for good, on the calling thread if it was started before
        activation (``runtime.active_here``): threads started while active take it at their
        start (``_thread_start``), and the installing thread at installation. remotecuda's own
        threads (``remotecuda-*``) stay plain. Whether the thread has the mode now."""
        installed = self.installed
        if not installed.on or installed.taken_here() or threading.current_thread().name.startswith("remotecuda-"):
            return False
        installed.took()
        _ThreadMode(self.mode.dispatcher, installed).__enter__()  # (left on: the thread's whole life)
        return True

    def originals(self) -> contextlib.AbstractContextManager[None]:
        """torch's own functions and attributes for a block (see ``_Patches.originals``)."""
        return self.patches.originals()

    def remove(self) -> None:
        self.installed.on = False
        if _get_current_dispatch_mode() is self.mode:  # (not in another thread, or a forked child of one)
            self.mode.__exit__(None, None, None)
        for lst in self.foreach:
            lst.remove(RemoteTensor)
        self.foreach = []
        self.patches.restore()
        warning_location.uninstall()
        compiled.forget_dynamo_code()
        library_caches.clear()
        uninstall_excepthook()


def _version_attribute(name: str) -> Any:
    """``torch.version``'s module ``__getattr__`` while active: its ``cuda`` is the gateway's."""
    if name == "cuda":
        return cuda_api.runtime_version()
    raise AttributeError(f"module 'torch.version' has no attribute {name!r}")


def _cuda_attribute(name: str) -> Any:
    """``torch.cuda``'s module ``__getattr__`` while active: its ``default_generators``, the devices'."""
    if name == "default_generators":
        return cuda_api.default_generators()
    raise AttributeError(f"module 'torch.cuda' has no attribute {name!r}")


def _not_the_triton_note(record: logging.LogRecord) -> bool:
    """A filter for flop_counter's logger: seeing ``torch.version.cuda`` set, it warns at import
    that triton is missing (Lightning and MFU counters import it), which a GPU machine's torch
    install, triton included, never says."""
    return not record.getMessage().startswith("triton not found")


def install(rt: Runtime) -> Interception:
    """Route 'cuda' to ``rt``: patch torch, push the dispatch mode on this thread."""
    p = _Patches()
    p.set(RemoteTensor, "dispatch", staticmethod(_adopting(rt.dispatcher.dispatch)))
    for name, obj in cuda_api.REPLACEMENTS.items():
        p.set(torch.cuda, name, obj)
        for module in (torch.cuda.memory, torch.cuda.random):  # what their own functions call
            if name in vars(module):
                p.set(module, name, obj)
    for name, obj in legacy_types.REPLACEMENTS.items():
        p.set(torch.cuda, name, obj)
    for name, obj in legacy_types.SPARSE_REPLACEMENTS.items():
        p.set(torch.cuda.sparse, name, obj)
    for name, obj in cuda_graphs.REPLACEMENTS.items():
        p.set(torch.cuda, name, obj)
        p.set(torch.cuda.graphs, name, obj)
    p.set(torch._C, "_cuda_jiterator_compile_and_launch_kernel", cuda_api.JITERATOR)
    if not hasattr(torch._C, "_host_emptyCache"):  # (torch.cuda.graph calls it)
        p.set(torch._C, "_host_emptyCache", cuda_graphs._host_empty_cache)
    for name, obj in cuda_api.NVTX_REPLACEMENTS.items():
        p.set(torch.cuda.nvtx, name, obj)
    p.set(torch.cuda.profiler, "cudart", cuda_api.cudart)  # (its own import of the name)
    p.set(torch.cuda, "_cudart", cuda_api.cudart())  # (what torch.cuda.check_error reads)
    for name, obj in accelerator_api.REPLACEMENTS.items():
        p.set(torch.accelerator, name, obj)
    for name, obj in accelerator_api.MEMORY_REPLACEMENTS.items():
        p.set(torch.accelerator.memory, name, obj)
    for name, obj in accelerator_api.TORCH_REPLACEMENTS.items():
        p.set(torch, name, obj)
    for name, obj in accelerator_api.C_REPLACEMENTS.items():
        p.set(torch._C, name, obj)
    # read when asked (a discovered GPU's runtime is known once it is placed)
    p.remove(torch.version, "cuda")
    p.set(torch.version, "__getattr__", _version_attribute)
    flop_log = logging.getLogger("torch.utils.flop_counter")
    p.set(flop_log, "filters", [*flop_log.filters, _not_the_triton_note])
    # (it caches its answers: one from before activation would name the CPU)
    p.set(torch, "get_device_module", functools.cache(inspect.unwrap(torch.get_device_module)))
    # on cudnn's module object only: its own functions (set_flags...) still see the local truth
    p.set(torch.backends.cudnn, "is_available", lambda: True)
    p.set(torch.backends.cudnn, "is_acceptable", _cudnn_is_acceptable)
    p.set(torch, "_use_cudnn_rnn_flatten_weight", lambda: False)  # flat cuDNN weights are a local GPU's
    flags.install(p)
    p.set(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
    manual_seed = _seeding_devices_too(torch.random.manual_seed)
    p.set(torch, "manual_seed", manual_seed)
    p.set(torch.random, "manual_seed", manual_seed)
    p.set(torch, "compile", compiled.compile)
    to_dlpack = dlpack.to_dlpack(torch.utils.dlpack.to_dlpack)
    p.set(torch.utils.dlpack, "to_dlpack", to_dlpack)
    p.set(torch, "to_dlpack", to_dlpack)
    p.set(torch._C, "_from_dlpack", dlpack.from_dlpack(torch._C._from_dlpack))
    p.set(torch, "Generator", cuda_api.Generator)
    p.remove(torch.cuda, "default_generators")  # (read when asked: the devices are known when used)
    p.set(torch.cuda, "__getattr__", _cuda_attribute)
    from torch.optim import optimizer
    from torch.utils import _foreach_utils as foreach_utils
    # the C++ function itself: every Python binding of it (clip_grad, the optimizers, swa_utils)
    # calls through torch._C
    p.set_item(optimizer._global_optimizer_pre_hooks, "remotecuda", _step_waits)
    backward_node = torch.autograd.function.BackwardCFunction
    p.set(backward_node, "apply", _checked_function_backward(backward_node.apply))
    p.set(torch._C, "_group_tensors_by_device_and_dtype", _group_by_device(torch._C._group_tensors_by_device_and_dtype))
    data_parallel.install(p)
    distributed.install(p)
    serialization.install(p)
    torchscript.install(p)
    downloads.install(p)
    decode.install(p)
    flex_attention.install(p)
    control_flow.install(p)
    distributions.install(p)
    downloads.on_import(p, "torch.onnx", lambda p, onnx: p.set(onnx, "export", _routed(onnx.export, _export)))
    device_type.install(p)
    hub_kernels.install(p)
    children.tell(p, rt.told, rt.pool.fallback_endpoint)
    library_caches.clear()
    expanded_weights.install(p)
    nested.install(p)
    foreach = [lst for lst in (foreach_utils._foreach_supported_types, optimizer._foreach_supported_types)
               if RemoteTensor not in lst]
    for lst in foreach:
        lst.append(RemoteTensor)
    p.set(torch.nn.Module, "_apply", _module_apply(torch.nn.Module._apply))
    if rt.replay:
        step_replay.install(p)
    device_context._device_constructors()  # `with torch.device(...)` caches the originals: before patching
    for owner, name, handler in _ROUTES:
        # (RemoteTensor's __getitem__ leaves it to the C++ original, which gives the hook torch's
        # own function and the index read already: a hook calling that function with a list
        # index would make a meta index tensor)
        p.set(owner, name, _routed(getattr(owner, name), handler, method=owner is torch.Tensor))
    for owner, name, handler in _ROUTES_EVERY_THREAD:
        p.set(owner, name, _everywhere(getattr(owner, name), handler))
    p.set(torch.Tensor, "__new__", staticmethod(legacy_types.tensor_base_new(torch._C.TensorBase.__new__)))
    storage_new = _routed(torch._C.StorageBase.__new__, storages.untyped_storage_new)
    p.set(torch.UntypedStorage, "__new__", staticmethod(storage_new))
    storages.install(p)
    p.set(torch.Tensor, "data", _data_property())
    p.set(torch.Tensor, "grad", _grad_property())
    for name in ("device", "is_cuda", "is_meta"):
        p.set(torch.Tensor, name, _identity_property(name))
    p.set(torch.Tensor, "get_device", _get_device)
    # (a staticmethod, as torch's: a class may call it through an instance)
    p.set(torch.Tensor, "_make_wrapper_subclass", staticmethod(
        _routed(torch.Tensor._make_wrapper_subclass, tensor_subclasses.make_wrapper)))
    p.set(torch.Tensor, "_make_subclass", staticmethod(
        _routed(torch.Tensor._make_subclass, tensor_subclasses.make_subclass)))
    p.set(torch.Tensor, "as_subclass", _routed(torch.Tensor.as_subclass, tensor_subclasses.as_subclass))
    p.set(torch.nn.Parameter, "__new__", staticmethod(
        _routed(torch.nn.Parameter.__new__, tensor_subclasses.parameter_new)))
    lazy_modules.install(p)
    profile = torch.autograd.profiler.profile
    p.set(profile, "__init__", _profile_init(profile.__init__))
    p.set(torch.autograd.profiler.emit_nvtx, "__enter__", _emit_nvtx_enter)
    p.set(torch.autograd.profiler.emit_nvtx, "__exit__", _emit_nvtx_exit)
    profiler_ranges.install(p, RemoteDispatchMode)
    linearize = _linearize(torch.func.linearize)
    p.set(torch.func, "linearize", linearize)
    p.set(torch._functorch.eager_transforms, "linearize", linearize)
    amp = torch.amp.autocast_mode.autocast
    p.set(amp, "__enter__", _autocast_enter(amp.__enter__))
    p.set(amp, "__exit__", _autocast_exit(amp.__exit__))
    # (torch's warnings placed in remotecuda's frames - routes, the autocast mode - at the program's line)
    warning_location.install(p)
    install_excepthook()
    installed = _Installed()
    p.set(threading.Thread, "start", _thread_start(threading.Thread.start, rt.dispatcher, installed))
    # x.item(), float(x)... straight to the session where nothing else would see them on the way
    for name, method in value_reads.methods(rt.dispatcher, RemoteDispatchMode).items():
        p.set(RemoteTensor, name, method)
    mode = RemoteDispatchMode(rt.dispatcher)
    p.set(rt.dispatcher, "as_user", mode.again)
    installed.took()
    mode.__enter__()
    return Interception(p, mode, foreach, installed)
