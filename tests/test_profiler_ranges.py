"""``record_function`` ranges while remotecuda is active (remotecuda/profiler_ranges.py): kept out
of the dispatch mode while no profiler collects, and recorded as plain PyTorch records them while
one does, on a real gateway; the profiles compared with the same program run by plain PyTorch."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from conftest import run_python

pytestmark = pytest.mark.usefixtures("remote")

#: an optimizer step's ranges and user ranges under torch.profiler, the autograd profiler, a
#: range opened before a profiler and closed in it (and the reverse), and a user's dispatch mode
PROGRAM = '''
import torch, torch.nn as nn
from torch.autograd.profiler import record_function
from torch.utils._python_dispatch import TorchDispatchMode

def program(dev):
    torch.manual_seed(0)
    m = nn.Linear(4, 4).to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(2, 4).to(dev)

    def step():
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()

    def ranges(prof):
        return [e.name for e in prof.function_events if e.is_user_annotation or e.name.startswith("profiler::")]

    step()
    out = {}
    with torch.profiler.profile() as p:
        step()
        with record_function("mine", "an arg"):
            pass
    out["kineto"] = ranges(p.profiler)
    with torch.autograd.profiler.profile() as q:
        step()
    out["autograd"] = ranges(q)
    early = record_function("early")
    early.__enter__()
    with torch.profiler.profile() as p:
        late = record_function("late")
        late.__enter__()
        early.__exit__(None, None, None)
    late.__exit__(None, None, None)
    out["across"] = ranges(p.profiler)

    class Seen(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "profiler":
                Seen.ops.append(str(func))
            return func(*args, **(kwargs or {}))
    with Seen():
        with record_function("seen"):
            pass
    out["mode"] = Seen.ops
    return out
'''


def test_profiles_hold_the_ranges_plain_pytorch_records():
    """Under torch.profiler and the autograd profiler an optimizer step's ranges, and a user's,
    are in the profile as plain PyTorch has them; a range entered before the profiler and one
    left after it, too; a user's dispatch mode still sees the range's ops."""
    local = run_python(PROGRAM + "\nimport json\nprint('OUT ' + json.dumps(program('cpu')))")
    assert local.returncode == 0, local.stderr[-3000:]
    expected = json.loads(local.stdout.split("OUT ", 1)[1])
    scope: dict = {}
    exec(PROGRAM, scope)  # noqa: S102 - the same program, here on the gateway
    got = scope["program"]("cuda")
    assert got == expected
    assert "Optimizer.step#SGD.step" in got["kineto"] and "Optimizer.zero_grad#SGD.zero_grad" in got["autograd"]


def test_ranges_no_profiler_collects_do_not_pass_through_the_dispatch_mode(monkeypatch):
    """An optimizer step's two ranges cost a replayed MLP step ~0.15M client instructions when
    their ops went through remotecuda's dispatch mode (benchmarks/RESULTS.md, 2026-12-08)."""
    from remotecuda import interception
    seen = []
    handler = interception.RemoteDispatchMode.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", None) == "profiler":
            seen.append(str(func))
        return handler(self, func, types, args, kwargs)
    monkeypatch.setattr(interception.RemoteDispatchMode, "__torch_dispatch__", spy)
    m = nn.Linear(4, 4).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(2, 4, device="cuda")
    for _ in range(2):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
    with record_function("with args", "an arg") as r:
        fut = r._call_end_callbacks_on_future(torch.futures.Future())
    fut.set_result(1)
    assert fut.wait() == 1
    assert seen == []
    with torch.profiler.profile():
        opt.step()
    assert "profiler._record_function_enter_new.default" in seen  # (while profiling: torch's own path)
