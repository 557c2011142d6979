"""More programs in the style of pytorch/examples and the PyTorch tutorials, pasted onto 'cuda'
(synthetic data): recurrent models with packed sequences, reinforcement learning with
torch.distributions, generative models (VAE, DCGAN, DDPM sampling), forward-forward, mixed
precision with a GradScaler, fused/foreach optimizers, schedulers, gradient accumulation with an
EMA, and DataLoader pinning with channels_last. Each runs on the local CPU and through the
gateway and must give the same values.

Dropout is off or the CPU's random stream is not used after 'cuda' draws: a GPU's generator is
its own, so masks drawn on 'cuda' after CPU-side initialisation differ from the CPU's there too."""
from __future__ import annotations

import copy
import random
import warnings
from collections import deque

import pytest
import torch
import torch.nn.functional as F
from local_parity import assert_matches_local, registry
from local_parity import data as _data
from torch import nn
from torch.distributions import Categorical, MultivariateNormal, Normal
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

pytestmark = pytest.mark.usefixtures("remote")
CASES, case = registry()


@case
def rnn_packed_sequences(dev):
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 8, num_layers=2, batch_first=True, bidirectional=True).to(dev)
    gru, fc = nn.GRU(4, 8, batch_first=True).to(dev), nn.Linear(16, 3).to(dev)
    x, lengths = _data(3, 5, 4).to(dev), torch.tensor([3, 5, 2])
    out, (h, _) = lstm(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
    padded, lens = pad_packed_sequence(out, batch_first=True)
    gout, _ = gru(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
    gpad, _ = pad_packed_sequence(gout, batch_first=True, total_length=5)
    logits = fc(torch.cat([h[-2], h[-1]], 1))
    (F.cross_entropy(logits, torch.tensor([0, 2, 1], device=dev)) + gpad.sum()).backward()
    return padded, lens, logits, gpad, lstm.weight_ih_l0.grad, gru.weight_hh_l0.grad


def test_packing_with_lengths_on_cuda_says_what_a_gpu_says():
    x = torch.zeros(2, 3, 4, device="cuda")
    with pytest.raises(RuntimeError, match="should be a 1D CPU int64 tensor, but got 1D cuda:0 Long tensor"):
        pack_padded_sequence(x, torch.tensor([3, 2], device="cuda"), batch_first=True)


@case
def word_language_model(dev):
    """pytorch/examples word_language_model: tied weights, repackage_hidden, clip_grad_norm_, p.data.add_."""
    torch.manual_seed(0)

    class RNNModel(nn.Module):
        def __init__(self, ntoken, nhid, nlayers):
            super().__init__()
            self.encoder, self.rnn = nn.Embedding(ntoken, nhid), nn.LSTM(nhid, nhid, nlayers)
            self.decoder = nn.Linear(nhid, ntoken)
            self.decoder.weight = self.encoder.weight
            nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
            nn.init.zeros_(self.decoder.bias)
            self.nhid, self.nlayers = nhid, nlayers

        def forward(self, inp, hidden):
            output, hidden = self.rnn(self.encoder(inp), hidden)
            return F.log_softmax(self.decoder(output).view(-1, self.encoder.num_embeddings), dim=1), hidden

        def init_hidden(self, bsz):
            weight = next(self.parameters())
            return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))

    corpus = torch.randint(0, 20, (120,), generator=torch.Generator().manual_seed(1))
    train = corpus.view(4, -1).t().contiguous().to(dev)
    model = RNNModel(20, 16, 2).to(dev)
    hidden, total = model.init_hidden(4), 0.0
    for i in range(0, 21, 7):
        data, targets = train[i:i + 7], train[i + 1:i + 8].reshape(-1)
        model.zero_grad()
        hidden = tuple(h.detach() for h in hidden)
        output, hidden = model(data, hidden)
        loss = F.nll_loss(output, targets)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-20)
        total += loss.item()
    with torch.no_grad():
        inp, hidden, words = torch.tensor([[3]], device=dev), model.init_hidden(1), []
        for _ in range(4):
            output, hidden = model(inp, hidden)
            word = torch.multinomial(output.squeeze().exp().cpu(), 1, generator=torch.Generator().manual_seed(2))[0]
            inp.fill_(word)
            words.append(word.item())
    return torch.tensor([total, *words]), model.encoder.weight


