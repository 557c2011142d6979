"""A training loop in today's idioms, on a device: a small conv-attention classifier in
channels_last, bfloat16 autocast with a GradScaler, activation checkpointing with
``use_reentrant=False``, attention under ``sdpa_kernel``, ``zero_grad(set_to_none=True)``, a
fused AdamW and a warm-up schedule, an EMA by ``AveragedModel(get_ema_multi_avg_fn)``, an SWA
model whose batch norms are recomputed by ``update_bn``, evaluated under ``inference_mode``."""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn
from torch.utils.checkpoint import checkpoint

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
gen = torch.Generator().manual_seed(11)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(B, N, C))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.GELU())
        self.down = nn.Sequential(nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.GELU())
        self.norm = nn.LayerNorm(16)
        self.attn = Attention(16, 2)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.stem(x)
        x = checkpoint(self.down, x, use_reentrant=False)
        tokens = x.flatten(2).transpose(1, 2)
        tokens = tokens + checkpoint(lambda t: self.attn(self.norm(t)), tokens, use_reentrant=False)
        return self.head(tokens.mean(1))


model = Net().to(device, memory_format=torch.channels_last)
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
swa = AveragedModel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.05,
                              fused=device.type == "cuda")
warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
swa_sched = SWALR(optimizer, swa_lr=1e-4, anneal_epochs=1)
scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")

batches = [(torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(4)]
log = {"loss": [], "lr": [], "scale": []}
for epoch in range(2):
    model.train()
    for images, labels in batches:
        images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        labels = labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            logits = model(images)
            loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        ema.update_parameters(model)
        log["loss"].append(loss.item())
        log["scale"].append(scaler.get_scale() if scaler.is_enabled() else 65536.0)
        if epoch == 0:
            warmup.step()
    if epoch == 1:
        swa.update_parameters(model)
        swa_sched.step()
    log["lr"].append(optimizer.param_groups[0]["lr"])
update_bn(((x.to(device), y) for x, y in batches), swa, device=device)
evals = {}
for name, net in (("model", model), ("ema", ema), ("swa", swa)):
    net.eval()
    with torch.inference_mode():
        out = net(batches[0][0].to(device).contiguous(memory_format=torch.channels_last))
    evals[name] = out.float().cpu().tolist()
log["evals"] = evals
log["swa_running_var"] = swa.module.stem[1].running_var.cpu().tolist()
log["grad_norm"] = grad_norm.item()
log["channels_last"] = model.stem[0].weight.is_contiguous(memory_format=torch.channels_last)
log["device"] = str(next(model.parameters()).device)
print(json.dumps(log))
