"""A 'cuda' tensor handed to other array code: DLPack round trips through torch (an alias of the
same gateway memory, as on a GPU), and NumPy's refusals, with the exception types and words a
GPU machine gives."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.usefixtures("remote")


# ---------------------------------------------------------------------- DLPack through torch
@pytest.mark.parametrize("consume", [
    torch.from_dlpack,
    lambda t: torch.utils.dlpack.from_dlpack(t.__dlpack__()),
    lambda t: torch.from_dlpack(t.__dlpack__(max_version=(1, 0))),
    lambda t: torch.from_dlpack(torch.utils.dlpack.to_dlpack(t)),
    lambda t: torch.from_dlpack(t, device="cuda"),
], ids=["from_dlpack", "capsule", "versioned", "to_dlpack", "device"])
def test_from_dlpack_of_a_cuda_tensor_is_an_alias(consume):
    """On a GPU the tensor from a capsule shares the exporter's memory: writes show both ways."""
    x = torch.arange(12.0).reshape(3, 4)
    t = x.to("cuda")
    v = t[:, 1:3]  # a strided view with an offset
    a = consume(v)
    assert a.device == torch.device("cuda:0") and not a.requires_grad
    assert (a.shape, a.stride(), a.storage_offset()) == (v.shape, v.stride(), v.storage_offset())
    a[0, 0] = -1.0
    t[2, 2] = -2.0
    x[0, 1], x[2, 2] = -1.0, -2.0
    torch.testing.assert_close(t.cpu(), x, rtol=0, atol=0)
    torch.testing.assert_close(a.cpu(), x[:, 1:3], rtol=0, atol=0)


def test_dlpack_copies_and_refusals_are_torchs():
    t = torch.arange(4, device="cuda", dtype=torch.int32)
    c = torch.from_dlpack(t, copy=True)
    c[0] = 9
    assert t.tolist() == [0, 1, 2, 3] and c.tolist() == [9, 1, 2, 3]
    on_cpu = torch.from_dlpack(t, device="cpu")
    assert on_cpu.device.type == "cpu" and on_cpu.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot move DLPack tensor from device"):
        torch.from_dlpack(t, device="cpu", copy=False)
    capsule = t.__dlpack__()
    torch.from_dlpack(capsule)
    with pytest.raises(RuntimeError, match="DLTensor capsules can be consumed only once"):
        torch.from_dlpack(capsule)
    p = torch.ones(2, device="cuda", requires_grad=True)
    with pytest.raises(BufferError, match="Can't export tensors that require gradient"):
        torch.from_dlpack(p)
    assert torch.from_dlpack(torch.utils.dlpack.to_dlpack(p)).tolist() == [1.0, 1.0]  # (to_dlpack does not ask)
    with pytest.raises(TypeError, match="stream must be ``int`` or ``none``"):
        t.__dlpack__(stream="0")
    with pytest.raises(BufferError, match="Unsupported device_type: 7"):
        t.__dlpack__(dl_device=(7, 0))
    with torch.cuda.stream(torch.cuda.Stream()):  # (its stream's number is passed along)
        assert torch.from_dlpack(t).tolist() == [0, 1, 2, 3]
    cpu = torch.arange(3.0)  # CPU tensors and capsules as before
    assert torch.equal(torch.from_dlpack(torch.utils.dlpack.to_dlpack(cpu)), cpu)


def test_a_capsule_releases_its_tensor():
    """A capsule holds its tensor until consumed or dropped, as torch's holds its storage."""
    from remotecuda import dlpack
    t = torch.ones(3, device="cuda")
    alive = weakref.ref(t)
    capsules = [t.__dlpack__(), t.__dlpack__(max_version=(1, 0)), torch.utils.dlpack.to_dlpack(t)]
    del t
    gc.collect()
    assert alive() is not None
    assert torch.from_dlpack(capsules.pop()).tolist() == [1.0, 1.0, 1.0]
    del capsules
    gc.collect()
    assert alive() is None and not dlpack._anchors


