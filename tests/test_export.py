"""``torch.export`` while active: a CPU model exports as usual; a model on 'cuda' is refused
with a clear error instead of the C++ abort that would end the process (autograd metadata for a
CUDA fake tensor on a CPU-only torch). Run in a fresh interpreter, so a regression is a failed
test, not a killed test run."""
from __future__ import annotations

import textwrap

from conftest import run_python


def test_export_of_a_cuda_model_is_refused_and_the_process_goes_on(gateway):
    code = textwrap.dedent("""
        import torch, remotecuda
        remotecuda.activate()
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        ep = torch.export.export(m, (torch.ones(2, 4),))
        assert ep.module()(torch.ones(2, 4)).shape == (2, 4)
        m.cuda()
        for inputs in ((torch.ones(2, 4, device='cuda'),), (torch.ones(2, 4),)):
            try:
                torch.export.export(m, inputs)
            except NotImplementedError as e:
                assert "remotecuda: torch.export.export of a model or inputs on 'cuda'" in str(e), e
                print("REFUSED")
        print(m(torch.ones(2, 4, device='cuda')).sum().item() >= 0)
    """)
    r = run_python(code, env={"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_FALLBACK": "error"})
    assert r.returncode == 0 and r.stdout.split() == ["REFUSED", "REFUSED", "True"], (r.stdout, r.stderr[-2000:])
