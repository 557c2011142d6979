"""lucidrains-style transformer code written without its libraries, and micrograd's torch checks,
moved to 'cuda': attention by ``torch.einsum('b h i d, b h j d -> b h i j')`` (spaced and
unspaced equations, ellipses), ``rearrange`` done by ``view``/``permute``/``reshape``, rotary
embeddings by hand (``einsum('i , j -> i j')`` frequencies in a non-persistent buffer,
``rotate_half`` by ``unflatten``/``unbind``/``stack``, xpos scaling), a causal mask by
``torch.ones(i, j, dtype=torch.bool).triu(j - i + 1)`` with ``-torch.finfo(sim.dtype).max``,
a padding mask broadcast by ``mask[:, None, None, :]``, null key/values concatenated per batch
by ``expand``, qk RMS-norm by ``F.normalize``, talking heads by einsum, ALiBi slopes, a T5
relative position bias by buckets (``torch.where``, ``log``, ``.long()``, ``torch.full_like``),
token shift by ``F.pad`` with a negative pad, SwiGLU by ``chunk``, a stable softmax by
``amax(...).detach()``, a memory-efficient attention over key chunks (``torch.utils.checkpoint``
with ``use_reentrant=False``) and a model trained with AdamW, ``clip_grad_norm_`` and a
LambdaLR warmup; then micrograd's README and test_engine checks against torch (double
``torch.Tensor([...])`` scalars with ``requires_grad = True``) and its MLP written in torch."""
import json
import math

import torch
import torch.nn.functional as F
from torch import einsum, nn
from torch.utils.checkpoint import checkpoint

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
out = {}


def exists(v):
    return v is not None


def default(v, d):
    return v if exists(v) else d


def split_heads(t, h):  # rearrange(t, 'b n (h d) -> b h n d', h=h)
    b, n, _ = t.shape
    return t.view(b, n, h, -1).permute(0, 2, 1, 3)


def merge_heads(t):  # rearrange(t, 'b h n d -> b n (h d)')
    b, h, n, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, n, h * d)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, theta=10000, use_xpos=True, scale_base=64):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.use_xpos = use_xpos
        self.scale_base = scale_base
        scale = (torch.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim)
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, seq_len, device):
        t = torch.arange(seq_len, device=device).type_as(self.inv_freq)
        freqs = torch.einsum("i , j -> i j", t, self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        if not self.use_xpos:
            return freqs, torch.ones(1, device=device)
        power = (t - (seq_len // 2)) / self.scale_base
        scale = self.scale ** power[:, None]
        scale = torch.cat((scale, scale), dim=-1)
        return freqs, scale


def rotate_half(x):
    x = x.unflatten(-1, (2, -1))
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):  # the interleaved variant: rearrange(x, '... (d r) -> ... d r', r=2)
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(pos, t, scale=1.0):
    return (t * pos.cos() * scale) + (rotate_half(t) * pos.sin() * scale)


def alibi_slopes(heads):
    def get_slopes_power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio**i for i in range(n)]
    if math.log2(heads).is_integer():
        return get_slopes_power_of_2(heads)
    closest_power_of_2 = 2 ** math.floor(math.log2(heads))
    return (get_slopes_power_of_2(closest_power_of_2)
            + get_slopes_power_of_2(2 * closest_power_of_2)[0::2][:heads - closest_power_of_2])


class RelativePositionBias(nn.Module):
    def __init__(self, scale, causal=False, num_buckets=8, max_distance=32, heads=2):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)

    @staticmethod
    def _relative_position_bucket(relative_position, causal=True, num_buckets=32, max_distance=128):
        ret = 0
        n = -relative_position
        if not causal:
            num_buckets //= 2
            ret += (n < 0).long() * num_buckets
            n = torch.abs(n)
        else:
            n = torch.max(n, torch.zeros_like(n))
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = max_exact + (
            torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).long()
        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
        ret += torch.where(is_small, n, val_if_large)
        return ret

    def forward(self, i, j):
        device = self.relative_attention_bias.weight.device
        q_pos = torch.arange(j - i, j, dtype=torch.long, device=device)
        k_pos = torch.arange(j, dtype=torch.long, device=device)
        rel_pos = k_pos[None, :] - q_pos[:, None]
        rp_bucket = self._relative_position_bucket(rel_pos, causal=self.causal, num_buckets=self.num_buckets,
                                                   max_distance=self.max_distance)
        values = self.relative_attention_bias(rp_bucket)
        bias = values.permute(2, 0, 1)  # rearrange(values, 'i j h -> h i j')
        return bias * self.scale


