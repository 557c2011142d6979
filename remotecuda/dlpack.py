"""DLPack capsules of 'cuda' tensors: what ``torch.from_dlpack`` takes back as an alias.

On a GPU ``torch.from_dlpack(t)``, ``from_dlpack(t.__dlpack__())`` and ``to_dlpack(t)`` round trips
give a tensor sharing ``t``'s memory (writes show both ways). A remote tensor's memory is on its
gateway, so its capsule here is torch's own capsule of an empty CPU "anchor" tensor of its dtype,
rewritten to describe the remote tensor (the CUDA device, its shape, strides and fake address):
another consumer sees what a GPU's capsule shows it (NumPy refuses it with its own "Unsupported
device" error). The anchor holds the remote tensor, and torch's capsule holds the anchor, so
the capsule's C destructor and deleter (torch's) release it with no Python code of ours in a
destructor (which may run with an exception pending). torch's consumer, ``torch._C._from_dlpack``
(which ``torch.from_dlpack`` calls, reading it at each call), is replaced while active by one that
finds such a capsule's anchor and gives an alias of the remote tensor on the gateway; any other
capsule goes to torch's.

The anchors are found by the address of their DLPack structure, in a weak table kept by the
module rather than the runtime: a capsule lives as long as its holder keeps it, not as long as
one activation, and its entry goes when torch's deleter frees the anchor.
"""
from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.dlpack import DLDeviceType

from .tensor import RemoteTensor

_NAMES = {b"dltensor": b"used_dltensor", b"dltensor_versioned": b"used_dltensor_versioned"}


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    """DLPack's ``DLTensor``."""
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
                ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Managed(ctypes.Structure):
    """DLPack's ``DLManagedTensor`` (a capsule named "dltensor")."""
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class _ManagedVersioned(ctypes.Structure):
    """DLPack 1's ``DLManagedTensorVersioned`` (a capsule named "dltensor_versioned")."""
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _Deleter), ("flags", ctypes.c_uint64), ("dl_tensor", _Tensor)]


_STRUCTS = {b"dltensor": _Managed, b"dltensor_versioned": _ManagedVersioned}

_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = (ctypes.py_object, ctypes.c_char_p)
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = (ctypes.py_object, ctypes.c_char_p)

#: DLPack structure address → the anchor whose capsule it is (see the module's docstring)
_anchors: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def _managed(capsule: Any) -> tuple[bytes, Any] | None:
    """The name and DLPack structure of an unconsumed capsule, None for anything else."""
    if type(capsule).__name__ != "PyCapsule":
        return None
    for name, struct in _STRUCTS.items():
        if _api.PyCapsule_IsValid(capsule, name):
            return name, struct.from_address(_api.PyCapsule_GetPointer(capsule, name))
    return None


def _capsule(t: RemoteTensor, versioned: bool) -> Any:
    """torch's capsule of an anchor of ``t``'s dtype (torch's words for a dtype DLPack cannot name),
    rewritten to describe ``t`` on its CUDA device; the anchor keeps ``t`` and the arrays."""
    anchor = torch.empty(0, dtype=t.dtype)
    capsule = torch.Tensor.__dlpack__(anchor, max_version=(1, 0) if versioned else None)
    name = b"dltensor_versioned" if versioned else b"dltensor"
    managed = _STRUCTS[name].from_address(_api.PyCapsule_GetPointer(capsule, name))
    n = t.dim()
    shape, strides = (ctypes.c_int64 * n)(*t.shape), (ctypes.c_int64 * n)(*t.stride())
    anchor.remotecuda_shared = (t, shape, strides)  # type: ignore[attr-defined]
    dl = managed.dl_tensor
    dl.data, dl.device, dl.ndim, dl.byte_offset = t.data_ptr(), _Device(DLDeviceType.kDLCUDA, t.device.index), n, 0
    dl.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    dl.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    _anchors[ctypes.addressof(managed)] = anchor
    return capsule


