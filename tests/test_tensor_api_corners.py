"""Corners of the Tensor API on 'cuda' that real code meets: a tensor subclass's
``__torch_function__`` on the Tensor methods remotecuda routes itself, a library that copies a
tensor's whole ``__dict__`` (MONAI's ``MetaTensor``), torch's deepcopy of a plain subclass, and
``out=`` tensors of ops whose output size depends on the data. Each is compared with the same
code on the local CPU."""
from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

pytestmark = pytest.mark.usefixtures("remote")


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.cpu().tolist()


def _data_dependent_outs(dev: str) -> list:
    m = torch.tensor([[1., 0, 2], [0, 3, 0]], device=dev)
    got = []
    for out in (torch.empty(0, dtype=torch.long, device=dev), torch.empty(7, 2, dtype=torch.long, device=dev)):
        assert torch.nonzero(m, out=out) is out
        got.append(_layout(out))
    for out in (torch.empty(0, device=dev), torch.empty(5, device=dev)):
        assert torch.masked_select(m, m > 0, out=out) is out
        got.append(_layout(out))
    out = torch.empty(0, dtype=torch.long, device=dev)
    torch.nonzero(m.t(), out=out)
    got.append(_layout(out))
    return got


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_out_of_a_data_dependent_op_takes_the_size_the_data_gives():
    """``torch.nonzero(m, out=o)``, ``torch.masked_select(x, mask, out=o)``: the gateway resized
    ``o`` to the op's result, but the client's tensor kept its old shape (``(0,)``, or the wrong
    size it was given), so ``o.shape`` was wrong while its values were the result's."""
    assert _data_dependent_outs("cuda") == _data_dependent_outs("cpu")


class Logged(torch.Tensor):
    """A tagged tensor whose ``__torch_function__`` records what it is called with, as a units
    library's or MONAI's hook dispatches on the function."""

    seen: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", repr(func)))
        return super().__torch_function__(func, types, args, kwargs)


def _routed_methods(dev: str) -> list:
    base = torch.arange(6.).reshape(2, 3)
    calls = {
        "copy_": lambda t: t.copy_(torch.ones(2, 3, device=dev)),
        "new_zeros": lambda t: t.new_zeros(3),
        "new_full": lambda t: t.new_full((2,), 5.),
        "new_tensor": lambda t: t.new_tensor([1., 2.]),
        "new": lambda t: t.new(2),
        "__setitem__": lambda t: t.__setitem__(0, 7.),
        "type_as": lambda t: t.type_as(torch.ones(1, dtype=torch.float64, device=dev)),
        "to": lambda t: t.to(torch.float16),
    }
    got = []
    for name, call in calls.items():
        t = base.clone().to(dev).as_subclass(Logged)
        Logged.seen = []
        r = call(t)
        got.append((name, type(r).__name__, list(Logged.seen), t.as_subclass(torch.Tensor).cpu().tolist()))
    return got


def test_a_subclass_hook_sees_the_routed_tensor_methods_as_on_the_cpu():
    """Tensor methods remotecuda routes in Python (``new_tensor``, ``type_as``, ``__setitem__``...)
    skipped the ``__torch_function__`` of a subclass, which torch's C++ method calls first:
    ``sub.new_tensor(data)`` was a plain tensor, ``type_as`` reached the hook as ``to``, and the
    hook saw the routes' own reads (``dtype``) as calls of its own."""
    assert _routed_methods("cuda") == _routed_methods("cpu")


