"""Storages and views that alias, on 'cuda' as on a GPU: a storage resized in place (FSDP's and
activation offloading's way to free a tensor's memory and refill it later) frees and regains the
gateway's memory, and the tensors on it see the change. Values are compared with the same code
on the CPU, which has the same semantics here."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (what _free_storage reads; FSDP imports it)
from torch import nn
from torch.distributed.utils import _alloc_storage, _free_storage

pytestmark = pytest.mark.usefixtures("remote")


def _allocated() -> int:
    gc.collect()  # (wrappers already dropped are released first, not between two readings)
    return torch.cuda.memory_allocated()


def _free_and_refill(device: str) -> tuple:
    """FSDP1's round: a flat parameter whose views are a layer's weight and bias, its storage freed
    (torch's own helpers) and then given back and refilled; what the tensors report and hold."""
    flat = torch.arange(40, dtype=torch.float32, device=device)
    weight, bias = flat[:32].view(4, 8), flat[32:36]
    full = flat.clone()
    _free_storage(flat)
    freed = (flat.untyped_storage().nbytes(), weight.untyped_storage().size(), flat._typed_storage()._size(),
             flat.shape)
    _alloc_storage(flat, flat.shape)
    flat.copy_(full * 2)
    out = nn.functional.linear(torch.ones(2, 8, device=device), weight, bias)
    return freed, flat.untyped_storage().nbytes(), out.cpu(), weight.cpu()


def test_a_freed_storage_refilled_as_fsdp_does():
    remote, local = _free_and_refill("cuda"), _free_and_refill("cpu")
    assert remote[:2] == local[:2] == (((0, 0, 0, torch.Size([40])), 160))
    assert torch.equal(remote[2], local[2]) and torch.equal(remote[3], local[3])


def test_resizing_a_storage_frees_and_takes_gateway_memory():
    """``untyped_storage().resize_(0)`` gives the bytes back (memory_allocated goes down by them),
    ``resize_(n)`` takes n again; the tensor object lives on all the while."""
    x = torch.arange(1 << 16, dtype=torch.float32, device="cuda") + 1
    view = x[100:104]
    before = _allocated()
    x.untyped_storage().resize_(0)
    assert _allocated() == before - x.nbytes
    assert view.untyped_storage().nbytes() == 0 and x.shape == (1 << 16,)
    x.untyped_storage().resize_(x.nbytes)
    assert _allocated() == before
    x.fill_(3.0)
    assert view.tolist() == [3.0] * 4 and x.sum().item() == 3.0 * (1 << 16)


def test_a_resize_keeps_the_first_bytes_and_reaches_every_alias():
    """A storage shrunk or grown keeps its first bytes; tensors that share it without being its
    views (``detach()``, a Parameter made from it) see it too; the typed storage resizes in elements."""
    def run(device: str) -> tuple:
        x = torch.arange(8.0, device=device)
        alias, param = x.detach(), nn.Parameter(x)
        x._typed_storage()._resize_(4)  # (in elements: FSDP's call)
        x.untyped_storage().resize_(32)
        head = x[:4].tolist()
        x[4:].fill_(-1.0)
        return head, alias.tolist(), (param * 2).tolist(), x.untyped_storage().nbytes()

    assert run("cuda") == run("cpu")


def test_an_uploaded_tensors_storage_resizes_and_its_twin_upload_keeps_its_bytes():
    """An upload lands in memory the gateway cannot resize in place on a CPU device (a recycled host
    block): it is moved to memory that can be, its views with it, and the same bytes uploaded again
    (the upload cache's copy) are untouched."""
    data = torch.arange(50_000, dtype=torch.float32)
    x = data.to("cuda")
    view = x[5:8]
    before = _allocated()
    x.untyped_storage().resize_(0)
    assert _allocated() == before - x.nbytes
    x.untyped_storage().resize_(x.nbytes)
    x.copy_(data * 2)
    assert view.tolist() == [10.0, 12.0, 14.0]
    twin = data.to("cuda")
    assert torch.equal(twin.cpu(), data) and torch.equal(x.cpu(), data * 2)
