"""Samplers and solvers written by hand on the device, as scientific code does: Hamiltonian Monte
Carlo (leapfrog with ``torch.autograd.grad`` of the potential, Metropolis acceptance from seeded
CPU uniforms), denoising score matching and annealed Langevin dynamics, sliced score matching
(a Hessian-vector product with ``create_graph=True``), a neural ODE integrated by a hand-written
RK4 loop and trained through it, and a preconditioned conjugate-gradient solve whose loop stops on
``.item()`` of the residual norm (float64, a sparse COO Laplacian and ``torch.sparse.mm``)."""
import json
import math

import torch
from torch import nn

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
out = {}

# --- HMC on a correlated Gaussian (float64)
prec = torch.tensor([[2.0, 0.9], [0.9, 1.0]], dtype=torch.float64, device=device)


def potential(q):
    return 0.5 * ((q @ prec) * q).sum(-1)


def grad_potential(q):
    q = q.detach().requires_grad_(True)
    return torch.autograd.grad(potential(q).sum(), q)[0]


q = torch.zeros(8, 2, dtype=torch.float64, device=device)
eps, n_leap, accepted, trace = 0.25, 6, [], []
for it in range(10):
    p0 = torch.randn(8, 2, generator=g, dtype=torch.float64).to(device)
    qn, p = q.clone(), p0 - 0.5 * eps * grad_potential(q)
    for leap in range(n_leap):
        qn = qn + eps * p
        if leap < n_leap - 1:
            p = p - eps * grad_potential(qn)
    p = p - 0.5 * eps * grad_potential(qn)
    log_ratio = potential(q) + 0.5 * p0.pow(2).sum(-1) - potential(qn) - 0.5 * p.pow(2).sum(-1)
    accept = torch.rand(8, generator=g, dtype=torch.float64).to(device).log() < log_ratio
    q = torch.where(accept[:, None], qn, q)
    accepted.append(int(accept.sum().item()))
    trace.append(q.mean(0).tolist())
out["hmc"] = {"accepted": accepted, "trace": trace, "final": q.tolist()}

# --- score matching and Langevin sampling
score = nn.Sequential(nn.Linear(3, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 2)).to(device)
opt = torch.optim.Adam(score.parameters(), lr=2e-3)
sigmas = torch.tensor([1.0, 0.5, 0.25], device=device)
data = (torch.randn(256, 2, generator=g) * torch.tensor([0.3, 1.0]) + torch.tensor([1.0, -1.0])).to(device)
dsm = []
for step in range(8):
    idx = torch.randint(0, 3, (256,), generator=g).to(device)
    sigma = sigmas[idx].unsqueeze(1)
    noise = torch.randn(256, 2, generator=g).to(device) * sigma
    pred = score(torch.cat([data + noise, sigma], 1))
    loss = 0.5 * ((pred * sigma + noise / sigma) ** 2).sum(1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    dsm.append(loss.item())

x = data[:16].clone().requires_grad_(True)
s = score(torch.cat([x, torch.full((16, 1), 0.25, device=device)], 1))
v = torch.randn(16, 2, generator=g).to(device)
hvp = torch.autograd.grad((s * v).sum(), x, create_graph=True)[0]
ssm = ((hvp * v).sum(1) + 0.5 * ((s * v).sum(1)) ** 2).mean()
ssm.backward()

with torch.no_grad():
    xs = torch.randn(32, 2, generator=g).to(device)
    for sigma in sigmas.tolist():
        step_size = 0.05 * sigma ** 2
        for _ in range(5):
            z = torch.randn(32, 2, generator=g).to(device)
            grad = score(torch.cat([xs, torch.full((32, 1), sigma, device=device)], 1))
            xs = xs + 0.5 * step_size * grad + math.sqrt(step_size) * z
out["score"] = {"dsm": dsm, "ssm": ssm.item(), "ssm_grad": score[0].weight.grad.abs().sum().item(),
                "samples_mean": xs.mean(0).tolist(), "samples_std": xs.std(0).tolist()}

# --- neural ODE by RK4
class ODEFunc(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2))

    def forward(self, t, y):
        return self.net(y) * torch.cos(t)


def rk4(f, y0, ts):
    ys, y = [y0], y0
    for t0, t1 in zip(ts[:-1], ts[1:]):
        h = t1 - t0
        k1 = f(t0, y)
        k2 = f(t0 + h / 2, y + h / 2 * k1)
        k3 = f(t0 + h / 2, y + h / 2 * k2)
        k4 = f(t1, y + h * k3)
        y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        ys.append(y)
    return torch.stack(ys)


ts = torch.linspace(0, 2, 11, device=device)
true_A = torch.tensor([[-0.1, 2.0], [-2.0, -0.1]], device=device)
y0 = torch.tensor([[2.0, 0.0]], device=device)
with torch.no_grad():
    true_y = rk4(lambda t, y: (y ** 3) @ true_A, y0, ts)
func = ODEFunc().to(device)
opt = torch.optim.RMSprop(func.parameters(), lr=1e-3)
ode = []
for it in range(4):
    opt.zero_grad()
    loss = (rk4(func, y0, ts) - true_y).abs().mean()
    loss.backward()
    opt.step()
    ode.append(loss.item())
out["ode"] = {"losses": ode, "true_end": true_y[-1].tolist()}

# --- conjugate gradients on a sparse 2-D Laplacian (float64), Jacobi-preconditioned
m = 12
n = m * m
idx = torch.arange(n).reshape(m, m)
rows, cols, vals = [idx.flatten()], [idx.flatten()], [torch.full((n,), 4.0, dtype=torch.float64)]
for a, b in ((idx[:, :-1], idx[:, 1:]), (idx[:-1, :], idx[1:, :])):
    rows += [a.flatten(), b.flatten()]
    cols += [b.flatten(), a.flatten()]
    vals += [torch.full((a.numel(),), -1.0, dtype=torch.float64)] * 2
A = torch.sparse_coo_tensor(torch.stack([torch.cat(rows), torch.cat(cols)]), torch.cat(vals), (n, n)).coalesce()
A = A.to(device)
diag = torch.full((n,), 4.0, dtype=torch.float64, device=device)
b = torch.ones(n, dtype=torch.float64, device=device)
xk = torch.zeros_like(b)
r = b - torch.sparse.mm(A, xk.unsqueeze(1)).squeeze(1)
zk = r / diag
p = zk.clone()
rz = torch.dot(r, zk)
residuals = []
for it in range(200):
    Ap = torch.sparse.mm(A, p.unsqueeze(1)).squeeze(1)
    alpha = rz / torch.dot(p, Ap)
    xk += alpha * p
    r -= alpha * Ap
    res = torch.linalg.vector_norm(r).item()
    residuals.append(res)
    if res < 1e-10:
        break
    zk = r / diag
    rz_new = torch.dot(r, zk)
    p = zk + (rz_new / rz) * p
    rz = rz_new
dense_check = torch.linalg.solve(A.to_dense(), b)
out["cg"] = {"iterations": len(residuals), "residuals": residuals[:10], "x_mid": xk[n // 2].item(),
             "agrees": torch.allclose(xk, dense_check, atol=1e-8)}
out["device"] = str(b.device)
print(json.dumps(out))
