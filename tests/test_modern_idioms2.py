"""Current PyTorch training idioms on 'cuda', round 2, against the local CPU: generators cloned
with ``clone_state``."""
from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

pytestmark = pytest.mark.usefixtures("remote")


def _both(fn: Callable[[str], object]) -> None:
    """``fn`` on 'cuda' and on the CPU give the same values (tensors come back to the CPU)."""
    def run(dev: str) -> object:
        torch.manual_seed(0)
        return torch.utils._pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, fn(dev))
    torch.testing.assert_close(run("cuda"), run("cpu"))


def test_a_cloned_generator_draws_on_its_own_from_the_state_it_was_cloned_at():
    """``Generator.clone_state()`` is an independent generator in the same state: the clone and
    the original then draw the same numbers, each advancing only itself (the clone was a second
    carrier of the original's id, so both drew from one gateway generator)."""
    def clone(dev: str) -> object:
        g = torch.Generator(device=dev).manual_seed(5)
        torch.randn(2, device=dev, generator=g)
        c = g.clone_state()
        assert c.device == g.device and c.initial_seed() == 5
        from_clone = torch.randn(3, device=dev, generator=c), torch.rand(2, device=dev, generator=c)
        from_original = torch.randn(3, device=dev, generator=g), torch.rand(2, device=dev, generator=g)
        torch.testing.assert_close(from_clone, from_original)
        return from_clone
    _both(clone)


def test_a_clone_of_the_default_generator_is_a_generator_of_its_own():
    """``torch.cuda.default_generators[0].clone_state()`` (the CPU's: ``torch.default_generator``)
    starts where the default is and then leaves it alone (it drew from the default itself)."""
    def clone(dev: str) -> object:
        default = torch.cuda.default_generators[0] if dev == "cuda" else torch.default_generator
        torch.manual_seed(3)
        c = default.clone_state()
        assert c.device == torch.empty(0, device=dev).device and c.initial_seed() == 3
        ahead = torch.rand(2, device=dev), torch.rand(2, device=dev)
        again = torch.rand(2, device=dev, generator=c), torch.rand(2, device=dev, generator=c)
        torch.testing.assert_close(again, ahead)
        return ahead
    _both(clone)


def test_an_argument_sdpa_does_not_take_is_refused_in_torchs_words():
    """``F.scaled_dot_product_attention(..., set_priority=True)`` (``sdpa_kernel``'s argument, put on
    the call) raised a TypeError naming remotecuda's own ``_bind()``."""
    def refused(dev: str) -> str:
        q = torch.ones(1, 1, 2, 4, device=dev)
        with pytest.raises(TypeError) as e:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, set_priority=True)
        return str(e.value)
    assert refused("cuda") == refused("cpu")
    assert "scaled_dot_product_attention()" in refused("cpu")


def _put_under_determinism(dev: str, warn_only: bool = False) -> tuple:
    """``put_`` (its kernel alerts under deterministic algorithms, on the CPU as on a GPU) in a
    ``try`` that falls back to ``index_put_``; what it raised or warned at the call, and the result."""
    torch._C._set_deterministic_algorithms(True, warn_only=warn_only)  # (use_deterministic_algorithms imports inductor)
    try:
        x = torch.zeros(4, device=dev)
        index, values = torch.tensor([1, 1], device=dev), torch.tensor([1.0, 2.0], device=dev)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            try:
                x.put_(index, values)
                raised = None
            except RuntimeError as e:
                raised = str(e)
                x.index_put_((index,), values, accumulate=True)
            at_call = [str(w.message) for w in warned]
        return raised, at_call, x.tolist()
    finally:
        torch._C._set_deterministic_algorithms(False)


def test_a_deterministic_algorithms_alert_is_raised_at_the_call():
    """A kernel with no deterministic implementation refuses, under ``use_deterministic_algorithms(True)``,
    on the host before it starts: at the call, where ``try``/``except`` around it catches it. Queued,
    the op failed on the gateway and its error came at the next sync (here ``tolist()``), past the
    handler, with every op after it poisoned."""
    raised, _, result = _put_under_determinism("cuda")
    assert (raised, result) == _put_under_determinism("cpu")[::2]
    assert raised is not None and "put_ does not have a deterministic implementation" in raised
    ones = torch.ones(2, device="cuda")  # (the setting off again: put_ queued, and run)
    assert torch.zeros(2, device="cuda").put_(torch.tensor([0, 0], device="cuda"), ones).tolist() == [1.0, 0.0]


def test_a_deterministic_algorithms_warning_is_given_at_the_call():
    """With ``warn_only=True`` the alert is a warning, given at the call (not at a later sync)."""
    got = _put_under_determinism("cuda", warn_only=True)
    assert got == _put_under_determinism("cpu", warn_only=True)
    assert len(got[1]) == 1 and "put_ does not have a deterministic implementation" in got[1][0]


def _attention(dev: str, backends: list) -> object:
    """Attention (and its gradient) with only ``backends`` allowed; torch's error if none fits."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=gen).to(dev) for _ in range(3))
    q.requires_grad_()
    try:
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except RuntimeError as e:
        return str(e)
    out.sum().backward()
    return out.detach().cpu(), q.grad.cpu()


def test_sdpa_kernel_picks_the_backend_on_the_gateway():
    """``with sdpa_kernel(...)`` sets which attention backends the device may pick: the gateway
    picked with all of them enabled (its flags were never told), so MATH alone still ran its fused
    kernel, and a backend its device lacks ran instead of being refused."""
    for backends in ([SDPBackend.MATH], [SDPBackend.EFFICIENT_ATTENTION], [SDPBackend.FLASH_ATTENTION],
                     [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]):
        remote, local = _attention("cuda", backends), _attention("cpu", backends)
        if isinstance(local, str):
            assert remote == local, backends
        else:
            assert isinstance(remote, tuple) and all(torch.equal(a, b) for a, b in zip(remote, local)), backends
