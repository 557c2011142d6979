"""Checkpoint save and resume: torch.save of model, optimizer and scheduler state, torch.load
with map_location into fresh objects, training continued; must equal an uninterrupted run."""
import copy
import json
import os
import tempfile

import torch
import torch.nn as nn

device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
g = torch.Generator().manual_seed(5)
batches = [(torch.randn(12, 10, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(6)]


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train(model, opt, sched, steps):
    losses = []
    model.train()
    for x, y in steps:
        x, y = x.to(device), y.to(device)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


model, opt, sched = build()
straight = train(model, opt, sched, batches)
straight_state = {k: v.double().sum().item() for k, v in model.state_dict().items()}

model, opt, sched = build()
first = train(model, opt, sched, batches[:3])
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "ckpt.pt")
    torch.save({"epoch": 3, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict()}, path)
    del model, opt, sched
    ckpt = torch.load(path, map_location=device)
    stored_device = str(ckpt["model"]["0.weight"].device)
    model, opt, sched = build()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    cpu_copy = copy.deepcopy({k: v.cpu() for k, v in model.state_dict().items()})
resumed = first + train(model, opt, sched, batches[3:])
resumed_state = {k: v.double().sum().item() for k, v in model.state_dict().items()}

print(json.dumps({"device": str(next(model.parameters()).device), "loaded_device": stored_device,
                  "straight": straight, "resumed": resumed, "same_losses": straight == resumed,
                  "same_state": straight_state == resumed_state, "state": resumed_state,
                  "exp_avg_sq_sum": sum(s["exp_avg_sq"].sum().item() for s in opt.state.values()),
                  "lr": sched.get_last_lr()[0],
                  "cpu_copy_sum": sum(v.double().sum().item() for v in cpu_copy.values())}))
