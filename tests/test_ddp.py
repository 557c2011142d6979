"""``DistributedDataParallel`` over a 'cuda' model (remotecuda/ddp.py), as a ``torchrun`` script
writes it: ``init_process_group("nccl")``, ``DDP(model.cuda(), device_ids=[rank])``, ``no_sync()``
for gradient accumulation, a state_dict with 'module.' keys. Each is compared with the same
program run with gloo on the local CPU, whose DDP is torch's own C++ Reducer."""
from __future__ import annotations

import copy
import os
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import ROOT, GatewayProcess, run_python


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


def test_a_parameter_without_a_gradient_stops_the_next_forward_as_torchs_ddp(remote, tmp_path):
    """Without ``find_unused_parameters``, a backward that left a parameter without a gradient makes
    the next forward with grad raise the Reducer's error, as torch's DDP does (a forward without grad
    passes); it was silently reduced as zeros."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        def run(dev: str) -> tuple:
            ddp = nn.parallel.DistributedDataParallel(_Branchy().to(dev))
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0)).to(dev)
            ddp(x, True).sum().backward()
            ddp(x, False).sum().backward()  # (b unused)
            with torch.no_grad():
                ddp(x, True)
            errors = []
            for _ in range(2):
                with pytest.raises(RuntimeError) as info:
                    ddp(x, True)
                errors.append(str(info.value))
            return errors, ddp.module.b.weight.grad.cpu()

        (got, got_grad), (want, want_grad) = run("cuda"), run("cpu")
        assert got == want and "did not receive grad for rank 0: 2 3\n" in got[0]
        assert torch.equal(got_grad, want_grad)
    finally:
        dist.destroy_process_group()


class _Unused(nn.Module):
    """Unused parameters of the root (named '.v' by DDP), of a child, and a shared one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w, self.v = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
        self.seq = nn.Sequential(*[nn.Linear(3, 3) for _ in range(12)])
        self.seq[7].weight = self.seq[2].weight  # (DDP names a shared parameter by its last module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq[3](x) * self.w


@pytest.mark.parametrize("level", ["INFO", "DETAIL"])
def test_the_unfinished_reduction_error_names_the_parameters_with_torch_distributed_debug(remote, tmp_path,
                                                                                         monkeypatch, level):
    """With TORCH_DISTRIBUTED_DEBUG=INFO or DETAIL the Reducer's error names the parameters that got
    no gradient (in its order); it gave the indices only, and told the user to set that variable.
    (The reference is CPU DDP at INFO: the message is the same at DETAIL, where this CPU torch's DDP
    crashes when made.)"""
    before = dist.get_debug_level()

    def error(dev: str, level: str) -> str:
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", level)
        dist.set_debug_level_from_env()  # (as torch.distributed's import reads it)
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/{dev}", rank=0, world_size=1)
        try:
            ddp = nn.parallel.DistributedDataParallel(_Unused().to(dev))
            x = torch.randn(2, 3).to(dev)
            ddp(x).sum().backward()
            with pytest.raises(RuntimeError) as info:
                ddp(x)
            return str(info.value)
        finally:
            dist.destroy_process_group()
            dist.set_debug_level(before)

    got, want = error("cuda", level), error("cpu", "INFO")
    assert got == want
    assert got.endswith("\nParameters which did not receive grad for rank 0: seq.11.bias, seq.11.weight, seq.10.bias, "
                        "seq.10.weight, seq.9.bias, seq.9.weight, seq.8.bias, seq.8.weight, seq.7.bias, seq.6.bias, "
                        "seq.6.weight, seq.5.bias, seq.5.weight, seq.4.bias, seq.4.weight, seq.2.bias, seq.7.weight, "
                        "seq.1.bias, seq.1.weight, seq.0.bias, seq.0.weight, .v\nParameter indices which did not "
                        "receive grad for rank 0: 1 2 3 4 5 6 7 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24")


#: a torchrun script as its tutorials write it: 'cuda' when there is one, nccl with it
PROGRAM = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from test_ddp import _model, _train

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    dev = f"cuda:{{local}}" if cuda else "cpu"
    model = _model(rank).to(dev)  # (each rank starts apart: DDP broadcasts rank 0's)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None)
    result = _train(ddp, dev, 100 + rank)
    torch.save({{**result, "device": str(model[0].weight.device)}}, os.path.join({out!r}, f"{{dev[:4]}}.{{rank}}"))
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def two_gpus():
    gw = GatewayProcess("--spare", "2", "--gpus", "2")
    try:
        yield gw
    finally:
        gw.stop()