def _held(capsule: Any) -> RemoteTensor | None:
    """The remote tensor of a capsule made here, consumed as torch consumes one (renamed "used_...",
    its deleter called), or None for any other object."""
    found = _managed(capsule)
    if found is None:
        return None
    name, managed = found
    anchor = _anchors.get(ctypes.addressof(managed))
    if anchor is None:
        return None
    t = anchor.remotecuda_shared[0]  # type: ignore[attr-defined]
    _api.PyCapsule_SetName(capsule, _NAMES[name])
    managed.deleter(ctypes.addressof(managed))
    return t


def _placed(t: RemoteTensor, dl_device: tuple[Any, int] | None, copy: bool | None) -> torch.Tensor:
    """What the capsule shares, as torch decides it (ATen's ``maybeCopyTensor``): a copy on the
    asked device when it is another (a CPU copy for NumPy's ``from_dlpack(t, device="cpu")``),
    a clone when ``copy`` asks for one, else the tensor itself."""
    if dl_device is not None:
        kind, index = int(dl_device[0]), int(dl_device[1])
        if kind not in (DLDeviceType.kDLCPU, DLDeviceType.kDLCUDA):
            raise BufferError(f"Unsupported device_type: {kind}")
        device = torch.device("cpu") if kind == DLDeviceType.kDLCPU else torch.device("cuda", index)
        if device != t.device:
            if copy is False:
                raise ValueError(f"cannot move (i.e. copy=False) tensor from {t.device} to {device} without copying.")
            return t.to(device)
    return t.clone() if copy else t


def _share(t: torch.Tensor, max_version: tuple[int, int] | None) -> Any:
    """The capsule of ``t``: one made here for a 'cuda' tensor, torch's own for a CPU copy; a
    versioned one when the consumer takes DLPack 1, as torch gives."""
    if isinstance(t, RemoteTensor):
        return _capsule(t, versioned=max_version is not None and max_version[0] >= 1)
    return torch.Tensor.__dlpack__(t, max_version=max_version)


def export(t: RemoteTensor, *, stream: Any, max_version: tuple[int, int] | None,
           dl_device: tuple[Any, int] | None, copy: bool | None) -> Any:
    """``Tensor.__dlpack__`` of a 'cuda' tensor: torch's refusals in its order and words, then a
    capsule of the tensor (a versioned one when the consumer takes DLPack 1), or of the CPU copy
    a consumer asking for the CPU gets."""
    if t.requires_grad:
        raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
    if t.device.index != torch.cuda.current_device():
        raise BufferError("Can't export tensors on a different CUDA device index. "
                          f"Expected: {t.device.index}. Current device: {torch.cuda.current_device()}.")
    if stream is not None and type(stream) is not int:
        raise TypeError("stream must be ``int`` or ``none``")
    if stream == 0:
        raise AssertionError("unsupported stream on CUDA: 0.")
    # a stream to wait on needs nothing more: a session's ops run in order on the gateway (and
    # torch's refusal of 2, CUDA's per-thread default stream, would refuse remotecuda's stream
    # number 2, which ``torch.from_dlpack`` passes inside ``with torch.cuda.stream(s)``)
    return _share(_placed(t, dl_device, copy), max_version)


def to_dlpack(original: Callable) -> Callable:
    """``torch.utils.dlpack.to_dlpack`` (torch's C++ ``_to_dlpack``, which would read the meta
    stand-in): a 'cuda' tensor's capsule; like torch's, without ``__dlpack__``'s refusals."""
    def _to_dlpack(tensor: Any, dl_device: Any = None, copy: bool | None = None) -> Any:
        if isinstance(tensor, RemoteTensor):
            return _share(_placed(tensor, dl_device, copy), max_version=None)
        return original(tensor, dl_device=dl_device, copy=copy)
    return _to_dlpack


def from_dlpack(original: Callable) -> Callable:
    """``torch._C._from_dlpack``: a capsule made here gives an alias of its tensor (sharing its
    gateway memory, not requiring grad, as torch's tensor from a capsule); others go to torch."""
    def _from_dlpack(data: Any) -> torch.Tensor:
        t = _held(data)
        return original(data) if t is None else t.detach()
    return _from_dlpack
