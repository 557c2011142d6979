"""Small gaps that earlier rounds left alone: each test fails without its fix.

The thread tests run in a fresh interpreter, as the program's threads must exist before it activates."""
from __future__ import annotations

import textwrap

from conftest import run_python


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

