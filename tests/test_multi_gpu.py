"""Multi-GPU idioms as programs write them, on one gateway serving two simulated GPUs
(``--gpus 2``: cuda:0 and cuda:1): ``nn.DataParallel`` training and its state_dict, a model split
by hand over both devices, and the current-device API. Values are compared with the same program
on the local CPU."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from local_parity import data
from torch import nn

from conftest import GatewayProcess, active_over


@pytest.fixture(scope="module")
def two_gpus():
    """A gateway with two simulated GPUs and remotecuda active over it; the run's own activation after."""
    gw = GatewayProcess("--spare", "2", "--gpus", "2")  # (a worker ready for each device)
    try:
        with active_over(gw.address):
            yield gw
    finally:
        gw.stop()


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
    through the CPU, as on a GPU machine (gloo's C++ said "unsupported device type meta").
    ('nccl' and DDP: tests/test_ddp.py.)"""
    import torch.distributed as dist
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
    finally:
        dist.destroy_process_group()


class _TwoStage(nn.Module):
    """Model parallelism by hand: a stage per device, the activations moved between them, and a
    table shared by both (tied weights): the first stage uses its first half (``chunk``, the other
    half unused there), the second a copy of all of it."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__()
        self.first, self.second = first, second
        self.table = nn.Parameter(data(8, 10, seed=5).to(first))
        self.stage0 = nn.Sequential(nn.Linear(10, 16), nn.LayerNorm(16), nn.ReLU()).to(first)
        self.stage1 = nn.Linear(16, 5).to(second)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half, _ = self.table.chunk(2)
        side = x.to(self.first) @ half.t()
        h = self.stage0(x.to(self.first)).to(self.second)
        return side, self.stage1(h) + (x.to(self.second) @ self.table.to(self.second).t()).mean()


def _train_two_stages(first: str, second: str) -> list:
    torch.manual_seed(0)
    model = _TwoStage(first, second)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        side, out = model(data(20, 10, seed=step))
        loss = side.mean() + F.mse_loss(out, data(20, 5, seed=10 + step).to(second)).to(first)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return [losses, *(p.detach().cpu() for p in model.parameters())]


def test_a_model_split_by_hand_over_two_devices_trains_as_on_the_cpu(two_gpus):
    torch.testing.assert_close(_train_two_stages("cuda:0", "cuda:1"), _train_two_stages("cpu", "cpu"))


def _two_branches(first: str, second: str) -> list[torch.Tensor]:
    x = torch.arange(12.0).reshape(4, 3).to(first).requires_grad_()
    w = torch.ones(3, device=second, requires_grad=True)
    kept, _ = x.chunk(2)
    far = ((x.to(second) * w).relu() * 3).sum()  # (before the near branch: its backward runs after)
    loss = (kept * 2).sum() + far.to(first)
    loss.backward()
    return [x.grad.cpu(), w.grad.cpu()]


def test_zeros_a_backward_formula_makes_follow_a_copy_back(two_gpus):
    """The backward crosses from cuda:1 back to cuda:0 (the copy's backward) and then reaches the
    chunk, whose unused half gets zeros from the backward formula: they were made on cuda:1, the
    device of the last op run, as the copy did not count as one ("Expected all tensors to be on
    the same device")."""
    torch.testing.assert_close(_two_branches("cuda:0", "cuda:1"), _two_branches("cpu", "cpu"))


class _Pair(torch.autograd.Function):
    """A custom Function with two outputs (the program uses one)."""

    @staticmethod
    def forward(ctx: object, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t * 2, t * 3

    @staticmethod
    def backward(ctx: object, g1: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        return g1 * 2 + g2 * 3


def _interleaved(first: str, second: str) -> list[torch.Tensor]:
    far = torch.ones(4, device=second, requires_grad=True)
    near = torch.ones(4, device=first, requires_grad=True)
    used, _ = _Pair.apply(far)
    half, _ = far.chunk(2)
    near_loss = (near * 2).sum()  # (made between: its backward runs between the far nodes' backward)
    loss = near_loss + (used.sum() + half.sum()).to(first)
    loss.backward()
    return [far.grad.cpu(), near.grad.cpu()]


def test_zeros_autograd_makes_go_to_the_device_of_the_node(two_gpus):
    """The engine runs cuda:1's nodes after one of cuda:0's: the zeros autograd makes for a custom
    Function's unused output, and a chunk's backward for its unused half, went to cuda:0."""
    torch.testing.assert_close(_interleaved("cuda:0", "cuda:1"), _interleaved("cpu", "cpu"))


def test_from_pretrained_split_over_two_devices_and_the_cpu_generates_as_local(two_gpus, tmp_path):
    """``device_map="auto"`` with ``max_memory`` for both GPUs and the CPU: Accelerate's hooks move
    the activations from cuda:0 to cuda:1 to the offloaded layers; a DataParallel of the same
    model splits a batch's keyword inputs and gathers its ``ModelOutput``."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    ids = torch.arange(14).reshape(2, 7) * 7 % 100
    local = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    split = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, device_map="auto", max_memory={0: "120KiB", 1: "120KiB", "cpu": "1GiB"})
    assert {0, 1, "cpu"} <= set(split.hf_device_map.values()) and split.device == torch.device("cuda", 0)
    with torch.no_grad():
        torch.testing.assert_close(split(ids.cuda()).logits.cpu(), local(ids).logits)
        assert torch.equal(split.generate(ids.cuda(), max_new_tokens=4, do_sample=False, pad_token_id=0).cpu(),
                           local.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))
        parallel = nn.DataParallel(copy.deepcopy(local).cuda())
        with pytest.warns(UserWarning, match="all input tensors were scalars"):  # (the losses, as on GPUs)
            out = parallel(input_ids=ids.cuda(), labels=ids.cuda())
        halves = [local(input_ids=ids[i:i + 1], labels=ids[i:i + 1]) for i in range(2)]
    torch.testing.assert_close(out.logits.cpu(), torch.cat([h.logits for h in halves]))
    torch.testing.assert_close(out.loss.cpu(), torch.stack([h.loss for h in halves]))


def test_tensor_factories_of_a_cuda_tensor_move_it_to_the_device_named(two_gpus):
    """``torch.tensor`` / ``as_tensor`` / ``asarray`` of a cuda:0 tensor with ``device='cuda:1'``
    are on cuda:1, as on two GPUs; they stayed on cuda:0 (the route took the source as it was).
    ``as_tensor`` of a tensor already as asked is the tensor itself."""
    t = torch.arange(3.0, device="cuda:0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.tensor's advice to clone: test_warnings_parity.py)
        made = [torch.tensor(t, device="cuda:1"), torch.as_tensor(t, device="cuda:1"),
                torch.asarray(t, device="cuda:1", dtype=torch.float64)]
    assert [(m.device, m.dtype) for m in made] == [(torch.device("cuda:1"), torch.float32)] * 2 + \
        [(torch.device("cuda:1"), torch.float64)]
    assert all(m.tolist() == [0.0, 1.0, 2.0] for m in made)
    assert torch.as_tensor(t, device="cuda:0") is t


def test_asarray_without_a_copy_refuses_another_gpu(two_gpus):
    """``torch.asarray(t, device=..., copy=False)`` of a cuda:0 tensor onto cuda:1, or onto
    'cuda' while cuda:1 is current (torch gives 'cuda' the current index): torch's ValueError;
    the upload copied it there. On its own GPU it is the tensor itself."""
    t = torch.arange(3.0, device="cuda:0")
    refused = "^can't alias tensor from device 'cuda:0' to 'cuda:1'.$"
    with pytest.raises(ValueError, match=refused):
        torch.asarray(t, device="cuda:1", copy=False)
    with torch.cuda.device(1), pytest.raises(ValueError, match=refused):
        torch.asarray(t, device="cuda", copy=False)
    assert torch.asarray(t, device="cuda", copy=False) is t
