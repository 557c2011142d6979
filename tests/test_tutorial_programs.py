"""Programs in the style of pytorch/examples and the official tutorials, pasted onto 'cuda'
(synthetic data, small sizes): L-BFGS time-series fitting with a strong-Wolfe closure, an
actor-critic with Categorical, a DQN over a numpy replay buffer with target-network copies,
super-resolution with PixelShuffle and fast neural style (reflection padding, InstanceNorm, Gram
matrices), an NT-Xent loss with distillation through KLDivLoss(log_target=True), a DDPM (schedule
buffers, gather by timestep, a sampling loop), a NeRF renderer (cumprod, searchsorted hierarchical
sampling), a GCN with torch.sparse.mm and index_add_, and the loop idioms around them (the norm
clip_grad_norm_ returns, ReduceLROnPlateau stepped on a 'cuda' loss, OneCycleLR, early stopping,
a whole training state saved and resumed with the RNG states). Each runs on the local CPU and
through the gateway and must give the same values.

Random draws are made on seeded CPU generators and moved: a GPU's generator is its own."""
from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from local_parity import assert_matches_local, registry
from local_parity import data as D
from torch import nn
from torch.distributions import Categorical

pytestmark = pytest.mark.usefixtures("remote")
CASES, case = registry()


@case
def lbfgs_time_series(dev):
    torch.manual_seed(0)
    x = torch.sin(torch.linspace(0, 6, 12)).view(1, -1, 1).double().to(dev)
    cell, lin = nn.LSTMCell(1, 8).double().to(dev), nn.Linear(8, 1).double().to(dev)

    def model(inp, future=0):
        h = torch.zeros(inp.size(0), 8, dtype=torch.double, device=inp.device)
        c = torch.zeros_like(h)
        outs = []
        for i in inp.split(1, dim=1):
            h, c = cell(i.squeeze(1), (h, c))
            outs.append(lin(h))
        for _ in range(future):
            h, c = cell(outs[-1], (h, c))
            outs.append(lin(h))
        return torch.stack(outs, 1)

    opt = torch.optim.LBFGS([*cell.parameters(), *lin.parameters()], lr=0.8, max_iter=3,
                            line_search_fn="strong_wolfe")
    losses = []
    for _ in range(2):
        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x[:, :-1]), x[:, 1:])
            loss.backward()
            return loss
        losses.append(opt.step(closure).item())
    with torch.no_grad():
        pred = model(x[:, :-1], future=4)
    return torch.tensor(losses), pred