@case
def seq2seq_bahdanau_attention(dev):
    torch.manual_seed(0)
    H, V = 16, 12
    emb_e, enc = nn.Embedding(V, H).to(dev), nn.GRU(H, H, batch_first=True).to(dev)
    emb_d, dec, out_l = nn.Embedding(V, H).to(dev), nn.GRU(2 * H, H, batch_first=True).to(dev), nn.Linear(H, V).to(dev)
    wa, ua, va = nn.Linear(H, H).to(dev), nn.Linear(H, H).to(dev), nn.Linear(H, 1).to(dev)
    src = torch.randint(1, V, (3, 7), generator=torch.Generator().manual_seed(2)).to(dev)
    enc_out, h = enc(emb_e(src))
    dec_in, outs, atts = torch.empty(3, 1, dtype=torch.long, device=dev).fill_(0), [], []
    for _ in range(5):
        scores = va(torch.tanh(wa(h.permute(1, 0, 2)) + ua(enc_out))).squeeze(2).unsqueeze(1)
        w = F.softmax(scores, dim=-1)
        o, h = dec(torch.cat((emb_d(dec_in), torch.bmm(w, enc_out)), dim=2), h)
        o = out_l(o)
        outs.append(o)
        atts.append(w)
        _, topi = o.topk(1)
        dec_in = topi.squeeze(-1).detach()
    logp = F.log_softmax(torch.cat(outs, 1), dim=-1)
    F.nll_loss(logp.view(-1, V), src[:, :5].reshape(-1)).backward()
    return logp, torch.cat(atts, 1), wa.weight.grad


@case
def reinforce_with_normalised_returns(dev):
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2), nn.Softmax(dim=1)).to(dev)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    states, log_probs, rewards = _data(6, 4), [], []
    for t in range(6):
        m = Categorical(policy(states[t].unsqueeze(0).to(dev)))
        action = torch.tensor([t % 2], device=dev)
        log_probs.append(m.log_prob(action))
        rewards.append(1.0 if action.item() == 0 else 0.5)
    R, returns = 0.0, []
    for r in rewards[::-1]:
        R = r + 0.99 * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + torch.finfo(torch.float32).eps)
    opt.zero_grad()
    loss = torch.cat([-lp * R for lp, R in zip(log_probs, returns, strict=True)]).sum()
    loss.backward()
    opt.step()
    return loss, policy[0].weight


@case
def actor_critic(dev):
    """pytorch/examples actor_critic: value.item() each step, torch.tensor([R]) of a 0-d return."""
    torch.manual_seed(0)
    body, head, value_head = nn.Linear(4, 32).to(dev), nn.Linear(32, 2).to(dev), nn.Linear(32, 1).to(dev)
    params = [*body.parameters(), *head.parameters(), *value_head.parameters()]
    opt = torch.optim.Adam(params, lr=3e-2)
    saved, rewards = [], []
    for t, s in enumerate(_data(5, 4)):
        x = F.relu(body(s.to(dev)))
        probs, value = F.softmax(head(x), dim=-1), value_head(x)
        m = Categorical(probs)
        action = torch.tensor(t % 2, device=dev)
        saved.append((m.log_prob(action), value))
        rewards.append(float(value.item() > 0) + 0.1 * action.item())
    R, returns = 0.0, []
    for r in rewards[::-1]:
        R = r + 0.99 * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + 1e-8)
    policy_losses, value_losses = [], []
    for (log_prob, value), R in zip(saved, returns, strict=True):
        policy_losses.append(-log_prob * (R - value.item()))
        value_losses.append(F.smooth_l1_loss(value, torch.tensor([R]).to(dev)))
    opt.zero_grad()
    loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
    loss.backward()
    opt.step()
    return loss, body.weight


