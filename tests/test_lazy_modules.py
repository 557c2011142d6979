"""Lazy modules moved to 'cuda' before their first forward pass (``nn.LazyLinear``, PyG's
``GCNConv(-1, ...)``): were refused; now they name 'cuda', materialize there at the first forward
(on the device's generator, as on a GPU) and then compute what the same weights compute locally."""
from __future__ import annotations

import copy

import pytest
import torch
from local_parity import data

pytestmark = pytest.mark.usefixtures("remote")


def _lazy_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.LazyLinear(6), torch.nn.ReLU(), torch.nn.LazyBatchNorm1d(),
                               torch.nn.Linear(6, 2))


def _local_twin(trained: torch.nn.Module, make: type | object, *inputs: torch.Tensor) -> torch.nn.Module:
    twin = make()  # type: ignore[operator]
    with torch.no_grad():
        twin(*inputs)  # materialized here, then given the same values
    twin.load_state_dict({k: v.cpu() for k, v in trained.state_dict().items()})
    return twin


def test_a_lazy_model_moved_before_its_first_forward_trains_on_cuda():
    torch.manual_seed(0)
    m = _lazy_mlp().cuda()
    assert all(p.device.type == "cuda" and p.is_cuda for p in m.parameters())
    x = data(5, 3)
    start = None
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # built before the parameters have a shape
    for step in range(2):
        out = m(x.cuda())
        if step == 0:
            assert type(m[0]) is torch.nn.Linear and m[0].weight.shape == (6, 3)
            assert all(isinstance(p, torch.nn.Parameter) and p.device.type == "cuda" for p in m.parameters())
            assert m[2].running_mean.device.type == "cuda"
            start = _local_twin(m, _lazy_mlp, x)
            local_opt = torch.optim.SGD(start.parameters(), lr=0.1)
        want = start(x)
        torch.testing.assert_close(out.cpu(), want)
        out.square().sum().backward()
        want.square().sum().backward()
        opt.step()
        local_opt.step()
        opt.zero_grad()
        local_opt.zero_grad()
    for p, q in zip(m.parameters(), start.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach())


def test_lazy_device_cuda_deepcopy_and_back_to_the_cpu():
    made = torch.nn.LazyLinear(3, device="cuda")
    assert made.weight.device == torch.device("cuda", 0)
    assert made(torch.ones(2, 5, device="cuda")).device.type == "cuda"
    twin = copy.deepcopy(torch.nn.LazyLinear(3).cuda())
    assert twin(torch.ones(2, 4, device="cuda")).device.type == "cuda"
    for back in (lambda m: m.cpu(), lambda m: m.to("cpu")):
        m = back(torch.nn.LazyLinear(3).cuda())
        assert m.weight.device.type == "cpu"
        assert m(torch.ones(2, 5)).device.type == "cpu" and m.weight.device.type == "cpu"


def test_pyg_lazy_convs_in_a_hetero_model_on_cuda():
    """PyG's heterogeneous-graph idiom: ``(-1, -1)`` input sizes, the model moved to 'cuda', then
    initialized by a forward pass under ``torch.no_grad()``."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.data import HeteroData
    from torch_geometric.nn import GCNConv, HeteroConv, SAGEConv

    g = torch.Generator().manual_seed(0)
    graph = HeteroData()
    graph["paper"].x = torch.randn(12, 8, generator=g)
    graph["author"].x = torch.randn(6, 5, generator=g)
    graph["author", "writes", "paper"].edge_index = torch.stack(
        [torch.randint(0, 6, (20,), generator=g), torch.randint(0, 12, (20,), generator=g)])
    graph["paper", "cites", "paper"].edge_index = torch.randint(0, 12, (2, 30), generator=g)

    def make() -> torch.nn.Module:
        return HeteroConv({("author", "writes", "paper"): SAGEConv((-1, -1), 4),
                           ("paper", "cites", "paper"): GCNConv(-1, 4)}, aggr="sum")

    torch.manual_seed(0)
    model = make().to("cuda")
    assert next(model.parameters()).device.type == "cuda"
    remote = graph.clone().to("cuda")  # (PyG moves a graph in place)
    with torch.no_grad():
        model(remote.x_dict, remote.edge_index_dict)
    local = _local_twin(model, make, graph.x_dict, graph.edge_index_dict)
    got = model(remote.x_dict, remote.edge_index_dict)["paper"]
    want = local(graph.x_dict, graph.edge_index_dict)["paper"]
    torch.testing.assert_close(got.cpu(), want)
    got.sum().backward()
    want.sum().backward()
    for p, q in zip(model.parameters(), local.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad)
