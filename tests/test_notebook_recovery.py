"""Notebooks that go wrong, as users meet it: interrupts, remote errors and out-of-memory in real
kernels (jupyter_client) on a real gateway of this module's own, a simulated GPU whose memory is
enforced; each cell's outcome compared with what a GPU gives."""
from __future__ import annotations

import os
import queue
import time

import pytest

from conftest import GatewayProcess

pytest.importorskip("jupyter_client")
from test_jupyter import (  # noqa: E402 - the kernel helpers, after jupyter_client is known
    ANSI,
    Kernel,
    kernel_dirs,  # noqa: F401 - fixtures
    kernelspec_prefix,  # noqa: F401
)

#: the simulated GPU's memory: small, so that an out-of-memory comes from the gateway's allocator
GPU_MEMORY = 256 * 2**20


@pytest.fixture(scope="module")
def jgw():
    gw = GatewayProcess("--spare", "1", "--gpus", "1", "--gpu-memory", str(GPU_MEMORY))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def kernel_env(jgw):
    env = dict(os.environ, REMOTECUDA_SERVERS=jgw.address, REMOTECUDA_FALLBACK="error", PYTHONUNBUFFERED="1")
    env.pop("REMOTECUDA_SYNC", None)
    return env


def _wait_busy(k: Kernel, msg_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = k.kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "busy"):
            return
    raise TimeoutError("the cell never started")


def test_an_interrupt_while_the_kernel_activates_interrupts_the_first_cell(kernel_dirs, kernel_env):  # noqa: F811
    """The kernel activates at its first execution, importing torch, which makes the first cell slow:
    an interrupt then landed in torch's import, which IPython's event hook printed ("Error in callback
    ... pre_execute") before running the cell anyway on a half-imported torch (SystemError), and the
    kernel never answered again. The interrupt now ends that cell before its first line, as it
    would on a GPU machine, and the kernel is whole: the next cell runs on the gateway."""
    k = Kernel("remotecuda", kernel_dirs, kernel_env)
    try:
        msg_id = k.send("print('ran', flush=True)\nimport torch\nx = torch.ones(2, device='cuda')")
        _wait_busy(k, msg_id)
        time.sleep(0.2)  # inside the activation: torch's import takes seconds
        k.km.interrupt_kernel()
        r = k.collect(msg_id, timeout=60)
        assert r["reply"]["status"] == "error" and r["reply"]["ename"] == "KeyboardInterrupt", r
        assert r["stdout"] == "" and "callback" not in r["stdout"] + r["stderr"], r
        tb = ANSI.sub("", "\n".join(r["errors"][0]["traceback"]))
        assert "----> 1 print('ran', flush=True)" in tb, tb
        r = k.ok("import torch\nprint(torch.cuda.is_available(), torch.ones(2, device='cuda').sum().item())", 60)
        assert r["stdout"] == "True 2.0\n", r
        assert k.ok("print('again')")["stdout"] == "again\n"  # only that cell was interrupted
    finally:
        k.stop()


def test_an_interrupt_while_load_ext_activates_leaves_it_loaded(kernel_env):
    """``%load_ext remotecuda`` in a plain kernel activates there, importing torch: interrupted, the
    cell ends with KeyboardInterrupt once the activation is whole, and 'cuda' works in the next."""
    k = Kernel("python3", [], kernel_env)
    try:
        msg_id = k.send("%load_ext remotecuda")
        _wait_busy(k, msg_id)
        time.sleep(0.2)
        k.km.interrupt_kernel()
        r = k.collect(msg_id, timeout=60)
        assert r["reply"]["ename"] == "KeyboardInterrupt", r["reply"]
        r = k.ok("import torch\nprint(torch.cuda.is_available(), torch.ones(2, device='cuda').sum().item())", 60)
        assert r["stdout"] == "True 2.0\n", r
    finally:
        k.stop()


@pytest.fixture(scope="module")
def rc(kernel_dirs, kernel_env):  # noqa: F811
    k = Kernel("remotecuda", kernel_dirs, kernel_env)
    yield k
    k.stop()


