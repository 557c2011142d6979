"""Found by sweeping transformers' model registries (every causal LM, masked LM, seq2seq, image and
sequence classifier built from a shrunken config, forward + backward + greedy generate on 'cuda'
against the CPU): the ops those models reach that the common path got wrong. Each test shows one
cause with torch alone; the architectures that reached it run in test_hf_architectures.py."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("remote")


@pytest.mark.parametrize("op", ["mm", "bmm", "addmm", "baddbmm"])
def test_matmul_out_dtype_as_cuda_computes_it(op):
    """``torch.mm(a, b, out_dtype=torch.float32)`` has CUDA kernels only (Kolibri's and Ergo's MoE
    routers take it on 'cuda' under no_grad): half/bfloat16 operands, a float32 product not
    rounded to bfloat16. A CPU gateway gives the float32 product of the widened operands."""
    g = torch.Generator().manual_seed(0)
    batch = (3,) if op.startswith("b") else ()
    a = torch.randn(*batch, 4, 8, generator=g).bfloat16()
    b = torch.randn(*batch, 8, 5, generator=g).bfloat16()
    c = torch.randn(*batch, 4, 5, generator=g)
    fn = getattr(torch, op)
    operands = (a, b) if op in ("mm", "bmm") else (c, a, b)
    expected = fn(*(t.float() for t in operands))
    got = fn(*(t.cuda() for t in operands), out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), expected)
    with pytest.raises(RuntimeError, match="out_dtype must be the same as input dtype or fp32"):
        fn(*(t.cuda().float() for t in operands), out_dtype=torch.bfloat16).cpu()


ELEMENTWISE = {
    "softplus_backward": lambda g, x: torch.ops.aten.softplus_backward(g, x, 1.0, 20.0),
    "hardsigmoid_backward": torch.ops.aten.hardsigmoid_backward,
    "hardswish_backward": torch.ops.aten.hardswish_backward,
    "logit_backward": lambda g, x: torch.ops.aten.logit_backward(g, x.sigmoid()),
    "xlogy": torch.xlogy,
    "special_xlog1py": torch.special.xlog1py,
    "copysign": torch.copysign,
    "floor_divide": torch.floor_divide,
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_output_follows_inputs_layout(name):
    """These ops' meta kernels return contiguous outputs where their kernels (TensorIterator, on
    the CPU as on a GPU) follow a transposed input: the client must know the gateway's layout, or
    ``reshape`` takes a view the gateway's tensor cannot give."""
    g = torch.randn(2, 4, 10, generator=torch.Generator().manual_seed(0)).transpose(1, 2)
    x = torch.rand(2, 10, 4, generator=torch.Generator().manual_seed(1)) + 0.5
    op = ELEMENTWISE[name]
    expected = op(g, x)
    got = op(g.cuda(), x.cuda())
    assert got.stride() == expected.stride()
    torch.testing.assert_close(got.reshape(-1).cpu(), expected.reshape(-1))


def test_softplus_gradient_of_transposed_use_views():
    """Doge's dynamic mask: softplus of a projection, used transposed. The gradient reaching the
    projection is transposed on a GPU, so autograd copies it into the parameter's layout; told
    it was contiguous, the client kept it as ``.grad`` and ``grad.view`` failed on the gateway."""
    def run(dev):
        x = torch.randn(2, 10, 4, generator=torch.Generator().manual_seed(0)).to(dev).requires_grad_()
        w = torch.randn(2, 4, 10, generator=torch.Generator().manual_seed(1)).to(dev)
        (torch.nn.functional.softplus(x).transpose(1, 2) * w).sum().backward()
        return x.grad.view(20, 4)
    torch.testing.assert_close(run("cuda").cpu(), run("cpu"))


def test_dropout_backward_layout_as_cuda_gives_it():
    """CUDA's dropout backward returns the gradient's suggested memory format (contiguous for a
    transposed gradient), as the meta kernel the client follows does; a CPU gateway's kernel kept
    it transposed and a ``view`` valid on a GPU failed there."""
    g = torch.randn(2, 4, 10, generator=torch.Generator().manual_seed(0)).transpose(1, 2)
    mask = torch.rand(2, 10, 4, generator=torch.Generator().manual_seed(1)) > 0.5
    got = torch.ops.aten.native_dropout_backward(g.cuda(), mask.cuda(), 2.0)
    expected = torch.ops.aten.native_dropout_backward(g, mask, 2.0).contiguous()
    assert got.is_contiguous()
    torch.testing.assert_close(got.view(-1).cpu(), expected.view(-1))


@pytest.mark.parametrize("loss", ["mse_loss", "huber_loss", "smooth_l1_loss"])
def test_loss_of_transposed_prediction_backward(loss):
    """These losses' backward kernels (shared by CPU and CUDA) return a contiguous gradient, their
    meta kernels one laid out as the transposed prediction: the client's idea of the layout was
    wrong the other way round, and the backward of ``Linear`` (a ``view``) failed on the gateway."""
    def run(dev):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 4).to(dev)
        x = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(1)).to(dev)
        target = torch.rand(2, 4, 10, generator=torch.Generator().manual_seed(2)).to(dev)
        getattr(torch.nn.functional, loss)(lin(x).transpose(1, 2), target).backward()
        return lin.weight.grad
    torch.testing.assert_close(run("cuda").cpu(), run("cpu"))
