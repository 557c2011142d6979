"""lucidrains/denoising-diffusion-pytorch's core as it is written: an einops U-Net (rearrange,
reduce, repeat, pack), weight-standardized convs, LinearAttention and full Attention by einsum,
RMSNorm with F.normalize, learned sinusoidal time features, the sigmoid/cosine schedules as
registered float32 buffers, p_losses with offset noise and min-SNR loss weights, self-conditioning,
``torch.cuda.amp.autocast(enabled=False)`` around the loss, and DDIM sampling over
``torch.linspace(...).int().tolist()`` times."""
import json
import math
import random
from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange, reduce, repeat
from torch import einsum, nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


def exists(x):
    return x is not None


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.g = nn.Parameter(torch.ones(1, dim, 1, 1))

    def forward(self, x):
        return F.normalize(x, dim=1) * self.g * self.scale


class WeightStandardizedConv2d(nn.Conv2d):
    def forward(self, x):
        eps = 1e-5 if x.dtype == torch.float32 else 1e-3
        weight = self.weight
        mean = reduce(weight, "o ... -> o 1 1 1", "mean")
        var = reduce(weight, "o ... -> o 1 1 1", partial(torch.var, unbiased=False))
        weight = (weight - mean) * (var + eps).rsqrt()
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class LearnedSinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weights = nn.Parameter(torch.randn(dim // 2))

    def forward(self, x):
        x = rearrange(x, "b -> b 1")
        freqs = x * rearrange(self.weights, "d -> 1 d") * 2 * math.pi
        return torch.cat((x, freqs.sin(), freqs.cos()), dim=-1)


class Block(nn.Module):
    def __init__(self, dim, dim_out, groups=4):
        super().__init__()
        self.proj = WeightStandardizedConv2d(dim, dim_out, 3, padding=1)
        self.norm = nn.GroupNorm(groups, dim_out)

    def forward(self, x, scale_shift=None):
        x = self.norm(self.proj(x))
        if exists(scale_shift):
            scale, shift = scale_shift
            x = x * (scale + 1) + shift
        return F.silu(x)


class ResnetBlock(nn.Module):
    def __init__(self, dim, dim_out, time_emb_dim):
        super().__init__()
        self.mlp = nn.Sequential(nn.SiLU(), nn.Linear(time_emb_dim, dim_out * 2))
        self.block1, self.block2 = Block(dim, dim_out), Block(dim_out, dim_out)
        self.res_conv = nn.Conv2d(dim, dim_out, 1) if dim != dim_out else nn.Identity()

    def forward(self, x, time_emb):
        time_emb = rearrange(self.mlp(time_emb), "b c -> b c 1 1")
        h = self.block1(x, scale_shift=time_emb.chunk(2, dim=1))
        return self.block2(h) + self.res_conv(x)


class LinearAttention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=8, num_mem_kv=2):
        super().__init__()
        self.scale, self.heads = dim_head ** -0.5, heads
        hidden = dim_head * heads
        self.norm = RMSNorm(dim)
        self.mem_kv = nn.Parameter(torch.randn(2, heads, dim_head, num_mem_kv))
        self.to_qkv = nn.Conv2d(dim, hidden * 3, 1, bias=False)
        self.to_out = nn.Sequential(nn.Conv2d(hidden, dim, 1), RMSNorm(dim))

    def forward(self, x):
        b, c, h, w = x.shape
        x = self.norm(x)
        qkv = self.to_qkv(x).chunk(3, dim=1)
        q, k, v = map(lambda t: rearrange(t, "b (h c) x y -> b h c (x y)", h=self.heads), qkv)
        mk, mv = map(lambda t: repeat(t, "h c n -> b h c n", b=b), self.mem_kv)
        k, v = map(partial(torch.cat, dim=-1), ((mk, k), (mv, v)))
        q = q.softmax(dim=-2) * self.scale
        k = k.softmax(dim=-1)
        context = einsum("b h d n, b h e n -> b h d e", k, v)
        out = einsum("b h d e, b h d n -> b h e n", context, q)
        return self.to_out(rearrange(out, "b h c (x y) -> b (h c) x y", h=self.heads, x=h, y=w))


class Attention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=8):
        super().__init__()
        self.heads = heads
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Conv2d(dim, dim_head * heads * 3, 1, bias=False)
        self.to_out = nn.Conv2d(dim_head * heads, dim, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = map(lambda t: rearrange(t, "b (h c) x y -> b h (x y) c", h=self.heads),
                      self.to_qkv(self.norm(x)).chunk(3, dim=1))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(rearrange(out, "b h (x y) d -> b (h d) x y", x=h, y=w))


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, *args, **kwargs):
        return self.fn(x, *args, **kwargs) + x


