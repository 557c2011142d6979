"""An ordinary PyTorch training script: nothing in it knows about RemoteCUDA."""
import time

import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
print(f"training on {device}: {torch.cuda.get_device_name(0) if device == 'cuda' else 'local CPU'}")
torch.manual_seed(0)
X = torch.randn(2048, 32)
true_w = torch.randn(32, 1)
Y = X @ true_w + 0.1 * torch.randn(2048, 1)

model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
start = time.perf_counter()
for epoch in range(5):
    for i in range(0, len(X), 256):
        xb, yb = X[i:i + 256].to(device), Y[i:i + 256].to(device)
        loss = nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"epoch {epoch}: loss {loss.item():.4f}")
print(f"done in {time.perf_counter() - start:.2f} s; parameters live on {next(model.parameters()).device}")
