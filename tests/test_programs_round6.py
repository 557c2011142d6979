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
"""
from __future__ import annotations

import pytest
from test_corpus import F16, F32, assert_program_matches

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

