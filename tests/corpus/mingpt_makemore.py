"""Karpathy's minGPT and makemore.py as they are written, tiny and on synthetic names: minGPT's
GPT (NewGELU by hand, a ``torch.tril`` ``bias`` buffer and ``masked_fill``, ``_init_weights``
by ``self.apply`` and the scaled ``c_proj`` init by ``named_parameters``), its
``configure_optimizers`` (decay/no_decay sets by module type and parameter name, checked for
overlap, AdamW over both groups), its Trainer's ``RandomSampler(replacement=True,
num_samples=int(1e10))`` DataLoader and ``clip_grad_norm_``, and its ``generate`` (``logits[:,
-1, :] / temperature``, ``torch.topk`` and ``logits[logits < v[:, [-1]]] = -float('Inf')``,
sampled by ``torch.multinomial`` or greedy by ``torch.topk(probs, k=1)``); makemore.py's RNN
and GRU cells (``torch.cat([xt, hprev], dim=1)``, ``hprev.expand``), its Bag-of-Words block
(``att.masked_fill(self.bias[:,:t,:t] == 0, float('-inf'))``), its InfiniteDataLoader, its
``evaluate`` under ``@torch.inference_mode()`` with ``model.eval()/train()``, and its
print_samples (``X_samp[i, 1:].tolist()``, ``row.index(0)``); and the "let's build GPT"
notebook's self-attention by ``xbow`` (the triple ``tril`` trick), its ``get_batch`` and
``@torch.no_grad() estimate_loss``."""
import json
import math
import random

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import DataLoader as DL

device = "cuda" if torch.cuda.is_available() else "cpu"
out = {}


# ---------------- minGPT model.py ----------------
class NewGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.ModuleDict(dict(
            c_fc=nn.Linear(config.n_embd, 4 * config.n_embd),
            c_proj=nn.Linear(4 * config.n_embd, config.n_embd),
            act=NewGELU(),
            dropout=nn.Dropout(config.resid_pdrop),
        ))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlpf(self.ln_2(x))
        return x


class CfgNode:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

    def merge_from_dict(self, d):
        self.__dict__.update(d)


