"""Opacus on 'cuda': PrivacyEngine.make_private on a small CNN and MLP (per-sample gradients
through hooks, functorch and ghost clipping, BatchMemoryManager, Poisson sampling with the
accountant's epsilon), compared with a local CPU run with the same seed and no noise (noise
drawn on a GPU is the GPU generator's own)."""
from __future__ import annotations

import warnings

import pytest

pytest.importorskip("opacus")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from local_parity import assert_matches_local, registry  # noqa: E402
from opacus import PrivacyEngine  # noqa: E402
from opacus.utils.batch_memory_manager import BatchMemoryManager  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

pytestmark = pytest.mark.usefixtures("remote")
CASES, case = registry()


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 3))


def _private(dev, model, **kw):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
    model = model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (secure RNG off)
        return engine, *engine.make_private(
            module=model, optimizer=opt, data_loader=DataLoader(ds, batch_size=8), max_grad_norm=1.0,
            **{"noise_multiplier": 0.0, "poisson_sampling": False, **kw})


def _per_sample_step(dev, module, **kw):
    """One private step: the per-sample gradients it computed and the parameters after it."""
    _, model, opt, dl = _private(dev, module, **kw)
    x, y = next(iter(dl))
    F.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
    grads = [p.grad_sample for p in model.parameters()]
    opt.step()
    return grads, [p.detach() for p in model.parameters()]


@case
def per_sample_grads_hooks(dev):
    return _per_sample_step(dev, _cnn())


@case
def per_sample_grads_functorch(dev):
    return _per_sample_step(dev, _mlp(), grad_sample_mode="functorch")


@case
def ghost_clipping(dev):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
    model = _mlp().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, crit, dl = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=DataLoader(ds, batch_size=8), criterion=nn.CrossEntropyLoss(),
            noise_multiplier=0.0, max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode="ghost")
    x, y = next(iter(dl))
    loss = crit(model(x.to(dev)), y.to(dev))
    loss.backward()
    opt.step()
    return loss.detach(), [p.detach() for p in model.parameters()]


@case
def batch_memory_manager_poisson_epsilon(dev):
    engine, model, opt, dl = _private(dev, _mlp(), poisson_sampling=True, noise_multiplier=1.0)
    torch.manual_seed(1)  # (the Poisson sampler draws from the CPU generator; the noise from the device's)
    losses = []
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=4, optimizer=opt) as loader:
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return torch.tensor([len(losses), engine.get_epsilon(1e-5)]), model._module[1].weight.shape


@pytest.mark.parametrize("name", sorted(CASES))
def test_program_matches_local(name):
    assert_matches_local(CASES[name])
