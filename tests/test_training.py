"""Unchanged training scripts give the same results through a gateway as on the local CPU."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from conftest import ROOT, run_python

SCRIPTS = os.path.join(ROOT, "tests", "scripts")


def _run(script: str, tmp_path, server: str | None) -> dict:
    path = os.path.join(SCRIPTS, script)
    args = [path, str(tmp_path)]
    if server:
        args = ["-m", "remotecuda", "run", "--server", server, sys.executable, *args]
    r = run_python("", args=args, env={"REMOTECUDA_FALLBACK": "error"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results(gateway, tmp_path_factory):
    cache = {}

    def get(script):
        if script not in cache:
            local = _run(script, tmp_path_factory.mktemp("local"), None)
            remote = _run(script, tmp_path_factory.mktemp("remote"), gateway.address)
            cache[script] = (local, remote)
        return cache[script]
    return get


def _close(a, b, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               rtol=rtol, atol=atol)


def test_mlp_adam_clipping_scheduler(results):
    local, remote = results("mlp_adam.py")
    assert local["device"] == "cpu" and remote["device"] == "cuda:0"
    _close(remote["losses"], local["losses"])
    _close(remote["checksum"], local["checksum"], rtol=1e-6, atol=1e-6)
    assert remote["losses"][-1] < remote["losses"][0]


def test_cnn_batchnorm_sgd_then_eval(results):
    local, remote = results("cnn_bn_sgd.py")
    assert remote["device"] == "cuda:0"
    _close(remote["losses"], local["losses"], rtol=1e-4, atol=1e-6)
    _close(remote["running_mean"], local["running_mean"])
    assert remote["accuracy"] == local["accuracy"] and remote["accuracy"] > 0.9


def test_transformer_checkpoint_and_greedy_decode(results):
    local, remote = results("transformer_lm.py")
    assert remote["device"] == "cuda:0" and remote["opt_state_device"] == "cuda:0"
    _close(remote["losses"], local["losses"], rtol=1e-4, atol=1e-5)
    assert remote["decoded"] == local["decoded"]
    assert remote["decoded"][:5] == [3, 4, 5, 6, 7]  # it learned to count


def test_autocast_gradscaler(results):
    local, remote = results("amp_gradscaler.py")
    assert remote["logits_dtypes"] == ["torch.float16"], "CUDA autocast runs Linear in float16"
    assert remote["loss_dtype"] == "torch.float32", "cross_entropy autocasts to float32"
    _close(remote["losses"], local["losses"], rtol=2e-2, atol=1e-3)
    assert remote["losses"][-1] < remote["losses"][0]