class GPT(nn.Module):
    @staticmethod
    def get_default_config():
        return CfgNode(model_type='gpt', n_layer=None, n_head=None, n_embd=None, vocab_size=None, block_size=None,
                       embd_pdrop=0.1, resid_pdrop=0.1, attn_pdrop=0.1)

    def __init__(self, config):
        super().__init__()
        self.block_size = config.block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.embd_pdrop),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self.n_params = sum(p.numel() for p in self.transformer.parameters())

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            torch.nn.init.zeros_(module.bias)
            torch.nn.init.ones_(module.weight)

    def configure_optimizers(self, train_config):
        decay = set()
        no_decay = set()
        whitelist_weight_modules = (torch.nn.Linear, )
        blacklist_weight_modules = (torch.nn.LayerNorm, torch.nn.Embedding)
        for mn, m in self.named_modules():
            for pn, p in m.named_parameters():
                fpn = '%s.%s' % (mn, pn) if mn else pn  # noqa: UP031 (minGPT's own line)
                if pn.endswith('bias'):
                    no_decay.add(fpn)
                elif pn.endswith('weight') and isinstance(m, whitelist_weight_modules):
                    decay.add(fpn)
                elif pn.endswith('weight') and isinstance(m, blacklist_weight_modules):
                    no_decay.add(fpn)
        param_dict = {pn: p for pn, p in self.named_parameters()}
        inter_params = decay & no_decay
        union_params = decay | no_decay
        assert len(inter_params) == 0
        assert len(param_dict.keys() - union_params) == 0
        optim_groups = [
            {"params": [param_dict[pn] for pn in sorted(list(decay))], "weight_decay": train_config.weight_decay},
            {"params": [param_dict[pn] for pn in sorted(list(no_decay))], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(optim_groups, lr=train_config.learning_rate, betas=train_config.betas)
        return optimizer

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device).unsqueeze(0)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, do_sample=False, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.block_size else idx[:, -self.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, top_k)
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            if do_sample:
                idx_next = torch.multinomial(probs, num_samples=1)
            else:
                _, idx_next = torch.topk(probs, k=1, dim=-1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


# ---------------- minGPT trainer.py ----------------
class Trainer:
    @staticmethod
    def get_default_config():
        return CfgNode(device='auto', num_workers=0, max_iters=None, batch_size=8, learning_rate=3e-4,
                       betas=(0.9, 0.95), weight_decay=0.1, grad_norm_clip=1.0)

    def __init__(self, config, model, train_dataset):
        self.config = config
        self.model = model
        self.train_dataset = train_dataset
        self.callbacks = []
        if config.device == 'auto':
            self.device = 'cuda' if torch.cuda.is_available() else 'cpu'
        else:
            self.device = config.device
        self.model = self.model.to(self.device)
        self.iter_num = 0

    def add_callback(self, fn):
        self.callbacks.append(fn)

    def run(self):
        model, config = self.model, self.config
        self.optimizer = model.configure_optimizers(config)
        train_loader = DataLoader(
            self.train_dataset,
            sampler=torch.utils.data.RandomSampler(self.train_dataset, replacement=True, num_samples=int(1e10)),
            shuffle=False, pin_memory=True, batch_size=config.batch_size, num_workers=config.num_workers,
        )
        model.train()
        data_iter = iter(train_loader)
        while True:
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(train_loader)
                batch = next(data_iter)
            batch = [t.to(self.device) for t in batch]
            x, y = batch
            logits, self.loss = model(x, y)
            model.zero_grad(set_to_none=True)
            self.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_norm_clip)
            self.optimizer.step()
            for cb in self.callbacks:
                cb(self)
            self.iter_num += 1
            if config.max_iters is not None and self.iter_num >= config.max_iters:
                break


# the minGPT "sort" demo: learn to sort digits
class SortDataset(Dataset):
    def __init__(self, split, length=6, num_digits=3):
        self.split, self.length, self.num_digits = split, length, num_digits

    def __len__(self):
        return 10000

    def get_vocab_size(self):
        return self.num_digits

    def get_block_size(self):
        return self.length * 2 - 1

    def __getitem__(self, idx):
        while True:
            inp = torch.randint(self.num_digits, size=(self.length,), dtype=torch.long)
            if torch.rand(1).item() < 0.5:  # noqa: SIM102 (minGPT's own lines)
                if inp.unique().nelement() > self.length // 2:
                    continue
            h = hash(pickle_free_key(inp.tolist()))
            inp_split = 'test' if h % 4 == 0 else 'train'
            if inp_split == self.split:
                break
        sol = torch.sort(inp)[0]
        cat = torch.cat((inp, sol), dim=0)
        x = cat[:-1].clone()
        y = cat[1:].clone()
        y[:self.length - 1] = -1
        return x, y


def pickle_free_key(lst):
    return sum(v * 7**i for i, v in enumerate(lst))


torch.manual_seed(3407)
train_dataset = SortDataset('train')
model_config = GPT.get_default_config()
model_config.merge_from_dict(dict(n_layer=2, n_head=2, n_embd=24, vocab_size=train_dataset.get_vocab_size(),
                                  block_size=train_dataset.get_block_size(),
                                  embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0))  # (dropout: the device's generator)
model = GPT(model_config)
train_config = Trainer.get_default_config()
train_config.learning_rate = 5e-4
train_config.max_iters = 6
trainer = Trainer(train_config, model, train_dataset)
losses = []
trainer.add_callback(lambda tr: losses.append(tr.loss.item()))
trainer.run()
groups = trainer.optimizer.param_groups
model.eval()
torch.manual_seed(0)
inp = torch.tensor([[0, 0, 2, 1, 0, 1]], dtype=torch.long).to(trainer.device)
with torch.no_grad():
    cat = model.generate(inp, 6, do_sample=False)
    cat_topk = model.generate(inp.repeat(3, 1), 6, do_sample=True, top_k=2, temperature=0.8)
out["mingpt"] = {"losses": losses, "n_params": model.n_params, "greedy": cat.tolist(), "sampled": cat_topk.tolist(),
                 "group_sizes": [len(g["params"]) for g in groups], "wd": [g["weight_decay"] for g in groups],
                 "adam_step": trainer.optimizer.state[groups[0]["params"][0]]["step"].item(),
                 "exp_avg_sq": sum(trainer.optimizer.state[p]["exp_avg_sq"].sum().item() for p in groups[1]["params"]),
                 "bias_buffer": model.transformer.h[0].attn.bias.sum().item(),
                 "device": str(next(model.parameters()).device)}

# ---------------- makemore.py ----------------
rng = random.Random(7)
words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 7))) for _ in range(200)]