# ---------------------------------------------------------------------- NumPy
def test_numpy_refuses_a_cuda_capsule_with_its_own_error():
    """``np.from_dlpack(t)`` (no device) reads the capsule's device and refuses CUDA, as with a
    GPU's capsule (a RuntimeError in NumPy 2.4, a BufferError later)."""
    t = torch.arange(3.0, device="cuda")
    with pytest.raises((RuntimeError, BufferError), match="Unsupported device in DLTensor"):
        np.from_dlpack(t)
    assert np.array_equal(np.from_dlpack(t, device="cpu"), [0.0, 1.0, 2.0])
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy:DeprecationWarning")  # (torch's)
@pytest.mark.parametrize("convert", [
    lambda t: t.numpy(), np.asarray, np.array, lambda t: np.stack([t, t]), lambda t: np.float32(t[0]),
], ids=["numpy", "asarray", "array", "stack", "scalar"])
def test_numpy_of_a_cuda_tensor_that_requires_grad_is_refused_for_its_device(convert):
    """torch checks the device before grad: a GPU's parameter gives the TypeError naming
    ``Tensor.cpu()``, not the RuntimeError naming ``detach()`` (code catching TypeError relies on it)."""
    p = torch.ones(2, device="cuda", requires_grad=True)
    with pytest.raises(TypeError, match=r"^can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu\(\) "
                                        "to copy the tensor to host memory first.$"):
        convert(p)
    assert np.array_equal(p.numpy(force=True), [1.0, 1.0])


def test_numpy_of_a_sparse_cuda_tensor_is_refused_for_its_layout():
    s = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2), device="cuda")
    refusal = r"^can't convert Sparse layout tensor to numpy. Use Tensor.to_dense\(\) first.$"
    for convert in (lambda t: t.numpy(), np.asarray, lambda t: t.numpy(force=True)):
        with pytest.raises(TypeError, match=refusal):
            convert(s)


# ---------------------------------------------------------------------- torch.asarray
def test_asarray_without_a_copy_refuses_another_device_in_torchs_words():
    """``torch.asarray(t, device=..., copy=False)`` of a 'cuda' tensor: an alias on its own
    device, torch's ValueError for another one. The CPU's named the wrapper's 'meta' device."""
    t = torch.arange(4.0, device="cuda")
    assert torch.asarray(t, device="cuda:0", copy=False) is t
    assert torch.asarray(t, copy=False) is t
    for device in ("cpu", "meta"):
        with pytest.raises(ValueError, match=f"^can't alias tensor from device 'cuda:0' to '{device}'.$"):
            torch.asarray(t, device=device, copy=False)
        with torch.device(device), pytest.raises(ValueError, match="^can't alias tensor from device 'cuda:0'"):
            torch.asarray(t, copy=False)
    c = torch.asarray(t, device="cpu")  # (a copy is allowed: the CPU's tensor)
    assert c.device == torch.device("cpu") and c.tolist() == [0.0, 1.0, 2.0, 3.0]


def _asarray_outcome(device: str, source: str, **kwargs: object) -> tuple:
    """What ``torch.asarray(src, device=device, **kwargs)`` gives: whether it is ``src`` itself
    and shares its memory, its requires_grad and leafness, ``src``'s requires_grad after (torch
    sets it on ``src`` when it is the result), or the error's type and words."""
    leaf = torch.arange(3.0, device=device).requires_grad_()
    src = {"leaf": leaf, "plain": torch.arange(3.0, device=device), "nonleaf": leaf * 1}[source]
    try:
        out = torch.asarray(src, device=device, **kwargs)
    except (ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    with torch.no_grad():
        out.view(-1)[0] = 7
    return (out is src, bool(src.detach()[0] == 7), out.dtype, out.requires_grad, out.is_leaf, src.requires_grad)


@pytest.mark.parametrize("source", ["leaf", "plain", "nonleaf"])
@pytest.mark.parametrize("copy", [None, True, False])
@pytest.mark.parametrize("dtype", [None, torch.float64])
@pytest.mark.parametrize("requires_grad", [None, False, True])
def test_asarray_onto_the_same_gpu_copies_and_sets_requires_grad_as_torch(source, copy, dtype, requires_grad):
    """``torch.asarray(t, device='cuda', ...)`` of a 'cuda' tensor, as torch's own asarray of a
    CPU tensor onto the CPU: ``copy=True`` gave ``t`` itself (writes to the "copy" changed
    ``t``), ``requires_grad=False`` neither detached a non-leaf nor cleared a leaf's flag, and
    another dtype with ``copy=False`` was converted where torch refuses."""
    kwargs = {k: v for k, v in (("copy", copy), ("dtype", dtype), ("requires_grad", requires_grad)) if v is not None}
    assert _asarray_outcome("cuda", source, **kwargs) == _asarray_outcome("cpu", source, **kwargs)
