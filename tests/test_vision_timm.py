"""Vision training code as timm writes it, in plain torch (timm is not installed): ConvNeXt,
EfficientNet and ViT blocks with DropPath and LayerScale, channels_last, autocast with a GradScaler,
a ModelEmaV2-style EMA on torch._foreach ops, Mixup/CutMix and RandomErasing built from torch ops on
the device, and the image functional ops they lean on. Each runs on the local CPU and through the
gateway and must give the same values."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from local_parity import assert_matches_local, registry
from local_parity import data as D
from torch import nn

pytestmark = pytest.mark.usefixtures("remote")
CASES, case = registry()


def drop_path(x: torch.Tensor, drop_prob: float, training: bool) -> torch.Tensor:
    if drop_prob == 0.0 or not training:
        return x
    keep = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep)
    if keep > 0.0:
        random_tensor.div_(keep)
    return x * random_tensor


class DropPath(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return drop_path(x, self.p, self.training)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float = 1e-1):
        super().__init__()
        self.gamma = nn.Parameter(init * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, dp: float):
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.gamma = nn.Parameter(1e-1 * torch.ones(dim))
        self.drop_path = DropPath(dp)

    def forward(self, x):
        shortcut = x
        x = self.conv_dw(x).permute(0, 2, 3, 1)
        x = self.mlp(self.norm(x))
        x = x.mul(self.gamma.reshape(1, 1, 1, -1)).permute(0, 3, 1, 2)
        return self.drop_path(x) + shortcut


def _convnext() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 4, stride=4), LayerNorm2d(8), ConvNeXtBlock(8, 0.3), ConvNeXtBlock(8, 0.3),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(8), nn.Linear(8, 5))


@case
def convnext_channels_last_droppath_train(dev):
    torch.manual_seed(1)
    model = _convnext().to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    out = []
    for step in range(2):
        torch.manual_seed(100 + step)
        x = D(4, 3, 16, 16, seed=step).to(dev).contiguous(memory_format=torch.channels_last)
        y = torch.tensor([0, 1, 2, 3]).to(dev)
        loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.detach())
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    return torch.stack(out), model[-1].weight


class SqueezeExcite(nn.Module):
    def __init__(self, c: int, r: int):
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(c, r, 1), nn.Conv2d(r, c, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * self.expand(F.silu(self.reduce(s))).sigmoid()


class MBConv(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.pw = nn.Sequential(nn.Conv2d(c, 4 * c, 1, bias=False), nn.BatchNorm2d(4 * c), nn.SiLU(inplace=True))
        self.dw = nn.Sequential(nn.Conv2d(4 * c, 4 * c, 3, padding=1, groups=4 * c, bias=False),
                                nn.BatchNorm2d(4 * c), nn.SiLU(inplace=True))
        self.se = SqueezeExcite(4 * c, 2)
        self.pwl = nn.Sequential(nn.Conv2d(4 * c, c, 1, bias=False), nn.BatchNorm2d(c))
        self.drop_path = DropPath(0.2)

    def forward(self, x):
        return self.drop_path(self.pwl(self.se(self.dw(self.pw(x))))) + x


@case
def efficientnet_amp_bf16_gradscaler_ema(dev):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.SiLU(), MBConv(8),
                          MBConv(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 4)).to(dev)
    ema = [p.detach().clone() for p in model.state_dict().values()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    scaler = torch.amp.GradScaler(dev, enabled=True)
    torch.manual_seed(3)
    losses = []
    for step in range(2):
        x = D(4, 3, 16, 16, seed=step).to(dev)
        y = torch.tensor([0, 1, 2, 3], device=dev)
        with torch.autocast(device_type=dev, dtype=torch.bfloat16):
            loss = nn.CrossEntropyLoss(label_smoothing=0.1)(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.detach().float())
        with torch.no_grad():
            cur = list(model.state_dict().values())
            ef = [e for e, c in zip(ema, cur) if e.is_floating_point()]
            cf = [c for c in cur if c.is_floating_point()]
            torch._foreach_lerp_(ef, cf, weight=1.0 - 0.9)
            torch._foreach_mul_(ef, 1.0)
    model.eval()
    with torch.no_grad():
        ev = model(D(2, 3, 16, 16, seed=9).to(dev))
    return torch.stack(losses), ev, ema[0], ema[2], scaler.get_scale()


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.q_norm = nn.LayerNorm(dim // heads)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = self.q_norm(q)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class ViTBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.attn, self.ls1 = nn.LayerNorm(dim), Attention(dim, 2), LayerScale(dim)
        self.norm2, self.ls2 = nn.LayerNorm(dim), LayerScale(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim))
        self.dp = DropPath(0.1)

    def forward(self, x):
        x = x + self.dp(self.ls1(self.attn(self.norm1(x))))
        return x + self.dp(self.ls2(self.mlp(self.norm2(x))))


class TinyViT(nn.Module):
    def __init__(self, dim: int = 16, img: int = 16, patch: int = 4):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(ViTBlock(dim), ViTBlock(dim))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 3)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def resample_abs_pos_embed(pos: torch.Tensor, new: int, old: int) -> torch.Tensor:
    cls, grid = pos[:, :1], pos[:, 1:]
    grid = grid.reshape(1, old, old, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(new, new), mode="bicubic", antialias=True, align_corners=False)
    return torch.cat([cls, grid.permute(0, 2, 3, 1).reshape(1, new * new, -1)], dim=1)


@case
def vit_mixup_cutmix_soft_target(dev):
    torch.manual_seed(0)
    model = TinyViT().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = D(4, 3, 16, 16, seed=1).to(dev)
    target = torch.tensor([0, 1, 2, 1], device=dev)
    torch.manual_seed(7)
    lam = torch.distributions.Beta(torch.tensor([0.8], device=dev), torch.tensor([0.8], device=dev)).sample().item()
    lam = round(lam, 4)
    off = F.one_hot(target, 3).float() * (1 - 0.1) + 0.1 / 3
    soft = off * lam + off.flip(0) * (1 - lam)
    mixed = x.mul(lam).add_(x.flip(0).mul_(1 - lam))
    H = W = 16
    cut = math.sqrt(1 - lam)
    ch, cw = int(H * cut), int(W * cut)
    cy, cx = torch.randint(0, H, (2,), generator=torch.Generator().manual_seed(3)).tolist()
    y1, y2, x1, x2 = max(cy - ch // 2, 0), min(cy + ch // 2, H), max(cx - cw // 2, 0), min(cx + cw // 2, W)
    perm = torch.randperm(4, generator=torch.Generator().manual_seed(4)).to(dev)
    cutmixed = x.clone()
    cutmixed[:, :, y1:y2, x1:x2] = x[perm][:, :, y1:y2, x1:x2]
    lam_c = 1 - (y2 - y1) * (x2 - x1) / (H * W)
    losses = []
    for inp, tgt in ((mixed, soft), (cutmixed, off * lam_c + off[perm] * (1 - lam_c))):
        loss = torch.sum(-tgt * F.log_softmax(model(inp), dim=-1), dim=-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    new_pos = resample_abs_pos_embed(model.pos_embed.detach(), 6, 4)
    return torch.stack(losses), new_pos, torch.tensor(lam)


@case
def random_erasing_on_device(dev):
    torch.manual_seed(5)
    img = D(2, 3, 12, 12, seed=2).to(dev)
    g = torch.Generator().manual_seed(0)
    out = img.clone()
    for i in range(out.shape[0]):
        area = 144 * float(torch.empty(1).uniform_(0.02, 1 / 3, generator=g))
        aspect = math.exp(float(torch.empty(1).uniform_(math.log(0.3), math.log(3.3), generator=g)))
        h, w = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        h, w = min(h, 11), min(w, 11)
        top = int(torch.randint(0, 12 - h, (1,), generator=g))
        left = int(torch.randint(0, 12 - w, (1,), generator=g))
        out[i, :, top:top + h, left:left + w] = torch.empty((3, h, w), dtype=img.dtype,
                                                            device=dev).normal_(generator=None)
    return out


@case
def image_functional_ops(dev):
    x = D(2, 4, 9, 9, seed=0).to(dev)
    res = [F.interpolate(x, size=(5, 7), mode="bilinear", antialias=True),
           F.interpolate(x, size=(13, 4), mode="bicubic", antialias=True, align_corners=False),
           F.interpolate(x, scale_factor=1.7, mode="nearest-exact"),
           F.interpolate(x, size=(4, 4), mode="area")]
    theta = torch.tensor([[[0.9, 0.1, 0.05], [-0.1, 0.8, 0.0]]]).repeat(2, 1, 1).to(dev)
    grid = F.affine_grid(theta, [2, 4, 7, 7], align_corners=False)
    res.append(F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False))
    res.append(F.grid_sample(x, grid, mode="bicubic", padding_mode="border", align_corners=True))
    cols = F.unfold(x, kernel_size=3, stride=2, padding=1)
    res += [cols, F.fold(cols, (9, 9), kernel_size=3, stride=2, padding=1)]
    res += [F.pixel_shuffle(x[:, :4], 2), F.pixel_unshuffle(F.pad(x, (0, 1, 0, 1)), 2)]
    res += [F.pad(x, (2, 1, 1, 2), mode=m) for m in ("reflect", "replicate", "circular")]
    res += [F.pad(x, (1, 1, 1, 1), value=-1.0), F.adaptive_avg_pool2d(x, (4, 3)), F.adaptive_max_pool2d(x, 2)]
    x5 = x.unsqueeze(2).expand(-1, -1, 3, -1, -1)
    res.append(F.pad(x5, (1, 1, 1, 1, 1, 1), mode="replicate"))
    xc = x.contiguous(memory_format=torch.channels_last)
    res.append(F.interpolate(xc, scale_factor=2, mode="bilinear", align_corners=False))
    res.append(F.avg_pool2d(xc, 3, 2, 1, count_include_pad=False))
    return res


@case
def norms_eval_and_channels_last_stride(dev):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1),
                      nn.BatchNorm2d(8), nn.ReLU()).to(dev)
    x = D(2, 4, 8, 8, seed=1).to(dev)
    m.train()
    m(x)
    m.eval()
    with torch.inference_mode():
        a = m(x)
    m = m.to(memory_format=torch.channels_last)
    b = m(x.to(memory_format=torch.channels_last))
    return (a, b, m[4].running_mean, m[4].num_batches_tracked, torch.tensor(b.stride()),
            torch.tensor(list(m[3].weight.stride())))


@pytest.mark.parametrize("name", sorted(CASES))
def test_program_matches_local(name):
    assert_matches_local(CASES[name])
