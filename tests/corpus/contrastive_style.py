"""pytorch/examples siamese_network and a SimCLR loop, shrunk: a shared CNN tower scored with
BCEWithLogits on pairs, an NT-Xent (InfoNCE) loss over two augmented views made on the device
(random crops by roll, flips, noise from a CPU generator), and fast_neural_style's losses
(normalize_batch with new_tensor, Gram matrices, InstanceNorm + ReflectionPad + upsampling)."""

import json

import torch
import torch.nn as nn
import torch.nn.functional as F

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 8, 3),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Sequential(nn.Linear(16, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
        self.proj = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward_once(self, x):
        return self.cnn(x)

    def forward(self, a, b):
        return self.fc(torch.cat((self.forward_once(a), self.forward_once(b)), 1))


def nt_xent(z1, z2, tau=0.5):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = z @ z.T / tau
    n = z1.shape[0]
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), float("-inf"))
    labels = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, labels)


def augment(x, gen):
    shifts = torch.randint(-2, 3, (2,), generator=gen).tolist()
    x = torch.roll(x, shifts=shifts, dims=(2, 3))
    if torch.rand(1, generator=gen).item() < 0.5:
        x = torch.flip(x, dims=[3])
    return x + 0.05 * torch.randn(x.shape, generator=gen).to(x.device)


model = Tower().to(device)
opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
imgs = torch.rand(16, 1, 10, 10, generator=g)
same = torch.randint(0, 2, (8,), generator=g).float()
log = {"siamese": [], "simclr": []}
for epoch in range(2):
    model.train()
    a, b = imgs[:8].to(device), imgs[8:].to(device)
    out = model(a, b).squeeze()
    loss = nn.BCEWithLogitsLoss()(out, same.to(device))
    opt.zero_grad()
    loss.backward()
    opt.step()
    x = imgs.to(device)
    z1, z2 = model.proj(model.forward_once(augment(x, g))), model.proj(model.forward_once(augment(x, g)))
    closs = nt_xent(z1, z2)
    opt.zero_grad()
    closs.backward()
    opt.step()
    sched.step()
    log["siamese"].append(loss.item())
    log["simclr"].append(closs.item())
    model.eval()
    with torch.no_grad():
        acc = ((torch.sigmoid(model(a, b).squeeze()) > 0.5).float() == same.to(device)).sum().item()
    log.setdefault("acc", []).append(acc)


class TransformerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Sequential(
            nn.ReflectionPad2d(1), nn.Conv2d(3, 8, 3, stride=2), nn.InstanceNorm2d(8, affine=True), nn.ReLU()
        )
        self.up = nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), nn.ReflectionPad2d(1), nn.Conv2d(8, 3, 3))

    def forward(self, x):
        return self.up(self.c1(x))


def normalize_batch(batch):
    mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    return (batch.div_(255.0) - mean) / std


def gram_matrix(y):
    b, ch, h, w = y.size()
    features = y.view(b, ch, w * h)
    return features.bmm(features.transpose(1, 2)) / (ch * h * w)


features = (
    nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
    .to(device)
    .requires_grad_(False)
)
tnet = TransformerNet().to(device)
opt = torch.optim.Adam(tnet.parameters(), 1e-3)
style = normalize_batch(torch.rand(1, 3, 8, 8, generator=g).mul(255).to(device))
gram_style = gram_matrix(features(style))
mse = nn.MSELoss()
for i in range(2):
    x = torch.rand(2, 3, 8, 8, generator=g).mul(255).to(device)
    y = normalize_batch(tnet(x))
    xn = normalize_batch(x)
    fy, fx = features(y), features(xn)
    content_loss = 1e5 * mse(fy, fx)
    style_loss = 1e10 * mse(gram_matrix(fy), gram_style.expand(2, -1, -1))
    total = content_loss + style_loss
    opt.zero_grad()
    total.backward()
    opt.step()
    log.setdefault("style", []).append([content_loss.item(), style_loss.item()])
log["device"] = str(x.device)
print(json.dumps(log))
