"""Jagged nested tensors (``torch.nested``, ``layout=torch.jagged``) on 'cuda' against the local
CPU: built from 'cuda' parts or moved there, pointwise ops, layers, reductions, attention,
gradients, and what a GPU answers about their device."""
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
    packed = narrowed.contiguous()  # (torch builds new offsets with torch.zeros(device=values.device))
    return [*nt.unbind(), nt.to_padded_tensor(-1.0), *narrowed.unbind(), *packed.unbind(), packed.offsets(),
            *cpu_parts.unbind()]


@case
def moved_to_the_device_and_back(dev):
    nt = torch.nested.nested_tensor([_data(3, 4), _data(2, 4, seed=1)], layout=torch.jagged)
    moved = nt.to(dev)
    back = moved.cpu()
    return [*(moved * 3).unbind(), *back.unbind(), back.offsets()]


class _PackedAttention(nn.Module):
    """The nested-tensor transformer tutorial's attention: one packed projection, heads split off
    the jagged (batch, ragged, embed) input, SDPA on (batch, heads, ragged, dim)."""

    def __init__(self, embed: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(embed, 3 * embed), nn.Linear(embed, embed)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().unflatten(-1, [self.heads, -1]).transpose(1, 2)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if memory is not None:
            _, k, v = self.qkv(memory).chunk(3, dim=-1)
        attended = F.scaled_dot_product_attention(self.split(q), self.split(k), self.split(v))
        return self.out(attended.transpose(1, 2).flatten(-2))


@case
def attention_over_jagged_sequences(dev):
    torch.manual_seed(0)
    attention = _PackedAttention(8, 2).to(dev)
    x = torch.nested.nested_tensor([_data(3, 8), _data(5, 8, seed=1), _data(1, 8, seed=2)], layout=torch.jagged,
                                   device=dev, requires_grad=True)
    memory = torch.nested.nested_tensor([_data(2, 8, seed=3), _data(4, 8, seed=4), _data(6, 8, seed=5)],
                                        layout=torch.jagged, device=dev)
    out = x + attention(x)  # (a residual: the output keeps the query's ragged size)
    out.values().pow(2).sum().backward()
    return [*out.unbind(), *attention(x, memory).unbind(), x.grad.values(), *(p.grad for p in attention.parameters())]


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


def test_jagged_attention_with_a_mask_says_what_to_do():
    q = _jagged("cuda").unflatten(-1, [2, 2]).transpose(1, 2)
    with pytest.raises(NotImplementedError, match="remotecuda: .*attn_mask.*to_padded_tensor"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(2, 2, device="cuda", dtype=torch.bool))


@pytest.mark.parametrize("make", [
    lambda: torch.nested.nested_tensor([_data(2, 3).cuda(), _data(1, 3).cuda()]),
    lambda: torch.nested.nested_tensor([_data(2, 3), _data(1, 3)], device="cuda"),
    lambda: torch.nested.nested_tensor([_data(2, 3), _data(1, 3)]).cuda()])
def test_a_strided_nested_tensor_on_cuda_says_to_use_the_jagged_layout(make):
    """torch.nested's default layout has no remote form: the refusal names remotecuda and the way
    out (it said 'PyTorch is not linked with support for cuda devices', or came from the gateway)."""
    with pytest.raises(NotImplementedError, match=r"remotecuda: .*strided layout.*layout=torch\.jagged"):
        make()
