"""Classic programs from pytorch/examples and the pytorch.org tutorials, round 6, shrunk (tiny
sizes, few steps, seeded, synthetic data) and run unchanged with plain ``python`` (the local CPU)
and under ``remotecuda run`` on a CPU gateway; the JSON each prints last must agree value by
value (tests/test_corpus.py's rules). The programs live in tests/corpus:

- fgsm_attack: "Adversarial Example Generation" (a LeNet trained with Adadelta, then attacked
  one example at a time: ``data.requires_grad = True``, the sign of ``data.grad``, ``clamp``);
- bilstm_crf: "Bi-LSTM CRF" (the forward algorithm's log_sum_exp, the gold path score, Viterbi
  decoding with backpointers read by ``.item()``);
- fx_conv_bn_fusion: the FX conv/batch-norm fuser (``symbolic_trace`` of a 'cuda' model,
  ``fuse_conv_bn_eval``, graph surgery, ``ShapeProp``);
- parametrizations: "Parametrizations" (symmetric, skew and matrix-exponential parametrizations,
  ``right_inverse``, ``parametrize.cached()``, ``orthogonal``, ``spectral_norm``,
  ``remove_parametrizations``);
- func_per_sample_ntk: the torch.func tutorials (per-sample gradients by ``vmap(grad(...))``,
  model ensembling with ``stack_module_state``, the empirical NTK by ``jacrev`` and by ``jvp`` of
  ``vjp``);
- transfer_learning: "Transfer Learning for Computer Vision" (fine-tuning, then a frozen feature
  extractor with a new head; ``set_grad_enabled``, StepLR, best weights kept by deepcopy);
- gradcam_hooks: Grad-CAM with forward, forward-pre, full backward and tensor hooks;
- optimizer_in_backward: the optimizer stepped from ``register_post_accumulate_grad_hook``,
  ``saved_tensors_hooks`` and ``save_on_cpu(pin_memory=True)``, ``register_multi_grad_hook``;
- char_rnn_classification: "Classifying Names with a Character-Level RNN" (2024): the default
  device set to the accelerator, ``random_split`` with a device ``torch.Generator``, ``nn.RNN``,
  ``clip_grad_norm_``, a confusion matrix and ``topk``;
- modern_training_loop: channels_last, bfloat16 autocast with a GradScaler, checkpointing with
  ``use_reentrant=False``, ``sdpa_kernel``, a fused AdamW, an EMA and an SWA model with
  ``update_bn``.

Beside them, the fidelity bugs they found, each shown directly."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from local_parity import data as D
from test_corpus import F16, F32, assert_program_matches
from torch import nn

pytestmark = pytest.mark.usefixtures("remote")

PROGRAMS = [  # (program in tests/corpus, tolerance)
    ("fgsm_attack", F32),
    ("bilstm_crf", F32),
    ("fx_conv_bn_fusion", F32),
    ("parametrizations", F32),
    ("func_per_sample_ntk", F32),
    ("transfer_learning", F32),
    ("gradcam_hooks", F32),
    ("optimizer_in_backward", F32),
    ("char_rnn_classification", F32),
    ("modern_training_loop", F16),  # (bfloat16 autocast: the CPU's policy locally, CUDA's remotely)
]


@pytest.mark.parametrize("name,tol", PROGRAMS, ids=[name for name, _ in PROGRAMS])
def test_program_matches_local(gateway, name: str, tol: tuple[float, float]):
    """The program prints under ``remotecuda run`` what it prints with plain ``python``."""
    assert_program_matches(gateway, name, tol)


def _shuffle_unit(dev: str, groups: int) -> list[torch.Tensor]:
    """A ShuffleNet unit's channel shuffle, trained through ``.sum()``: its backward shuffles the
    expanded (all-zero-stride) gradient ``sum`` gives back."""
    x = D(2, 4, 3, 3).to(dev).requires_grad_()
    conv = nn.Conv2d(4, 4, 1, groups=2).to(dev)
    with torch.no_grad():
        conv.weight.copy_(D(4, 2, 1, 1, seed=1).to(dev))
        conv.bias.zero_()
    y = nn.ChannelShuffle(groups)(conv(x))
    y.sum().backward()
    return [y, x.grad, conv.weight.grad, F.channel_shuffle(x.detach()[:1].expand(3, 4, 3, 3), groups)]


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_channel_shuffle_of_a_non_contiguous_tensor(groups: int):
    """torch's meta kernel for ``channel_shuffle`` gives a view of its input (same strides) when
    every channel is its own group or there is one group (as CUDA's kernel does for a contiguous
    input); for a non-contiguous one (the zero-stride gradient of ``y.sum()``) CUDA copies it into
    a contiguous tensor, which the gateway could not lay out on zero strides: "more than one element
    of the written-to tensor refers to a single memory location", at the next sync."""
    got, want = _shuffle_unit("cuda", groups), _shuffle_unit("cpu", groups)
    for g, w in zip(got, want):
        assert g.is_contiguous()
        torch.testing.assert_close(g.cpu(), w)
