"""A Diffusion Transformer trained and sampled as facebookresearch/DiT writes it: patch
embedding by a strided Conv2d, fixed 2-D sin-cos positions from NumPy, adaLN-Zero modulation
(chunk(6)), a learned-sigma output, class dropout for classifier-free guidance
(torch.where on a random mask), unpatchify by einsum; and its GaussianDiffusion: NumPy float64
schedules gathered by ``th.from_numpy(arr).to(device)[t].float()``, the hybrid loss (MSE plus the
variational bound with the discretized Gaussian log-likelihood), guided DDPM sampling with
``torch.split``/``torch.cat`` halves, and DDIM."""
import json
import math

import numpy as np
import torch
import torch as th
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
IMG, PATCH, CH, HID, DEPTH, HEADS, CLASSES, T = 8, 2, 2, 32, 2, 4, 3, 10


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden, freq=32):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(freq, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.freq = freq

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
        freqs = freqs.to(device=t.device)
        args = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t, self.freq))


class LabelEmbedder(nn.Module):
    def __init__(self, num_classes, hidden, dropout_prob):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, hidden)
        self.num_classes, self.dropout_prob = num_classes, dropout_prob

    def token_drop(self, labels, force_drop_ids=None):
        if force_drop_ids is None:
            drop_ids = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop_ids = force_drop_ids == 1
        return torch.where(drop_ids, self.num_classes, labels)

    def forward(self, labels, train, force_drop_ids=None):
        if (train and self.dropout_prob > 0) or (force_drop_ids is not None):
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * hidden, hidden))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden, bias=True))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


def get_2d_sincos_pos_embed(embed_dim, grid_size):
    grid_h = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_h, grid_h), axis=0).reshape([2, 1, grid_size, grid_size])

    def one_d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    return np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)


class DiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.out_channels = CH * 2
        self.x_embedder = nn.Conv2d(CH, HID, kernel_size=PATCH, stride=PATCH)
        self.t_embedder = TimestepEmbedder(HID)
        self.y_embedder = LabelEmbedder(CLASSES, HID, 0.1)
        self.num_patches = (IMG // PATCH) ** 2
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches, HID), requires_grad=False)
        self.blocks = nn.ModuleList([DiTBlock(HID, HEADS) for _ in range(DEPTH)])
        self.final_norm = nn.LayerNorm(HID, elementwise_affine=False, eps=1e-6)
        self.final_linear = nn.Linear(HID, PATCH * PATCH * self.out_channels)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(HID, 2 * HID))
        self.pos_embed.data.copy_(torch.from_numpy(get_2d_sincos_pos_embed(HID, IMG // PATCH)).float().unsqueeze(0))

    def unpatchify(self, x):
        c, p = self.out_channels, PATCH
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(shape=(x.shape[0], h, w, p, p, c))
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(shape=(x.shape[0], c, h * p, h * p))

    def forward(self, x, t, y):
        x = self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y, self.training)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_ada(c).chunk(2, dim=1)
        return self.unpatchify(self.final_linear(modulate(self.final_norm(x), shift, scale)))

    def forward_with_cfg(self, x, t, y, cfg_scale):
        half = x[: len(x) // 2]
        combined = torch.cat([half, half], dim=0)
        model_out = self.forward(combined, t, y)
        eps, rest = model_out[:, :CH], model_out[:, CH:]
        cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
        half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        eps = torch.cat([half_eps, half_eps], dim=0)
        return torch.cat([eps, rest], dim=1)


def _extract(arr, timesteps, broadcast_shape):
    res = th.from_numpy(arr).to(device=timesteps.device)[timesteps].float()
    while len(res.shape) < len(broadcast_shape):
        res = res[..., None]
    return res + th.zeros(broadcast_shape, device=timesteps.device)


def normal_kl(mean1, logvar1, mean2, logvar2):
    tensor = next(obj for obj in (mean1, logvar1, mean2, logvar2) if isinstance(obj, th.Tensor))
    logvar1, logvar2 = [x if isinstance(x, th.Tensor) else th.tensor(x).to(tensor) for x in (logvar1, logvar2)]
    return 0.5 * (-1.0 + logvar2 - logvar1 + th.exp(logvar1 - logvar2) + ((mean1 - mean2) ** 2) * th.exp(-logvar2))


def approx_standard_normal_cdf(x):
    return 0.5 * (1.0 + th.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * th.pow(x, 3))))


def discretized_gaussian_log_likelihood(x, *, means, log_scales):
    centered_x = x - means
    inv_stdv = th.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_stdv * (centered_x + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_stdv * (centered_x - 1.0 / 255.0))
    log_cdf_plus = th.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = th.log((1.0 - cdf_min).clamp(min=1e-12))
    cdf_delta = cdf_plus - cdf_min
    return th.where(x < -0.999, log_cdf_plus,
                    th.where(x > 0.999, log_one_minus_cdf_min, th.log(cdf_delta.clamp(min=1e-12))))


class GaussianDiffusion:
    def __init__(self, betas):
        self.betas = betas
        self.num_timesteps = len(betas)
        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas, axis=0)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1)
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_log_variance_clipped = np.log(np.append(self.posterior_variance[1], self.posterior_variance[1:]))
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - self.alphas_cumprod)

    def q_sample(self, x_start, t, noise):
        return (_extract(self.sqrt_alphas_cumprod, t, x_start.shape) * x_start
                + _extract(self.sqrt_one_minus_alphas_cumprod, t, x_start.shape) * noise)

    def q_posterior(self, x_start, x_t, t):
        mean = (_extract(self.posterior_mean_coef1, t, x_t.shape) * x_start
                + _extract(self.posterior_mean_coef2, t, x_t.shape) * x_t)
        return mean, _extract(self.posterior_log_variance_clipped, t, x_t.shape)

    def p_mean_variance(self, model_output, x, t):
        eps, var_values = th.split(model_output, CH, dim=1)
        min_log = _extract(self.posterior_log_variance_clipped, t, x.shape)
        max_log = _extract(np.log(self.betas), t, x.shape)
        frac = (var_values + 1) / 2
        log_variance = frac * max_log + (1 - frac) * min_log
        pred_xstart = (_extract(self.sqrt_recip_alphas_cumprod, t, x.shape) * x
                       - _extract(self.sqrt_recipm1_alphas_cumprod, t, x.shape) * eps).clamp(-1, 1)
        mean, _ = self.q_posterior(pred_xstart, x, t)
        return mean, log_variance, pred_xstart, eps

    def training_losses(self, model, x_start, t, y, noise):
        x_t = self.q_sample(x_start, t, noise)
        out = model(x_t, t, y)
        eps, var = th.split(out, CH, dim=1)
        frozen = th.cat([eps.detach(), var], dim=1)
        true_mean, true_log_var = self.q_posterior(x_start, x_t, t)
        mean, log_var, _, _ = self.p_mean_variance(frozen, x_t, t)
        kl = normal_kl(true_mean, true_log_var, mean, log_var).mean(dim=list(range(1, 4))) / np.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x_start, means=mean, log_scales=0.5 * log_var)
        nll = nll.mean(dim=list(range(1, 4))) / np.log(2.0)
        vb = th.where((t == 0), nll, kl) * self.num_timesteps / 1000.0
        return ((noise - eps) ** 2).mean(dim=list(range(1, 4))) + vb

    def p_sample_loop(self, model, shape, noise, model_kwargs):
        img = noise
        for i in list(range(self.num_timesteps))[::-1]:
            t = th.tensor([i] * shape[0], device=img.device)
            with th.no_grad():
                mean, log_var, _, _ = self.p_mean_variance(model(img, t, **model_kwargs), img, t)
                z = th.randn_like(img)
                nonzero_mask = (t != 0).float().view(-1, *([1] * (len(img.shape) - 1)))
                img = mean + nonzero_mask * th.exp(0.5 * log_var) * z
        return img

    def ddim_sample_loop(self, model, shape, noise, model_kwargs, eta=0.0):
        img = noise
        for i in list(range(self.num_timesteps))[::-1]:
            t = th.tensor([i] * shape[0], device=img.device)
            with th.no_grad():
                _, _, pred_xstart, _ = self.p_mean_variance(model(img, t, **model_kwargs), img, t)
                eps = ((_extract(self.sqrt_recip_alphas_cumprod, t, img.shape) * img - pred_xstart)
                       / _extract(self.sqrt_recipm1_alphas_cumprod, t, img.shape))
                alpha_bar_prev = _extract(self.alphas_cumprod_prev, t, img.shape)
                img = pred_xstart * th.sqrt(alpha_bar_prev) + th.sqrt(1 - alpha_bar_prev) * eps
        return img


