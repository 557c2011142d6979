"""karpathy/build-nanogpt's train_gpt2.py, shrunk: GPT-2 with NANOGPT_SCALE_INIT, a token file
read by NumPy into a DataLoaderLite, gradient accumulation under bfloat16 autocast with
``loss_accum += loss.detach()``, ``set_float32_matmul_precision("high")``, fused AdamW where the
device is 'cuda', a cosine schedule, ``torch.cuda.synchronize()`` around the step's timing, the
HellaSwag scorer (masked per-token losses, argmin), and top-k sampling by ``torch.multinomial``
with a ``torch.Generator(device=device)``. (The sampling forward runs outside autocast here: a
CPU's and a GPU's bfloat16 policies differ in the last bit, which a sampled token may show.)"""
import inspect
import json
import math
import time

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
device_type = "cuda" if device.startswith("cuda") else "cpu"
torch.manual_seed(1337)
if torch.cuda.is_available():
    torch.cuda.manual_seed(1337)
torch.set_float32_matmul_precision("high")

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1
        self.n_head, self.n_embd = n_head, n_embd
    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * n_embd, n_embd))
    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    def __init__(self, vocab=64, block=16, n_layer=2, n_embd=32, n_head=4):
        super().__init__()
        self.block_size = block
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.n_layer = n_layer
        self.apply(self._init_weights)
    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if hasattr(module, "NANOGPT_SCALE_INIT"):
                std *= (2 * self.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
    def forward(self, idx, targets=None):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay = [p for n, p in param_dict.items() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]
        use_fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=use_fused)

class DataLoaderLite:
    def __init__(self, B, T):
        self.B, self.T = B, T
        npt = np.random.default_rng(0).integers(0, 64, 2000).astype(np.int32)  # (load_tokens' np.load)
        self.tokens = torch.tensor(npt, dtype=torch.long)
        self.current_position = 0
    def next_batch(self):
        B, T = self.B, self.T
        buf = self.tokens[self.current_position:self.current_position + B * T + 1]
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.current_position += B * T
        if self.current_position + (B * T + 1) > len(self.tokens):
            self.current_position = 0
        return x, y

def get_most_likely_row(tokens, mask, logits):
    shift_logits = (logits[..., :-1, :]).contiguous()
    shift_tokens = (tokens[..., 1:]).contiguous()
    flat_shift_logits = shift_logits.view(-1, shift_logits.size(-1))
    shift_losses = F.cross_entropy(flat_shift_logits, shift_tokens.view(-1), reduction="none")
    shift_losses = shift_losses.view(tokens.size(0), -1)
    shift_mask = (mask[..., 1:]).contiguous()
    masked = shift_losses * shift_mask
    avg_loss = masked.sum(dim=1) / shift_mask.sum(dim=1)
    return avg_loss.argmin().item()

total_batch_size, B, T = 256, 4, 16
grad_accum_steps = total_batch_size // (B * T)
train_loader = DataLoaderLite(B, T)
model = GPT().to(device)
raw_model = model
max_lr, min_lr, warmup_steps, max_steps = 6e-4 * 10, 6e-5 * 10, 2, 5
def get_lr(it):
    if it < warmup_steps:
        return max_lr * (it + 1) / warmup_steps
    decay_ratio = (it - warmup_steps) / (max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (max_lr - min_lr)
optimizer = raw_model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, device_type=device_type)
out = {"losses": [], "norms": []}
for step in range(max_steps):
    t0 = time.time()
    optimizer.zero_grad()
    loss_accum = 0.0
    for micro_step in range(grad_accum_steps):
        x, y = train_loader.next_batch()
        x, y = x.to(device), y.to(device)
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            logits, loss = model(x, y)
        loss = loss / grad_accum_steps
        loss_accum += loss.detach()
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    lr = get_lr(step)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    optimizer.step()
    if device_type == "cuda":
        torch.cuda.synchronize()
    dt = time.time() - t0
    tokens_per_sec = train_loader.B * train_loader.T * grad_accum_steps / dt
    out["losses"].append(loss_accum.item())
    out["norms"].append(norm.item())
    out["tokens_per_sec_positive"] = tokens_per_sec > 0
model.eval()
tokens = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [1, 2, 3, 7, 8, 0], [1, 2, 3, 5, 5, 5]]).to(device)
mask = torch.tensor([[0, 0, 0, 1, 1, 1]] * 4).to(device)
with torch.no_grad():
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
        logits, loss = model(tokens)
    out["pred"] = get_most_likely_row(tokens, mask, logits)
    out["eval_dtype"] = str(logits.dtype)
num_return_sequences, max_length = 2, 12
xgen = torch.tensor([1, 2, 3, 4], dtype=torch.long).unsqueeze(0).repeat(num_return_sequences, 1).to(device)
sample_rng = torch.Generator(device=device)
sample_rng.manual_seed(42)
while xgen.size(1) < max_length:
    with torch.no_grad():
        logits, loss = model(xgen)
        logits = logits[:, -1, :]
        probs = F.softmax(logits, dim=-1)
        topk_probs, topk_indices = torch.topk(probs, 50, dim=-1)
        ix = torch.multinomial(topk_probs, 1, generator=sample_rng)
        xcol = torch.gather(topk_indices, -1, ix)
        xgen = torch.cat((xgen, xcol), dim=1)
out["gen"] = xgen.tolist()
out["device"] = str(xgen.device)
print(json.dumps(out))
