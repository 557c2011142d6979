"""Mixed precision as the PyTorch AMP recipe writes it: torch.autocast(float16) around the
forward, torch.amp.GradScaler around backward/step, unscale_ before gradient clipping."""
import json

import torch
import torch.nn as nn

device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10)
g = torch.Generator().manual_seed(1)
data = [(torch.randn(16, 32, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(5)]

losses, scales, dtypes = [], [], set()
for x, y in data:
    x, y = x.to(device), y.to(device)
    with torch.autocast(device_type=device.type, dtype=torch.float16):
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
    dtypes.add(str(out.dtype))
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    losses.append(loss.item())
    scales.append(scaler.get_scale())

print(json.dumps({"device": str(next(model.parameters()).device), "losses": losses, "scales": scales,
                  "autocast_dtypes": sorted(dtypes), "loss_dtype": str(loss.dtype),
                  "param_dtype": str(next(model.parameters()).dtype),
                  "weight_sum": model[0].weight.sum().item()}))
