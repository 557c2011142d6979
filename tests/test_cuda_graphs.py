"""CUDA graphs, unchanged code: ``torch.cuda.graph``, ``CUDAGraph.replay`` and
``make_graphed_callables`` against a gateway give what eager PyTorch gives on the local CPU,
and static tensors keep their identity across replays, as on a GPU."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

STEPS = 6


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(n)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adam":  # capturable, as CUDA graphs need it; its CPU reference computes the same otherwise
        on_cuda = next(model.parameters()).is_cuda
        return torch.optim.Adam(model.parameters(), lr=1e-2, capturable=on_cuda)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _eager(kind: str) -> list[torch.Tensor]:
    """The reference: three warm-up steps, then one step per batch, on the local CPU."""
    model, data = _model(), _data(STEPS + 1)
    opt = _optimizer(model, kind)
    batches = [data[0]] * 3 + data[1:]
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_whole_step_capture_matches_eager(remote, kind):
    """PyTorch's whole-network example: warm up on a side stream, capture forward, backward and
    ``optimizer.step()`` once, then replay with new data copied into the static inputs."""
    model, data = _model().cuda(), _data(STEPS + 1)
    opt = _optimizer(model, kind)
    static_x, static_y = data[0][0].cuda(), data[0][1].cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(static_x), static_y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    before = [p.detach().cpu() for p in model.parameters()]
    with torch.cuda.graph(g):
        static_loss = nn.functional.mse_loss(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    for p, b in zip(model.parameters(), before):  # capture runs nothing that changes state
        assert torch.equal(p.detach().cpu(), b)
    losses = []
    for x, y in data[1:]:
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()
        losses.append(static_loss.item())
    assert len(set(losses)) == len(losses)  # the static loss is refilled by every replay
    for p, ref in zip(model.parameters(), _eager(kind)):
        torch.testing.assert_close(p.detach().cpu(), ref, rtol=1e-5, atol=1e-6)


def test_static_outputs_and_their_views_keep_identity(remote):
    x = torch.zeros(5, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = (x + 1) * 2
        tail = y[2:]
        z = y.exp_()
    assert z is y
    head = y[:2]  # a view made after capture sees every replay's values too
    for v in (torch.arange(5.0), torch.ones(5)):
        x.copy_(v)
        g.replay()
        ref = ((v + 1) * 2).exp()
        assert torch.equal(y.cpu(), ref)
        assert torch.equal(tail.cpu(), ref[2:]) and torch.equal(head.cpu(), ref[:2])


def test_replay_advances_random_streams(remote):
    torch.cuda.manual_seed(3)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        noise = torch.rand(1000, device="cuda")
    g.replay()
    first = noise.cpu()
    g.replay()
    assert not torch.equal(first, noise.cpu())
    assert first.min() >= 0.0 and first.max() < 1.0


def test_make_graphed_callables_trains_as_eager(remote):
    data = _data(STEPS)
    ref_model = _model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    model = _model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sample = torch.randn(16, 8, device="cuda", requires_grad=False)
    graphed = torch.cuda.make_graphed_callables(model, (sample,), num_warmup_iters=3)
    for (x, y) in data:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(graphed(x.cuda()), y.cuda()).backward()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ref_model(x), y).backward()
        ref_opt.step()
    for p, ref in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), ref.detach(), rtol=1e-6, atol=1e-7)


def test_a_sync_inside_capture_fails_as_on_a_gpu_and_the_session_goes_on(remote):
    x = torch.ones(3, device="cuda")
    g = torch.cuda.CUDAGraph()
    assert not torch.cuda.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"), torch.cuda.graph(g):
        assert torch.cuda.is_current_stream_capturing()
        (x * 2).sum().item()
    assert not torch.cuda.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="capture failed|not been captured|invalidated"):
        g.replay()
        torch.cuda.synchronize()
    assert (x * 3).sum().item() == 9.0


def test_reset_graph_cannot_replay(remote):
    x = torch.ones(3, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x + 1
    g.replay()
    assert torch.equal(y.cpu(), torch.full((3,), 2.0))
    g.reset()
    with pytest.raises(RuntimeError, match="not been captured"):
        g.replay()


def test_an_optimizers_first_step_may_be_captured(remote):
    """The first step of an optimizer waits for the work before it (an OOM is raised before it
    makes state), but not inside a capture, where a GPU's torch could not wait either."""
    torch.manual_seed(0)
    model, x = nn.Linear(2, 2), torch.ones(1, 2)
    local = copy.deepcopy(model)
    opt = torch.optim.SGD(model.cuda().parameters(), lr=0.1)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        model(x.cuda()).sum().backward()
        opt.step()
    g.replay()
    local(x).sum().backward()
    torch.optim.SGD(local.parameters(), lr=0.1).step()
    assert torch.equal(model.weight.detach().cpu(), local.weight.detach())


def test_a_generator_dropped_during_a_capture_leaves_the_capture_whole(remote):
    """A dropped generator is forgotten with the session's next message, which a long capture sends
    mid-capture (every BATCH_OPS ops): forgetting a Python object is no device work, and the
    gateway refused it there ("rc::gen_free inside a CUDA graph capture"), failing the capture."""
    from remotecuda.session import BATCH_OPS
    x = torch.ones(4, device="cuda")
    gen = torch.Generator("cuda").manual_seed(3)
    torch.rand(2, device="cuda", generator=gen)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        del gen
        y = x
        for _ in range(BATCH_OPS + 8):
            y = y + 1
    g.replay()
    assert torch.equal(y.cpu(), torch.full((4,), BATCH_OPS + 9.0))
