"""A 'cuda' ``torch.Generator`` copied (``clone_state``, ``copy.deepcopy``, pickle) and the CUDA
RNG state set, as a GPU machine's torch does them: a copy is a new generator on the same device
that draws what the original would draw next, independently of it, and a state that is not a
ByteTensor is refused at the call (the Reformer's reversible layers, activation checkpointing and
``fork_rng`` save and restore these states)."""
from __future__ import annotations

import copy
import json
import pickle
import re
from collections.abc import Callable

import pytest
import torch

from conftest import GatewayProcess

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


#: a CUDA generator's Philox state, as a program reaches it: its offset and its graph-safe state
PHILOX_CALLS: dict[str, Callable[[], object]] = {
    "get_offset": lambda: torch.Generator("cuda").get_offset(),
    "set_offset": lambda: torch.Generator("cuda").set_offset(4),
    "default get_offset": lambda: torch.cuda.default_generators[0].get_offset(),
    "_get_rng_state_offset": torch.cuda._get_rng_state_offset,
    "_set_rng_state_offset": lambda: torch.cuda._set_rng_state_offset(8),
    "graphsafe_get_state": lambda: torch.Generator("cuda").graphsafe_get_state(),
    "default graphsafe_get_state": lambda: torch.cuda.default_generators[0].graphsafe_get_state(),
    "graphsafe_set_state": lambda: torch.Generator("cuda").graphsafe_set_state(torch.Generator("cuda")),
}


@pytest.mark.parametrize("call", sorted(PHILOX_CALLS))
def test_a_cpu_served_device_refuses_philox_state_at_the_call_saying_why(call):
    """A GPU's generator has a Philox offset and a graph-safe state; a CPU-served device's (a Mersenne
    Twister) has neither. These reached the client's CPU carrier, whose error blamed a "CPU Generator"
    the program never made (and ``set_offset`` would have set the carrier's, changing nothing)."""
    with pytest.raises(NotImplementedError, match="served by its gateway's CPU.*needs a gateway serving a GPU"):
        PHILOX_CALLS[call]()
    assert torch.ones(2, device="cuda").sum().item() == 2.0  # the session goes on


@pytest.mark.parametrize("offset", [1.5, True, 2**64])
def test_an_offset_torch_refuses_is_refused_at_the_call_with_its_error(offset):
    with pytest.raises(Exception) as local:  # noqa: PT011 - compared with the remote error below
        torch.Generator().set_offset(offset)
    with pytest.raises(type(local.value), match=re.escape(str(local.value))):
        torch.Generator("cuda").set_offset(offset)


def test_graphsafe_set_state_of_a_cpu_generator_is_torchs_error():
    with pytest.raises(RuntimeError, match="Expected a CUDA Generator"):
        torch.Generator("cuda").graphsafe_set_state(torch.Generator())


#: what a program sees of a CUDA generator's Philox state, printed as JSON (run on a GPU, locally and
#: through a ``--device cuda`` gateway with CUDA hidden from the client)
_PHILOX_PROGRAM = """
import json, sys, torch
if len(sys.argv) > 1:
    import remotecuda
    remotecuda.activate(sys.argv[1], fallback="error")
out = {}
g = torch.Generator("cuda").manual_seed(5)
out["fresh"] = g.get_offset()
first = torch.rand(10, device="cuda", generator=g).tolist()
out["after_draw"] = g.get_offset()
g.set_offset(0)
out["redrawn"] = torch.rand(10, device="cuda", generator=g).tolist() == first
try:
    g.set_offset(2)
except RuntimeError as e:
    out["odd_offset"] = str(e).splitlines()[0]
shared = g.graphsafe_get_state()
out["shared_seed"] = shared.initial_seed()
torch.rand(100, device="cuda", generator=shared)
out["shared_advances_source"] = g.get_offset()
other = torch.Generator("cuda").manual_seed(9)
other.graphsafe_set_state(shared)
out["other_offset"] = other.get_offset()
out["other_draw"] = torch.rand(3, device="cuda", generator=other).tolist()
out["source_offset_after_other"] = g.get_offset()
torch.cuda.manual_seed(3)
torch.randn(7, device="cuda")
out["default_offset"] = torch.cuda._get_rng_state_offset()
torch.cuda._set_rng_state_offset(0)
out["default_redraw"] = torch.randn(3, device="cuda").tolist()
out["default_shared"] = torch.cuda.default_generators[0].graphsafe_get_state().get_offset()
print(json.dumps(out))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU, for a --device cuda gateway and local CUDA")
def test_philox_offset_and_graphsafe_state_on_a_gpu_gateway_are_the_cuda_generators(run_python):
    gw = GatewayProcess("--device", "cuda")
    try:
        local = run_python(_PHILOX_PROGRAM)
        remote = run_python("", env={"CUDA_VISIBLE_DEVICES": ""}, args=["-c", _PHILOX_PROGRAM, gw.endpoint])
    finally:
        gw.stop()
    assert local.returncode == 0, local.stderr
    assert remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout.splitlines()[-1]) == json.loads(local.stdout.splitlines()[-1])
