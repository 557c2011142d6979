"""Llama-family training and decoding as llama2.c, Meta's llama and gpt-fast write them: RMSNorm,
RoPE (real cos/sin tables, and complex via torch.polar/view_as_complex), grouped-query attention
(expand+reshape, and repeat_interleave), SwiGLU, tied embeddings, AdamW with fused=True on 'cuda',
a cosine schedule with warmup, gradient accumulation; then a static KV cache written with
index_put (cache[:, :, pos] = k) and index_copy_, a boolean causal mask sliced by position,
and top-k sampling by exponential race (gpt-fast's multinomial_sample_one_no_sync)."""
import inspect
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
device_type = "cuda" if "cuda" in device else "cpu"
torch.manual_seed(0)
DIM, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ = 32, 2, 4, 2, 64, 16


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def cos_sin(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    f = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.cos(f), torch.sin(f)


def polar_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    f = torch.outer(torch.arange(end), freqs)
    return torch.polar(torch.ones_like(f), f)


def rope_real(x, cos, sin):
    xr, xi = x.float().reshape(x.shape[:-1] + (-1, 2)).unbind(-1)
    shape = [d if i == 1 or i == xr.ndim - 1 else 1 for i, d in enumerate(xr.shape)]
    cos, sin = cos.view(shape), sin.view(shape)
    out = torch.stack([xr * cos - xi * sin, xr * sin + xi * cos], dim=-1).flatten(3)
    return out.type_as(x)


def rope_complex(x, cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    cis = cis.view(1, xc.shape[1], 1, xc.shape[-1])
    return torch.view_as_real(xc * cis).flatten(3).type_as(x)


def repeat_kv(x, n):
    b, s, h, d = x.shape
    return x if n == 1 else x[:, :, :, None, :].expand(b, s, h, n, d).reshape(b, s, h * n, d)


class KVCache(nn.Module):
    def __init__(self, b, s, h, d, dtype):
        super().__init__()
        self.register_buffer("k", torch.zeros(b, h, s, d, dtype=dtype))
        self.register_buffer("v", torch.zeros(b, h, s, d, dtype=dtype))

    def update(self, pos, k, v, by_copy):
        if by_copy:
            self.k.index_copy_(2, pos, k)
            self.v.index_copy_(2, pos, v)
        else:
            self.k[:, :, pos] = k
            self.v[:, :, pos] = v
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, rope):
        super().__init__()
        self.hd = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.hd, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.rope = rope
        self.cache = None
        self.by_copy = False

    def forward(self, x, freqs, mask=None, pos=None):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, HEADS, self.hd)
        k = self.wk(x).view(b, s, KV_HEADS, self.hd)
        v = self.wv(x).view(b, s, KV_HEADS, self.hd)
        if self.rope == "real":
            q, k = rope_real(q, *freqs), rope_real(k, *freqs)
        else:
            q, k = rope_complex(q, freqs), rope_complex(k, freqs)
        if self.cache is None:
            k, v = repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            k, v = self.cache.update(pos, k, v, self.by_copy)
            k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
            v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, DIM))


class Block(nn.Module):
    def __init__(self, rope):
        super().__init__()
        self.attention = Attention(rope)
        self.w1 = nn.Linear(DIM, 64, bias=False)
        self.w2 = nn.Linear(64, DIM, bias=False)
        self.w3 = nn.Linear(DIM, 64, bias=False)
        self.n1, self.n2 = RMSNorm(DIM), RMSNorm(DIM)

    def forward(self, x, freqs, mask=None, pos=None):
        h = x + self.attention(self.n1(x), freqs, mask, pos)
        return h + self.w2(F.silu(self.w1(self.n2(h))) * self.w3(self.n2(h)))


