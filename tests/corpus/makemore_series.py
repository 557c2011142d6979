"""Karpathy's "Neural Networks: Zero to Hero" makemore lectures as they are written, moved to
'cuda' (tiny sizes, synthetic names, few steps): the bigram counts filled by ``N[ix1, ix2] += 1``
in a Python loop, ``P = (N+1).float(); P /= P.sum(1, keepdims=True)`` and sampling by
``torch.multinomial(..., generator=g)`` from a device ``torch.Generator``; the one-layer net on
``F.one_hot`` with ``W.grad = None`` and ``W.data += -lr * W.grad``; the MLP with its embedding
table ``C[X]``, ``emb.view(-1, ...)`` and a hand-made batch norm whose running stats are updated
under ``torch.no_grad()``, a learning-rate search over ``torch.linspace`` exponents and the
split losses under ``@torch.no_grad()``; "backprop ninja" (every intermediate's ``retain_grad()``,
the manual gradients compared with ``(dt == t.grad).all()`` and ``torch.allclose``,
``logits.max(1, keepdim=True).values``, ``counts_sum**-1``, ``F.one_hot`` of the max's indices,
the fused cross-entropy and batch-norm backward, ``dC`` accumulated row by row); and the
WaveNet with hand-written Linear/BatchNorm1d/Tanh/Embedding/FlattenConsecutive/Sequential
classes and their ``.view``s, trained and sampled."""
import json
import random

import torch
import torch.nn.functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"

# -- names: synthetic, from a seeded Python RNG --
rng = random.Random(42)
syll = ["an", "el", "ma", "ri", "ka", "so", "li", "ja", "de", "no",
        "ya", "th", "ph", "zo", "vi", "qu", "ex", "bu", "gw", "fo"]
words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(300)]
chars = sorted(list(set("".join(words))))
stoi = {s: i + 1 for i, s in enumerate(chars)}
stoi["."] = 0
itos = {i: s for s, i in stoi.items()}
vocab_size = len(itos)
out = {"vocab_size": vocab_size}

# -- part 1: bigram counts and sampling --
N = torch.zeros((vocab_size, vocab_size), dtype=torch.int32, device=device)
for w in words[:60]:
    chs = ["."] + list(w) + ["."]
    for ch1, ch2 in zip(chs, chs[1:]):
        ix1 = stoi[ch1]
        ix2 = stoi[ch2]
        N[ix1, ix2] += 1
P = (N + 1).float()
P /= P.sum(1, keepdims=True)
g = torch.Generator(device=device).manual_seed(2147483647)
samples = []
for i in range(5):
    o = []
    ix = 0
    while True:
        p = P[ix]
        ix = torch.multinomial(p, num_samples=1, replacement=True, generator=g).item()
        o.append(itos[ix])
        if ix == 0 or len(o) > 30:
            break
    samples.append("".join(o))
log_likelihood = 0.0
n = 0
for w in words[:20]:
    chs = ["."] + list(w) + ["."]
    for ch1, ch2 in zip(chs, chs[1:]):
        prob = P[stoi[ch1], stoi[ch2]]
        log_likelihood += torch.log(prob)
        n += 1
out["bigram"] = {"N_sum": N.sum().item(), "N_row0": N[0].tolist(), "samples": samples,
                 "nll": (-log_likelihood / n).item(), "device": str(N.device), "N_dtype": str(N.dtype)}

# -- part 2: the one-layer net on one-hot inputs, gradient descent by hand --
xs, ys = [], []
for w in words[:60]:
    chs = ["."] + list(w) + ["."]
    for ch1, ch2 in zip(chs, chs[1:]):
        xs.append(stoi[ch1])
        ys.append(stoi[ch2])
xs = torch.tensor(xs, device=device)
ys = torch.tensor(ys, device=device)
num = xs.nelement()
g = torch.Generator(device=device).manual_seed(2147483647)
W = torch.randn((vocab_size, vocab_size), generator=g, requires_grad=True, device=device)
losses = []
for k in range(5):
    xenc = F.one_hot(xs, num_classes=vocab_size).float()
    logits = xenc @ W
    counts = logits.exp()
    probs = counts / counts.sum(1, keepdims=True)
    loss = -probs[torch.arange(num, device=device), ys].log().mean() + 0.01 * (W**2).mean()
    losses.append(loss.item())
    W.grad = None
    loss.backward()
    W.data += -50 * W.grad
