"""Well-known single-file programs, shrunk (tiny sizes, few steps, seeded, synthetic data) and run
unchanged: once with plain ``python`` (the local CPU) and once under ``remotecuda run`` with
'cuda' on a CPU gateway; the JSON each prints last must agree value by value (the rules are
tests/test_corpus.py's). The programs live in tests/corpus:

- CleanRL's ppo.py (CartPole in a SyncVectorEnv, GAE), dqn.py (stable-baselines3's ReplayBuffer
  on the device, a target network), sac_continuous_action.py and td3_continuous_action.py
  (Pendulum; a device leaf ``log_alpha``, ``torch.normal`` with a device std, ``randn_like``);
- torchdiffeq's ode_demo with ``odeint`` and ``odeint_adjoint`` and an ``odeint_event``;
- torch_geometric's GCN (cached normalisation) and GAT with dropout, a GIN graph classifier
  over PyG's DataLoader with global pooling, and link_pred.py (RandomLinkSplit after ToDevice,
  negative_sampling, dropout_edge);
- a DDPM trained with an EMA (``torch._foreach_lerp_``) then sampled (ancestral and DDIM);
- a tiny NeRF (positional encoding, cumprod transmittance, hierarchical ``searchsorted``
  sampling);
- an SNGAN with ``spectral_norm`` and the parametrizations API, then SWA (``AveragedModel``,
  ``SWALR``, ``update_bn``);
- pytorch/examples' time_sequence_prediction (float64 LSTMCells with L-BFGS) and activation
  checkpointing with dropout inside (reentrant and not);
- pytorch/examples' siamese_network, a SimCLR NT-Xent loop and fast_neural_style's losses;
- a Lightning ``Trainer(accelerator="auto")`` fit, checkpoint and reload.

Each program seeds the CPU's generator before building its networks and the device's right
before its loop: a GPU's generator is its own, so draws on 'cuda' never come from the CPU's
(and a CPU generator that the local run drew from for a 'cuda' op is seeded again after it).
pytorch/examples' mnist_hogwild is not here: a cuda tensor cannot be sent to another process
(README's limits)."""
from __future__ import annotations

import pytest
from test_corpus import F32, assert_program_matches

PROGRAMS = [  # (program in tests/corpus, the libraries it needs beyond torch)
    ("cleanrl_ppo", ("gymnasium",)),
    ("cleanrl_dqn", ("gymnasium", "stable_baselines3")),
    ("cleanrl_sac", ("gymnasium", "stable_baselines3")),
    ("cleanrl_td3", ("gymnasium", "stable_baselines3")),
    ("torchdiffeq_ode", ("torchdiffeq",)),
    ("pyg_gnn", ("torch_geometric",)),
    ("pyg_link_pred", ("torch_geometric", "sklearn")),
    ("ddpm", ()),
    ("nerf", ()),
    ("sngan_swa", ()),
    ("time_sequence", ()),
    ("contrastive_style", ()),
    ("lightning_fit", ("lightning",)),
]


@pytest.mark.parametrize("name,libraries", PROGRAMS, ids=[name for name, _ in PROGRAMS])
def test_program_matches_local(gateway, name: str, libraries: tuple[str, ...]):
    """The program prints under ``remotecuda run`` what it prints with plain ``python``."""
    for library in libraries:
        pytest.importorskip(library)
    assert_program_matches(gateway, name, F32)
