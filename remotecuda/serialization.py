"""``torch.save`` / ``torch.load`` across the boundary.

Saving: ``torch.save`` writes a remote tensor as a GPU's torch writes a CUDA tensor: a
storage located on 'cuda:N' and the tensor's view of it, so the file is a GPU's checkpoint
(views saved together stay views of one storage; ``map_location`` as a callable, a dict or
a string means what it means there). It first finds every remote tensor in the object (a
pickling pass that writes nothing and stops at tensors) and fetches, for each remote
storage, the span its saved tensors cover, all together (downloads.py): one round trip for
a whole checkpoint, not one per tensor. Plain pickling (``pickle.dumps``, multiprocessing)
keeps tensor.py's form, a CPU tensor rebuilt on 'cuda:N'. A storage saved as itself
(``torch.save(t.storage())``) is written whole, and the tensors saved with it view it.

Loading: a checkpoint whose storages are located on 'cuda' cannot be restored by a CPU-only
torch. A deserializer registered for 'cuda' locations keeps such storages on the CPU and
remembers them; ``torch.load`` then moves the tensors built on them to the remote device
(a storage several tensors view goes once, and they become views of it), and a storage loaded
as itself after them, and honours ``map_location='cuda'`` by moving every tensor and storage.
"""
from __future__ import annotations

import itertools
import multiprocessing.queues
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from . import downloads, runtime
from .device_type import DEVICE
from .tensor import (
    RemoteStorage,
    RemoteTensor,
    as_subclass_reduction,
    extent,
    stands_for_parameter,
    torch_function_first,
)

#: the dtypes of which TypedStorage refuses to make a CUDA storage
_QUANTIZED = frozenset((torch.quint8, torch.quint4x2, torch.quint2x4, torch.qint32, torch.qint8))
#: during torch.load: ``current``, its _Load
_loading = threading.local()
#: during torch.save: ``storages``, {(session id, storage id, dtype): (CPU UntypedStorage, its first element's offset)}
_saving = threading.local()


def _tag(obj: Any) -> str | None:
    """A saved remote tensor's storage is a CPU one naming its 'cuda:N' (``__reduce_ex__`` below):
    the zipfile format reads that name itself, the legacy one asks the taggers."""
    fake = getattr(obj, "_fake_device", None)
    return str(fake) if isinstance(fake, DEVICE) and fake.type == "cuda" else None


def _deserialize(obj: Any, location: str) -> Any:
    if isinstance(location, str) and location.startswith("cuda"):
        load = getattr(_loading, "current", None)
        if load is None:  # not inside remotecuda's torch.load: let torch say what it says
            return None
        index, count = _index(location), torch.cuda.device_count()
        if index >= count:  # (torch's own words, which name the remedy)
            raise RuntimeError(f"Attempting to deserialize object on CUDA device {index} but "
                               f"torch.cuda.device_count() is {count}. Please use torch.load with "
                               "map_location to map your storages to an existing device.")
        load.storages[obj._cdata] = (index, obj)
        return obj
    return None


