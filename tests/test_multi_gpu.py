"""Multi-GPU idioms as programs write them, on one gateway serving two simulated GPUs
(``--gpus 2``: cuda:0 and cuda:1): ``nn.DataParallel`` training and its state_dict, a model split
by hand over both devices, and the current-device API. Values are compared with the same program
on the local CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from local_parity import data
from torch import nn

import remotecuda
from remotecuda import visible_devices

from conftest import GatewayProcess


@pytest.fixture(scope="module")
def two_gpus():
    """A gateway with two simulated GPUs and remotecuda active over it; the run's own activation after."""
    gw = GatewayProcess("--spare", "1", "--gpus", "2")
    previous = remotecuda.runtime.active()
    restore = previous and list(dict.fromkeys(d.endpoint.removeprefix("tcp://") for d in previous.pool.devices))
    remotecuda.deactivate()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(visible_devices.VAR, raising=False)
        remotecuda.activate(gw.address, fallback="error")
        try:
            yield gw
        finally:
            remotecuda.deactivate()
            gw.stop()
    if restore:
        remotecuda.activate(restore, fallback="error")


class _WithUnused(nn.Module):
    """A classifier with a head the forward does not use (a frozen or optional branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.head(torch.relu(self.body(x))), 1)


def test_data_parallel_trains_a_model_with_unused_parameters(two_gpus):
    """The tutorial's ``if device_count() > 1: DataParallel``, with a parameter no replica uses:
    its gradient is zeros on cuda:0 as on GPUs (autograd's zeros for replica 1's unused copy were
    made on cuda:0 and the coalesced sum mixed devices), and the saved state_dict ('module.'
    keys) loads into the plain model."""
    torch.manual_seed(0)
    model = _WithUnused()
    local = copy.deepcopy(model)
    assert torch.cuda.device_count() == 2
    dp = nn.DataParallel(model).to("cuda")
    opt, local_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (dp, local))
    for step in range(2):
        x, y = data(12, 8, seed=step), torch.arange(12) % 4
        loss = F.nll_loss(dp(x.cuda()), y.cuda())
        opt.zero_grad()
        loss.backward()
        local_loss = F.nll_loss(local(x), y)
        local_opt.zero_grad()
        local_loss.backward()
        torch.testing.assert_close(loss.item(), local_loss.item())
        assert model.aux.weight.grad.device == torch.device("cuda", 0)
        assert not model.aux.weight.grad.cpu().any() and local.aux.weight.grad is None
        opt.step()
        local_opt.step()
    state = dp.state_dict()
    assert list(state)[0] == "module.body.weight" and state["module.body.weight"].device == torch.device("cuda", 0)
    plain = _WithUnused()
    plain.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    torch.testing.assert_close(plain.state_dict(), local.state_dict())


def test_torch_distributed_gloo_collectives_on_cuda_tensors(two_gpus):
    """A one-process world (a torchrun script run alone): gloo's collectives on 'cuda' tensors go
    through the CPU, as on a GPU machine (gloo's C++ said "unsupported device type meta"); 'nccl',
    and DDP over a 'cuda' model, are refused naming remotecuda."""
    import torch.distributed as dist
    with pytest.raises(RuntimeError, match="remotecuda: torch.distributed's 'nccl' backend"):
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)  # (no backend: gloo)
    try:
        assert dist.get_backend() == "gloo"
        t = torch.arange(4.0, device="cuda:1")
        dist.all_reduce(t)
        gathered = [torch.zeros(4, device="cuda")]
        dist.all_gather(gathered, t)
        into = torch.zeros(4, device="cuda:1")
        dist.broadcast(t, 0, async_op=True).wait()
        dist.all_to_all_single(into, t)
        assert gathered[0].device == torch.device("cuda", 0) and into.device == torch.device("cuda", 1)
        torch.testing.assert_close([t.cpu(), gathered[0].cpu(), into.cpu()], [torch.arange(4.0)] * 3)
        with pytest.raises(NotImplementedError, match="remotecuda: DistributedDataParallel"):
            nn.parallel.DistributedDataParallel(nn.Linear(3, 2).cuda())
    finally:
        dist.destroy_process_group()
