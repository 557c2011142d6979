"""Remote vs local on a real GPU (run by gpu_check.sh on a machine with one).

`--mode local` runs on the local CUDA device; `--mode remote` runs the same code with
CUDA hidden from this process and RemoteCUDA active against a gateway on this machine.
Prints one JSON line of figures.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def sync() -> None:
    torch.cuda.synchronize()


def matmul_tflops(n: int, reps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def step_time(model: nn.Module, make_batch, loss_fn, steps: int = 30) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [make_batch() for _ in range(4)]
    for i in range(5):
        x, y = batches[i % 4]
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    sync()
    t = time.perf_counter()
    for i in range(steps):
        x, y = batches[i % 4]
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    loss.item()
    return (time.perf_counter() - t) / steps * 1e3


def mlp_step() -> float:
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                          nn.Linear(4096, 10)).cuda()
    return step_time(model, lambda: (torch.randn(512, 1024, device="cuda"),
                                     torch.randint(0, 10, (512,), device="cuda")), F.cross_entropy)


def transformer_step() -> float:
    layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, dropout=0.0)
    model = nn.Sequential(nn.TransformerEncoder(layer, 6), nn.Linear(512, 512)).cuda()
    return step_time(model, lambda: (torch.randn(16, 256, 512, device="cuda"),
                                     torch.randn(16, 256, 512, device="cuda")), F.mse_loss, steps=20)


def upload_gbps(nbytes: int = 256 << 20, reps: int = 5) -> float:
    host = torch.randn(nbytes // 4)
    host.cuda()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        host.add_(1)  # new content each time, so the upload cache cannot help
        host.cuda()
    sync()
    return nbytes * reps / (time.perf_counter() - t) / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("local", "remote"), required=True)
    p.add_argument("--server", default=None)
    a = p.parse_args()
    if a.mode == "remote":
        import remotecuda
        remotecuda.activate(a.server, fallback="error")
    out = {"mode": a.mode, "device": torch.cuda.get_device_name(0)}
    out["matmul_bf16_tflops_4096"] = matmul_tflops(4096)
    out["matmul_bf16_tflops_8192"] = matmul_tflops(8192)
    out["mlp_step_ms"] = mlp_step()
    out["transformer_step_ms"] = transformer_step()
    out["upload_gb_s"] = upload_gbps()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
