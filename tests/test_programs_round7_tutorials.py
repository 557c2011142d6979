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
  embeddings, hand-written attention, AdamW with warm-up then cosine by ``SequentialLR``)."""
from __future__ import annotations

import pytest
from test_corpus import F32, assert_program_matches

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
