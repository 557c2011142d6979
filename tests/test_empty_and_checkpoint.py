"""Zero-size tensors, checkpoints fetched in one round trip, and exact memory figures on a CPU gateway.

The reference for every value is the same computation in local PyTorch on the CPU.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import remotecuda

pytestmark = pytest.mark.usefixtures("remote")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
SHAPES = [(0,), (0, 3), (2, 0, 4), (3, 0)]


def _same(remote_value: torch.Tensor, local: torch.Tensor) -> None:
    cpu = remote_value.cpu()
    assert type(cpu) is torch.Tensor and cpu.dtype == local.dtype and cpu.shape == local.shape
    assert cpu.stride() == local.stride() or local.numel() == 0
    assert torch.equal(cpu, local)


# ---------------------------------------------------------------- zero-size tensors

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_tensors_upload_and_download_in_every_dtype(dtype):
    for shape in SHAPES:
        local = torch.zeros(shape, dtype=dtype)
        r = local.cuda()
        assert r.is_cuda and r.shape == local.shape and r.dtype == dtype
        _same(r, local)
        assert r.tolist() == local.tolist()
        if dtype is not torch.bfloat16:  # (numpy has no bfloat16)
            assert r.cpu().numpy().shape == local.numpy().shape
        assert repr(r).replace(", device='cuda:0'", "") == repr(local)
    _same(torch.tensor([], dtype=dtype, device="cuda"), torch.tensor([], dtype=dtype))


def test_empty_tensor_from_the_data_factory_and_its_repr():
    r = torch.tensor([], device="cuda")
    assert repr(r) == "tensor([], device='cuda:0')"
    assert repr(torch.zeros(0, 3).cuda()) == "tensor([], device='cuda:0', size=(0, 3))"
    assert repr(torch.zeros(0, dtype=torch.int64).cuda()) == "tensor([], device='cuda:0', dtype=torch.int64)"


def test_non_contiguous_empties():
    for local in (torch.zeros(3, 0).t(), torch.zeros(4, 0, 2).permute(2, 0, 1), torch.zeros(0, 6)[:, ::2],
                  torch.zeros(2, 4)[:, 4:]):
        r = local.cuda()
        assert r.shape == local.shape
        _same(r.contiguous(), local.contiguous())
        assert torch.equal(r.cpu(), local)


def test_zero_dim_scalars():
    for dtype in DTYPES:
        local = torch.tensor(3, dtype=dtype) if not dtype.is_complex else torch.tensor(1 + 2j, dtype=dtype)
        r = local.cuda()
        assert r.dim() == 0
        _same(r, local)
        assert r.item() == local.item() and r.tolist() == local.tolist()
        assert repr(r).replace(", device='cuda:0'", "") == repr(local)
    assert repr(torch.tensor(3.5).cuda()) == "tensor(3.5000, device='cuda:0')"
    assert f"{torch.tensor(2.25, device='cuda'):.1f}" == "2.2"


def test_ops_on_empty_tensors_match_local():
    """HF's DynamicCache starts from an empty tensor and concatenates onto it."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 4)
    empty = torch.tensor([])
    rx, rempty = x.cuda(), empty.cuda()
    _same(torch.cat([rempty, rx], dim=-2), torch.cat([empty, x], dim=-2))
    e4 = torch.zeros(2, 3, 0, 4)
    _same(torch.cat([e4.cuda(), rx], dim=-2), torch.cat([e4, x], dim=-2))
    z = torch.zeros(0, 3)
    rz = z.cuda()
    _same(rz + 1, z + 1)
    _same(rz.sum(0), z.sum(0))
    _same(rz @ torch.ones(3, 2).cuda(), z @ torch.ones(3, 2))
    _same(torch.ones(2, 0).cuda() @ torch.ones(0, 3).cuda(), torch.ones(2, 0) @ torch.ones(0, 3))
    _same(rz.sum(), z.sum())
    _same(rz.reshape(3, 0), z.reshape(3, 0))
    _same(rx[:, :, 5:], x[:, :, 5:])
    _same(rx[rx > 100], x[x > 100])  # a data-dependent empty result
    assert rz.max(1).values.shape == z.max(1).values.shape
    _same(torch.empty(0, device="cuda").new_zeros(0, 2), torch.zeros(0, 2))


