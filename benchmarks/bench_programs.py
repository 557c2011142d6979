"""Whole programs, remote vs local in one run: an LSTM language model's training step, a
checkpoint of a model with dozens of tensors, and a Hugging Face GPT-2 (small config, no
weights downloaded): its training step and ``generate()`` tokens per second.

    python benchmarks/bench_programs.py [--quick] [--json OUT]

Starts its own gateway (``remotecuda start --device cpu`` on 127.0.0.1). Each figure is the
best of N runs, measured first on the local CPU and then on 'cuda' through the gateway in
the same process, so the ratio compares like with like on this machine.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_core  # noqa: E402


def best(fn: Callable[[], None], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls (after one untimed warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


class LSTMLanguageModel(nn.Module):
    """pytorch/examples' word_language_model at a small size: embedding 64, 2 LSTM layers of 128."""

    def __init__(self, vocab: int = 1000, emb: int = 64, hidden: int = 128, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, layers, dropout=0.2)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor, state: tuple) -> tuple[torch.Tensor, tuple]:
        out, state = self.rnn(self.embed(x), state)
        return self.head(out), state


def lstm_step(device: str, steps: int) -> Callable[[], None]:
    """``steps`` truncated-BPTT steps (seq 35, batch 20, SGD, clip 0.25, loss.item() each step
    as the example logs it)."""
    torch.manual_seed(0)
    model = LSTMLanguageModel().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = torch.randint(0, 1000, (36 * steps, 20), generator=torch.Generator().manual_seed(0)).to(device)
    loss_fn = nn.CrossEntropyLoss()

    def run() -> None:
        state = (torch.zeros(2, 20, 128, device=device), torch.zeros(2, 20, 128, device=device))
        for i in range(steps):
            x, y = data[i * 36:i * 36 + 35], data[i * 36 + 1:i * 36 + 36]
            state = tuple(s.detach() for s in state)
            out, state = model(x, state)
            loss = loss_fn(out.reshape(-1, 1000), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            opt.step()
            loss.item()
    return run


def checkpoint(device: str) -> tuple[Callable[[], None], int]:
    """``torch.save(model.state_dict())`` of a 6-layer transformer encoder (dozens of tensors)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True)
    model = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).to(device)
    sd = model.state_dict()

    def run() -> None:
        sync(device)
        torch.save(model.state_dict(), io.BytesIO())
    return run, len(sd)


def gpt2(device: str):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=512, n_positions=128, n_embd=128, n_layer=4, n_head=4)
    return GPT2LMHeadModel(cfg).to(device)


def gpt2_train(device: str, steps: int) -> Callable[[], None]:
    """GPT-2 (4 layers, d 128) on a padded batch of 8×64 tokens, AdamW, loss.item() each step."""
    model = gpt2(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (8, 64), generator=g)
    mask = torch.ones(8, 64, dtype=torch.long)
    mask[::2, 48:] = 0
    ids, mask = ids.to(device), mask.to(device)

    def run() -> None:
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.item()
    return run


def gpt2_generate(device: str, new_tokens: int) -> Callable[[], None]:
    """Greedy ``generate()`` of ``new_tokens`` tokens for a batch of 4 prompts of 16 tokens."""
    model = gpt2(device).eval()
    ids = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(1)).to(device)

    def run() -> None:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return run


def measure(device: str, quick: bool) -> dict:
    reps = 2 if quick else 5
    lstm_steps, gpt_steps, tokens = (3, 2, 8) if quick else (10, 5, 32)
    ckpt, n_tensors = checkpoint(device)
    return {
        "lstm_step_ms": best(lstm_step(device, lstm_steps), reps) / lstm_steps * 1e3,
        "checkpoint_ms": best(ckpt, reps) * 1e3,
        "checkpoint_tensors": n_tensors,
        "gpt2_step_ms": best(gpt2_train(device, gpt_steps), reps) / gpt_steps * 1e3,
        "gpt2_generate_tok_s": 4 * tokens / best(gpt2_generate(device, tokens), reps),
    }


ROWS = [("lstm_step_ms", "LSTM LM training step (2×128, seq 35, batch 20, SGD, `item()` each step)", "ms"),
        ("checkpoint_ms", "`torch.save(model.state_dict())`, 6-layer encoder", "ms"),
        ("gpt2_step_ms", "GPT-2 (4 layers, d 128) training step, padded batch 8×64, AdamW", "ms"),
        ("gpt2_generate_tok_s", "GPT-2 greedy `generate()`, batch 4, tokens/s (higher is better)", "tok/s")]


def markdown(r: dict) -> str:
    local, remote = r["local"], r["remote"]
    lines = ["| program | local CPU | remote (`--device cpu` gateway) | remote / local |", "| --- | --- | --- | --- |"]
    for key, label, unit in ROWS:
        if key == "checkpoint_ms":
            label += f" ({local['checkpoint_tensors']} tensors)"
        lines.append(f"| {label} | {local[key]:.1f} {unit} | {remote[key]:.1f} {unit} | ×{remote[key] / local[key]:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    local = measure("cpu", a.quick)
    gw, addr = bench_core.start_gateway()
    try:
        import remotecuda
        remotecuda.activate(addr, fallback="error")
        remote = measure("cuda", a.quick)
        remotecuda.deactivate()
    finally:
        gw.terminate()
    r = {"local": local, "remote": remote, "elapsed_s": time.perf_counter() - t0}
    print(markdown(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f)


if __name__ == "__main__":
    main()