out["onehot"] = {"losses": losses, "W_sum": W.sum().item()}


# -- part 3: the MLP with a hand-made batch norm --
def build_dataset(words, block_size):
    X, Y = [], []
    for w in words:
        context = [0] * block_size
        for ch in w + ".":
            ix = stoi[ch]
            X.append(context)
            Y.append(ix)
            context = context[1:] + [ix]
    X = torch.tensor(X)
    Y = torch.tensor(Y)
    return X.to(device), Y.to(device)


block_size = 3
random.seed(42)
random.shuffle(words)
n1 = int(0.8 * len(words))
n2 = int(0.9 * len(words))
Xtr, Ytr = build_dataset(words[:n1], block_size)
Xdev, Ydev = build_dataset(words[n1:n2], block_size)
Xte, Yte = build_dataset(words[n2:], block_size)

n_embd, n_hidden = 10, 64
g = torch.Generator(device=device).manual_seed(2147483647)
C = torch.randn((vocab_size, n_embd), generator=g, device=device)
W1 = torch.randn((n_embd * block_size, n_hidden), generator=g, device=device) * (5 / 3) / ((n_embd * block_size) ** 0.5)
b1 = torch.randn(n_hidden, generator=g, device=device) * 0.01
W2 = torch.randn((n_hidden, vocab_size), generator=g, device=device) * 0.01
b2 = torch.randn(vocab_size, generator=g, device=device) * 0
bngain = torch.ones((1, n_hidden), device=device)
bnbias = torch.zeros((1, n_hidden), device=device)
bnmean_running = torch.zeros((1, n_hidden), device=device)
bnstd_running = torch.ones((1, n_hidden), device=device)
parameters = [C, W1, b1, W2, b2, bngain, bnbias]
for p in parameters:
    p.requires_grad = True
out["mlp_params"] = sum(p.nelement() for p in parameters)

lre = torch.linspace(-3, 0, 6, device=device)
lrs = 10**lre
lri, lossi, ud = [], [], []
for i in range(12):
    ix = torch.randint(0, Xtr.shape[0], (32,), generator=g, device=device)
    Xb, Yb = Xtr[ix], Ytr[ix]
    emb = C[Xb]
    embcat = emb.view(emb.shape[0], -1)
    hpreact = embcat @ W1 + b1
    bnmeani = hpreact.mean(0, keepdim=True)
    bnstdi = hpreact.std(0, keepdim=True)
    hpreact = bngain * (hpreact - bnmeani) / bnstdi + bnbias
    with torch.no_grad():
        bnmean_running = 0.999 * bnmean_running + 0.001 * bnmeani
        bnstd_running = 0.999 * bnstd_running + 0.001 * bnstdi
    h = torch.tanh(hpreact)
    logits = h @ W2 + b2
    loss = F.cross_entropy(logits, Yb)
    for p in parameters:
        p.grad = None
    loss.backward()
    lr = lrs[i % len(lrs)] if i < 6 else 0.1
    for p in parameters:
        p.data += -lr * p.grad
    lri.append(lre[i % len(lre)].item())
    lossi.append(loss.log10().item())
    with torch.no_grad():
        ud.append([((lr * p.grad).std() / p.data.std()).log10().item() for p in parameters])


@torch.no_grad()
def split_loss(split):
    x, y = {"train": (Xtr, Ytr), "val": (Xdev, Ydev), "test": (Xte, Yte)}[split]
    emb = C[x]
    embcat = emb.view(emb.shape[0], -1)
    hpreact = embcat @ W1 + b1
    hpreact = bngain * (hpreact - bnmean_running) / bnstd_running + bnbias
    h = torch.tanh(hpreact)
    logits = h @ W2 + b2
    return F.cross_entropy(logits, y).item()


out["mlp"] = {"lossi": lossi, "lri": lri, "ud": ud, "splits": [split_loss(s) for s in ("train", "val", "test")],
              "bnmean_running": bnmean_running.sum().item(), "bnstd_running": bnstd_running.sum().item(),
              "saturated": (h.abs() > 0.99).float().mean().item(),
              "device": str(C.device), "lr_device": str(lrs.device)}

