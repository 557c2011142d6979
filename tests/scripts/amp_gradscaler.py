"""Mixed precision: autocast + GradScaler, the CUDA recipe."""
import json

import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(3)
X = torch.randn(256, 32)
Y = (X[:, :4].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler(device)
losses, dtypes = [], set()
for step in range(30):
    i = (step * 64) % 256
    xb, yb = X[i:i + 64].to(device), Y[i:i + 64].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        logits = model(xb)
        dtypes.add(str(logits.dtype))
        loss = nn.functional.cross_entropy(logits, yb)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    losses.append(loss.item())
print(json.dumps({"device": str(logits.device), "losses": losses, "logits_dtypes": sorted(dtypes),
                  "loss_dtype": str(loss.dtype), "scale": scaler.get_scale()}))
