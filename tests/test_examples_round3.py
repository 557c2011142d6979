"""Classic deep-learning and scientific programs as users write them, pasted onto 'cuda'
(synthetic data, small sizes): L-BFGS with a closure (style transfer, a PINN with
``autograd.grad(create_graph=True)``), Gaussian-process regression (cholesky, triangular solves,
logdet, lstsq), hand-written graph networks (index_add_/scatter_reduce message passing, a dense
GCN), mixture-of-experts routing, PPO/REINFORCE with torch.distributions and a DQN replay buffer
kept on the device, a U-Net with a Dice loss and every interpolation mode, SimCLR/CLIP losses,
distillation, triplet mining, WGAN-GP, a neural ODE, RealNVP, k-means, seq2seq with teacher
forcing, a CTC speech model, LSTM forecasting on packed sequences, pruning, VQ-VAE, spectral PDE
solvers, PCA, molecular dynamics, Monte Carlo with a cuda Generator, Newton steps with
torch.func.hessian, a spatial transformer, Sinkhorn and Bayesian optimisation. Each runs on the
local CPU and through the gateway and must give the same values.

Random draws on 'cuda' are seeded right before them: a GPU's generator is its own, so draws made
there after CPU-side initialisation differ from the CPU's too. (Sparse COO graph networks:
tests/test_sparse.py.)"""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from local_parity import assert_matches_local, registry
from local_parity import data as D
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence, pad_packed_sequence, pad_sequence

pytestmark = pytest.mark.usefixtures("remote")
CASES, case = registry()


@case
def lbfgs_style(dev):
    torch.manual_seed(0)
    target = D(1, 3, 8, 8).to(dev)
    img = D(1, 3, 8, 8, seed=1).to(dev).requires_grad_(True)
    conv = nn.Conv2d(3, 4, 3).to(dev).requires_grad_(False)
    opt = torch.optim.LBFGS([img], lr=1, max_iter=5, history_size=4, line_search_fn="strong_wolfe")
    def gram(y):
        b, c, h, w = y.shape
        f = y.view(b, c, h*w)
        return f @ f.transpose(1, 2) / (c*h*w)
    losses = []
    for _ in range(2):
        def closure():
            opt.zero_grad()
            with torch.no_grad():
                img.clamp_(0, 1)
            loss = F.mse_loss(gram(conv(img)), gram(conv(target))) + F.mse_loss(conv(img), conv(target))
            loss.backward()
            return loss
        losses.append(opt.step(closure))
    return torch.stack(losses), img


@case
def pinn_burgers(dev):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = (torch.rand(32, 1) * 2 - 1).to(dev).requires_grad_(True)
    t = torch.rand(32, 1).to(dev).requires_grad_(True)
    out = []
    for _ in range(3):
        u = net(torch.cat([x, t], 1))
        u_t = torch.autograd.grad(u, t, torch.ones_like(u), create_graph=True)[0]
        u_x = torch.autograd.grad(u, x, grad_outputs=torch.ones_like(u), create_graph=True, retain_graph=True)[0]
        u_xx = torch.autograd.grad(u_x, x, torch.ones_like(u_x), create_graph=True)[0]
        f = u_t + u * u_x - (0.01 / math.pi) * u_xx
        x0 = torch.linspace(-1, 1, 16, device=dev).unsqueeze(1)
        u0 = net(torch.cat([x0, torch.zeros_like(x0)], 1))
        loss = f.pow(2).mean() + F.mse_loss(u0, -torch.sin(math.pi * x0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.detach())
    # LBFGS phase
    opt2 = torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=4)
    def closure():
        opt2.zero_grad()
        u = net(torch.cat([x, t], 1))
        u_x = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        residual = (u_x - 1).pow(2).mean()
        residual.backward()
        return residual
    out.append(opt2.step(closure).detach())
    return torch.stack(out), net[0].weight


@case
def gp_regression(dev):
    torch.manual_seed(0)
    X = torch.linspace(0, 5, 20, dtype=torch.float64).unsqueeze(1).to(dev)
    y = torch.sin(X).squeeze(1) + 0.1 * D(20).double().to(dev)
    Xs = torch.linspace(0, 5, 7, dtype=torch.float64, device=dev).unsqueeze(1)
    log_ls = torch.zeros((), dtype=torch.float64, device=dev, requires_grad=True)
    log_sf = torch.zeros((), dtype=torch.float64, device=dev, requires_grad=True)
    log_sn = torch.tensor(-2.0, dtype=torch.float64, device=dev, requires_grad=True)
    opt = torch.optim.Adam([log_ls, log_sf, log_sn], lr=0.05)
    def k(a, b):
        return log_sf.exp() ** 2 * torch.exp(-0.5 * torch.cdist(a, b) ** 2 / log_ls.exp() ** 2)
    nlls = []
    for _ in range(3):
        K = k(X, X) + (log_sn.exp() ** 2 + 1e-6) * torch.eye(20, dtype=X.dtype, device=dev)
        L = torch.linalg.cholesky(K)
        alpha = torch.cholesky_solve(y.unsqueeze(1), L)
        nll = 0.5 * y @ alpha.squeeze(1) + torch.log(torch.diagonal(L)).sum() + 10 * math.log(2 * math.pi)
        opt.zero_grad()
        nll.backward()
        opt.step()
        nlls.append(nll.detach())
    with torch.no_grad():
        K = k(X, X) + log_sn.exp() ** 2 * torch.eye(20, dtype=X.dtype, device=dev)
        L = torch.linalg.cholesky(K)
        Ks = k(X, Xs)
        v = torch.linalg.solve_triangular(L, Ks, upper=False)
        v2 = torch.triangular_solve(Ks, L, upper=False).solution
        mean = Ks.T @ torch.cholesky_solve(y.unsqueeze(1), L)
        var = k(Xs, Xs).diagonal() - (v ** 2).sum(0)
        ld = torch.logdet(K)
        sl = torch.linalg.slogdet(K)
        sol = torch.linalg.lstsq(torch.cat([X, torch.ones_like(X)], 1), y.unsqueeze(1)).solution
        inv = torch.cholesky_inverse(L)
        info = torch.linalg.cholesky_ex(K).info
    return torch.stack(nlls), mean, var, v, v2, ld, sl.logabsdet, sol, inv, info


@case
def gnn_message_passing(dev):
    torch.manual_seed(0)
    N, E, Fi = 10, 30, 5
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, N, (E,), generator=g).to(dev)
    dst = torch.randint(0, N, (E,), generator=g).to(dev)
    edge_index = torch.stack([src, dst])
    x = D(N, Fi).to(dev)
    lin = nn.Linear(Fi, 8).to(dev)
    h = lin(x)
    msg = h[edge_index[0]]
    agg = torch.zeros(N, 8, device=dev).index_add_(0, edge_index[1], msg)
    agg2 = torch.zeros(N, 8, device=dev).scatter_add_(0, edge_index[1].unsqueeze(1).expand(-1, 8), msg)
    deg = torch.bincount(edge_index[1], minlength=N).clamp(min=1).float()
    mean = agg / deg.unsqueeze(1)
    dst = edge_index[1].unsqueeze(1).expand(-1, 8)
    mx = torch.full((N, 8), float("-inf"), device=dev).scatter_reduce(0, dst, msg, reduce="amax", include_self=True)
    mn = torch.zeros(N, 8, device=dev).scatter_reduce(0, dst, msg, reduce="mean", include_self=False)
    # GAT-style softmax per destination
    e = (msg * h[edge_index[1]]).sum(-1)
    emax = torch.zeros(N, device=dev).scatter_reduce(0, edge_index[1], e, "amax", include_self=False)
    a = (e - emax[edge_index[1]]).exp()
    asum = torch.zeros(N, device=dev).index_add(0, edge_index[1], a)
    alpha = a / asum[edge_index[1]]
    out = torch.zeros(N, 8, device=dev).index_add_(0, edge_index[1], alpha.unsqueeze(1) * msg)
    loss = out.relu().sum() + mean.pow(2).sum() + torch.nan_to_num(mx, neginf=0).sum() + mn.sum()
    loss.backward()
    # segment mean via unique
    uniq, inv, counts = torch.unique(edge_index[1], return_inverse=True, return_counts=True)
    seg = torch.zeros(len(uniq), 8, device=dev).index_add_(0, inv, msg.detach()) / counts.unsqueeze(1)
    # batch pooling
    batch = torch.tensor([0]*4 + [1]*6, device=dev)
    pooled = torch.zeros(2, 8, device=dev).index_reduce_(0, batch, h.detach(), "mean", include_self=False)
    return agg, agg2, mean, mx, mn, out, lin.weight.grad, seg, uniq, counts, pooled


@case
def gcn_dense(dev):
    torch.manual_seed(0)
    N = 12
    A = (torch.rand(N, N, generator=torch.Generator().manual_seed(3)) < 0.3).float()
    A = ((A + A.T) > 0).float().to(dev)
    A_hat = A + torch.eye(N, device=dev)
    dinv = A_hat.sum(1).pow(-0.5)
    dinv[torch.isinf(dinv)] = 0
    An = dinv[:, None] * A_hat * dinv[None, :]
    X = D(N, 6).to(dev)
    y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(5)).to(dev)
    mask = torch.zeros(N, dtype=torch.bool, device=dev)
    mask[:8] = True
    W1, W2 = nn.Linear(6, 16).to(dev), nn.Linear(16, 3).to(dev)
    opt = torch.optim.Adam(list(W1.parameters()) + list(W2.parameters()), lr=0.01, weight_decay=5e-4)
    ls = []
    for _ in range(3):
        h = F.relu(An @ W1(X))
        out = An @ W2(h)
        loss = F.cross_entropy(out[mask], y[mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ls.append(loss.item())
    acc = (out.argmax(1)[~mask] == y[~mask]).float().mean()
    return torch.tensor(ls), out, acc


@case
def moe_routing(dev):
    torch.manual_seed(0)
    E, k, d = 4, 2, 8
    experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d)) for _ in range(E)]).to(dev)
    gate = nn.Linear(d, E, bias=False).to(dev)
    x = D(10, d).to(dev)
    logits = gate(x)
    probs = logits.softmax(-1)
    w, idx = torch.topk(probs, k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    mask = F.one_hot(idx, E).permute(2, 1, 0)
    for e in range(E):
        ki, tok = torch.where(mask[e])
        if tok.numel() == 0:
            continue
        out.index_add_(0, tok, experts[e](x[tok]) * w[tok, ki, None])
    # alternative loop using nonzero
    out2 = torch.zeros_like(x)
    flat = idx.view(-1)
    for e in range(E):
        pos = (flat == e).nonzero(as_tuple=True)[0]
        tok = pos // k
        out2[tok] += experts[e](x.index_select(0, tok)) * w.view(-1)[pos].unsqueeze(-1)
    counts = torch.bincount(idx.flatten(), minlength=E)
    frac = counts.float() / idx.numel()
    aux = E * (frac * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    (out.sum() + aux + z).backward()
    cap = counts.max().item()
    return out, out2, counts, aux, gate.weight.grad, experts[0][0].weight.grad, torch.tensor(cap)


@case
def reinforce_ppo(dev):
    from torch.distributions import Categorical, Normal
    torch.manual_seed(0)
    pol = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2)).to(dev)
    val = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1)).to(dev)
    opt = torch.optim.Adam(list(pol.parameters()) + list(val.parameters()), lr=3e-4)
    obs = D(16, 4).to(dev)
    with torch.no_grad():
        dist = Categorical(logits=pol(obs))
        acts = torch.tensor([0, 1] * 8, device=dev)
        old_logp = dist.log_prob(acts)
        v = val(obs).squeeze(-1)
    rewards = D(16, seed=2).to(dev)
    dones = torch.zeros(16, device=dev)
    dones[7] = 1
    gamma, lam = 0.99, 0.95
    adv = torch.zeros(16, device=dev)
    last = 0
    for t in reversed(range(16)):
        nv = v[t + 1] if t + 1 < 16 else 0.0
        delta = rewards[t] + gamma * nv * (1 - dones[t]) - v[t]
        last = delta + gamma * lam * (1 - dones[t]) * last
        adv[t] = last
    ret = adv + v
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ls = []
    for _ in range(2):
        for mb in torch.randperm(16, generator=torch.Generator().manual_seed(0)).view(2, 8):
            mb = mb.to(dev)
            d = Categorical(logits=pol(obs[mb]))
            ratio = (d.log_prob(acts[mb]) - old_logp[mb]).exp()
            s1 = ratio * adv[mb]
            s2 = torch.clamp(ratio, 0.8, 1.2) * adv[mb]
            value_loss = F.mse_loss(val(obs[mb]).squeeze(-1), ret[mb])
            loss = -torch.min(s1, s2).mean() + 0.5 * value_loss - 0.01 * d.entropy().mean()
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(pol.parameters(), 0.5)
            opt.step()
            ls.append(loss.detach())
    # continuous
    mu = nn.Linear(4, 2).to(dev)
    log_std = nn.Parameter(torch.zeros(2, device=dev))
    nd = Normal(mu(obs), log_std.exp())
    torch.manual_seed(1)
    a = nd.rsample()
    lp = nd.log_prob(a).sum(-1)
    ent = nd.entropy().sum(-1)
    # REINFORCE
    R = 0
    rets = []
    for r in reversed(rewards.tolist()):
        R = r + gamma * R
        rets.insert(0, R)
    rets = torch.tensor(rets, device=dev)
    rets = (rets - rets.mean()) / (rets.std() + 1e-9)
    pl = (-lp * rets).sum()
    pl.backward()
    return torch.stack(ls), adv, ret, lp, ent, mu.weight.grad, log_std.grad, a.shape


@case
def dqn_buffer_on_cuda(dev):
    torch.manual_seed(0)
    cap, od = 50, 4
    S = torch.zeros(cap, od, device=dev)
    A = torch.zeros(cap, dtype=torch.long, device=dev)
    R = torch.zeros(cap, device=dev)
    S2 = torch.zeros(cap, od, device=dev)
    Dn = torch.zeros(cap, dtype=torch.bool, device=dev)
    ptr = 0
    for i in range(30):
        s = D(od, seed=i)
        S[ptr] = s.to(dev)
        A[ptr] = i % 2
        R[ptr] = float(i % 3)
        S2[ptr] = torch.as_tensor(s + 1, device=dev)
        Dn[ptr] = i % 10 == 9
        ptr = (ptr + 1) % cap
    q = nn.Sequential(nn.Linear(od, 16), nn.ReLU(), nn.Linear(16, 2)).to(dev)
    tq = nn.Sequential(nn.Linear(od, 16), nn.ReLU(), nn.Linear(16, 2)).to(dev)
    tq.load_state_dict(q.state_dict())
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    ls = []
    for _ in range(3):
        torch.manual_seed(_)
        idx = torch.randint(0, 30, (8,), device=dev)
        qs = q(S[idx]).gather(1, A[idx].unsqueeze(1)).squeeze(1)
        with torch.no_grad():
            na = q(S2[idx]).argmax(1, keepdim=True)
            tgt = R[idx] + 0.99 * tq(S2[idx]).gather(1, na).squeeze(1) * (~Dn[idx]).float()
        loss = F.smooth_l1_loss(qs, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ls.append(loss.item())
    eps_greedy = q(S[:5]).max(1).indices.tolist()
    return torch.tensor(ls), q[0].weight, torch.tensor(eps_greedy)


@case
def unet_dice(dev):
    torch.manual_seed(0)
    class Up(nn.Module):
        def __init__(s, ci, co, bilinear):
            super().__init__()
            s.up = (nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True) if bilinear
                    else nn.ConvTranspose2d(ci, ci, 2, stride=2))
            s.conv = nn.Sequential(nn.Conv2d(ci * 2, co, 3, padding=1), nn.BatchNorm2d(co), nn.ReLU(inplace=True))
        def forward(s, x1, x2):
            x1 = s.up(x1)
            dy, dx = x2.size(2) - x1.size(2), x2.size(3) - x1.size(3)
            x1 = F.pad(x1, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
            return s.conv(torch.cat([x2, x1], dim=1))
    class UNet(nn.Module):
        def __init__(s, bilinear):
            super().__init__()
            s.inc = nn.Conv2d(3, 4, 3, padding=1)
            s.down = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
            s.up = Up(4, 4, bilinear)
            s.outc = nn.Conv2d(4, 2, 1)
        def forward(s, x):
            x1 = s.inc(x)
            x2 = s.down(x1)
            return s.outc(s.up(x2, x1))
    res = []
    for bil in (False, True):
        net = UNet(bil).to(dev)
        opt = torch.optim.RMSprop(net.parameters(), lr=1e-4, weight_decay=1e-8, momentum=0.9)
        x = D(2, 3, 9, 9).to(dev)
        m = (D(2, 9, 9, seed=1) > 0).long().to(dev)
        for _ in range(2):
            logits = net(x)
            p = F.softmax(logits, 1).float()
            oh = F.one_hot(m, 2).permute(0, 3, 1, 2).float()
            inter = 2 * (p * oh).sum(dim=(-1, -2))
            sets = p.sum(dim=(-1, -2)) + oh.sum(dim=(-1, -2))
            sets = torch.where(sets == 0, inter, sets)
            dice = ((inter + 1e-6) / (sets + 1e-6)).mean()
            loss = F.cross_entropy(logits, m) + 1 - dice
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            res.append(loss.detach())
        res.append(net.up.conv[1].running_mean)
    y = D(1, 2, 5, 7).to(dev)
    for mode, ac in [("nearest", None), ("bilinear", True), ("bilinear", False), ("bicubic", True), ("area", None),
                     ("nearest-exact", None)]:
        res.append(F.interpolate(y, size=(8, 11), mode=mode, align_corners=ac))
        res.append(F.interpolate(y, scale_factor=1.7, mode=mode, align_corners=ac))
    res.append(F.interpolate(D(1, 2, 5, seed=3).to(dev), scale_factor=2, mode="linear", align_corners=False))
    res.append(F.interpolate(D(1, 1, 3, 4, 5, seed=3).to(dev), scale_factor=2, mode="trilinear"))
    res.append(F.interpolate(y, scale_factor=0.5, mode="bilinear", antialias=True))
    return res


@case
def simclr(dev):
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 16)).to(dev)
    opt = torch.optim.SGD(enc.parameters(), lr=0.1, momentum=0.9)
    x1, x2 = D(8, 10).to(dev), D(8, 10, seed=1).to(dev)
    out = []
    for _ in range(2):
        z = F.normalize(torch.cat([enc(x1), enc(x2)]), dim=1)
        sim = z @ z.T / 0.5
        n = z.shape[0] // 2
        sim.fill_diagonal_(-9e15)
        labels = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(dev)
        loss = F.cross_entropy(sim, labels)
        # also the masked version
        mask = torch.eye(2 * n, dtype=torch.bool, device=dev)
        sim2 = (z @ z.T / 0.1).masked_fill(mask, float("-inf"))
        pos = torch.roll(torch.arange(2 * n, device=dev), n)
        loss2 = -sim2[torch.arange(2 * n, device=dev), pos] + torch.logsumexp(sim2, dim=-1)
        # CLIP style
        logit_scale = torch.tensor(math.log(1 / 0.07), device=dev)
        lg = logit_scale.exp() * F.normalize(enc(x1), dim=-1) @ F.normalize(enc(x2), dim=-1).t()
        tgt = torch.arange(len(lg), device=lg.device)
        clip = (F.cross_entropy(lg, tgt) + F.cross_entropy(lg.t(), tgt)) / 2
        acc = (sim2.argmax(-1) == pos).float().mean()
        total = loss + loss2.mean() + clip
        opt.zero_grad()
        total.backward()
        opt.step()
        out += [loss.detach(), loss2.detach(), clip.detach(), acc]
    return out


@case
def distillation(dev):
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5)).to(dev).eval()
    student = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 5)).to(dev)
    opt = torch.optim.Adam(student.parameters(), lr=1e-3)
    x, y = D(6, 10).to(dev), torch.tensor([0, 1, 2, 3, 4, 0]).to(dev)
    T = 2.0
    out = []
    for _ in range(2):
        with torch.no_grad():
            tl = teacher(x)
        sl = student(x)
        kd = F.kl_div(F.log_softmax(sl / T, dim=1), F.softmax(tl / T, dim=1), reduction="batchmean") * T * T
        kd2 = F.kl_div(F.log_softmax(sl / T, -1), F.log_softmax(tl / T, -1), reduction="batchmean", log_target=True)
        kd3 = nn.KLDivLoss(reduction="sum", log_target=True)(F.log_softmax(sl, -1), F.log_softmax(tl, -1))
        soft = -(F.softmax(tl / T, -1) * F.log_softmax(sl / T, -1)).sum(-1).mean()
        loss = 0.5 * kd + 0.5 * F.cross_entropy(sl, y) + kd2 + kd3 + soft
        opt.zero_grad()
        loss.backward()
        opt.step()
        out += [kd.detach(), kd2.detach(), kd3.detach(), soft.detach()]
    return out


@case
def triplet_hard_mining(dev):
    torch.manual_seed(0)
    emb = nn.Linear(6, 4).to(dev)
    x = D(12, 6).to(dev)
    labels = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]).to(dev)
    e = F.normalize(emb(x), p=2, dim=1)
    dist = torch.cdist(e, e, p=2)
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    eye = torch.eye(len(labels), dtype=torch.bool, device=dev)
    pos_mask = same & ~eye
    hardest_pos = (dist * pos_mask.float()).max(1).values
    max_d = dist.max(1, keepdim=True).values
    hardest_neg = (dist + max_d * same.float()).min(1).values
    loss = F.relu(hardest_pos - hardest_neg + 0.2).mean()
    tl = nn.TripletMarginLoss(margin=0.3)(e[0:3], e[[1, 4, 7]], e[[9, 10, 11]])
    tlf = F.triplet_margin_with_distance_loss(e[0:3], e[[1, 4, 7]], e[[9, 10, 11]],
                                              distance_function=lambda a, b: 1 - F.cosine_similarity(a, b))
    (loss + tl + tlf).backward()
    knn = dist.masked_fill(eye, float("inf")).topk(3, largest=False)
    pred = torch.mode(labels[knn.indices], dim=1).values
    recall = (labels[knn.indices[:, 0]] == labels).float().mean()
    cl = nn.CosineEmbeddingLoss(margin=0.1)(e[:6], e[6:], torch.tensor([1, -1, 1, -1, 1, -1], device=dev))
    d2 = torch.cdist(e.unsqueeze(0), e[:4].unsqueeze(0), p=1).squeeze(0)
    pd = F.pairwise_distance(e[:6], e[6:])
    return loss, tl, tlf, emb.weight.grad, knn.values, knn.indices, pred, recall, cl, d2, pd


@case
def wgan_gp(dev):
    torch.manual_seed(0)
    Dn = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)).to(dev)
    G = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4)).to(dev)
    od = torch.optim.Adam(Dn.parameters(), lr=1e-4, betas=(0.0, 0.9))
    og = torch.optim.Adam(G.parameters(), lr=1e-4, betas=(0.0, 0.9))
    real = D(8, 4).to(dev)
    out = []
    for it in range(2):
        torch.manual_seed(it + 10)
        z = torch.randn(8, 2, device=dev)
        fake = G(z).detach()
        alpha = torch.rand(8, 1, device=dev)
        interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        d_i = Dn(interp)
        grads = torch.autograd.grad(outputs=d_i, inputs=interp, grad_outputs=torch.ones(d_i.size(), device=dev),
                                    create_graph=True, retain_graph=True, only_inputs=True)[0]
        gp = ((grads.view(grads.size(0), -1).norm(2, dim=1) - 1) ** 2).mean()
        dl = -Dn(real).mean() + Dn(fake).mean() + 10 * gp
        od.zero_grad()
        dl.backward()
        od.step()
        gl = -Dn(G(z)).mean()
        og.zero_grad()
        gl.backward()
        og.step()
        out += [dl.detach(), gp.detach(), gl.detach()]
    return out, Dn[0].weight


@case
def neural_ode_rk4(dev):
    torch.manual_seed(0)
    f = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2)).to(dev)
    def rk4(func, y0, t):
        ys = [y0]
        y = y0
        for i in range(len(t) - 1):
            h = t[i + 1] - t[i]
            k1 = func(t[i], y)
            k2 = func(t[i] + h / 2, y + h * k1 / 2)
            k3 = func(t[i] + h / 2, y + h * k2 / 2)
            k4 = func(t[i] + h, y + h * k3)
            y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            ys.append(y)
        return torch.stack(ys)
    t = torch.linspace(0, 1, 6).to(dev)
    y0 = D(4, 2).to(dev)
    true = torch.stack([y0 * torch.exp(-ti) for ti in t])
    opt = torch.optim.Adam(f.parameters(), lr=1e-2)
    ls = []
    for _ in range(2):
        pred = rk4(lambda tt, y: f(y), y0, t)
        loss = (pred - true).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ls.append(loss.item())
    return torch.tensor(ls), pred


@case
def realnvp_flow(dev):
    torch.manual_seed(0)
    class Coupling(nn.Module):
        def __init__(s, mask):
            super().__init__()
            s.register_buffer("mask", mask)
            s.s = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))
            s.t = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4))
        def forward(s, x):
            xm = x * s.mask
            sc = s.s(xm) * (1 - s.mask)
            tr = s.t(xm) * (1 - s.mask)
            return xm + (1 - s.mask) * (x * torch.exp(sc) + tr), sc.sum(1)
    masks = [torch.tensor([1., 0, 1, 0]), torch.tensor([0., 1, 0, 1])] * 2
    flows = nn.ModuleList([Coupling(m) for m in masks]).to(dev)
    prior = torch.distributions.MultivariateNormal(torch.zeros(4, device=dev), torch.eye(4, device=dev))
    x = D(16, 4).to(dev)
    opt = torch.optim.Adam(flows.parameters(), lr=1e-3)
    out = []
    for _ in range(2):
        z, ld = x, torch.zeros(16, device=dev)
        for fl in flows:
            z, step_ld = fl(z)
            ld = ld + step_ld
        loss = -(prior.log_prob(z) + ld).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.detach())
    # MADE-style triangular masks + linear flow with LU
    W = torch.tril(torch.ones(4, 4, device=dev), -1)
    Wf = nn.Parameter(D(4, 4).to(dev))
    lu, piv = torch.linalg.lu_factor(Wf.detach())
    P, L, U = torch.linalg.lu(Wf)
    sld = torch.linalg.slogdet(Wf)
    y = x @ (Wf * W).T + x
    ld2 = torch.log(torch.abs(torch.diagonal(U))).sum()
    (ld2 + y.sum()).backward()
    return out, z, ld, lu, piv, P, L, U, sld.logabsdet, sld.sign, Wf.grad, prior.sample((2,)).shape


@case
def kmeans(dev):
    torch.manual_seed(0)
    X = torch.cat([D(20, 2) + 3, D(20, 2, seed=1) - 3, D(20, 2, seed=2) + torch.tensor([3., -3])]).to(dev)
    k = 3
    C = X[torch.tensor([0, 20, 40], device=dev)].clone()
    it = 0
    while True:
        dist = ((X[:, None, :] - C[None]) ** 2).sum(-1)
        assign = dist.argmin(1)
        newC = torch.stack([X[assign == j].mean(0) if (assign == j).any() else C[j] for j in range(k)])
        shift = (newC - C).norm()
        C = newC
        it += 1
        if shift.item() < 1e-4 or it > 20:
            break
    # kmeans++ init with multinomial
    torch.manual_seed(5)
    c0 = X[torch.randint(len(X), (1,), device=dev)]
    d2 = torch.cdist(X, c0).min(1).values ** 2
    nxt = torch.multinomial(d2 / d2.sum(), 1)
    inertia = dist.gather(1, assign[:, None]).sum()
    sizes = torch.bincount(assign, minlength=k)
    sc = torch.zeros(k, 2, device=dev).scatter_add_(0, assign[:, None].expand(-1, 2), X) / sizes[:, None]
    return C, assign, torch.tensor(it), inertia, sizes, sc, nxt


@case
def seq2seq_gru_attn_teacher_forcing(dev):
    torch.manual_seed(0)
    random.seed(0)
    V, H, L = 12, 16, 6
    class Enc(nn.Module):
        def __init__(s):
            super().__init__()
            s.emb = nn.Embedding(V, H)
            s.gru = nn.GRU(H, H, batch_first=True)
        def forward(s, x):
            return s.gru(s.emb(x))
    class Dec(nn.Module):
        def __init__(s):
            super().__init__()
            s.emb = nn.Embedding(V, H)
            s.attn = nn.Linear(2 * H, L)
            s.comb = nn.Linear(2 * H, H)
            s.gru = nn.GRU(H, H, batch_first=True)
            s.out = nn.Linear(H, V)
        def forward(s, inp, hid, enc_out):
            e = s.emb(inp)
            w = F.softmax(s.attn(torch.cat((e[:, 0], hid[0]), 1)), dim=1)
            applied = torch.bmm(w.unsqueeze(1), enc_out)
            o = F.relu(s.comb(torch.cat((e[:, 0], applied[:, 0]), 1)).unsqueeze(1))
            o, hid = s.gru(o, hid)
            return F.log_softmax(s.out(o[:, 0]), dim=1), hid, w
    enc, dec = Enc().to(dev), Dec().to(dev)
    eo, do = torch.optim.SGD(enc.parameters(), lr=0.01), torch.optim.SGD(dec.parameters(), lr=0.01)
    src = torch.randint(2, V, (3, L), generator=torch.Generator().manual_seed(1)).to(dev)
    tgt = torch.randint(2, V, (3, L), generator=torch.Generator().manual_seed(2)).to(dev)
    crit = nn.NLLLoss()
    ls = []
    for _it in range(3):
        eo.zero_grad()
        do.zero_grad()
        enc_out, hid = enc(src)
        inp = torch.zeros(3, 1, dtype=torch.long, device=dev)
        loss = 0
        atts = []
        tf = random.random() < 0.5
        for di in range(L):
            lp, hid, w = dec(inp, hid, enc_out)
            atts.append(w)
            loss += crit(lp, tgt[:, di])
            if tf:
                inp = tgt[:, di].unsqueeze(1)
            else:
                topv, topi = lp.topk(1)
                inp = topi.detach()
        loss.backward()
        nn.utils.clip_grad_norm_(enc.parameters(), 1.0)
        eo.step()
        do.step()
        ls.append(loss.item() / L)
    return torch.tensor(ls), torch.stack(atts), enc.emb.weight.grad


@case
def ctc_speech(dev):
    torch.manual_seed(0)
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.conv = nn.Sequential(nn.Conv2d(1, 4, 3, stride=(2, 1), padding=1), nn.GELU(), nn.Dropout(0.0))
            s.rnn = nn.GRU(4 * 8, 16, num_layers=2, bidirectional=True, batch_first=True)
            s.fc = nn.Linear(32, 6)
        def forward(s, x):
            x = s.conv(x)
            b, c, f, t = x.shape
            x = x.view(b, c * f, t).transpose(1, 2)
            x, _ = s.rnn(x)
            return s.fc(x)
    m = M().to(dev)
    opt = torch.optim.AdamW(m.parameters(), 5e-4)
    spec = D(3, 1, 16, 20).to(dev)
    targets = torch.tensor([[1, 2, 3, 4], [2, 3, 0, 0], [5, 1, 2, 0]]).to(dev)
    tl = torch.tensor([4, 2, 3])
    il = torch.tensor([20, 18, 15])
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    out = []
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-4, steps_per_epoch=3, epochs=1, anneal_strategy="linear")
    for _ in range(2):
        lp = F.log_softmax(m(spec), dim=2).transpose(0, 1)
        loss = ctc(lp, targets, il, tl)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        out.append(loss.detach())
    arg = lp.argmax(2).transpose(0, 1)
    decoded = []
    for seq in arg.tolist():
        r, prev = [], None
        for c in seq:
            if c != prev and c != 0:
                r.append(c)
            prev = c
        decoded.append(len(r))
    return out, arg, torch.tensor(decoded), m.fc.weight.grad


@case
def lstm_forecast_packed(dev):
    torch.manual_seed(0)
    seqs = [D(n, 3, seed=n) for n in (7, 5, 3, 6)]
    lengths = torch.tensor([len(s) for s in seqs])
    padded = pad_sequence(seqs, batch_first=True).to(dev)
    lstm = nn.LSTM(3, 8, batch_first=True, num_layers=2, dropout=0.0).to(dev)
    head = nn.Linear(8, 1).to(dev)
    opt = torch.optim.Adam(list(lstm.parameters()) + list(head.parameters()), lr=1e-2)
    y = D(4, 1, seed=9).to(dev)
    out = []
    for _ in range(2):
        packed = pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)
        po, (h, c) = lstm(packed)
        uo, ul = pad_packed_sequence(po, batch_first=True)
        last = uo[torch.arange(4, device=dev), (ul - 1).to(dev)]
        pred = head(h[-1])
        loss = F.mse_loss(pred, y) + F.l1_loss(head(last), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.detach())
    # pack_sequence directly, sorted
    ps = pack_sequence([s.to(dev) for s in sorted(seqs, key=len, reverse=True)])
    o2, _ = lstm(ps)
    # sliding-window autoregressive forecast
    series = torch.sin(torch.linspace(0, 6, 30)).to(dev)
    win = series.unfold(0, 5, 1)[:, :, None].expand(-1, -1, 3)
    preds = []
    ctx = win[-1:]
    with torch.no_grad():
        for _ in range(4):
            o, _ = lstm(ctx)
            p = head(o[:, -1])
            preds.append(p)
            ctx = torch.cat([ctx[:, 1:], p.unsqueeze(-1).expand(-1, 1, 3)], 1)
    return out, uo, ul, o2.data, o2.batch_sizes, torch.cat(preds)


@case
def pruning(dev):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 10)).to(dev)
    prune.l1_unstructured(net[0], name="weight", amount=0.3)
    prune.ln_structured(net[3], name="weight", amount=0.5, n=2, dim=0)
    m0 = net[0].weight_mask.clone()
    m3 = net[3].weight_mask.clone()
    x = D(2, 1, 6, 6).to(dev)
    net(x).sum().backward()
    g = net[0].weight_orig.grad
    prune.global_unstructured([(net[0], "weight"), (net[3], "weight")], pruning_method=prune.L1Unstructured, amount=0.4)
    sp = float(torch.sum(net[3].weight == 0)) / net[3].weight.nelement()
    prune.remove(net[0], "weight")
    prune.remove(net[3], "weight")
    names = len(sorted(n for n, _ in net.named_parameters()))
    prune.l1_unstructured(net[3], "bias", amount=3)
    prune.identity(net[0], "bias")
    sd = net.state_dict()
    return m0, m3, g, torch.tensor(sp), net[0].weight, net[3].weight, names, sd["3.bias_mask"], net(x)


@case
def vqvae_straight_through(dev):
    torch.manual_seed(0)
    cb = nn.Embedding(8, 4)
    cb.weight.data.uniform_(-1 / 8, 1 / 8)
    cb = cb.to(dev)
    enc = nn.Linear(6, 4).to(dev)
    dec = nn.Linear(4, 6).to(dev)
    x = D(10, 6).to(dev)
    z = enc(x)
    d = (z.pow(2).sum(1, keepdim=True) - 2 * z @ cb.weight.t() + cb.weight.pow(2).sum(1))
    idx = torch.argmin(d, dim=1)
    enc_oh = torch.zeros(idx.shape[0], 8, device=dev)
    enc_oh.scatter_(1, idx.unsqueeze(1), 1)
    q = enc_oh @ cb.weight
    loss = F.mse_loss(q.detach(), z) * 0.25 + F.mse_loss(q, z.detach())
    q = z + (q - z).detach()
    avg = enc_oh.mean(0)
    perp = torch.exp(-torch.sum(avg * torch.log(avg + 1e-10)))
    rec = F.mse_loss(dec(q), x)
    (loss + rec).backward()
    # gumbel
    torch.manual_seed(3)
    gs = F.gumbel_softmax(d, tau=0.5, hard=True)
    return idx, q, perp, enc.weight.grad, cb.weight.grad, gs.sum(1)


@case
def distributions_zoo(dev):
    from torch.distributions import (
        Bernoulli,
        Beta,
        Categorical,
        Dirichlet,
        Gamma,
        Independent,
        LogNormal,
        MixtureSameFamily,
        Normal,
        OneHotCategorical,
        TransformedDistribution,
        kl_divergence,
    )
    from torch.distributions.transforms import TanhTransform
    torch.manual_seed(0)
    p = nn.Parameter(D(5, 3).to(dev))
    out = []
    n1 = Normal(p, p.exp())
    n2 = Normal(torch.zeros(5, 3, device=dev), 1.0)
    out.append(kl_divergence(n1, n2))
    c1 = Categorical(logits=p)
    c2 = Categorical(probs=p.softmax(-1).flip(-1))
    out.append(kl_divergence(c1, c2))
    out.append(c1.entropy())
    b = Bernoulli(logits=p)
    out.append(b.log_prob((p > 0).float()))
    out.append(b.entropy())
    be = Beta(p.exp(), 2.0)
    out.append(be.log_prob(torch.full((5, 3), 0.3, device=dev)))
    out.append(be.mean)
    di = Dirichlet(p.exp())
    out.append(di.log_prob(torch.full((5, 3), 1 / 3, device=dev)))
    ind = Independent(Normal(p, 1.0), 1)
    out.append(ind.log_prob(torch.zeros(5, 3, device=dev)))
    mix = MixtureSameFamily(Categorical(logits=p), Normal(p, torch.ones(5, 3, device=dev)))
    out.append(mix.log_prob(torch.zeros(5, device=dev)))
    ga = Gamma(p.exp(), 1.0)
    out.append(ga.log_prob(torch.ones(5, 3, device=dev)))
    ln = LogNormal(p, 1.0)
    out.append(ln.log_prob(torch.ones(5, 3, device=dev)))
    sq = TransformedDistribution(Normal(p, 1.0), [TanhTransform(cache_size=1)])
    out.append(sq.log_prob(torch.full((5, 3), 0.5, device=dev)))
    oh = OneHotCategorical(logits=p)
    out.append(oh.log_prob(torch.eye(3, device=dev)[[0, 1, 2, 0, 1]]))
    sum(o.sum() for o in out).backward()
    torch.manual_seed(1)
    s = [be.sample().shape, di.sample().shape, ga.rsample().shape, mix.sample().shape]
    return out, p.grad, s


@case
def spectral_pde(dev):
    N = 16
    x = torch.linspace(0, 2 * math.pi, N + 1, device=dev)[:-1]
    X, Y = torch.meshgrid(x, x, indexing="ij")
    u = torch.sin(X) * torch.cos(2 * Y)
    k = torch.fft.fftfreq(N, d=1.0 / N, device=dev)
    kr = torch.fft.rfftfreq(N, d=1.0 / N).to(dev)
    KX, KY = torch.meshgrid(k, kr, indexing="ij")
    uh = torch.fft.rfft2(u)
    lap = torch.fft.irfft2(-(KX ** 2 + KY ** 2) * uh, s=(N, N))
    # heat eq implicit step in Fourier
    for _ in range(3):
        uh = uh / (1 + 0.01 * (KX ** 2 + KY ** 2))
    u2 = torch.fft.irfft2(uh, s=(N, N))
    f = torch.fft.fftshift(torch.fft.fft2(u.to(torch.complex64)))
    st = torch.tensor([[0., 1, 0], [1, -4, 1], [0, 1, 0]], device=dev).view(1, 1, 3, 3)
    fd = F.conv2d(F.pad(u[None, None], (1, 1, 1, 1), mode="circular"), st)
    gx, gy = torch.gradient(u, spacing=(x, x))
    tz = torch.trapezoid(u, x, dim=1)
    ctz = torch.cumulative_trapezoid(u[0], dx=x[1] - x[0])
    return lap, u2, f.abs(), f.angle(), fd, gx, gy, tz, ctz, torch.diff(u, dim=0, n=2)


@case
def pca_linalg(dev):
    X = D(30, 5).to(dev) @ D(5, 5, seed=1).to(dev)
    Xc = X - X.mean(0)
    cov = Xc.T @ Xc / (len(X) - 1)
    ev, evec = torch.linalg.eigh(cov)
    U, S, Vh = torch.linalg.svd(Xc, full_matrices=False)
    sv = torch.linalg.svdvals(Xc)
    Q, R = torch.linalg.qr(X)
    me = torch.linalg.matrix_exp(cov / 10)
    pinv = torch.linalg.pinv(X)
    nrm = torch.linalg.matrix_norm(X), torch.linalg.vector_norm(X, ord=3, dim=1), torch.linalg.norm(X, "nuc")
    cond = torch.linalg.cond(cov)
    rank = torch.linalg.matrix_rank(X)
    sol = torch.linalg.solve(cov, torch.ones(5, device=dev))
    inv = torch.linalg.inv(cov)
    proj = Xc @ Vh[:2].T
    evals = torch.linalg.eigvals(cov)
    det = torch.det(cov)
    return ev, evec.abs(), S, sv, R.abs(), me, pinv, nrm, cond, rank, sol, inv, proj.abs(), evals.real, det


@case
def md_lennard_jones(dev):
    torch.manual_seed(0)
    pos = (torch.rand(10, 3, generator=torch.Generator().manual_seed(0)) * 4).to(dev).requires_grad_(True)
    vel = torch.zeros(10, 3, device=dev)
    dt = 0.001
    es = []
    for _ in range(4):
        r = torch.cdist(pos, pos) + torch.eye(10, device=dev)
        inv6 = (1.0 / r) ** 6
        e = 4 * (inv6 ** 2 - inv6)
        e = torch.triu(e, diagonal=1).sum()
        force = -torch.autograd.grad(e, pos)[0]
        with torch.no_grad():
            vel += force * dt
            pos += vel * dt
        es.append(e.item())
    diff = pos.unsqueeze(1) - pos.unsqueeze(0)
    return torch.tensor(es), pos, vel, diff.norm(dim=-1)


@case
def monte_carlo_ising(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    pts = torch.rand(1000, 2, device=dev, generator=g)
    pi = 4 * (pts.pow(2).sum(1) <= 1).float().mean().item()
    N = 8
    s = torch.where(torch.rand(N, N, device=dev, generator=g) < 0.5, -1, 1).float()
    beta = 0.5
    mags = []
    for _ in range(4):
        nb = torch.roll(s, 1, 0) + torch.roll(s, -1, 0) + torch.roll(s, 1, 1) + torch.roll(s, -1, 1)
        dE = 2 * s * nb
        acc = torch.rand(N, N, device=dev, generator=g) < torch.exp(-beta * dE)
        chk = (torch.arange(N, device=dev)[:, None] + torch.arange(N, device=dev)) % 2 == 0
        s = torch.where(acc & chk, -s, s)
        mags.append(s.mean().abs().item())
    st = g.get_state()
    g2 = torch.Generator(device=dev)
    g2.set_state(st)
    a = torch.randn(3, device=dev, generator=g2)
    b = torch.randn(3, device=dev, generator=g)
    perm = torch.randperm(10, device=dev, generator=g)
    assert g.device.type == dev
    return torch.tensor(pi), s, torch.tensor(mags), a, b, perm


@case
def hessian_and_functional(dev):
    torch.manual_seed(0)
    from torch.autograd.functional import hessian, hvp, jacobian, vjp
    def rosen(x):
        return ((1 - x[:-1]) ** 2 + 100 * (x[1:] - x[:-1] ** 2) ** 2).sum()
    x = torch.tensor([0.5, 1.5, -0.3], device=dev)
    H = hessian(rosen, x)
    J = jacobian(lambda v: torch.stack([v.sin().sum(), (v ** 2).prod()]), x)
    _, hv = hvp(rosen, x, torch.ones(3, device=dev))
    _, vj = vjp(lambda v: v.exp(), x, torch.ones(3, device=dev))
    Hf = torch.func.hessian(rosen)(x)
    # Newton iterations
    y = x.clone()
    for _ in range(3):
        g = torch.func.grad(rosen)(y)
        y = y - torch.linalg.solve(torch.func.hessian(rosen)(y) + 1e-3 * torch.eye(3, device=dev), g)
    # scipy-style minimize with Adam on parameters
    return H, J, hv, vj, Hf, y


@case
def spatial_transformer(dev):
    torch.manual_seed(0)
    loc = nn.Sequential(nn.Flatten(), nn.Linear(64, 6)).to(dev)
    loc[1].weight.data.zero_()
    loc[1].bias.data.copy_(torch.tensor([1, 0, 0, 0, 1, 0], dtype=torch.float))
    x = D(2, 1, 8, 8).to(dev).requires_grad_(True)
    theta = (loc(x) + 0.1 * D(2, 6, seed=1).to(dev)).view(-1, 2, 3)
    out = []
    for ac in (False, True):
        grid = F.affine_grid(theta, x.size(), align_corners=ac)
        for mode in ("bilinear", "nearest", "bicubic"):
            for pm in ("zeros", "border", "reflection"):
                out.append(F.grid_sample(x, grid, mode=mode, padding_mode=pm, align_corners=ac))
    sum(o.sum() for o in out).backward()
    return out, x.grad, loc[1].weight.grad


@case
def sinkhorn_ot(dev):
    a = torch.full((6,), 1 / 6, device=dev)
    b = torch.full((5,), 1 / 5, device=dev)
    C = torch.cdist(D(6, 2).to(dev), D(5, 2, seed=1).to(dev)) ** 2
    eps = 0.1
    f = torch.zeros(6, device=dev)
    g = torch.zeros(5, device=dev)
    for it in range(50):
        f = -eps * torch.logsumexp((g[None] - C) / eps + b.log()[None], 1)
        g = -eps * torch.logsumexp((f[:, None] - C) / eps + a.log()[:, None], 0)
        if it % 10 == 0:
            P = torch.exp((f[:, None] + g[None] - C) / eps) * a[:, None] * b[None]
            if (P.sum(0) - b).abs().max() < 1e-6:
                break
    P = torch.exp((f[:, None] + g[None] - C) / eps) * a[:, None] * b[None]
    return P, (P * C).sum(), torch.tensor(it)


@case
def sobol_bayesopt(dev):
    from torch.quasirandom import SobolEngine
    se = SobolEngine(dimension=2, scramble=True, seed=0)
    Xc = se.draw(8).to(dev, torch.float64)
    y = (Xc ** 2).sum(1)
    ls = 0.3
    K = torch.exp(-torch.cdist(Xc, Xc) ** 2 / (2 * ls ** 2)) + 1e-6 * torch.eye(8, device=dev, dtype=torch.float64)
    L = torch.linalg.cholesky(K)
    cand = SobolEngine(2, scramble=True, seed=1).draw(16, dtype=torch.float64).to(dev)
    Ks = torch.exp(-torch.cdist(cand, Xc) ** 2 / (2 * ls ** 2))
    mu = Ks @ torch.cholesky_solve(y[:, None], L)
    v = torch.linalg.solve_triangular(L, Ks.T, upper=False)
    sd = (1 - (v ** 2).sum(0)).clamp_min(1e-9).sqrt()
    best = y.min()
    z = (best - mu.squeeze(1)) / sd
    n = torch.distributions.Normal(torch.zeros((), device=dev, dtype=torch.float64), 1.0)
    ei = sd * (z * n.cdf(z) + n.log_prob(z).exp())
    nxt = cand[ei.argmax()]
    special = [torch.special.erf(z), torch.special.ndtr(z), torch.special.log_ndtr(z), torch.special.gammaln(sd + 1),
               torch.special.i0(z)]
    return mu, sd, ei, nxt, special


@case
def beam_search(dev):
    torch.manual_seed(0)
    V, B, K, H = 10, 2, 3, 8
    emb = nn.Embedding(V, H).to(dev)
    cell = nn.GRUCell(H, H).to(dev)
    out = nn.Linear(H, V).to(dev)
    h = D(B, H).to(dev).repeat_interleave(K, 0)
    tokens = torch.zeros(B * K, 1, dtype=torch.long, device=dev)
    scores = torch.zeros(B, K, device=dev)
    scores[:, 1:] = float("-inf")
    finished = torch.zeros(B * K, dtype=torch.bool, device=dev)
    with torch.no_grad():
        for _step in range(5):
            h = cell(emb(tokens[:, -1]), h)
            lp = F.log_softmax(out(h), -1)
            lp = lp.masked_fill(finished.unsqueeze(1), float("-inf"))
            cand = (scores.view(-1, 1) + lp).view(B, K * V)
            top, idx = cand.topk(K, dim=1)
            beam = torch.div(idx, V, rounding_mode="floor")
            tok = idx % V
            base = (torch.arange(B, device=dev) * K).unsqueeze(1)
            sel = (base + beam).view(-1)
            tokens = torch.cat([tokens.index_select(0, sel), tok.view(-1, 1)], 1)
            h = h[sel]
            scores = top
            finished = finished[sel] | (tok.view(-1) == 2)
            if finished.all():
                break
    best = scores.argmax(1)
    return tokens, scores, best, tokens.view(B, K, -1)[torch.arange(B, device=dev), best]


@case
def quantum_sim(dev):
    X = torch.tensor([[0, 1], [1, 0]], dtype=torch.complex64, device=dev)
    Z = torch.tensor([[1, 0], [0, -1]], dtype=torch.complex64, device=dev)
    Id = torch.eye(2, dtype=torch.complex64, device=dev)
    Hm = torch.kron(Z, Z) + 0.5 * (torch.kron(X, Id) + torch.kron(Id, X))
    ev, evec = torch.linalg.eigh(Hm)
    psi0 = torch.zeros(4, dtype=torch.complex64, device=dev)
    psi0[0] = 1
    U = torch.linalg.matrix_exp(-1j * Hm * 0.3)
    psi = U @ psi0
    expZ = (psi.conj() @ torch.kron(Z, Id) @ psi).real
    probs = psi.abs() ** 2
    rho = torch.outer(psi, psi.conj())
    purity = torch.trace(rho @ rho).real
    theta = torch.tensor(0.4, device=dev, requires_grad=True)
    c, sn = torch.cos(theta / 2), torch.sin(theta / 2)
    Ry = torch.stack([torch.stack([c, -sn]), torch.stack([sn, c])]).to(torch.complex64)
    st = Ry @ torch.tensor([1, 0], dtype=torch.complex64, device=dev)
    e = (st.conj() @ Z @ st).real
    e.backward()
    return ev, U, psi, expZ, probs, purity, theta.grad, torch.view_as_real(st), torch.angle(psi)


@case
def hmc(dev):
    torch.manual_seed(0)
    mu = torch.tensor([1.0, -1.0], device=dev)
    cov = torch.tensor([[1.0, 0.8], [0.8, 1.0]], device=dev)
    prec = torch.linalg.inv(cov)
    def U(q):
        d = q - mu
        return 0.5 * d @ prec @ d
    def gradU(q):
        q = q.detach().requires_grad_(True)
        return torch.autograd.grad(U(q), q)[0]
    q = torch.zeros(2, device=dev)
    samples = []
    acc = 0
    for it in range(10):
        torch.manual_seed(100 + it)
        p = torch.randn(2, device=dev)
        q0, p0 = q.clone(), p.clone()
        p = p - 0.1 * gradU(q) / 2
        for _ in range(5):
            q = q + 0.1 * p
            p = p - 0.1 * gradU(q)
        p = p + 0.1 * gradU(q) / 2
        H0 = U(q0) + 0.5 * p0 @ p0
        H1 = U(q) + 0.5 * p @ p
        if torch.rand(1, device=dev).item() < torch.exp(H0 - H1).item():
            acc += 1
        else:
            q = q0
        samples.append(q)
    return torch.stack(samples), torch.tensor(acc)


@case
def grad_reversal_and_custom_fn(dev):
    torch.manual_seed(0)
    class GradReverse(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, alpha):
            ctx.alpha = alpha
            return x.view_as(x)
        @staticmethod
        def backward(ctx, g):
            return g.neg() * ctx.alpha, None
    class MyReLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clamp(min=0)
        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g):
            x, = ctx.saved_tensors
            gi = g.clone()
            gi[x < 0] = 0
            return gi
    class Swish(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            r = x * torch.sigmoid(x)
            ctx.save_for_backward(x)
            return r
        @staticmethod
        def backward(ctx, g):
            x, = ctx.saved_tensors
            s = torch.sigmoid(x)
            return g * (s * (1 + x * (1 - s)))
    feat = nn.Linear(4, 8).to(dev)
    dom = nn.Linear(8, 2).to(dev)
    cls = nn.Linear(8, 3).to(dev)
    x = D(6, 4).to(dev)
    f = MyReLU.apply(feat(x))
    loss = F.cross_entropy(cls(Swish.apply(f)), torch.tensor([0, 1, 2, 0, 1, 2], device=dev)) + \
        F.cross_entropy(dom(GradReverse.apply(f, 0.5)), torch.tensor([0, 1] * 3, device=dev))
    loss.backward()
    xg = D(3, 4, seed=2).double().to(dev).requires_grad_(True)
    ok = torch.autograd.gradcheck(Swish.apply, (xg,), eps=1e-6, atol=1e-4)
    return feat.weight.grad, dom.weight.grad, cls.weight.grad, torch.tensor(ok)


@case
def vit_patches_unfold(dev):
    torch.manual_seed(0)
    img = D(2, 3, 8, 8).to(dev)
    p = F.unfold(img, kernel_size=4, stride=4)
    patches = p.transpose(1, 2)
    proj = nn.Linear(48, 16).to(dev)
    cls_tok = nn.Parameter(torch.zeros(1, 1, 16, device=dev))
    pos = nn.Parameter(D(1, 5, 16, seed=1).to(dev))
    tok = torch.cat([cls_tok.expand(2, -1, -1), proj(patches)], 1) + pos
    enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True).to(dev)
    out = enc(tok)
    rec = F.fold(p, output_size=(8, 8), kernel_size=4, stride=4)
    p2 = img.unfold(2, 4, 4).unfold(3, 4, 4).contiguous().view(2, 3, -1, 16)
    def overlap_add(t):
        return F.fold(F.unfold(t, 3, padding=1), (8, 8), 3, padding=1)
    ov = overlap_add(img) / overlap_add(torch.ones_like(img))
    out[:, 0].sum().backward()
    return out, rec, p2, ov, proj.weight.grad, pos.grad


