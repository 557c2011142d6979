"""Failover (remotecuda/failover.py, replay_log.py): a gateway killed with SIGKILL, or a session's
worker killed, in the middle of a 200-step training run, and the run finishes with parameters
bit-identical to the same run without the failure. Real gateway processes on loopback (CPU
devices), a client process of its own that trains twice in one session (once undisturbed, once
killing its own gateway at a random step) and compares. Dropout and ``torch.rand`` on the
device make the gateway's random stream part of the result. Timings are printed, not asserted:
benchmarks/bench_failover.py measures them (and repeats the kill 20 times)."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT, GatewayProcess

#: the client: argv = steps, kill step, "item" (a value read every step) or not, what to kill
#: ("gateway", "worker", "three": the gateway of cuda:0 three times, 20 steps apart; with reads the
#: batches come through ``remotecuda.prefetch``, so uploads are in flight at the kill), and the
#: gateways' pids by address. Prints RESULT (identical?), the failovers and the replay log's figures.
CLIENT = textwrap.dedent(r'''
    import json, os, signal, sys, time
    import psutil, torch, remotecuda

    steps, kill_at, reads, kill = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "item", sys.argv[4]
    pids = json.loads(sys.argv[5])
    remotecuda.activate(fallback="error")

    def do_kill():
        pid = pids[remotecuda.stats()["devices"][0]["gateway"][6:]]
        if kill == "worker":  # the gateway runs no spare worker: its one child is this session's
            (worker,) = psutil.Process(pid).children()
            worker.kill()
        else:
            os.kill(pid, signal.SIGKILL)

    def run(kill_at, kills=1):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 1)).cuda()
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        big = torch.arange(1_500_000, dtype=torch.float32).cuda()  # 6 MB: sent in PARTs
        check = (big - torch.arange(1_500_000, dtype=torch.float32).cuda()).abs().sum()  # (an upload cache hit)
        del big
        g = torch.Generator().manual_seed(1)
        batches = ((torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)) for _ in range(steps))
        # with reads, the batches also go through remotecuda.prefetch: two uploads in flight ahead of the step
        batches = remotecuda.prefetch(batches) if reads else ((x.cuda(), y.cuda()) for x, y in batches)
        losses = []
        for i, (x, y) in enumerate(batches):
            if kill_at >= 0 and i >= kill_at and (i - kill_at) % 20 == 0 and (i - kill_at) // 20 < kills:
                do_kill()
            noise = torch.rand(32, 1, device="cuda")  # the gateway's random stream
            loss = ((m(x) + 0.01 * noise - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if reads:
                losses.append(loss.item())
        return [p.detach().cpu() for p in m.parameters()] + [check.cpu()], losses

    ref = run(-1)
    try:
        got = run(kill_at, 3 if kill == "three" else 1)
    except remotecuda.GatewayUnavailableError as e:
        print("ERROR", type(e).__name__, str(e).replace("\n", " "), flush=True)
        print("FAILOVERS", json.dumps(remotecuda.stats()["failovers"]), flush=True)
        sys.exit(0)
    same = all(torch.equal(a, b) for a, b in zip(ref[0], got[0])) and ref[1] == got[1] and float(got[0][-1]) == 0
    st = remotecuda.stats()
    print("RESULT", same, flush=True)
    print("FAILOVERS", json.dumps(st["failovers"]), flush=True)
    print("LOG", json.dumps(st["replay_log"]), flush=True)
    remotecuda.deactivate()
''')


@pytest.fixture(scope="module")
def fleet():
    """Six gateways, started at once (a gateway takes seconds to start on a loaded machine); each
    test takes those it needs, in order: a gateway a test kills is not handed out again. The
    fourth runs no spare worker (the worker test finds the session's worker as its one child)."""
    with ThreadPoolExecutor(6) as pool:
        gws = list(pool.map(lambda i: GatewayProcess(*(["--spare", "0"] if i == 3 else [])), range(6)))
    yield gws
    for gw in gws:
        gw.stop()


def _train(gws: list[GatewayProcess], kill_at: int, reads: bool, kill: str, env: dict | None = None,
           steps: int = 200) -> dict:
    import os
    pids = {gw.address: gw.proc.pid for gw in gws}
    e = dict(os.environ, REMOTECUDA_SERVERS=",".join(gw.address for gw in gws), **(env or {}))
    r = subprocess.run([sys.executable, "-c", CLIENT, str(steps), str(kill_at), "item" if reads else "-",
                        kill, json.dumps(pids)], capture_output=True, text=True, timeout=150, cwd=ROOT, env=e)
    out = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in r.stdout.splitlines() if " " in line}
    print(f"kill {kill} at step {kill_at}: {r.stdout[-2000:]}")
    assert "RESULT" in out or "ERROR" in out, r.stdout + r.stderr[-3000:]
    out["stderr"] = r.stderr
    return out


KILLS = random.Random().sample(range(20, 180), 3)  # (printed with each result: rerun by hand to repeat one)