class Unet(nn.Module):
    def __init__(self, dim=8, channels=1, self_condition=True):
        super().__init__()
        self.channels, self.self_condition = channels, self_condition
        self.init_conv = nn.Conv2d(channels * 2, dim, 7, padding=3)
        tdim = dim * 4
        self.time_mlp = nn.Sequential(LearnedSinusoidalPosEmb(16), nn.Linear(17, tdim), nn.GELU(),
                                      nn.Linear(tdim, tdim))
        self.down1 = nn.ModuleList([ResnetBlock(dim, dim, tdim), Residual(LinearAttention(dim))])
        self.downsample = nn.Conv2d(dim * 4, 2 * dim, 1)
        self.mid = ResnetBlock(2 * dim, 2 * dim, tdim)
        self.mid_attn = Residual(Attention(2 * dim))
        self.up = nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(2 * dim, dim, 3, padding=1))
        self.up_block = ResnetBlock(2 * dim, dim, tdim)
        self.final_res = ResnetBlock(2 * dim, dim, tdim)
        self.final_conv = nn.Conv2d(dim, channels, 1)

    def forward(self, x, time, x_self_cond=None):
        x_self_cond = x_self_cond if exists(x_self_cond) else torch.zeros_like(x)
        x = torch.cat((x_self_cond, x), dim=1)
        x = self.init_conv(x)
        r = x.clone()
        t = self.time_mlp(time)
        h = self.down1[1](self.down1[0](x, t))
        skip = h
        h = self.downsample(rearrange(h, "b c (h p1) (w p2) -> b (c p1 p2) h w", p1=2, p2=2))
        h = self.mid_attn(self.mid(h, t))
        h = self.up_block(torch.cat((self.up(h), skip), dim=1), t)
        return self.final_conv(self.final_res(torch.cat((h, r), dim=1), t))


def extract(a, t, x_shape):
    b, *_ = t.shape
    out = a.gather(-1, t)
    return out.reshape(b, *((1,) * (len(x_shape) - 1)))


def sigmoid_beta_schedule(timesteps, start=-3, end=3, tau=1):
    steps = timesteps + 1
    t = torch.linspace(0, timesteps, steps, dtype=torch.float64) / timesteps
    v_start, v_end = torch.tensor(start / tau).sigmoid(), torch.tensor(end / tau).sigmoid()
    alphas_cumprod = (-((t * (end - start) + start) / tau).sigmoid() + v_end) / (v_end - v_start)
    alphas_cumprod = alphas_cumprod / alphas_cumprod[0]
    betas = 1 - (alphas_cumprod[1:] / alphas_cumprod[:-1])
    return torch.clip(betas, 0, 0.999)


