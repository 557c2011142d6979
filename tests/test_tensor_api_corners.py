"""Corners of the Tensor API on 'cuda' that real code meets: a tensor subclass's
``__torch_function__`` on the Tensor methods remotecuda routes itself, a library that copies a
tensor's whole ``__dict__`` (MONAI's ``MetaTensor``), torch's deepcopy of a plain subclass, and
``out=`` tensors of ops whose output size depends on the data. Each is compared with the same
code on the local CPU."""
from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.usefixtures("remote")


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.cpu().tolist()


def _data_dependent_outs(dev: str) -> list:
    m = torch.tensor([[1., 0, 2], [0, 3, 0]], device=dev)
    got = []
    for out in (torch.empty(0, dtype=torch.long, device=dev), torch.empty(7, 2, dtype=torch.long, device=dev)):
        assert torch.nonzero(m, out=out) is out
        got.append(_layout(out))
    for out in (torch.empty(0, device=dev), torch.empty(5, device=dev)):
        assert torch.masked_select(m, m > 0, out=out) is out
        got.append(_layout(out))
    out = torch.empty(0, dtype=torch.long, device=dev)
    torch.nonzero(m.t(), out=out)
    got.append(_layout(out))
    return got


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_out_of_a_data_dependent_op_takes_the_size_the_data_gives():
    """``torch.nonzero(m, out=o)``, ``torch.masked_select(x, mask, out=o)``: the gateway resized
    ``o`` to the op's result, but the client's tensor kept its old shape (``(0,)``, or the wrong
    size it was given), so ``o.shape`` was wrong while its values were the result's."""
    assert _data_dependent_outs("cuda") == _data_dependent_outs("cpu")