def test_empty_tensors_save_and_load():
    local = {"a": torch.zeros(0, 3), "b": torch.tensor([], dtype=torch.int64), "c": torch.tensor(1.5),
             "d": torch.zeros(2, 0, 4, dtype=torch.bfloat16)}
    buf = io.BytesIO()
    torch.save({k: v.cuda() for k, v in local.items()}, buf)
    buf.seek(0)
    back = torch.load(buf)
    for k, v in local.items():
        assert back[k].is_cuda
        _same(back[k], v)


# ---------------------------------------------------------------- checkpoints: many tensors, one round trip

def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(23)], nn.BatchNorm1d(16))  # 48 params + 3 buffers


def _round_trips(fn) -> tuple:
    torch.cuda.synchronize()
    remotecuda.stats(reset=True)
    out = fn()
    return out, remotecuda.stats()["blocking_round_trips"]


def _equal_dicts(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert type(a[k]) is torch.Tensor and torch.equal(a[k], b[k]), k


def test_torch_save_of_a_state_dict_is_one_round_trip():
    local = _model()
    ref = {k: v.clone() for k, v in local.state_dict().items()}
    sd = local.cuda().state_dict()
    assert len(sd) >= 48
    buf = io.BytesIO()
    _, trips = _round_trips(lambda: torch.save(sd, buf))
    assert trips <= 2, f"torch.save of {len(sd)} tensors took {trips} round trips"
    buf.seek(0)
    _equal_dicts(torch.load(buf, map_location="cpu"), ref)
    buf.seek(0)
    back = torch.load(buf)  # back onto the remote device
    assert all(v.is_cuda for v in back.values())
    _equal_dicts({k: v.cpu() for k, v in back.items()}, ref)


def test_checkpoint_with_model_optimizer_and_scalars():
    model = _model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16, device="cuda")).sum().backward()
    opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "view": model[0].weight[2:5]}
    local = {"model": {k: v.cpu() for k, v in ckpt["model"].items()},
             "state": {i: {k: v.cpu() for k, v in s.items()} for i, s in ckpt["optimizer"]["state"].items()},
             "view": ckpt["view"].cpu()}
    buf = io.BytesIO()
    _, trips = _round_trips(lambda: torch.save(ckpt, buf))
    assert trips <= 2
    buf.seek(0)
    back = torch.load(buf, map_location="cpu")
    _equal_dicts(back["model"], local["model"])
    for i, s in local["state"].items():
        _equal_dicts(back["optimizer"]["state"][i], s)
    assert back["epoch"] == 3 and torch.equal(back["view"], local["view"])
    _, trips = _round_trips(lambda: torch.save(opt.state_dict(), io.BytesIO()))
    assert trips <= 2


def test_fetch_helper():
    sd = _model().cuda().state_dict()
    cpu_tensor = torch.arange(3)
    t = torch.randn(4, 6, device="cuda").t()  # .cpu() keeps a transpose's strides
    values, trips = _round_trips(lambda: remotecuda.fetch([*sd.values(), cpu_tensor, t]))
    assert trips == 1
    for v, ref in zip(values, [*(x.cpu() for x in sd.values()), cpu_tensor, t.cpu()]):
        assert type(v) is torch.Tensor and v.stride() == ref.stride() and torch.equal(v, ref)
    assert values[-2] is cpu_tensor


def test_module_cpu_and_to_cpu_fetch_together():
    local = _model()
    ref = {k: v.clone() for k, v in local.state_dict().items()}
    for move in (lambda m: m.cpu(), lambda m: m.to("cpu"), lambda m: m.to(torch.device("cpu"), torch.float64)):
        m = copy.deepcopy(local).cuda()
        m[0].weight.grad = torch.ones(16, 16, device="cuda")
        _, trips = _round_trips(lambda: move(m))  # noqa: B023 (called at once)
        assert trips <= 2
        assert all(type(v) is torch.Tensor for v in m.state_dict().values())
        _equal_dicts(m.state_dict(), {k: v.to(m[0].weight.dtype) if v.is_floating_point() else v
                                      for k, v in ref.items()})
        assert torch.equal(m[0].weight.grad, torch.ones(16, 16, dtype=m[0].weight.dtype))


