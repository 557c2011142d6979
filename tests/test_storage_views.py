"""Storages and views that alias, on 'cuda' as on a GPU: a storage resized in place (FSDP's and
activation offloading's way to free a tensor's memory and refill it later) frees and regains the
gateway's memory, and the tensors on it see the change. Values are compared with the same code
on the CPU, which has the same semantics here."""
from __future__ import annotations

import copy
import gc
import io

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (what _free_storage reads; FSDP imports it)
from torch import nn
from torch.distributed.utils import _alloc_storage, _free_storage

pytestmark = pytest.mark.usefixtures("remote")


def _allocated() -> int:
    """The session's allocated bytes once what earlier tests dropped is released (their garbage,
    collected here, is freed by the next message: read until two readings agree)."""
    last = None
    while True:
        gc.collect()
        now = torch.cuda.memory_allocated()
        if now == last:
            return now
        last = now


def _free_and_refill(device: str) -> tuple:
    """FSDP1's round: a flat parameter whose views are a layer's weight and bias, its storage freed
    (torch's own helpers) and then given back and refilled; what the tensors report and hold."""
    flat = torch.arange(40, dtype=torch.float32, device=device)
    weight, bias = (part.view(shape) for part, shape in zip(flat.split([32, 4, 4])[:2], [(4, 8), (4,)]))
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


def test_split_chunk_and_unbind_give_views_of_one_storage():
    """Their outputs (FSDP's flat parameter split into a module's parameters, a fused QKV weight
    chunked) share their input's storage object, data pointer and size, as on a GPU: libraries
    find tied tensors by them."""
    def run(device: str) -> list:
        x = torch.arange(12.0, device=device).view(4, 3)
        parts = [*x.split(2), *x.chunk(2, 1), *x.unbind(), *x.split([1, 3])]
        return [(p.data_ptr() - x.data_ptr(), p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(),
                 p.untyped_storage().nbytes()) for p in parts]

    assert run("cuda") == run("cpu")
    z = _z("cuda")
    assert all(p.is_conj() for p in z.conj().split(2))


def _z(device: str) -> torch.Tensor:
    return torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j], device=device)


def _conj_writes(device: str) -> list:
    """Writes through lazy conjugates and negatives reach their base (in conjugated or negated
    math), and writes to the base show in them: they are views sharing its memory."""
    z = _z(device)
    c = z.conj()
    seen = [c.is_conj(), c.data_ptr() == z.data_ptr()]
    c.mul_(2)
    c[0] = 5j
    seen.append(z.clone())
    z.add_(1)
    seen += [c.clone(), c.resolve_conj().is_conj(), c[1:].is_conj(), c.view(3, 1).mH.is_conj()]
    c.imag.zero_()
    c.copy_(c * 1j)
    n = z._neg_view()
    n.add_(1)
    seen += [z.clone(), n.is_neg(), n.resolve_neg().is_neg(), c.imag.is_neg(), c.conj().is_conj()]
    return [x.cpu() if isinstance(x, torch.Tensor) else x for x in seen]


def test_conj_and_neg_views_share_their_bases_memory():
    remote, local = _conj_writes("cuda"), _conj_writes("cpu")
    assert len(remote) == len(local)
    for r, c in zip(remote, local):
        assert (torch.equal(r, c) if isinstance(c, torch.Tensor) else r == c), (remote, local)


def _real_and_imag_views(device: str) -> list:
    z = _z(device)
    z.real.add_(1)
    z.imag[0] = 3
    torch.view_as_real(z)[1, 1] = 9
    x = torch.arange(6.0, device=device).view(3, 2)
    torch.view_as_complex(x).mul_(1j)
    return [z.cpu(), x.cpu()]


def test_real_imag_and_view_as_real_are_writable_views():
    remote, local = _real_and_imag_views("cuda"), _real_and_imag_views("cpu")
    assert all(torch.equal(r, c) for r, c in zip(remote, local))


