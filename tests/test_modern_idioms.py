"""Current PyTorch idioms on 'cuda', unchanged, against the local CPU: torch.func's per-sample
gradients and forward-mode transforms, TorchScript next to the patched factories, EMA/SWA with
AveragedModel, checkpoints and pickles of cuda tensors, cuda Generators' states, printing."""
from __future__ import annotations

import io
import pickle
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jvp, vmap

from conftest import run_python

pytestmark = pytest.mark.usefixtures("remote")


def _seeded(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _both(fn: Callable[[str], object]) -> None:
    """``fn`` on 'cuda' and on the CPU give the same values (tensors come back to the CPU)."""
    def run(dev: str) -> object:
        torch.manual_seed(0)
        return torch.utils._pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, fn(dev))
    torch.testing.assert_close(run("cuda"), run("cpu"), rtol=1e-4, atol=1e-5)


def test_per_sample_gradients_with_vmap_of_grad():
    """vmap(grad(loss)) over functional_call: model code under the transforms reads ``x.device``
    (F.cross_entropy's decomposition does ``.to(self)``; positions come from
    ``arange(n, device=x.device)``), which must say 'cuda', not the wrappers' C++ meta."""
    def per_sample(dev: str) -> object:
        m = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(dev)
        params = {k: v.detach() for k, v in m.named_parameters()}

        def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            assert xi.device.type == dev and xi.is_cuda == (dev == "cuda") and not xi.is_meta
            xi = xi + torch.arange(xi.shape[-1], device=xi.device) / 10
            return F.cross_entropy(functional_call(m, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))
        x, y = _seeded(6, 5).to(dev), torch.tensor([0, 1, 2, 0, 1, 2]).to(dev)
        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    _both(per_sample)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_forward_mode_transforms_and_torchscript_of_patched_factories():
    """Forward-mode AD scripts torch's decompositions when it first loads them, and TorchScript
    compiles ``torch.zeros_like`` by the function's identity: the patched factories stay builtins."""
    @torch.jit.script
    def scripted(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x) + torch.ones(x.shape, device=x.device) * x.sum()

    def forward_mode(dev: str) -> object:
        x = _seeded(4).to(dev)
        _, tangent = jvp(torch.sin, (x,), (torch.ones_like(x),))
        return hessian(lambda t: (t.sin() * t).sum())(x), jacfwd(torch.tanh)(x), tangent, scripted(x)
    _both(forward_mode)


def test_ema_and_swa_averaged_models_with_update_bn():
    """AveragedModel groups parameters with swa_utils' own import of the foreach grouping: the
    groups must be keyed by the 'cuda' device (not the wrappers' meta, where ``n_averaged.to``
    would make a stray meta tensor)."""
    from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn

    def averaged(dev: str) -> object:
        m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1)).to(dev)
        ema, swa = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)), AveragedModel(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = SWALR(opt, swa_lr=0.05, anneal_epochs=2)
        for i in range(3):
            opt.zero_grad()
            m(_seeded(8, 4, seed=i).to(dev)).pow(2).mean().backward()
            opt.step()
            ema.update_parameters(m)
            swa.update_parameters(m)
            sched.step()
        update_bn([_seeded(8, 4, seed=10 + i).to(dev) for i in range(2)], swa)
        return [*ema.parameters(), *swa.parameters(), swa.module[1].running_mean, swa.n_averaged]
    _both(averaged)


def test_cuda_generator_state_round_trip():
    """``get_state``/``set_state`` of a ``torch.Generator('cuda')`` replay its draws exactly."""
    def replay(dev: str) -> object:
        g = torch.Generator(device=dev).manual_seed(42)
        first = torch.randperm(7, device=dev, generator=g)
        state = g.get_state()
        assert state.dtype == torch.uint8 and state.device.type == "cpu"
        a = torch.randn(3, device=dev, generator=g), torch.empty(4, device=dev).bernoulli_(0.5, generator=g)
        assert g.set_state(state) is g
        b = torch.randn(3, device=dev, generator=g), torch.empty(4, device=dev).bernoulli_(0.5, generator=g)
        torch.testing.assert_close(a, b)
        return first, a
    _both(replay)
    with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):  # (torch's words)
        torch.Generator(device="cuda").set_state(torch.zeros(3))


def test_parameter_prints_as_torch_prints_a_cuda_parameter():
    p = nn.Parameter(torch.tensor([1.0, 2.0]).cuda())
    assert repr(p) == "Parameter containing:\ntensor([1., 2.], device='cuda:0', requires_grad=True)"
    assert str(nn.Linear(2, 1).cuda().bias).startswith("Parameter containing:\ntensor([")