class _Load:
    """One torch.load: the storages the file locates on 'cuda' (kept on the CPU, by StorageImpl, as
    empty storages share data_ptr 0, and held so that no other takes the address), and each
    moved to its device once, for the tensors built on it to view."""

    def __init__(self) -> None:
        self.storages: dict[int, tuple[int, Any]] = {}
        self.bases: dict[tuple, torch.Tensor] = {}
        #: a file in the legacy format (``_use_new_zipfile_serialization=False``) gives its
        #: storages their bytes after the tensors on them are built: those move once it is read
        self.deferred = False

    def remote(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (just rebuilt on a CPU storage) on the device its storage was located on."""
        storage = t.untyped_storage()
        found = self.storages.get(storage._cdata)
        if found is None:
            return t
        if getattr(found[1], "_torch_load_uninitialized", False):
            self.deferred = True
            return t
        dest, size = torch.device("cuda", found[0]), t.element_size()
        key = (storage._cdata, t.dtype)
        base = self.bases.get(key)
        with torch.no_grad():
            if base is None and (t.is_contiguous() and t.storage_offset() == 0
                                 and t.numel() * size == storage.nbytes()):
                moved = self.bases[key] = _plain(t.detach()).to(dest)  # the whole storage (the usual case)
            elif base is None and storage.nbytes() % size:  # (no whole number of elements fills it)
                moved = _plain(t.detach()).to(dest)
            else:
                if base is None:
                    base = self.bases[key] = torch.empty(0, dtype=t.dtype).set_(storage).to(dest)
                moved = base.as_strided(t.shape, t.stride(), t.storage_offset()).detach()
            moved = _with_bits(moved, t)
        return moved.requires_grad_(t.requires_grad)

    def located(self, t: torch.Tensor) -> torch.device | None:
        """The 'cuda' device the file locates ``t``'s storage on, if any."""
        found = self.storages.get(t.untyped_storage()._cdata)
        return None if found is None else torch.device("cuda", found[0])


def _storage_to(original: Any) -> Any:
    """``storage.to('cuda')`` (what ``storage.cuda()`` calls): inside torch.load, a ``map_location``
    callable's ``lambda storage, loc: storage.cuda()``, whose storage stays on the CPU located on
    the device, and the tensors torch builds on it go there, as for a file's 'cuda' storages.
    Elsewhere the storage of a byte tensor viewing it, moved (torch's own move makes a storage on
    the device, which a CPU-only torch cannot); one already there is itself, as on a GPU."""
    def to(self: Any, *, device: Any, non_blocking: bool = False) -> Any:
        d = device if isinstance(device, torch.device) else torch.device(device)
        if d.type != "cuda":
            return original(self, device=device, non_blocking=non_blocking)
        d = DEVICE("cuda", runtime.current().current_device if d.index is None else d.index)
        load = getattr(_loading, "current", None)
        if load is not None:
            load.storages[self._cdata] = (d.index, self)
            return self
        if self.device == d:
            return self
        viewing = torch.empty(0, dtype=torch.uint8, device=self.device).set_(self)
        return viewing.to(d, non_blocking=non_blocking).untyped_storage()
    return to


def _new_wrapped_storage(original: Any) -> Any:
    """``TypedStorage``'s wrapping of the untyped storage its ``cuda()``, ``clone()``, ``copy``
    and ``to`` made, which refuses any class but ``UntypedStorage``: a 'cuda' one is a
    ``RemoteStorage`` (tensor.py), wrapped as ``Tensor.storage()`` wraps it."""
    def _new_wrapped_storage(self: Any, untyped_storage: Any) -> Any:
        if isinstance(untyped_storage, RemoteStorage):
            return torch.TypedStorage(wrap_storage=untyped_storage, dtype=self.dtype, _internal=True)
        return original(self, untyped_storage)
    return _new_wrapped_storage


def _restored_on_device(plain: Any) -> Any:
    """``torch._utils._restore_device_fake_mode``, which every tensor torch.load rebuilds passes
    through: inside remotecuda's load, a tensor on a storage located on 'cuda' goes there."""
    def _restore_device_fake_mode(tensor: torch.Tensor) -> torch.Tensor:
        tensor = plain(tensor)
        load = getattr(_loading, "current", None)
        return tensor if load is None or isinstance(tensor, RemoteTensor) else load.remote(tensor)
    return _restore_device_fake_mode


def _index(location: str) -> int:
    _, _, idx = location.partition(":")
    return int(idx) if idx.isdigit() else 0


def _map_location_device(map_location: Any) -> torch.device | None:
    if isinstance(map_location, (str, DEVICE)):
        d = torch.device(map_location)
        return d
    return None


class _Mover:
    """``map_location='cuda'`` (``target`` says 'cuda' of every tensor), or a file whose storages
    are located on 'cuda' (``target`` names the device of a tensor's storage, None for a CPU one):
    every loaded tensor and storage moved there (torch loaded them on the CPU); shared tensors
    stay shared, and tensors and storages that view one storage view one remote storage."""

    def __init__(self, target: Callable[[torch.Tensor], torch.device | None],
                 bases: dict[tuple, torch.Tensor] | None = None):
        self.target = target
        self.memo: dict[int, Any] = {}
        self.viewers: dict[int, int] = {}  # storage (its StorageImpl) → how many loaded tensors view it
        #: (storage, dtype) → the storage moved (a _Load's, when its tensors moved as they were built)
        self.bases: dict[tuple, torch.Tensor] = {} if bases is None else bases

    def __call__(self, obj: Any) -> Any:
        self._count(obj, set())
        return self._move(obj)

    def _children(self, obj: Any) -> Any:
        if isinstance(obj, dict):
            return obj.values()
        if isinstance(obj, list) or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
            return obj
        return ()

    def _count(self, obj: Any, seen: set) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, torch.TypedStorage)) and not isinstance(obj, RemoteTensor):
            ptr = obj.untyped_storage()._cdata if isinstance(obj, torch.Tensor) else obj._untyped_storage._cdata
            self.viewers[ptr] = self.viewers.get(ptr, 0) + 1
        for v in self._children(obj):
            self._count(v, seen)

    def _move(self, obj: Any) -> Any:
        if id(obj) in self.memo:
            return self.memo[id(obj)]
        out = obj
        if isinstance(obj, torch.nn.Module):
            dest = next(filter(None, map(self.target, itertools.chain(obj.parameters(), obj.buffers()))), None)
            if dest is not None:
                obj.to(dest)
        elif isinstance(obj, torch.Tensor):
            if not isinstance(obj, RemoteTensor):
                out = self._tensor_to(obj)
        elif isinstance(obj, torch.TypedStorage):
            out = self._storage_to(obj)
        elif isinstance(obj, dict):
            new: Any = type(obj)() if type(obj) is not dict else {}
            for k, v in obj.items():
                new[k] = self._move(v)
            if hasattr(obj, "_metadata"):
                new._metadata = obj._metadata
            out = new
        elif isinstance(obj, list):
            out = [self._move(v) for v in obj]
        elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            out = tuple(self._move(v) for v in obj)
        self.memo[id(obj)] = out
        return out

    def _tensor_to(self, obj: torch.Tensor) -> torch.Tensor:
        """``obj`` on the target, a leaf as torch.load makes it; a view of its storage moved once
        when other loaded tensors view that storage too."""
        dest = self.target(obj)
        if dest is None:
            return obj
        storage = obj.untyped_storage()
        ptr, size = storage._cdata, obj.element_size()
        with torch.no_grad():
            if obj.numel() and self.viewers.get(ptr, 0) > 1 and storage.nbytes() % size == 0:
                key = (ptr, obj.dtype)
                base = self.bases.get(key)
                if base is None:
                    base = self.bases[key] = torch.empty(0, dtype=obj.dtype).set_(storage).to(dest)
                moved = base.as_strided(obj.shape, obj.stride(), obj.storage_offset()).detach()
            else:
                moved = _plain(obj.detach()).to(dest)
            moved = _with_bits(moved, obj)
        if isinstance(obj, torch.nn.Parameter):
            return torch.nn.Parameter(moved, requires_grad=obj.requires_grad)
        return moved.requires_grad_(obj.requires_grad)


    def _storage_to(self, obj: torch.TypedStorage) -> torch.TypedStorage:
        """A loaded storage (torch.load gives each as a TypedStorage) on the target, as a GPU's
        torch.load gives one the file locates on 'cuda': the storage of its bytes moved, the same
        one the loaded tensors on it view."""
        storage = obj._untyped_storage
        if isinstance(storage, RemoteStorage) or obj.dtype in _QUANTIZED:  # (torch has no CUDA storage of those)
            return obj
        view = torch.empty(0, dtype=obj.dtype).set_(storage)
        dest = self.target(view)
        if dest is None:
            return obj
        key = (storage._cdata, obj.dtype)
        base = self.bases.get(key)
        if base is None:
            with torch.no_grad():
                base = self.bases[key] = view.to(dest)
        return torch.TypedStorage(wrap_storage=base.untyped_storage(), dtype=obj.dtype, _internal=True)


class _Finder(pickle.Pickler):
    """Pickles into nothing, only to list the remote tensors an object holds."""

    class _Nowhere:
        def write(self, data: Any) -> None:
            pass

    def __init__(self) -> None:
        super().__init__(self._Nowhere(), protocol=2)
        self.found: list[RemoteTensor] = []
        self.storages: set[int] = set()  # the remote storages saved as themselves (their StorageImpl)

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            if isinstance(obj, RemoteTensor):
                self.found.append(obj)
            storage = obj._untyped_storage if isinstance(obj, torch.TypedStorage) else obj
            if isinstance(storage, RemoteStorage):
                self.storages.add(storage._cdata)
            return 0  # (a tensor's contents are not walked)
        return None


def saved_contents(obj: Any) -> tuple[list[RemoteTensor], set[int]]:
    """The remote tensors that pickling ``obj`` would save, and the remote storages it would save
    as themselves; none if it does not pickle (then ``torch.save`` raises its own error)."""
    finder = _Finder()
    try:
        finder.dump(obj)
    except Exception:
        return [], set()
    return finder.found, finder.storages


def _with_bits(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` with ``like``'s lazy conjugate and negative bits flipped, by the ops that flip them (so
    the gateway holds the bits too; ``torch._utils.set_tensor_metadata`` would set them on the
    client's tensor only): a plain view of a storage moved to the device then reads its bytes as
    ``like`` does, and ``like`` itself becomes its plain bytes."""
    t = t.conj() if like.is_conj() else t
    return t._neg_view() if like.is_neg() else t


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as they are, without its bits (the file keeps the storage's bytes and each
    tensor's bits, as torch saves a CUDA tensor)."""
    return _with_bits(t, t)


def _own(cpu: torch.Tensor) -> torch.UntypedStorage:
    """A fetched flat tensor's bytes as a storage of their own."""
    if cpu.storage_offset() or cpu.untyped_storage().nbytes() != cpu.numel() * cpu.element_size():
        cpu = cpu.clone()
    return cpu.untyped_storage()


@contextmanager
def _saved_storages(tensors: list[RemoteTensor], whole: set[int] | None = None) -> Iterator[None]:
    """For a torch.save: each remote storage (per dtype) as a CPU storage spanning the saved
    tensors on it, all fetched in one round trip per session. A storage saved as itself too
    (``whole``: ``torch.save([t.storage(), t])``) is instead the one record its tensors view, as on
    a GPU: the RemoteStorage, which torch saves whole (``cpu()``) and keys by its StorageImpl."""
    with torch._C.DisableTorchFunctionSubclass():  # (remotecuda's reads: a subclass's __torch_function__ sees none)
        mine = _fetched_storages(tensors, whole or set())
    outer = getattr(_saving, "storages", None)
    outer_whole: set[int] = getattr(_saving, "whole", set())
    _saving.storages, _saving.whole = {**(outer or {}), **mine}, outer_whole | (whole or set())
    try:
        yield
    finally:
        _saving.storages, _saving.whole = outer, outer_whole


def _fetched_storages(tensors: list[RemoteTensor], whole: set[int]) -> dict:
    """``_saved_storages``' CPU storages, keyed by (session, storage, dtype): each with the storage
    offset its bytes begin at."""
    spans: dict[tuple, tuple[RemoteTensor, int, int]] = {}
    for t in tensors:
        if t.numel() and not (whole and t.untyped_storage()._cdata in whole):
            key = (id(t._s), t._sid, t.dtype)
            lo = int(t.storage_offset())
            hi = lo + extent(t.shape, t.stride())
            if key in spans:
                first, a, b = spans[key]
                lo, hi, t = min(a, lo), max(b, hi), first
            spans[key] = (t, lo, hi)
    if len({key[:2] for key in spans}) < len(spans):  # torch.save's own check (it sees CPU storages)
        raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
    with torch.no_grad():
        flats = [_plain(t.detach() if t.is_contiguous() and t.storage_offset() == lo and t.numel() == hi - lo
                        else t.as_strided((hi - lo,), (1,), lo)) for t, lo, hi in spans.values()]
    return {key: (_own(cpu.reshape(-1)), lo) for (key, (_, lo, _)), cpu in zip(spans.items(), downloads.fetch(flats))}


def _make_save(original: Any) -> Any:
    def save(obj: Any, *args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunctionSubclass():  # (finding them is remotecuda's, unseen by a subclass)
            contents = saved_contents(obj)
        with _saved_storages(*contents):
            return original(obj, *args, **kwargs)
    save.__doc__ = original.__doc__
    save.__wrapped__ = original  # type: ignore[attr-defined]  # (as functools.wraps sets it)
    return save


def _reduce_ex(plain: Any) -> Any:
    """``RemoteTensor.__reduce_ex__``: inside torch.save, a view of a CPU storage that the file
    locates on 'cuda:N' (torch's own form for a CUDA tensor); elsewhere ``plain``'s. Handed to a
    subclass's ``__torch_function__`` first, as torch's ``Tensor.__reduce_ex__`` is."""
    def __reduce_ex__(self: RemoteTensor, proto: Any) -> Any:
        storages = getattr(_saving, "storages", None)
        if storages is None or stands_for_parameter(self):
            return plain(self, proto)
        found = storages.get((id(self._s), self._sid, self.dtype))
        if _saving.whole and self.untyped_storage()._cdata in _saving.whole:
            found = (self.untyped_storage(), 0)
        if found is None and self.numel():  # (reached by pickling only, not by the finder's pass)
            with _saved_storages([self]):
                return __reduce_ex__(self, proto)
        storage, first = found if found is not None else (torch.UntypedStorage(0), self.storage_offset())
        args: tuple = (self.storage_offset() - first, tuple(self.shape), self.stride(), self.requires_grad,
                       OrderedDict())
        metadata = torch._utils.get_tensor_metadata(self)  # (the lazy conjugate's and negative's bits)
        if self.dtype in torch.storage._new_dtypes():
            storage._fake_device = self.device  # type: ignore[attr-defined]  # (what the file names)
            return as_subclass_reduction(self, (torch._utils._rebuild_tensor_v3,
                                                (storage, *args, self.dtype, *([metadata] if metadata else []))))
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=self.dtype, _internal=True)
        typed._fake_device = storage._fake_device = self.device  # type: ignore[attr-defined]
        return as_subclass_reduction(self, (torch._utils._rebuild_tensor_v2,
                                            (typed, *args, *([metadata] if metadata else []))))
    return torch_function_first(__reduce_ex__)


def _make_load(original: Any) -> Any:
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        target = _map_location_device(map_location)
        outer = getattr(_loading, "current", None)
        current = _loading.current = _Load()
        try:
            if target is not None and target.type == "cuda":
                return _Mover(lambda t: target)(original(f, "cpu", *args, **kwargs))
            loaded = original(f, map_location, *args, **kwargs)
            if current.deferred or (current.storages and _holds_storage(loaded)):
                return _Mover(current.located, current.bases)(loaded)
            return loaded
        finally:
            _loading.current = outer
    load.__doc__ = original.__doc__
    load.__wrapped__ = original  # type: ignore[attr-defined]  # (as functools.wraps sets it)
    return load


def _holds_storage(obj: Any) -> bool:
    """Whether a loaded object holds a storage where ``_Mover`` looks (itself, or in dicts, lists
    and tuples): a storage saved as one, which torch.load leaves on the CPU (the tensors on a
    storage the file locates on 'cuda' are moved there as they are built)."""
    if isinstance(obj, torch.TypedStorage):
        return True
    if isinstance(obj, dict):
        return any(map(_holds_storage, obj.values()))
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return any(map(_holds_storage, obj))
    return False


def _not_shared(t: RemoteTensor) -> Any:
    """multiprocessing's pickler (a Queue, a spawned Process's arguments) shares a CUDA tensor by
    CUDA IPC, so that both processes see one memory (Hogwild's shared weights); a remote device
    offers no such sharing, and a copy would silently break what the program relies on."""
    raise _sharing_refused()


#: why a 'cuda' tensor is not sent to another process
_REFUSAL = ("remotecuda: a cuda tensor cannot be sent to another process (torch.multiprocessing shares CUDA "
            "tensors through CUDA IPC, which remote devices do not offer); send a CPU copy (t.cpu()) and move it "
            "to 'cuda' there, or use threads")


def _sharing_refused() -> NotImplementedError:
    return NotImplementedError(_REFUSAL)


def _feeder_error(original: Callable) -> Callable:
    """``multiprocessing.Queue._on_queue_feeder_error``, as a method: a Queue pickles what it sends
    in a background thread, where a refusal (``_not_shared``) is printed and the item dropped. A
    DataLoader worker (forked before the program initialized CUDA, so free to use it) whose batch
    holds 'cuda' tensors then left its parent waiting for that batch for ever; the refusal is
    sent in the batch's place as the worker sends its ``collate_fn``'s errors, and the parent's
    loop raises it."""
    def on_error(queue: Any, e: Exception, obj: Any) -> None:
        info = torch.utils.data.get_worker_info()
        if info is None or str(e) != _REFUSAL or not (isinstance(obj, tuple) and len(obj) == 2):
            original(e, obj)
            return
        from torch._utils import ExceptionWrapper
        queue.put((obj[0], ExceptionWrapper((type(e), e, e.__traceback__), where=f"in DataLoader worker process "
                                                                                  f"{info.id}")))
    return on_error


def _new_shared(original: Callable) -> classmethod:
    """``UntypedStorage._new_shared``: a storage made to be sent to another process (a
    DataLoader worker's ``default_collate`` stacks its batch into one). For 'cuda' it is refused
    as the sending would be (``_not_shared``), in the worker, where the program sees it; torch's
    would make a CUDA storage by ``UntypedStorage(size, device='cuda')``, which a CPU-only torch
    does not know ("Storage device not recognized: cuda")."""
    def new_shared(cls: type, size: int, *, device: Any = "cpu") -> Any:
        if torch.device(device).type == "cuda":
            raise _sharing_refused()
        return original(cls, size, device=device)
    return classmethod(new_shared)


_registered = False


def install(patches: Any) -> None:
    global _registered
    if not _registered:  # torch has no unregister; the deserializer is inert unless loading
        torch.serialization.register_package(0, _tag, _deserialize)
        _registered = True
    ForkingPickler.register(RemoteTensor, _not_shared)  # (inert for other types: nothing to undo)
    queue = multiprocessing.queues.Queue
    patches.set(queue, "_on_queue_feeder_error", _feeder_error(vars(queue)["_on_queue_feeder_error"].__func__))
    shared = vars(torch.storage._StorageBase)["_new_shared"].__func__  # (the raw classmethod's function)
    patches.set(torch.UntypedStorage, "_new_shared", _new_shared(shared))
    patches.set(torch, "load", _make_load(torch.load))
    patches.set(torch, "save", _make_save(torch.save))
    patches.set(RemoteTensor, "__reduce_ex__", _reduce_ex(RemoteTensor.__reduce_ex__))
    patches.set(torch.storage._StorageBase, "to", _storage_to(torch.storage._StorageBase.to))
    typed = torch.TypedStorage
    patches.set(typed, "_new_wrapped_storage", _new_wrapped_storage(typed._new_wrapped_storage))
    patches.set(torch._utils, "_restore_device_fake_mode", _restored_on_device(torch._utils._restore_device_fake_mode))
    patches.set(torch.serialization, "save", torch.save)
    patches.set(torch.serialization, "load", torch.load)
