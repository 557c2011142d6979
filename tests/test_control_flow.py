"""torch.cond, while_loop and map (torch's control-flow higher-order ops) on 'cuda' tensors: the
predicate is read and the branch's ops run on the gateway, with gradients, as a GPU's eager run
does; on CPU tensors while active they keep their gradients too."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.while_loop import while_loop  # (imported before activation: the op itself)

pytestmark = pytest.mark.usefixtures("remote")


def _seeded(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cond_step(dev: str, sign: float, plain: bool) -> tuple:
    """A module whose forward branches on a tensor, trained one backward: the gradients reach the
    operand and the parameters the branches close over."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).to(dev)
    x = (_seeded(2, 4) * sign).to(dev).requires_grad_()

    def pos(x: torch.Tensor) -> torch.Tensor:
        return lin(x).sin()

    def neg(x: torch.Tensor) -> torch.Tensor:
        return lin(x.abs()).cos() * 2
    y = (pos(x) if x.sum() > 0 else neg(x)) if plain else torch.cond(x.sum() > 0, pos, neg, (x,))
    y.square().sum().backward()
    return y.detach().cpu(), x.grad.cpu(), lin.weight.grad.cpu(), lin.bias.grad.cpu()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_on_a_tensor_runs_the_branch_with_gradients(sign):
    expected = _cond_step("cpu", sign, plain=True)
    torch.testing.assert_close(_cond_step("cuda", sign, plain=False), expected)
    torch.testing.assert_close(_cond_step("cpu", sign, plain=False), expected)  # (CPU tensors while active)


def test_while_loop_and_map_on_cuda_tensors():
    def loop(dev: str, fn) -> tuple:
        i, x = torch.tensor(0, device=dev), _seeded(3).to(dev)
        out = fn(lambda i, x: i < 4, lambda i, x: (i + 1, x * 2 + 1), (i, x))
        return tuple(t.cpu() for t in out)
    expected = (torch.tensor(4), ((((_seeded(3) * 2 + 1) * 2 + 1) * 2 + 1) * 2 + 1))
    torch.testing.assert_close(loop("cpu", torch._higher_order_ops.while_loop), expected)
    torch.testing.assert_close(loop("cuda", torch._higher_order_ops.while_loop), expected)
    torch.testing.assert_close(loop("cuda", while_loop), expected)  # (the op reaches the dispatch mode)
    none = while_loop(lambda x: x.sum() > 1e9, lambda x: (x + 1,), (torch.ones(2, device="cuda"),))
    torch.testing.assert_close(none[0].cpu(), torch.ones(2))

    xs, w = _seeded(5, 3), _seeded(3, seed=1)
    got = hop_map(lambda x, w: {"a": x * w, "b": x.sum()}, xs.cuda(), w.cuda())
    torch.testing.assert_close({k: v.cpu() for k, v in got.items()}, {"a": xs * w, "b": xs.sum(1)})


def test_cond_op_itself_and_cond_inside_torch_compile():
    x = _seeded(4)
    got = torch.ops.higher_order.cond(x.cuda().sum() > 0, lambda t: (t.exp(),), lambda t: (t.neg(),), (x.cuda(),))
    torch.testing.assert_close(got[0].cpu(), x.exp() if x.sum() > 0 else x.neg())

    lin = nn.Linear(4, 4)
    ref = nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())
    lin.cuda()

    def f(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.mean() > 0, lambda x: m(x), lambda x: m(-x), (x,)).relu().sum()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(lambda x: f(lin, x))(x.view(1, 4).cuda())
    assert [str(w.message).split(": ", 1)[1] for w in caught] == [
        "torch.compile runs test_cond_op_itself_and_cond_inside_torch_compile.<locals>.<lambda> eagerly: it calls "
        "torch.cond, while_loop or map on a tensor (the graph cannot hold their functions)"]
    out.backward()
    expected = f(ref, x.view(1, 4))
    expected.backward()
    torch.testing.assert_close(out.cpu(), expected)
    torch.testing.assert_close(lin.weight.grad.cpu(), ref.weight.grad)



def test_a_function_imported_before_activation_takes_gradients_too():
    """``while_loop`` imported at the top of this file reaches the op itself, whose autograd rule
    would trace the body with make_fx on the remote tensors."""
    w = _seeded(3)

    def grads(dev: str, fn) -> tuple:
        x, scale = torch.ones(3, device=dev, requires_grad=True), w.to(dev).detach().requires_grad_()
        out, = fn(lambda x: x.sum() < 50, lambda x: (x * 2 + scale,), (x,))
        out.sum().backward()
        return out.detach().cpu(), x.grad.cpu(), scale.grad.cpu()
    expected = grads("cpu", torch._higher_order_ops.while_loop)
    torch.testing.assert_close(grads("cuda", while_loop), expected)
