"""A Fourier neural operator as neuraloperator's tutorials write its SpectralConv2d (complex
``nn.Parameter`` weights, ``torch.fft.rfft2``/``irfft2``, ``torch.einsum`` on complex tensors,
the kept modes written into a zeros ``cfloat`` tensor by slices), trained with Adam and a relative
L2 loss, checkpointed through ``torch.save`` with its complex weights (and their
``view_as_real``/``view_as_complex`` round trip); then a spectral solver in complex128: Poisson's
equation by ``fft2`` and wavenumbers from ``fftfreq``, and a split-step Schrödinger propagator
whose norm must stay 1."""
import io
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)


class SpectralConv2d(nn.Module):
    def __init__(self, in_channels, out_channels, modes1, modes2):
        super().__init__()
        self.out_channels, self.modes1, self.modes2 = out_channels, modes1, modes2
        self.scale = 1 / (in_channels * out_channels)
        self.weights1 = nn.Parameter(self.scale * torch.rand(in_channels, out_channels, modes1, modes2,
                                                             dtype=torch.cfloat))
        self.weights2 = nn.Parameter(self.scale * torch.rand(in_channels, out_channels, modes1, modes2,
                                                             dtype=torch.cfloat))

    def compl_mul2d(self, input, weights):
        return torch.einsum("bixy,ioxy->boxy", input, weights)

    def forward(self, x):
        batchsize = x.shape[0]
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(batchsize, self.out_channels, x.size(-2), x.size(-1) // 2 + 1, dtype=torch.cfloat,
                             device=x.device)
        out_ft[:, :, :self.modes1, :self.modes2] = self.compl_mul2d(x_ft[:, :, :self.modes1, :self.modes2],
                                                                    self.weights1)
        out_ft[:, :, -self.modes1:, :self.modes2] = self.compl_mul2d(x_ft[:, :, -self.modes1:, :self.modes2],
                                                                     self.weights2)
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))


class FNO2d(nn.Module):
    def __init__(self, modes=4, width=8):
        super().__init__()
        self.fc0 = nn.Linear(3, width)
        self.convs = nn.ModuleList(SpectralConv2d(width, width, modes, modes) for _ in range(2))
        self.ws = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(2))
        self.fc1, self.fc2 = nn.Linear(width, 16), nn.Linear(16, 1)

    def get_grid(self, shape, device):
        b, sx, sy = shape[0], shape[1], shape[2]
        gridx = torch.linspace(0, 1, sx, dtype=torch.float).reshape(1, sx, 1, 1).repeat([b, 1, sy, 1])
        gridy = torch.linspace(0, 1, sy, dtype=torch.float).reshape(1, 1, sy, 1).repeat([b, sx, 1, 1])
        return torch.cat((gridx, gridy), dim=-1).to(device)

    def forward(self, x):
        x = torch.cat((x, self.get_grid(x.shape, x.device)), dim=-1)
        x = self.fc0(x).permute(0, 3, 1, 2)
        for i, (conv, w) in enumerate(zip(self.convs, self.ws)):
            x = conv(x) + w(x)
            if i < len(self.convs) - 1:
                x = F.gelu(x)
        return self.fc2(F.gelu(self.fc1(x.permute(0, 2, 3, 1))))


def rel_l2(pred, y):
    b = pred.shape[0]
    return (torch.norm(pred.reshape(b, -1) - y.reshape(b, -1), 2, 1) / torch.norm(y.reshape(b, -1), 2, 1)).sum()


n = 16
a = torch.randn(8, n, n, 1, generator=g)
u = torch.fft.irfft2(torch.fft.rfft2(a.squeeze(-1)) / (1 + torch.arange(n // 2 + 1) ** 2), s=(n, n)).unsqueeze(-1)
a, u = a.to(device), u.to(device)
model = FNO2d().to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
losses = []
for epoch in range(4):
    for i in range(0, 8, 4):
        opt.zero_grad()
        loss = rel_l2(model(a[i:i + 4]), u[i:i + 4])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    sched.step()

buf = io.BytesIO()
torch.save(model.state_dict(), buf)
buf.seek(0)
restored = FNO2d().to(device)
restored.load_state_dict(torch.load(buf, map_location=device))
w = restored.convs[0].weights1
as_real = torch.view_as_real(w.detach())
with torch.no_grad():
    same = torch.equal(restored(a[:2]), model(a[:2]))

# Poisson: -lap(phi) = rho, periodic, complex128 spectra
L = 2 * math.pi
x = torch.arange(n, dtype=torch.float64, device=device) * L / n
X, Y = torch.meshgrid(x, x, indexing="ij")
rho = torch.sin(X) * torch.cos(2 * Y)
k = torch.fft.fftfreq(n, d=L / n / (2 * math.pi)).to(device=device, dtype=torch.float64)
KX, KY = torch.meshgrid(k, k, indexing="ij")
k2 = KX ** 2 + KY ** 2
k2[0, 0] = 1.0
phi_hat = torch.fft.fft2(rho.to(torch.complex128)) / k2
phi_hat[0, 0] = 0
phi = torch.fft.ifft2(phi_hat).real
poisson_err = (phi - rho / 5).abs().max().item()

# split-step Fourier for i psi_t = -0.5 psi_xx + V psi
xs = torch.linspace(-8, 8, 64, dtype=torch.float64, device=device)
dx = (xs[1] - xs[0]).item()
kk = 2 * math.pi * torch.fft.fftfreq(64, d=dx).to(device)
psi = torch.exp(-(xs - 1) ** 2).to(torch.complex128) * torch.exp(1j * 2 * xs)
psi = psi / torch.sqrt((psi.abs() ** 2).sum() * dx)
V = 0.5 * xs ** 2
dt = 0.01
half_v = torch.exp(-0.5j * dt * V)
kinetic = torch.exp(-0.5j * dt * kk ** 2)
for _ in range(20):
    psi = half_v * torch.fft.ifft(kinetic * torch.fft.fft(half_v * psi))
norm = ((psi.abs() ** 2).sum() * dx).item()
mean_x = ((psi.conj() * xs * psi).real.sum() * dx).item()

print(json.dumps({
    "losses": losses,
    "w_real": as_real[0, 0].flatten().tolist(),
    "w_roundtrip": torch.equal(torch.view_as_complex(as_real), w.detach()),
    "w_dtype": str(w.dtype), "restored_same": same,
    "w_grad_abs": model.convs[0].weights1.grad.abs().sum().item(),
    "poisson_err": poisson_err, "phi": phi[3, :4].tolist(),
    "norm": norm, "mean_x": mean_x, "psi_dtype": str(psi.dtype),
    "device": str(a.device),
}))
