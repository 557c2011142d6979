"""Processes and children of a remotecuda program, as on a GPU machine: a child forked before the
program initialized CUDA may use CUDA itself (remotecuda/runtime.py, ``forked_before_initialization``),
one forked after is a bad fork (remotecuda/forked_child.py), and a child that activates remotecuda
itself gets the options its parent's activation was given (remotecuda/children.py). Each program
runs in a fresh interpreter: this process has long initialized CUDA."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

from conftest import private_discovery, run_python

#: what a GPU's torch raises at a forked child's first CUDA use (torch/cuda/__init__.py, _lazy_init)
BAD_FORK = ("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
            "you must use the 'spawn' start method")

#: a program's start: its gateway is argv[1]; ``seen`` is printed as JSON at its end;
#: ``forked(child)`` is what ``child(conn)`` sends from a forked process
HEAD = """
import json, multiprocessing as mp, os, sys, torch, remotecuda
remotecuda.activate(sys.argv[1], fallback="error")

def forked(child):
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=child, args=(send,))
    p.start()
    got = receive.recv()
    p.join()
    return got
"""


def _program(gateway, body: str, env: dict | None = None) -> object:
    code = textwrap.dedent(HEAD) + textwrap.dedent(body) + "\nprint(json.dumps(seen))\n"
    r = run_python("", env={"REMOTECUDA_DISCOVERY": private_discovery(), **(env or {})}, timeout=120,
                   args=["-c", code, gateway.address])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _squares(i: int, device: str) -> list[float]:
    x = torch.arange(3.0, device=device) + i
    return (x * x).tolist()


def test_a_pool_forked_before_cuda_is_used_runs_cuda_work_in_its_workers(gateway):
    """``multiprocessing.get_context("fork").Pool`` made before the program's first CUDA use, whose
    workers use 'cuda': a GPU's torch lets a child forked before CUDA's initialization initialize
    it; remotecuda made every child of an active program a bad fork ("Cannot re-initialize CUDA in
    forked subprocess"). Each worker gets a session of its own, and the parent goes on with its."""
    seen = _program(gateway, """
        def squares(i):
            x = torch.arange(3.0, device="cuda") + i
            return (x * x).tolist(), x.device.type
        with mp.get_context("fork").Pool(2) as pool:
            seen = pool.map(squares, [0, 1, 2])
        seen.append(torch.ones(2, device="cuda").sum().item())
    """)
    assert seen == [[_squares(i, "cpu"), "cuda"] for i in range(3)] + [2.0], seen


def test_a_child_forked_before_cuda_is_used_draws_from_the_seed_set_before_the_fork(gateway):
    """``torch.manual_seed`` before the fork: a GPU's torch queues the CUDA generators' seed until
    CUDA initializes, in the child as in the parent, so the child's first draws are the seed's."""
    seen = _program(gateway, """
        torch.manual_seed(7)
        def child(conn):
            conn.send(torch.randn(3, device="cuda").tolist())
        seen = forked(child)
    """)
    torch.manual_seed(7)
    assert seen == torch.randn(3).tolist()


@pytest.mark.parametrize("ask", ["torch.cuda.is_available()", "torch.cuda.init()", "torch.ones(1, device='cuda')"])
def test_a_child_forked_after_cuda_is_initialized_is_a_bad_fork(gateway, ask):
    """What initializes CUDA for a GPU's fork handler (torch's ``poison_fork``: ``is_available``
    asks the driver; ``init``; a first tensor) makes the children forked after it bad forks."""
    seen = _program(gateway, f"""
        {ask}
        def child(conn):
            try:
                torch.zeros(2, device="cuda")
                conn.send("no error")
            except RuntimeError as e:
                conn.send(str(e))
        seen = forked(child)
    """)
    assert seen.startswith(BAD_FORK), seen


#: a child that activates remotecuda itself, and says what it sees
CHILD = ("import torch, remotecuda\n"
         "rt = remotecuda.activate()\n"
         "print(torch.cuda.device_count(), rt.pool.strategy, rt.pool.devices[0].pin,\n"
         "      torch.ones(2, device='cuda').sum().item())")


def test_a_started_process_that_activates_gets_the_options_its_parent_was_given(gateway):
    """``activate(servers, devices=..., strategy=...)`` and then a child (``subprocess``, a spawned
    worker) that calls ``remotecuda.activate()``: it was told of the named gateways only, and saw
    another number of devices, placed by another strategy, than its parent; a GPU's child sees the
    GPUs its parent sees."""
    seen = _program(gateway, f"""
        remotecuda.deactivate()
        rt = remotecuda.activate(sys.argv[1], devices="2", strategy="memory-aware", fallback="error")
        import subprocess
        r = subprocess.run([sys.executable, "-c", {CHILD!r}], capture_output=True, text=True)
        parent = [torch.cuda.device_count(), rt.pool.strategy, str(rt.pool.devices[0].pin), 2.0]
        seen = [r.stdout.split(), [str(x) for x in parent], r.stderr[-2000:]]
    """)
    assert seen[0] == seen[1], seen


def test_a_child_forked_after_cuda_use_that_activates_gets_its_parents_options(gateway):
    """The bad fork's own activation (its way to use CUDA) reads the parent's options too."""
    seen = _program(gateway, f"""
        remotecuda.deactivate()
        rt = remotecuda.activate(sys.argv[1], devices="2", strategy="memory-aware", fallback="error")
        torch.ones(1, device="cuda")
        def child(conn):
            import io, contextlib
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec({CHILD!r}, {{}})
            conn.send(out.getvalue().split())
        seen = [forked(child), [str(x) for x in [2, rt.pool.strategy, rt.pool.devices[0].pin, 2.0]]]
    """)
    assert seen[0] == seen[1], seen


def test_fork_workers_whose_batches_hold_cuda_tensors_raise_the_refusal_in_the_parent(gateway):
    """DataLoader workers forked before CUDA's initialization may use 'cuda', and a ``collate_fn``
    that moves the batch there makes one that cannot be sent (no CUDA IPC between remote
    devices): the worker's Queue refused it in its background thread and dropped it, and the
    loop waited for that batch for ever. The refusal now reaches the loop as a collate_fn's error."""
    seen = _program(gateway, """
        from torch.utils.data import DataLoader
        def collate(batch):
            return torch.stack(batch).to("cuda")
        try:
            next(iter(DataLoader([torch.ones(2)] * 4, batch_size=2, num_workers=2, collate_fn=collate, timeout=60)))
            seen = "no error"
        except Exception as e:
            seen = [type(e).__name__, str(e)]
    """)
    assert seen[0] == "NotImplementedError" and "in DataLoader worker process" in seen[1] and \
        "a cuda tensor cannot be sent to another process" in seen[1], seen


def test_a_child_forked_before_cuda_is_used_that_uses_none_opens_nothing_at_its_exit(gateway):
    """The child's pool is made at its first need, and its exit is none: the exit handler that waits
    for the program's work made the pool there (asking the gateways for nothing), and failed with
    it (here: a setting the pool refuses, set in the child)."""
    seen = _program(gateway, """
        pid = os.fork()
        if pid == 0:
            os.environ["REMOTECUDA_CACHE_POLICY"] = "none such"
            sys.exit(0)
        seen = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    """)
    assert seen == 0
