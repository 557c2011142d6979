"""Other libraries' tensor subclasses over 'cuda' tensors.

Two kinds. A *wrapper* subclass (PyG's ``EdgeIndex``, ``Index`` and ``HashTensor``, a user's own
``__torch_dispatch__`` class) holds a plain tensor and makes itself with
``Tensor._make_wrapper_subclass``: a C++ tensor with no data, on the device it is given, which such
a class takes from the tensor it wraps (``device=data.device``: 'cuda:N' for a remote one). On a
CPU-only torch a C++ tensor on 'cuda' fails at the first thing C++ does with that device:
indexing's device guard raises "PyTorch is not linked with support for cuda devices", and
autograd, recording one that requires grad, aborts the process. So while remotecuda is active a
wrapper asked for on 'cuda' is made on 'meta', as RemoteTensor is, and keeps the device it was
asked for, which ``Tensor.device``, ``is_cuda`` and ``get_device`` answer with (interception's
identity properties). Its ops still reach its own ``__torch_dispatch__`` first, which unwraps it
into ops on the remote tensors.

A *plain* subclass (``x.as_subclass(Sub)``, ``Tensor._make_subclass(Sub, x)``: torchvision's
``tv_tensors``, MONAI's ``MetaTensor``, fastai's ``TensorBase``) is a second Python object of the
same C++ tensor. A remote tensor's C++ tensor answers to its RemoteTensor object, which C++ will not
give a class that is not a RemoteTensor ("already associated to a python object of type Tensor"),
and a plain ``Sub`` would not know its gateway handle either. So the new object's class is one that
is both: a subclass of ``Sub`` and of RemoteTensor, named as ``Sub`` (``isinstance(t, Sub)`` holds;
``type(t) is Sub`` does not), with ``Sub``'s ``__torch_function__``, which keeps results in the
subclass as on a GPU. Its ``__dict__`` holds remotecuda's own state (``tensor.OWN_KEYS``: the
gateway handle, the session) beside the library's attributes, kept out of the library's sight
(``_Attributes``): a library that copies one tensor's whole ``__dict__`` onto another (MONAI's
``MetaTensor`` carries its metadata to an op's result that way) would otherwise make the result
stand for its input's gateway tensor, or deep-copy the session.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from . import runtime
from .tensor import HANDLE_FIELDS, OWN_KEYS, RemoteTensor, torch_function_first

#: the ``__dict__`` key under which a wrapper made on 'meta' keeps the 'cuda' device it stands for
DEVICE_KEY = "_remotecuda_device"
_META = torch.device("meta")
#: the device's place among the positional arguments (cls, size, strides, storage_offset,
#: memory_format, dtype, layout, device, ...), where torch's parser also takes it
_DEVICE_AT = 7


def make_wrapper(original: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    """``Tensor._make_wrapper_subclass(cls, size, ..., device=...)``: on 'meta' when the device is
    'cuda' (its index the current device's when it names none, as CUDA's factories read it)."""
    positional = len(args) > _DEVICE_AT
    device = args[_DEVICE_AT] if positional else kwargs.get("device")
    if device is None or torch.device(device).type != "cuda":
        return original(*args, **kwargs)
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if positional:
        out = original(*args[:_DEVICE_AT], _META, *args[_DEVICE_AT + 1:], **kwargs)
    else:
        out = original(*args, **{**kwargs, "device": _META})
    out.__dict__[DEVICE_KEY] = device
    return out


def device_of(t: torch.Tensor) -> Any:
    """The 'cuda' device a wrapper made by ``make_wrapper`` stands for, or None (any other tensor)."""
    return t.__dict__.get(DEVICE_KEY)


def as_subclass(original: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    """``x.as_subclass(cls)``: of a remote ``x``, an alias of it (as torch's is) of ``cls``'s
    remote class. (Neither this nor ``make_subclass`` calls a subclass's ``__torch_function__``,
    as torch's do not.)"""
    x, cls = (args + (kwargs.get("cls"),))[:2]
    if not isinstance(x, RemoteTensor):  # (a remote class's result moved to the CPU: the library's class)
        return original(x, _library_class(cls))
    with torch._C.DisableTorchFunctionSubclass():
        return become(torch.ops.aten.alias.default(x), cls)


def make_subclass(original: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    """``Tensor._make_subclass(cls, data, require_grad=False)``: of a remote ``data``, a detached
    alias of it (as torch's is) of ``cls``'s remote class, requiring grad as asked."""
    cls, data = args[:2]
    if not isinstance(data, RemoteTensor) or len(args) > 3 or set(kwargs) - {"require_grad"}:
        # (a plain tensor, or the options only torch's own subclasses use)
        return original(_library_class(cls), *args[1:], **kwargs)
    require_grad = args[2] if len(args) > 2 else kwargs.get("require_grad", False)
    with torch._C.DisableTorchFunctionSubclass():
        return become(data.detach().requires_grad_(require_grad), cls)


def parameter_new(original: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    """``nn.Parameter.__new__`` called by a subclass of it (``SubParameter(data)``, whose
    ``__new__`` calls Parameter's) for a remote ``data``: an instance of the subclass, as torch makes
    one of a plain tensor (by ``_make_subclass``). Parameter's own path for another library's tensor
    class, taken for a RemoteTensor, keeps that class (only marking it a parameter): right for
    ``nn.Parameter`` itself (a 'cuda' Parameter is a RemoteTensor so marked), not for its subclasses."""
    cls = args[0]
    data = args[1] if len(args) > 1 else kwargs.get("data")
    if cls is torch.nn.Parameter or type(data) is not RemoteTensor:
        return original(*args, **kwargs)
    requires_grad = args[2] if len(args) > 2 else kwargs.get("requires_grad", True)
    return torch.Tensor._make_subclass(cls, data, requires_grad)


def collate(original: Callable, args: tuple, kwargs: dict) -> Any:
    """torch's ``collate(batch, collate_fn_map=...)`` (what ``default_collate`` and a DataLoader
    run), whose table of collate functions is asked for the batch's first element's exact type
    before any ``isinstance``: for a library's remote class, the entry of the library's class, as a
    GPU's tensor of that class finds it. (MONAI adds ``MetaTensor`` to torch's
    ``default_collate_fn_map``: a batch of 'cuda' MetaTensors met the table's first ``isinstance``
    match, ``torch.Tensor``'s, a stack without their metadata.)"""
    table = kwargs.get("collate_fn_map")
    batch = args[0] if len(args) == 1 else None
    if table is not None and isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], RemoteTensor):
        cls = type(batch[0])
        library = _library_class(cls)
        if library is not cls and cls not in table and library in table:
            return table[library](batch, collate_fn_map=table)
    return original(*args, **kwargs)


def keep_parameters(module: torch.nn.Module) -> Callable[[], None]:
    """What a GPU's ``module.to('cuda')`` keeps of its parameters: each stays the object it was
    (``param.data = ...``), so its class (a subclass of nn.Parameter: diffusers' GGUFParameter, a
    user's) and its attributes (``p._no_weight_decay``, Megatron's ``p.sequence_parallel``) stay.
    A conversion here that swaps them (interception's ``Module._apply``) makes each a new
    ``nn.Parameter`` of the converted tensor first, with neither; this returns the function that
    gives them back to the converted parameters, found by name (a conversion that could not swap
    makes new objects)."""
    kept: dict[str, tuple[type | None, dict]] = {}
    for name, p in module._parameters.items():
        if p is None or is_lazy(p):
            continue
        cls = _library_class(type(p))
        subclass = cls if cls is not torch.nn.Parameter and issubclass(cls, torch.nn.Parameter) else None
        attributes = {k: v for k, v in dict.items(_DICT.__get__(p)) if k not in OWN_KEYS and k != "_is_param"}
        if subclass is not None or attributes:
            kept[name] = subclass, attributes

    def give_back() -> None:
        for name, (subclass, attributes) in kept.items():
            p = module._parameters.get(name)
            if p is None:
                continue
            if subclass is not None and not isinstance(p, subclass):
                if isinstance(p, RemoteTensor):
                    _DICT.__get__(p).pop("_is_param", None)  # (a parameter by its class now)
                    become(p, subclass)
                else:
                    p.__class__ = subclass
            _DICT.__get__(p).update(attributes)
    return give_back


def become(t: torch.Tensor, cls: type) -> torch.Tensor:
    """``t`` (a new remote tensor of its own) made a ``cls``, by the remote class of ``cls``."""
    if not isinstance(cls, type) or not issubclass(cls, torch.Tensor):
        raise TypeError(f"cls must be a type (got {cls!r})" if not isinstance(cls, type)
                        else f"{cls.__name__} is not a subclass of torch.Tensor")
    t.__class__ = RemoteTensor if issubclass(RemoteTensor, cls) else \
        cls if issubclass(cls, RemoteTensor) else remote_class(cls)
    return t


_DEFAULT_TORCH_FUNCTION = torch.Tensor.__torch_function__.__func__  # type: ignore[attr-defined]


class _UnderSubclass(RemoteTensor):
    """RemoteTensor as the base of another library's subclass: with torch.Tensor's own
    ``__torch_function__``, which keeps results in the subclass, where RemoteTensor's is disabled.
    (A function of its own: C++ disables the default one on a class with a ``__torch_dispatch__``.)
    It comes after the subclass in the method order, so that the subclass's ``super()`` reaches it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _DEFAULT_TORCH_FUNCTION(cls, func, types, args, kwargs)

    @torch_function_first
    def __deepcopy__(self, memo: dict) -> RemoteTensor:
        """torch's deepcopy of a subclass that defines none: it builds the copy with the subclass's
        ``new_empty`` (its overrides off), and refuses a subclass whose ``new_empty`` gives another
        class (a plain subclass that does not define it), with torch's error; RemoteTensor's copy."""
        if self.is_leaf and id(self) not in memo:
            with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
                built = self.new_empty([])
            if type(built) is not type(self):
                raise RuntimeError(_NO_NEW_EMPTY)
        return super().__deepcopy__(memo)


#: torch's refusal to deep-copy a plain subclass whose ``new_empty`` gives another class
_NO_NEW_EMPTY = (
    "The default implementation of __deepcopy__() for non-wrapper subclasses only works for subclass types "
    "that implement new_empty() and for which that function returns another instance of the same subclass. "
    "You should either properly implement new_empty() for your subclass or override __deepcopy__() if it is "
    "intended behavior for new_empty() to return an instance of a different type.")


def _library_class(cls: Any) -> Any:
    """``cls``, or the library's class that it is the remote class of."""
    return cls.__bases__[0] if isinstance(cls, type) and _UnderSubclass in cls.__bases__ else cls


def remote_class(cls: type) -> type:
    """The class of a remote tensor that is a ``cls`` (one per class and activation). Its
    ``__dict__`` is ``_attributes``, first in the method order (a library's class before
    RemoteTensor, MONAI's ``MetaObj``, has a ``__dict__`` of its own)."""
    classes = runtime.current().remote_subclasses
    made = classes.get(cls)
    if made is None:
        made = classes[cls] = type(cls.__name__, (cls, _UnderSubclass),
                                   {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                    "__dict__": _attributes})
    return made


#: the attribute dictionary of a tensor, as Python reads and sets it (a getset of torch.Tensor's)
_DICT = torch.Tensor.__dict__["__dict__"]


class _Attributes(dict):
    """A library subclass's remote tensor's ``__dict__``, which shows the library its own
    attributes only: iterating it (``keys()``, ``items()``, ``dict(d)``, ``{**d}``) leaves out
    remotecuda's keys, which attribute access (a dictionary look-up in C) still finds, as do
    ``d[k]``, ``get`` and ``in``, which name a key."""

    def _library(self) -> dict:
        return {k: v for k, v in dict.items(self) if k not in OWN_KEYS}

    def __iter__(self) -> Any:
        return iter(self._library())

    def __len__(self) -> int:
        return len(self._library())

    def __repr__(self) -> str:
        return repr(self._library())

    def keys(self) -> Any:
        return self._library().keys()

    def items(self) -> Any:
        return self._library().items()

    def values(self) -> Any:
        return self._library().values()

    def copy(self) -> dict:
        return self._library()


def _get_attributes(t: torch.Tensor) -> _Attributes:
    d = _DICT.__get__(t)
    if type(d) is not _Attributes:  # (first read since the tensor became a library's class)
        d = _Attributes(d)
        _DICT.__set__(t, d)
    return d


def _set_attributes(t: torch.Tensor, new: Any) -> None:
    """``t.__dict__ = new``: the library's attributes replaced (MONAI's ``copy_meta_from`` of a
    batch), remotecuda's own kept, unless ``new`` brings a tensor's own (``swap_tensors``, which
    swaps the classes and then the dictionaries of two tensors)."""
    if not isinstance(new, dict):
        raise TypeError(f"__dict__ must be set to a dictionary, not a '{type(new).__name__}'")
    whole = dict(dict.items(new))
    if not any(k in whole for k in HANDLE_FIELDS):
        whole.update((k, v) for k, v in dict.items(_DICT.__get__(t)) if k in OWN_KEYS)
    _DICT.__set__(t, _Attributes(whole))


_attributes = property(_get_attributes, _set_attributes, doc=_Attributes.__doc__)
