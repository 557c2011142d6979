"""Everyday tensor idioms on 'cuda' that a notebook user types, answered as a GPU's PyTorch
answers them: tensors built from lists of scalar tensors, CPU tensors indexed with 'cuda'
indices, ``map_location`` callables that move storages, the legacy ``torch.cuda.FloatTensor``
types. Values are compared with the same code on the CPU."""
from __future__ import annotations

import copy
import io
import traceback
import warnings
import zipfile

import numpy as np
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.usefixtures("remote")


def test_a_list_of_scalar_tensors_becomes_a_tensor():
    """``torch.tensor([loss_a, loss_b])``: torch reads each element's value (the dtype promoted
    from theirs); with CPU tensors too while active, which C++ once took for sequences."""
    x = torch.arange(4.0, device="cuda")
    built = torch.tensor([x[0], x[3]])
    assert built.device.type == "cpu" and torch.equal(built, torch.tensor([0.0, 3.0]))
    on_cuda = torch.tensor([x[1], x[2]], device="cuda")
    assert on_cuda.is_cuda and torch.equal(on_cuda.cpu(), torch.tensor([1.0, 2.0]))
    mixed = [torch.tensor(2, dtype=torch.int32, device="cuda"), torch.tensor(1.5, dtype=torch.float16, device="cuda")]
    assert torch.tensor(mixed).dtype == torch.float16 and torch.as_tensor([[x[1]], [x[2]]]).shape == (2, 1)
    cpu = torch.tensor([torch.tensor(1.0), torch.tensor(2.0)])
    assert torch.equal(cpu, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="only one element tensors"):
        torch.tensor([torch.ones(2), torch.ones(2)])
    assert x[torch.tensor([1, 3])].tolist() == [1.0, 3.0] and x[[0, 2]].tolist() == [0.0, 2.0]


def test_a_cpu_tensor_indexed_with_cuda_indices():
    """Reading a CPU tensor at 'cuda' indices is refused, as PyTorch refuses it; writing there
    moves the indices to the CPU and changes the CPU tensor itself (it was uploaded and written
    on the gateway, and the write was lost)."""
    idx = torch.tensor([1, 3], device="cuda")
    with pytest.raises(RuntimeError, match=r"indices should be either on cpu or on the same device as the "
                                           r"indexed tensor \(cpu\)"):
        torch.arange(5.0)[idx]
    c = torch.zeros(5)
    c[idx] = 2.0
    c[torch.arange(5, device="cuda") == 4] = 7.0
    c[torch.tensor([0])] = torch.tensor(3.0, device="cuda")
    c.index_put_((torch.tensor([2, 2], device="cuda"),), torch.tensor(1.5), accumulate=True)
    assert c.tolist() == [3.0, 2.0, 3.0, 2.0, 7.0]
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        c[torch.tensor([0, 1])] = torch.ones(2, device="cuda")
    y = torch.zeros(4, 2, device="cuda")
    y[torch.tensor([0, 2])] += 1  # (a CPU index on a cuda tensor is fine)
    assert y.sum().item() == 4.0


