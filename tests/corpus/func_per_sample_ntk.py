"""The torch.func tutorials on a device: per-sample gradients (``functional_call``, ``grad``,
``vmap`` with ``in_dims=(None, None, 0, 0)``) checked against a loop of backward passes, model
ensembling (``stack_module_state`` over a meta base model), and the empirical neural tangent
kernel (``jacrev`` under ``vmap``, contracted with ``einsum``, and as ``jvp`` of ``vjp``)."""
import copy
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, jacrev, jvp, stack_module_state, vjp, vmap

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
gen = torch.Generator().manual_seed(1)


class SimpleCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.fc1 = nn.Linear(8 * 2 * 2, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def loss_fn(predictions, targets):
    return F.nll_loss(predictions, targets)


batch_size = 6
data = torch.randn(batch_size, 1, 8, 8, generator=gen).to(device)
targets = torch.randint(10, (batch_size,), generator=gen).to(device)
model = SimpleCNN().to(device=device)


def compute_grad(sample, target):
    sample = sample.unsqueeze(0)
    target = target.unsqueeze(0)
    prediction = model(sample)
    loss = loss_fn(prediction, target)
    return torch.autograd.grad(loss, list(model.parameters()))


def compute_sample_grads(data, targets):
    sample_grads = [compute_grad(data[i], targets[i]) for i in range(batch_size)]
    sample_grads = zip(*sample_grads)
    return [torch.stack(shards) for shards in sample_grads]


per_sample_grads = compute_sample_grads(data, targets)
params = {k: v.detach() for k, v in model.named_parameters()}
buffers = {k: v.detach() for k, v in model.named_buffers()}


def compute_loss(params, buffers, sample, target):
    batch = sample.unsqueeze(0)
    targets = target.unsqueeze(0)
    predictions = functional_call(model, (params, buffers), (batch,))
    return loss_fn(predictions, targets)


ft_compute_grad = grad(compute_loss)
ft_compute_sample_grad = vmap(ft_compute_grad, in_dims=(None, None, 0, 0))
ft_per_sample_grads = ft_compute_sample_grad(params, buffers, data, targets)
log = {"per_sample_norms": [g.flatten(1).norm(dim=1).cpu().tolist() for g in per_sample_grads],
       "per_sample_max_diff": max((a - b).abs().max().item()
                                  for a, b in zip(per_sample_grads, ft_per_sample_grads.values()))}

# model ensembling
num_models = 3
models = [nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).to(device) for _ in range(num_models)]
minibatches = torch.randn(num_models, 5, 16, generator=gen).to(device)
predictions_diff_minibatch_loop = [m(minibatches[i]) for i, m in enumerate(models)]
ens_params, ens_buffers = stack_module_state(models)
base_model = copy.deepcopy(models[0]).to("meta")


def fmodel(params, buffers, x):
    return functional_call(base_model, (params, buffers), (x,))


predictions1_vmap = vmap(fmodel)(ens_params, ens_buffers, minibatches)
predictions2_vmap = vmap(fmodel, in_dims=(0, 0, None))(ens_params, ens_buffers, minibatches[0])
log["ensemble_loop"] = torch.stack(predictions_diff_minibatch_loop).sum(-1).cpu().tolist()
log["ensemble_vmap"] = predictions1_vmap.sum(-1).cpu().tolist()
log["ensemble_same_batch"] = predictions2_vmap.sum(-1).cpu().tolist()

# neural tangent kernel
net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(device)
x_train = torch.randn(5, 4, generator=gen).to(device)
x_test = torch.randn(2, 4, generator=gen).to(device)
params = {k: v.detach() for k, v in net.named_parameters()}


def fnet_single(params, x):
    return functional_call(net, params, (x.unsqueeze(0),)).squeeze(0)


def empirical_ntk_jacobian_contraction(fnet_single, params, x1, x2):
    jac1 = vmap(jacrev(fnet_single), (None, 0))(params, x1)
    jac1 = jac1.values()
    jac1 = [j.flatten(2) for j in jac1]
    jac2 = vmap(jacrev(fnet_single), (None, 0))(params, x2)
    jac2 = jac2.values()
    jac2 = [j.flatten(2) for j in jac2]
    result = torch.stack([torch.einsum("Naf,Mbf->NMab", j1, j2) for j1, j2 in zip(jac1, jac2)])
    return result.sum(0)


def empirical_ntk_ntk_vps(func, params, x1, x2, compute="full"):
    def get_ntk(x1, x2):
        def func_x1(params):
            return func(params, x1)

        def func_x2(params):
            return func(params, x2)

        output, vjp_fn = vjp(func_x1, params)

        def get_ntk_slice(vec):
            vjps = vjp_fn(vec)
            _, jvps = jvp(func_x2, (params,), vjps)
            return jvps

        basis = torch.eye(output.numel(), dtype=output.dtype, device=output.device).view(output.numel(), -1)
        return vmap(get_ntk_slice)(basis)

    result = vmap(vmap(get_ntk, (None, 0)), (0, None))(x1, x2)
    if compute == "trace":
        return torch.einsum("NMKK->NM", result)
    return result


ntk1 = empirical_ntk_jacobian_contraction(fnet_single, params, x_train, x_test)
ntk2 = empirical_ntk_ntk_vps(fnet_single, params, x_train, x_test)
log["ntk"] = ntk1.flatten().cpu().tolist()
log["ntk_vps_max_diff"] = (ntk1 - ntk2).abs().max().item()
log["ntk_trace"] = empirical_ntk_ntk_vps(fnet_single, params, x_train, x_test, "trace").cpu().tolist()
log["device"] = str(ntk1.device)
print(json.dumps(log))