class Meta(torch.Tensor):
    """MONAI's ``MetaObj.copy_meta_from`` pattern: an op's result gets its input's whole
    ``__dict__``, deep-copied item by item, or (for a batch) the dictionary replaced."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        first = next((a for a in args if isinstance(a, Meta)), None)
        if isinstance(out, Meta) and first is not None:
            source = first.__dict__
            names = source.keys()  # (as MONAI reads them)
            if source.get("batch"):
                out.__dict__ = {k: source[k] for k in names}
            else:
                out.__dict__.update({k: copy.deepcopy(source[k]) for k in names})
        return out


def _dict_copied(dev: str) -> list:
    got = []
    for batch in (False, True):
        m = torch.arange(6.).reshape(2, 3).to(dev).as_subclass(Meta)
        m.batch, m.affine = batch, [1, 2]
        y = (m * 2 + 1).sum(0)
        got.append((type(y).__name__, sorted(vars(y)), y.affine, y.as_subclass(torch.Tensor).cpu().tolist(),
                    m.as_subclass(torch.Tensor).cpu().tolist()))
    return got


def test_a_subclass_that_copies_a_tensors_whole_dict_keeps_its_own_values():
    """A library's hook copying its input's ``__dict__`` onto an op's result copied remotecuda's
    own state too: deep-copying it failed ("cannot pickle '_thread.lock' object"), and replacing
    the result's dictionary made it stand for its input's gateway tensor (its input's values)."""
    assert _dict_copied("cuda") == _dict_copied("cpu")


def test_swapping_two_cuda_subclass_tensors_swaps_their_values():
    """``torch.utils.swap_tensors`` (``module.to`` with swapping on) swaps the classes, then the
    dictionaries: a subclass tensor's dictionary, which keeps remotecuda's state out of sight,
    must still move whole."""
    a = torch.zeros(2, device="cuda").as_subclass(Meta)
    b = torch.ones(3, device="cuda").as_subclass(Meta)
    a.tag, b.tag = "a", "b"
    torch.utils.swap_tensors(a, b)
    assert (a.tag, a.shape, a.as_subclass(torch.Tensor).cpu().tolist()) == ("b", (3,), [1., 1., 1.])
    assert (b.tag, b.shape, b.as_subclass(torch.Tensor).cpu().tolist()) == ("a", (2,), [0., 0.])


class Plain(torch.Tensor):
    pass


class Built(torch.Tensor):
    def new_empty(self, *args, **kwargs):
        return super().new_empty(*args, **kwargs).as_subclass(type(self))


def _deepcopies(dev: str) -> list:
    got = []
    for cls in (Plain, Built):
        t = torch.arange(3.).to(dev).as_subclass(cls)
        t.tag = "kept"
        try:
            c = copy.deepcopy(t)
        except RuntimeError as e:
            got.append(("RuntimeError", str(e)))
        else:
            got.append((type(c).__name__, c.tag, c.as_subclass(torch.Tensor).cpu().tolist()))
    return got


def test_deepcopy_of_a_plain_subclass_is_refused_as_torch_refuses_it():
    """torch deep-copies a subclass that defines no ``__deepcopy__`` with its ``new_empty``, and
    refuses one whose ``new_empty`` gives another class; on 'cuda' such a copy was made anyway."""
    got, want = _deepcopies("cuda"), _deepcopies("cpu")
    assert got == want and want[0][0] == "RuntimeError" and want[1][0] == "Built"


class TaggedParameter(torch.nn.Parameter):
    """A subclass of nn.Parameter (diffusers' GGUFParameter, a user's), with Parameter's ``__new__``."""


def _converted_parameters(dev: str) -> list:
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    lin.weight = TaggedParameter(lin.weight.detach())
    lin.weight.tag, lin.bias._no_weight_decay = "w", True
    got = []
    for step in (lambda m: m.to(dev), lambda m: m.to(dev, torch.float64), lambda m: m.cpu().to(dev)):
        step(lin)
        w, b = lin.weight, lin.bias
        got.append((type(w).__name__, isinstance(w, TaggedParameter), isinstance(w, torch.nn.Parameter),
                    getattr(w, "tag", None), getattr(b, "_no_weight_decay", None), w.dtype))
        assert w.device.type == b.device.type == dev
    made = TaggedParameter(torch.ones(2, device=dev))
    lin(torch.ones(1, 3, device=dev, dtype=torch.float64)).sum().backward()
    got.append((type(made).__name__, made.requires_grad, made.is_leaf, lin.weight.grad.cpu().tolist()))
    return got


def test_a_parameters_class_and_attributes_survive_a_move_to_cuda():
    """``model.to('cuda')`` kept neither a parameter's subclass of nn.Parameter nor its
    attributes (``p._no_weight_decay``, read later to group an optimizer's parameters): on a GPU
    each parameter stays its object (``param.data = ...``), but the conversion here swaps each for
    a new Parameter. And ``SubParameter(cuda_tensor)`` was a plain Parameter."""
    assert _converted_parameters("cuda") == _converted_parameters("cpu")


def test_monai_meta_tensor_on_cuda():
    """MONAI's MetaTensor on 'cuda': its ops and transforms, a collated batch (whose ops replace
    the result's ``__dict__``), deepcopy and pickling, compared with the CPU."""
    pytest.importorskip("monai")
    assert _monai("cuda") == _monai("cpu")


def _monai(dev: str) -> list:
    import pickle

    import monai.transforms as T
    from monai.data import MetaTensor, decollate_batch, list_data_collate

    x = MetaTensor(torch.arange(12.).reshape(1, 3, 4), affine=torch.eye(4), meta={"filename_or_obj": "a.nii"})
    m = x.to(dev)

    def seen(t: torch.Tensor) -> tuple:
        return type(t).__name__, tuple(t.shape), t.meta.get("filename_or_obj"), t.as_tensor().cpu().tolist()

    got = [seen(m + 1), seen(m[0]), seen(copy.deepcopy(m)), seen(pickle.loads(pickle.dumps(m))),
           seen(T.Flip(spatial_axis=0)(m)), seen(T.ScaleIntensity()(m)), seen(T.Resize((6, 8))(m))]
    batch = list_data_collate([{"img": x}, {"img": x * 2}])["img"].to(dev)  # (collated on the CPU, as loaders do)
    got += [seen(batch * 3 - batch), batch.is_batch, [seen(t) for t in decollate_batch(batch + 1)]]
    return got


def test_matrix_rank_writes_its_out_tensor():
    """``linalg.matrix_rank(..., out=o)``: ATen's composite takes its tensor-subclass branch for a
    remote matrix, which leaves ``o`` unwritten (uninitialized memory, silently); a GPU's writes it."""
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    a[:, 0] = a[:, 1]
    for dtype, shape in ((torch.long, ()), (torch.float64, (0,)), (torch.long, (2,))):
        local, remote = torch.full(shape, 7, dtype=dtype), torch.full(shape, 7, dtype=dtype, device="cuda")
        with pytest.warns(UserWarning) if shape == (2,) else _no_warning():  # (a non-empty out resized)
            got = torch.linalg.matrix_rank(a.cuda(), out=remote)
            remote.cpu()
        assert got is remote and torch.linalg.matrix_rank(a, out=local) is local
        assert _layout(remote) == _layout(local) and remote.dtype == local.dtype and local.item() == 3


def test_a_factory_with_a_device_and_an_out_tensor():
    """``torch.zeros(3, device='cuda', out=o)``: C++ compares the device's type with the out
    tensor's, which is meta on the client ('device type cuda does not match ... (meta)')."""
    for make in (lambda d, o: torch.zeros(3, device=d, out=o), lambda d, o: torch.arange(3.0, device=d, out=o),
                 lambda d, o: torch.linspace(0, 1, 3, device=d, out=o), lambda d, o: torch.full((3,), 2.0, device=d,
                                                                                          out=o)):
        local, remote = torch.empty(3), torch.empty(3, device="cuda")
        assert make("cuda:0", remote) is remote
        assert remote.cpu().tolist() == make("cpu", local).tolist()
    with pytest.raises(RuntimeError, match=r"^device type cpu does not match device type of out parameter \(cuda\)$"):
        torch.zeros(3, device="cpu", out=torch.empty(3, device="cuda"))


@contextlib.contextmanager
def _no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield
