"""Notebooks as users run them: real kernels (jupyter_client) on a real gateway, each workflow
compared with what a plain python3 kernel does on the CPU, or a GPU does."""
from __future__ import annotations

import time

import pytest

from conftest import wait_for

pytest.importorskip("jupyter_client")
from test_jupyter import (  # noqa: E402 - the kernel helpers, after jupyter_client is known
    START_TIMEOUT,
    Kernel,
    gateway_sessions,
    jgw,  # noqa: F401 - fixtures (module-scoped: a gateway of this module's own)
    kernel_dirs,  # noqa: F401 - fixtures
    kernel_env,  # noqa: F401
    kernelspec_prefix,  # noqa: F401
)

#: seconds of remote work a cell leaves queued when it is interrupted: long enough that waiting
#: for it shows, short enough for a test
BACKLOG_SECONDS = 4.0


@pytest.fixture(scope="module")
def rc(kernel_dirs, kernel_env):  # noqa: F811
    k = Kernel("remotecuda", kernel_dirs, kernel_env)
    yield k
    k.stop()


def _queue_backlog(k: Kernel) -> int:
    """Define ``h``, ``m``, ``count`` in the kernel, and ``N``: how many ``tanh(h @ m)`` steps make
    about BACKLOG_SECONDS of the gateway's work (timed there, so a loaded machine makes N smaller)."""
    r = k.ok("import time, torch\nm = torch.randn(768, 768, device='cuda') / 28\nh = m.clone()\n"
             "count = torch.zeros((), device='cuda')\n(h @ m).sum().item()\nt0 = time.perf_counter()\n"
             "for _ in range(20):\n    h = torch.tanh(h @ m)\n    count += 1\n"
             f"count.item()\nN = max(50, int(20 * {BACKLOG_SECONDS} / (time.perf_counter() - t0)))\nprint(N)")
    return int(r["stdout"])


def _interrupt(k: Kernel, msg_id: str, mark: str) -> tuple[dict, float]:
    """Interrupt the cell once it printed ``mark``: its reply, and how long it took to come."""
    k.wait_stream(msg_id, mark, 60)
    t0 = time.monotonic()
    k.km.interrupt_kernel()
    r = k.collect(msg_id, timeout=30)
    return r, time.monotonic() - t0


def test_an_interrupted_cell_returns_at_once_and_its_queued_work_runs_on(rc):
    """As on a GPU, an interrupted cell ends at once with KeyboardInterrupt and the work it launched
    before the interrupt finishes in the background: the next cell's ops run after it, so tensors
    changed in place hold every update issued before the interrupt. (The cell waited for all of it.)"""
    n = _queue_backlog(rc)
    msg_id = rc.send("count.zero_()\nfor _ in range(N):\n    h = torch.tanh(h @ m)\n    count += 1\n"
                     "print('queued', flush=True)\ntime.sleep(120)")
    r, elapsed = _interrupt(rc, msg_id, "queued")
    assert r["reply"]["status"] == "error" and r["reply"]["ename"] == "KeyboardInterrupt", r["reply"]
    assert elapsed < BACKLOG_SECONDS / 2, f"the interrupted cell ended {elapsed:.1f} s after the interrupt"
    assert "runs on in the background" in r["stderr"], r["stderr"]
    t0 = time.monotonic()
    assert rc.ok("print('next')")["stdout"] == "next\n"  # a cell without remote work runs now
    assert time.monotonic() - t0 < BACKLOG_SECONDS / 2
    r = rc.ok("print(int(count.item()))")  # after the work queued before the interrupt: all of it
    assert int(r["stdout"]) == n, (r, n)


def test_an_interrupt_while_a_cell_waits_for_its_remote_work_leaves_it_running(rc):
    """An interrupt that lands in the end-of-cell wait (the cell's Python is done) ends the cell at
    once too, with the work left running rather than dropped (it dropped the rest of the queue, and
    the tensors the cell changed in place kept an arbitrary part of its updates)."""
    n = _queue_backlog(rc)
    msg_id = rc.send("count.zero_()\nfor _ in range(N):\n    h = torch.tanh(h @ m)\n    count += 1\n"
                     "print('queued', flush=True)")
    r, elapsed = _interrupt(rc, msg_id, "queued")
    assert r["reply"]["ename"] == "KeyboardInterrupt", r["reply"]
    assert elapsed < BACKLOG_SECONDS / 2, f"the interrupted cell ended {elapsed:.1f} s after the interrupt"
    r = rc.ok("print(int(count.item()))")
    assert int(r["stdout"]) == n, (r, n)


def test_remotecuda_cancel_drops_the_work_an_interrupted_cell_left_running(rc):
    """``%remotecuda cancel``: the way out of a long backlog that a GPU does not offer (its launch
    queue holds a second of work; the gateway's, RUN_AHEAD ops): what it was to compute is marked
    never computed, tensors it was to change in place keep their earlier values."""
    n = _queue_backlog(rc)
    msg_id = rc.send("count.zero_()\nfor _ in range(N):\n    h = torch.tanh(h @ m)\n    count += 1\n"
                     "print('queued', flush=True)\ntime.sleep(120)")
    r, _ = _interrupt(rc, msg_id, "queued")
    assert r["reply"]["ename"] == "KeyboardInterrupt", r["reply"]
    t0 = time.monotonic()
    r = rc.ok("%remotecuda cancel")
    assert time.monotonic() - t0 < BACKLOG_SECONDS / 2
    assert "dropped" in r["stdout"], r
    r = rc.ok("print(int(count.item()) < N)")  # (what ran before the cancel, not all)
    assert r["stdout"] == "True\n", (r, n)
    r = rc.run("h.sum().item()")
    assert r["reply"]["status"] == "error" and "never computed" in r["reply"]["evalue"], r["reply"]
    assert rc.ok("print(torch.ones(3, device='cuda').sum().item())")["stdout"] == "3.0\n"
    assert rc.ok("%remotecuda cancel")["stdout"].startswith("remotecuda: nothing"), "idle: nothing to drop"