@pytest.mark.parametrize("case", [0, 1, 2], ids=["ops-only", "item-each-step", "item-and-snapshots"])
def test_a_killed_gateway_is_replaced_and_the_run_is_bit_identical(fleet, case):
    """kill -9 of the gateway at a random step: cuda:0 moves to the other gateway, and the final
    parameters (and every loss read) equal those of the run without the failure. The third case
    bounds the log at 40 kB, so snapshots are taken (every few steps) before the kill."""
    gws = [fleet[case], fleet[case + 1] if case < 2 else fleet[4]]
    env = {"REMOTECUDA_SNAPSHOT_BYTES": "40000"} if case == 2 else {}
    out = _train(gws, KILLS[case], reads=case > 0, kill="gateway", env=env)
    assert out.get("RESULT") == "True", out
    (event,) = json.loads(out["FAILOVERS"])
    assert event["from"] == f"{gws[0].address} GPU 0" and event["to"] == f"{gws[1].address} GPU 0", event
    assert event["ops_replayed"] > 0 and event["attempts"] == 1 and event["device"] == "cuda:0"
    assert "moved from" in out["stderr"] and gws[1].address in out["stderr"]
    log = json.loads(out["LOG"])
    if case == 2:
        assert log["snapshots"] > 0 and event["snapshot_bytes"] > 0, (log, event)
    else:
        assert log["snapshots"] == 0 and event["snapshot_bytes"] == 0


def test_a_killed_worker_is_replaced_and_the_run_is_bit_identical(fleet):
    """The session's worker killed (as a sticky CUDA error would end it): the gateway reports the
    session lost, and the session is rebuilt (on a new worker, here or on the other gateway)."""
    out = _train([fleet[3]], random.randrange(20, 180), reads=False, kill="worker")
    assert out.get("RESULT") == "True", out
    (event,) = json.loads(out["FAILOVERS"])
    assert "worker exited" in event["cause"], event
    assert event["to"] == f"{fleet[3].address} GPU 0"


def test_three_gateways_killed_in_a_row_give_a_clear_error(fleet):
    """cuda:0's gateway killed three times, 20 steps apart: it moves twice, and the third time no
    gateway is left: GatewayUnavailableError after REMOTECUDA_RETRIES (3) attempts, naming them."""
    gws = [fleet[4], fleet[5], fleet[3]]
    out = _train(gws, 10, reads=True, kill="three", steps=60)
    assert "ERROR" in out, out
    kind, msg = out["ERROR"].split(" ", 1)
    assert kind == "GatewayDownError" and "in 3 attempts" in msg and "attempt 3:" in msg, msg
    moves = json.loads(out["FAILOVERS"])
    assert len(moves) == 2 and moves[0]["to"] == moves[1]["from"], moves


def test_the_log_keeps_uploads_once_and_spills_past_its_memory_bound(tmp_path):
    """The replay log's uploads: each content once, in memory up to the bound and in the spill
    folder past it, read back whole; a snapshot drops the rest, closing removes the folder."""
    import torch

    from remotecuda.replay_log import ReplayLog, Snapshot
    log = ReplayLog(memory_bytes=1000, snapshot_bytes=5000, folder=str(tmp_path))
    a, b = bytes(range(200)) * 4, bytes(range(100)) * 30  # 800 bytes (in memory), 3000 (spilled)
    log.upload(1, b"ka", a, torch.float32, [200])
    log.upload(2, b"ka", a, torch.float32, [200])  # the same content again: kept once
    log.upload(3, b"kb", b, torch.uint8, [3000])
    log.record(b"x" * 100, [["aten::add.Tensor", [], None, [4]]], request=False)
    (folder,) = tmp_path.iterdir()  # (the log's own, in the one it was given)
    assert log.blobs.in_memory == 800 and log.blobs.spilled == 3000 and len(list(folder.iterdir())) == 1
    assert log.blob(b"ka") == a and log.blob(b"kb") == b and log.uploads[2][0] == b"ka"
    assert not log.due()
    log.record(b"y" * 2000, [], request=True)
    assert log.due() and log.info()["bytes"] == 3800 + 2100
    log.blobs.put(b"snap", b"z" * 10)
    log.truncate(Snapshot(5, storages={0: (b"snap", 10)}))
    assert log.entries == [] and log.uploads == {} and log.blobs.spilled == 0 and not log.due()
    assert log.blob(b"snap") == b"z" * 10 and log.info()["snapshots"] == 1
    log.close()
    assert not folder.exists() and tmp_path.exists()


def test_a_snapshot_compacts_the_sticky_ops():
    """Flags set at every step (Lightning's "bf16-true" sets the default dtype twice a step) and
    compiled graphs defined and freed stay a few sticky ops across snapshots, not one per call."""
    from remotecuda.replay_log import ReplayLog, Snapshot
    log = ReplayLog(memory_bytes=1000, snapshot_bytes=5000)
    for step in range(100):
        log.record(b"x", [["rc::set_flags", [{"default_dtype": "bfloat16"}], None, None],
                          ["rc::program_define", [step, 1, [], [], []], None, None],
                          ["rc::set_flags", [{"default_dtype": "float32", "cudnn.benchmark": step}], None, None],
                          ["rc::program_free", [step - 1], None, None]], request=False)
        log.truncate(Snapshot(step))
        assert len(log.sticky) <= 2, log.sticky
    assert log.sticky == [["rc::set_flags", [{"default_dtype": "float32", "cudnn.benchmark": 99}], None, None],
                          ["rc::program_define", [99, 1, [], [], []], None, None]]
    log.close()


