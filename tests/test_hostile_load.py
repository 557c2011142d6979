"""Hostile and heavy load on a real gateway (``--device cpu`` on 127.0.0.1), issue 15's acceptance:
a seeded fuzzer on each connection kind while a well-behaved client's results are checked, and
8 client processes × 10,000 ops each, every result verified."""
from __future__ import annotations

import random
import subprocess
import sys
import threading

import psutil
import pytest
import torch
import zmq

from remotecuda_wire import auth, protocol

from conftest import ROOT, Client, GatewayProcess, wait_for
from fuzzing import Campaign

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


class GoodClient(threading.Thread):
    """A well-behaved client doing ops throughout, each result compared with local PyTorch."""

    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.stop = threading.Event()
        self.done = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        c = Client(self.endpoint, zmq.Context())
        try:
            c.hello()
            rng = random.Random(7)
            while not self.stop.is_set():
                x = torch.tensor([float(rng.randint(-1000, 1000)) for _ in range(rng.randint(1, 32))])
                y = torch.tensor([float(rng.randint(-1000, 1000))])
                got = c.add(x, y)
                assert torch.equal(got, x + 2 * y), (x, y, got)
                self.done += 1
            c.send(protocol.BYE, {})
        except BaseException as e:  # (reported by the test)
            self.failure = e
        finally:
            c.close()
            c.ctx.term()

    def progresses(self) -> None:
        """It completes a round trip more (the gateway did not stall it), or failed."""
        n = self.done
        assert wait_for(lambda: self.done > n or self.failure is not None, 60), "the well-behaved client stalled"
        assert self.failure is None, self.failure


def test_fuzzing_every_connection_kind_while_a_client_works(tokened, monkeypatch):
    """≥ 10,000 hostile frames on each connection kind: the front port in a session, the session's
    data port and its bulk connection, the front port authenticated without a session, and a
    stranger's; the gateway stays up, its memory bounded, the fuzzed connections' readers answer,
    the fuzzed session still computes right, and a second client's results stay correct throughout."""
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
        ctx.term()
    assert not good.is_alive(), "the well-behaved client hung"
    assert good.failure is None, good.failure
    assert tokened.proc.poll() is None
    # a new client is served, and computes right
    c = Client(tokened.endpoint)
    try:
        c.hello()
        x = torch.arange(6.0)
        assert torch.equal(c.add(x, x), x * 3)
        c.send(protocol.BYE, {})
    finally:
        c.close()


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
