"""Third-party libraries' code on 'cuda', unchanged (kornia, torchdiffeq, torch_geometric): the
failures found running them, each shown with torch alone where it can be, and compared with the
same code on the local CPU."""
from __future__ import annotations

import inspect
import textwrap

import pytest
import torch
from torch.utils._pytree import tree_map

from conftest import run_python


class Wrap(torch.Tensor):
    """A tensor subclass holding a plain tensor, made on the device of the tensor it holds, as
    PyG's EdgeIndex, Index and HashTensor are (``device=data.device``)."""

    @staticmethod
    def __new__(cls, data):
        out = torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(), dtype=data.dtype,
                                                  device=data.device, requires_grad=data.requires_grad)
        out._data = data
        return out

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, size, stride):
        return Wrap(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t._data if isinstance(t, Wrap) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrap(t) if isinstance(t, torch.Tensor) and not isinstance(t, Wrap) else t, out)


def _wrapper_ops(dev: str) -> list[torch.Tensor]:
    w = Wrap(torch.arange(12.).reshape(3, 4).to(dev))
    w[1] = 7.
    picked = [w[0], w[:, 1], w[torch.tensor([2, 0], device=dev)], w @ torch.ones(4, 2, device=dev), torch.cat([w, w])]
    return [p._data if isinstance(p, Wrap) else p for p in picked]


def test_a_wrapper_subclass_over_a_cuda_tensor_is_on_cuda_and_indexes(remote):
    """A wrapper made with ``device=data.device`` of a 'cuda' tensor was a C++ tensor on 'cuda',
    which a CPU-only torch's indexing refused ("PyTorch is not linked with support for cuda
    devices") at ``w[0]``, as PyG's ``edge_index[0]`` (GCNConv's self loops) over an EdgeIndex."""
    w = Wrap(torch.zeros(2, 3).cuda())
    assert (w.device, w.is_cuda, w.is_meta, w.get_device()) == (torch.device("cuda", 0), True, False, 0)
    assert w.type() == "torch.cuda.FloatTensor"  # (not 'torch.meta.FloatTensor')
    for got, want in zip(_wrapper_ops("cuda"), _wrapper_ops("cpu"), strict=True):
        assert got.device.type == "cuda"
        torch.testing.assert_close(got.cpu(), want)


def test_a_wrapper_subclass_that_requires_grad_on_cuda_trains(gateway):
    """Autograd recording such a wrapper that requires grad aborted the whole process (C++'s
    ``InputMetadata`` asks the 'cuda' device guard, which a CPU-only torch lacks); run in a fresh
    interpreter, so that the abort fails this test and not the run."""
    code = "import torch\nfrom torch.utils._pytree import tree_map\n" + inspect.getsource(Wrap) + textwrap.dedent('''
        import remotecuda
        remotecuda.activate()

        def step(dev):
            w = Wrap(torch.linspace(-1, 1, 6).reshape(2, 3).to(dev).requires_grad_())
            loss = (w * torch.tensor([1., 2., 3.], device=dev)).sin().sum()
            loss.backward()
            return loss.detach().cpu(), w.grad._data.cpu() if isinstance(w.grad, Wrap) else w.grad.cpu()

        (l1, g1), (l2, g2) = step("cpu"), step("cuda")
        torch.testing.assert_close(l2, l1)
        torch.testing.assert_close(g2, g1)
        print("OK")
    ''')
    r = run_python(code, env={"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_FALLBACK": "error"})
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_pyg_edge_index_and_hash_tensor_on_cuda(remote):
    """PyG's own wrapper subclasses on 'cuda': GCNConv and SAGEConv over a sorted ``EdgeIndex``
    (its self loops index it), and a ``HashTensor`` looked up by keys."""
    pyg = pytest.importorskip("torch_geometric")
    from torch_geometric.nn import GCNConv, SAGEConv

    g = torch.Generator().manual_seed(0)
    x0, ei = torch.randn(12, 5, generator=g), torch.randint(12, (2, 40), generator=g)

    def run(dev: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        m1, m2 = GCNConv(5, 3).to(dev), SAGEConv(5, 3).to(dev)
        edges = pyg.EdgeIndex(ei, sparse_size=(12, 12)).sort_by("col")[0].to(dev)
        x = x0.to(dev).requires_grad_()
        out = m1(x, edges) + m2(x, edges)
        out.pow(2).sum().backward()
        table = pyg.HashTensor(torch.tensor([10, 20, 5], device=dev), x0[:3].to(dev))
        found = table[torch.tensor([5, 10], device=dev)]
        return [out, x.grad, *(p.grad for p in [*m1.parameters(), *m2.parameters()]), found.as_tensor()
                if isinstance(found, pyg.HashTensor) else found]

    for got, want in zip(run("cuda"), run("cpu"), strict=True):
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=1e-4, atol=1e-5)