@pytest.mark.parametrize("saved_on", ["cuda", "cpu"])
def test_map_location_callable_that_moves_storages_to_cuda(saved_on):
    """``torch.load(f, map_location=lambda storage, loc: storage.cuda())`` of older code loads
    every tensor on 'cuda', with its values."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save(model.to(saved_on).state_dict(), buf)
    for to_cuda in (lambda storage, loc: storage.cuda(), lambda storage, loc: storage.cuda(0)):
        buf.seek(0)
        back = torch.load(buf, map_location=to_cuda)
        assert all(v.is_cuda for v in back.values())
        torch.testing.assert_close({k: v.cpu() for k, v in back.items()}, want)
    moved = torch.ones(2).untyped_storage().cuda()  # (outside torch.load: a storage on the device, as on a GPU)
    assert moved.device == torch.device("cuda", 0) and moved.cuda() is moved and list(moved.cpu()) == list(
        torch.ones(2).untyped_storage())


def _saved_on_device_1() -> io.BytesIO:
    """A checkpoint as a second GPU writes it: its storage located on 'cuda:1'."""
    saved = io.BytesIO()
    torch.save({"w": torch.arange(3.0, device="cuda")}, saved)
    moved = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(saved.getvalue())) as zin, zipfile.ZipFile(moved, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            zout.writestr(info, data.replace(b"cuda:0", b"cuda:1") if info.filename.endswith("data.pkl") else data)
    moved.seek(0)
    return moved


@pytest.mark.parametrize("map_location", [{"cuda:1": "cuda:0"}, "cuda:0", {"cuda:1": "cpu"}])
def test_a_checkpoint_of_another_gpu_maps_to_this_one(map_location):
    back = torch.load(_saved_on_device_1(), map_location=map_location)["w"]
    where = map_location["cuda:1"] if isinstance(map_location, dict) else map_location
    assert back.device == torch.device(where)
    assert back.tolist() == [0.0, 1.0, 2.0]


def test_a_checkpoint_of_a_missing_gpu_says_to_use_map_location():
    with pytest.raises(RuntimeError, match="on CUDA device 1 but torch.cuda.device_count.. is 1. Please use torch.load "
                                           "with map_location"):
        torch.load(_saved_on_device_1())


def test_legacy_cuda_tensor_types_build_convert_and_match():
    """The PyTorch-GAN idiom: ``Tensor = torch.cuda.FloatTensor``, ``Tensor(n, 1).fill_(1.0)``,
    ``imgs.type(Tensor)``, and ``isinstance`` against the CUDA types."""
    Tensor = torch.cuda.FloatTensor
    valid = Tensor(4, 1).fill_(1.0)
    assert valid.is_cuda and valid.shape == (4, 1) and valid.dtype == torch.float32 and valid.sum().item() == 4.0
    assert torch.cuda.LongTensor([1, 2]).tolist() == [1, 2]
    assert torch.cuda.ByteTensor(torch.Size([2, 3])).shape == (2, 3)
    imgs = torch.arange(6, dtype=torch.uint8).reshape(2, 3)
    real = imgs.type(Tensor)
    assert real.is_cuda and real.dtype == torch.float32 and torch.equal(real.cpu(), imgs.float())
    assert imgs.type("torch.cuda.DoubleTensor").dtype == torch.float64 and imgs.type(torch.float16).device.type == "cpu"
    assert isinstance(real, torch.cuda.FloatTensor) and not isinstance(real, torch.cuda.LongTensor)
    assert not isinstance(imgs, torch.cuda.ByteTensor) and isinstance(imgs, torch.ByteTensor)
    assert real.type() == "torch.cuda.FloatTensor" and real.type(torch.cuda.LongTensor).dtype == torch.int64
    with pytest.raises(TypeError, match="expected torch.cuda.FloatTensor"):
        Tensor(torch.ones(2))


def test_legacy_new_from_data_keeps_the_data():
    """``x.new([1, 2])`` is a tensor of x's dtype on x's device holding the data (it was a meta
    tensor: the data lost); ``x.new(2, 3)`` and ``x.new(torch.Size(...))`` are sizes."""
    x = torch.zeros(2, dtype=torch.int32, device="cuda")
    made = x.new([1.7, 2])
    assert made.is_cuda and made.dtype == torch.int32 and made.tolist() == [1, 2]
    assert x.new((3.5,)).tolist() == [3] and x.new(2, 3).shape == (2, 3) and x.new(torch.Size([4])).shape == (4,)
    assert x.new(2, 3).is_cuda and x.new().shape == (0,)


def test_set_default_tensor_type_to_a_cuda_type():
    """nerf-pytorch's ``torch.set_default_tensor_type('torch.cuda.FloatTensor')``: factories and
    modules are made on 'cuda' with its dtype; a CPU type makes the CPU the default again."""
    try:
        with warnings.catch_warnings():  # (deprecated, and said once per process: test_traps.py may have)
            warnings.simplefilter("ignore", UserWarning)
            torch.set_default_tensor_type("torch.cuda.FloatTensor")
        assert torch.ones(2).is_cuda and torch.tensor([1.0]).is_cuda and nn.Linear(2, 2).weight.is_cuda
        big = torch.Tensor([1e10])  # (nerf-pytorch's raw2outputs, then cat with cuda distances)
        assert big.is_cuda and big.tolist() == [1e10] and torch.Tensor(2, 3).is_cuda
        assert torch.FloatTensor([1.0]).device.type == "cpu"
        torch.set_default_tensor_type(torch.cuda.DoubleTensor)
        assert torch.zeros(1).dtype == torch.float64 and torch.zeros(1).is_cuda
        with pytest.raises(TypeError, match="only floating-point types"):
            torch.set_default_tensor_type(torch.cuda.LongTensor)
    finally:
        torch.set_default_tensor_type(torch.FloatTensor)
    assert torch.ones(2).device.type == "cpu" and torch.ones(2).dtype == torch.float32
    assert torch.Tensor([1.0]).device.type == "cpu"
    torch.set_default_device("cuda")  # a device set apart from the type stays, as torch keeps it
    try:
        torch.set_default_tensor_type(torch.FloatTensor)
        assert torch.ones(1).is_cuda and torch.Tensor([1.0]).device.type == "cpu"
    finally:
        torch.set_default_device(None)


def test_numpy_force_copies_to_the_host():
    """``t.numpy(force=True)`` is ``t.detach().cpu().resolve_conj().resolve_neg().numpy()``, on a GPU too."""
    w = torch.tensor([1.0, 2.0], device="cuda", requires_grad=True)
    assert w.numpy(force=True).tolist() == [1.0, 2.0]
    assert torch.tensor([1 + 2j], device="cuda").conj().numpy(force=True).tolist() == [1 - 2j]
    with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
        w.detach().numpy()


def _index_programs() -> list:
    """Indices made of Python sequences, read and written (each on a fresh copy)."""
    def write(idx: object, value: object = -1.0):
        def go(x: torch.Tensor) -> torch.Tensor:
            y = x.clone()
            y[idx] = value
            return y
        return go
    return [lambda x: x[range(2)], lambda x: x[:, range(1, 3)], lambda x: x[(0, 2), :], lambda x: x[[1.0]],
            lambda x: x[[[0, 2], [1, 3]]], lambda x: x[[slice(None), 1]], lambda x: x[[None, 1]],
            lambda x: x[[Ellipsis, 1]], lambda x: x[[torch.tensor([0, 2]), torch.tensor([1, 3])]],
            lambda x: x[[True, False, True]], lambda x: x[[[0], [2]], [1, 3]],
            write(range(2)), write(((0, 2), slice(None))), write([[0, 2], [1, 3]]), write([1, 2], 5.0)]


@pytest.mark.parametrize("k", range(len(_index_programs())))
def test_python_sequences_in_an_index_read_as_torch_reads_them(k):
    """Ranges, tuples inside a tuple, lists of lists, lists holding slices or tensors: torch's own
    reading (several dimensions, or one index tensor), where they became meta index tensors (lost)
    or one index tensor of the wrong shape."""
    fn = _index_programs()[k]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's deprecation of lists read as tuples: below)
        got, want = fn(torch.arange(12.0, device="cuda").reshape(3, 4)), fn(torch.arange(12.0).reshape(3, 4))
    torch.testing.assert_close(got.cpu(), want)


def test_index_warnings_and_refusals_name_what_torch_names():
    y = torch.zeros(3, 4, device="cuda")
    with pytest.warns(UserWarning, match="non-tuple sequence for multidimensional indexing") as caught:
        y[[[0, 2], [1, 3]]]
    assert caught[0].filename == __file__
    with pytest.raises(TypeError, match=r"can't assign a list to a torch\.cuda\.FloatTensor"):
        y[0] = [1.0] * 4
    with pytest.raises(TypeError, match=r"can't assign a numpy\.ndarray to a torch\.cuda\.FloatTensor"):
        y[torch.tensor([0])] = np.ones(4)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.bool])
def test_large_tensors_of_every_dtype_print_their_edge_items(dtype):
    """A tensor too large to print whole prints its edge items (the CPU's index_put_, which places
    them, takes no unsigned 16-64 bit type: printing one raised)."""
    cpu = (torch.arange(3000) % 7).to(dtype)
    assert " ".join(repr(cpu.cuda()).replace(", device='cuda:0'", "").split()) == " ".join(repr(cpu).split())


def test_a_device_mismatch_is_a_runtime_error_by_name():
    """The most searched-for PyTorch error reads as a GPU prints it: ``RuntimeError: Expected all
    tensors to be on the same device, ...`` (the traceback named remotecuda.dispatch.DeviceMismatch)."""
    try:
        torch.ones(2, device="cuda") + torch.ones(2)
    except RuntimeError as e:
        shown = traceback.format_exception_only(type(e), e)[-1]
    assert shown == ("RuntimeError: Expected all tensors to be on the same device, but found at least two devices, "
                     "cuda:0 and cpu!\n")


def test_an_rnn_with_state_or_input_left_on_the_cpu_names_the_devices():
    """A forgotten ``h0.to(device)``: torch's message, naming cuda:0 (it named the wrappers' meta)."""
    lstm = nn.LSTM(3, 4).cuda()
    h0 = (torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(RuntimeError, match=r"^Input and hidden tensors are not at the same device, found input "
                                           r"tensor at cuda:0 and hidden tensor at cpu$"):
        lstm(torch.ones(2, 1, 3, device="cuda"), h0)
    with pytest.raises(RuntimeError, match=r"^Input and parameter tensors are not at the same device, found input "
                                           r"tensor at cpu and parameter tensor at cuda:0$"):
        nn.GRU(3, 4).cuda()(torch.ones(2, 1, 3))
    out, _ = lstm(torch.ones(2, 1, 3, device="cuda"), tuple(h.cuda() for h in h0))
    assert out.is_cuda


def test_deepcopy_keeps_views_together_and_refuses_non_leaves():
    """torch's deepcopy: tensors viewing one storage, deepcopied together, view one copy; a
    non-leaf is refused (it was copied, with a warning about .grad)."""
    x = torch.arange(4.0, device="cuda")
    copied = copy.deepcopy({"rows": x[1:], "all": x, "col": x.view(2, 2)[:, 1]})
    copied["all"][1] = 100.0
    assert copied["rows"][0].item() == 100.0 and copied["col"].tolist() == [100.0, 3.0] and x[1].item() == 1.0
    w = torch.ones(2, device="cuda", requires_grad=True)
    with pytest.raises(RuntimeError, match=r"Only Tensors created explicitly by the user \(graph leaves\)"):
        copy.deepcopy(w * 2)
    assert copy.deepcopy(w).requires_grad and copy.deepcopy(w).is_leaf


@pytest.mark.parametrize("mistake", [
    lambda y: y.__setitem__(torch.tensor([0], device="cuda"), torch.ones(1, 3, dtype=torch.int64, device="cuda")),
    lambda y: y.index_select(0, torch.tensor([0.0], device="cuda")),
    lambda y: torch.nn.functional.cross_entropy(y, torch.tensor([0, 1], dtype=torch.int32, device="cuda")),
    lambda y: torch.softmax(y.long(), 0)])
def test_dtype_mistakes_are_raised_at_the_call(mistake):
    """As README says and a GPU does: a dtype its kernels refuse fails at the call, not at a later
    sync (the meta kernels pass these)."""
    y = torch.zeros(2, 3, device="cuda")
    with pytest.raises((RuntimeError, NotImplementedError)):
        mistake(y)
    torch.cuda.synchronize()  # (nothing left pending)


def test_new_tensor_from_a_tensor_warns_at_the_users_line():
    """``x.new_tensor(t)`` warns as torch does, naming the caller's line (it was silent)."""
    x = torch.zeros(2, device="cuda")
    with pytest.warns(UserWarning, match=r"rather than tensor\.new_tensor\(sourceTensor\)") as caught:
        made = x.new_tensor(torch.ones(2))
    assert caught[0].filename == __file__ and made.is_cuda and made.tolist() == [1.0, 1.0]


