"""A per-session memory quota (remotecuda start --session-memory): a real --device cpu gateway,
two client processes. Past the quota an op or an upload is a torch.cuda.OutOfMemoryError naming
it, in that session alone, which goes on; another session on the same gateway is unaffected."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
import torch
import zstandard

from remotecuda_wire import protocol

from conftest import ROOT, Client, GatewayProcess, run_python

MIB = 2**20


@pytest.fixture(scope="module")
def quota_gw():
    gw = GatewayProcess("--spare", "2", "--session-memory", "64MiB")
    yield gw
    gw.stop()


CLIENT = r'''
import torch, remotecuda
remotecuda.activate(fallback="error")
def oom(f):
    try:
        return f()
    except torch.cuda.OutOfMemoryError as e:
        return str(e).replace("\n", " ")
x = torch.ones(40 * 2**20 // 4, device="cuda")                           # 40 MiB of 64
print("OP", oom(lambda: torch.ones(40 * 2**20 // 4, device="cuda").sum().item()))
print("AFTER", (x[:2**20] * 2).sum().item())                               # the session goes on
print("SMALL", oom(lambda: torch.full((30 * 2**20 // 4,), 3.0).to("cuda").sum().item()))   # an upload in parts
print("INLINE", oom(lambda: torch.full((512 * 2**10 // 4,), 3.0).to("cuda").sum().item()))  # fits
free, total = torch.cuda.mem_get_info()
print("FREE", free, torch.cuda.memory_allocated())
del x
print("REUSED", torch.full((56 * 2**20 // 4,), 2.0, device="cuda").sum().item())   # the freed bytes are reusable
'''

OTHER = r'''
import torch, remotecuda
remotecuda.activate(fallback="error")
y = torch.full((60 * 2**20 // 4,), 1.0, device="cuda")     # 60 MiB: its own quota, whatever the other holds
print("OTHER", y.sum().item())
'''


def test_the_quota_is_enforced_per_session_and_the_session_goes_on(quota_gw):
    env = {"REMOTECUDA_SERVERS": quota_gw.address}
    r = run_python(CLIENT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    f = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert f["OP"].startswith("CUDA out of memory. Tried to allocate 40.00 MiB. This session's memory quota "
                              "is 64.00 MiB (remotecuda start --session-memory)"), f["OP"]
    assert "40.00 MiB is in use" in f["OP"]
    assert float(f["AFTER"]) == 2 * MIB
    assert f["SMALL"].startswith("CUDA out of memory. Tried to allocate 30.00 MiB. This session's memory quota "
                                 "is 64.00 MiB"), f["SMALL"]
    assert float(f["INLINE"]) == 3.0 * 128 * 2**10
    free, allocated = map(int, f["FREE"].split())
    assert free == 64 * MIB - allocated and allocated >= 40 * MIB
    assert float(f["REUSED"]) == 2.0 * 56 * MIB / 4
    other = run_python(OTHER, env=env)
    assert other.returncode == 0 and other.stdout.split() == ["OTHER", str(float(15 * MIB))], other.stderr[-3000:]


HOLD = r'''
import sys, torch, remotecuda
remotecuda.activate(fallback="error")
x = torch.ones(60 * 2**20 // 4, device="cuda")
print("HELD", x.sum().item(), flush=True)
sys.stdin.readline()
'''


def test_another_session_is_unaffected_while_one_holds_its_quota(quota_gw):
    env = {"REMOTECUDA_SERVERS": quota_gw.address}
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT, env={**os.environ, **env})
    try:
        assert holder.stdout.readline().split() == ["HELD", str(float(15 * MIB))]
        other = run_python(OTHER, env=env)
        assert other.returncode == 0 and other.stdout.split() == ["OTHER", str(float(15 * MIB))], \
            other.stderr[-3000:]
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_an_upload_past_the_quota_is_refused_before_it_is_decompressed(quota_gw):
    """A 40 KB zstd frame declaring 128 MiB (consistent with its upload's dtype and shape): the
    session's 64 MiB quota refuses it as an OutOfMemoryError without inflating it, and goes on."""
    c = Client(quota_gw.endpoint)
    try:
        c.hello()
        packer = zstandard.ZstdCompressor(level=1).compressobj(size=128 * MIB)
        bomb = b"".join(packer.compress(bytes(MIB)) for _ in range(128)) + packer.flush()
        desc = [128 * MIB, "zstd", protocol.payload_digest(b"")]
        msg = c.request([["rc::upload", [c.handle(), 0, torch.float32, [32 * MIB], None], None, None]],
                        [(desc, bomb)])
        assert msg.type == protocol.REPLY, msg.body
        err = msg.body["err"]
        assert err["type"] == "OutOfMemoryError" and err["op"] == "rc::upload", err
        assert err["msg"].startswith("CUDA out of memory. Tried to allocate 128.00 MiB. This session's memory "
                                     "quota is 64.00 MiB"), err
        x = torch.arange(6.0)
        assert torch.equal(c.add(x, x), x * 3)
        c.send(protocol.BYE, {})
    finally:
        c.close()


RETRY = r'''
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 64)).to("{dev}")
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
for bs in {sizes}:  # 32768: 128 MiB of activations, past the 64 MiB quota; 256 fits
    try:
        opt.zero_grad()
        loss = model(torch.ones(bs, 64, device="{dev}")).pow(2).mean()
        loss.backward()
        opt.step()
        print("STEP", bs, loss.item(), model[0].weight.sum().item())
        break
    except torch.cuda.OutOfMemoryError:
        print("OOM", bs)
'''


def test_out_of_memory_then_a_smaller_batch_trains(quota_gw):
    """The idiom: catch the OOM, retry with a smaller batch. The error came at loss.item(), after
    the first step had made AdamW's state from ops skipped after the failure, and the retry died
    on tensors "never computed"; now the first step waits, and the retry trains as on the CPU."""
    step = _oom_then_256(quota_gw, RETRY, 32768)
    assert step == pytest.approx(_local_256(RETRY), rel=1e-5)


def _oom_then_256(quota_gw, program: str, big: int) -> list[float]:
    """Run ``program`` on 'cuda' with batch sizes ``big`` (past the quota), then 256: it must say
    OOM once, then train; the loss and weight sum it printed."""
    remote = run_python("import remotecuda; remotecuda.activate(fallback='error')\n" +
                        program.format(dev="cuda", sizes=(big, 256)), env={"REMOTECUDA_SERVERS": quota_gw.address})
    assert remote.returncode == 0, remote.stderr[-3000:]
    oom, step = remote.stdout.splitlines()
    assert oom == f"OOM {big}" and step.startswith("STEP 256 "), remote.stdout
    return list(map(float, step.split()[2:]))


def _local_256(program: str) -> list[float]:
    """What ``program`` prints on the local CPU with batch size 256 alone."""
    local = io.StringIO()
    with contextlib.redirect_stdout(local):
        exec(program.format(dev="cpu", sizes=(256,)), {})
    return list(map(float, local.getvalue().split()[2:]))


LOOP_RETRY = r'''
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 64)).to("{dev}")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for bs in {sizes}:
    try:
        for step in range(2):  # (accelerate's find_executable_batch_size runs such a function again)
            loss = model(torch.ones(bs, 64, device="{dev}")).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        print("STEP", bs, loss.item(), model[0].weight.sum().item())
        break
    except torch.cuda.OutOfMemoryError:
        print("OOM", bs)
'''


@pytest.mark.parametrize("big", [32768, 6144])  # past the quota in the forward pass; in the backward pass
def test_out_of_memory_in_a_loop_that_zeroes_gradients_last_then_a_smaller_batch_trains(quota_gw, big):
    """``backward(); step(); zero_grad()``: the forward's failure, raised at the first step, left the
    gradients made from skipped ops in ``.grad`` (zero_grad never ran), and every retry accumulated
    into them and failed again ("never computed") down to batch size 1. Now the first backward
    waits for its forward (on a GPU that backward never ran), and a failure in the backward pass
    drops the gradients it did not make."""
    step = _oom_then_256(quota_gw, LOOP_RETRY, big)
    if big == 6144:  # (the gradients the failed backward pass made before it failed stay, as on a GPU)
        return
    assert step == pytest.approx(_local_256(LOOP_RETRY), rel=1e-5)
