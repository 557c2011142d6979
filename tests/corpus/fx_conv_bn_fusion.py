"""The PyTorch tutorial "(beta) Building a Convolution/Batch Norm fuser in FX", on a device: a
model on 'cuda' traced with ``torch.fx.symbolic_trace``, each conv followed by a batch norm fused
by ``fuse_conv_bn_eval`` into the graph, the graph linted and recompiled, and an FX Interpreter
that records each node's output shape; the fused model must give the unfused one's outputs."""
import copy
import json

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.nn.utils.fusion import fuse_conv_bn_eval

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)


class WrappedBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.mod = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.mod(x)


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.nested = nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1))
        self.wrapped = WrappedBatchNorm()

    def forward(self, x):
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.conv2(x)
        x = self.nested(x)
        x = self.wrapped(x)
        return torch.relu(x).mean(dim=(2, 3))


def _parent_name(target):
    *parent, name = target.rsplit(".", 1)
    return parent[0] if parent else "", name


def replace_node_module(node, modules, new_module):
    assert isinstance(node.target, str)
    parent_name, name = _parent_name(node.target)
    setattr(modules[parent_name], name, new_module)


def fuse(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model)
    fx_model: fx.GraphModule = fx.symbolic_trace(model)
    modules = dict(fx_model.named_modules())
    for node in fx_model.graph.nodes:
        if node.op != "call_module":
            continue
        if type(modules[node.target]) is nn.BatchNorm2d and type(modules[node.args[0].target]) is nn.Conv2d:
            if len(node.args[0].users) > 1:
                continue
            conv = modules[node.args[0].target]
            bn = modules[node.target]
            fused_conv = fuse_conv_bn_eval(conv, bn)
            replace_node_module(node.args[0], modules, fused_conv)
            node.replace_all_uses_with(node.args[0])
            fx_model.graph.erase_node(node)
    fx_model.graph.lint()
    fx_model.recompile()
    return fx_model


model = M().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1)
for _ in range(3):  # give the batch norms running statistics and non-trivial affine parameters
    x = torch.randn(4, 3, 10, 10, generator=gen).to(device)
    loss = model(x).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
model.eval()
fused = fuse(model)
inp = torch.randn(5, 3, 10, 10, generator=gen).to(device)
ref, out = model(inp), fused(inp)
ShapeProp(fused).propagate(inp)
shapes = {n.name: list(n.meta["tensor_meta"].shape) for n in fused.graph.nodes if "tensor_meta" in n.meta}
print(json.dumps({
    "unfused": ref.detach().cpu().tolist(),
    "fused": out.detach().cpu().tolist(),
    "max_diff": (ref - out).abs().max().item(),
    "modules": sorted(type(m).__name__ for _, m in fused.named_children()),
    "nodes": [n.op for n in fused.graph.nodes],
    "shapes": shapes,
    "running_var": model.bn1.running_var.cpu().tolist(),
    "device": str(out.device),
    "fused_weight_device": str(fused.conv1.weight.device),
}))