def test_a_gradient_from_another_device_is_refused_naming_cuda():
    w = torch.zeros(2, device="cuda", requires_grad=True)
    with pytest.raises(RuntimeError, match=r"^attempting to assign a gradient with device type 'cpu' to a tensor "
                                           r"with device type 'cuda'\. Please ensure"):
        w.grad = torch.ones(2)
    w.grad = torch.ones(2, device="cuda")
    assert w.grad.tolist() == [1.0, 1.0]
    del w.grad
    assert w.grad is None


def test_the_deprecated_torch_range_makes_cuda_tensors():
    """Old code's ``torch.range(..., device='cuda')`` (end included) warns as on a GPU and makes the
    same values; it raised 'PyTorch is not linked with support for cuda devices'."""
    with pytest.warns(UserWarning, match="torch.range is deprecated"):
        made = [torch.range(0, 3, device="cuda"), torch.range(1, 2, 0.25, device=0, dtype=torch.float64),
                torch.range(0, 1, 0.5, device="cuda", requires_grad=True)]
    with torch.device("cuda"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made.append(torch.range(-2, 2, 2))
    assert all(t.is_cuda for t in made) and made[2].is_leaf and made[2].requires_grad
    assert [t.tolist() for t in made] == [[0.0, 1.0, 2.0, 3.0], [1.0, 1.25, 1.5, 1.75, 2.0], [0.0, 0.5, 1.0],
                                          [-2.0, 0.0, 2.0]]
    assert made[1].dtype == torch.float64


@pytest.mark.parametrize("call", [lambda t: t.apply_(lambda v: v * 2), lambda t: t.map_(t, lambda a, b: a + b),
                                  lambda t: t.map2_(t, t, lambda a, b, c: a + b + c)])
def test_python_functions_per_element_are_cpu_only_as_on_a_gpu(call):
    """``apply_`` on a 'cuda' tensor raised nothing and left its values unchanged (C++ skips a meta
    tensor); a GPU's torch raises TypeError, as it does for ``map_``/``map2_``."""
    t = torch.ones(3, device="cuda")
    with pytest.raises(TypeError, match=r"^(apply_|map_|map2_) is only implemented on CPU tensors$"):
        call(t)
    assert t.tolist() == [1.0, 1.0, 1.0] and call(torch.ones(3)).tolist() != [1.0, 1.0, 1.0]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_views_storage_is_its_bases_on_the_tensors_device(device):
    """``untyped_storage()`` of a 'cuda' tensor said 'meta', and a view's was an object of its own
    spanning only the view: transformers' ``id_tensor_storage`` told a view from its base."""
    from transformers.pytorch_utils import id_tensor_storage
    x = torch.arange(10.0, device=device)
    head, tail = x[:2], x[3:]
    s = x.untyped_storage()
    assert s.device == x.device and s.is_cuda == (device == "cuda") and s.nbytes() == 40
    assert head.untyped_storage()._cdata == tail.untyped_storage()._cdata == s._cdata
    assert head.untyped_storage().data_ptr() == s.data_ptr() and head.untyped_storage().nbytes() == 40
    assert id_tensor_storage(head) == id_tensor_storage(x) != id_tensor_storage(x.clone())


def test_a_byte_mask_fill_is_refused_at_the_call_as_torch_does():
    """``x[uint8_mask] = 0`` takes ``masked_fill_``, whose kernels refuse a byte mask (on a GPU
    too, at the call); on 'cuda' the meta kernel passed it and the error came at the next sync."""
    for device in ("cpu", "cuda"):
        x = torch.arange(4.0, device=device)
        mask = torch.tensor([1, 0, 1, 0], dtype=torch.uint8, device=device)
        with pytest.raises(RuntimeError, match="^masked_fill_ only supports boolean masks"):
            x[mask] = 0
        with pytest.raises(RuntimeError, match="^masked_fill_ only supports boolean masks"):
            x.masked_fill(mask, 1.0)
        x[mask.bool()] = 0
        assert x.tolist() == [0.0, 1.0, 0.0, 3.0]


def test_a_byte_mask_index_warns_as_torch_does():
    """``x[mask]`` with a uint8 mask: torch's index kernel warns that it is deprecated, which on
    'cuda' ran on the gateway and was not seen."""
    x = torch.arange(4.0, device="cuda")
    with pytest.warns(UserWarning, match="indexing with dtype torch.uint8 is now deprecated") as caught:
        got = x[torch.tensor([1, 0, 1, 0], dtype=torch.uint8, device="cuda")]
    assert caught[0].filename == __file__ and got.tolist() == [0.0, 2.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert x[x > 1].tolist() == [2.0, 3.0]