@case
def actor_critic(dev):
    torch.manual_seed(0)
    pol = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)).to(dev)
    val = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1)).to(dev)
    opt = torch.optim.Adam([*pol.parameters(), *val.parameters()], lr=1e-2)
    rng, out = random.Random(0), []
    for _ in range(3):
        pos, obs = 0, np.array([0.0, 1.0, 0.0, 0.5], dtype=np.float32)
        lps, vals, rews, ents = [], [], [], []
        for t in range(12):
            st = torch.from_numpy(obs).float().unsqueeze(0).to(dev)
            m = Categorical(F.softmax(pol(st), dim=-1))
            a = torch.tensor([t % 2 if t % 3 else 1], device=dev)
            lps.append(m.log_prob(a))
            ents.append(m.entropy())
            vals.append(val(st))
            pos += 1 if a.item() == 1 else -1
            obs = np.array([pos / 5, 1.0, rng.random(), 0.5], dtype=np.float32)
            rews.append(float(a.item() == 1))
            if abs(pos) >= 5:
                break
        R, rets = 0.0, []
        for r in reversed(rews):
            R = r + 0.99 * R
            rets.insert(0, R)
        ret = torch.tensor(rets, device=dev)
        ret = (ret - ret.mean()) / (ret.std() + 1e-8)
        v = torch.cat(vals).squeeze(-1)
        loss = (-(torch.cat(lps) * (ret - v.detach())).sum() + F.smooth_l1_loss(v, ret)
                - 0.01 * torch.cat(ents).sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return torch.tensor(out), list(pol.parameters())


@case
def dqn_numpy_replay(dev):
    torch.manual_seed(0)
    rs = np.random.RandomState(0)
    q = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 3)).to(dev)
    tgt = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 3)).to(dev)
    tgt.load_state_dict(q.state_dict())
    opt = torch.optim.RMSprop(q.parameters(), lr=1e-3)
    S, A, R = rs.randn(100, 4).astype(np.float32), rs.randint(0, 3, 100), rs.randn(100).astype(np.float32)
    S2, done = rs.randn(100, 4).astype(np.float32), (rs.rand(100) < 0.1).astype(np.float32)
    acts, losses = [], []
    for step in range(12):
        if rs.rand() < max(0.05, 1 - step / 6):
            acts.append(int(rs.randint(3)))
        else:
            with torch.no_grad():
                acts.append(q(torch.as_tensor(S[step], device=dev).unsqueeze(0)).argmax(dim=1).item())
        idx = rs.choice(100, 16)
        s, s2 = torch.as_tensor(S[idx], device=dev), torch.as_tensor(S2[idx], device=dev)
        a = torch.as_tensor(A[idx], device=dev, dtype=torch.long)
        qsa = q(s).gather(1, a.unsqueeze(1)).squeeze(1)
        with torch.no_grad():
            target = torch.as_tensor(R[idx], device=dev) + 0.99 * tgt(s2).max(1)[0] * (
                1 - torch.as_tensor(done[idx], device=dev))
        loss = F.smooth_l1_loss(qsa, target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_value_(q.parameters(), 100)
        opt.step()
        losses.append(loss.item())
        if step % 4 == 0:
            tgt.load_state_dict(q.state_dict())
    return torch.tensor(losses), torch.tensor(acts), list(tgt.parameters())


@case
def super_resolution_and_style(dev):
    torch.manual_seed(0)
    sr = nn.Sequential(nn.Conv2d(1, 8, 5, padding=2), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1),
                       nn.PixelShuffle(2)).to(dev)
    style = nn.Sequential(nn.ReflectionPad2d(4), nn.Conv2d(3, 8, 9), nn.InstanceNorm2d(8, affine=True), nn.ReLU(),
                          nn.Upsample(scale_factor=2), nn.ReflectionPad2d(1), nn.Conv2d(8, 3, 3, 2)).to(dev)

    def gram(y):
        b, ch, h, w = y.size()
        f = y.view(b, ch, w * h)
        return f.bmm(f.transpose(1, 2)) / (ch * h * w)

    lo, hi, x = D(2, 1, 8, 8).to(dev), D(2, 1, 16, 16, seed=1).to(dev), D(2, 3, 12, 12, seed=2).to(dev)
    gs = gram(D(1, 3, 12, 12, seed=3).to(dev))
    opt = torch.optim.Adam([*sr.parameters(), *style.parameters()], 1e-3)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        y = style(x)
        loss = F.mse_loss(sr(lo), hi) + F.mse_loss(y, x) + 1e3 * F.mse_loss(gram(y), gs.expand(2, -1, -1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    psnr = 10 * math.log10(1 / F.mse_loss(sr(lo), hi).item())
    return torch.tensor(losses), torch.tensor(psnr), F.pixel_unshuffle(sr(lo), 2), style(x).clamp(0, 255)


@case
def nt_xent_and_distillation(dev):
    z1 = D(8, 16).to(dev).requires_grad_()
    z = F.normalize(torch.cat([z1, D(8, 16, seed=1).to(dev)]), dim=1)
    sim = (z @ z.T / 0.5).masked_fill(torch.eye(16, dtype=torch.bool, device=dev), -9e15)
    nt_xent = F.cross_entropy(sim, torch.cat([torch.arange(8, 16), torch.arange(8)]).to(dev))
    student, teacher, T = D(8, 10, seed=4).to(dev).requires_grad_(), D(8, 10, seed=5).to(dev), 4.0
    kd = nn.KLDivLoss(reduction="batchmean", log_target=True)(
        F.log_softmax(student / T, -1), F.log_softmax(teacher / T, -1)) * T * T
    kd2 = nn.KLDivLoss(reduction="batchmean")(F.log_softmax(student / T, -1), F.softmax(teacher / T, -1))
    triplet = nn.TripletMarginLoss(swap=True)(z1[:4], z1[4:], student[:4, :16].repeat(1, 2)[:, :16])
    (nt_xent + kd + kd2 + triplet).backward()
    return nt_xent, kd, kd2, triplet, z1.grad, student.grad


@case
def ddpm(dev):
    torch.manual_seed(0)
    steps = 40
    betas = torch.linspace(1e-4, 0.02, steps)
    ab = torch.cumprod(1 - betas, 0)
    net = nn.Sequential(nn.Linear(3, 32), nn.SiLU(), nn.Linear(32, 2)).to(dev)
    bufs = nn.Module()
    for name, b in [("betas", betas), ("alphas", 1 - betas), ("sqrt_ab", ab.sqrt()), ("sqrt_1mab", (1 - ab).sqrt()),
                    ("ab_prev", F.pad(ab[:-1], (1, 0), value=1.0))]:
        bufs.register_buffer(name, b)
    bufs.to(dev)

    def eps(x, t):
        return net(torch.cat([x, (t.float() / steps).unsqueeze(-1)], -1))

    def extract(a, t, shape):
        return a.gather(-1, t).reshape(t.shape[0], *((1,) * (len(shape) - 1)))

    opt, x0, losses = torch.optim.AdamW(net.parameters(), 1e-3), D(32, 2).to(dev), []
    for i in range(3):
        t = torch.randint(0, steps, (32,), generator=torch.Generator().manual_seed(i)).to(dev)
        noise = D(32, 2, seed=10 + i).to(dev)
        xt = extract(bufs.sqrt_ab, t, x0.shape) * x0 + extract(bufs.sqrt_1mab, t, x0.shape) * noise
        loss = F.mse_loss(eps(xt, t), noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        x = D(8, 2, seed=99).to(dev)
        for i in reversed(range(steps)):
            tt = torch.full((8,), i, device=dev, dtype=torch.long)
            x = (x - bufs.betas[i] / bufs.sqrt_1mab[i] * eps(x, tt)) / bufs.alphas[i].sqrt()
            if i > 0:
                var = bufs.betas[i] * (1 - bufs.ab_prev[i]) / (1 - extract(bufs.sqrt_ab, tt, x.shape) ** 2)
                x = x + var.sqrt() * D(8, 2, seed=200 + i).to(dev)
    return torch.tensor(losses), x


@case
def nerf_hierarchical(dev):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(27, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
    rays_o, rays_d = D(16, 3).to(dev), F.normalize(D(16, 3, seed=1), dim=-1).to(dev)

    def posenc(x):
        return torch.cat([x] + [fn(2.0 ** i * x) for i in range(4) for fn in (torch.sin, torch.cos)], -1)

    def render(z):
        raw = mlp(posenc(rays_o[..., None, :] + rays_d[..., None, :] * z[..., :, None]))
        rgb, sigma = torch.sigmoid(raw[..., :3]), F.relu(raw[..., 3])
        dists = torch.cat([z[..., 1:] - z[..., :-1], torch.full_like(z[..., :1], 1e10)], -1)
        alpha = 1 - torch.exp(-sigma * dists)
        trans = torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]), 1 - alpha + 1e-10], -1), -1)[..., :-1]
        w = alpha * trans
        return (w[..., None] * rgb).sum(-2), w, (w * z).sum(-1)

    t = torch.linspace(2.0, 6.0, 8, device=dev).expand(16, 8)
    mids = 0.5 * (t[..., 1:] + t[..., :-1])
    lower, upper = torch.cat([t[..., :1], mids], -1), torch.cat([mids, t[..., -1:]], -1)
    z = lower + (upper - lower) * torch.rand(t.shape, generator=torch.Generator().manual_seed(3)).to(dev)
    rgb, w, depth = render(z)
    bins, weights = 0.5 * (z[..., 1:] + z[..., :-1]), w[..., 1:-1].detach() + 1e-5
    cdf = torch.cumsum(weights / weights.sum(-1, keepdim=True), -1)
    cdf = torch.cat([torch.zeros_like(cdf[..., :1]), cdf], -1)
    u = torch.linspace(0, 1, 16, device=dev).expand(16, 16).contiguous()
    inds = torch.searchsorted(cdf, u, right=True)
    below = torch.max(torch.zeros_like(inds - 1), inds - 1)
    above = torch.min((cdf.shape[-1] - 1) * torch.ones_like(inds), inds)
    ig, shape = torch.stack([below, above], -1), [16, 16, cdf.shape[-1]]
    cdf_g = torch.gather(cdf.unsqueeze(1).expand(shape), 2, ig)
    bins_g = torch.gather(bins.unsqueeze(1).expand(shape), 2, ig)
    denom = cdf_g[..., 1] - cdf_g[..., 0]
    denom = torch.where(denom < 1e-5, torch.ones_like(denom), denom)
    samples = bins_g[..., 0] + (u - cdf_g[..., 0]) / denom * (bins_g[..., 1] - bins_g[..., 0])
    rgb2, _, depth2 = render(torch.sort(torch.cat([z, samples.detach()], -1), -1).values)
    F.mse_loss(rgb2, torch.full_like(rgb2, 0.5)).backward()
    return rgb, depth, inds, rgb2, depth2, mlp[0].weight.grad