def _checkpoint(dev: str) -> tuple[nn.Module, torch.optim.Optimizer, io.BytesIO]:
    torch.manual_seed(0)
    m = nn.Linear(3, 2).to(dev)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(_seeded(2, 3).to(dev)).sum().backward()
    opt.step()
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "epoch": 3}, buf)
    buf.seek(0)
    return m, opt, buf


@pytest.mark.parametrize(("map_location", "where"), [
    (None, "cuda"), ("cpu", "cpu"), (lambda storage, loc: storage, "cpu"), ({"cuda:0": "cpu"}, "cpu"),
    (torch.device("cuda"), "cuda")])
def test_checkpoint_loads_where_map_location_says(map_location, where):
    """A checkpoint of cuda tensors loads as a GPU's does with each form of ``map_location``
    (the callable ``lambda storage, loc: storage`` of older code keeps everything on the CPU)."""
    _, _, buf = _checkpoint("cuda")
    _, _, local = _checkpoint("cpu")
    back = torch.load(buf, map_location=map_location, weights_only=True)
    want = torch.load(local, weights_only=True)
    assert back["model"]["weight"].device.type == where and back["opt"]["state"][0]["exp_avg"].device.type == where
    # Adam's step is a CPU tensor, moved only by a map_location that moves everything
    assert back["opt"]["state"][0]["step"].device.type == ("cpu" if map_location is None else where)
    torch.testing.assert_close(torch.utils._pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v,
                                                            back), want)


@pytest.mark.parametrize("zipfile", [True, False])
def test_views_saved_together_load_as_views_of_one_storage(tmp_path, zipfile):
    """torch.save writes a cuda tensor as a GPU does (a storage located on 'cuda:0'): views saved
    together come back sharing a storage, leaves that required grad come back leaves that do; in
    the legacy format too (``_use_new_zipfile_serialization=False``, whose storages' bytes come
    after the tensors: they came back on the CPU, then moved before their bytes were read)."""
    x = _seeded(3, 3).cuda()
    w = _seeded(4).cuda().requires_grad_()
    torch.save({"x": x, "rows": x[1:], "col": x[:, 2], "w": w, "empty": x[:0]}, tmp_path / "t.pt",
               _use_new_zipfile_serialization=zipfile)
    back = torch.load(tmp_path / "t.pt")
    torch.testing.assert_close(back["x"].cpu(), x.cpu())
    assert back["rows"].storage_offset() == 3 and back["col"].stride() == (3,) and back["x"].is_cuda
    back["x"][1, 2] = 100.0
    assert back["rows"][0, 2].item() == 100.0 and back["col"][1].item() == 100.0
    assert back["w"].is_leaf and back["w"].requires_grad and back["empty"].is_cuda
    torch.testing.assert_close(back["w"].detach().cpu(), w.detach().cpu())


def test_a_saved_checkpoint_is_a_gpu_checkpoint_to_plain_torch(tmp_path):
    torch.save({"x": _seeded(2, 2).cuda(), "n": 1}, tmp_path / "c.pt")
    code = ("import torch, sys\n"
            "f = sys.argv[1]\n"
            "print(torch.load(f, map_location='cpu')['x'].sum().item())\n"
            "try:\n    torch.load(f)\nexcept RuntimeError as e:\n    print('CUDA' in str(e))\n")
    out = run_python("", args=["-c", code, str(tmp_path / "c.pt")])
    lines = out.stdout.split()
    assert out.returncode == 0 and float(lines[0]) == pytest.approx(_seeded(2, 2).sum().item()) and lines[1] == "True"


def test_pickled_cuda_tensors_and_parameters_come_back_on_cuda():
    x = _seeded(3).cuda()
    p = nn.Parameter(_seeded(2).cuda())
    y, q = pickle.loads(pickle.dumps((x, p)))
    assert y.is_cuda and isinstance(q, nn.Parameter) and q.is_cuda and q.requires_grad
    torch.testing.assert_close(y.cpu(), x.cpu())


