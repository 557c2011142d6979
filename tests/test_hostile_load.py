"""Hostile and heavy load on a real gateway (``--device cpu`` on 127.0.0.1), issue 15's acceptance:
a seeded fuzzer on each connection kind while a well-behaved client's results are checked, and
8 client processes × 10,000 ops each, every result verified."""
from __future__ import annotations

import subprocess
import sys
import threading

import psutil
import pytest
import torch
import zmq

from remotecuda_wire import auth, protocol
from remotecuda_wire.protocol import Handle

from conftest import ROOT, Client, GatewayProcess, run_python, still_served, wait_for
from fuzzing import Campaign, GoodClient

TOKEN = "fuzzing-token-0123456789-abcdefghij"
FRAMES_PER_KIND = 10_000


@pytest.fixture(scope="module")
def tokened(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    gw = GatewayProcess("--token-file", str(path), "--spare", "2")
    yield gw
    gw.stop()


def _rss(gw: GatewayProcess) -> int:
    return psutil.Process(gw.proc.pid).memory_info().rss


def test_fuzzing_every_connection_kind_while_a_client_works(tokened, monkeypatch):
    """≥ 10,000 hostile frames on each connection kind: the front port in a session, the session's
    data port and its bulk connection, a stranger on that data port, the front port authenticated
    without a session, and a stranger on it; the gateway stays up, its memory bounded, the fuzzed
    connections' readers answer, the fuzzed session still computes right, and a second client's
    results stay correct throughout."""
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    good = GoodClient(tokened.endpoint)
    good.start()
    ctx = zmq.Context()
    campaign = None
    try:
        campaign = Campaign(tokened.endpoint, ctx)
        good.progresses()
        before = _rss(tokened)

        def after(kind: str) -> None:
            assert tokened.proc.poll() is None, f"the gateway died under fuzzing ({kind})"
            good.progresses()
        campaign.run(FRAMES_PER_KIND, after)
        campaign.check_session()
        assert all(f.frames >= FRAMES_PER_KIND * 0.99 for f in campaign.kinds.values())
        grown = _rss(tokened) - before
        assert grown < 256 << 20, f"the supervisor grew by {grown >> 20} MiB"
        workers = psutil.Process(tokened.proc.pid).children()
        assert len(workers) <= 8, f"{len(workers)} workers for at most 3 sessions and 2 spares"
    finally:
        good.stop.set()
        good.join(120)
        if campaign is not None:
            campaign.close()
        ctx.destroy(linger=0)
    assert not good.is_alive(), "the well-behaved client hung"
    assert good.failure is None, good.failure
    still_served(tokened)  # a new client is served, and computes right


# ============================================================================ 8 clients × 10,000 ops

_CLIENT = r"""
import sys, torch, remotecuda
remotecuda.activate(sys.argv[1], fallback="error")
seed, n, every = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
M = 1_000_003
local = torch.arange(16, dtype=torch.int64) + seed
remote = local.to("cuda")
for i in range(n):
    # one op a step, not commutative: a lost, repeated or reordered op changes the value
    if i % 3 == 0:
        local.add_(i + seed); remote.add_(i + seed)
    elif i % 3 == 1:
        local.mul_(3); remote.mul_(3)
    else:
        local.remainder_(M); remote.remainder_(M)
    if (i + 1) % every == 0 or i == n - 1:
        got = remote.cpu()
        assert torch.equal(got, local), (seed, i, got, local)
print("OK", n)
"""


def test_eight_clients_ten_thousand_ops_each(gateway):
    """8 processes, each activated against the gateway, run 10,000 in-place ops on a tensor of their
    own, reading it back every 1000 ops and at the end, compared with the same computation on local
    PyTorch: nothing lost, repeated or reordered."""
    procs = [subprocess.Popen([sys.executable, "-c", _CLIENT, gateway.address, str(k), "10000", "1000"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for k in range(8)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a client hung")
        outs.append((p.returncode, out, err))
    for k, (rc, out, err) in enumerate(outs):
        assert rc == 0 and out.startswith("OK"), f"client {k}: rc={rc}\n{out}\n{err[-3000:]}"


# ============================================================================ queued work and fairness

def _matmuls(c: Client, a: int, out: int, n: int) -> None:
    """n matrix products queued, no reply asked: work that takes its executor a while."""
    c.send(protocol.OPS, {"ops": [["aten::mm", [Handle(a), Handle(a)], {}, [out]]] * n, "n0": 0})


def _answers(c: Client, sock: zmq.Socket | None = None) -> list[protocol.Message]:
    out = []
    sock = sock or c.sock
    while sock.poll(0):
        out.append(c.recv(sock=sock))
    return out


def test_a_sessions_queue_is_bounded():
    """A client that queues faster than its ops run is refused past --max-queued, at once and
    clearly (ERROR, kind "limit"; counted in STATUS); a CANCEL empties the queue, and the session
    goes on, its results right."""
    gw = GatewayProcess("--spare", "1", "--max-queued", "300")
    c = Client(gw.endpoint)
    try:
        c.hello()
        ha, up, pl = c.upload_op(torch.randn(192, 192), 0)
        c.send(protocol.OPS, {"ops": [up], "n0": 0}, [pl])
        out = c.handle()
        refusals: list[protocol.Message] = []
        for _ in range(40):  # 4,000 products sent at once; the executor runs some hundreds a second
            _matmuls(c, ha, out, 100)
        assert wait_for(lambda: bool(refusals.extend(m for m in _answers(c) if m.type == protocol.ERROR))
                        or bool(refusals), 60)
        assert refusals[0].body["kind"] == "limit", refusals[0].body
        assert "--max-queued" in refusals[0].body["msg"] and "300" in refusals[0].body["msg"]
        c.send(protocol.CANCEL, {"upto": c.seq, "rid": None})
        while (m := c.recv(60)).type != protocol.REPLY:  # the refusals that came before its answer
            assert m.body["kind"] == "limit", m.body
        assert m.body.get("cancelled"), m.body
        x = torch.arange(7.0)
        assert torch.equal(c.add(x, x), x * 3)

        def refused() -> int:
            from remotecuda.session import gateway_status
            return gateway_status(zmq.Context.instance(), gw.endpoint, 10)["totals"].get("queue_refused", 0)
        assert wait_for(lambda: refused() >= 1, 20)
    finally:
        c.close()
        gw.stop()


PACED = r"""
import remotecuda, remotecuda.session, torch
remotecuda.session.RUN_AHEAD = 100  # (at most about two messages of 256 ops ahead: the bound here is 1000)
remotecuda.activate()
a = torch.randn(96, 96, device="cuda") / 10
n = torch.zeros((), device="cuda")
for i in range(700):  # never reads a value: its products outrun the gateway
    a = torch.tanh(a @ a)
    n += 1
print("COUNT", n.item())
b = torch.zeros(3, device="cuda")
b[torch.tensor([7], device="cuda")]  # fails on the gateway; the loop after it never reads
try:
    for i in range(600):
        b += 1
except IndexError as e:
    print("RAISED", str(e).splitlines()[0])
print("AFTER", torch.ones(2, device="cuda").sum().item())
"""


def test_a_loop_that_never_reads_keeps_pace_with_its_gateway():
    """remotecuda/session.py's RUN_AHEAD: a loop queuing ops without reading a value waits for its gateway
    once it is that far ahead, as a full launch queue holds a loop on a GPU. It ran ever further ahead: its
    messages were refused past --max-queued (GatewayProtocolError), and an interrupt waited for all it had
    queued. An op's error met on the way is raised there, as by a sync."""
    gw = GatewayProcess("--spare", "1", "--max-queued", "1000")
    try:
        r = run_python(PACED, env={"REMOTECUDA_SERVERS": gw.address, "REMOTECUDA_FALLBACK": "error"}, timeout=240)
    finally:
        gw.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["COUNT 700.0", "RAISED index 7 is out of bounds for dimension 0 with size 3",
                                     "AFTER 2.0"], (r.stdout, r.stderr[-3000:])


class Flood(threading.Thread):
    """A client sending OPS messages of cheap ops as fast as it can, never waiting for them."""

    def __init__(self, endpoint: str, direct: bool):
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.c = Client(endpoint, self.ctx)
        self.c.hello()
        self.sock = self.c.direct()[0] if direct else self.c.sock
        self.stop = threading.Event()
        self.sent = 0
        self.limited = 0  # refusals for the queue's bound
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            h, up, pl = self.c.upload_op(torch.ones(8), 0)
            self.c.send(protocol.OPS, {"ops": [up], "n0": 0}, [pl], sock=self.sock)
            ops = [["aten::add_.Tensor", [Handle(h), Handle(h)], {}, [h]]] * 50
            while not self.stop.is_set():
                self.c.send(protocol.OPS, {"ops": ops, "n0": 0}, sock=self.sock)
                self.sent += 1
                for m in _answers(self.c, self.sock):
                    self.limited += m.type == protocol.ERROR and m.body.get("kind") == "limit"
        except BaseException as e:  # (reported by the test)
            self.failure = e
        finally:
            self.c.close()
            self.sock.close(0)
            self.ctx.destroy(linger=0)


def test_a_flooding_client_does_not_stall_another():
    """Two clients flood their sessions (one through the supervisor, one on its data port) while a
    third does 100 round trips, each checked: all complete while the floods run, the floods meet
    their queue's bound, and the supervisor's memory stays bounded."""
    gw = GatewayProcess("--spare", "3", "--max-queued", "2000")
    floods = [Flood(gw.endpoint, direct=False), Flood(gw.endpoint, direct=True)]
    c = Client(gw.endpoint)
    try:
        c.hello()
        before = psutil.Process(gw.proc.pid).memory_info().rss
        for f in floods:
            f.start()
        assert wait_for(lambda: all(f.sent > 100 for f in floods), 60)
        started = [f.sent for f in floods]
        for i in range(100):
            x = torch.arange(float(i % 13 + 1))
            assert torch.equal(c.add(x, x), x * 3)
        assert all(f.is_alive() and f.failure is None for f in floods), [f.failure for f in floods]
        assert all(f.sent > s for f, s in zip(floods, started)), "a flood stopped before the round trips ended"
        assert wait_for(lambda: all(f.limited for f in floods), 60), "a flood never met its queue's bound"
        grown = psutil.Process(gw.proc.pid).memory_info().rss - before
        assert grown < 256 << 20, f"the supervisor grew by {grown >> 20} MiB"
    finally:
        for f in floods:
            f.stop.set()
        for f in floods:
            f.join(60)
        c.close()
        gw.stop()



def test_the_backlog_bounds_ops_and_upload_bytes():
    """remotecuda_server/backlog.py's arithmetic: each message counts at least one op; past either
    bound a message is refused (counted), never when the queue is empty; what has run leaves it."""
    from remotecuda_server import backlog
    b = backlog.Backlog(10)
    assert b.admit(0) is None and b.admit(9) is None and b.queued() == 10
    assert "--max-queued" in (b.admit(1) or "") and b.refused == 1
    b.ran(9)
    assert b.admit(5, backlog.MAX_BYTES) is None  # (up to the bytes bound itself)
    assert b.admit(1, 1) is not None and b.refused == 2  # past the bytes bound
    b.ran(0)
    b.ran(5, backlog.MAX_BYTES)
    assert b.queued() == 0 and b.bytes == 0
    assert b.admit(1000, 1 << 40) is None  # an empty queue refuses nothing
    with pytest.raises(ValueError):
        backlog.Backlog(0)
