"""Liveness (remotecuda/liveness.py): a gateway killed, frozen or replaced mid-session is marked down,
its sessions raise a GatewayUnavailableError naming it, and a session on another gateway in the same
process goes on to results equal to a local run. Real gateway processes; a client process of its own
(REMOTECUDA_SERVERS=a,b: cuda:0 on a, cuda:1 on b). Detection times are printed, not asserted
tightly (the machine is shared): benchmarks/bench_liveness.py measures them."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from conftest import ROOT, GatewayProcess, wait_for

#: the client: trains a small model on cuda:0 (gateway a) and one on cuda:1 (gateway b); the test
#: kills or stops a at a point the client names; the client reports what it saw
CLIENT = r'''
import sys, time, torch, remotecuda
mode, a = sys.argv[1], sys.argv[2]
rt = remotecuda.activate(fallback="error")

def make(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return m, torch.optim.SGD(m.parameters(), lr=0.1), torch.randn(64, 8), torch.randn(64, 1)

def step(m, opt, x, y):
    opt.zero_grad()
    loss = ((m(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss

m0, o0, x0, y0 = make(0)
m0.cuda(0); x0, y0 = x0.cuda(0), y0.cuda(0)
o0 = torch.optim.SGD(m0.parameters(), lr=0.1)
m1, o1, x1, y1 = make(1)
m1.cuda(1); x1, y1 = x1.cuda(1), y1.cuda(1)
o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
losses = [step(m1, o1, x1, y1).item() for _ in range(3)]
step(m0, o0, x0, y0).item()
rt.pool.session(1)  # (both sessions open)
for _ in range(100):
    if rt.pool.liveness.rtt_ms(a) is not None:
        break
    time.sleep(0.1)
print("RTT", rt.pool.liveness.rtt_ms(a), flush=True)

def killed_at():
    return float(sys.stdin.readline().split()[1])

err = None
if mode == "blocked":
    w = torch.randn(768, 768, device="cuda:0") / 28
    z = w
    for _ in range(400):  # seconds of work on a: the client waits for it below
        z = z @ w
    print("BLOCKING", flush=True)
    try:
        z.sum().item()
    except remotecuda.GatewayUnavailableError as e:
        t_err, err = time.monotonic(), e
    print("DETECTED %.2f" % (t_err - killed_at()), flush=True)
else:  # the gateway dies while this process works on the other one
    print("IDLE", flush=True)
    t_kill = killed_at()
    while err is None and rt.pool.session(0).lost is None and time.monotonic() - t_kill < 30:
        losses.append(step(m1, o1, x1, y1).item())
        try:
            step(m0, o0, x0, y0)  # queued on a: raised at the next sync (or a full batch's flush)
        except remotecuda.GatewayUnavailableError as e:
            err = e
    print("DETECTED %.2f" % (time.monotonic() - t_kill), flush=True)
    try:
        step(m0, o0, x0, y0).item()
    except remotecuda.GatewayUnavailableError as e:
        err = err or e
print("ERROR", type(err).__name__, err, flush=True)
try:  # sticky: every later sync on cuda:0 says so too
    torch.ones(2, device="cuda:0").sum().item()
except remotecuda.GatewayUnavailableError as e:
    print("AGAIN", type(e).__name__, flush=True)
losses += [step(m1, o1, x1, y1).item() for _ in range(10)]  # b goes on
local = make(1)
local_losses = [step(*local).item() for _ in losses]
ok = all(abs(p - q) <= 1e-6 for p, q in zip(losses, local_losses))
print("MATCH", ok, len(losses), losses[-1], local_losses[-1], flush=True)
remotecuda.deactivate()
print("DONE", flush=True)
'''


@pytest.fixture(scope="module")
def gateways():
    """The gateways the tests kill, freeze or replace, and ``other`` (cuda:1, which goes on),
    started at once: a gateway takes seconds to start on a loaded machine."""
    with ThreadPoolExecutor(5) as pool:
        gws = list(pool.map(lambda _: GatewayProcess(), range(5)))
    yield gws
    for gw in gws:
        gw.stop()


@pytest.fixture(scope="module")
def other(gateways):
    return gateways[0]


def _tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def _client(mode: str, a: GatewayProcess, b: GatewayProcess) -> subprocess.Popen:
    env = dict(os.environ, REMOTECUDA_SERVERS=f"{a.address},{b.address}", REMOTECUDA_FAILOVER="off")  # (the
    # errors without failover; tests/test_failover.py has the sessions moved instead)
    return subprocess.Popen([sys.executable, "-c", CLIENT, mode, a.address], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def _expect(p: subprocess.Popen, word: str) -> str:
    line = p.stdout.readline()
    if not line.startswith(word):
        p.kill()
        raise AssertionError(f"wanted {word}, got {line!r}; stderr: {p.stderr.read()[-3000:]}")
    return line


@pytest.mark.parametrize("n,how,mode", [(1, "kill", "idle"), (2, "kill", "blocked"), (3, "stop", "blocked")])
def test_a_gateway_that_stops_answering_is_marked_down_and_the_other_goes_on(gateways, other, n, how, mode):
    """kill -9 (the TCP connections close) or SIGSTOP (they stay open, nothing answers) of gateway a,
    while the client works on b ("idle") or is blocked in a sync on a ("blocked"): the client's
    session on a raises a GatewayUnavailableError naming a, within seconds and at every later sync;
    b's training finishes with a local run's losses."""
    a = gateways[n]
    procs = _tree(a.proc.pid)
    p = _client(mode, a, other)
    try:
        rtt = float(_expect(p, "RTT").split()[1])
        assert rtt > 0
        _expect(p, "BLOCKING" if mode == "blocked" else "IDLE")
        if mode == "blocked":
            time.sleep(0.5)  # the client is inside .item() now
        procs = _tree(a.proc.pid)  # the supervisor and its session workers
        t = time.monotonic()
        if how == "kill":  # the supervisor (its workers follow it: PR_SET_PDEATHSIG)
            a.proc.send_signal(signal.SIGKILL)
        else:  # the whole gateway freezes, as a hung machine does
            for proc in procs:
                proc.send_signal(signal.SIGSTOP)
        p.stdin.write(f"killed {t}\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=120)
        detected = float(re.search(r"DETECTED ([\d.]+)", out).group(1))
        print(f"{how}/{mode}: detected after {detected:.2f} s, rtt {rtt:.2f} ms")
        assert detected < 10, out
        m = re.search(r"ERROR (\w+) (.*)", out)
        assert m and m.group(1) == "GatewayDownError", out + err[-3000:]
        assert a.address in m.group(2) and "GPU 0" in m.group(2) and "not answered a heartbeat" in m.group(2)
        assert "AGAIN GatewayDownError" in out
        assert "MATCH True" in out and "DONE" in out, out + err[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
        for proc in procs:
            try:
                proc.kill()
                proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        a.proc.wait(timeout=20)


RESTART = r'''
import sys, time, torch, remotecuda
rt = remotecuda.activate(sys.argv[1], fallback="error")
x = torch.ones(4, device="cuda")
assert x.sum().item() == 4
for _ in range(100):
    if rt.pool.liveness.gateway_id(sys.argv[1]) is not None:
        break
    time.sleep(0.1)
print("ID", rt.pool.liveness.gateway_id(sys.argv[1]), flush=True)
sys.stdin.readline()  # the address now leads to another gateway
end = time.monotonic() + 30
try:
    while time.monotonic() < end:
        x.sum().item()  # (still works: the session's direct connection reaches the first gateway's worker)
        time.sleep(0.1)
except remotecuda.GatewayUnavailableError as e:
    print("ERROR", e, flush=True)
print("ID", rt.pool.liveness.gateway_id(sys.argv[1]), flush=True)
'''


def test_a_new_gateway_at_the_same_address_is_noticed(gateways, other):
    """A gateway restarted at its address (here: the address is a TCP proxy that is swapped to
    another gateway, so the new one answers at once) has a new id: the sessions opened with the
    old one are lost, and say that it restarted."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from delay_proxy import DelayProxy
    a = gateways[4]
    proxy = DelayProxy(int(a.address.rsplit(":", 1)[1])).start()
    p = subprocess.Popen([sys.executable, "-c", RESTART, proxy.address], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, REMOTECUDA_FAILOVER="off"))
    try:
        first = _expect(p, "ID").split()[1]
        proxy.stop()
        proxy = DelayProxy(int(other.address.rsplit(":", 1)[1]), port=proxy.port).start()
        p.stdin.write("swapped\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=60)
        assert f"gateway {proxy.address}" in out and "it restarted" in out, out + err[-3000:]
        second = out.strip().splitlines()[-1].split()[1]
        assert second not in (first, "None"), out
    finally:
        if p.poll() is None:
            p.kill()
        proxy.stop()


@pytest.mark.filterwarnings("ignore:remotecuda. gateway .* is unavailable:RuntimeWarning")
def test_a_gateway_discovery_drops_is_down():
    """A gateway that leaves the pool by discovery (its leaving beacon) is down at once: its
    session is lost, saying so."""
    import zmq

    from remotecuda.discovery import Discovery
    from remotecuda.liveness import Liveness
    from remotecuda.session import Session
    gw = GatewayProcess(discovery=True)
    ctx = zmq.Context()
    s = Session(ctx, gw.endpoint, 0, 0, connect_timeout=60)
    live = Liveness(ctx, lambda: [s]).start()
    try:
        with Discovery() as d:
            assert d.wait(1, timeout=10)
            d.subscribe(live.on_discovery)
            assert wait_for(lambda: live.gateway_id(gw.address) is not None, timeout=10)
            gw.stop()  # SIGTERM: it says it is leaving
            assert wait_for(lambda: s.lost is not None, timeout=10)
        assert "discovery dropped it" in s.lost and gw.address in s.lost, s.lost
        assert live.down(gw.address) is not None
    finally:
        live.close()
        s.close()
        ctx.term()