@case
def dqn_replay_and_soft_update(dev):
    """The DQN tutorial: a replay batch with a non-final mask built from a tuple of bools, masked
    writes of the target's values, clip_grad_value_ and a soft update through state_dicts."""
    torch.manual_seed(0)
    rng = random.Random(0)
    policy_net, target_net = (nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)).to(dev) for _ in range(2))
    target_net.load_state_dict(policy_net.state_dict())
    optimizer = torch.optim.AdamW(policy_net.parameters(), lr=1e-3, amsgrad=True)
    memory, losses, states = deque([], maxlen=100), [], _data(14, 4)
    state = torch.tensor(states[0].tolist(), dtype=torch.float32, device=dev).unsqueeze(0)
    for t in range(1, 14):
        if rng.random() > 0.5:
            with torch.no_grad():
                action = policy_net(state).max(1).indices.view(1, 1)
        else:
            action = torch.tensor([[rng.randrange(2)]], device=dev, dtype=torch.long)
        reward = torch.tensor([1.0 if action.item() == 0 else 0.0], device=dev)
        following = torch.tensor(states[t].tolist(), dtype=torch.float32, device=dev).unsqueeze(0)
        memory.append((state, action, None if t % 5 == 0 else following, reward))
        state = following
        if len(memory) >= 6:
            batch_state, batch_action, batch_next, batch_reward = zip(*rng.sample(memory, 6), strict=True)
            non_final_mask = torch.tensor(tuple(s is not None for s in batch_next), device=dev, dtype=torch.bool)
            values = policy_net(torch.cat(batch_state)).gather(1, torch.cat(batch_action))
            next_values = torch.zeros(6, device=dev)
            non_final = torch.cat([s for s in batch_next if s is not None])
            with torch.no_grad():
                next_values[non_final_mask] = target_net(non_final).max(1).values
            loss = nn.SmoothL1Loss()(values, (next_values * 0.99 + torch.cat(batch_reward)).unsqueeze(1))
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_value_(policy_net.parameters(), 100)
            optimizer.step()
            losses.append(loss.item())
        target_sd, policy_sd = target_net.state_dict(), policy_net.state_dict()
        for key in policy_sd:
            target_sd[key] = policy_sd[key] * 0.005 + target_sd[key] * (1 - 0.005)
        target_net.load_state_dict(target_sd)
    return torch.tensor(losses), target_net[0].weight, policy_net[2].bias


@case
def gaussian_policy_distributions(dev):
    torch.manual_seed(0)
    mu, log_std = nn.Linear(3, 2).to(dev), nn.Parameter(torch.zeros(2, device=dev))
    dist = Normal(mu(_data(4, 3).to(dev)), log_std.exp())
    assert dist.rsample().device.type == dev
    a = dist.loc + dist.scale * _data(4, 2, seed=1).to(dev)
    lp, ent = dist.log_prob(a).sum(-1), dist.entropy().sum(-1)
    (lp.mean() + ent.mean()).backward()
    cov = torch.tensor([[2.0, 0.5], [0.5, 1.0]], device=dev)
    mvn = MultivariateNormal(torch.zeros(2, device=dev), covariance_matrix=cov)
    assert mvn.rsample((3,)).shape == (3, 2)
    probs = torch.tensor([[0.2, 0.8], [0.9, 0.1]], device=dev)
    sample = Categorical(probs).sample()
    assert sample.device.type == dev and sample.dtype == torch.long and sample.shape == (2,)
    return lp, ent, mu.weight.grad, log_std.grad, mvn.log_prob(a), mvn.entropy(), Categorical(probs).entropy()