class CharDataset(Dataset):
    def __init__(self, words, chars, max_word_length):
        self.words = words
        self.chars = chars
        self.max_word_length = max_word_length
        self.stoi = {ch: i + 1 for i, ch in enumerate(chars)}
        self.itos = {i: s for s, i in self.stoi.items()}

    def __len__(self):
        return len(self.words)

    def get_vocab_size(self):
        return len(self.chars) + 1

    def get_output_length(self):
        return self.max_word_length + 1

    def encode(self, word):
        return torch.tensor([self.stoi[w] for w in word], dtype=torch.long)

    def decode(self, ix):
        return ''.join(self.itos[i] for i in ix)

    def __getitem__(self, idx):
        word = self.words[idx]
        ix = self.encode(word)
        x = torch.zeros(self.max_word_length + 1, dtype=torch.long)
        y = torch.zeros(self.max_word_length + 1, dtype=torch.long)
        x[1:1 + len(ix)] = ix
        y[:len(ix)] = ix
        y[len(ix) + 1:] = -1
        return x, y


class InfiniteDataLoader:
    def __init__(self, dataset, **kwargs):
        train_sampler = torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=int(1e10))
        self.train_loader = DL(dataset, sampler=train_sampler, **kwargs)
        self.data_iter = iter(self.train_loader)

    def next(self):
        try:
            batch = next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.train_loader)
            batch = next(self.data_iter)
        return batch


class RNNCell(nn.Module):
    def __init__(self, n_embd, n_embd2):
        super().__init__()
        self.xh_to_h = nn.Linear(n_embd + n_embd2, n_embd2)

    def forward(self, xt, hprev):
        xh = torch.cat([xt, hprev], dim=1)
        ht = F.tanh(self.xh_to_h(xh))
        return ht


class GRUCell(nn.Module):
    def __init__(self, n_embd, n_embd2):
        super().__init__()
        self.xh_to_z = nn.Linear(n_embd + n_embd2, n_embd2)
        self.xh_to_r = nn.Linear(n_embd + n_embd2, n_embd2)
        self.xh_to_hbar = nn.Linear(n_embd + n_embd2, n_embd2)

    def forward(self, xt, hprev):
        xh = torch.cat([xt, hprev], dim=1)
        r = F.sigmoid(self.xh_to_r(xh))
        hprev_reset = r * hprev
        xhr = torch.cat([xt, hprev_reset], dim=1)
        hbar = F.tanh(self.xh_to_hbar(xhr))
        z = F.sigmoid(self.xh_to_z(xh))
        ht = (1 - z) * hprev + z * hbar
        return ht


class RNN(nn.Module):
    def __init__(self, block_size, vocab_size, n_embd, n_embd2, cell_type):
        super().__init__()
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.start = nn.Parameter(torch.zeros(1, n_embd2))
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.cell = RNNCell(n_embd, n_embd2) if cell_type == 'rnn' else GRUCell(n_embd, n_embd2)
        self.lm_head = nn.Linear(n_embd2, self.vocab_size)

    def get_block_size(self):
        return self.block_size

    def forward(self, idx, targets=None):
        b, t = idx.size()
        emb = self.wte(idx)
        hprev = self.start.expand((b, -1))
        hiddens = []
        for i in range(t):
            xt = emb[:, i, :]
            ht = self.cell(xt, hprev)
            hprev = ht
            hiddens.append(ht)
        hidden = torch.stack(hiddens, 1)
        logits = self.lm_head(hidden)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class CausalBoW(nn.Module):
    def __init__(self, block_size):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        att = torch.zeros((B, T, T), device=x.device)
        att = att.masked_fill(self.bias[:, :T, :T] == 0, float('-inf'))
        att = F.softmax(att, dim=-1)
        y = att @ x
        return y