def test_out_of_memory_on_the_gateway_then_free_and_go_on(rc):
    """An allocation the GPU has no room for fails in its cell with torch.cuda.OutOfMemoryError, in
    CUDA's words; the notebook's tensors are intact; ``del`` + ``empty_cache()`` really frees on the
    gateway (``memory_allocated()`` is its allocator's figure), and the allocation then succeeds."""
    mib = 2**20
    rc.ok("import gc, sys, torch\na = torch.ones(32, 1024, 1024, device='cuda')\n"
          "print(torch.cuda.memory_allocated())")
    r = rc.run("b = torch.ones(40, 1024, 1024, device='cuda')")
    assert r["reply"]["ename"] == "OutOfMemoryError", r["reply"]
    assert "CUDA out of memory. Tried to allocate 160.00 MiB" in r["reply"]["evalue"], r["reply"]
    r = rc.ok("print(type(sys.last_value).__name__, a.sum().item(), torch.cuda.memory_allocated())")
    assert r["stdout"] == f"OutOfMemoryError {32 * mib}.0 {128 * mib}\n", r
    r = rc.ok("try:\n    c = torch.ones(40, 1024, 1024, device='cuda'); c.sum().item()\n"
              "except torch.cuda.OutOfMemoryError:\n    print('caught')")  # as on a GPU, catchable
    assert r["stdout"] == "caught\n", r
    r = rc.ok("del a; gc.collect(); torch.cuda.empty_cache()\nprint(torch.cuda.memory_allocated())\n"
              "b = torch.ones(40, 1024, 1024, device='cuda')\nprint(b.sum().item(), torch.cuda.memory_allocated())")
    assert r["stdout"] == f"0\n{40 * mib}.0 {160 * mib}\n", r


def test_rerunning_the_model_cell_does_not_grow_the_gateways_memory(rc):
    """A notebook's "model = Net().cuda()" cell (with its optimizer and a step) run again and again:
    each run's old model is freed on the gateway, as on a GPU (20 runs of 12 MiB each would not fit)."""
    rc.ok("import gc, torch, torch.nn as nn\ngc.collect(); torch.cuda.empty_cache()\n"
          "base = torch.cuda.memory_allocated()\nx = torch.randn(8, 1024, device='cuda')")
    cell = ("model = nn.Linear(1024, 1024).cuda()\nopt = torch.optim.Adam(model.parameters())\n"
            "model(x).sum().backward(); opt.step()\nused = torch.cuda.memory_allocated() - base")
    seen = []
    for _ in range(20):
        rc.ok(cell)
        seen.append(int(rc.ok("print(used)")["stdout"]))
    assert max(seen) < 2 * min(seen) < GPU_MEMORY / 4, seen
    r = rc.ok("del model, opt; gc.collect(); torch.cuda.empty_cache()\n"
              "print(torch.cuda.memory_allocated() - base)")
    assert int(r["stdout"]) == 8 * 1024 * 4, r  # x alone


def test_debug_after_a_remote_error_of_the_cells_end(rc):
    """``%debug`` after an asynchronous remote error, which the end-of-cell sync raises with no frame
    of the notebook's: IPython's debugger failed with its own AttributeError ('NoneType' object has
    no attribute 'tb_frame'); it says there is no frame, and how to get the error at its line.
    The post-mortem state is the error's, as locally: ``sys.last_value``, ``%tb``."""
    r = rc.run("import sys, torch\nz = torch.zeros(2, device='cuda')\nw = z[torch.tensor([7], device='cuda')]")
    assert r["reply"]["ename"] == "IndexError", r["reply"]
    r = rc.ok("%debug")
    assert "has no frame to debug" in r["stderr"] and "%remotecuda sync on" in r["stderr"], r
    r = rc.ok("%tb")
    assert any("index 7 is out of bounds" in line for e in r["errors"] for line in e["traceback"]) or \
        "index 7 is out of bounds" in r["stdout"], r
    assert rc.ok("print(type(sys.last_value).__name__, z.sum().item())")["stdout"] == "IndexError 0.0\n"
    # %pdb on: the debugger called as the error is shown (it failed inside the end-of-cell hook)
    rc.ok("%pdb on")
    r = rc.run("w = z[torch.tensor([7], device='cuda')]")
    assert r["reply"]["ename"] == "IndexError" and "has no frame to debug" in r["stderr"], r
    assert "callback" not in r["stdout"], r
    rc.ok("%pdb off")
