"""Two compact architectures as their reference single-file implementations write them:
a Mamba language model (johnma2006/mamba-minimal's style: in_proj split, depthwise causal
Conv1d with padding cropped, softplus dt, a sequential selective scan over einsum-discretized
A and B, RMSNorm, tied head) and a KAN (Blealtan/efficient-kan's style: B-spline bases from
interval masks and the Cox-de Boor recursion, base + spline weights, spline scalers,
curve2coeff by least squares and update_grid from sorted activations, regularization loss)."""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MambaBlock(nn.Module):
    def __init__(self, d_model, d_state=4, expand=2, d_conv=4):
        super().__init__()
        self.d_inner = expand * d_model
        self.dt_rank = math.ceil(d_model / 16)
        self.in_proj = nn.Linear(d_model, self.d_inner * 2, bias=False)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + d_state * 2, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        A = torch.arange(1, d_state + 1).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def forward(self, x):
        b, length, d = x.shape
        x_and_res = self.in_proj(x)
        x, res = x_and_res.split(split_size=[self.d_inner, self.d_inner], dim=-1)
        x = x.transpose(1, 2)  # rearrange 'b l d_in -> b d_in l'
        x = self.conv1d(x)[:, :, :length]
        x = F.silu(x.transpose(1, 2))
        y = self.ssm(x)
        return self.out_proj(y * F.silu(res))

    def ssm(self, x):
        d_in, n = self.A_log.shape
        A = -torch.exp(self.A_log.float())
        D = self.D.float()
        delta, B, C = self.x_proj(x).split(split_size=[self.dt_rank, n, n], dim=-1)
        delta = F.softplus(self.dt_proj(delta))
        return self.selective_scan(x, delta, A, B, C, D)

    def selective_scan(self, u, delta, A, B, C, D):
        b, length, d_in = u.shape
        deltaA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
        deltaB_u = torch.einsum("bld,bln,bld->bldn", delta, B, u)
        x = torch.zeros((b, d_in, A.shape[1]), device=deltaA.device)
        ys = []
        for i in range(length):
            x = deltaA[:, i] * x + deltaB_u[:, i]
            ys.append(torch.einsum("bdn,bn->bd", x, C[:, i, :]))
        return torch.stack(ys, dim=1) + u * D


class Mamba(nn.Module):
    def __init__(self, vocab=32, d_model=16, n_layer=2):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(mixer=MambaBlock(d_model), norm=RMSNorm(d_model)))
                                    for _ in range(n_layer))
        self.norm_f = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, ids):
        x = self.embedding(ids)
        for layer in self.layers:
            x = layer["mixer"](layer["norm"](x)) + x
        return self.lm_head(self.norm_f(x))


