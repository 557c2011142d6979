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