torch.manual_seed(1)
model = DiT().to(device)
for block in model.blocks:
    nn.init.constant_(block.adaLN_modulation[-1].weight, 0)
    nn.init.constant_(block.adaLN_modulation[-1].bias, 0)
ema = DiT().to(device)
ema.load_state_dict(model.state_dict())
ema.requires_grad_(False)
diffusion = GaussianDiffusion(np.linspace(1e-4, 0.2, T, dtype=np.float64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0)
x0 = torch.tanh(torch.randn(6, CH, IMG, IMG)).to(device)
y = torch.tensor([0, 1, 2, 0, 1, 2]).to(device)
g = torch.Generator().manual_seed(2)
torch.cuda.manual_seed(3) if device == "cuda" else torch.manual_seed(3)
losses = []
model.train()
for step in range(4):
    t = torch.randint(0, diffusion.num_timesteps, (x0.shape[0],), generator=g).to(device)
    noise = torch.randn(x0.shape, generator=g).to(device)
    loss = diffusion.training_losses(model, x0, t, y, noise).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for ep, p in zip(ema.parameters(), model.parameters()):
            ep.mul_(0.9).add_(p.data, alpha=0.1)
    losses.append(loss.item())
ema.eval()
z = torch.randn(2, CH, IMG, IMG, generator=g).to(device)
z = torch.cat([z, z], 0)
y_cfg = torch.cat([torch.tensor([0, 2], device=device), torch.tensor([CLASSES] * 2, device=device)], 0)
torch.cuda.manual_seed(4) if device == "cuda" else torch.manual_seed(4)
samples = diffusion.p_sample_loop(ema.forward_with_cfg, z.shape, z, dict(y=y_cfg, cfg_scale=4.0))
samples, _ = samples.chunk(2, dim=0)
ddim = diffusion.ddim_sample_loop(ema.forward_with_cfg, z.shape, z, dict(y=y_cfg, cfg_scale=4.0))
print(json.dumps({"losses": losses, "ddpm": samples.sum().item(), "ddpm_abs": samples.abs().mean().item(),
                  "ddim": ddim.sum().item(), "device": str(samples.device)}))
