"""pytorch.org tutorials and pytorch/examples programs not covered before, round 7, shrunk (tiny
sizes, few steps, seeded, synthetic data) and run unchanged with plain ``python`` (the local CPU)
and under ``remotecuda run`` on a CPU gateway; the JSON each prints last must agree value by value
(tests/test_corpus.py's rules). The programs live in tests/corpus:

- custom_autograd: "Learning PyTorch with Examples" (a polynomial fitted with hand-written
  gradients, then autograd with manual ``-=`` updates, then the ``LegendrePolynomial3`` Function)
  and "Extending PyTorch": ``ctx.needs_input_grad``, ``mark_non_differentiable``,
  ``set_materialize_grads(False)``, ``mark_dirty``, ``once_differentiable``, a ``setup_context``
  Function with ``jvp`` and ``generate_vmap_rule`` (forward AD, ``vmap``, ``jacrev``), double
  backward, ``gradcheck``/``gradgradcheck`` on the device;
- seq2seq_translation: "Translation with a Sequence to Sequence Network and Attention" (per-step
  ``encoder_outputs[ei] = ...``, teacher forcing by ``random.random()``, ``topi.squeeze().detach()``
  with an EOS ``.item()`` break, ``decoder_attentions[di] = attn.data`` into a CPU tensor) and its
  batched Bahdanau form over a DataLoader;
- neural_style: "Neural Transfer" (loss modules with ``.detach()`` targets, the model rebuilt and
  trimmed from ``cnn.children()``, LBFGS over an input image with ``input_img.data.clamp_(0, 1)``
  inside the closure), fast_neural_style (ReflectionPad2d, InstanceNorm2d(affine), nearest
  upsampling, ``batch.div_(255.0)``, namedtuple features, ``bmm`` Gram matrices) and
  super_resolution (PixelShuffle, ``init.orthogonal_``, PSNR);
- vision_examples: "Spatial Transformer Networks" (identity-initialised ``fc_loc``,
  ``affine_grid``/``grid_sample`` with ``align_corners`` both ways), mnist_rnn (LSTM over rows,
  Adadelta, StepLR) and siamese_network (a shared tower, BCE on the pair and on ``|f1 - f2|``,
  ``TripletMarginLoss`` and ``TripletMarginWithDistanceLoss``);
- gat_vit: pytorch/examples gat (multi-head attention masked by ``torch.where(adj > 0, e, -9e16)``
  over a densified sparse adjacency, dropout on the attention checked for scale and repeatability)
  and a vision transformer from scratch (``unfold``/``permute`` patches, a cls token, position
  embeddings, hand-written attention, AdamW with warm-up then cosine by ``SequentialLR``).

Beside them, the fidelity bugs they found, each shown directly."""
from __future__ import annotations

import pytest
import torch
from local_parity import data as D
from test_corpus import F32, assert_program_matches
from torch import nn

pytestmark = pytest.mark.usefixtures("remote")

PROGRAMS = [  # (program in tests/corpus, tolerance)
    ("custom_autograd", F32),
    ("seq2seq_translation", F32),
    ("neural_style", F32),
    ("vision_examples", F32),
    ("gat_vit", F32),
]


@pytest.mark.parametrize("name,tol", PROGRAMS, ids=[name for name, _ in PROGRAMS])
def test_program_matches_local(gateway, name: str, tol: tuple[float, float]):
    """The program prints under ``remotecuda run`` what it prints with plain ``python``."""
    assert_program_matches(gateway, name, tol)