#: the client of the upload test: argv = the gateways' pids by address. Its gateway is killed (and
#: gone) before a 64 MB upload starts, so the upload's parts wait in ZeroMQ until liveness marks the
#: gateway down, and the failover comes while the upload waits for them.
UPLOAD_CLIENT = textwrap.dedent(r'''
    import json, os, signal, sys
    import torch, remotecuda

    pids = json.loads(sys.argv[1])
    remotecuda.activate(fallback="error")
    w = torch.ones(4, device="cuda")
    assert float(w.sum()) == 4
    pid = pids[remotecuda.stats()["devices"][0]["gateway"][6:]]
    os.kill(pid, signal.SIGKILL)
    while open(f"/proc/{pid}/stat").read().split()[2] != "Z":  # (its parent, the test, reaps it later)
        pass
    x = torch.arange(16 << 20, dtype=torch.float32)
    y = x.cuda()  # 64 MB, in parts, to a gateway that is gone
    print("RESULT", float((y[-1000:] * w[0]).sum()) == float(x[-1000:].sum()), flush=True)
    print("FAILOVERS", len(remotecuda.stats()["failovers"]), flush=True)
''')


def test_a_gateway_killed_under_a_large_upload_is_replaced_and_the_upload_kept():
    """A blocking upload in parts that the failover interrupts (its parts never left ZeroMQ) is
    replayed on the new gateway: the tensor holds its bytes (the upload's handle was released,
    and the first op reading the tensor failed with 'tensor handle ... is unknown')."""
    import os
    with ThreadPoolExecutor(2) as pool:
        gws = list(pool.map(lambda _: GatewayProcess(), range(2)))
    try:
        e = dict(os.environ, REMOTECUDA_SERVERS=",".join(gw.address for gw in gws))
        r = subprocess.run([sys.executable, "-c", UPLOAD_CLIENT, json.dumps({gw.address: gw.proc.pid for gw in gws})],
                           capture_output=True, text=True, timeout=150, cwd=ROOT, env=e)
    finally:
        for gw in gws:
            gw.stop()
    assert "RESULT True" in r.stdout and "FAILOVERS 1" in r.stdout, r.stdout + r.stderr[-3000:]


#: the client of the lazy-conjugate test: argv = the gateway's pid. Snapshots are taken while a
#: lazy conjugate and a lazy negative of z are live, then the session's worker is killed.
MATH_BITS_CLIENT = textwrap.dedent(r'''
    import sys
    import psutil, torch, remotecuda

    remotecuda.activate(fallback="error")
    z = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j], device="cuda")
    c, n = z.conj(), z._neg_view()
    for _ in range(100):  # past the log's bound: snapshots hold z's storage, c's and n's rows
        float(torch.ones(64, device="cuda").sum())
    (worker,) = psutil.Process(int(sys.argv[1])).children()
    worker.kill()
    c.mul_(2)  # through the lazy conjugate, after the session is rebuilt from the snapshot
    print("RESULT", [c.is_conj(), n.is_neg(), z.cpu().tolist(), c.resolve_conj().cpu().tolist(),
                     n.resolve_neg().cpu().tolist()], flush=True)
    print("SNAPSHOTS", remotecuda.stats()["replay_log"]["snapshots"] > 0, flush=True)
    print("FAILOVERS", len(remotecuda.stats()["failovers"]), flush=True)
''')


def test_a_lazy_conjugate_survives_a_failover_after_a_snapshot():
    """A snapshot restores each tensor as a view of its storage's bytes; a lazy conjugate's or
    negative's views are those same bytes read another way, so they are put back with their bits:
    without them, after the failover c read as z itself and c.mul_(2) wrote conj(2·z) into z."""
    import os

    import torch
    z = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j])
    c, n = z.conj(), z._neg_view()
    c.mul_(2)
    want = [True, True, z.tolist(), c.resolve_conj().tolist(), n.resolve_neg().tolist()]
    gw = GatewayProcess("--spare", "0")  # (its one child is then the session's worker)
    try:
        e = dict(os.environ, REMOTECUDA_SERVERS=gw.address, REMOTECUDA_SNAPSHOT_BYTES="5000")
        r = subprocess.run([sys.executable, "-c", MATH_BITS_CLIENT, str(gw.proc.pid)],
                           capture_output=True, text=True, timeout=150, cwd=ROOT, env=e)
    finally:
        gw.stop()
    assert f"RESULT {want}" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "SNAPSHOTS True" in r.stdout and "FAILOVERS 1" in r.stdout, r.stdout + r.stderr[-3000:]
