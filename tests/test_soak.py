"""What a long session does many times must not leave anything behind on the gateway or in the
client: each loop here runs a few dozen times and checks counts, not timings."""
from __future__ import annotations

import gc

import pytest
import torch

import remotecuda
from remotecuda import runtime

pytestmark = pytest.mark.usefixtures("remote")


def _session():
    return runtime.current().pool.sessions[0]


def test_a_generator_made_per_call_is_freed_on_the_gateway():
    """``generator=torch.Generator('cuda').manual_seed(s)`` made at each call (a diffusers pipeline's
    idiom): each dropped one goes from the gateway, which a snapshot shows, and the one kept still draws."""
    keep = torch.Generator(device="cuda").manual_seed(7)
    for i in range(40):
        g = torch.Generator(device="cuda").manual_seed(i)
        torch.randn(3, device="cuda", generator=g)
    del g
    gc.collect()
    got = torch.randn(5, device="cuda", generator=keep)
    remotecuda.checkpoint()
    log = _session().log
    if log is None:
        pytest.skip("REMOTECUDA_FAILOVER=off: no snapshot to count the gateway's generators with")
    assert len(log.snapshot.generators) <= 2, len(log.snapshot.generators)  # keep (and one a cycle held)
    assert torch.equal(got.cpu(), torch.randn(5, generator=torch.Generator().manual_seed(7)))
