"""A user's tensor subclass of a 'cuda' tensor sees what torch shows it of a GPU's.

Each test compares a subclass of a local CPU tensor with one of a 'cuda' tensor and fails without
its fix."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils.collate import default_collate_fn_map

from conftest import LoggedSubclass

pytestmark = pytest.mark.usefixtures("remote")


def _save_and_load(t: torch.Tensor) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


#: what torch hands to a subclass's __torch_function__ first: its property getters (``__get__``),
#: ``__deepcopy__`` (refused for a subclass without ``new_empty``, here as on any device),
#: ``__reduce_ex__`` (pickle, torch.save), all of which remotecuda's own versions ran without it, or
#: with its internal calls in sight (``detach``, ``cpu``... of torch.save's fetch; ``t.data``'s ``_base``);
#: and a CPU subclass's ``device`` or ``get_device()`` while active, which showed it remotecuda's
#: own ``is_meta`` read too
_READS = {
    "device": lambda t: t.device,
    "is_cuda": lambda t: t.is_cuda,
    "is_cpu": lambda t: t.is_cpu,
    "is_meta": lambda t: t.is_meta,
    "data": lambda t: t.data,
    "deepcopy": copy.deepcopy,
    "get_device": lambda t: t.get_device(),
    "reduce_ex": lambda t: t.__reduce_ex__(2),
    "torch.save": _save_and_load,
}


def _seen(t: torch.Tensor, call) -> tuple[list[str], str | None]:
    LoggedSubclass.seen.clear()
    try:
        call(t)
    except RuntimeError as e:
        return list(LoggedSubclass.seen), str(e)
    return list(LoggedSubclass.seen), None


@pytest.mark.parametrize("name", list(_READS))
def test_a_subclass_torch_function_sees_what_it_sees_on_any_device(name):
    local = torch.tensor([1.0, 2.0, 3.0]).as_subclass(LoggedSubclass)
    remote = torch.tensor([1.0, 2.0, 3.0], device="cuda").as_subclass(LoggedSubclass)
    assert _seen(remote, _READS[name]) == _seen(local, _READS[name])


def test_subclass_reads_answer_for_cuda_and_round_trip():
    remote = torch.tensor([1.0, 2.0, 3.0], device="cuda").as_subclass(LoggedSubclass)
    identity = (remote.device, remote.is_cuda, remote.is_cpu, remote.is_meta)
    assert identity == (torch.device("cuda", 0), True, False, False)
    for back in (_save_and_load(remote), pickle.loads(pickle.dumps(remote))):
        assert type(back).__name__ == "LoggedSubclass" and isinstance(back, LoggedSubclass)
        assert back.device.type == "cuda"
        assert back.cpu().tolist() == [1.0, 2.0, 3.0]


def test_unpickling_a_subclass_shows_it_what_it_shows_on_any_device():
    """pickle.loads of a 'cuda' subclass showed it the ``to`` that moved its CPU copy to 'cuda' (and
    pickle.dumps its copy's ``__reduce_ex__``): torch's default ``__torch_function__`` had made the
    copy inside the reduction the subclass's class."""
    def seen(device):
        t = torch.tensor([1.0, 2.0], device=device).as_subclass(LoggedSubclass)
        t.tag = "kept"
        LoggedSubclass.seen.clear()
        data = pickle.dumps(t)
        dumped, _ = list(LoggedSubclass.seen), LoggedSubclass.seen.clear()
        back = pickle.loads(data)
        loaded = list(LoggedSubclass.seen)
        assert type(back).__name__ == "LoggedSubclass" and back.tag == "kept" and back.device.type == device
        assert back.cpu().tolist() == [1.0, 2.0]
        return dumped, loaded

    assert seen("cuda") == seen("cpu") == (["__reduce_ex__"], [])


class _Tagged(torch.Tensor):
    """A library's subclass with a collate function of its own in torch's table (MONAI's MetaTensor)."""


def _collate_tagged(batch, *, collate_fn_map=None):
    out = torch.stack(batch)
    out.batched_from = len(batch)
    return out


@pytest.fixture
def tagged_collate():
    table = default_collate_fn_map
    table[_Tagged] = _collate_tagged
    yield
    del table[_Tagged]


@pytest.mark.usefixtures("tagged_collate")
@pytest.mark.parametrize("nested", [False, True], ids=["tensors", "dicts"])
def test_default_collate_finds_a_subclass_by_its_exact_type(nested):
    # torch looks the table up by the exact type first: a 'cuda' _Tagged (of a class made from it and
    # remotecuda's) fell to the table's first isinstance match, torch.Tensor's plain stack
    def batch(device):
        items = [torch.full((2,), float(i), device=device).as_subclass(_Tagged) for i in range(3)]
        return [{"image": t} for t in items] if nested else items

    local, remote = default_collate(batch("cpu")), default_collate(batch("cuda"))
    if nested:
        local, remote = local["image"], remote["image"]
    assert isinstance(remote, _Tagged) and remote.device.type == "cuda"
    assert getattr(remote, "batched_from", None) == local.batched_from == 3
    assert torch.equal(remote.cpu(), local.as_subclass(torch.Tensor))