class _Exp(torch.autograd.Function):
    """The extending guide's torch.func-ready Function: ``setup_context``, ``jvp``, a generated
    vmap rule."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.exp(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0]

    @staticmethod
    def jvp(ctx, x_t):
        return x_t * ctx.saved_tensors[0]


class _OnesOnCpu(_Exp):
    @staticmethod
    def backward(ctx, g):
        return torch.ones(g.shape)  # (a slip for torch.ones_like(g))


def _func_grads_through_a_custom_function(dev: str) -> list[torch.Tensor]:
    lin = nn.Linear(3, 2).to(dev)
    with torch.no_grad():
        lin.weight.copy_(D(2, 3))
        lin.bias.copy_(D(2, seed=1))
    params = dict(lin.named_parameters())
    x, xs = D(3, seed=2).to(dev), D(4, 3, seed=3).to(dev)

    def loss(p, inp):
        return _Exp.apply(torch.func.functional_call(lin, p, (inp,)) * 0.5).sum()
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, xs)
    return [*torch.func.grad(loss)(params, x).values(), *per_sample.values(),
            torch.func.grad(lambda t: _Exp.apply(t.view(3) * 2).sum())(x.view(1, 3))]


def test_torch_func_grad_through_a_custom_function_of_a_computed_input():
    """``torch.func.grad`` (and ``vmap`` of it) through a custom Function whose input is computed
    from the differentiated argument (a ``functional_call`` of a model): the backward's gradient
    is torch.func's wrapper of a 'cuda' tensor, which the check of a Function's gradient device
    took for a CPU one: "returned an invalid gradient at index 0 - expected device cuda:0 but got
    cuda:0". A gradient really on the CPU is still refused."""
    got, want = _func_grads_through_a_custom_function("cuda"), _func_grads_through_a_custom_function("cpu")
    for g, w in zip(got, want, strict=True):
        assert g.device.type == "cuda"
        torch.testing.assert_close(g.cpu(), w)
    x = torch.ones(3, device="cuda")
    msg = ("^Function _OnesOnCpuGeneratedBackward returned an invalid gradient at index 0 - "
           "expected device cuda:0 but got cpu$")
    for f in (lambda t: _OnesOnCpu.apply(t).sum(), lambda t: _OnesOnCpu.apply(t * 2).sum()):
        with pytest.raises(RuntimeError, match=msg):
            torch.func.grad(f)(x)


def test_a_cpu_cotangent_for_a_cuda_output_of_torch_func_vjp_is_refused_as_a_gpu_refuses_it():
    """``vjp_fn(torch.ones(n))`` for a 'cuda' output: the engine's check of a given gradient's
    device saw torch.func's wrapper of the output by its C++ device: "expected device meta but got
    cpu". A 0-d cotangent is moved, as C++ moves it; batched cotangents (``jacrev``) pass."""
    x = torch.arange(3.0, device="cuda")
    _, vjp_fn = torch.func.vjp(lambda a: a * 2, x)
    with pytest.raises(RuntimeError, match="^invalid gradient at index 0 - expected device cuda:0 but got cpu$"):
        vjp_fn(torch.ones(3))
    g, = vjp_fn(torch.ones(3, device="cuda"))
    assert g.device.type == "cuda" and g.cpu().tolist() == [2.0] * 3
    g0, = torch.func.vjp(lambda a: (a * 2).sum(), x)[1](torch.tensor(1.0))
    assert g0.device.type == "cuda" and g0.cpu().tolist() == [2.0] * 3
    assert torch.func.jacrev(lambda a: a * 2)(x).cpu().equal(2 * torch.eye(3))


def _inside_transforms(dev: str) -> list:
    """``new_tensor`` and list-index assignment on torch.func's wrappers of 'cuda' tensors (the
    forward-forward example's label overlay, ``x_[:, [0, 2]] = ...``, per sample)."""
    x, xs = D(4).to(dev), D(3, 4, seed=1).to(dev)

    def overlay(a):
        b = a.clone()
        b[[0, 2]] = 5.0
        b[[1, 3]] = a.new_tensor([7.0, 8.0])
        return b
    return [torch.func.grad(lambda a: (a * a.new_tensor([1.0, 2.0, 3.0, 4.0])).sum())(x),
            torch.func.vmap(lambda a: a * a.new_tensor([2.0]))(xs),
            torch.func.jvp(lambda a: a * a.new_tensor([1.0, 2.0, 3.0, 4.0]), (x,), (torch.ones(4, device=dev),))[1],
            torch.func.grad(lambda a: (overlay(a) * a).sum())(x),
            torch.func.vmap(overlay)(xs)]


def test_new_tensor_and_list_index_assignment_inside_torch_func_transforms():
    """Inside ``grad``/``vmap``/``jvp`` a 'cuda' tensor is torch.func's wrapper of a remote one,
    which the routes for ``new_tensor`` and ``__setitem__`` took for a CPU tensor: C++ then built
    the data and the list index on the wrapper's C++ device, meta ("DispatchKey Undefined doesn't
    correspond to a device"; "a plain meta tensor reached op aten::index_put_")."""
    got, want = _inside_transforms("cuda"), _inside_transforms("cpu")
    for g, w in zip(got, want, strict=True):
        assert g.device.type == "cuda"
        torch.testing.assert_close(g.cpu(), w)
