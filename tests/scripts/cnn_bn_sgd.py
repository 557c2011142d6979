"""A small CNN with BatchNorm trained with SGD momentum, then evaluated under no_grad."""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(1)
n = 256
labels = torch.randint(0, 4, (n,))
images = torch.randn(n, 1, 12, 12) * 0.5
for c in range(4):  # a class-dependent bright quadrant makes the task learnable
    m = labels == c
    images[m, 0, (c // 2) * 6:(c // 2) * 6 + 6, (c % 2) * 6:(c % 2) * 6 + 6] += 1.5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 3 * 3, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(torch.flatten(x, 1))


model = Net().cuda() if device == "cuda" else Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
losses = []
for epoch in range(3):
    model.train()
    for i in range(0, n, 32):
        xb, yb = images[i:i + 32].to(device), labels[i:i + 32].to(device)
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    losses.append(loss.item())
model.eval()
with torch.no_grad():
    logits = model(images.to(device))
    acc = (logits.argmax(1) == labels.to(device)).float().mean().item()
    running_mean = model.bn1.running_mean.cpu().tolist()
print(json.dumps({"device": str(logits.device), "losses": losses, "accuracy": acc,
                  "running_mean": running_mean}))
