"""A DDPM as the tutorials write it (a tiny conv denoiser with sinusoidal time embeddings):
linear beta schedule as buffers, q_sample with gathered coefficients, training with an EMA of the
weights (torch._foreach_lerp_), then ancestral sampling and DDIM sampling from the EMA model."""

import copy
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
T = 20


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Block(nn.Module):
    def __init__(self, c_in, c_out, t_dim):
        super().__init__()
        self.norm = nn.GroupNorm(2, c_in)
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.t = nn.Linear(t_dim, c_out)

    def forward(self, x, temb):
        return self.conv(F.silu(self.norm(x))) + self.t(temb)[:, :, None, None]


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Conv2d(1, 8, 3, padding=1)
        self.down = Block(8, 16, 16)
        self.mid = Block(16, 16, 16)
        self.up = Block(32, 8, 16)
        self.out = nn.Conv2d(8, 1, 3, padding=1)
        self.temb = nn.Sequential(nn.Linear(16, 16), nn.SiLU(), nn.Linear(16, 16))

    def forward(self, x, t):
        temb = self.temb(timestep_embedding(t, 16))
        h0 = self.inp(x)
        h1 = self.down(F.avg_pool2d(h0, 2), temb)
        h2 = self.mid(h1, temb)
        h = F.interpolate(torch.cat([h1, h2], 1), scale_factor=2, mode="nearest")
        return self.out(self.up(h, temb) + h0)


class Diffusion(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        betas = torch.linspace(1e-4, 0.2, T, dtype=torch.float64)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)

        def reg(name, v):
            self.register_buffer(name, v.to(torch.float32))

        reg("betas", betas)
        reg("alphas_cumprod", alphas_cumprod)
        reg("alphas_cumprod_prev", F.pad(alphas_cumprod[:-1], (1, 0), value=1.0))
        reg("sqrt_alphas_cumprod", alphas_cumprod.sqrt())
        reg("sqrt_one_minus_alphas_cumprod", (1.0 - alphas_cumprod).sqrt())
        reg(
            "posterior_variance", betas * (1.0 - F.pad(alphas_cumprod[:-1], (1, 0), value=1.0)) / (1.0 - alphas_cumprod)
        )

    @staticmethod
    def extract(a, t, shape):
        return a.gather(-1, t).reshape(t.shape[0], *((1,) * (len(shape) - 1)))

    def q_sample(self, x0, t, noise):
        return (
            self.extract(self.sqrt_alphas_cumprod, t, x0.shape) * x0
            + self.extract(self.sqrt_one_minus_alphas_cumprod, t, x0.shape) * noise
        )

    def loss(self, x0):
        t = torch.randint(0, T, (x0.shape[0],), device=x0.device).long()
        noise = torch.randn_like(x0)
        return F.mse_loss(self.model(self.q_sample(x0, t, noise), t), noise)

    @torch.no_grad()
    def p_sample_loop(self, shape):
        img = torch.randn(shape, device=self.betas.device)
        for i in reversed(range(T)):
            t = torch.full((shape[0],), i, device=img.device, dtype=torch.long)
            eps = self.model(img, t)
            b, ac = self.extract(self.betas, t, shape), self.extract(self.alphas_cumprod, t, shape)
            mean = (img - b / torch.sqrt(1 - ac) * eps) / torch.sqrt(1 - b)
            if i > 0:
                img = mean + torch.sqrt(self.extract(self.posterior_variance, t, shape)) * torch.randn_like(img)
            else:
                img = mean
        return img.clamp(-1, 1)

    @torch.no_grad()
    def ddim_sample(self, shape, steps=5):
        img = torch.randn(shape, device=self.betas.device)
        times = torch.linspace(T - 1, 0, steps).long().tolist()
        for i, j in zip(times[:-1], times[1:]):
            t = torch.full((shape[0],), i, device=img.device, dtype=torch.long)
            eps = self.model(img, t)
            a_t, a_s = self.alphas_cumprod[i], self.alphas_cumprod[j]
            x0 = ((img - (1 - a_t).sqrt() * eps) / a_t.sqrt()).clamp(-1, 1)
            img = a_s.sqrt() * x0 + (1 - a_s).sqrt() * eps
        return img


data = torch.rand(32, 1, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 - 1
diffusion = Diffusion(Denoiser()).to(device)
ema = copy.deepcopy(diffusion).eval().requires_grad_(False)
opt = torch.optim.AdamW(diffusion.parameters(), lr=1e-3)
torch.manual_seed(2)  # timesteps and noise draw from the device's generator
losses = []
for epoch in range(2):
    for i in range(0, 32, 8):
        loss = diffusion.loss(data[i : i + 8].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(diffusion.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(diffusion.parameters()), 0.1)
        losses.append(loss.item())
samples = ema.p_sample_loop((2, 1, 8, 8)).cpu()
ddim = ema.ddim_sample((2, 1, 8, 8)).cpu()
print(
    json.dumps(
        {
            "device": str(diffusion.betas.device),
            "losses": losses,
            "sample_mean": samples.mean().item(),
            "sample": samples[0, 0, 0].tolist(),
            "ddim": ddim[0, 0, 0].tolist(),
            "ema_sum": sum(p.sum().item() for p in ema.parameters()),
        }
    )
)
