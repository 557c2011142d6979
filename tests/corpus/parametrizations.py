"""The PyTorch tutorial "Parametrizations", on a device: a symmetric and a skew-symmetric
parametrization, a matrix exponential giving orthogonal weights, a parametrization with
``right_inverse`` assigned to, ``parametrize.cached()``, torch's own ``orthogonal`` and
``spectral_norm`` parametrizations trained a few steps, and ``remove_parametrizations``."""
import json

import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
from torch.nn.utils.parametrizations import orthogonal, spectral_norm

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)


class Symmetric(nn.Module):
    def forward(self, X):
        return X.triu() + X.triu(1).transpose(-1, -2)


class SymmetricWithInverse(Symmetric):
    def right_inverse(self, A):
        return A.triu()


class Skew(nn.Module):
    def forward(self, X):
        A = X.triu(1)
        return A - A.transpose(-1, -2)


class MatrixExponential(nn.Module):
    def forward(self, X):
        return torch.matrix_exp(X)


class NoisyParametrization(nn.Module):
    def forward(self, X):
        return X

    def right_inverse(self, Z):
        return Z + 1.


log = {}
layer = nn.Linear(3, 3).to(device)
parametrize.register_parametrization(layer, "weight", Symmetric())
A = layer.weight
log["symmetric"] = torch.dist(A, A.T).item()
log["original_is_param"] = isinstance(layer.parametrizations.weight.original, nn.Parameter)

layer_orthogonal = nn.Linear(3, 3).to(device)
parametrize.register_parametrization(layer_orthogonal, "weight", Skew())
parametrize.register_parametrization(layer_orthogonal, "weight", MatrixExponential())
X = layer_orthogonal.weight
log["orthogonal_err"] = torch.dist(X.T @ X, torch.eye(3, device=device)).item()

layer = nn.Linear(3, 3).to(device)
parametrize.register_parametrization(layer, "weight", SymmetricWithInverse())
with torch.no_grad():
    A = torch.arange(9., device=device).view(3, 3)
    layer.weight = A.triu() + A.triu(1).T
log["assigned"] = layer.weight.cpu().tolist()

layer = nn.Linear(3, 3).to(device)
parametrize.register_parametrization(layer, "weight", NoisyParametrization())
with torch.no_grad():
    layer.weight = torch.zeros(3, 3, device=device)
log["right_inverse"] = layer.parametrizations.weight.original.sum().item()

model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2)).to(device)
parametrize.register_parametrization(model[0], "weight", Symmetric())
orthogonal(model[2])
spectral_norm(model[3])
opt = torch.optim.Adam(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(3)
x, y = torch.randn(16, 4, generator=gen).to(device), torch.randn(16, 2, generator=gen).to(device)
losses = []
for step in range(4):
    opt.zero_grad()
    with parametrize.cached():
        out = model(x)
        loss = nn.functional.mse_loss(out, y) + model[0].weight.norm() * 1e-3
    loss.backward()
    opt.step()
    losses.append(loss.item())
log["losses"] = losses
W = model[2].weight
log["trained_orthogonal_err"] = torch.dist(W @ W.T, torch.eye(4, device=device)).item()
log["sigma"] = torch.linalg.matrix_norm(model[3].weight, ord=2).item()
model.eval()
log["eval_out"] = model(x[:2]).detach().cpu().tolist()
parametrize.remove_parametrizations(model[0], "weight", leave_parametrized=True)
log["removed"] = [parametrize.is_parametrized(model[0]), isinstance(model[0].weight, nn.Parameter),
                  torch.dist(model[0].weight, model[0].weight.T).item()]
log["device"] = str(model[0].weight.device)
print(json.dumps(log))