def test_conjugate_aware_kernels_and_autograd_read_the_bit():
    """mm, dot and solve take a lazy conjugate as it is (on the gateway, which holds the bit);
    backward formulas make conjugate views of their own."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 3, dtype=torch.cfloat, generator=g), torch.randn(3, 2, dtype=torch.cfloat, generator=g)

    def run(device: str) -> list:
        ad, bd, z = a.to(device), b.to(device), _z(device)
        w = ad.clone().requires_grad_()
        (w.mH @ bd).abs().sum().backward()
        x = torch.arange(8.0, device=device).requires_grad_()
        torch.fft.hfft(torch.fft.ifft(x)).sum().backward()
        return [t.cpu() for t in (ad.mH @ bd, torch.dot(z.conj(), z), torch.linalg.solve(ad.mH, bd), w.grad, x.grad)]

    for r, c in zip(run("cuda"), run("cpu")):
        torch.testing.assert_close(r, c)


def test_views_that_refuse_a_lazy_conjugate_refuse_it_at_the_call():
    z = _z("cuda")
    with pytest.raises(RuntimeError, match="view_as_real doesn't work on unresolved conjugated tensors"):
        torch.view_as_real(z.conj())
    with pytest.raises(RuntimeError, match="not supported for conjugate view tensors"):
        z.conj().view(torch.float32)
    assert torch.view_as_real(z._neg_view()).is_neg()
    assert torch.view_as_real(z.conj().resolve_conj()).tolist() == [[1.0, -2.0], [3.0, 1.0], [-2.0, -0.5]]


def _saved_and_loaded(device: str) -> list:
    """A checkpoint holding a tensor with its lazy conjugate and negative (in either order, and
    loaded with map_location too) keeps one storage of the base's bytes and each view's bit: the
    loaded views read conjugated and negated, and see writes to the loaded base."""
    out = []
    for order in (["z", "c", "n", "c1"], ["c1", "n", "c", "z"]):
        z = _z(device)
        views = {"z": z, "c": z.conj(), "n": z._neg_view(), "c1": z[1:].conj()}
        for where in (None, device):
            f = io.BytesIO()
            torch.save({k: views[k] for k in order}, f)
            f.seek(0)
            got = torch.load(f, map_location=where)
            got["z"].mul_(2)
            out += [(k, t.is_conj(), t.is_neg(), t.cpu().resolve_conj().resolve_neg()) for k, t in got.items()]
    return out


def test_a_checkpoint_keeps_lazy_conjugates_as_views():
    remote, local = _saved_and_loaded("cuda"), _saved_and_loaded("cpu")
    assert len(remote) == len(local)
    for (*r, rt), (*c, ct) in zip(remote, local):
        assert r == c and torch.equal(rt, ct), (remote, local)


def test_a_deepcopied_lazy_conjugate_holds_its_values():
    """torch's deepcopy of a lazy conjugate or negative copies the base's bytes and resolves them."""
    def run(device: str) -> list:
        z = _z(device)
        copies = [copy.deepcopy(z.conj()), copy.deepcopy(z._neg_view()), *copy.deepcopy([z, z[1:].conj()])]
        return [(t.is_conj(), t.is_neg(), t.cpu()) for t in copies]

    for (*r, rt), (*c, ct) in zip(run("cuda"), run("cpu")):
        assert r == c and torch.equal(rt, ct)


def test_data_assigned_a_lazy_conjugate_becomes_one():
    """``p.data = z.conj()``: p takes the conjugate's bit and memory (C++ refused the wrapper's
    keys, which differed by the bit), and a later ``p.data = plain`` drops the bit again."""
    def run(device: str) -> list:
        z = _z(device)
        w, p = torch.zeros(3, dtype=torch.cfloat, device=device), nn.Parameter(torch.zeros(3, 2, device=device))
        w.data = z.conj()
        seen = [w.is_conj(), w.resolve_conj().cpu()]
        w.mul_(2)
        seen.append(z.cpu())
        w.data = torch.ones(3, dtype=torch.cfloat, device=device)
        p.data = torch.view_as_real(z._neg_view())
        return [*seen, w.is_conj(), w.cpu(), p.is_neg(), p.resolve_neg().cpu(), isinstance(p, nn.Parameter)]

    for r, c in zip(run("cuda"), run("cpu")):
        assert (torch.equal(r, c) if isinstance(c, torch.Tensor) else r == c)