def test_two_kernels_on_one_gateway_and_a_restart_of_a_busy_one(rc, jgw, kernel_dirs, kernel_env):  # noqa: F811
    """Two notebooks on one gateway have a session each and never see each other's tensors; one
    restarted while its interrupted cell's work still runs frees its session (BYE: the worker
    process, with its memory, goes) without disturbing the other."""
    other = Kernel("remotecuda", kernel_dirs, kernel_env)
    try:
        rc.ok("import torch\nx = torch.full((4,), 1., device='cuda')")
        other.ok("import torch\nx = torch.full((4,), 2., device='cuda')")
        assert rc.ok("x += 1\nprint(x.sum().item())")["stdout"] == "8.0\n"
        assert other.ok("print(x.sum().item())")["stdout"] == "8.0\n"
        n = gateway_sessions(jgw.address)
        msg_id = other.send("import time\nm = torch.randn(1024, 1024, device='cuda') / 32\nh = m\n"
                            "for _ in range(40):\n    h = torch.tanh(h @ m)\nprint('queued', flush=True)\n"
                            "time.sleep(120)")
        r, _ = _interrupt(other, msg_id, "queued")
        assert r["reply"]["ename"] == "KeyboardInterrupt", r["reply"]
        other.km.restart_kernel(now=False)
        other.kc.wait_for_ready(timeout=START_TIMEOUT)
        assert wait_for(lambda: gateway_sessions(jgw.address) == n - 1, 20), gateway_sessions(jgw.address)
        assert rc.ok("print(x.sum().item())")["stdout"] == "8.0\n"
        r = other.ok("import torch\nprint('x' in dir(), torch.ones(2, device='cuda').sum().item())")
        assert r["stdout"] == "False 2.0\n", r
    finally:
        other.stop()


@pytest.fixture(scope="module")
def plain(kernel_env):  # noqa: F811
    k = Kernel("python3", [], kernel_env)
    yield k
    k.stop()


def test_load_ext_after_a_cpu_model_was_built_then_reload_keeps_the_cuda_tensors(plain):
    """A notebook that imported torch and built a model and its optimizer on the CPU, then loads the
    extension and moves them: the steps' losses are the CPU's. ``%reload_ext remotecuda`` (which
    IPython suggests to whoever runs ``%load_ext remotecuda`` twice) keeps the sessions: it closed
    them, and every 'cuda' tensor of the notebook, the model's parameters too, was gone for good."""
    plain.ok("import copy, torch\ntorch.manual_seed(0)\n"
             "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
             "opt = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
             "x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))\n"
             "ref = copy.deepcopy(model)\nref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)\n"
             "def train(model, opt, x, y):\n    for _ in range(3):\n"
             "        loss = torch.nn.functional.cross_entropy(model(x), y)\n"
             "        opt.zero_grad()\n        loss.backward()\n        opt.step()\n    return loss.item()\n"
             "expected = train(ref, ref_opt, x, y)")
    plain.ok("%load_ext remotecuda")
    r = plain.ok("model.cuda()\nxc, yc = x.cuda(), y.cuda()\nloss = train(model, opt, xc, yc)\n"
                 "print(loss == expected, opt.state[model[0].weight]['exp_avg'].device)")
    assert r["stdout"] == "True cuda:0\n", r
    assert "already loaded" in plain.ok("%load_ext remotecuda")["stdout"]
    plain.ok("%reload_ext remotecuda")
    r = plain.ok("print(torch.equal(model(xc).cpu(), ref(x)), torch.cuda.is_available())")
    assert r["stdout"] == "True True\n", r
    r = plain.ok("%remotecuda last")  # the reloaded extension accounts the cells
    assert "ok" in r["stdout"], r
    plain.ok("%unload_ext remotecuda")
    assert plain.ok("print(torch.cuda.is_available())")["stdout"] == "False\n"


def test_a_remote_error_met_showing_the_cells_value_is_the_cells_error(rc):
    """A cell whose last expression fails on the gateway (``t[bad_index]``) meets the error when
    IPython shows the value: ipykernel then failed the cell but named no error in its reply
    ("NoneType: None", what nbclient and papermill report), where locally it is the IndexError."""
    r = rc.run("import torch\nt = torch.zeros(2, device='cuda')\nt[torch.tensor([5], device='cuda')]")
    assert r["reply"]["status"] == "error", r["reply"]
    assert r["reply"]["ename"] == "IndexError" and "index 5 is out of bounds" in r["reply"]["evalue"], r["reply"]
    assert len(r["errors"]) == 1 and not r["results"], r
    assert rc.ok("print(t.sum().item())")["stdout"] == "0.0\n"  # the next cell starts clean