def test_a_whole_model_saved_and_loaded_is_on_cuda(tmp_path):
    """``torch.save(model)`` / ``torch.load(weights_only=False)``: the tensors inside the module
    (not only those of a dict) come back on 'cuda'."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).cuda()
    torch.save(m, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=False)
    assert all(t.is_cuda for t in [*back.parameters(), *back.buffers()])
    assert isinstance(back[0].weight, nn.Parameter) and back[0].weight.requires_grad
    x = _seeded(5, 3).cuda()
    torch.testing.assert_close(back(x).cpu(), m(x).cpu())


def test_jacobians_through_batch_norm_in_eval_mode():
    """jacrev through an eval BatchNorm expands its saved statistics: a CPU gateway saves them as
    CUDA does (the running statistics), not as its own kernel does (empty)."""
    from torch.func import jacrev

    def jacobians(dev: str) -> object:
        m = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(dev).eval()
        x = _seeded(4, 3).to(dev)
        buffers = dict(m.named_buffers())
        by_params = jacrev(lambda p: functional_call(m, (p, buffers), (x,)).sum())(dict(m.named_parameters()))
        return by_params, jacrev(lambda t: m(t).sum())(x)
    _both(jacobians)


def test_stream_and_sharing_idioms_of_cuda_tensors():
    """``record_stream``, ``share_memory_`` and ``is_shared`` as on any CUDA tensor."""
    s = torch.cuda.Stream()
    x = torch.ones(3, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2
    torch.cuda.current_stream().wait_stream(s)
    y.record_stream(torch.cuda.current_stream())
    assert y.share_memory_() is y and y.is_shared()
    assert y.sum().item() == 6.0


def test_profiler_with_cuda_activity_profiles_quietly(capfd):
    """``torch.profiler.profile(activities=[CPU, CUDA])`` and ``emit_nvtx`` run as on a GPU, without
    the CPU-only build's C++ warning (and stack) about CUDA events at every op."""
    from torch.profiler import ProfilerActivity, profile, record_function
    x = torch.ones(8, 8, device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("matmul"):
            y = x @ x
        y.sum().item()
    with torch.autograd.profiler.profile(use_device="cuda"), torch.autograd.profiler.emit_nvtx():
        (x * 2).sum().item()
    assert any(e.key == "matmul" for e in prof.key_averages())
    err = capfd.readouterr().err
    assert "CUDA event" not in err and "NVTX" not in err


def test_a_profiler_capture_range_is_marked_as_nvtx_ranges_are():
    """``torch.cuda.profiler.start()``/``stop()`` and ``profile()`` (scripts run under ``nsys
    --capture-range=cudaProfilerApi``, Megatron's --profile) bound a local GPU's capture as NVTX
    ranges mark its timeline: no-ops here (they raised AttributeError on the missing cudart);
    the rest of cudart says it is not supported."""
    torch.cuda.profiler.start()
    with torch.cuda.profiler.profile():
        y = torch.ones(2, device="cuda") * 2
    torch.cuda.profiler.stop()
    assert torch.cuda.cudart().cudaProfilerStart() == 0 and y.sum().item() == 4.0
    with pytest.raises(NotImplementedError, match="cudaHostRegister"):
        torch.cuda.cudart().cudaHostRegister(0, 0, 0)


def test_memory_history_says_plainly_it_is_not_recorded():
    """The memory-visualizer workflow fails with a message naming what is missing (not an
    AttributeError from torch._C), and the figures the gateway does report stay available."""
    with pytest.raises(NotImplementedError, match="allocator history"):
        torch.cuda.memory._record_memory_history(max_entries=1000)
    with pytest.raises(NotImplementedError, match="allocator history"):
        torch.cuda.memory._snapshot()
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] >= 0


def test_save_pretrained_of_a_model_with_weights_of_one_size(tmp_path):
    """transformers groups tensors by storage address before saving; same-sized weights over 64 KiB
    were taken for overlapping views of one storage ('contained shared tensors')."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=256, num_hidden_layers=1, num_attention_heads=2, intermediate_size=512,
                     vocab_size=50, max_position_embeddings=16)
    model = BertModel(cfg).cuda()
    model.save_pretrained(tmp_path)
    back = BertModel.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a.cpu(), b, msg=name)


def test_linearize_says_it_cannot_trace_rather_than_return_a_constant():
    """torch.func.linearize traces with make_fx, whose tracer passes over 'cuda' tensors: its jvp
    came back the value it had while tracing. It says so; jvp gives the product."""
    x = torch.tensor([0.5, 1.0, 2.0]).cuda()
    with pytest.raises(NotImplementedError, match="linearize cannot trace"):
        torch.func.linearize(torch.sin, x)
    torch.testing.assert_close(jvp(torch.sin, (x,), (torch.ones_like(x),))[1].cpu(), x.cos().cpu())


def test_messages_name_a_cuda_tensor_tensor():
    """torch's messages that name the argument's type say Tensor, as on a GPU."""
    with pytest.raises(ValueError, match=r"Expected parameter scale \(Tensor of shape \(1,\)\)"):
        # (validate_args named: Dynamo's first compile in this process turns the default off, as in torch)
        torch.distributions.Normal(torch.zeros(1, device="cuda"), torch.tensor([-1.0], device="cuda"),
                                   validate_args=True)
    with pytest.raises(TypeError, match=r"got \(Tensor, out=Tensor\)"):
        torch.argsort(torch.ones(3, device="cuda"), out=torch.empty(3, dtype=torch.long, device="cuda"))
