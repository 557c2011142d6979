"""Probabilistic models from the normalizing-flow and Bayesian deep-learning tutorials: a RealNVP
with alternating affine-coupling masks (buffers), its log-det-Jacobian summed per layer, trained
against a ``MultivariateNormal`` base and sampled by the inverse pass; the same flow over a
``MixtureSameFamily`` base of ``Independent`` Normals; ``TransformedDistribution`` with affine and
sigmoid transforms; a Bayes-by-backprop network (``Normal(...).rsample()`` on seeded noise via the
reparameterisation trick, ``kl_divergence`` to the prior) and a ``Categorical(logits=...)``
classifier's log-likelihood and entropy."""
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import (
    AffineTransform,
    Categorical,
    Independent,
    MixtureSameFamily,
    MultivariateNormal,
    Normal,
    SigmoidTransform,
    TransformedDistribution,
    kl_divergence,
)

device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)


def two_moons(n):
    t = torch.rand(n, generator=g) * torch.pi
    upper = torch.rand(n, generator=g) > 0.5
    x = torch.stack([torch.cos(t), torch.sin(t)], 1)
    x = torch.where(upper[:, None], x, torch.stack([1 - torch.cos(t), 0.5 - torch.sin(t)], 1))
    return x + 0.05 * torch.randn(n, 2, generator=g)


class Coupling(nn.Module):
    def __init__(self, mask, hidden=16):
        super().__init__()
        self.register_buffer("mask", mask)
        self.s = nn.Sequential(nn.Linear(2, hidden), nn.LeakyReLU(), nn.Linear(hidden, 2), nn.Tanh())
        self.t = nn.Sequential(nn.Linear(2, hidden), nn.LeakyReLU(), nn.Linear(hidden, 2))

    def forward(self, x):
        xm = x * self.mask
        s = self.s(xm) * (1 - self.mask)
        t = self.t(xm) * (1 - self.mask)
        return xm + (1 - self.mask) * (x * torch.exp(s) + t), s.sum(dim=1)

    def inverse(self, z):
        zm = z * self.mask
        s = self.s(zm) * (1 - self.mask)
        t = self.t(zm) * (1 - self.mask)
        return zm + (1 - self.mask) * (z - t) * torch.exp(-s)


class RealNVP(nn.Module):
    def __init__(self, base, n=4):
        super().__init__()
        masks = torch.tensor([[0.0, 1.0], [1.0, 0.0]] * (n // 2))
        self.layers = nn.ModuleList(Coupling(m) for m in masks)
        self.base = base

    def log_prob(self, x):
        z, log_det = x, torch.zeros(x.shape[0], device=x.device)
        for layer in self.layers:
            z, ld = layer(z)
            log_det = log_det + ld
        return self.base.log_prob(z) + log_det

    def sample_from(self, z):
        for layer in reversed(self.layers):
            z = layer.inverse(z)
        return z


data = two_moons(256).to(device)
bases = {
    "gaussian": MultivariateNormal(torch.zeros(2, device=device), torch.eye(2, device=device)),
    "mixture": MixtureSameFamily(Categorical(logits=torch.zeros(3, device=device)),
                                 Independent(Normal(torch.tensor([[-1.0, 0.0], [0.0, 0.0], [1.0, 0.0]], device=device),
                                                    torch.ones(3, 2, device=device) * 0.7), 1)),
}
out = {}
for name, base in bases.items():
    torch.manual_seed(2)
    flow = RealNVP(base).to(device)
    opt = torch.optim.Adam(flow.parameters(), lr=1e-3)
    losses = []
    for step in range(6):
        batch = data[step * 16 % 256:][:64]
        loss = -flow.log_prob(batch).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        z = torch.randn(5, 2, generator=g).to(device)
        x = flow.sample_from(z)
        out[name] = {"losses": losses, "samples": x.tolist(), "test_lp": flow.log_prob(data[:8]).tolist()}

squashed = TransformedDistribution(Independent(Normal(torch.zeros(2, device=device), torch.ones(2, device=device)), 1),
                                   [AffineTransform(torch.tensor([0.5, -0.5], device=device), 2.0), SigmoidTransform()])
out["squashed_lp"] = squashed.log_prob(torch.tensor([[0.2, 0.7], [0.9, 0.4]], device=device)).tolist()


class BayesLinear(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.mu = nn.Parameter(torch.randn(n_out, n_in, generator=g) * 0.1)
        self.rho = nn.Parameter(torch.full((n_out, n_in), -4.0))
        self.prior = Normal(0.0, 1.0)

    def forward(self, x, eps):
        q = Normal(self.mu, F.softplus(self.rho))
        w = self.mu + F.softplus(self.rho) * eps  # q.rsample() with the caller's noise
        self.kl = kl_divergence(q, self.prior).sum()
        return x @ w.T


class BNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = BayesLinear(2, 16), BayesLinear(16, 2)

    def forward(self, x, noise):
        return self.l2(torch.relu(self.l1(x, noise[0])), noise[1])


labels = (data[:, 1] > 0.25).long()
bnn = BNN().to(device)
opt = torch.optim.Adam(bnn.parameters(), lr=1e-2)
elbo = []
for step in range(5):
    noise = [torch.randn(16, 2, generator=g).to(device), torch.randn(2, 16, generator=g).to(device)]
    logits = bnn(data, noise)
    nll = -Categorical(logits=logits).log_prob(labels).sum()
    loss = nll + (bnn.l1.kl + bnn.l2.kl)
    opt.zero_grad()
    loss.backward()
    opt.step()
    elbo.append(-loss.item())
with torch.no_grad():
    noise = [torch.randn(16, 2, generator=g).to(device), torch.randn(2, 16, generator=g).to(device)]
    pred = Categorical(logits=bnn(data[:10], noise))
    out["bnn"] = {"elbo": elbo, "entropy": pred.entropy().tolist(), "probs": pred.probs.tolist(),
                  "sigma_mean": F.softplus(bnn.l1.rho).mean().item()}
out["device"] = str(data.device)
print(json.dumps(out))
