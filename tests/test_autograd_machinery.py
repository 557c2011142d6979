"""Autograd machinery on 'cuda', against the local CPU and a GPU's own errors: second derivatives
through recurrent layers (gradient penalties, MAML, Hessian-vector products)."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from local_parity import data
from torch import nn

pytestmark = pytest.mark.usefixtures("remote")


def _input_gradient_penalty(m: nn.Module, x: torch.Tensor, cudnn: bool) -> list[torch.Tensor]:
    """WGAN-GP's penalty on an RNN critic: the gradient of its output by its input, differentiated again."""
    x = x.detach().requires_grad_()
    with torch.backends.cudnn.flags(enabled=cudnn):
        out, _ = m(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    g.pow(2).sum().backward()
    return [g.detach().cpu(), x.grad.cpu(), *(p.grad.cpu() for p in m.parameters())]


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_rnn_double_backward_with_cudnn_disabled_matches_local(cls):
    """cuDNN disabled around the forward (the cure torch's error names): a GPU's native RNN, twice
    differentiable, and the second derivatives equal the CPU's."""
    torch.manual_seed(0)
    m = cls(3, 4, num_layers=2, batch_first=True)
    x = data(2, 5, 3)
    want = _input_gradient_penalty(m, x, cudnn=True)
    got = _input_gradient_penalty(copy.deepcopy(m).cuda(), x.cuda(), cudnn=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_rnn_double_backward_through_cudnn_raises_as_on_a_gpu():
    """The gradient through cuDNN's RNN requires grad, and differentiating it raises torch's
    NotImplementedError with its cure, where it gave no graph at all ("does not require grad")."""
    m = nn.LSTM(3, 4).cuda()
    x = data(5, 2, 3).cuda().requires_grad_()
    out, _ = m(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    assert g.requires_grad
    with pytest.raises(NotImplementedError, match=r"(?s)the derivative for '_cudnn_rnn_backward' is not implemented\. "
                       r"Double backwards is not supported for CuDNN RNNs.*cudnn\.flags\(enabled=False\)"):
        g.pow(2).sum().backward()


def test_hessian_vector_product_through_an_rnn_is_not_silently_zero():
    """torch.autograd.functional.hvp by the weights of a GRU: on a GPU cuDNN's RNN refuses it, and
    with cuDNN disabled it equals the CPU's; the parameters' second gradient was zeros."""
    torch.manual_seed(0)
    m = nn.GRU(3, 4)
    x = data(5, 2, 3)

    def hvp(model: nn.Module, inp: torch.Tensor) -> torch.Tensor:
        names = [n for n, _ in model.named_parameters()]
        params = tuple(model.parameters())

        def loss(*ps: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(model, dict(zip(names, ps)), (inp,))[0].pow(2).sum()
        return torch.autograd.functional.hvp(loss, params, tuple(torch.ones_like(p) for p in params))[1][0]

    remote = copy.deepcopy(m).cuda()
    with pytest.raises(NotImplementedError, match="Double backwards is not supported for CuDNN RNNs"):
        hvp(remote, x.cuda())
    with torch.backends.cudnn.flags(enabled=False):
        torch.testing.assert_close(hvp(remote, x.cuda()).cpu(), hvp(m, x))


def test_rnn_backward_in_eval_mode_raises_as_cudnn_does():
    """A gradient through an RNN in eval mode (a saliency map, an adversarial input): cuDNN refuses
    it, which a CPU-served gateway did not; with cuDNN disabled it equals the CPU's."""
    torch.manual_seed(0)
    m = nn.GRU(3, 4).eval()
    x = data(5, 2, 3)
    remote = copy.deepcopy(m).cuda()
    xr = x.cuda().requires_grad_()
    with pytest.raises(RuntimeError, match="^cudnn RNN backward can only be called in training mode$"):
        remote(xr)[0].sum().backward()
    with torch.backends.cudnn.flags(enabled=False):
        remote(xr)[0].sum().backward()
    x.requires_grad_()
    m(x)[0].sum().backward()
    torch.testing.assert_close(xr.grad.cpu(), x.grad)


def _offloaded_rnn_step(m: nn.Module, x: torch.Tensor, hooks: str) -> list[torch.Tensor]:
    """A training step's gradients with the RNN's saved tensors under ``hooks``."""
    x = x.detach().requires_grad_()
    if hooks == "save_on_cpu":
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
    elif hooks == "pack_to_cpu":  # a library's offloading: its own pack and unpack
        ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: (t.device, t.detach().cpu()),
                                                       lambda p: p[1].to(p[0]))
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        out = (torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False) if hooks == "checkpoint" else m(x))[0]
    out.sin().sum().backward()
    return [out.detach().cpu(), x.grad.cpu(), *(p.grad.cpu() for p in m.parameters())]


@pytest.mark.parametrize("hooks", ["save_on_cpu", "pack_to_cpu", "checkpoint"])
def test_rnn_under_activation_offloading_matches_local(hooks):
    """Saved-tensor hooks that store copies (activation offloading) gave the RNN's backward
    graphless copies of the gateway graph it walks ("element 0 of tensors does not require grad")."""
    torch.manual_seed(0)
    m = nn.LSTM(3, 4, num_layers=2)
    x = data(5, 2, 3)
    want = _offloaded_rnn_step(m, x, hooks)
    got = _offloaded_rnn_step(copy.deepcopy(m).cuda(), x.cuda(), hooks)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


class _Scale(torch.autograd.Function):
    """x * w with a gradient written by hand, as a library's custom Function is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g * w, g * x


def test_custom_function_under_batched_gradients_matches_local():
    """A custom Function's gradients under autograd's vmap (``is_grads_batched``, a vectorized
    Jacobian) were refused as on the wrong device: their batched wrapper's C++ device is 'meta'."""
    def jacobians(dev: str) -> list[torch.Tensor]:
        x, w = data(3).to(dev).requires_grad_(), data(3, seed=1).to(dev).requires_grad_()
        batched = torch.autograd.grad(_Scale.apply(x, w), (x, w), torch.eye(3).to(dev), is_grads_batched=True)
        vectorized = torch.autograd.functional.jacobian(_Scale.apply, (x.detach(), w.detach()), vectorize=True)
        return [t.cpu() for t in (*batched, *vectorized)]
    for g, w in zip(jacobians("cuda"), jacobians("cpu")):
        torch.testing.assert_close(g, w)


def test_rnn_jacobian_with_batched_gradients_matches_local():
    """A vectorized Jacobian through a GRU: its one backward op took no batched gradient
    ("'Tensor' object has no attribute '_w'"); it is walked one sample at a time, as vmap's fallback does."""
    torch.manual_seed(0)
    m = nn.GRU(3, 4)
    x = data(5, 2, 3)

    def jacobians(model: nn.Module, inp: torch.Tensor) -> list[torch.Tensor]:
        def last(t: torch.Tensor) -> torch.Tensor:
            return model(t)[0][-1].sum(0)
        t = inp.detach().requires_grad_()
        batched, = torch.autograd.grad(last(t), t, torch.eye(4).to(inp.device), is_grads_batched=True)
        return [batched.cpu(), torch.autograd.functional.jacobian(last, inp, vectorize=True).cpu()]
    for g, w in zip(jacobians(copy.deepcopy(m).cuda(), x.cuda()), jacobians(m, x)):
        torch.testing.assert_close(g, w)