g = torch.Generator(device=device).manual_seed(2147483647 + 10)
samples = []
for _ in range(4):
    o = []
    context = [0] * block_size
    while True:
        emb = C[torch.tensor([context], device=device)]
        hpreact = emb.view(1, -1) @ W1 + b1
        hpreact = bngain * (hpreact - bnmean_running) / bnstd_running + bnbias
        h = torch.tanh(hpreact)
        logits = h @ W2 + b2
        probs = F.softmax(logits, dim=1)
        ix = torch.multinomial(probs, num_samples=1, generator=g).item()
        context = context[1:] + [ix]
        o.append(ix)
        if ix == 0 or len(o) > 20:
            break
    samples.append("".join(itos[i] for i in o))
out["mlp"]["samples"] = samples


# -- part 4: backprop ninja --
def cmp(s, dt, t):
    ex = torch.all(dt == t.grad).item()
    app = torch.allclose(dt, t.grad)
    maxdiff = (dt - t.grad).abs().max().item()
    return {"approx": app, "small": maxdiff < 1e-6, "exact_or_approx": ex or app, "name": s}


g = torch.Generator(device=device).manual_seed(2147483647)
C = torch.randn((vocab_size, n_embd), generator=g, device=device)
W1 = torch.randn((n_embd * block_size, n_hidden), generator=g, device=device) * (5 / 3) / ((n_embd * block_size) ** 0.5)
b1 = torch.randn(n_hidden, generator=g, device=device) * 0.1
W2 = torch.randn((n_hidden, vocab_size), generator=g, device=device) * 0.1
b2 = torch.randn(vocab_size, generator=g, device=device) * 0.1
bngain = torch.randn((1, n_hidden), device=device, generator=g) * 0.1 + 1.0
bnbias = torch.randn((1, n_hidden), device=device, generator=g) * 0.1
parameters = [C, W1, b1, W2, b2, bngain, bnbias]
for p in parameters:
    p.requires_grad = True
batch_size = n = 32
ix = torch.randint(0, Xtr.shape[0], (batch_size,), generator=g, device=device)
Xb, Yb = Xtr[ix], Ytr[ix]

emb = C[Xb]
embcat = emb.view(emb.shape[0], -1)
hprebn = embcat @ W1 + b1
bnmeani = 1 / n * hprebn.sum(0, keepdim=True)
bndiff = hprebn - bnmeani
bndiff2 = bndiff**2
bnvar = 1 / (n - 1) * (bndiff2).sum(0, keepdim=True)
bnvar_inv = (bnvar + 1e-5) ** -0.5
bnraw = bndiff * bnvar_inv
hpreact = bngain * bnraw + bnbias
h = torch.tanh(hpreact)
logits = h @ W2 + b2
logit_maxes = logits.max(1, keepdim=True).values
norm_logits = logits - logit_maxes
counts = norm_logits.exp()
counts_sum = counts.sum(1, keepdims=True)
counts_sum_inv = counts_sum**-1
probs = counts * counts_sum_inv
logprobs = probs.log()
loss = -logprobs[range(n), Yb].mean()
for p in parameters:
    p.grad = None
for t in [logprobs, probs, counts, counts_sum, counts_sum_inv, norm_logits, logit_maxes, logits, h, hpreact, bnraw,
          bnvar_inv, bnvar, bndiff2, bndiff, hprebn, bnmeani, embcat, emb]:
    t.retain_grad()
loss.backward()

