"""Programs in the style of pytorch/examples and the PyTorch tutorials, pasted unchanged onto
'cuda' (synthetic data, no torchvision). Each runs on the local CPU and through the gateway,
with weights made on the CPU from the same seed, and must give the same values."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

CASES: dict[str, Callable[[str], torch.Tensor]] = {}


def case(fn: Callable[[str], torch.Tensor]) -> Callable:
    CASES[fn.__name__] = fn
    return fn


def _data(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


class _Residual(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.body = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3), nn.InstanceNorm2d(c, affine=True),
                                  nn.ReLU(), nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3),
                                  nn.InstanceNorm2d(c, affine=True))

    def forward(self, x):
        return x + self.body(x)


def _gram(y: torch.Tensor) -> torch.Tensor:
    b, ch, h, w = y.size()
    f = y.view(b, ch, w * h)
    return f.bmm(f.transpose(1, 2)) / (ch * h * w)


@case
def fast_neural_style_two_steps(dev):
    torch.manual_seed(0)
    net = nn.Sequential(nn.ReflectionPad2d(4), nn.Conv2d(3, 8, 9), nn.InstanceNorm2d(8, affine=True), nn.ReLU(),
                        _Residual(8), nn.Upsample(scale_factor=2, mode="nearest"), nn.ReflectionPad2d(1),
                        nn.Conv2d(8, 3, 3, stride=2)).to(dev)
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    x, style = _data(2, 3, 16, 16).to(dev), _gram(_data(1, 3, 16, 16, seed=1)).to(dev)
    for _ in range(2):
        opt.zero_grad()
        y = net(x)
        loss = F.mse_loss(y, x) + 1e5 * F.mse_loss(_gram(y), style.expand(2, -1, -1))
        loss.backward()
        opt.step()
    return net(x)


@case
def super_resolution_pixel_shuffle(dev):
    torch.manual_seed(0)
    conv = nn.Conv2d(1, 4, 3, padding=1)
    nn.init.orthogonal_(conv.weight, nn.init.calculate_gain("relu"))
    m = nn.Sequential(conv, nn.ReLU(), nn.PixelShuffle(2)).to(dev)
    out = m(_data(2, 1, 6, 6).to(dev))
    F.mse_loss(out, torch.zeros_like(out)).backward()
    return torch.cat([out.flatten(), conv.weight.grad.flatten()])


@case
def siamese_losses(dev):
    a, b = _data(6, 8).to(dev), _data(6, 8, seed=1).to(dev)
    target = torch.tensor([1, -1, 1, -1, 1, 1], device=dev, dtype=torch.float)
    d = nn.PairwiseDistance()(a, b)
    contrastive = ((target + 1) / 2 * d.pow(2) + (1 - target) / 2 * F.relu(1.0 - d).pow(2)).mean()
    return torch.stack([contrastive, nn.CosineEmbeddingLoss(margin=0.2)(a, b, target),
                        nn.BCEWithLogitsLoss()(d, (target > 0).float())])


@case
def time_sequence_lbfgs(dev):
    torch.manual_seed(0)
    cell1, cell2 = nn.LSTMCell(1, 8).double().to(dev), nn.LSTMCell(8, 8).double().to(dev)
    lin = nn.Linear(8, 1).double().to(dev)
    data = torch.sin(torch.arange(12, dtype=torch.float64).view(1, 12).repeat(3, 1) / 3 + _data(3, 1)).to(dev)
    params = [*cell1.parameters(), *cell2.parameters(), *lin.parameters()]

    def forward(inp, future=0):
        h1 = c1 = h2 = c2 = torch.zeros(inp.size(0), 8, dtype=torch.double, device=inp.device)
        outputs = []
        for x in inp.split(1, dim=1):
            h1, c1 = cell1(x, (h1, c1))
            h2, c2 = cell2(h1, (h2, c2))
            outputs.append(lin(h2))
        for _ in range(future):
            h1, c1 = cell1(outputs[-1], (h1, c1))
            h2, c2 = cell2(h1, (h2, c2))
            outputs.append(lin(h2))
        return torch.cat(outputs, dim=1)

    opt = torch.optim.LBFGS(params, lr=0.8, max_iter=4)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(forward(data[:, :-1]), data[:, 1:])
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return forward(data[:, :-1], future=3)


@case
def simclr_nt_xent(dev):
    z = F.normalize(_data(8, 16).to(dev), dim=1)
    sim = z @ z.T / 0.5
    sim = sim.masked_fill(torch.eye(8, dtype=torch.bool, device=dev), -9e15)
    labels = (torch.arange(8, device=dev) + 4) % 8
    return F.cross_entropy(sim, labels)


def _time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-torch.arange(half, device=t.device) * (torch.log(torch.tensor(10000.0)) / (half - 1)))
    args = t[:, None].float() * freqs[None]
    return torch.cat([args.sin(), args.cos()], dim=-1)


@case
def ddpm_train_step(dev):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv2d(8, 1, 3, padding=1))
    net = net.to(dev)
    betas = torch.linspace(1e-4, 0.02, 10, device=dev)
    alphas_bar = torch.cumprod(1 - betas, dim=0)
    x0, noise = _data(4, 1, 8, 8).to(dev), _data(4, 1, 8, 8, seed=1).to(dev)
    t = torch.tensor([0, 3, 7, 9], device=dev)
    a = alphas_bar.gather(-1, t).view(-1, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
    emb = _time_embedding(t, 64).view(4, 1, 8, 8)
    loss = F.mse_loss(net(torch.cat([xt, emb], 1)), noise)
    loss.backward()
    return torch.cat([loss.view(1), net[0].weight.grad.flatten()])


@case
def transformer_greedy_decode(dev):
    torch.manual_seed(0)
    emb, gen = nn.Embedding(12, 16).to(dev), nn.Linear(16, 12).to(dev)
    model = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True).to(dev).eval()
    src = torch.tensor([[3, 5, 7, 1, 0]], device=dev)
    memory = model.encoder(emb(src), src_key_padding_mask=src == 0)
    ys = torch.tensor([[2]], device=dev)
    for _ in range(5):
        mask = nn.Transformer.generate_square_subsequent_mask(ys.size(1), device=dev)
        out = model.decoder(emb(ys), memory, tgt_mask=mask, memory_key_padding_mask=src == 0)
        nxt = gen(out[:, -1]).argmax(dim=-1).item()
        ys = torch.cat([ys, torch.tensor([[nxt]], device=dev)], dim=1)
    return ys


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_program_matches_local(remote, name):
    fn = CASES[name]
    got, want = fn("cuda"), fn("cpu")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


def test_transformer_encoder_fast_path_with_a_padding_mask(remote):
    """Under no_grad the eval encoder packs a padded batch into a nested tensor (which does not
    cross the wire): remotecuda keeps it dense, and its padded positions are zeros as the nested
    path leaves them (they held the layers' values, and a mean over all positions differed)."""
    def encode(dev):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).to(dev).eval()
        x = torch.randn(3, 6, 16).to(dev)
        pad = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool).to(dev)
        with torch.no_grad():
            return enc(x, src_key_padding_mask=pad).cpu(), pad.cpu()
    (got, _), (want, _) = encode("cuda"), encode("cpu")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
