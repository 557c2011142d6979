"""``DistributedDataParallel`` over a 'cuda' model (remotecuda/ddp.py), as a ``torchrun`` script
writes it: ``init_process_group("nccl")``, ``DDP(model.cuda(), device_ids=[rank])``, ``no_sync()``
for gradient accumulation, a state_dict with 'module.' keys. Each is compared with the same
program run with gloo on the local CPU, whose DDP is torch's own C++ Reducer."""
from __future__ import annotations

import copy
import os
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import ROOT, run_python


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _train(ddp: nn.Module, dev: str, seed: int) -> dict:
    """Three steps, the second accumulating a ``no_sync()`` backward first; the final state and loss."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    for step in range(3):
        x = torch.randn(6, 8, generator=g).to(dev)
        opt.zero_grad()
        if step == 1:
            with ddp.no_sync():
                ddp(x).pow(2).mean().backward()
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
    return {**{k: v.cpu() for k, v in ddp.state_dict().items()}, "loss": loss.detach().cpu()}


def test_a_one_process_world_trains_a_cuda_model_as_torchs_ddp_on_the_cpu(remote, tmp_path):
    """(It raised NotImplementedError: the Reducer's C++ cannot reach a remote tensor.)"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        assert dist.get_backend() == "gloo"
        assert any("'nccl' backend runs as 'gloo'" in str(w.message) for w in caught)
        model = _model(0)
        local = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        ddp = nn.parallel.DistributedDataParallel(model.cuda(), device_ids=[0])
        assert isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp.module is model
        got, want = _train(ddp, "cuda", 1), _train(local, "cpu", 1)
        assert list(got) == list(want) and list(got)[0] == "module.0.weight"
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        with pytest.raises(NotImplementedError, match="remotecuda: DDP communication hooks"):
            ddp.register_comm_hook(None, lambda state, bucket: bucket)
    finally:
        dist.destroy_process_group()


PROGRAM = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    sys.path.insert(0, {tests!r})
    from test_ddp import _model, _train

    def run(rank, dev, rdv, out):
        if dev == "cuda":
            import remotecuda
            remotecuda.activate({server!r})
        dist.init_process_group("nccl" if dev == "cuda" else "gloo", init_method=rdv, rank=rank, world_size=2)
        model = _model(rank).to(dev)  # (each rank starts apart: DDP broadcasts rank 0's)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if dev == "cuda" else None)
        torch.save(_train(ddp, dev, 100 + rank), f"{{out}}.{{rank}}")
        dist.destroy_process_group()

    if __name__ == "__main__":
        dev, rdv, out = sys.argv[1:]
        mp.spawn(run, args=(dev, rdv, out), nprocs=2)
""")


def test_a_two_process_world_reduces_gradients_as_torchs_ddp(gateway, tmp_path):
    """Two ranks, each on 'cuda' through its own session, different data and initial weights:
    rank 0's weights broadcast, gradients averaged (the buffers, BatchNorm's running statistics,
    are broadcast before each forward)."""
    script = tmp_path / "ddp_train.py"
    script.write_text(PROGRAM.format(tests=os.path.join(ROOT, "tests"), server=gateway.address))
    results = {}
    for dev in ("cpu", "cuda"):
        r = run_python("", args=[str(script), dev, f"file://{tmp_path}/rdv-{dev}", str(tmp_path / dev)], timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        results[dev] = [torch.load(tmp_path / f"{dev}.{rank}") for rank in range(2)]
    for got, want in zip(results["cuda"], results["cpu"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(results["cpu"][0]["loss"], results["cpu"][1]["loss"])
    first, second = (results["cuda"][rank]["module.0.weight"] for rank in range(2))
    torch.testing.assert_close(first, second, rtol=0, atol=0)
