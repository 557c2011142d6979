"""Two memory tutorials on a device: "How to save memory by fusing the optimizer step into the
backward pass" (one optimizer per parameter, stepped from
``register_post_accumulate_grad_hook``), and "Hooks for saved tensors" (``saved_tensors_hooks``
packing activations to the CPU and back, ``save_on_cpu(pin_memory=True)``), with
``torch.autograd.graph.register_multi_grad_hook`` counting the gradients that arrived."""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
gen = torch.Generator().manual_seed(5)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4)).to(device)


xs = [torch.randn(6, 8, generator=gen).to(device) for _ in range(3)]
ys = [torch.randn(6, 4, generator=gen).to(device) for _ in range(3)]

# the reference: one optimizer, stepped after backward
ref = make_model()
opt = torch.optim.Adam(ref.parameters(), lr=0.01)
ref_losses = []
for x, y in zip(xs, ys):
    loss = F.mse_loss(ref(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    ref_losses.append(loss.item())

# the optimizer fused into backward
model = make_model()
optimizer_dict = {p: torch.optim.Adam([p], lr=0.01, foreach=False) for p in model.parameters()}


def optimizer_hook(parameter) -> None:
    optimizer_dict[parameter].step()
    optimizer_dict[parameter].zero_grad()


for p in model.parameters():
    p.register_post_accumulate_grad_hook(optimizer_hook)
fused_losses = []
for x, y in zip(xs, ys):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    fused_losses.append(loss.item())
grads_left = [p.grad is None for p in model.parameters()]
max_param_diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))

# saved tensors hooks
packed = []
packed_devices = set()


def pack_hook(t):
    packed.append(list(t.shape))
    packed_devices.add(str(t.device))
    return t.device, t.cpu()


def unpack_hook(saved):
    dev, t = saved
    return t.to(dev)


net = make_model()
x = xs[0].clone().requires_grad_(True)
with torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook):
    out = net(x).pow(2).sum()
out.backward()
hooked = [x.grad.sum().item(), net[0].weight.grad.sum().item()]
net.zero_grad()
x.grad = None
with torch.autograd.graph.save_on_cpu(pin_memory=True):
    out2 = net(x).pow(2).sum()
out2.backward()
on_cpu = [x.grad.sum().item(), net[0].weight.grad.sum().item()]

arrived = []
a = torch.ones(3, device=device, requires_grad=True)
b = torch.full((3,), 2.0, device=device, requires_grad=True)
handle = torch.autograd.graph.register_multi_grad_hook(
    (a, b), lambda grads: arrived.append([g is not None for g in grads]))
(a * b).sum().backward()
(a * 3).sum().backward()
handle.remove()
print(json.dumps({
    "ref_losses": ref_losses, "fused_losses": fused_losses, "grads_left": grads_left,
    "max_param_diff": max_param_diff, "packed": packed, "packed_device": ",".join(sorted(packed_devices)),
    "hooked": hooked, "on_cpu": on_cpu,
    "arrived": arrived, "a_grad": a.grad.cpu().tolist(), "device": str(a.device),
}))
