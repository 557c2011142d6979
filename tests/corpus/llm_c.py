"""A training run in the style of karpathy/llm.c's train_gpt2.py (tiny, synthetic tokens): a
token shard with llm.c's 256-int32 header read by np.frombuffer, batches cut from it as views
and moved to the device, init from a seeded CPU generator (LLMC_SKIP_INIT on the tied head),
torch.set_float32_matmul_precision('high'), torch.compile, AdamW(fused=device == 'cuda'),
gradient accumulation into ``lossf += loss.detach()``, ``model(x, y, return_logits=False)``
returning (None, loss), the clip norm formatted by an f-string, validation under no_grad,
the weights written as float32 and as bfloat16 reinterpreted as int16 (llm.c's write_model),
and nanoGPT's bench.py profiler (a schedule and a tensorboard trace handler)."""
import json
import math
import os
import tempfile
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

device = "cpu"
if torch.cuda.is_available():
    device = "cuda"
elif hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
    device = "mps"
ctx = torch.amp.autocast(device_type="cuda", dtype=torch.float32) if device == "cuda" else nullcontext()
torch.manual_seed(42)
if torch.cuda.is_available():
    torch.cuda.manual_seed(42)
torch.set_float32_matmul_precision('high')
B, T, V, C = 4, 8, 50, 32


class MLPLM(nn.Module):
    """A one-block language model with llm.c's initialisation."""

    def __init__(self):
        super().__init__()
        self.init_rng = torch.Generator()
        self.init_rng.manual_seed(42)
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.ln = nn.LayerNorm(C)
        self.c_fc, self.c_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.c_proj.LLMC_RESIDUAL_SCALE_FLAG = 1
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.LLMC_SKIP_INIT = 1  # tied to wte, which is initialised instead
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02 if not hasattr(module, 'LLMC_RESIDUAL_SCALE_FLAG') else 0.02 / math.sqrt(2)
            if not hasattr(module, 'LLMC_SKIP_INIT'):
                torch.nn.init.normal_(module.weight, mean=0.0, std=std, generator=self.init_rng)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=self.init_rng)

    def forward(self, idx, targets=None, return_logits=True):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        x = x + self.c_proj(F.gelu(self.c_fc(self.ln(x)), approximate='tanh'))
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        if not return_logits:
            logits = None
        return logits, loss


shard = os.path.join(tempfile.mkdtemp(), "tok_val_000000.bin")
header = np.zeros(256, dtype=np.int32)
header[0], header[1], header[2] = 20240520, 1, 1200
with open(shard, "wb") as f:
    f.write(header.tobytes())
    f.write(np.random.default_rng(0).integers(0, V, 1200).astype(np.uint16).tobytes())


def load_data_shard(filename):
    with open(filename, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype=np.int32)
        assert header[0] == 20240520, "magic number mismatch in the data .bin file"
        tokens = np.frombuffer(f.read(), dtype=np.uint16)
    assert len(tokens) == header[2], "number of tokens read does not match header"
    return tokens


class DataLoaderLite:
    def __init__(self, filename):
        self.filename = filename
        self.reset()

    def reset(self):
        self.current_position, self.tokens = 0, load_data_shard(self.filename)

    def next_batch(self):
        buf = self.tokens[self.current_position:self.current_position + B * T + 1]
        buf = torch.tensor(buf.astype(np.int32), dtype=torch.long)
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.current_position += B * T
        if self.current_position + (B * T + 1) > len(self.tokens):
            self.reset()
        return x.to(device), y.to(device)


def write_model(model, filename):
    header = torch.zeros(256, dtype=torch.int32)
    header[0], header[1], header[2], header[3] = 20240326, 3, T, V
    params = {name: param.cpu() for name, param in model.named_parameters()}
    with open(filename, "wb") as file:
        file.write(header.numpy().tobytes())
        for name in sorted(params):
            file.write(params[name].detach().cpu().to(torch.float32).numpy().tobytes())
        for name in sorted(params):  # numpy has no bfloat16: reinterpret as int16
            file.write(params[name].detach().cpu().to(torch.bfloat16).view(torch.int16).numpy().tobytes())


model = MLPLM()
model.train()
model.to(device)
if device == "cuda":
    model = torch.compile(model)
raw_model = model
optimizer = torch.optim.AdamW(raw_model.parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95),
                              fused=device == "cuda")
loader = DataLoaderLite(shard)
grad_accum_steps = 2
if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
steps = []
for step in range(3):
    model.train()
    optimizer.zero_grad(set_to_none=True)
    lossf = 0.0
    for micro_step in range(grad_accum_steps):
        x, y = loader.next_batch()
        with ctx:
            _, loss = model(x, y, return_logits=False)
            loss = loss / grad_accum_steps
            lossf += loss.detach()  # a device tensor from here on
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    lr = 1e-3 * (step + 1) / 3
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr
    optimizer.step()
    if device == "mps":
        torch.mps.synchronize()
    elif device == "cuda":
        torch.cuda.synchronize()
    line = f"step {step + 1:4d} | train loss {lossf.item():.6f} | norm {norm:.4f} | lr {lr:.2e}"
    model.eval()
    with torch.no_grad():
        val_loss = 0.0
        for _ in range(2):
            x, y = loader.next_batch()
            _, loss = model(x, y, return_logits=False)
            val_loss += loss.item()
    steps.append([line, lossf.item(), val_loss / 2])

out = tempfile.mkdtemp()
write_model(raw_model, os.path.join(out, "model.bin"))
n = sum(p.numel() for p in raw_model.parameters())
blob = np.fromfile(os.path.join(out, "model.bin"), dtype=np.uint8, offset=1024)
fp32, bf16 = blob[:4 * n].view(np.float32), blob[4 * n:].view(np.int16)

from torch.profiler import ProfilerActivity  # noqa: E402

wait, warmup, active = 1, 1, 1
with torch.profiler.profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(os.path.join(out, 'bench_log')),
        record_shapes=False, profile_memory=False, with_stack=False, with_flops=True, with_modules=False) as prof:
    model.train()
    for k in range(wait + warmup + active):
        X, Y = loader.next_batch()
        with ctx:
            logits, loss = model(X, Y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        lossf = loss.item()
        prof.step()
print(json.dumps({"device": str(X.device), "steps": steps, "fp32_sum": float(fp32.sum()), "n": int(n),
                  "bf16_bits": int(bf16.astype(np.int64).sum()),
                  "traces": len(os.listdir(os.path.join(out, 'bench_log'))),
                  "bench_loss": lossf, "logits_shape": list(logits.shape),
                  "peak_mib": torch.cuda.max_memory_allocated() // 1024 // 1024}))
