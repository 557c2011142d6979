"""A tiny-NeRF (the NeRF tutorials' single-file version), shrunk: rays from a pinhole camera
(meshgrid 'xy'), stratified samples, positional encoding, volume rendering with cumprod
transmittance, hierarchical sampling by inverse CDF (searchsorted), trained a few steps."""

import json

import torch
import torch.nn as nn
import torch.nn.functional as F

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
H = W = 6
focal = 5.0


def get_rays(H, W, focal, c2w):
    i, j = torch.meshgrid(
        torch.arange(W, dtype=torch.float32, device=c2w.device),
        torch.arange(H, dtype=torch.float32, device=c2w.device),
        indexing="xy",
    )
    dirs = torch.stack([(i - W * 0.5) / focal, -(j - H * 0.5) / focal, -torch.ones_like(i)], -1)
    rays_d = torch.sum(dirs[..., None, :] * c2w[:3, :3], -1)
    rays_o = c2w[:3, -1].expand(rays_d.shape)
    return rays_o, rays_d


def posenc(x, L=4):
    freq = 2.0 ** torch.arange(L, device=x.device)
    xb = (x[..., None, :] * freq[:, None]).flatten(-2)
    return torch.cat([x, torch.sin(xb), torch.cos(xb)], -1)


class NeRF(nn.Module):
    def __init__(self, d_in=3 + 3 * 2 * 4, w=32):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d_in, w), nn.Linear(w + d_in, w), nn.Linear(w, 4)

    def forward(self, x):
        h = F.relu(self.l1(x))
        h = F.relu(self.l2(torch.cat([h, x], -1)))  # the skip connection
        return self.l3(h)


def render(model, rays_o, rays_d, z_vals):
    pts = rays_o[..., None, :] + rays_d[..., None, :] * z_vals[..., :, None]
    raw = model(posenc(pts))
    sigma_a, rgb = F.relu(raw[..., 3]), torch.sigmoid(raw[..., :3])
    dists = torch.cat(
        [
            z_vals[..., 1:] - z_vals[..., :-1],
            torch.broadcast_to(torch.tensor([1e10], device=z_vals.device), z_vals[..., :1].shape),
        ],
        -1,
    )
    alpha = 1.0 - torch.exp(-sigma_a * dists)
    weights = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]), 1.0 - alpha + 1e-10], -1), -1)[..., :-1]
    rgb_map = torch.sum(weights[..., None] * rgb, -2)
    depth_map = torch.sum(weights * z_vals, -1)
    acc_map = torch.sum(weights, -1)
    return rgb_map, depth_map, acc_map, weights


def sample_pdf(bins, weights, n, u):
    weights = weights + 1e-5
    pdf = weights / torch.sum(weights, -1, keepdim=True)
    cdf = torch.cat([torch.zeros_like(pdf[..., :1]), torch.cumsum(pdf, -1)], -1)
    u = u.expand(list(cdf.shape[:-1]) + [n]).contiguous()
    inds = torch.searchsorted(cdf, u, right=True)
    below = torch.max(torch.zeros_like(inds - 1), inds - 1)
    above = torch.min((cdf.shape[-1] - 1) * torch.ones_like(inds), inds)
    inds_g = torch.stack([below, above], -1)
    matched = [inds_g.shape[0], inds_g.shape[1], inds_g.shape[2], cdf.shape[-1]]
    cdf_g = torch.gather(cdf.unsqueeze(-2).expand(matched), -1, inds_g)
    bins_g = torch.gather(bins.unsqueeze(-2).expand(matched), -1, inds_g)
    denom = cdf_g[..., 1] - cdf_g[..., 0]
    denom = torch.where(denom < 1e-5, torch.ones_like(denom), denom)
    t = (u - cdf_g[..., 0]) / denom
    return bins_g[..., 0] + t * (bins_g[..., 1] - bins_g[..., 0])


coarse, fine = NeRF().to(device), NeRF().to(device)
opt = torch.optim.Adam(list(coarse.parameters()) + list(fine.parameters()), lr=5e-3)
g = torch.Generator().manual_seed(1)
target = torch.rand(H, W, 3, generator=g).to(device)
c2w = torch.eye(4)
c2w[2, 3] = 4.0
rays_o, rays_d = get_rays(H, W, focal, c2w.to(device))
near, far, n_c, n_f = 2.0, 6.0, 8, 8
log = {"loss": [], "psnr": []}
for step in range(3):
    z_vals = torch.linspace(near, far, n_c, device=device).expand(H, W, n_c).clone()
    mids = 0.5 * (z_vals[..., 1:] + z_vals[..., :-1])
    upper, lower = torch.cat([mids, z_vals[..., -1:]], -1), torch.cat([z_vals[..., :1], mids], -1)
    z_vals = lower + (upper - lower) * torch.rand(z_vals.shape, generator=g).to(device)
    rgb_c, _, _, weights = render(coarse, rays_o, rays_d, z_vals)
    z_samples = sample_pdf(mids, weights[..., 1:-1].detach(), n_f, torch.rand(n_f, generator=g).to(device))
    z_all, _ = torch.sort(torch.cat([z_vals, z_samples], -1), -1)
    rgb_f, depth, acc, _ = render(fine, rays_o, rays_d, z_all)
    loss = F.mse_loss(rgb_c, target) + F.mse_loss(rgb_f, target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    log["loss"].append(loss.item())
    log["psnr"].append((-10.0 * torch.log10(F.mse_loss(rgb_f, target))).item())
print(json.dumps({"device": str(depth.device), **log, "depth": depth[0].tolist(), "acc_sum": acc.sum().item()}))