@case
def gcn_sparse_mm(dev):
    n = 10
    src, dst = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 2]), torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 5, 7])
    ei = torch.cat([torch.stack([src, dst]), torch.stack([dst, src]), torch.arange(n).repeat(2, 1)], 1).to(dev)
    deg = torch.zeros(n, device=dev).index_add_(0, ei[0], torch.ones(ei.shape[1], device=dev))
    norm = deg[ei[0]].pow(-0.5) * deg[ei[1]].pow(-0.5)
    adj = torch.sparse_coo_tensor(ei, norm, (n, n)).coalesce()
    torch.manual_seed(0)
    w1, w2 = nn.Linear(5, 8).to(dev), nn.Linear(8, 3).to(dev)
    x, y = D(n, 5).to(dev), torch.tensor([0, 1, 2] * 3 + [0], device=dev)
    opt, losses = torch.optim.Adam([*w1.parameters(), *w2.parameters()], 0.01), []
    for _ in range(3):
        h = F.relu(torch.sparse.mm(adj, w1(x)))
        out = torch.zeros(n, 3, device=dev).index_add_(0, ei[1], w2(h)[ei[0]] * norm[:, None])
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses), (out.argmax(1) == y).float().mean(), adj.to_dense()


@case
def training_loop_idioms(dev):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)).to(dev)
    opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    x, y = D(32, 6).to(dev), D(32, 1, seed=1).to(dev)
    norms, lrs, losses, best, bad = [], [], [], float("inf"), 0
    for _ in range(8):
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5).item())
        opt.step()
        val = F.mse_loss(m(x), y).detach()
        plateau.step(val)
        lrs.append(opt.param_groups[0]["lr"])
        losses.append(val.item())
        if val.item() < best - 1e-3:
            best, bad = val.item(), 0
        else:
            bad += 1
            if bad > 2:
                break
    m2 = nn.Linear(6, 1).to(dev)
    opt2 = torch.optim.AdamW(m2.parameters(), 1e-2)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=0.1, total_steps=10)
    for _ in range(10):
        opt2.zero_grad()
        F.mse_loss(m2(x), y).backward()
        opt2.step()
        one_cycle.step()
        lrs.append(one_cycle.get_last_lr()[0])
    return torch.tensor(norms), torch.tensor(lrs), torch.tensor(losses), m2.weight, torch.tensor(len(losses))


