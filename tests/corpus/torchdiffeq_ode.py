"""torchdiffeq's ode_demo, shrunk: fit a neural ODE to a spiral with odeint (dopri5, adaptive
steps) and odeint_adjoint (the adjoint backward), and a time-dependent event."""

import json

import torch
import torch.nn as nn
import torch.optim as optim
from torchdiffeq import odeint, odeint_adjoint, odeint_event

device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
true_y0 = torch.tensor([[2.0, 0.0]]).to(device)
t = torch.linspace(0.0, 2.0, 20).to(device)
true_A = torch.tensor([[-0.1, 2.0], [-2.0, -0.1]]).to(device)


class Lambda(nn.Module):
    def forward(self, t, y):
        return torch.mm(y**3, true_A)


with torch.no_grad():
    true_y = odeint(Lambda(), true_y0, t, method="dopri5")


def get_batch(g):
    s = torch.from_numpy(torch.randperm(20 - 5, generator=g)[:4].numpy())
    batch_y0 = true_y[s]
    batch_t = t[:5]
    batch_y = torch.stack([true_y[s + i] for i in range(5)], dim=0)
    return batch_y0.to(device), batch_t.to(device), batch_y.to(device)


class ODEFunc(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))
        for m in self.net.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0, std=0.1)
                nn.init.constant_(m.bias, val=0)

    def forward(self, t, y):
        return self.net(y**3)


out = {}
for name, solve in (("odeint", odeint), ("adjoint", odeint_adjoint)):
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(2)
    func = ODEFunc().to(device)
    optimizer = optim.RMSprop(func.parameters(), lr=1e-3)
    losses = []
    for itr in range(3):
        optimizer.zero_grad()
        batch_y0, batch_t, batch_y = get_batch(g)
        pred_y = solve(func, batch_y0, batch_t, rtol=1e-5, atol=1e-6).to(device)
        loss = torch.mean(torch.abs(pred_y - batch_y))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        pred_y = solve(func, true_y0, t, method="rk4", options=dict(step_size=0.1))
    out[name] = {
        "losses": losses,
        "final": torch.mean(torch.abs(pred_y - true_y)).item(),
        "w_sum": func.net[0].weight.sum().item(),
    }


def event_fn(t, y):  # a ball falling: the event is y[0] reaching 0
    return y[..., 0]


def fall(t, y):
    return torch.stack([y[..., 1], torch.full_like(y[..., 1], -9.81)], -1)


event_t, solution = odeint_event(
    fall,
    torch.tensor([10.0, 0.0], device=device),
    torch.tensor(0.0, device=device),
    event_fn=event_fn,
    reverse_time=False,
    atol=1e-8,
    rtol=1e-8,
    odeint_interface=odeint,
)
out["event_t"] = event_t.item()
out["device"] = str(true_y.device)
print(json.dumps(out))
