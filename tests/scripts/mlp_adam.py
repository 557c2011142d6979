"""MLP regression with Adam, gradient clipping and a step LR schedule."""
import json

import torch
import torch.nn as nn

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
X, w = torch.randn(512, 16), torch.randn(16, 1)
Y = torch.sin(X @ w) + 0.05 * torch.randn(512, 1)

model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=3e-3)  # built before .to(device), as many scripts do
model.to(device)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
losses = []
for step in range(60):
    idx = torch.arange(step * 32, step * 32 + 64) % 512
    xb, yb = X[idx].to(device), Y[idx].to(device)
    loss = nn.functional.mse_loss(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    sched.step()
    losses.append(loss.item())
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
print(json.dumps({"device": str(next(model.parameters()).device), "losses": losses, "checksum": checksum}))
