"""RemoteTensor: a tensor whose data lives on a gateway.

On a CPU-only torch a wrapper subclass whose C++ device is ``cuda`` aborts inside
autograd, so the wrapper's C++ device is ``meta`` (shape, stride and dtype only, no
data) and the Python-level ``device`` / ``is_cuda`` report ``cuda:N``. Every aten op
on it arrives in ``__torch_dispatch__`` and goes to the op dispatcher.

Handles are freed through a small owner object kept in ``__dict__`` rather than a
weakref finalizer: ``torch.utils.swap_tensors`` (which keeps Parameter identity across
``model.cuda()``) refuses tensors that have weakrefs.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, SupportsIndex, cast

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type

from remotecuda_wire.protocol import handle_ext

from . import forked_child
from .errors import GatewayLostError

_DEVICES: dict[int, torch.device] = {}
_META = torch.device("meta")
_new_wrapper = torch.Tensor._make_wrapper_subclass
_has_torch_function_unary = torch._C._has_torch_function_unary


def torch_function_first(method: Callable) -> Callable:
    """RemoteTensor's own version of a Tensor method that torch hands to ``__torch_function__``
    first (its C++ binding, or torch/_tensor.py's ``has_torch_function_unary`` check): a user
    subclass's (``x.as_subclass(Sub)``), or a function mode's, sees the call as on any device,
    with this method as the function; its call with their overrides off comes back here and runs
    the method. (A plain RemoteTensor's ``__torch_function__`` is disabled: one C call.)"""
    @functools.wraps(method)
    def first(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _has_torch_function_unary(self):
            return torch.overrides.handle_torch_function(first, (self,), self, *args, **kwargs)
        return method(self, *args, **kwargs)
    return first


def _torch_function_first_property(getter: Callable) -> property:
    """A read-only property of RemoteTensor's that torch's C++ getter hands to
    ``__torch_function__`` first (``device``, ``is_cuda``...): a user subclass's, or a function
    mode's, sees the read as on any device, with this property's ``__get__`` as the function, whose
    call with their overrides off comes back here and reads the value. (torch's own ``func`` is
    ``Tensor.<name>.__get__``, which would read the meta wrapper's C++ answer.)"""
    def get(self: Any) -> Any:
        if _has_torch_function_unary(self):
            return torch.overrides.handle_torch_function(prop.__get__, (self,), self)
        return getter(self)
    prop = property(functools.wraps(getter)(get))
    return prop


def cuda_device(index: int) -> torch.device:
    d = _DEVICES.get(index)
    if d is None:
        d = _DEVICES[index] = torch.device("cuda", index)
    return d


class HandleOwner:
    """Releases a gateway handle when the last wrapper using it goes away.

    ``wrap`` fills the two slots; there is no ``__init__`` because one is made per op and
    a Python-level constructor would cost more than the rest of the object's life.
    """

    __slots__ = ("handle", "session")
    handle: int
    session: Any  # the Session

    def __del__(self) -> None:
        s = self.session
        if s is not None and not s.closed:
            s.release(self.handle)


def is_pinned(t: torch.Tensor, device: Any = None) -> bool:
    """Whether ``t`` is in page-locked host memory: never, while remotecuda is active. Pinned
    memory is a local GPU's notion (a CPU-only torch has no page-locked allocator, and the gateway
    receives from a socket), so ``pin_memory`` gives plain memory, and this is the one answer for
    a remote tensor's ``is_pinned``, for the aten op, and for ``Tensor.is_pinned`` in every thread."""
    return False


def _not_active(func: Any, args: tuple, kwargs: dict) -> Any:
    if forked_child.forked():  # a GPU's torch refuses a parent's CUDA tensor in a forked child so
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess (remotecuda: a forked process, a "
                           "DataLoader's worker among them, cannot use the parent's 'cuda' tensors; keep a "
                           f"dataset's tensors on the CPU and move each batch to 'cuda' in the main process) ({func})")
    raise GatewayLostError(f"remotecuda is not active: this 'cuda' tensor's session was closed "
                           f"(remotecuda.deactivate()) and its data is gone ({func})")


#: the legacy tensor type names (``torch.cuda.FloatTensor``...) → their dtype
LEGACY_TYPES = {"FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
                 "BFloat16Tensor": torch.bfloat16, "LongTensor": torch.int64, "IntTensor": torch.int32,
                 "ShortTensor": torch.int16, "CharTensor": torch.int8, "ByteTensor": torch.uint8,
                 "BoolTensor": torch.bool}


def wrapper_type(types: Any) -> type | None:
    """Another library's wrapper subclass among an op's tensor types (a jagged ``torch.nested``
    tensor, whose values and offsets are RemoteTensors), or None: that wrapper's own
    ``__torch_dispatch__`` must run first, to unwrap it into the ops on its parts that come here."""
    for t in types:
        if is_traceable_wrapper_subclass_type(t) and not issubclass(t, RemoteTensor):
            return t
    return None


class RemoteStorage(torch.UntypedStorage):
    """A remote tensor's storage (``RemoteTensor.untyped_storage``): the wrapper's meta storage,
    on the tensor's 'cuda:N' as a GPU's storage is. Its bytes are on the gateway, in the storage of
    the tensor that owns it: torch reaches a storage's bytes by ``set_`` of a tensor onto it (a
    TypedStorage's ``cpu()``, ``tolist()``, indexing and dtype conversions, ``copy_`` between
    storages), which the dispatcher turns into ``set_`` onto that tensor (``tensor()``)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.__dict__["_device"]

    def data_ptr(self) -> int:
        """The fake address of the gateway's storage (``RemoteTensor.data_ptr`` less the tensor's
        offset), a slice's ``start`` bytes further, as a GPU's slice points into its parent."""
        _, _, _, sid = self.__dict__["_gateway"]
        return _address(self.device.index, sid) + self.__dict__["_start"]

    def __getitem__(self, idx: Any) -> Any:
        """``s[i]`` (one byte, read through ``set_`` as every read is) and ``s[a:b]``: C++ makes a
        slice as a storage of this class on the bytes from ``a`` (its checks, its size, not
        resizable), and here it is told where those bytes are: in the same gateway storage, ``a``
        bytes further (``start``), which ``set_`` onto the slice reaches (dispatch's ``_set_storage``)."""
        part = super().__getitem__(idx)
        if isinstance(idx, slice):
            start = self.__dict__["_start"] + idx.indices(self.nbytes())[0]
            part.__dict__.update(_device=self.device, _gateway=self.__dict__["_gateway"], _start=start)
        return part

    def type(self, dtype: Any = None, non_blocking: bool = False) -> Any:  # type: ignore[override]
        """The class a GPU's storage names (``pin_memory``'s refusal quotes it); a conversion is torch's."""
        return "torch.storage.UntypedStorage" if dtype is None else super().type(dtype, non_blocking)

    def new(self) -> torch.UntypedStorage:
        """An empty storage on the same device (C++ would make one of this class on 'meta', told
        nothing of its device)."""
        return torch.UntypedStorage(0, device=self.device)

    def __iter__(self) -> Iterator[int]:
        """Its bytes, from one copy to the host: torch's reads one byte a round trip (``tolist()``,
        ``list(s)`` and the repr iterate), 4000 bytes taking seconds even on loopback."""
        return iter(self.cpu())

    def __repr__(self) -> str:
        """torch's text (each byte, then class, device and size) from one copy of its bytes, naming
        the class a GPU's storage has."""
        text = repr(self.cpu())
        info = f"[torch.storage.UntypedStorage(device={self.device}) of size {len(self)}]"
        return text[:text.rindex("\n") + 1] + info

    def _write_file(self, *args: Any) -> None:
        """How the legacy format writes a storage (``pickle`` of one uses it): its bytes fetched to
        the CPU first, as torch's C++ copies a GPU's (from the meta storage C++ would read none)."""
        self.cpu()._write_file(*args)

    def is_shared(self) -> bool:
        """True, as torch says of every CUDA storage (device memory is shared between processes
        without moving it; ``share_memory_`` leaves it): the meta storage's own answer is False."""
        return True

    def tensor(self) -> RemoteTensor:
        """A wrapper of the gateway tensor that owns this storage, as its owner saw it when the
        storage was asked for. It shares the owner's handle, which this storage keeps, as a GPU's
        storage keeps its memory (a wrapper of its own, not the owner: that would hold the owner's
        C++ tensor, which holds this object, in a cycle the collector cannot see)."""
        session, owner, lay, sid = self.__dict__["_gateway"]
        t = wrap(session, owner.handle, lay, sid)
        t.__dict__["_owner"].session = None  # (its own release disarmed: the handle is the owner's)
        t.__dict__["_owner"] = owner
        return t

    def resize_(self, size: int) -> RemoteStorage:  # type: ignore[override]
        """Resize the gateway's storage too, in stream order: ``resize_(0)`` frees its memory while
        the tensors on it live on (FSDP's and activation offloading's idiom), a later ``resize_(n)``
        gives it ``n`` bytes again for a refill (their first bytes kept, the rest uninitialized), and
        every tensor on it, views included, sees the change, as on a GPU. torch's own resize of the
        meta storage comes first: its checks, and the size this storage reports."""
        super().resize_(size)
        session, owner, _, _ = self.__dict__["_gateway"]
        session.enqueue("rc::storage_resize", [owner.handle, self.nbytes()], None, None)
        return self

    def clone(self) -> torch.UntypedStorage:
        """A copy on the same device (torch's makes ``type(self)(n, device=...)``, which a
        CPU-only torch refuses for 'cuda'); also what ``copy.deepcopy`` of a storage does."""
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(self).clone().untyped_storage()


#: what ties a wrapper to its gateway tensor
HANDLE_FIELDS = ("_h", "_w", "_s", "_dev", "_sid", "_k", "_owner")
#: where known.py keeps the client's copy of a remote tensor's values
KNOWN_KEY = "_known"
#: remotecuda's own ``__dict__`` keys on a remote tensor. They are underscored to stay out of
#: torch.Tensor's namespace, but so are other libraries' attributes (MONAI's ``MetaTensor._meta``),
#: so it is this set, not a leading ``_``, that tells them apart: pickling, deepcopy and
#: ``p.data =`` carry every other attribute, as torch does.
OWN_KEYS = frozenset((*HANDLE_FIELDS, KNOWN_KEY))


def stands_for_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is what a GPU's ``nn.Parameter`` is here: a RemoteTensor that ``nn.Parameter``
    marked (``_is_param``, torch's mark for a tensor subclass made a parameter), not a library's
    subclass so marked, which torch copies and pickles as that subclass."""
    return type(t) is RemoteTensor and isinstance(t, torch.nn.Parameter)


class RemoteTensor(torch.Tensor):
    # Set by wrap(), and read by the dispatcher, downloads, rnn, attention and transfer: the
    # wrapper's own fields, underscored to stay out of torch.Tensor's namespace; changed only here
    # (wrap, refresh_key, follow).
    _h: int  # the gateway handle
    _s: Any  # the Session
    _dev: int  # virtual device index
    _sid: int  # storage identity: views share their base's
    _k: tuple  # (dtype, shape, stride, offset): this tensor's part of a dispatch cache key
    _w: Any  # the handle's wire form
    _owner: HandleOwner

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # (torch's way)
    #: the active runtime's ``Dispatcher.dispatch`` (set by interception while installed)
    dispatch: Any = staticmethod(_not_active)

    def __new__(cls, *args: Any, **kwargs: Any) -> RemoteTensor:
        """``type(p)(data, requires_grad=...)``: libraries rebuild a parameter by its class
        (accelerate's ``set_module_tensor_to_device``, when it offloads or dispatches a model).
        On a GPU that class is ``nn.Parameter``; ``nn.Parameter(x)`` of a 'cuda' tensor is a
        RemoteTensor marked as a parameter, as for any tensor subclass, so the call means
        ``nn.Parameter``. (Wrappers themselves are made by ``wrap``, never by calling the class.)"""
        return cast(RemoteTensor, torch.nn.Parameter(*args, **kwargs))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if len(types) > 1 and wrapper_type(types) is not None:
            return NotImplemented
        return cls.dispatch(func, args, kwargs or {})

    # ---------------------------------------------------------------- identity
    @_torch_function_first_property
    def device(self) -> torch.device:  # type: ignore[override]
        return cuda_device(self._dev)

    @_torch_function_first_property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @_torch_function_first_property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False

    @_torch_function_first_property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    @torch_function_first
    def get_device(self) -> int:
        return self._dev

    @torch_function_first
    def type(self, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:  # type: ignore[override]
        """The legacy type API: ``x.type()`` names a CUDA type ('torch.cuda.FloatTensor') and
        ``x.type(torch.cuda.HalfTensor)`` / ``x.type('torch.DoubleTensor')`` convert, as on a GPU."""
        if dtype is None:
            return super().type().replace("torch.meta.", "torch.cuda.")
        if isinstance(dtype, torch.dtype):
            return self.to(dtype, non_blocking=non_blocking)
        name = dtype if isinstance(dtype, str) else f"{dtype.__module__}.{dtype.__name__}"
        legacy = LEGACY_TYPES.get(name.rsplit(".", 1)[-1])
        if legacy is None or not name.startswith("torch."):
            raise ValueError(f"invalid type: {dtype!r}")
        device = "cuda" if name.startswith("torch.cuda.") else "cpu"
        return self.to(device if device == "cpu" else self.device, legacy, non_blocking=non_blocking)

    @torch_function_first
    def data_ptr(self) -> int:
        """A stable fake address: distinct per storage, offset like a real pointer."""
        return _address(self._dev, self._sid) + int(self.storage_offset()) * self.element_size()

    @torch_function_first
    def untyped_storage(self) -> torch.UntypedStorage:
        """The (meta) storage of the wrapper that owns the gateway's storage: a view's base's, so
        that a view and its base share one storage object (``_cdata``) and its size, as on a GPU;
        on the tensor's 'cuda:N' (``RemoteStorage``), its ``data_ptr`` the fake address of the
        gateway's storage (``data_ptr()`` less the offset). Libraries find tied tensors by device,
        storage pointer and size (safetensors refuses to save shared ones, transformers'
        ``id_tensor_storage``, Accelerate's ``save_state``); a meta storage's 0 would tie every two
        tensors of one size, and a view's own wrapper spans only the view. A write through the
        storage (``copy_``, or a tensor ``set_`` on it) bumps no tensor's version counter, so the
        values the client knows of the tensor (known.py) are dropped."""
        from . import known  # (known.py builds on this module)
        known.forget(self)
        base = self._base
        owner = base if isinstance(base, RemoteTensor) and base._sid == self._sid else self
        storage = torch.Tensor.untyped_storage(owner)
        storage.__class__ = RemoteStorage
        storage.__dict__["_device"] = self.device
        dtype, shape, stride, offset = owner._k
        storage.__dict__["_gateway"] = (owner._s, owner._owner, layout(shape, stride, offset, dtype), owner._sid)
        storage.__dict__["_start"] = 0  # (where its bytes begin in the gateway's storage: a slice's are further)
        return storage

    @torch_function_first
    def is_pinned(self, device: Any = None) -> bool:
        return is_pinned(self, device)

    @torch_function_first
    def pin_memory(self, device: Any = None) -> RemoteTensor:
        raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")

    @torch_function_first
    def share_memory_(self) -> RemoteTensor:
        """A no-op, as for a CUDA tensor: device memory is shared across processes without moving it."""
        return self

    @torch_function_first
    def is_shared(self) -> bool:
        return True  # (torch says so of every CUDA storage)

    @torch_function_first
    def __dlpack__(self, *, stream: Any = -1, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[Any, int] | None = None, copy: bool | None = None) -> Any:
        """A capsule that ``torch.from_dlpack`` takes back as an alias (dlpack.py), or a CPU copy's
        where the consumer asks for the CPU, as torch gives on a GPU."""
        from . import dlpack
        return dlpack.export(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    @property
    def __cuda_array_interface__(self) -> dict:
        """Refused: its ``data`` is a device pointer that CuPy, Numba or PyCUDA would read in this
        process, where the memory is not (torch would hand out the placeholder's). An
        AttributeError, so that a library that asks ``hasattr`` first takes its CPU or DLPack path,
        as it does for a tensor without one."""
        raise AttributeError(f"remotecuda: a cuda:{self._dev} tensor's memory is on its gateway's device, not in "
                             "this process, so __cuda_array_interface__ cannot hand it to another library here; "
                             "copy it to the CPU first (tensor.cpu()) and share that")

    @torch_function_first
    def record_stream(self, stream: Any) -> None:
        """A caching-allocator hint: a session's streams run serially on the gateway, so no use of
        this memory can still be pending on another stream when it is freed."""

    def __coerce_same_metadata_as_tangent__(self, expected_metadata: Any, expected_type: Any = None) -> Any:
        """A compiled graph's backward (compiled.py) was traced on plain tensors: a wrapper's
        gradient is what it expects (None: AOTAutograd then says which tangent did not fit)."""
        return self if expected_type in (None, torch.Tensor) and expected_metadata is None else None

    # ---------------------------------------------------------------- values (sync points)
    @torch_function_first
    def numpy(self, *, force: bool = False) -> Any:
        """A GPU's refusal, which is about the device before it is about grad (torch checks in that
        order), but ``force=True`` copies to the host first (torch's documented meaning)."""
        if force:
            return self.detach().cpu().resolve_conj().resolve_neg().numpy()
        raise TypeError(f"can't convert cuda:{self._dev} device type tensor to numpy. Use Tensor.cpu() "
                        "to copy the tensor to host memory first.")

    @torch_function_first
    def tolist(self) -> Any:
        """Its values, downloaded: under no_grad, not through a ``detach`` (an op, which would make
        the read wait for it: a read with nothing queued is one message each way, fastread.py)."""
        with torch.no_grad():
            return self.cpu().tolist()

    @torch_function_first
    def __format__(self, spec: str) -> str:
        if self.dim() == 0 and type(self) is RemoteTensor:  # (torch formats a subclass's as an object)
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    @torch_function_first
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # (torch's stub)
        from torch._tensor_str import _str
        # (ops of another library's subclass give plain tensors here, as under torch's own repr)
        with torch._C.DisableTorchFunctionSubclass():
            if tensor_contents is None:
                with torch.no_grad():
                    tensor_contents = self._contents()
            text = _str(self, tensor_contents=tensor_contents).replace("Tensor(", "tensor(", 1)
        if isinstance(self, torch.nn.Parameter):  # torch writes "Parameter(...)" for a subclass
            return "Parameter containing:\n" + text.removeprefix("Parameter(").removesuffix(")")
        return text

    def _contents(self) -> str:
        """What torch prints inside ``tensor(...)``, fetched in one round trip. A tensor too large
        to print whole shows only its edge items, so only those cross the network, and no CPU
        tensor of its size is made (printing a 1 GB activation must not download it, nor a view
        larger than this machine's memory allocate it): each dimension longer than 2 × edgeitems
        comes as its first edgeitems + 1 and last edgeitems elements, summarised as the whole
        (the one element between is elided)."""
        from torch._tensor_str import PRINT_OPTS, _tensor_str
        e = PRINT_OPTS.edgeitems
        t = self.detach()
        if self.numel() <= PRINT_OPTS.threshold or self.dim() == 0 or e == 0:
            return _tensor_str(t.cpu(), 7)
        for d, n in enumerate(self.shape):
            if n > 2 * e:
                t = torch.cat((t.narrow(d, 0, e + 1), t.narrow(d, n - e, e)), d)
        compact = t.cpu()
        threshold = PRINT_OPTS.threshold
        PRINT_OPTS.threshold = min(threshold, compact.numel() - 1)  # (summarised, as the whole is)
        try:
            return _tensor_str(compact, 7)
        finally:
            PRINT_OPTS.threshold = threshold

    # ---------------------------------------------------------------- copies and pickling
    @torch_function_first
    def __deepcopy__(self, memo: dict) -> RemoteTensor:
        """torch's deepcopy: leaves only, and views deepcopied together stay views of one copy
        (torch copies each storage once per deepcopy): a view copies its base, and views that. A lazy
        conjugate's or negative's view of the copy reads the base's bytes plainly, so it is then
        resolved (conj_physical, neg), as torch resolves its own deepcopy of one."""
        if stands_for_parameter(self):  # (a new Parameter of a clone: no attributes, no grad)
            return cast(RemoteTensor, torch.nn.Parameter.__deepcopy__(self, memo))
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                               "protocol at the moment.  If you were attempting to deepcopy a module, this may be "
                               "because of a torch.nn.utils.weight_norm usage, see "
                               "https://github.com/pytorch/pytorch/pull/103001")
        import copy
        base = self._base
        with torch.no_grad():
            if isinstance(base, RemoteTensor) and base.is_contiguous():
                new_base = copy.deepcopy(base, memo)
                offset = self.storage_offset() - base.storage_offset() + new_base.storage_offset()
                new = cast(RemoteTensor, new_base.as_strided(self.shape, self.stride(), offset))
                if self.is_conj():
                    new = cast(RemoteTensor, new.conj_physical())
                if self.is_neg():
                    new = cast(RemoteTensor, new.neg())
            else:
                new = cast(RemoteTensor, self.clone())
        if self.requires_grad:
            new.requires_grad_(True)
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)
        for k, v in self.__getstate__().items():
            new.__dict__[k] = copy.deepcopy(v, memo)
        if type(self) is not RemoteTensor:  # a Parameter swapped onto the wrapper keeps its class
            new.__class__ = type(self)
        memo[id(self)] = new
        return new

    def __getstate__(self) -> dict[str, Any]:
        """The tensor's attributes, as torch reads them to pickle or deepcopy a subclass or a
        Parameter (``torch._utils._get_obj_state``): its ``__dict__`` less remotecuda's own keys."""
        return {k: v for k, v in self.__dict__.items() if k not in OWN_KEYS}

    def __reduce_ex__(self, proto: SupportsIndex) -> Any:
        """Save as a CPU tensor that torch rebuilds on 'cuda:N' (as it does for XLA and PrivateUse1)."""
        if stands_for_parameter(self):  # (as Parameter.__reduce_ex__, whose class has no ``_is_param``)
            from collections import OrderedDict
            state = {k: v for k, v in self.__getstate__().items() if k != "_is_param"}
            if not state:
                return (torch._utils._rebuild_parameter, (self.detach(), self.requires_grad, OrderedDict()))
            return (torch._utils._rebuild_parameter_with_state,
                    (self.detach(), self.requires_grad, OrderedDict(), state))
        cpu = self.detach().cpu().clone()
        rebuild: tuple = (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                          (cpu, self.dtype, str(self.device), self.requires_grad))
        if type(self) is not RemoteTensor:  # (a library's subclass: torch's default ``__torch_function__``,
            # which returns this reduction, makes every tensor in its nested tuples the library's class,
            # whose ``to`` unpickling would then call: the CPU copy goes inside a partial)
            rebuild = (functools.partial(rebuild[0], *rebuild[1]), ())
        return as_subclass_reduction(self, rebuild)


#: torch's messages name a tensor by its type's name, as a GPU's do: "Expected parameter scale (Tensor
#: of shape (1,)) of distribution Normal ...", the argument parser's "got (Tensor, out=Tensor)"
#: (the qualified name, in ``repr(type(t))``, stays RemoteTensor)
RemoteTensor.__name__ = "Tensor"


def as_subclass_reduction(t: RemoteTensor, reduction: tuple) -> tuple:
    """``reduction`` (a rebuild function and its arguments) of a remote tensor, for one that is
    another library's subclass (tensor_subclasses.py) as torch reduces one: rebuilt, then made that
    library's class with its attributes (``__getstate__``)."""
    if type(t) is RemoteTensor:
        return reduction
    library = next(c for c in type(t).__mro__ if not issubclass(c, RemoteTensor))
    return (torch._tensor._rebuild_from_type_v2, (reduction[0], library, reduction[1], t.__getstate__()))


def contiguous_strides(shape: tuple) -> tuple:
    """The strides torch gives a new tensor of ``shape`` when none are asked for."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def layout(shape: Any, stride: Any, offset: int, dtype: torch.dtype) -> tuple:
    """What ``wrap`` needs to build a wrapper: its key part (``_k``) and whether the strides
    are the default ones. The dispatcher keeps one per cached op output, so none of this is
    recomputed per op; leaving out default strides halves ``_make_wrapper_subclass``'s cost."""
    shape, stride = tuple(shape), tuple(stride)
    return (dtype, shape, stride, offset), offset == 0 and stride == contiguous_strides(shape)


def extent(shape: Any, stride: Any) -> int:
    """How many elements of its storage a tensor of this shape and stride spans from its offset on."""
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if 0 not in shape else 0


def _address(dev: int, sid: int) -> int:
    """The fake address of storage ``sid`` on virtual device ``dev`` (see ``RemoteTensor.data_ptr``)."""
    return ((dev + 1) << 48) | (sid << 16)


def wrap(session: Any, handle: int, lay: tuple, sid: int | None = None) -> RemoteTensor:
    """A wrapper for gateway tensor ``handle`` with the metadata of ``lay`` (see ``layout``)."""
    k, dense = lay
    dtype, shape, stride, offset = k
    if dense:
        t = _new_wrapper(RemoteTensor, shape, dtype=dtype, device=_META)
    else:
        t = _new_wrapper(RemoteTensor, shape, strides=stride, storage_offset=offset, dtype=dtype, device=_META)
    owner = HandleOwner()
    owner.session, owner.handle = session, handle
    d = t.__dict__
    d["_h"] = handle
    d["_w"] = handle_ext(handle)
    d["_s"] = session
    d["_dev"] = session.vdev
    d["_sid"] = handle if sid is None else sid
    d["_k"] = k
    d["_owner"] = owner
    return t


def make(session: Any, handle: int, shape: Any, stride: Any, offset: int, dtype: torch.dtype,
         sid: int | None = None) -> RemoteTensor:
    """A wrapper for gateway tensor ``handle``; metadata is whatever the dispatcher computed."""
    return wrap(session, handle, layout(shape, stride, offset, dtype), sid)


def refresh_key(t: RemoteTensor, storage_of: RemoteTensor | None = None) -> None:
    """After an in-place metadata change (t_, resize_, set_...); ``storage_of``: the tensor whose
    storage ``t`` now uses (``set_``)."""
    t.__dict__["_k"] = (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())
    if storage_of is not None:
        t.__dict__["_sid"] = storage_of._sid


def follow(t: RemoteTensor, new: RemoteTensor) -> None:
    """Make ``t`` stand for ``new``'s gateway tensor (``p.data = new``; the C++ metadata is set by
    the caller)."""
    for k in HANDLE_FIELDS:
        t.__dict__[k] = new.__dict__[k]
