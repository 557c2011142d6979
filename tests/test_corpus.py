"""Real programs, run unchanged: each script in tests/corpus runs once with plain ``python``
(local CPU: this torch has no accelerator) and once under ``remotecuda run`` against a CPU
gateway, and the JSON each prints last must agree value by value.

Tolerances: float32 programs agree to rel 1e-4 / abs 1e-6 (a remote op may be a fused kernel
where the local one decomposes, so the last bits may differ); the float16 autocast program to
rel 1e-2 / abs 1e-3. Integers, strings and booleans (generated ids, dtypes, "same result after
resume") must be equal. A key named ``device`` or ``*_device`` must read ``cpu`` locally and
``cuda:0`` remotely, so a program that silently stayed on the client's CPU fails, and the
remote run may give no warning the local one does not.

Random numbers: a device's generator is not the CPU's, so the programs draw their noise and
initial weights from seeded CPU generators, and sampled ``generate()`` is compared by shape,
validity and repeatability under one seed (on each side), not token by token.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
F32 = (1e-4, 1e-6)
F16 = (1e-2, 1e-3)


def case(name: str, tol: tuple[float, float] = F32) -> object:
    return pytest.param(name, tol, id=name)


PROGRAMS = [
    case("hf_gpt2"),
    case("hf_llama"),
    case("hf_bert"),
    case("hf_t5"),
    case("hf_trainer"),
    case("word_lm"),
    case("vae"),
    case("dcgan"),
    case("amp_scaler", F16),
    case("dataloader"),
    case("checkpoint"),
    case("nanogpt"),
    case("llm_c"),
]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTECUDA_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def _result(proc: subprocess.Popen, what: str) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{what} run failed (exit {proc.returncode}):\n{err[-4000:]}"
    last = [line for line in out.splitlines() if line.startswith("{")]
    assert last, f"{what} run printed no JSON:\n{out[-2000:]}\n{err[-2000:]}"
    return json.loads(last[-1]), err


def _warnings(stderr: str) -> set[str]:
    return set(re.findall(r"\b(\w*Warning: .*)", stderr))


def _compare(local: object, remote: object, tol: tuple[float, float], path: str, bad: list[str]) -> None:
    key = path.rsplit(".", 1)[-1]
    if key == "device" or key.endswith("_device"):
        if not (str(local).startswith("cpu") and remote == "cuda:0"):
            bad.append(f"{path}: local {local!r}, remote {remote!r} (expected 'cpu' and 'cuda:0')")
    elif isinstance(local, dict) and isinstance(remote, dict):
        if local.keys() != remote.keys():
            bad.append(f"{path}: keys {sorted(local)} != {sorted(remote)}")
        for k in local.keys() & remote.keys():
            _compare(local[k], remote[k], tol, f"{path}.{k}", bad)
    elif isinstance(local, list) and isinstance(remote, list):
        if len(local) != len(remote):
            bad.append(f"{path}: length {len(local)} != {len(remote)}")
        for i, (a, b) in enumerate(zip(local, remote)):
            _compare(a, b, tol, f"{path}[{i}]", bad)
    elif isinstance(local, float) and isinstance(remote, (int, float)) and not isinstance(remote, bool):
        if not math.isclose(local, remote, rel_tol=tol[0], abs_tol=tol[1]):
            bad.append(f"{path}: local {local!r}, remote {remote!r}")
    elif type(local) is not type(remote) or local != remote:
        bad.append(f"{path}: local {local!r}, remote {remote!r}")


def assert_program_matches(gateway, name: str, tol: tuple[float, float]) -> None:
    """tests/corpus/NAME.py under ``remotecuda run`` prints the values plain ``python`` prints, the
    remote run really used 'cuda', and it gives no warning the local run does not."""
    script = os.path.join(CORPUS, f"{name}.py")
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    local = subprocess.Popen([sys.executable, script], env=_env(), **kw)
    remote = subprocess.Popen([sys.executable, "-m", "remotecuda", "run", "--server", gateway.address,
                               sys.executable, script], env=_env(REMOTECUDA_FALLBACK="error"), **kw)
    expected, local_err = _result(local, "local")
    got, remote_err = _result(remote, "remote")
    bad: list[str] = []
    _compare(expected, got, tol, name, bad)
    assert not bad, "remote differs from local:\n" + "\n".join(bad[:20])
    extra = _warnings(remote_err) - _warnings(local_err)
    assert not extra, f"warnings only the remote run gives: {sorted(extra)}"


@pytest.mark.parametrize("name,tol", PROGRAMS)
def test_program(gateway, name: str, tol: tuple[float, float]):
    """The program's printed values are the local CPU's, and the remote run really used 'cuda'."""
    assert_program_matches(gateway, name, tol)
