"""pytorch/examples vae, shrunk: an MLP VAE on random binary "images". The reparameterisation
noise comes from a seeded CPU generator so that the result does not depend on the device's RNG."""
import json

import torch
from torch import nn, optim
from torch.nn import functional as F

device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
torch.manual_seed(1)
noise = torch.Generator().manual_seed(2)


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc21 = nn.Linear(32, 4)
        self.fc22 = nn.Linear(32, 4)
        self.fc3 = nn.Linear(4, 32)
        self.fc4 = nn.Linear(32, 64)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn(std.shape, generator=noise).to(std.device)
        return mu + eps * std

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 64))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def loss_function(recon_x, x, mu, logvar):
    bce = F.binary_cross_entropy(recon_x, x.view(-1, 64), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


model = VAE().to(device)
optimizer = optim.Adam(model.parameters(), lr=1e-3)
data = (torch.rand(48, 1, 8, 8, generator=torch.Generator().manual_seed(3)) > 0.5).float()
losses = []
model.train()
for epoch in range(2):
    for i in range(0, len(data), 16):
        x = data[i:i + 16].to(device)
        optimizer.zero_grad()
        recon, mu, logvar = model(x)
        loss = loss_function(recon, x, mu, logvar)
        loss.backward()
        optimizer.step()
        losses.append(loss.item() / len(x))
model.eval()
with torch.no_grad():
    sample = model.decode(torch.randn(4, 4, generator=noise).to(device)).cpu()
print(json.dumps({"device": str(next(model.parameters()).device), "losses": losses,
                  "sample": sample[:, :6].tolist(), "fc4_sum": model.fc4.weight.sum().item()}))