@case
def vae_two_steps(dev):
    torch.manual_seed(0)
    fc1, fc21, fc22, fc3, fc4 = (nn.Linear(i, o).to(dev) for i, o in [(16, 8), (8, 2), (8, 2), (2, 8), (8, 16)])
    params = [p for m in (fc1, fc21, fc22, fc3, fc4) for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)

    def decode(z):
        return torch.sigmoid(fc4(F.relu(fc3(z))))

    x = torch.rand(4, 1, 4, 4, generator=torch.Generator().manual_seed(1)).to(dev)
    torch.manual_seed(1)  # randn_like draws from the device's generator from here on
    total = 0.0
    for _ in range(2):
        opt.zero_grad()
        h1 = F.relu(fc1(x.view(-1, 16)))
        mu, logvar = fc21(h1), fc22(h1)
        std = torch.exp(0.5 * logvar)
        recon = decode(mu + torch.randn_like(std) * std)
        loss = F.binary_cross_entropy(recon, x.view(-1, 16), reduction="sum") \
            - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        loss.backward()
        total += loss.item()
        opt.step()
    with torch.no_grad():
        return torch.tensor(total), decode(_data(3, 2, seed=4).to(dev)).cpu()


@case
def dcgan_two_steps_with_label_smoothing(dev):
    torch.manual_seed(0)

    def weights_init(m):
        if m.__class__.__name__.find("Conv") != -1:
            nn.init.normal_(m.weight, 0.0, 0.02)
        elif m.__class__.__name__.find("BatchNorm") != -1:
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.zeros_(m.bias)

    net_g = nn.Sequential(nn.ConvTranspose2d(4, 8, 4, 1, 0, bias=False), nn.BatchNorm2d(8), nn.ReLU(True),
                          nn.ConvTranspose2d(8, 1, 4, 2, 1, bias=False), nn.Tanh())
    net_d = nn.Sequential(nn.Conv2d(1, 4, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
                          nn.Conv2d(4, 1, 4, 1, 0, bias=False), nn.Sigmoid())
    net_g.apply(weights_init)
    net_d.apply(weights_init)
    net_g, net_d, criterion = net_g.to(dev), net_d.to(dev), nn.BCELoss()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    real = _data(3, 1, 8, 8, seed=1).tanh().to(dev)
    for it in range(2):
        net_d.zero_grad()
        label = torch.full((3,), 0.9, dtype=real.dtype, device=dev)
        output = net_d(real).view(-1)
        err_d_real = criterion(output, label)
        err_d_real.backward()
        d_x = output.mean().item()
        fake = net_g(_data(3, 4, 1, 1, seed=10 + it).to(dev))
        label.fill_(0.0)
        err_d_fake = criterion(net_d(fake.detach()).view(-1), label)
        err_d_fake.backward()
        opt_d.step()
        net_g.zero_grad()
        label.fill_(0.9)
        err_g = criterion(net_d(fake).view(-1), label)
        err_g.backward()
        opt_g.step()
    return err_d_real + err_d_fake, err_g, torch.tensor(d_x), net_g[1].running_mean, net_g[0].weight


@case
def ddpm_sampling_loop(dev):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.SiLU(), nn.Conv2d(4, 1, 3, padding=1)).to(dev)
    betas = torch.linspace(1e-4, 0.02, 6, device=dev)
    alphas_cumprod = torch.cumprod(1.0 - betas, axis=0)
    alphas_cumprod_prev = F.pad(alphas_cumprod[:-1], (1, 0), value=1.0)
    sqrt_recip_alphas, sqrt_one_minus = torch.sqrt(1.0 / (1.0 - betas)), torch.sqrt(1.0 - alphas_cumprod)
    posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)

    def extract(a, t):
        return a.gather(-1, t).reshape(t.shape[0], 1, 1, 1)

    torch.manual_seed(7)
    img, imgs = torch.randn((2, 1, 6, 6), device=dev), []
    with torch.no_grad():
        for i in reversed(range(6)):
            t = torch.full((2,), i, device=dev, dtype=torch.long)
            mean = extract(sqrt_recip_alphas, t) * (img - extract(betas, t) * net(img) / extract(sqrt_one_minus, t))
            img = mean if i == 0 else mean + torch.sqrt(extract(posterior_variance, t)) * torch.randn_like(img)
            imgs.append(img.cpu())
    return torch.stack(imgs)


