"""Settings a program makes for reproducibility reach the gateway's worker, where the kernels they
govern run: deterministic algorithms (tests/test_modern_idioms2.py, tests/test_idioms.py) and the
``CUBLAS_WORKSPACE_CONFIG`` environment variable that torch reads, at a GPU's first cuBLAS call, when
they are on."""
from __future__ import annotations

import json
import os

import pytest
import torch

import remotecuda
from remotecuda_server import executor

from conftest import GatewayProcess, spy_set_flags

pytestmark = pytest.mark.usefixtures("remote")


def test_cublas_workspace_config_set_for_determinism_reaches_the_gateway(monkeypatch):
    """transformers' ``enable_full_determinism`` sets ``CUBLAS_WORKSPACE_CONFIG=:16:8``, then
    ``use_deterministic_algorithms(True)``. Left in the client's environment, the GPU gateway's torch
    saw none at its first cuBLAS call and refused every matmul of the program."""
    torch.ones(1, device="cuda")  # a session is open
    sent = spy_set_flags(monkeypatch)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch._C._set_deterministic_algorithms(True)  # (what use_deterministic_algorithms sets, less inductor)
    try:
        torch.cuda.synchronize()  # the gateway applied it (an error in rc::set_flags is raised here)
        assert {k: v for d in sent for k, v in d.items()} == {
            "deterministic_algorithms": [True, False], "cublas_workspace_config": ":16:8"}
        assert remotecuda.runtime.current().flags["cublas_workspace_config"] == ":16:8"  # (later sessions')
    finally:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
        torch._C._set_deterministic_algorithms(False)  # (the unset goes with the next flag set)
    assert sent[-1] == {"deterministic_algorithms": [False, False], "cublas_workspace_config": None}


def test_the_worker_puts_the_programs_cublas_workspace_config_in_its_environment():
    """(Applied here, in this process, then undone: None restores the gateway's own value.)"""
    ex = executor.Executor(torch.device("cpu"))
    try:
        for value in (":4096:8", None):
            ops = [["rc::set_flags", [{"cublas_workspace_config": value}], None, None]]
            assert ex.run({"ops": ops, "n0": 0, "req": 1})[1] is None
            assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == (value or executor._CUBLAS_WORKSPACE_CONFIG)
    finally:
        executor._set_cublas_workspace_config(None)


#: a matmul under deterministic algorithms, with (argv[2] "set") or without the cuBLAS setting torch
#: asks for, run on a GPU locally and through a ``--device cuda`` gateway with CUDA hidden from the client
_CUBLAS_PROGRAM = """
import json, os, sys, torch
if sys.argv[2] == "set":
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
if sys.argv[1] != "local":
    import remotecuda
    remotecuda.activate(sys.argv[1], fallback="error")
torch.use_deterministic_algorithms(True)
a = torch.arange(12.0).reshape(3, 4).cuda()
try:
    print(json.dumps({"mm": (a @ a.T).tolist()}))
except RuntimeError as e:
    print(json.dumps({"error": str(e).splitlines()[0]}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU, for a --device cuda gateway and local CUDA")
@pytest.mark.parametrize("config", ["set", "unset"])
def test_a_gpu_gateways_cublas_follows_the_programs_workspace_config(run_python, monkeypatch, config):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # (the gateway's own environment has none)
    gw = GatewayProcess("--device", "cuda")
    try:
        local = run_python("", args=["-c", _CUBLAS_PROGRAM, "local", config])
        remote = run_python("", env={"CUDA_VISIBLE_DEVICES": ""}, args=["-c", _CUBLAS_PROGRAM, gw.endpoint, config])
    finally:
        gw.stop()
    assert local.returncode == 0 and remote.returncode == 0, local.stderr + remote.stderr
    assert json.loads(remote.stdout.splitlines()[-1]) == json.loads(local.stdout.splitlines()[-1])


def test_fill_uninitialized_memory_turned_off_reaches_the_gateway():
    """``torch.utils.deterministic.fill_uninitialized_memory = False`` (deterministic algorithms
    without the cost of filling every new tensor): the gateway went on filling them with NaN."""
    import torch.utils.deterministic as deterministic

    torch._C._set_deterministic_algorithms(True)
    try:
        deterministic.fill_uninitialized_memory = False
        local = torch.empty(70001)  # (a size no earlier test's filled tensor freed for reuse)
        remote = torch.empty(70001, device="cuda").cpu()
        deterministic.fill_uninitialized_memory = True
        filled = torch.empty(70001, device="cuda").cpu()
    finally:
        deterministic.fill_uninitialized_memory = True
        torch._C._set_deterministic_algorithms(False)
    assert not local.isnan().all() and not remote.isnan().all()
    assert filled.isnan().all()


@pytest.mark.parametrize(("choose", "choice"), [
    (torch.backends.cuda.preferred_linalg_library, "cusolver"),
    (torch.backends.cuda.preferred_linalg_library, "magma"),
    (torch.backends.cuda.preferred_blas_library, "cublaslt"),
])
def test_a_cuda_library_choice_is_held_and_sent_not_refused(monkeypatch, choose, choice):
    """A CPU-only torch has neither cuSOLVER, MAGMA nor cuBLASLt: choosing one (a known workaround for a
    cuSOLVER failure) raised "not compiled with cuSOLVER" in the program, where a GPU machine's torch
    takes it. The choice is the gateway's to apply; the program reads back what it chose."""
    torch.ones(1, device="cuda")  # a session is open
    sent = spy_set_flags(monkeypatch)
    before = choose()
    try:
        got = choose(choice)
        assert got.name.lower() == choice and choose() == got
        torch.cuda.synchronize()  # the gateway took it (an error in rc::set_flags is raised here)
    finally:
        choose(before.name.lower())
    key = f"preferred_{choose.__name__.split('_')[1]}_library"
    assert [d[key] for d in sent] == [got.name, before.name]
