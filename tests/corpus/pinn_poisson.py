"""A physics-informed network, the way PINN tutorials write one: float64 everywhere
(``torch.set_default_dtype``), -Δu = f on the unit square with u = 0 on the boundary, the
Laplacian by ``torch.autograd.grad(..., create_graph=True)`` twice, Adam then L-BFGS with a
strong-Wolfe line search, and the Laplacian again by ``torch.func`` (vmap of hessian)."""
import json
import math

import torch
from torch import nn
from torch.func import functional_call, hessian, vmap

torch.set_default_dtype(torch.float64)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)


class PINN(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                 nn.Linear(width, 1))

    def forward(self, xy):
        return self.net(xy)


def source(xy):
    return 2 * math.pi ** 2 * torch.sin(math.pi * xy[:, :1]) * torch.sin(math.pi * xy[:, 1:])


def exact(xy):
    return torch.sin(math.pi * xy[:, :1]) * torch.sin(math.pi * xy[:, 1:])


def laplacian(u, xy):
    du = torch.autograd.grad(u, xy, grad_outputs=torch.ones_like(u), create_graph=True)[0]
    lap = torch.zeros_like(u)
    for i in range(xy.shape[1]):
        lap = lap + torch.autograd.grad(du[:, i], xy, torch.ones_like(du[:, i]), create_graph=True)[0][:, i:i + 1]
    return lap


interior = torch.rand(64, 2, generator=g).to(device).requires_grad_(True)
t = torch.rand(16, 1, generator=g)
edges = torch.cat([torch.cat([t, torch.zeros_like(t)], 1), torch.cat([t, torch.ones_like(t)], 1),
                   torch.cat([torch.zeros_like(t), t], 1), torch.cat([torch.ones_like(t), t], 1)]).to(device)

model = PINN().to(device)


def loss_fn():
    u = model(interior)
    residual = -laplacian(u, interior) - source(interior)
    return residual.pow(2).mean() + 10 * model(edges).pow(2).mean()


adam = torch.optim.Adam(model.parameters(), lr=1e-2)
adam_losses = []
for step in range(6):
    adam.zero_grad()
    loss = loss_fn()
    loss.backward()
    adam.step()
    adam_losses.append(loss.item())

lbfgs = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=5, history_size=5, line_search_fn="strong_wolfe",
                          tolerance_grad=1e-12, tolerance_change=1e-14)


def closure():
    lbfgs.zero_grad()
    loss = loss_fn()
    loss.backward()
    return loss


lbfgs_losses = [lbfgs.step(closure).item() for _ in range(2)]
state = lbfgs.state[next(iter(model.parameters()))]

test = torch.stack(torch.meshgrid(torch.linspace(0, 1, 9, device=device), torch.linspace(0, 1, 9, device=device),
                                  indexing="ij"), -1).reshape(-1, 2)
with torch.no_grad():
    err = (model(test) - exact(test)).abs()

params = {k: v.detach() for k, v in model.named_parameters()}
func_lap = vmap(lambda p: torch.trace(hessian(lambda q: functional_call(model, params, (q[None],)).squeeze())(p)))(
    test[:5])
xy = test[:5].clone().requires_grad_(True)
auto_lap = laplacian(model(xy), xy).squeeze(1)

print(json.dumps({
    "adam_losses": adam_losses,
    "lbfgs_losses": lbfgs_losses,
    "lbfgs_iters": state["n_iter"],
    "lbfgs_evals": state["func_evals"],
    "max_err": err.max().item(),
    "mean_err": err.mean().item(),
    "func_laplacian": func_lap.tolist(),
    "laplacians_agree": torch.allclose(func_lap, auto_lap),
    "dtype": str(model.net[0].weight.dtype),
    "device": str(interior.device),
}))