class Sub(torch.Tensor):
    """A plain subclass, as fastai's TensorBase: results of its ops stay in it."""


class Unwrapping(torch.Tensor):
    """torchvision's tv_tensors pattern: most ops give plain tensors, a few keep the subclass."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        keep = func in (torch.Tensor.clone, torch.Tensor.to, torch.Tensor.detach)
        return out.as_subclass(cls) if keep and isinstance(out, torch.Tensor) else out


def _plain_subclasses(dev: str) -> tuple[list[str], list[torch.Tensor]]:
    x = torch.arange(6.).reshape(2, 3).to(dev).requires_grad_()
    s = x.as_subclass(Sub)
    u = torch.ones(3, device=dev).as_subclass(Unwrapping)
    w = torch.Tensor._make_subclass(Sub, torch.linspace(0, 1, 6, device=dev).reshape(2, 3), True)
    results = [s * 2, s[0], s.cpu(), u.clone(), u * 2, u.to(torch.float64), w @ torch.ones(3, device=dev)]
    (s * s).sum().backward()
    (w @ torch.ones(3, device=dev)).sum().backward()
    names = [type(r).__name__ for r in results] + [r.device.type for r in results]
    return names, [x.grad, w.grad, *(r.as_subclass(torch.Tensor) for r in results)]


def test_plain_subclasses_of_a_cuda_tensor(remote):
    """``x.as_subclass(Sub)`` and ``Tensor._make_subclass(Sub, x)`` of a 'cuda' tensor raised
    "the raw Tensor object is already associated to a python object of type Tensor": the new
    object is now a ``Sub`` that is remote, whose ops keep (or drop) the subclass as ``Sub``'s
    ``__torch_function__`` says, and whose result moved to the CPU is a plain ``Sub``."""
    (names, got), (cpu_names, want) = _plain_subclasses("cuda"), _plain_subclasses("cpu")
    n = len(names) // 2
    assert names[:n] == cpu_names[:n] == ["Sub", "Sub", "Sub", "Unwrapping", "Tensor", "Unwrapping", "Sub"]
    assert names[n:] == ["cuda", "cuda", "cpu", "cuda", "cuda", "cuda", "cuda"]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.detach().cpu(), w.detach())
    s = torch.zeros(2).cuda().as_subclass(Sub)
    assert isinstance(s, Sub) and type(s).__name__ == "Sub" and s.is_cuda
    assert type(s.as_subclass(torch.Tensor)).__name__ == "Tensor"


def test_a_plain_subclass_of_a_cuda_tensor_saves_pickles_and_prints(remote):
    """Such a tensor is saved as torch saves a subclass (``torch.save`` and pickling kept neither
    the class nor its attributes), and prints as one (its repr formatted ``Sub`` elements)."""
    import io
    import pickle

    s = torch.arange(3.).cuda().as_subclass(Sub)
    s.tag = "kept"
    buf = io.BytesIO()
    torch.save({"s": s}, buf)
    buf.seek(0)
    for back in (torch.load(buf, weights_only=False)["s"], pickle.loads(pickle.dumps(s))):
        assert isinstance(back, Sub) and back.is_cuda and back.tag == "kept"
        torch.testing.assert_close(back.cpu().as_subclass(torch.Tensor), torch.arange(3.))
    assert repr(s) == "Sub([0., 1., 2.], device='cuda:0')"



class Tagged(torch.Tensor):
    """A plain subclass keeping its state under an underscored name, as MONAI's ``MetaTensor``
    (``_meta``) does; ``new_empty`` in the class, which torch's deepcopy of a subclass needs."""

    def new_empty(self, *args, **kwargs):
        return super().new_empty(*args, **kwargs).as_subclass(type(self))


def _tagged(t: torch.Tensor, n: int) -> torch.Tensor:
    t._meta, t.tag = {"affine": [n, 2]}, f"t{n}"
    return t


