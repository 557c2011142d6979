"""A Dataset fed through DataLoader(num_workers=2, pin_memory=True, shuffle with a seeded
generator), batches moved with non_blocking=True, as today's training loops do."""
import json

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x ** 2).sum(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main():
    acc = torch.accelerator.current_accelerator()
    device = acc if torch.accelerator.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    loader = DataLoader(Squares(96), batch_size=16, shuffle=True, num_workers=2, pin_memory=True,
                        generator=torch.Generator().manual_seed(4), persistent_workers=False)
    model = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for epoch in range(2):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    print(json.dumps({"device": str(next(model.parameters()).device), "losses": losses,
                      "batch_device": str(x.device), "weight_sum": model[0].weight.sum().item()}))


if __name__ == "__main__":
    main()