dlogprobs = torch.zeros_like(logprobs)
dlogprobs[range(n), Yb] = -1.0 / n
dprobs = (1.0 / probs) * dlogprobs
dcounts_sum_inv = (counts * dprobs).sum(1, keepdim=True)
dcounts = counts_sum_inv * dprobs
dcounts_sum = (-(counts_sum**-2)) * dcounts_sum_inv
dcounts += torch.ones_like(counts) * dcounts_sum
dnorm_logits = counts * dcounts
dlogits = dnorm_logits.clone()
dlogit_maxes = (-dnorm_logits).sum(1, keepdim=True)
dlogits += F.one_hot(logits.max(1).indices, num_classes=logits.shape[1]) * dlogit_maxes
dh = dlogits @ W2.T
dW2 = h.T @ dlogits
db2 = dlogits.sum(0)
dhpreact = (1.0 - h**2) * dh
dbngain = (bnraw * dhpreact).sum(0, keepdim=True)
dbnraw = bngain * dhpreact
dbnbias = dhpreact.sum(0, keepdim=True)
dbndiff = bnvar_inv * dbnraw
dbnvar_inv = (bndiff * dbnraw).sum(0, keepdim=True)
dbnvar = (-0.5 * (bnvar + 1e-5) ** -1.5) * dbnvar_inv
dbndiff2 = (1.0 / (n - 1)) * torch.ones_like(bndiff2) * dbnvar
dbndiff += (2 * bndiff) * dbndiff2
dhprebn = dbndiff.clone()
dbnmeani = (-dbndiff).sum(0)
dhprebn += 1.0 / n * (torch.ones_like(hprebn) * dbnmeani)
dembcat = dhprebn @ W1.T
dW1 = embcat.T @ dhprebn
db1 = dhprebn.sum(0)
demb = dembcat.view(emb.shape)
dC = torch.zeros_like(C)
for k in range(Xb.shape[0]):
    for j in range(Xb.shape[1]):
        ix = Xb[k, j]
        dC[ix] += demb[k, j]
checks = [cmp(*a) for a in [
    ("logprobs", dlogprobs, logprobs), ("probs", dprobs, probs), ("counts_sum_inv", dcounts_sum_inv, counts_sum_inv),
    ("counts_sum", dcounts_sum, counts_sum), ("counts", dcounts, counts), ("norm_logits", dnorm_logits, norm_logits),
    ("logit_maxes", dlogit_maxes, logit_maxes), ("logits", dlogits, logits), ("h", dh, h), ("W2", dW2, W2),
    ("b2", db2, b2), ("hpreact", dhpreact, hpreact), ("bngain", dbngain, bngain), ("bnbias", dbnbias, bnbias),
    ("bnraw", dbnraw, bnraw), ("bnvar_inv", dbnvar_inv, bnvar_inv), ("bnvar", dbnvar, bnvar),
    ("bndiff2", dbndiff2, bndiff2), ("bndiff", dbndiff, bndiff), ("bnmeani", dbnmeani, bnmeani),
    ("hprebn", dhprebn, hprebn), ("embcat", dembcat, embcat), ("W1", dW1, W1), ("b1", db1, b1),
    ("emb", demb, emb), ("C", dC, C)]]

# exercise 2 and 3: the fused cross-entropy and batch-norm backward
loss_fast = F.cross_entropy(logits, Yb)
dlogits2 = F.softmax(logits, 1)
dlogits2[range(n), Yb] -= 1
dlogits2 /= n
hpreact_fast = bngain * (hprebn - hprebn.mean(0, keepdim=True)) / torch.sqrt(
    hprebn.var(0, keepdim=True, unbiased=True) + 1e-5) + bnbias
dhprebn2 = bngain * bnvar_inv / n * (n * dhpreact - dhpreact.sum(0) - n / (n - 1) * bnraw * (dhpreact * bnraw).sum(0))
dC2 = torch.zeros_like(C)
dC2.index_add_(0, Xb.view(-1), demb.view(-1, n_embd))
out["ninja"] = {"loss": loss.item(), "checks": checks,
                "fast_loss_diff": (loss_fast - loss).item() < 1e-6,
                "dlogits_fast": torch.allclose(dlogits2, logits.grad, atol=1e-7),
                "bn_fast_diff": (hpreact_fast - hpreact).abs().max().item() < 1e-5,
                "dhprebn_fast": torch.allclose(dhprebn2, hprebn.grad, atol=1e-6),
                "dC_index_add": torch.allclose(dC2, C.grad),
                "dC": dC.sum().item(), "dW1": dW1.abs().sum().item()}


# -- part 5: the WaveNet, torch.nn-like classes written by hand --
class Linear:
    def __init__(self, fan_in, fan_out, bias=True):
        self.weight = torch.randn((fan_in, fan_out), generator=g, device=device) / fan_in**0.5
        self.bias = torch.zeros(fan_out, device=device) if bias else None

    def __call__(self, x):
        self.out = x @ self.weight
        if self.bias is not None:
            self.out += self.bias
        return self.out

    def parameters(self):
        return [self.weight] + ([] if self.bias is None else [self.bias])