class Attention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=8, causal=True, num_null_kv=1, qk_norm=True, talking_heads=True,
                 rel_pos="rotary"):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.scale = dim_head**-0.5 if not qk_norm else 8.0
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)
        self.null_kv = nn.Parameter(torch.randn(2, heads, num_null_kv, dim_head))
        self.qk_norm = qk_norm
        self.q_scale = nn.Parameter(torch.ones(dim_head))
        self.k_scale = nn.Parameter(torch.ones(dim_head))
        self.talking_heads = nn.Parameter(torch.eye(heads) + 0.01 * torch.randn(heads, heads)) \
            if talking_heads else None
        self.rel_pos = rel_pos
        self.rotary = RotaryEmbedding(dim_head)
        self.rel_pos_bias = RelativePositionBias(scale=dim_head**0.5, causal=causal, heads=heads)
        self.register_buffer("slopes", torch.tensor(alibi_slopes(heads)).view(heads, 1, 1), persistent=False)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        h = self.heads
        q = self.to_q(x)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = map(lambda t: split_heads(t, h), (q, k, v))
        if self.rel_pos == "rotary":
            freqs, scale = self.rotary(n, x.device)
            q = apply_rotary_pos_emb(freqs, q, scale)
            k = apply_rotary_pos_emb(freqs, k, scale**-1)
        nk, nv = self.null_kv.unsqueeze(1).expand(-1, b, -1, -1, -1).unbind(0)  # repeat 'h n d -> b h n d'
        k = torch.cat((nk, k), dim=-2)
        v = torch.cat((nv, v), dim=-2)
        if self.qk_norm:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
            q = q * self.q_scale
            k = k * self.k_scale
        sim = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        i, j = sim.shape[-2:]
        if self.rel_pos == "t5":
            sim = sim + F.pad(self.rel_pos_bias(i, j - 1), (1, 0), value=0.0)
        elif self.rel_pos == "alibi":
            k_pos = torch.arange(j, device=x.device)
            q_pos = torch.arange(j - i, j, device=x.device)
            sim = sim - self.slopes * (k_pos[None, :] - q_pos[:, None]).abs()
        mask_value = -torch.finfo(sim.dtype).max
        if exists(mask):
            mask = F.pad(mask, (1, 0), value=True)
            sim = sim.masked_fill(~mask[:, None, None, :], mask_value)
        if self.causal:
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, mask_value)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1, dtype=torch.float32)
        if exists(self.talking_heads):
            attn = einsum("b h i j, h k -> b k i j", attn, self.talking_heads)
        o = einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(merge_heads(o))


def chunked_attention(q, k, v, chunk=4):  # memory-efficient attention: a running log-sum-exp over key chunks
    scale = q.shape[-1] ** -0.5
    q = q * scale
    out = torch.zeros_like(q)
    row_max = torch.full(q.shape[:-1] + (1,), -torch.finfo(q.dtype).max, device=q.device)
    row_sum = torch.zeros(q.shape[:-1] + (1,), device=q.device)

    def chunk_fn(q, k, v):
        s = einsum("... i d, ... j d -> ... i j", q, k)
        m = s.amax(dim=-1, keepdim=True).detach()
        e = (s - m).exp()
        return e.sum(dim=-1, keepdim=True), einsum("... i j, ... j d -> ... i d", e, v), m

    for kc, vc in zip(k.split(chunk, dim=-2), v.split(chunk, dim=-2)):
        s, o, m = checkpoint(chunk_fn, q, kc, vc, use_reentrant=False)
        new_max = torch.maximum(row_max, m)
        a, c = (row_max - new_max).exp(), (m - new_max).exp()
        out = out * a + o * c
        row_sum = row_sum * a + s * c
        row_max = new_max
    return out / row_sum


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class SwiGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


def shift_tokens(t):
    t, t_shift = t.chunk(2, dim=-1)
    t_shift = F.pad(t_shift, (0, 0, 1, -1), value=0.0)
    return torch.cat((t, t_shift), dim=-1)


class Transformer(nn.Module):
    def __init__(self, num_tokens, dim, depth, rel_pos):
        super().__init__()
        self.emb = nn.Embedding(num_tokens, dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                RMSNorm(dim), Attention(dim, rel_pos=rel_pos),
                RMSNorm(dim), nn.Sequential(nn.Linear(dim, dim * 4 * 2), SwiGLU(), nn.Linear(dim * 4, dim)),
            ]))
        self.norm = RMSNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, mask=None):
        x = self.emb(x)
        for n1, attn, n2, ff in self.layers:
            x = attn(shift_tokens(n1(x)), mask=mask) + x
            x = ff(n2(x)) + x
        return self.to_logits(self.norm(x))