@case
def forward_forward(dev):
    """pytorch/examples mnist_forward_forward: labels written with x_[range(n), y] = x.max()."""
    torch.manual_seed(0)
    layers = [nn.Linear(16, 8).to(dev), nn.Linear(8, 8).to(dev)]
    opts = [torch.optim.Adam(layer.parameters(), lr=0.03) for layer in layers]

    def forward(layer, x):
        return F.relu(torch.mm(x / (x.norm(2, 1, keepdim=True) + 1e-4), layer.weight.T) + layer.bias.unsqueeze(0))

    def overlay_y_on_x(x, y):
        x_ = x.clone()
        x_[:, :10] *= 0.0
        x_[range(x.shape[0]), y] = x.max()
        return x_

    x, y = _data(5, 16).to(dev), torch.tensor([1, 3, 2, 0, 4]).to(dev)
    h_pos, h_neg = overlay_y_on_x(x, y), overlay_y_on_x(x, y[torch.tensor([4, 0, 1, 3, 2]).to(dev)])
    for layer, opt in zip(layers, opts, strict=True):
        for _ in range(2):
            g_pos, g_neg = forward(layer, h_pos).pow(2).mean(1), forward(layer, h_neg).pow(2).mean(1)
            loss = torch.log(1 + torch.exp(torch.cat([-g_pos + 2.0, g_neg - 2.0]))).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        h_pos, h_neg = forward(layer, h_pos).detach(), forward(layer, h_neg).detach()
    goodness = []
    for label in range(10):
        h, g = overlay_y_on_x(x, label), 0
        for layer in layers:
            h = forward(layer, h)
            g = g + h.pow(2).mean(1)
        goodness.append(g.unsqueeze(1))
    g = torch.cat(goodness, 1)
    return g, torch.tensor(1.0 - g.argmax(1).eq(y).float().mean().item())


def _mixed_precision(dev: str, dtype: torch.dtype, deprecated: bool = False) -> list:
    """Autocast and a GradScaler, an inf injected at step 3. The CPU reference for
    autocast('cuda') cannot run on a CPU, so it casts as CUDA's autocast lists do: linear in
    ``dtype``, layer_norm and cross_entropy in float32."""
    torch.manual_seed(0)
    l1, ln, l2 = nn.Linear(8, 16).to(dev), nn.LayerNorm(16).to(dev), nn.Linear(16, 4).to(dev)
    params = [*l1.parameters(), *ln.parameters(), *l2.parameters()]
    opt = torch.optim.AdamW(params, lr=0.1)
    if dev == "cuda" and deprecated:
        scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 10, growth_interval=2)
    else:
        scaler = torch.amp.GradScaler(dev, init_scale=2.0 ** 10, growth_interval=2)
    x, y = _data(4, 8).to(dev), torch.tensor([0, 1, 2, 3], device=dev)

    def forward():
        if dev == "cuda":
            with torch.cuda.amp.autocast(dtype=dtype) if deprecated else torch.autocast("cuda", dtype=dtype):
                h = F.relu(l1(x))
                assert h.dtype == dtype
                h = ln(h)
                assert h.dtype == torch.float32
                out = l2(h)
                return F.cross_entropy(out, y), out
        h = F.layer_norm(F.relu(F.linear(x.to(dtype), l1.weight.to(dtype), l1.bias.to(dtype))).float(), (16,),
                         ln.weight, ln.bias)
        out = F.linear(h.to(dtype), l2.weight.to(dtype), l2.bias.to(dtype))
        return F.cross_entropy(out.float(), y), out

    record = []
    for step in range(5):
        opt.zero_grad()
        loss, out = forward()
        assert out.dtype == dtype and loss.dtype == torch.float32
        if step == 2:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        record += [out.float(), norm, torch.tensor(scaler.get_scale()), l1.weight, l2.weight.grad]
    return record


@case
def autocast_float16_grad_scaler(dev):
    return _mixed_precision(dev, torch.float16)


@case
def autocast_bfloat16_grad_scaler(dev):
    return _mixed_precision(dev, torch.bfloat16)


