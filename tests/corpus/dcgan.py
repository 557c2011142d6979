"""pytorch/examples dcgan, shrunk to 8x8 images: conv-transpose generator, conv discriminator
with BatchNorm, BCELoss and Adam(betas=(0.5, 0.999)). Noise comes from a seeded CPU generator
so that the result does not depend on the device's RNG."""
import json

import torch
import torch.nn as nn
import torch.optim as optim

device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
torch.manual_seed(999)
nz, ngf, ndf, nc = 8, 8, 8, 1


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


netG = nn.Sequential(
    nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
    nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False), nn.Tanh())
netD = nn.Sequential(
    nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
    nn.Conv2d(ndf, ndf * 2, 3, 1, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
    nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False), nn.Sigmoid(), nn.Flatten(0))
# initialised on the CPU before the move: the device's random numbers are not the CPU's
netG.apply(weights_init).to(device)
netD.apply(weights_init).to(device)

criterion = nn.BCELoss()
gen = torch.Generator().manual_seed(5)
fixed_noise = torch.randn(4, nz, 1, 1, generator=gen).to(device)
real_label, fake_label = 1.0, 0.0
optimizerD = optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
optimizerG = optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
images = torch.rand(24, nc, 8, 8, generator=gen) * 2 - 1

log = []
for i in range(0, len(images), 8):
    real = images[i:i + 8].to(device)
    b = real.size(0)
    netD.zero_grad()
    label = torch.full((b,), real_label, dtype=torch.float, device=device)
    errD_real = criterion(netD(real), label)
    errD_real.backward()
    D_x = netD(real).mean().item()
    fake = netG(torch.randn(b, nz, 1, 1, generator=gen).to(device))
    label.fill_(fake_label)
    output = netD(fake.detach())
    errD_fake = criterion(output, label)
    errD_fake.backward()
    optimizerD.step()
    netG.zero_grad()
    label.fill_(real_label)
    errG = criterion(netD(fake), label)
    errG.backward()
    optimizerG.step()
    log.append([(errD_real + errD_fake).item(), errG.item(), D_x])

with torch.no_grad():
    sample = netG(fixed_noise).detach().cpu()
print(json.dumps({"device": str(next(netG.parameters()).device), "log": log,
                  "sample": sample[0, 0, :2].tolist(),
                  "bn_running_mean": netD[3].running_mean.tolist(),
                  "bn_batches": netD[3].num_batches_tracked.item()}))