results = {}
for rel_pos in ("rotary", "t5", "alibi"):
    torch.manual_seed(0)
    model = Transformer(num_tokens=20, dim=16, depth=2, rel_pos=rel_pos).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 20, (3, 11), generator=g).to(device)
    mask = torch.ones(3, 10, dtype=torch.bool, device=device)
    mask[1, 7:] = False
    losses, norms = [], []
    for step in range(4):
        inp, labels = seq[:, :-1], seq[:, 1:]
        logits = model(inp, mask=mask)
        loss = F.cross_entropy(logits.permute(0, 2, 1), labels.masked_fill(~mask, -100), ignore_index=-100)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        out_tokens = seq[:, :2]
        for _ in range(5):
            logits = model(out_tokens)[:, -1]
            out_tokens = torch.cat((out_tokens, logits.argmax(dim=-1, keepdim=True)), dim=-1)
    results[rel_pos] = {"losses": losses, "norms": norms, "greedy": out_tokens.tolist(), "lr": sched.get_last_lr()}
out["transformer"] = results

q, k, v = (torch.randn(2, 2, 10, 8, generator=torch.Generator().manual_seed(s)).to(device).requires_grad_()
           for s in (3, 4, 5))
ref = F.softmax(einsum("b h i d, b h j d -> b h i j", q, k) * 8**-0.5, dim=-1) @ v
mem = chunked_attention(q, k, v)
mem.sum().backward()
out["chunked_attention"] = {"close": torch.allclose(ref, mem, atol=1e-5), "out": mem.sum().item(),
                            "dq": q.grad.abs().sum().item(), "dv": v.grad.sum().item(), "device": str(mem.device)}
x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(6)).to(device)
freqs, _ = RotaryEmbedding(8, use_xpos=False).to(device)(5, device)
out["rotary"] = {"half": apply_rotary_pos_emb(freqs, x).sum().item(), "two": rotate_every_two(x).sum().item(),
                 "norm_kept": torch.allclose(apply_rotary_pos_emb(freqs, x).norm(dim=-1), x.norm(dim=-1), atol=1e-5)}

# -- micrograd: its README's and test_engine.py's torch side --
x = torch.Tensor([-4.0]).double().to(device)
x.requires_grad = True
z = 2 * x + 2 + x
q = z.relu() + z * x
h = (z * z).relu()
y = h + q + q * x
y.backward()
xpt, ypt = x, y
a = torch.Tensor([-4.0]).double().to(device)
b = torch.Tensor([2.0]).double().to(device)
a.requires_grad = True
b.requires_grad = True
c = a + b
d = a * b + b**3
c = c + c + 1
c = c + 1 + c + (-a)
d = d + d * 2 + (b + a).relu()
d = d + 3 * d + (b - a).relu()
e = c - d
f = e**2
g = f / 2.0
g = g + 10.0 / f
g.backward()
out["micrograd"] = {"y": ypt.data.item(), "x_grad": xpt.grad.item(), "g": g.data.item(), "a_grad": a.grad.item(),
                    "b_grad": b.grad.item(), "x_device": str(x.device), "dtype": str(g.dtype), "leaf": x.is_leaf}


class Neuron(nn.Module):  # micrograd's MLP, written with torch tensors
    def __init__(self, nin, nonlin=True):
        super().__init__()
        self.w = nn.Parameter(torch.empty(nin).uniform_(-1, 1))
        self.b = nn.Parameter(torch.zeros(()))
        self.nonlin = nonlin

    def forward(self, x):
        act = (self.w * x).sum() + self.b
        return act.relu() if self.nonlin else act


class Layer(nn.Module):
    def __init__(self, nin, nout, **kwargs):
        super().__init__()
        self.neurons = nn.ModuleList([Neuron(nin, **kwargs) for _ in range(nout)])

    def forward(self, x):
        out = [n(x) for n in self.neurons]
        return out[0] if len(out) == 1 else torch.stack(out)


class MLP(nn.Module):
    def __init__(self, nin, nouts):
        super().__init__()
        sz = [nin] + nouts
        self.layers = nn.ModuleList([Layer(sz[i], sz[i + 1], nonlin=i != len(nouts) - 1) for i in range(len(nouts))])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


torch.manual_seed(1337)
model = MLP(2, [8, 8, 1]).to(device)
X = torch.randn(12, 2, generator=torch.Generator().manual_seed(0)).to(device)
yb = (X[:, 0] * X[:, 1] > 0).float() * 2 - 1
hist = []
for k in range(4):
    scores = torch.stack([model(xi) for xi in X])
    losses = (1 + -yb * scores).relu()
    data_loss = losses.sum() * (1.0 / len(losses))
    reg_loss = 1e-4 * sum((p * p).sum() for p in model.parameters())
    total_loss = data_loss + reg_loss
    accuracy = [(yi > 0) == (scorei > 0) for yi, scorei in zip(yb.tolist(), scores.tolist())]
    model.zero_grad()
    total_loss.backward()
    learning_rate = 1.0 - 0.9 * k / 100
    for p in model.parameters():
        p.data -= learning_rate * p.grad
    hist.append([total_loss.item(), sum(accuracy) / len(accuracy)])
out["micrograd_mlp"] = {"hist": hist, "n_params": sum(p.numel() for p in model.parameters())}
print(json.dumps(out))
