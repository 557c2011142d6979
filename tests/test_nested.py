"""Jagged nested tensors (``torch.nested``, ``layout=torch.jagged``) on 'cuda' against the local
CPU: built from 'cuda' parts or moved there, pointwise ops, layers, reductions, gradients, and
what a GPU's answers about their device."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from local_parity import assert_matches_local, registry
from local_parity import data as _data
from torch import nn

pytestmark = pytest.mark.usefixtures("remote")
CASES, case = registry()


def _jagged(dev: str, requires_grad: bool = False) -> torch.Tensor:
    parts = [_data(3, 4).to(dev), _data(5, 4, seed=1).to(dev)]
    return torch.nested.nested_tensor(parts, layout=torch.jagged, device=dev, requires_grad=requires_grad)


@case
def pointwise_padding_and_reductions(dev):
    nt = _jagged(dev)
    out = (nt * 2 + 1).sin()
    return [*out.unbind(), out.to_padded_tensor(0.0), nt.offsets(), nt.mean(dim=1), nt.softmax(-1).values(),
            nt.sum(-1).values(), nt.values()]


@case
def layers_with_gradients(dev):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.LayerNorm(6), nn.Linear(6, 2)).to(dev)
    nt = _jagged(dev, requires_grad=True)
    out = model(nt)
    out.values().pow(2).sum().backward()
    return [*out.unbind(), nt.grad.values(), *(p.grad for p in model.parameters())]


@case
def built_from_values_and_offsets(dev):
    values, offsets = _data(7, 4).to(dev), torch.tensor([0, 3, 7], device=dev)
    nt = torch.nested.nested_tensor_from_jagged(values, offsets)
    narrowed = torch.nested.narrow(_data(3, 6).to(dev), 1, torch.tensor([0, 1, 2], device=dev),
                                   torch.tensor([3, 2, 4], device=dev), layout=torch.jagged)
    cpu_parts = torch.nested.nested_tensor([_data(2, 4), _data(1, 4, seed=2)], layout=torch.jagged, device=dev)
    return [*nt.unbind(), nt.to_padded_tensor(-1.0), *narrowed.unbind(), *cpu_parts.unbind()]


@case
def moved_to_the_device_and_back(dev):
    nt = torch.nested.nested_tensor([_data(3, 4), _data(2, 4, seed=1)], layout=torch.jagged)
    moved = nt.to(dev)
    back = moved.cpu()
    return [*(moved * 3).unbind(), *back.unbind(), back.offsets()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_jagged_program_matches_local(name):
    assert_matches_local(CASES[name])


def test_a_jagged_tensor_says_it_is_on_cuda():
    """Its C++ device is its parts' (meta, for remote ones): it answers with theirs, as on a GPU."""
    nt = _jagged("cuda", requires_grad=True)
    moved = torch.nested.nested_tensor([_data(2, 4)], layout=torch.jagged).cuda()
    for t in (nt, moved, F.relu(nt), nt.transpose(1, 2)):
        assert t.is_nested and t.layout is torch.jagged
        assert t.device == torch.device("cuda", 0) and t.is_cuda and t.get_device() == 0
