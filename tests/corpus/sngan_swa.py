"""An SNGAN-style program: spectral_norm (power iteration buffers updated in forward) and the
parametrizations API (weight_norm, orthogonal), hinge losses, two optimizers with betas (0, 0.9),
then stochastic weight averaging (AveragedModel, SWALR, update_bn over a DataLoader)."""

import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations, spectral_norm
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
noise = torch.Generator().manual_seed(1)

G = nn.Sequential(
    nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), parametrizations.weight_norm(nn.Linear(16, 8)), nn.Tanh()
).to(device)
D = nn.Sequential(
    spectral_norm(nn.Linear(8, 16)),
    nn.LeakyReLU(0.1),
    parametrizations.spectral_norm(nn.Linear(16, 16)),
    nn.LeakyReLU(0.1),
    parametrizations.orthogonal(nn.Linear(16, 16)),
    nn.Linear(16, 1),
).to(device)
opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.0, 0.9))
opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.0, 0.9))
real_all = torch.randn(64, 8, generator=noise) * 0.5 + 1
log = {"d": [], "g": []}
swa_G = AveragedModel(G)
swa_sched = SWALR(opt_g, swa_lr=1e-4, anneal_epochs=2)
for step in range(6):
    real = real_all[step * 8 % 64 :][:8].to(device)
    z = torch.randn(8, 4, generator=noise).to(device)
    fake = G(z)
    d_loss = F.relu(1.0 - D(real)).mean() + F.relu(1.0 + D(fake.detach())).mean()
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = -D(fake).mean()
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
    if step >= 3:
        swa_G.update_parameters(G)
        swa_sched.step()
    log["d"].append(d_loss.item())
    log["g"].append(g_loss.item())
loader = DataLoader(TensorDataset(torch.randn(16, 4, generator=noise)), batch_size=8)
update_bn(((z,) for (z,) in loader), swa_G, device=device)
with torch.no_grad():
    swa_G.eval()
    out = swa_G(torch.randn(4, 4, generator=noise).to(device))
print(
    json.dumps(
        {
            "device": str(out.device),
            **log,
            "out": out[0].tolist(),
            "u": D[0].weight_u[:4].tolist(),
            "n_averaged": swa_G.n_averaged.item(),
            "bn_mean": swa_G.module[1].running_mean[:4].tolist(),
            "lr": opt_g.param_groups[0]["lr"],
        }
    )
)