def test_deepcopy_of_a_cuda_model_reads_nothing():
    model = _model().cuda()
    ref = {k: v.cpu() for k, v in model.state_dict().items()}
    (m2, sd2), trips = _round_trips(lambda: (copy.deepcopy(model), copy.deepcopy(model.state_dict())))
    assert trips == 0, "copies stay on the gateway"
    _equal_dicts({k: v.cpu() for k, v in m2.state_dict().items()}, ref)
    _equal_dicts({k: v.cpu() for k, v in sd2.items()}, ref)


def test_safetensors_save_file(tmp_path):
    from safetensors.torch import load_file, save_file
    local = _model()
    ref = {k: v.clone() for k, v in local.state_dict().items()}
    sd = local.cuda().state_dict()
    _, trips = _round_trips(lambda: save_file(sd, tmp_path / "m.safetensors"))
    assert trips <= 2
    back = load_file(tmp_path / "m.safetensors")
    assert set(back) == set(ref) and all(torch.equal(back[k], ref[k]) for k in ref)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_shared_storage_is_refused_where_torch_refuses_it(device, tmp_path):
    """A view saved beside its base: safetensors refuses tensors sharing memory (it found them by
    storage pointer and size, and a 'cuda' view's storage spanned only the view); torch.save
    refuses two dtypes viewing one storage (it was given a CPU storage per dtype)."""
    from safetensors.torch import save_file
    x = torch.arange(10.0, device=device)
    with pytest.raises(RuntimeError, match="Some tensors share memory"):
        save_file({"x": x, "head": x[:2]}, tmp_path / "v.safetensors")
    with pytest.raises(RuntimeError, match="^Cannot save multiple tensors or storages that view the same data as "
                                           "different types$"):
        torch.save([x, x.view(torch.int32)], io.BytesIO())
    buf = io.BytesIO()
    torch.save([x, x[2:], x.clone().view(torch.int32)], buf)  # (one dtype per storage: saved)
    buf.seek(0)
    back = torch.load(buf)
    assert torch.equal(back[1].cpu(), torch.arange(2.0, 10.0))


# ---------------------------------------------------------------- memory figures on a CPU gateway

def test_peak_memory_sees_a_temporary_between_samples():
    """The CPU gateway counts its tensors' storages as they come and go, as CUDA's allocator
    does: a 64 MB temporary that lives for one op inside one message is in the peak."""
    x = torch.randn(16 << 20, device="cuda")  # 64 MiB
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    assert torch.cuda.max_memory_allocated() == base
    y = (x * 2).sum()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() >= base + (64 << 20)
    del y
    assert torch.cuda.memory_allocated() == base
    v = x[: 1 << 20]  # a view: its storage is counted once
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base
    del v, x
    assert torch.cuda.memory_allocated() == base - (64 << 20)
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.peak"] == torch.cuda.max_memory_allocated()


def test_hugging_face_save_pretrained(tmp_path):
    """save_pretrained writes through safetensors: one fetch for the whole model, the same file as locally."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "local")
    model.cuda()
    _, trips = _round_trips(lambda: model.save_pretrained(tmp_path / "remote"))
    assert trips <= 2
    local, remote = (load_file(tmp_path / d / "model.safetensors") for d in ("local", "remote"))
    _equal_dicts(dict(sorted(remote.items())), dict(sorted(local.items())))


def test_fetch_of_large_tensors_in_parts_keeps_each_in_its_place():
    """Tensors over 32 MiB come as PART messages naming their place in the request."""
    torch.manual_seed(0)
    local = [torch.randn(3), torch.randn(9 << 20), torch.arange(5), torch.randn(10 << 20), torch.zeros(0)]
    values, trips = _round_trips(lambda: remotecuda.fetch([t.cuda() for t in local]))
    assert trips == 1
    for v, ref in zip(values, local):
        assert torch.equal(v, ref)
