"""Remote vs local results on a real GPU (run by gpu_check.sh on a machine with one).

The CPU gateway of the test suite cannot exercise what only a GPU gateway does: the fused
attention and cuDNN RNN kernels the client asks for, CUDA's own error messages, bf16/fp16
kernels. Each check here runs the same code locally on CUDA (``--mode local``) and through a
gateway on the same GPU with CUDA hidden from the client (``--mode remote``); ``--compare``
prints one line per check with the largest relative difference.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

CHECKS: dict[str, Callable[[], dict]] = {}


def check(fn: Callable[[], dict]) -> Callable[[], dict]:
    CHECKS[fn.__name__] = fn
    return fn


def values(t: torch.Tensor, n: int = 64) -> list:
    """A tensor's sum, norm and first ``n`` values, as floats (enough to compare, small to print)."""
    t = t.detach().float().cpu().flatten()
    return [float(t.sum()), float(t.norm()), *t[:n].tolist()]


def cpu_randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def sdpa_case(dtype: torch.dtype, mask_kind: str, causal: bool) -> dict:
    q, k, v = (cpu_randn(2, 4, 16, 32, seed=s, dtype=dtype).cuda().requires_grad_() for s in (1, 2, 3))
    mask = None
    if mask_kind == "bool":
        keep = torch.ones(2, 1, 16, 16, dtype=torch.bool)
        keep[0, :, :, 12:] = False  # a padded sequence
        mask = keep.cuda()
    elif mask_kind == "float":
        mask = cpu_randn(2, 1, 16, 16, seed=4, dtype=dtype).cuda()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    out.float().square().sum().backward()
    return {"out": values(out), "dq": values(q.grad), "dk": values(k.grad), "dv": values(v.grad)}


@check
def sdpa_bool_mask_fp16() -> dict:
    return sdpa_case(torch.float16, "bool", False)


@check
def sdpa_bool_mask_fp32() -> dict:
    return sdpa_case(torch.float32, "bool", False)


@check
def sdpa_float_mask_bf16() -> dict:
    return sdpa_case(torch.bfloat16, "float", False)


@check
def sdpa_causal_bf16() -> dict:
    return sdpa_case(torch.bfloat16, "none", True)


def rnn_case(cls: type, **kw: object) -> dict:
    torch.manual_seed(0)
    rnn = cls(32, 64, 2, batch_first=True, **kw).cuda()
    x = cpu_randn(4, 10, 32, seed=5).cuda().requires_grad_()
    out, _ = rnn(x)
    out.square().sum().backward()
    return {"out": values(out), "dx": values(x.grad), "dw": values(rnn.weight_hh_l0.grad)}


@check
def lstm() -> dict:
    return rnn_case(nn.LSTM)


@check
def lstm_bidirectional() -> dict:
    return rnn_case(nn.LSTM, bidirectional=True)


@check
def gru() -> dict:
    return rnn_case(nn.GRU)


@check
def dropout() -> dict:
    torch.manual_seed(0)
    x = cpu_randn(64, 64).cuda().requires_grad_()
    y = F.dropout(x, 0.3)
    y.sum().backward()
    return {"y": values(y, 256), "dx": values(x.grad, 256)}


@check
def empty_tensors() -> dict:
    e = torch.zeros(0, 3).cuda()
    x = cpu_randn(2, 3).cuda()
    c = torch.cat([e, x])
    return {"cat": values(c), "empty_shape": list(torch.tensor([], device="cuda").shape)}


@check
def mlp_adamw() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = cpu_randn(32, 64).cuda(), torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(0)).cuda()
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}


@check
def autocast_bf16() -> dict:
    torch.manual_seed(0)
    lin = nn.Linear(64, 64).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(cpu_randn(8, 64).cuda())
    return {"dtype": str(y.dtype), "y": values(y)}


@check
def error_message() -> dict:
    try:
        (torch.randn(3, 4, device="cuda") @ torch.randn(5, 6, device="cuda")).sum().item()
    except Exception as e:  # noqa: BLE001 - the type and message are what is compared
        return {"type": type(e).__name__, "message": str(e).splitlines()[0]}
    return {"type": "no error"}


@check
def gpt2_padded_and_generate() -> dict:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return {"skipped": "transformers not importable"}
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4)).cuda()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    ids, mask = ids.cuda(), mask.cuda()
    torch.manual_seed(0)
    train_loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss  # with dropout
    model.eval()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    return {"train_loss": [train_loss.item()], "loss": [loss.item()], "grad": values(model.transformer.wte.weight.grad), "generated": gen.tolist()}


def lstm_step_ms() -> float:
    torch.manual_seed(0)
    emb, rnn, head = nn.Embedding(1000, 64).cuda(), nn.LSTM(64, 128, 2).cuda(), nn.Linear(128, 1000).cuda()
    params = [*emb.parameters(), *rnn.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=1.0)
    data = torch.randint(0, 1000, (36, 20), generator=torch.Generator().manual_seed(0)).cuda()

    def step() -> None:
        out, _ = rnn(emb(data[:35]))
        loss = F.cross_entropy(head(out).reshape(-1, 1000), data[1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
    for _ in range(3):
        step()
    t = time.perf_counter()
    for _ in range(20):
        step()
    return (time.perf_counter() - t) / 20 * 1e3


def run(mode: str, server: str | None) -> dict:
    if mode == "remote":
        import remotecuda
        remotecuda.activate(server, fallback="error")
    out: dict = {"mode": mode, "torch": torch.__version__}
    for name, fn in CHECKS.items():
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - every check reports, one failure does not stop the rest
            out[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300],
                         "where": traceback.format_exc().splitlines()[-3:]}
    out["lstm_step_ms"] = lstm_step_ms()
    return out


def rel_diff(a: object, b: object) -> float:
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return max((rel_diff(x, y) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) / max(abs(a), abs(b), 1e-3)
    return 0.0 if a == b else float("inf")


def compare(local: dict, remote: dict) -> None:
    for name in CHECKS:
        loc, rem = local.get(name, {}), remote.get(name, {})
        if "error" in loc or "error" in rem or "skipped" in loc or "skipped" in rem:
            print(f"{name:28s} local: {loc.get('error') or loc.get('skipped', 'ok')}   "
                  f"remote: {rem.get('error') or rem.get('skipped', 'ok')}")
            continue
        worst = max((rel_diff(loc[k], rem.get(k)) for k in loc), default=0.0)
        print(f"{name:28s} max rel diff {worst:.2e}  {'OK' if worst <= 2e-2 else 'DIFFERS'}"
              + ("" if worst <= 2e-2 else f"  local={json.dumps(loc)[:200]} remote={json.dumps(rem)[:200]}"))
    print(f"{'lstm_step_ms':28s} local {local['lstm_step_ms']:.2f}  remote {remote['lstm_step_ms']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("local", "remote"))
    p.add_argument("--server", default=None)
    p.add_argument("--compare", nargs=2, metavar=("LOCAL_JSON", "REMOTE_JSON"))
    a = p.parse_args()
    if a.compare:
        local, remote = (json.loads(pathlib.Path(f).read_text().strip().splitlines()[-1]) for f in a.compare)
        compare(local, remote)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(run(a.mode, a.server)), flush=True)


if __name__ == "__main__":
    main()