class BoWBlock(nn.Module):
    def __init__(self, n_embd, n_embd2, block_size):
        super().__init__()
        self.cbow = CausalBoW(block_size)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, n_embd2), c_proj=nn.Linear(n_embd2, n_embd)))
        m = self.mlp
        self.mlpf = lambda x: m.c_proj(F.tanh(m.c_fc(x)))

    def forward(self, x):
        x = x + self.cbow(x)
        x = x + self.mlpf(x)
        return x


class BoW(nn.Module):
    def __init__(self, block_size, vocab_size, n_embd, n_embd2):
        super().__init__()
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.context_block = BoWBlock(n_embd, n_embd2, block_size)
        self.lm_head = nn.Linear(n_embd, self.vocab_size)

    def get_block_size(self):
        return self.block_size

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=device).unsqueeze(0)
        x = self.wte(idx) + self.wpe(pos)
        x = self.context_block(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, do_sample=False, top_k=None):
    block_size = model.get_block_size()
    for _ in range(max_new_tokens):
        idx_cond = idx if idx.size(1) <= block_size else idx[:, -block_size:]
        logits, _ = model(idx_cond)
        logits = logits[:, -1, :] / temperature
        if top_k is not None:
            v, _ = torch.topk(logits, top_k)
            logits[logits < v[:, [-1]]] = -float('Inf')
        probs = F.softmax(logits, dim=-1)
        if do_sample:
            idx_next = torch.multinomial(probs, num_samples=1)
        else:
            _, idx_next = torch.topk(probs, k=1, dim=-1)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


def print_samples(model, dataset, num=4, top_k=None):
    X_init = torch.zeros(num, 1, dtype=torch.long).to(device)
    steps = dataset.get_output_length() - 1
    X_samp = generate(model, X_init, steps, top_k=top_k, do_sample=True).to('cpu')
    samples = []
    for i in range(X_samp.size(0)):
        row = X_samp[i, 1:].tolist()
        crop_index = row.index(0) if 0 in row else len(row)
        row = row[:crop_index]
        samples.append(dataset.decode(row))
    return samples


@torch.inference_mode()
def evaluate(model, dataset, batch_size=50, max_batches=None):
    model.eval()
    loader = DL(dataset, shuffle=True, batch_size=batch_size, num_workers=0)
    losses = []
    for i, batch in enumerate(loader):
        batch = [t.to(device) for t in batch]
        X, Y = batch
        logits, loss = model(X, Y)
        losses.append(loss.item())
        if max_batches is not None and i >= max_batches:
            break
    mean_loss = torch.tensor(losses).mean().item()
    model.train()
    return mean_loss


chars = sorted(list(set(''.join(words))))
max_word_length = max(len(w) for w in words)
train_set = CharDataset(words[:180], chars, max_word_length)
test_set = CharDataset(words[180:], chars, max_word_length)
vocab_size = train_set.get_vocab_size()
block_size = train_set.get_output_length()
results = {}
for kind in ("rnn", "gru", "bow"):
    torch.manual_seed(3407)
    m = BoW(block_size, vocab_size, 16, 32) if kind == "bow" else RNN(block_size, vocab_size, 16, 32, cell_type=kind)
    m.to(device)
    optimizer = torch.optim.AdamW(m.parameters(), lr=5e-3, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8)
    batch_loader = InfiniteDataLoader(train_set, batch_size=16, pin_memory=True, num_workers=0)
    steps = []
    for step in range(4):
        batch = batch_loader.next()
        batch = [t.to(device) for t in batch]
        X, Y = batch
        logits, loss = m(X, Y)
        m.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        steps.append(loss.item())
    torch.manual_seed(1)
    test_loss = evaluate(m, test_set, batch_size=8, max_batches=1)
    torch.manual_seed(2)
    results[kind] = {"steps": steps, "test_loss": test_loss, "samples": print_samples(m, train_set, top_k=5),
                     "best": min(steps), "training": m.training}