class GaussianDiffusion(nn.Module):
    def __init__(self, model, image_size=8, timesteps=12, sampling_timesteps=4, offset_noise_strength=0.1,
                 min_snr_gamma=5):
        super().__init__()
        self.model, self.image_size, self.channels = model, image_size, model.channels
        betas = sigmoid_beta_schedule(timesteps)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        alphas_cumprod_prev = F.pad(alphas_cumprod[:-1], (1, 0), value=1.0)
        self.num_timesteps, self.sampling_timesteps = int(betas.shape[0]), sampling_timesteps
        self.offset_noise_strength = offset_noise_strength

        def register_buffer(name, val):
            self.register_buffer(name, val.to(torch.float32))
        register_buffer("betas", betas)
        register_buffer("alphas_cumprod", alphas_cumprod)
        register_buffer("alphas_cumprod_prev", alphas_cumprod_prev)
        register_buffer("sqrt_alphas_cumprod", torch.sqrt(alphas_cumprod))
        register_buffer("sqrt_one_minus_alphas_cumprod", torch.sqrt(1.0 - alphas_cumprod))
        register_buffer("sqrt_recip_alphas_cumprod", torch.sqrt(1.0 / alphas_cumprod))
        register_buffer("sqrt_recipm1_alphas_cumprod", torch.sqrt(1.0 / alphas_cumprod - 1))
        snr = alphas_cumprod / (1 - alphas_cumprod)
        maybe_clipped_snr = snr.clone()
        maybe_clipped_snr.clamp_(max=min_snr_gamma)
        register_buffer("loss_weight", maybe_clipped_snr / snr)

    @property
    def device(self):
        return self.betas.device

    def predict_start_from_noise(self, x_t, t, noise):
        return extract(self.sqrt_recip_alphas_cumprod, t, x_t.shape) * x_t - \
            extract(self.sqrt_recipm1_alphas_cumprod, t, x_t.shape) * noise

    def predict_noise_from_start(self, x_t, t, x0):
        return (extract(self.sqrt_recip_alphas_cumprod, t, x_t.shape) * x_t - x0) / \
            extract(self.sqrt_recipm1_alphas_cumprod, t, x_t.shape)

    def model_predictions(self, x, t, x_self_cond=None, clip_x_start=False):
        pred_noise = self.model(x, t, x_self_cond)
        x_start = self.predict_start_from_noise(x, t, pred_noise)
        if clip_x_start:
            x_start = torch.clamp(x_start, min=-1.0, max=1.0)
            pred_noise = self.predict_noise_from_start(x, t, x_start)
        return pred_noise, x_start

    @torch.inference_mode()
    def ddim_sample(self, shape, img, eta=0.5):
        batch = shape[0]
        times = torch.linspace(-1, self.num_timesteps - 1, steps=self.sampling_timesteps + 1)
        times = list(reversed(times.int().tolist()))
        time_pairs = list(zip(times[:-1], times[1:]))
        x_start = None
        for time, time_next in time_pairs:
            time_cond = torch.full((batch,), time, device=self.device, dtype=torch.long)
            pred_noise, x_start = self.model_predictions(img, time_cond, x_start, clip_x_start=True)
            if time_next < 0:
                img = x_start
                continue
            alpha, alpha_next = self.alphas_cumprod[time], self.alphas_cumprod[time_next]
            sigma = eta * ((1 - alpha / alpha_next) * (1 - alpha_next) / (1 - alpha)).sqrt()
            c = (1 - alpha_next - sigma ** 2).sqrt()
            noise = torch.randn_like(img)
            img = x_start * alpha_next.sqrt() + c * pred_noise + sigma * noise
        return (img + 1) * 0.5

    def p_losses(self, x_start, t, noise):
        b, c, h, w = x_start.shape
        offset_noise = torch.randn(x_start.shape[:2], device=self.device)
        noise = noise + self.offset_noise_strength * rearrange(offset_noise, "b c -> b c 1 1")
        x = extract(self.sqrt_alphas_cumprod, t, x_start.shape) * x_start + \
            extract(self.sqrt_one_minus_alphas_cumprod, t, x_start.shape) * noise
        x_self_cond = None
        if self.model.self_condition and random.random() < 0.5:
            with torch.no_grad():
                x_self_cond = self.model_predictions(x, t)[1].detach_()
        model_out = self.model(x, t, x_self_cond)
        loss = F.mse_loss(model_out, noise, reduction="none")
        loss = reduce(loss, "b ... -> b", "mean")
        return (loss * extract(self.loss_weight, t, loss.shape)).mean()

    def forward(self, img):
        b = img.shape[0]
        t = torch.randint(0, self.num_timesteps, (b,), device=img.device).long()
        with torch.autocast(device_type="cuda" if img.is_cuda else "cpu", enabled=False):
            return self.p_losses(img * 2 - 1, t, torch.randn_like(img))


torch.manual_seed(1)
random.seed(0)
diffusion = GaussianDiffusion(Unet()).to(device)
opt = torch.optim.Adam(diffusion.parameters(), lr=1e-3, betas=(0.9, 0.99))
images = torch.rand(4, 1, 8, 8).to(device)
torch.cuda.manual_seed(2) if device == "cuda" else torch.manual_seed(2)
losses = []
for step in range(4):
    loss = diffusion(images)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(diffusion.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
img = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(3)).to(device)
torch.cuda.manual_seed(4) if device == "cuda" else torch.manual_seed(4)
sample = diffusion.ddim_sample((2, 1, 8, 8), img)
print(json.dumps({"losses": losses, "sample": sample.sum().item(), "sample_max": sample.max().item(),
                  "device": str(sample.device)}))