@case
def resume_training_state(dev):
    """Saved mid-run (model, optimizer, scheduler, both RNG states) and resumed after the run went
    on: the same values as the uninterrupted run, dropout and device draws included."""
    x, y = D(16, 4).to(dev), D(16, 1, seed=1).to(dev)

    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1)).to(dev)
        o = torch.optim.Adam(m.parameters(), 1e-2)
        return m, o, torch.optim.lr_scheduler.StepLR(o, 2, 0.5)

    def train(m, o, s, n):
        out = []
        for _ in range(n):
            o.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            o.step()
            s.step()
            out += [loss.item(), torch.rand(1, device=dev).item()]
        return out

    m, o, s = make()
    torch.manual_seed(5)
    whole = train(m, o, s, 6)
    m, o, s = make()
    torch.manual_seed(5)
    first = train(m, o, s, 3)
    state = {"model": m.state_dict(), "opt": o.state_dict(), "sched": s.state_dict(), "rng": torch.get_rng_state()}
    if dev == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    train(m, o, s, 2)
    buf.seek(0)
    ck = torch.load(buf)
    m, o, s = make()
    m.load_state_dict(ck["model"])
    o.load_state_dict(ck["opt"])
    s.load_state_dict(ck["sched"])
    torch.set_rng_state(ck["rng"])
    if dev == "cuda":
        torch.cuda.set_rng_state(ck["cuda_rng"])
    rest = train(m, o, s, 3)
    assert first + rest == whole
    return torch.tensor(whole), list(m.parameters()), m[1].running_var


@pytest.mark.parametrize("name", sorted(CASES))
def test_tutorial_program_matches_local(name):
    assert_matches_local(CASES[name])