@case
def robust_stats(dev):
    x = D(7, 9).to(dev)
    r = [torch.median(x), x.median(dim=1), x.nanmedian(0),
         torch.quantile(x, torch.tensor([0.1, 0.5, 0.9], device=dev), dim=1), x.kthvalue(3, dim=1),
         torch.sort(x.round(), dim=1, stable=True), x.argsort(dim=0, descending=True), torch.cummax(x, 1),
         torch.cummin(x, 0), torch.logcumsumexp(x, 1), x.mode(1), torch.histc(x, bins=5, min=-2, max=2),
         torch.bucketize(x, torch.tensor([-1.0, 0, 1], device=dev)), x.std(1, unbiased=False),
         torch.var_mean(x, 0, correction=0), torch.aminmax(x), x.msort(), torch.cov(x), torch.corrcoef(x),
         x.renorm(2, 0, 1.0), torch.unique(x.round(), sorted=True, return_counts=True),
         torch.unique_consecutive(x.round().flatten(), return_counts=True), torch.nanquantile(x, 0.3)]
    out = []
    for v in r:
        out += list(v) if isinstance(v, tuple) else [v]
    return out


@case
def gpu_augment(dev):
    torch.manual_seed(0)
    x = D(4, 3, 10, 10).to(dev)
    torch.manual_seed(7)
    flip = torch.rand(4, device=dev) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    i, j = torch.randint(0, 3, (2,), device=dev).tolist()
    crop = x[:, :, i:i + 8, j:j + 8]
    rot = torch.rot90(crop, 1, (2, 3))
    mean = torch.tensor([0.485, 0.456, 0.406], device=dev).view(1, 3, 1, 1)
    norm = (rot - mean) / torch.tensor([0.229, 0.224, 0.225], device=dev).view(1, 3, 1, 1)
    lam = torch.distributions.Beta(torch.tensor(0.4, device=dev), torch.tensor(0.4, device=dev)).sample()
    perm = torch.randperm(4, device=dev)
    mixed = lam * norm + (1 - lam) * norm[perm]
    jitter = norm * (1 + 0.2 * (torch.rand(4, 1, 1, 1, device=dev) - 0.5))
    gray = (norm * torch.tensor([0.299, 0.587, 0.114], device=dev).view(1, 3, 1, 1)).sum(1, keepdim=True)
    noise = norm + 0.1 * torch.randn_like(norm)
    erase = norm.clone()
    erase[:, :, 2:4, 2:4] = 0
    return flip, crop, rot, norm, lam, perm, mixed, jitter, gray, noise, erase, torch.tensor([i, j])


@case
def set_transformer_masks(dev):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True, dropout=0.0).to(dev)
    x = D(3, 5, 8).to(dev)
    lengths = torch.tensor([5, 3, 2], device=dev)
    kpm = torch.arange(5, device=dev)[None, :] >= lengths[:, None]
    o, w = mha(x, x, x, key_padding_mask=kpm)
    o2, w2 = mha(x, x, x, key_padding_mask=kpm, average_attn_weights=False)
    causal = nn.Transformer.generate_square_subsequent_mask(5, device=dev)
    o3, _ = mha(x, x, x, attn_mask=causal, need_weights=False)
    pooled = (o * (~kpm).unsqueeze(-1)).sum(1) / lengths.unsqueeze(-1)
    seeds = nn.Parameter(D(1, 2, 8, seed=2).to(dev))
    pma, _ = mha(seeds.expand(3, -1, -1), x, x, key_padding_mask=kpm)
    mha.eval()
    with torch.inference_mode():
        o4, _ = mha(x, x, x, key_padding_mask=kpm)
        inf = o4.is_inference()
    (pooled.sum() + pma.sum()).backward()
    return o, w, o2, w2, o3, pooled, pma, o4, torch.tensor(inf), mha.in_proj_weight.grad


@case
def capsule_routing(dev):
    torch.manual_seed(0)
    def squash(s, dim=-1):
        n2 = (s ** 2).sum(dim, keepdim=True)
        return n2 / (1 + n2) * s / torch.sqrt(n2 + 1e-8)
    u = D(2, 6, 4).to(dev)
    W = nn.Parameter(D(1, 6, 3, 5, 4, seed=1).to(dev) * 0.1)
    u_hat = (W @ u[:, :, None, :, None]).squeeze(-1)
    b = torch.zeros(2, 6, 3, device=dev)
    for r in range(3):
        c = F.softmax(b, dim=2)
        v = squash((c.unsqueeze(-1) * u_hat).sum(1))
        if r < 2:
            b = b + (u_hat * v.unsqueeze(1)).sum(-1)
    lengths = v.norm(dim=-1)
    tgt = F.one_hot(torch.tensor([0, 2], device=dev), 3).float()
    margin = (tgt * F.relu(0.9 - lengths) ** 2 + 0.5 * (1 - tgt) * F.relu(lengths - 0.1) ** 2).sum(1).mean()
    margin.backward()
    return v, lengths, margin, W.grad


@case
def maml(dev):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 1)).to(dev)
    meta = torch.optim.Adam(net.parameters(), lr=1e-3)
    out = []
    for it in range(2):
        meta.zero_grad()
        tot = 0
        for t in range(2):
            xs, ys = D(5, 1, seed=it * 10 + t).to(dev), D(5, 1, seed=it * 10 + t + 5).to(dev)
            params = dict(net.named_parameters())
            for _ in range(2):
                inner = F.mse_loss(functional_call(net, params, (xs,)), ys)
                grads = torch.autograd.grad(inner, params.values(), create_graph=True)
                params = {n: p - 0.01 * g for (n, p), g in zip(params.items(), grads)}
            ql = F.mse_loss(functional_call(net, params, (xs * 2,)), ys)
            tot = tot + ql
        tot.backward()
        meta.step()
        out.append(tot.detach())
    return out, net[0].weight


@case
def trpo_cg(dev):
    torch.manual_seed(0)
    pol = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dev)
    obs = D(10, 4).to(dev)
    acts = torch.tensor([0, 1] * 5, device=dev)
    adv = D(10, seed=1).to(dev)
    with torch.no_grad():
        old = F.log_softmax(pol(obs), -1)
    def surr():
        lp = F.log_softmax(pol(obs), -1)
        ratio = torch.exp(lp.gather(1, acts[:, None]).squeeze(1) - old.gather(1, acts[:, None]).squeeze(1))
        return (ratio * adv).mean()
    def kl():
        lp = F.log_softmax(pol(obs), -1)
        return (old.exp() * (old - lp)).sum(-1).mean()
    params = list(pol.parameters())
    g = parameters_to_vector(torch.autograd.grad(surr(), params))
    def Fvp(v):
        k = kl()
        gk = parameters_to_vector(torch.autograd.grad(k, params, create_graph=True))
        return parameters_to_vector(torch.autograd.grad((gk * v).sum(), params)) + 0.1 * v
    x = torch.zeros_like(g)
    r = g.clone()
    p = g.clone()
    rr = r @ r
    for _i in range(5):
        Ap = Fvp(p)
        alpha = rr / (p @ Ap)
        x += alpha * p
        r -= alpha * Ap
        nrr = r @ r
        if nrr < 1e-10:
            break
        p = r + nrr / rr * p
        rr = nrr
    step = torch.sqrt(2 * 0.01 / (x @ Fvp(x))) * x
    oldp = parameters_to_vector(params)
    for frac in [1.0, 0.5, 0.25]:
        vector_to_parameters(oldp + frac * step, params)
        if kl().item() <= 0.01 and surr().item() > 0:
            break
    return g, x, step, parameters_to_vector(pol.parameters()), torch.tensor(frac)


@pytest.mark.parametrize("name", sorted(CASES))
def test_program_matches_local(name):
    assert_matches_local(CASES[name])