class BatchNorm1d:
    def __init__(self, dim, eps=1e-5, momentum=0.1):
        self.eps = eps
        self.momentum = momentum
        self.training = True
        self.gamma = torch.ones(dim, device=device)
        self.beta = torch.zeros(dim, device=device)
        self.running_mean = torch.zeros(dim, device=device)
        self.running_var = torch.ones(dim, device=device)

    def __call__(self, x):
        if self.training:
            if x.ndim == 2:
                dim = 0
            elif x.ndim == 3:
                dim = (0, 1)
            xmean = x.mean(dim, keepdim=True)
            xvar = x.var(dim, keepdim=True)
        else:
            xmean = self.running_mean
            xvar = self.running_var
        xhat = (x - xmean) / torch.sqrt(xvar + self.eps)
        self.out = self.gamma * xhat + self.beta
        if self.training:
            with torch.no_grad():
                self.running_mean = (1 - self.momentum) * self.running_mean + self.momentum * xmean
                self.running_var = (1 - self.momentum) * self.running_var + self.momentum * xvar
        return self.out

    def parameters(self):
        return [self.gamma, self.beta]


class Tanh:
    def __call__(self, x):
        self.out = torch.tanh(x)
        return self.out

    def parameters(self):
        return []


class Embedding:
    def __init__(self, num_embeddings, embedding_dim):
        self.weight = torch.randn((num_embeddings, embedding_dim), generator=g, device=device)

    def __call__(self, IX):
        self.out = self.weight[IX]
        return self.out

    def parameters(self):
        return [self.weight]


class FlattenConsecutive:
    def __init__(self, n):
        self.n = n

    def __call__(self, x):
        B, T, C = x.shape
        x = x.view(B, T // self.n, C * self.n)
        if x.shape[1] == 1:
            x = x.squeeze(1)
        self.out = x
        return self.out

    def parameters(self):
        return []


class Sequential:
    def __init__(self, layers):
        self.layers = layers

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        self.out = x
        return self.out

    def parameters(self):
        return [p for layer in self.layers for p in layer.parameters()]


block_size = 8
Xtr, Ytr = build_dataset(words[:n1], block_size)
Xdev, Ydev = build_dataset(words[n1:n2], block_size)
g = torch.Generator(device=device).manual_seed(42)
n_embd, n_hidden = 8, 32
model = Sequential([
    Embedding(vocab_size, n_embd),
    FlattenConsecutive(2), Linear(n_embd * 2, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh(),
    FlattenConsecutive(2), Linear(n_hidden * 2, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh(),
    FlattenConsecutive(2), Linear(n_hidden * 2, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh(),
    Linear(n_hidden, vocab_size),
])
with torch.no_grad():
    model.layers[-1].weight *= 0.1
parameters = model.parameters()
for p in parameters:
    p.requires_grad = True
lossi = []
for i in range(10):
    ix = torch.randint(0, Xtr.shape[0], (32,), generator=g, device=device)
    Xb, Yb = Xtr[ix], Ytr[ix]
    logits = model(Xb)
    loss = F.cross_entropy(logits, Yb)
    for p in parameters:
        p.grad = None
    loss.backward()
    lr = 0.1 if i < 7 else 0.01
    for p in parameters:
        p.data += -lr * p.grad
    lossi.append(loss.log10().item())
shapes = [list(layer.out.shape) for layer in model.layers]
for layer in model.layers:
    layer.training = False


@torch.no_grad()
def split_loss(split):
    x, y = {"train": (Xtr, Ytr), "val": (Xdev, Ydev)}[split]
    logits = model(x)
    return F.cross_entropy(logits, y).item()


samples = []
for _ in range(3):
    o = []
    context = [0] * block_size
    while True:
        logits = model(torch.tensor([context], device=device))
        probs = F.softmax(logits, dim=1)
        ix = torch.multinomial(probs, num_samples=1, generator=g).item()
        context = context[1:] + [ix]
        o.append(ix)
        if ix == 0 or len(o) > 20:
            break
    samples.append("".join(itos[i] for i in o))
out["wavenet"] = {"lossi": lossi, "shapes": shapes, "splits": [split_loss("train"), split_loss("val")],
                  "lossi_view_mean": torch.tensor(lossi).view(-1, 5).mean(1).tolist(),
                  "running_var": model.layers[3].running_var.sum().item(), "samples": samples,
                  "params": sum(p.nelement() for p in parameters), "device": str(model.layers[0].weight.device)}
print(json.dumps(out))