class Transformer(nn.Module):
    def __init__(self, rope):
        super().__init__()
        self.rope = rope
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(rope) for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.tok.weight = self.output.weight
        if rope == "real":
            c, s = cos_sin(DIM // HEADS, 2 * SEQ)
            self.register_buffer("fcos", c, persistent=False)
            self.register_buffer("fsin", s, persistent=False)
        else:
            self.freqs_cis = polar_cis(DIM // HEADS, 2 * SEQ)
        self.apply(self._init)
        for n, p in self.named_parameters():
            if n.endswith("w3.weight") or n.endswith("wo.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * LAYERS))

    def _init(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def freqs(self, sl):
        if self.rope == "real":
            return self.fcos[sl], self.fsin[sl]
        self.freqs_cis = self.freqs_cis.to(self.tok.weight.device)
        return self.freqs_cis[sl]

    def forward(self, tokens, targets=None):
        h = self.tok(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs(slice(0, tokens.shape[1])))
        h = self.norm(h)
        if targets is not None:
            logits = self.output(h)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return self.output(h[:, [-1], :])

    def setup_caches(self, b, s, by_copy):
        dtype = self.output.weight.dtype
        for layer in self.layers:
            layer.attention.cache = KVCache(b, s, KV_HEADS, DIM // HEADS, dtype).to(self.output.weight.device)
            layer.attention.by_copy = by_copy
        self.causal = torch.tril(torch.ones(s, s, dtype=torch.bool, device=self.output.weight.device))

    def step(self, idx, pos):
        mask = self.causal[None, None, pos]
        h = self.tok(idx)
        freqs = (self.fcos[pos], self.fsin[pos]) if self.rope == "real" else self.freqs_cis[pos]
        for layer in self.layers:
            h = layer(h, freqs, mask, pos)
        return self.output(self.norm(h))

    def configure_optimizers(self, wd, lr, betas, device_type):
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": wd},
                  {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
        use_fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=lr, betas=betas, **(dict(fused=True) if use_fused else {}))


def get_lr(it, warmup=2, iters=5, lr=3e-3, min_lr=3e-4):
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / (iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def sample(logits, temperature=1.0, top_k=None):
    logits = logits[0, -1] / max(temperature, 1e-5)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = torch.where(logits < v.select(-1, -1), -float("inf"), logits)
    probs = F.softmax(logits, dim=-1)
    q = torch.empty_like(probs).exponential_(1)
    return torch.argmax(probs / q, dim=-1, keepdim=True).to(dtype=torch.int)


data = torch.randint(0, VOCAB, (400,))
result = {}
for rope in ("real", "complex"):
    torch.manual_seed(1)
    model = Transformer(rope).to(device)
    opt = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), device_type)
    torch.manual_seed(2)
    ix = torch.randint(len(data) - SEQ - 1, (5, 4))
    losses = []
    for it in range(5):
        for g in opt.param_groups:
            g["lr"] = get_lr(it)
        for micro in range(2):
            x = torch.stack([data[i:i + SEQ] for i in ix[it, 2 * micro:2 * micro + 2]]).to(device, non_blocking=True)
            y = torch.stack([data[i + 1:i + 1 + SEQ] for i in ix[it, 2 * micro:2 * micro + 2]]).to(device)
            loss = model(x, y) / 2
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item() * 2)
    model.eval()
    with torch.inference_mode():
        # llama2.c's generate: no cache, the whole prefix each step, logits of the last position
        idx = torch.zeros((1, 1), dtype=torch.long, device=device)
        for _ in range(6):
            logits = model(idx)[:, -1, :]
            _, nxt = torch.topk(logits, k=1, dim=-1)
            idx = torch.cat((idx, nxt), dim=1)
        greedy = idx[0].tolist()
        decoded = {}
        for by_copy in (False, True):
            model.setup_caches(1, 24, by_copy)
            prompt = torch.tensor([[3, 5, 7, 9]], device=device)
            pos = torch.arange(0, 4, device=device)
            logits = model.step(prompt, pos)
            torch.manual_seed(3)
            tok = sample(logits, 0.8, 10)
            toks = [tok.item()]
            in_pos = torch.tensor([4], device=device, dtype=torch.long if by_copy else torch.int)
            for _ in range(8):
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                    logits = model.step(tok.view(1, -1), in_pos)
                tok = sample(logits, 0.8, 10)
                in_pos += 1
                toks.append(tok.item())
            decoded["copy" if by_copy else "index_put"] = toks
            for layer in model.layers:
                layer.attention.cache = None
    result[rope] = {"losses": losses, "norm": norm.item(), "greedy": greedy, "decoded": decoded,
                    "wsum": sum(p.double().sum().item() for p in model.parameters()),
                    "device": str(model.output.weight.device)}
print(json.dumps(result))
