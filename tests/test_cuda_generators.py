"""A 'cuda' ``torch.Generator`` copied (``clone_state``, ``copy.deepcopy``, pickle) and the CUDA
RNG state set, as a GPU machine's torch does them: a copy is a new generator on the same device
that draws what the original would draw next, independently of it, and a state that is not a
ByteTensor is refused at the call (the Reformer's reversible layers, activation checkpointing and
``fork_rng`` save and restore these states)."""
from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch

pytestmark = pytest.mark.usefixtures("remote")

COPIES: dict[str, Callable[[torch.Generator], torch.Generator]] = {
    "clone_state": lambda g: g.clone_state(),
    "deepcopy": copy.deepcopy,
    "pickle": lambda g: pickle.loads(pickle.dumps(g)),
}


def _drawn_after_copy(dev: str, copy_of: Callable[[torch.Generator], torch.Generator]) -> dict[str, object]:
    g = torch.Generator(dev).manual_seed(5)
    torch.rand(3, device=dev, generator=g)
    twin = copy_of(g)
    from_twin = torch.rand(4, device=dev, generator=twin)
    from_original = torch.rand(4, device=dev, generator=g)
    return {"twin": from_twin.cpu(), "original": from_original.cpu(), "device": twin.device.type,
            "seed": twin.initial_seed()}


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copied_cuda_generator_is_an_independent_twin(how):
    """Copied, a 'cuda' generator was a CPU generator aliasing the original (the carrier's seed
    names the gateway's generator): drawing from the copy advanced the original."""
    expected = _drawn_after_copy("cpu", COPIES[how])
    got = _drawn_after_copy("cuda", COPIES[how])
    assert got["device"] == "cuda"
    assert got["seed"] == expected["seed"]
    torch.testing.assert_close(got["twin"], expected["twin"])
    torch.testing.assert_close(got["original"], expected["original"])


def test_the_default_cuda_generator_clones_to_a_generator_of_its_state():
    torch.manual_seed(7)
    twin = torch.cuda.default_generators[0].clone_state()
    assert twin.device == torch.device("cuda", 0)
    torch.testing.assert_close(torch.rand(4, device="cuda", generator=twin).cpu(),
                               torch.rand(4, device="cuda").cpu())


@pytest.mark.parametrize("set_state", [
    torch.cuda.set_rng_state,
    lambda s: torch.cuda.set_rng_state_all([s]),
    lambda s: torch.cuda.default_generators[0].set_state(s),
    lambda s: torch.Generator("cuda").set_state(s),
])
def test_a_rng_state_not_a_byte_tensor_is_refused_at_the_call(set_state):
    """torch checks the state's type as it is set (TypeError); here a float state was sent as its
    bytes, and the gateway's refusal came at a later sync, from an unrelated op, as a RuntimeError
    about the state's size."""
    with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):
        set_state(torch.zeros(16))
    torch.testing.assert_close(torch.ones(2, device="cuda").sum().cpu(), torch.tensor(2.0))


@pytest.mark.parametrize("seed", [-1, 2**63 + 5])
def test_initial_seed_is_the_seed_as_torch_keeps_it(seed):
    """torch keeps a seed as an unsigned 64-bit number: ``manual_seed(-1).initial_seed()`` is 2**64 - 1."""
    expected = torch.Generator().manual_seed(seed).initial_seed()
    assert torch.Generator("cuda").manual_seed(seed).initial_seed() == expected
