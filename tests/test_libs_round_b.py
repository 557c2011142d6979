"""Third-party libraries, round B: what their code does on 'cuda' through remotecuda, against the
same code run locally on the CPU. gpytorch, x-transformers, rotary-embedding-torch,
vector-quantize-pytorch, torch-ema, timm's ModelEmaV3 and schedulefree agreed as they were; the
tests here hold the idioms that did not, reduced to torch where the bug shows that way."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.usefixtures("remote")


class _FillsOnce(nn.Module):
    """A cache filled on the first call and a Python flag saying so, as rotary-embedding-torch's
    ``RotaryEmbedding`` keeps its frequencies (``cached_freqs`` and ``cached_freqs_seq_len``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4), persistent=False)
        self.filled = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.filled:
            self.cache.copy_(x * 2)
            self.filled = len(x)
        return x + self.cache


def _calls(m: nn.Module, device: str) -> list[torch.Tensor]:
    """Four calls and the cache: on 'cuda' through ``torch.compile``, on the CPU eagerly (what a
    compiled call must equal; torch's own compiler would take minutes here)."""
    m = m.to(device)
    c = torch.compile(m) if device == "cuda" else m
    x = torch.arange(4.0, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = [c(x), c(x + 1), m(x + 2), c(x + 3)]
    return [t.cpu() for t in (*out, m.cache)]


def test_compiled_call_that_changes_its_modules_python_state():
    """The trace ran the module's Python once per AOTAutograd pass: the first pass set the flag,
    so the graph was traced on the 'already filled' branch (x + zeros) and the cache never
    filled. Each pass now starts from the state before the call; the attributes the call changed
    are set again after each run of its graph and are part of the trace's key."""
    expected = _calls(_FillsOnce(), "cpu")
    m = _FillsOnce()
    got = _calls(m, "cuda")
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert m.filled == 4


class _Counts(nn.Module):
    """A Python counter a forward advances, and a flag it flips."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = 0
        self.odd = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.odd = not self.odd
        return self.lin(x) * (2 if self.odd else 3)


def test_compiled_call_replays_its_attribute_changes():
    """As Dynamo replays a frame's attribute stores, each call's changes happen once per call,
    also on a trace run again for a signature seen before."""
    torch.manual_seed(0)
    local = _Counts()
    remote = _Counts()
    remote.load_state_dict(local.state_dict())
    x = torch.randn(2, 3)
    expected = [local(x) for _ in range(5)]
    remote = remote.cuda()
    c = torch.compile(remote)  # (local: eager, what compiled calls must equal)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = [c(x.cuda()).cpu() for _ in range(5)]
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e.detach())
    assert (remote.calls, remote.odd) == (local.calls, local.odd) == (5, True)


def test_failed_trace_leaves_python_state_as_it_was():
    """A call the trace cannot take runs eagerly: the state its trace changed is put back first,
    or the eager call would find the cache 'filled' and skip filling it."""

    class ReadsValue(_FillsOnce):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            return out * 2 if out.sum() > 0 else out  # (a branch on a value: eager)

    expected = _calls(ReadsValue(), "cpu")
    got = _calls(ReadsValue(), "cuda")
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_rotary_embedding_cache_under_torch_compile():
    """rotary-embedding-torch's README idiom: a compiled function rotating queries fills the
    embedding's frequency cache; eager calls after it read that cache."""
    pytest.importorskip("rotary_embedding_torch")
    from rotary_embedding_torch import RotaryEmbedding

    def run(device: str) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        q = torch.randn(1, 4, 12, 32, generator=g).to(device)
        rot = RotaryEmbedding(dim=16).to(device)
        f = lambda t: rot.rotate_queries_or_keys(t)  # noqa: E731 - the README's shape
        if device == "cuda":
            f = torch.compile(f)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = [f(q), rot.rotate_queries_or_keys(q), f(q)]
        return [t.cpu() for t in out]

    for e, g in zip(run("cpu"), run("cuda")):
        torch.testing.assert_close(g, e)


def test_eigvalsh_and_svdvals_compute_the_values_alone():
    """gpytorch's and linear_operator's spectra, a PCA's singular values: torch's composites ask
    ``_linalg_eigh``/``_linalg_svd`` for the vectors too whenever a gradient may need them, which
    they assume of any tensor subclass, so the gateway computed vectors nobody read, and values
    that differed from a GPU's (values-only) in the last bits. With a gradient wanted, the vectors
    are computed and the gradient is local's."""
    g = torch.Generator().manual_seed(0)
    b = torch.randn(2, 40, 40, generator=g)
    a = b @ b.mT
    # (what a plain program's calls run: here, in the process remotecuda is active in, its dispatch
    # mode makes every tensor "subclass-like" to C++, and a local call computes the vectors too)
    for uplo in ("L", "U"):
        expected = torch.ops.aten._linalg_eigh(a, uplo, False)[0]
        assert torch.equal(torch.linalg.eigvalsh(a.cuda(), UPLO=uplo).cpu(), expected)
    for x in (b, b[0].double()):
        assert torch.equal(torch.linalg.svdvals(x.cuda()).cpu(), torch.ops.aten._linalg_svd(x, False, False)[1])
    grads = []
    for dev in ("cpu", "cuda"):
        x = b[0].to(dev).requires_grad_()
        (torch.linalg.svdvals(x).sum() + torch.linalg.eigvalsh(x @ x.T).sum()).backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])