class KANLinear(nn.Module):
    def __init__(self, in_f, out_f, grid_size=5, spline_order=3, scale_noise=0.1, scale_base=1.0,
                 scale_spline=1.0, grid_eps=0.02, grid_range=(-1, 1)):
        super().__init__()
        self.in_features, self.out_features = in_f, out_f
        self.grid_size, self.spline_order = grid_size, spline_order
        h = (grid_range[1] - grid_range[0]) / grid_size
        grid = ((torch.arange(-spline_order, grid_size + spline_order + 1) * h + grid_range[0])
                .expand(in_f, -1).contiguous())
        self.register_buffer("grid", grid)
        self.base_weight = nn.Parameter(torch.empty(out_f, in_f))
        self.spline_weight = nn.Parameter(torch.empty(out_f, in_f, grid_size + spline_order))
        self.spline_scaler = nn.Parameter(torch.empty(out_f, in_f))
        self.scale_noise, self.scale_base, self.scale_spline = scale_noise, scale_base, scale_spline
        self.grid_eps = grid_eps
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.kaiming_uniform_(self.base_weight, a=math.sqrt(5) * self.scale_base)
        with torch.no_grad():
            noise = (torch.rand(self.grid_size + 1, self.in_features, self.out_features) - 0.5) \
                * self.scale_noise / self.grid_size
            self.spline_weight.data.copy_(self.curve2coeff(self.grid.T[self.spline_order:-self.spline_order], noise))
            nn.init.kaiming_uniform_(self.spline_scaler, a=math.sqrt(5) * self.scale_spline)

    def b_splines(self, x):
        grid = self.grid
        x = x.unsqueeze(-1)
        bases = ((x >= grid[:, :-1]) & (x < grid[:, 1:])).to(x.dtype)
        for k in range(1, self.spline_order + 1):
            bases = ((x - grid[:, :-(k + 1)]) / (grid[:, k:-1] - grid[:, :-(k + 1)]) * bases[:, :, :-1]) \
                + ((grid[:, k + 1:] - x) / (grid[:, k + 1:] - grid[:, 1:(-k)]) * bases[:, :, 1:])
        return bases.contiguous()

    def curve2coeff(self, x, y):
        A = self.b_splines(x).transpose(0, 1)
        B = y.transpose(0, 1)
        solution = torch.linalg.lstsq(A, B).solution
        return solution.permute(2, 0, 1).contiguous()

    @property
    def scaled_spline_weight(self):
        return self.spline_weight * self.spline_scaler.unsqueeze(-1)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        base = F.linear(F.silu(x), self.base_weight)
        spline = F.linear(self.b_splines(x).view(x.size(0), -1),
                          self.scaled_spline_weight.view(self.out_features, -1))
        return (base + spline).reshape(*shape[:-1], self.out_features)

    @torch.no_grad()
    def update_grid(self, x, margin=0.01):
        batch = x.size(0)
        splines = self.b_splines(x).permute(1, 0, 2)
        orig = self.scaled_spline_weight.permute(1, 2, 0)
        unreduced = torch.bmm(splines, orig).permute(1, 0, 2)
        x_sorted = torch.sort(x, dim=0)[0]
        grid_adaptive = x_sorted[torch.linspace(0, batch - 1, self.grid_size + 1, dtype=torch.int64, device=x.device)]
        uniform_step = (x_sorted[-1] - x_sorted[0] + 2 * margin) / self.grid_size
        grid_uniform = (torch.arange(self.grid_size + 1, dtype=torch.float32, device=x.device).unsqueeze(1)
                        * uniform_step + x_sorted[0] - margin)
        grid = self.grid_eps * grid_uniform + (1 - self.grid_eps) * grid_adaptive
        grid = torch.concatenate([
            grid[:1] - uniform_step * torch.arange(self.spline_order, 0, -1, device=x.device).unsqueeze(1),
            grid,
            grid[-1:] + uniform_step * torch.arange(1, self.spline_order + 1, device=x.device).unsqueeze(1)], dim=0)
        self.grid.copy_(grid.T)
        self.spline_weight.data.copy_(self.curve2coeff(x, unreduced))

    def regularization_loss(self, act=1.0, ent=1.0):
        l1 = self.spline_weight.abs().mean(-1)
        reg_act = l1.sum()
        p = l1 / reg_act
        return act * reg_act + ent * -torch.sum(p * p.log())


result = {}
torch.manual_seed(1)
mamba = Mamba().to(device)
opt = torch.optim.AdamW(mamba.parameters(), lr=3e-3)
ids = torch.randint(0, 32, (4, 12))
xb, yb = ids[:, :-1].to(device), ids[:, 1:].to(device)
losses = []
for _ in range(4):
    logits = mamba(xb)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), yb.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
with torch.no_grad():
    seq = xb[:1, :3]
    for _ in range(5):
        nxt = mamba(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
result["mamba"] = {"losses": losses, "tokens": seq[0].tolist(), "device": str(logits.device)}

torch.manual_seed(2)
kan = nn.Sequential(KANLinear(2, 5), KANLinear(5, 1)).to(device)
opt = torch.optim.LBFGS(kan.parameters(), lr=1, history_size=5, max_iter=4)
X = (torch.rand(64, 2) * 2 - 1)
Y = torch.sin(math.pi * X[:, :1]) * X[:, 1:] ** 2
X, Y = X.to(device), Y.to(device)
klosses = []
for step in range(3):
    if step == 1:
        h = X
        for layer in kan:
            layer.update_grid(h)
            h = layer(h)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(kan(X), Y) + 1e-3 * sum(layer.regularization_loss() for layer in kan)
        loss.backward()
        return loss
    klosses.append(opt.step(closure).item())
# (not the coefficients themselves: lstsq's driver is gelsy on the CPU, gels on a GPU, and the CPU's
# own differ from run to run in the last digits)
result["kan"] = {"losses": klosses, "grid": kan[0].grid[0].tolist(), "device": str(kan[0].grid.device)}
print(json.dumps(result))
