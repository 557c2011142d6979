"""A tiny causal transformer LM: SDPA, AdamW with parameter groups, a checkpoint saved and
loaded back, then greedy decoding."""
import json
import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(2)
V, D, H, T = 16, 32, 4, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, L, H, D // H).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, D))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.zeros(1, T, D))
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:, :idx.shape[1]]
        return self.head(self.blocks(x))


def batch(n):  # sequences counting up modulo V from a random start: learnable
    start = torch.randint(0, V, (n, 1))
    seq = (start + torch.arange(T + 1)) % V
    return seq[:, :-1], seq[:, 1:]


model = LM().to(device)
decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                         {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)
data = [batch(32) for _ in range(40)]
losses = []


def train(steps):
    for x, y in steps:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())


train(data[:20])
path = os.path.join(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(), "ckpt.pt")
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
ckpt = torch.load(path, map_location=device)
model = LM().to(device)
model.load_state_dict(ckpt["model"])
opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                         {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                        lr=3e-3)
opt.load_state_dict(ckpt["opt"])
train(data[20:])

model.eval()
idx = torch.tensor([[3]], device=device)
with torch.no_grad():
    for _ in range(T - 1):
        nxt = model(idx)[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
print(json.dumps({"device": str(idx.device), "losses": losses, "decoded": idx[0].tolist(),
                  "opt_state_device": str(next(iter(opt.state.values()))["exp_avg"].device)}))
