"""Gaussian-process regression by hand, as GP tutorials and BoTorch-style code write it in float64:
an RBF kernel from ``torch.cdist``, a jitter loop on ``torch.linalg.cholesky_ex`` reading ``info``
with ``.item()``, ``cholesky_solve`` and ``solve_triangular`` for the posterior, the log marginal
likelihood (by the Cholesky factor, ``logdet``, ``slogdet`` and ``eigh``) maximised with Adam, the
same likelihood by ``MultivariateNormal``, posterior samples from seeded CPU noise, and the
least-squares / QR / SVD / pinv baselines and the summary statistics (``quantile``, ``histc``,
``bucketize``, ``searchsorted``, ``bincount``) a report prints."""
import json
import math

import torch
from torch.distributions import MultivariateNormal

device = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.float64
g = torch.Generator().manual_seed(0)

X = torch.rand(24, 1, generator=g, dtype=dt).to(device) * 6
X = torch.cat([X, X[:4]])  # repeated inputs: K is singular without jitter
y = (torch.sin(X) + 0.1 * torch.randn(X.shape, generator=g, dtype=dt).to(device)).squeeze(-1)
Xs = torch.linspace(0, 6, 13, dtype=dt, device=device).unsqueeze(-1)


def rbf(a, b, log_ls, log_sf):
    return torch.exp(2 * log_sf) * torch.exp(-0.5 * torch.cdist(a, b).pow(2) / torch.exp(2 * log_ls))


def robust_cholesky(K, jitter=1e-12, tries=8):
    """gpytorch's psd_safe_cholesky, shrunk: no jitter first, then more and more."""
    eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    L, info = torch.linalg.cholesky_ex(K)
    used = 0.0
    for attempt in range(tries):
        if not torch.any(info):
            return L, used, attempt
        used, jitter = jitter, jitter * 10
        L, info = torch.linalg.cholesky_ex(K + used * eye)
    raise RuntimeError(f"not positive definite ({info.item()})")


jitters = []
L0, j0, attempts0 = robust_cholesky(rbf(X, X, torch.tensor(0.0, dtype=dt), torch.tensor(0.0, dtype=dt)))
jitters.append([j0, attempts0])

log_ls = torch.tensor(0.0, dtype=dt, device=device, requires_grad=True)
log_sf = torch.tensor(0.0, dtype=dt, device=device, requires_grad=True)
log_sn = torch.tensor(-1.0, dtype=dt, device=device, requires_grad=True)
opt = torch.optim.Adam([log_ls, log_sf, log_sn], lr=0.05)
n = len(X)
nlls = []
for it in range(12):
    opt.zero_grad()
    K = rbf(X, X, log_ls, log_sf) + torch.exp(2 * log_sn) * torch.eye(n, dtype=dt, device=device)
    L, jitter, attempts = robust_cholesky(K)
    alpha = torch.cholesky_solve(y.unsqueeze(-1), L).squeeze(-1)
    nll = 0.5 * y @ alpha + L.diagonal().log().sum() + 0.5 * n * math.log(2 * math.pi)
    nll.backward()
    opt.step()
    nlls.append(nll.item())
    jitters.append([jitter, attempts])

with torch.no_grad():
    K = rbf(X, X, log_ls, log_sf) + torch.exp(2 * log_sn) * torch.eye(n, dtype=dt, device=device)
    L, _, _ = robust_cholesky(K)
    Ks, Kss = rbf(X, Xs, log_ls, log_sf), rbf(Xs, Xs, log_ls, log_sf)
    v = torch.linalg.solve_triangular(L, Ks, upper=False)
    mean = Ks.T @ torch.cholesky_solve(y.unsqueeze(-1), L).squeeze(-1)
    cov = Kss - v.T @ v
    var = cov.diagonal().clamp_min(0)
    Ls, _, _ = robust_cholesky(cov, jitter=1e-9)
    draws = mean + (Ls @ torch.randn(13, 3, generator=g, dtype=dt).to(device)).T
    evals, evecs = torch.linalg.eigh(K)
    logdets = [2 * L.diagonal().log().sum().item(), torch.logdet(K).item(), torch.linalg.slogdet(K).logabsdet.item(),
               evals.log().sum().item()]
    mvn = MultivariateNormal(torch.zeros(n, dtype=dt, device=device), scale_tril=L)
    mvn_nll = -mvn.log_prob(y).item()
    mvn_cov = MultivariateNormal(torch.zeros(n, dtype=dt, device=device), covariance_matrix=K).log_prob(y).item()

    A = torch.cat([X, X.pow(2), torch.ones_like(X)], 1)
    lstsq = torch.linalg.lstsq(A, y.unsqueeze(-1)).solution.squeeze(-1)
    Q, R = torch.linalg.qr(A)
    qr_sol = torch.linalg.solve_triangular(R, Q.T @ y.unsqueeze(-1), upper=True).squeeze(-1)
    pinv_sol = torch.linalg.pinv(A) @ y
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    svd_sol = Vh.T @ ((U.T @ y) / S)
    z = (y - mean.mean()) / y.std()
    quant = torch.quantile(z, torch.tensor([0.05, 0.5, 0.95], dtype=dt, device=device))
    hist = torch.histc(z, bins=6, min=-3, max=3)
    edges = torch.linspace(-2, 2, 5, dtype=dt, device=device)
    buckets = torch.bucketize(z, edges)
    counts = torch.bincount(buckets, minlength=6)
    pos = torch.searchsorted(edges, quant)

print(json.dumps({
    "jitters": jitters, "nlls": nlls, "hyper": [log_ls.item(), log_sf.item(), log_sn.item()],
    "mean": mean.tolist(), "var": var.tolist(), "draws": draws.tolist(), "logdets": logdets,
    "mvn_nll": mvn_nll, "mvn_cov": mvn_cov, "eig_min": evals.min().item(), "evec_abs0": evecs[:, -1].abs().tolist(),
    "lstsq": lstsq.tolist(), "qr": qr_sol.tolist(), "pinv": pinv_sol.tolist(), "svd": svd_sol.tolist(),
    "quantiles": quant.tolist(), "hist": hist.tolist(), "counts": counts.tolist(), "pos": pos.tolist(),
    "device": str(X.device),
}))