def _attributes(t: torch.Tensor) -> tuple:
    """What a copy kept: its class, whether it is a Parameter, and its attributes (its device apart)."""
    return (isinstance(t, Tagged), isinstance(t, torch.nn.Parameter), t.grad is None,
            {k: v for k, v in vars(t).items() if k in ("_meta", "tag")})


def _saved_and_copied(t: torch.Tensor) -> tuple[dict[str, tuple], set[str]]:
    """``t`` through torch.save and torch.load, pickling and deepcopy: what each copy kept, and the
    copies' devices."""
    import copy
    import io
    import pickle

    buf = io.BytesIO()
    torch.save({"t": t}, buf)
    buf.seek(0)
    copies = {"save": torch.load(buf, weights_only=False)["t"], "pickle": pickle.loads(pickle.dumps(t)),
              "deepcopy": copy.deepcopy(t)}
    return {k: _attributes(c) for k, c in copies.items()}, {c.device.type for c in copies.values()}


def _underscored_attributes(dev: str) -> tuple[dict[str, tuple], set[str]]:
    got, devices = _saved_and_copied(_tagged(torch.arange(3.).to(dev).as_subclass(Tagged), 0))
    p = _tagged(torch.nn.Parameter(torch.zeros(3)), 1)
    p.data = torch.ones(3, device=dev)
    got["parameter.data"] = _attributes(p)
    return got, devices | {p.device.type}


def test_a_subclass_keeps_its_underscored_attributes_on_cuda(remote):
    """A subclass's attributes whose names start with ``_`` (MONAI's ``MetaTensor._meta``) were
    dropped by torch.save, pickling, deepcopy and ``p.data = x.cuda()``, which kept only the public
    ones (remotecuda's own state is underscored too): torch keeps them all."""
    (got, devices), (want, _) = _underscored_attributes("cuda"), _underscored_attributes("cpu")
    assert got == want and devices == {"cuda"}
    assert want["save"][3] == {"_meta": {"affine": [0, 2]}, "tag": "t0"}


def _parameters_and_data_setter(dev: str) -> tuple[dict[str, tuple], set[str]]:
    p = _tagged(torch.nn.Parameter(torch.zeros(3, device=dev)), 1)
    p.grad = torch.ones(3, device=dev)
    got, devices = _saved_and_copied(p)
    s = _tagged(torch.zeros(3).as_subclass(Tagged), 2)
    s.data = torch.ones(3, device=dev)
    got["subclass.data"] = _attributes(s)
    return got, devices | {s.device.type}


def test_a_cuda_parameter_saves_and_copies_as_torchs(remote):
    """A 'cuda' Parameter was pickled and saved without its attributes (torch's Parameter keeps
    them), and deepcopied with them and its grad (torch's new Parameter of a clone has neither);
    ``sub.data = x.cuda()`` made a subclass's tensor a plain one."""
    (got, devices), (want, _) = _parameters_and_data_setter("cuda"), _parameters_and_data_setter("cpu")
    assert got == want and devices == {"cuda"}


class Carrying(torch.Tensor):
    """MONAI's MetaTensor pattern: its ``__torch_function__`` gives an op's result its input's ``_meta``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        if isinstance(out, Carrying) and isinstance(args[0], Carrying) and "_meta" in vars(args[0]):
            out._meta = vars(args[0])["_meta"]
        return out


def _moved(dev: str) -> tuple[list[tuple], set[str]]:
    s = torch.arange(3.).as_subclass(Carrying)
    s._meta = {"affine": 1}
    moved = [s.to(dev), s.to(dev, torch.float64), s.to(device=dev, dtype=torch.float16), torch.zeros(1).to(dev)]
    moved += [s.cuda(), s.cuda().to("cuda", torch.float64)] if dev == "cuda" else [s, s.to(torch.float64)]
    return [(type(m).__name__, isinstance(m, Carrying), m.dtype, vars(m).get("_meta")) for m in moved], \
        {m.device.type for m in moved}


def test_a_subclass_moved_to_cuda_stays_one_through_its_torch_function(remote):
    """``sub.to('cuda')`` and ``sub.cuda()`` of a CPU subclass (MONAI's MetaTensor, fastai's
    TensorBase) gave a plain tensor without its metadata: the routed ``Tensor.to`` skipped the
    subclass's ``__torch_function__``, which torch's C++ method calls first."""
    (got, devices), (want, _) = _moved("cuda"), _moved("cpu")
    assert got == want and devices == {"cuda"}
