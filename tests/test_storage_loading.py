"""Storages on 'cuda' as on a GPU: slices of a storage, storages made by their constructors,
saved and loaded as themselves, and read whole. Values are compared with the same code run on the
CPU, whose storages have the same semantics."""
from __future__ import annotations

import io
import warnings

import pytest
import torch

import remotecuda

pytestmark = pytest.mark.usefixtures("remote")


def _slices(device: str) -> tuple:
    """A storage's slices read, sliced again, written through and viewed by tensors ``set_`` on
    them, and their addresses relative to the whole storage's."""
    a = torch.arange(6, dtype=torch.float32, device=device)
    whole = a.untyped_storage()
    part = whole[8:20]
    inner = part[4:8]
    reads = (part.nbytes(), part.tolist(), inner.tolist(), part[-1], part.cpu().tolist(), part.clone().tolist())
    on_part = torch.empty(0, device=device).set_(part, 1, (2,), (1,))
    whole[0:4].copy_(part[0:4])  # a[0] = a[2], storage to storage
    inner.fill_(0)  # a[3] = 0
    addresses = (part.data_ptr() - whole.data_ptr(), inner.data_ptr() - whole.data_ptr())
    return reads, addresses, on_part.cpu(), a.cpu(), str(part.device), type(part).__mro__.count(torch.UntypedStorage)


def test_a_storage_slice_reads_writes_and_views_the_storages_bytes():
    """``s[a:b]`` of a 'cuda' storage (a storage of the bytes from ``a``, as a GPU's points into
    its parent) raised KeyError '_device': the slice, made by C++ as an object of the storage's
    class, was not told which device and gateway tensor it belongs to."""
    remote, local = _slices("cuda"), _slices("cpu")
    assert remote[:2] == local[:2]
    assert torch.equal(remote[2], local[2]) and torch.equal(remote[3], local[3])
    assert remote[4:] == ("cuda:0", 1)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_tensor_set_past_a_slices_end_is_refused_as_torch_refuses_it(device):
    """A tensor ``set_`` onto a slice must fit in the slice, not in the storage it was cut from
    (torch would grow the storage, which a slice's cannot)."""
    part = torch.zeros(4, device=device).untyped_storage()[4:12]
    with pytest.raises(RuntimeError, match="Trying to resize storage that is not resizable"):
        torch.empty(0, device=device).set_(part, 1, (2,))
    with pytest.raises(RuntimeError, match="Trying to resize storage that is not resizable"):
        part.resize_(4)


def _constructed(device: str, legacy: type) -> tuple:
    """Storages made by their constructors: untyped (a size, bytes, none), typed, and legacy."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (TypedStorage's deprecation)
        sized = torch.UntypedStorage(12, device=device).fill_(3)
        from_bytes = torch.UntypedStorage([1, 2, 3, 4], device=device)
        empty = torch.UntypedStorage(device=device)
        typed = torch.TypedStorage([1.5, -2.0], dtype=torch.float64, device=device)
        old = legacy(3).fill_(2)
        on_it = torch.empty(0, dtype=torch.int32, device=device).set_(sized)
        return (sized.nbytes(), sized.tolist(), from_bytes.tolist(), empty.nbytes(), typed.tolist(),
                typed.dtype, old.tolist(), old.dtype, on_it.cpu().tolist(),
                [str(s.device) for s in (sized, from_bytes, empty, typed, old)])


def test_storages_made_on_cuda_by_their_constructors():
    """``torch.UntypedStorage(n, device='cuda')``, and the TypedStorage and legacy
    ``torch.cuda.FloatStorage(n)`` constructors that build on it, said "Storage device not
    recognized: cuda" (a CPU-only torch's C++); they make a storage on the current device."""
    remote = _constructed("cuda", torch.cuda.FloatStorage)
    local = _constructed("cpu", torch.FloatStorage)
    assert remote[:-1] == local[:-1]
    assert remote[-1] == ["cuda:0"] * 5 and local[-1] == ["cpu"] * 5


def test_torch_is_storage_knows_a_cuda_storage():
    """``torch.is_storage`` (an exact-class lookup in torch's set) said False of a 'cuda' storage."""
    s = torch.arange(4.0, device="cuda").untyped_storage()
    assert torch.is_storage(s) and torch.is_storage(s[4:8]) and not torch.is_storage(torch.ones(1, device="cuda"))


def _saved_storages(device: str) -> list:
    """Storages saved as themselves (untyped, a slice, typed, in the legacy format), loaded back:
    their class, device, dtype and bytes."""
    a = torch.arange(4.0, device=device)
    out = []
    for obj, kwargs in [(a.untyped_storage(), {}), (a.untyped_storage()[4:12], {}), (a.storage(), {}),
                        ({"s": a.storage()}, {"_use_new_zipfile_serialization": False})]:
        buf = io.BytesIO()
        torch.save(obj, buf, **kwargs)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        loaded = loaded["s"] if isinstance(loaded, dict) else loaded
        out.append((type(loaded).__name__, loaded.device.type, loaded.dtype, loaded.tolist()))
    return out


def test_a_saved_cuda_storage_loads_back_on_cuda():
    """``torch.save`` of a 'cuda' storage recursed until RecursionError (torch took it for a plain
    object, whose ``__reduce__`` saves it again); loaded, a storage the file locates on 'cuda' stayed
    on the CPU (only tensors were moved), where a GPU's torch.load gives it on 'cuda'."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (TypedStorage's deprecation)
        remote, local = _saved_storages("cuda"), _saved_storages("cpu")
    assert [r[:1] + r[2:] for r in remote] == [r[:1] + r[2:] for r in local]
    assert {r[1] for r in remote} == {"cuda"}


def test_a_storage_loaded_with_map_location_cuda_goes_there():
    """...and stays the storage of the tensors loaded on it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        a = torch.arange(3.0)
        buf = io.BytesIO()
        torch.save([a.storage(), a], buf)
        buf.seek(0)
        storage, tensor = torch.load(buf, map_location="cuda", weights_only=True)
        tensor[0] = 5.0
        assert storage.device == torch.device("cuda", 0) and storage.tolist() == [5.0, 1.0, 2.0]


def _round_trips(read, t: torch.Tensor) -> tuple:
    torch.cuda.synchronize()
    before = remotecuda.stats()["blocking_round_trips"]
    value = read(t)
    return value, remotecuda.stats()["blocking_round_trips"] - before


def test_a_storages_values_come_in_one_read():
    """torch reads a storage one element a round trip when it iterates it (``tolist()``, ``list``,
    its text): 4000 bytes took seconds on loopback. A 'cuda' storage's are read whole, once; its
    text names the class a GPU's storage has."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (TypedStorage's deprecation)
        a, local = torch.arange(16, dtype=torch.float32, device="cuda"), torch.arange(16, dtype=torch.float32)
        for read in (lambda t: t.untyped_storage().tolist(), lambda t: list(t.untyped_storage()[8:24]),
                     lambda t: t.storage().tolist(), lambda t: repr(t.storage()), lambda t: repr(t.untyped_storage())):
            value, trips = _round_trips(read, a)
            assert value == read(local).replace("cpu", "cuda:0") if isinstance(value, str) else value == read(local)
            assert trips <= 2, trips


def test_a_cuda_storage_names_its_class_and_makes_new_ones_on_its_device():
    """``type()`` named ``remotecuda.tensor.RemoteStorage`` (and so did ``pin_memory``'s refusal),
    and ``new()`` gave a storage on 'meta' that did not know its device (C++'s, of the same class)."""
    s = torch.arange(4.0, device="cuda").untyped_storage()
    assert s.type() == "torch.storage.UntypedStorage"
    with pytest.raises(TypeError, match="cannot pin 'torch.storage.UntypedStorage' only CPU memory can be pinned"):
        s.pin_memory()
    empty = s.new()
    assert empty.device == torch.device("cuda", 0) and empty.nbytes() == 0 and empty.tolist() == []


def _saved_with_tensors(device: str, legacy: bool) -> list:
    """A storage saved beside tensors on it (a view among them): loaded, a write through one tensor
    shows in the other and in the storage, as the file holds one storage they all view."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (TypedStorage's deprecation)
        a = torch.arange(6.0, device=device)
        buf = io.BytesIO()
        torch.save([a.storage(), a, a[2:4]], buf, _use_new_zipfile_serialization=not legacy)
        buf.seek(0)
        storage, whole, view = torch.load(buf, weights_only=not legacy)
        view.fill_(7.0)
        return [storage.tolist(), whole.cpu().tolist(), storage.device.type]


@pytest.mark.parametrize("legacy", [False, True])
def test_a_storage_saved_beside_its_tensors_is_one_storage_in_the_file(legacy):
    """The storage was written as a copy of its own (the tensors' bytes came from another, fetched
    copy), so the loaded storage and tensors no longer shared memory, and one storage saved as two
    dtypes was not refused as torch refuses it."""
    remote, local = _saved_with_tensors("cuda", legacy), _saved_with_tensors("cpu", legacy)
    assert remote[:2] == local[:2] == [[0.0, 1.0, 7.0, 7.0, 4.0, 5.0]] * 2
    assert remote[2] == "cuda"
    a = torch.arange(2.0, device="cuda")
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        torch.save([a.untyped_storage(), a], io.BytesIO())