def test_torchrun_of_two_ranks_reduces_gradients_as_torchs_ddp(two_gpus, tmp_path):
    """``remotecuda run torchrun --nproc_per_node 2`` of an unchanged DDP script: each rank on
    its own 'cuda:LOCAL_RANK', different data and initial weights; rank 0's weights broadcast,
    gradients averaged, BatchNorm's running statistics broadcast before each forward; equal to the
    same script under plain torchrun on the CPU."""
    script = tmp_path / "ddp_train.py"
    script.write_text(PROGRAM.format(tests=os.path.join(ROOT, "tests"), out=str(tmp_path)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    for args in (torchrun, [sys.executable, "-m", "remotecuda", "run", "--server", two_gpus.address, *torchrun]):
        r = run_python("", args=args[1:], timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
    cpu, cuda = ([torch.load(tmp_path / f"{dev}.{rank}") for rank in range(2)] for dev in ("cpu", "cuda"))
    assert [c.pop("device") for c in cuda] == ["cuda:0", "cuda:1"]
    for got, want in zip(cuda, cpu):  # (to float32's tolerance: torchrun runs the CPU's ranks on one thread)
        want.pop("device")
        torch.testing.assert_close(got, want)
    assert not torch.equal(cpu[0]["loss"], cpu[1]["loss"])
    torch.testing.assert_close(cuda[0]["module.0.weight"], cuda[1]["module.0.weight"], rtol=0, atol=0)


class _Branchy(nn.Module):
    """A branch only some ranks take (``find_unused_parameters=True``'s case)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if branch else self.a(x)


def _scenario(name: str, dev: str, rank: int) -> dict:
    """What the ranks of ``SCENARIO`` run: ``name``'s final state."""
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(6, 8, generator=g).to(dev) for _ in range(3)]
    DDP = nn.parallel.DistributedDataParallel
    if name == "unused_branch":  # (rank 1 never takes b: its optimizer must step b with rank 0's gradient)
        ddp = DDP(_Branchy().to(dev), find_unused_parameters=True)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x in xs[:2]:
            opt.zero_grad()
            ddp(x, rank == 0).sum().backward()
            opt.step()
    elif name == "accumulation_keeps_each_ranks_statistics":  # (buffers broadcast before the first forward only)
        ddp = DDP(_model(0).to(dev))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with ddp.no_sync():
            for x in xs[:2]:
                ddp(x).pow(2).mean().backward()
        ddp(xs[2]).pow(2).mean().backward()
        opt.step()
    else:  # "deepcopy": the copy reduces its own gradients
        ddp = copy.deepcopy(DDP(_model(0).to(dev)))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x in xs[:2]:
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            opt.step()
    return {k: v.detach().cpu() for k, v in ddp.state_dict().items()}


SCENARIO = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from test_ddp import _scenario

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    dev = f"cuda:{{local}}" if cuda else "cpu"
    torch.save(_scenario({name!r}, dev, rank), os.path.join({out!r}, f"{{dev[:4]}}.{{rank}}"))
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("name", ["unused_branch", "accumulation_keeps_each_ranks_statistics", "deepcopy"])
def test_what_ddp_does_beyond_averaging_is_done_as_torchs_ddp_on_the_cpu(two_gpus, tmp_path, name):
    """unused_branch: rank 1's b.grad stayed None, its optimizer skipped b, the ranks' weights
    parted. accumulation: each forward broadcast rank 0's BatchNorm statistics, where DDP skips
    the broadcast after a forward inside no_sync(). deepcopy: KeyError 'reducer'."""
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO.format(tests=os.path.join(ROOT, "tests"), name=name, out=str(tmp_path)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    for args in (torchrun, [sys.executable, "-m", "remotecuda", "run", "--server", two_gpus.address, *torchrun]):
        r = run_python("", args=args[1:], timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"cuda.{rank}"), torch.load(tmp_path / f"cpu.{rank}"))


@pytest.mark.parametrize("wrap", ["FullyShardedDataParallel", "fully_shard"])
def test_fsdp_over_a_cuda_model_is_refused_by_name(remote, tmp_path, wrap):
    """(FullyShardedDataParallel failed in gloo with 'unsupported device type meta', fully_shard
    with a RecursionError in DTensor's dispatch: neither said what is unsupported.)"""
    import torch.distributed.fsdp as fsdp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        with pytest.raises(NotImplementedError, match=f"remotecuda: {wrap} over a model on 'cuda'"):
            getattr(fsdp, wrap)(_model(0).cuda())
    finally:
        dist.destroy_process_group()


def test_all_gather_into_a_flat_cuda_tensor_takes_what_nccl_takes(remote, tmp_path):
    """accelerate's ``gather`` (``gather_for_metrics``) on an 'nccl' group gathers a (3, 4) tensor
    into a flat one of 3 * 4 * world elements, which NCCL takes; run as gloo it raised
    'ProcessGroupGloo::allgather: invalid tensor size'. (torch 2.13's ``all_gather_single``, which
    accelerate calls, was not staged at all.)"""
    with pytest.warns(UserWarning, match="'nccl' backend runs as 'gloo'"):
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        x = torch.randn(3, 4)
        flat = torch.empty(12, device="cuda")
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (as accelerate picks)
        gather(flat, x.cuda())
        torch.testing.assert_close(flat.cpu(), x.reshape(-1), rtol=0, atol=0)
        stacked = torch.empty(1, 3, 4, device="cuda")
        gather(stacked, x.cuda())
        torch.testing.assert_close(stacked.cpu(), x[None], rtol=0, atol=0)
    finally:
        dist.destroy_process_group()