out["makemore"] = results

# ---------------- "let's build GPT": the mathematical trick in self-attention ----------------
torch.manual_seed(1337)
B, T, C = 4, 8, 2
x = torch.randn(B, T, C).to(device)
xbow = torch.zeros((B, T, C), device=device)
for b in range(B):
    for t in range(T):
        xprev = x[b, :t + 1]
        xbow[b, t] = torch.mean(xprev, 0)
wei = torch.tril(torch.ones(T, T, device=device))
wei = wei / wei.sum(1, keepdim=True)
xbow2 = wei @ x
tril = torch.tril(torch.ones(T, T, device=device))
wei = torch.zeros((T, T), device=device)
wei = wei.masked_fill(tril == 0, float('-inf'))
wei = F.softmax(wei, dim=-1)
xbow3 = wei @ x
head_size = 16
key = nn.Linear(C, head_size, bias=False).to(device)
query = nn.Linear(C, head_size, bias=False).to(device)
value = nn.Linear(C, head_size, bias=False).to(device)
k, q = key(x), query(x)
wei = q @ k.transpose(-2, -1) * head_size**-0.5
wei = wei.masked_fill(tril == 0, float('-inf'))
wei = F.softmax(wei, dim=-1)
o = wei @ value(x)

rng = random.Random(0)
text = "".join(rng.choice("hello world, to be or not to be ") for _ in range(500))
chars = sorted(list(set(text)))
stoi = {ch: i for i, ch in enumerate(chars)}
itos = {i: ch for i, ch in enumerate(chars)}
encode = lambda s: [stoi[c] for c in s]  # noqa: E731
decode = lambda l: ''.join([itos[i] for i in l])  # noqa: E731, E741
data = torch.tensor(encode(text), dtype=torch.long)
n = int(0.9 * len(data))
train_data, val_data = data[:n], data[n:]
block_size, batch_size, eval_iters = 8, 4, 3


def get_batch(split):
    data = train_data if split == 'train' else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + block_size + 1] for i in ix])
    x, y = x.to(device), y.to(device)
    return x, y


class BigramLanguageModel(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.token_embedding_table = nn.Embedding(vocab_size, vocab_size)

    def forward(self, idx, targets=None):
        logits = self.token_embedding_table(idx)
        if targets is None:
            loss = None
        else:
            B, T, C = logits.shape
            logits = logits.view(B * T, C)
            targets = targets.view(B * T)
            loss = F.cross_entropy(logits, targets)
        return logits, loss

    def generate(self, idx, max_new_tokens):
        for _ in range(max_new_tokens):
            logits, loss = self(idx)
            logits = logits[:, -1, :]
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


model = BigramLanguageModel(len(chars))
m = model.to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
evals = []
for iter in range(6):
    if iter % 3 == 0:
        losses = estimate_loss()
        evals.append([losses['train'].item(), losses['val'].item()])
    xb, yb = get_batch('train')
    logits, loss = model(xb, yb)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
torch.manual_seed(1337)
context = torch.zeros((1, 1), dtype=torch.long, device=device)
generated = decode(m.generate(context, max_new_tokens=20)[0].tolist())
out["gpt_dev"] = {"xbow_same": [torch.allclose(xbow, xbow2), torch.allclose(xbow, xbow3)], "xbow": xbow.sum().item(),
                  "head_out": o.sum().item(), "wei0": wei[0].tolist(), "evals": evals, "generated": generated,
                  "loss_device": str(loss.device)}
print(json.dumps(out))