@case
def deprecated_cuda_amp_grad_scaler(dev):
    """torch.cuda.amp's GradScaler and autocast still work, with torch's FutureWarnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _mixed_precision(dev, torch.float16, deprecated=True)
    said = {str(w.message).split("(")[0] for w in caught if w.category is FutureWarning}
    assert said == ({"`torch.cuda.amp.GradScaler", "`torch.cuda.amp.autocast"} if dev == "cuda" else set()), said
    return out


def _mlp(dev: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dev)


@case
def fused_and_foreach_optimizers(dev):
    """fused=True is CUDA's (the CPU reference runs the same update unfused)."""
    out = []
    for cls, kw in [(torch.optim.Adam, {"fused": True}), (torch.optim.AdamW, {"fused": True, "weight_decay": 0.1}),
                    (torch.optim.SGD, {"fused": True, "momentum": 0.9, "lr": 0.1}),
                    (torch.optim.Adam, {"foreach": True, "amsgrad": True}),
                    (torch.optim.SGD, {"foreach": True, "momentum": 0.9, "nesterov": True, "lr": 0.1})]:
        m = _mlp(dev)
        opt = cls(m.parameters(), **{k: v for k, v in kw.items() if k != "fused" or dev == "cuda"})
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(m(_data(4, 8).to(dev)), torch.zeros(4, 4, device=dev)).backward()
            opt.step()
        state = opt.state[m[0].weight]
        assert all(v.device.type == dev for v in state.values() if v.dim() > 0)
        out += [m[0].weight, *(v for v in state.values() if v.dim() > 0)]
    return out


@case
def one_cycle_and_warm_restarts_schedules(dev):
    m = _mlp(dev)
    x, lrs = _data(4, 8).to(dev), []
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=6)
    for _ in range(5):
        opt.zero_grad()
        F.mse_loss(m(x), torch.zeros(4, 4, device=dev)).backward()
        opt.step()
        one_cycle.step()
        lrs += [one_cycle.get_last_lr()[0], opt.param_groups[0]["momentum"]]
    opt2 = torch.optim.AdamW(m.parameters(), lr=1e-2)
    restarts = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt2, T_0=3, T_mult=2, eta_min=1e-4)
    for epoch in range(2):
        for i in range(3):
            opt2.zero_grad()
            F.mse_loss(m(x), torch.zeros(4, 4, device=dev)).backward()
            opt2.step()
            restarts.step(epoch + i / 3)
            lrs.append(restarts.get_last_lr()[0])
    return torch.tensor(lrs), m[0].weight


@case
def gradient_accumulation_and_ema(dev):
    m = _mlp(dev)
    ema = copy.deepcopy(m).eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x, y, norms = _data(6, 8).to(dev), _data(6, 4, seed=1).to(dev), []
    for i in range(6):
        (F.mse_loss(m(x[i:i + 1]), y[i:i + 1]) / 3).backward()
        if (i + 1) % 3 == 0:
            norms.append(nn.utils.clip_grad_norm_(m.parameters(), 0.5, foreach=True))
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for e, p in zip(ema.parameters(), m.parameters(), strict=True):
                    e.mul_(0.99).add_(p.detach(), alpha=0.01)
    assert m[0].weight.grad is None
    return torch.stack(norms), m[2].weight, ema(x)


@case
def pinned_loader_non_blocking_channels_last(dev):
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(4, 2)).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(TensorDataset(_data(10, 3, 6, 6), torch.arange(10) % 2), batch_size=4, shuffle=True,
                        pin_memory=True, generator=torch.Generator().manual_seed(0))
    losses = []
    for xb, yb in loader:
        xb = xb.to(dev, non_blocking=True).contiguous(memory_format=torch.channels_last)
        yb = yb.to(dev, non_blocking=True)
        opt.zero_grad()
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert net[0].weight.is_contiguous(memory_format=torch.channels_last)
    return torch.tensor(losses), net[0].weight.grad, net[1].running_var


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_matches_local(name):
    assert_matches_local(CASES[name])
