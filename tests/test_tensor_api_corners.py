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


class Logged(torch.Tensor):
    """A tagged tensor whose ``__torch_function__`` records what it is called with, as a units
    library's or MONAI's hook dispatches on the function."""

    seen: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", repr(func)))
        return super().__torch_function__(func, types, args, kwargs)


def _routed_methods(dev: str) -> list:
    base = torch.arange(6.).reshape(2, 3)
    calls = {
        "copy_": lambda t: t.copy_(torch.ones(2, 3, device=dev)),
        "new_zeros": lambda t: t.new_zeros(3),
        "new_full": lambda t: t.new_full((2,), 5.),
        "new_tensor": lambda t: t.new_tensor([1., 2.]),
        "new": lambda t: t.new(2),
        "__setitem__": lambda t: t.__setitem__(0, 7.),
        "type_as": lambda t: t.type_as(torch.ones(1, dtype=torch.float64, device=dev)),
        "to": lambda t: t.to(torch.float16),
    }
    got = []
    for name, call in calls.items():
        t = base.clone().to(dev).as_subclass(Logged)
        Logged.seen = []
        r = call(t)
        got.append((name, type(r).__name__, list(Logged.seen), t.as_subclass(torch.Tensor).cpu().tolist()))
    return got


def test_a_subclass_hook_sees_the_routed_tensor_methods_as_on_the_cpu():
    """Tensor methods remotecuda routes in Python (``new_tensor``, ``type_as``, ``__setitem__``...)
    skipped the ``__torch_function__`` of a subclass, which torch's C++ method calls first:
    ``sub.new_tensor(data)`` was a plain tensor, ``type_as`` reached the hook as ``to``, and the
    hook saw the routes' own reads (``dtype``) as calls of its own."""
    assert _routed_methods("cuda") == _routed_methods("cpu")
