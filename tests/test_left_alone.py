"""Small gaps that earlier rounds left alone: each test fails without its fix.

The thread tests run in a fresh interpreter, as the program's threads must exist before it activates."""
from __future__ import annotations

import textwrap

import pytest
import torch

from conftest import LoggedSubclass, run_python


def _run(gateway, code: str) -> str:
    r = run_python(textwrap.dedent(code), env={"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_FALLBACK": "error"})
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-3000:]
    return r.stdout


_TRAIN = """
    import torch
    from concurrent.futures import ThreadPoolExecutor

    def train(device):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)  # (before the move: the same parameters train)
        m.to(device)
        x = torch.randn(4, 3).to(device)
        for _ in range(2):
            opt.zero_grad()
            (m(x) + torch.ones(2, device=device)).square().sum().backward()
            opt.step()
        return m.weight.device.type, m.weight.detach().cpu()

    pool = ThreadPoolExecutor(1)
    local = pool.submit(train, 'cpu').result()  # the pool's thread starts now, before activation
"""


def test_thread_started_before_activation_runs_cuda(gateway):
    # a GPU is every thread's once CUDA is initialized: a pool made (and used) before activate()
    # runs 'cuda' work as threads started afterwards do, where the CPU build refused it
    _run(gateway, _TRAIN + """
    import remotecuda
    remotecuda.activate()
    kind, w = pool.submit(train, 'cuda').result()
    assert kind == 'cuda' and torch.equal(w, local[1]), (kind, w, local)
    print('OK')
    """)


def test_thread_started_before_activation_follows_reactivation(gateway):
    # the thread keeps the mode it took: plain PyTorch after deactivate(), the new activation's after
    # the next activate() (a pool outlives activations, as a notebook's does)
    _run(gateway, _TRAIN + """
    import remotecuda
    remotecuda.activate()
    assert pool.submit(train, 'cuda').result()[0] == 'cuda'
    remotecuda.deactivate()
    assert pool.submit(lambda: torch.ones(2).add(1).tolist()).result() == [2.0, 2.0]
    try:
        pool.submit(torch.ones, 2, device='cuda').result()
    except (AssertionError, RuntimeError) as e:
        assert 'remotecuda' not in str(e), e
    else:
        raise SystemExit('cuda after deactivate()')
    remotecuda.activate()
    kind, w = pool.submit(train, 'cuda').result()
    assert kind == 'cuda' and torch.equal(w, local[1]), (kind, w, local)
    print('OK')
    """)


@pytest.mark.usefixtures("remote")
@pytest.mark.parametrize("call", [
    lambda x, i: torch.tensor_split(x, i),
    lambda x, i: x.tensor_split(i, 1),
    lambda x, i: torch.tensor_split(x, tensor_indices_or_sections=i),
])
@pytest.mark.parametrize("split", [torch.tensor([1, 2]), torch.tensor(2)])
def test_tensor_split_refuses_cuda_indices_naming_cuda(call, split):
    # C++ reads the indices or sections on the host and names their device, a wrapper's 'meta'
    x = torch.arange(12.0).reshape(3, 4)
    want = "tensor_split expected tensor_indices_or_sections to be on cpu, but it's on cuda:0"
    with pytest.raises(RuntimeError) as e:
        call(x.cuda(), split.cuda())
    assert str(e.value) == want
    got = [t.cpu() for t in call(x.cuda(), split)]  # (indices on the CPU, as torch wants them)
    assert all(torch.equal(g, w) for g, w in zip(got, call(x, split), strict=True))
    with pytest.raises(RuntimeError, match="expected at least a 1-dimensional tensor"):  # (its first check stays first)
        torch.tensor_split(torch.tensor(1.0, device="cuda"), split.cuda())


_METHODS = {
    "tolist": lambda t: t.tolist(),
    "data_ptr": lambda t: t.data_ptr(),
    "repr": repr,
    "format": lambda t: f"{t[0]:.2f}",  # (torch formats a subclass's 0-d tensor as an object: refused)
    "type": lambda t: t.type(),
    "is_pinned": lambda t: t.is_pinned(),
    "untyped_storage": lambda t: t.untyped_storage(),
    "is_shared": lambda t: t.is_shared(),
    "share_memory_": lambda t: t.share_memory_(),
    "dlpack": lambda t: t.__dlpack__(),
}


def _seen(t: torch.Tensor, call) -> list[str] | str:
    LoggedSubclass.seen.clear()
    try:
        call(t)
    except TypeError as e:
        return str(e)
    return list(dict.fromkeys(LoggedSubclass.seen))


@pytest.mark.usefixtures("remote")
@pytest.mark.parametrize("name", list(_METHODS))
def test_remote_tensor_methods_call_a_subclass_torch_function_first(name):
    # torch hands these to a subclass's __torch_function__ before it runs them (C++ bindings,
    # torch/_tensor.py's checks); RemoteTensor's own versions ran without it
    local = torch.tensor([1.0, 2.0, 3.0]).as_subclass(LoggedSubclass)
    remote = torch.tensor([1.0, 2.0, 3.0], device="cuda").as_subclass(LoggedSubclass)
    assert _seen(remote, _METHODS[name]) == _seen(local, _METHODS[name])
