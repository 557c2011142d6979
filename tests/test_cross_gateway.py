"""Copies between virtual devices go gateway worker to gateway worker (remotecuda/transfer.py,
remotecuda_server/peer.py), and DataParallel splits a batch over two gateways.

Real gateways on 127.0.0.1: REMOTECUDA_SERVERS=a,b,c, b with two simulated GPUs, gives cuda:0 (a),
cuda:1 and cuda:2 (b's two GPUs) and cuda:3 (c, killed by the last test). Results are compared
with local CPU PyTorch; the client's byte counters show the tensors never crossed it."""
from __future__ import annotations

import copy
import os
import secrets
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import zmq
from torch import nn

import remotecuda
from remotecuda.tensor import make
from remotecuda_wire import protocol

from conftest import GatewayProcess, active_over, run_python, wait_for


@pytest.fixture(scope="module")
def pool():
    """Gateways a (one simulated GPU), b (two, alike: DataParallel warns of unequal ones), c, and
    remotecuda active over them; the run's own activation after."""
    with ThreadPoolExecutor(3) as starting:  # (each takes seconds to import torch)
        gateways = list(starting.map(lambda extra: GatewayProcess("--spare", "0", *extra),
                                     [("--gpus", "1"), ("--gpus", "2"), ()]))
    a, b, c = gateways
    try:
        with active_over([a.address, b.address, c.address]):
            yield a, b, c
    finally:
        for g in gateways:
            g.stop()


def _client_bytes() -> int:
    st = remotecuda.stats()
    return st["bytes_up"] + st["bytes_down"]


def _transfer_bytes_in(gateway: GatewayProcess) -> int:
    return remotecuda.gateway_status(gateway.address)["totals"].get("transfer_bytes_in", 0)


def test_copy_between_gateways_sends_no_bytes_through_the_client(pool):
    _, b, _ = pool
    x = torch.randn(512, 512)
    xc = x.cuda(0)
    xc.sum().item()  # uploaded, and cuda:1's session open, before counting
    torch.zeros(1, device="cuda:1").item()
    before_b = _transfer_bytes_in(b)
    remotecuda.stats(reset=True)
    y = xc.to("cuda:1")
    z = (y * 2).sum(0)
    assert y.device == torch.device("cuda", 1)
    torch.testing.assert_close(z.cpu(), (x * 2).sum(0), rtol=0, atol=0)
    assert _client_bytes() < x.nbytes / 50, remotecuda.stats()  # the result's 2 KiB came down; x did not
    assert wait_for(lambda: _transfer_bytes_in(b) - before_b >= x.nbytes, timeout=5)


def test_copy_keeps_layout_and_converts(pool):
    x = torch.randn(64, 48)
    xc = x.cuda(0)
    xc.sum().item()  # (the upload waits in a batch: sent before counting)
    remotecuda.stats(reset=True)
    t = xc.t().to("cuda:1")  # dense, transposed: preserve_format keeps the strides
    assert t.stride() == x.t().stride() and torch.equal(t.cpu(), x.t())
    strided = xc[:, ::2].cuda(1)  # not dense: arrives contiguous
    assert strided.is_contiguous() and torch.equal(strided.cpu(), x[:, ::2])
    d = xc.to("cuda:1", torch.float64)
    assert d.dtype == torch.float64 and torch.equal(d.cpu(), x.double())
    dst = torch.zeros(64, 48, device="cuda:1", dtype=torch.float64)
    dst.copy_(xc)  # copy_ across devices (with a dtype conversion on the destination)
    assert torch.equal(dst.cpu(), x.double())
    assert remotecuda.stats()["bytes_up"] < x.nbytes / 4  # commands only; the checks downloaded results
    for other in (torch.tensor([[True, False, True]]), torch.arange(7), torch.empty(0, 3),
                  torch.randn(2, 3, dtype=torch.complex64)):
        assert torch.equal(other.cuda(0).to("cuda:1").cpu(), other)


def test_large_copy_goes_in_parts(pool):
    x = torch.randn(10_000_000)  # 40 MB: ten 4 MiB parts
    xc = x.cuda(0)
    xc[:1].item()
    remotecuda.stats(reset=True)
    y = xc.to("cuda:1")
    assert y.sum().item() == pytest.approx(x.sum().item(), rel=1e-5)
    assert _client_bytes() < 10_000
    assert torch.equal(y[-1000:].cpu(), x[-1000:]) and torch.equal(y[:1000].cpu(), x[:1000])


def test_gradient_flows_back_through_the_copy(pool):
    x = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64)
    (x.to("cpu") @ w).tanh().sum().backward()
    xr = x.detach().cuda(0).requires_grad_()
    (xr.to("cuda:1") @ w.cuda(1)).tanh().sum().backward()
    assert xr.grad.device == torch.device("cuda", 0)
    torch.testing.assert_close(xr.grad.cpu(), x.grad)
    (xr.grad + xr).sum().item()  # usable with the tensors of its own device


def test_gradient_of_copy_into_another_device_goes_back_to_the_source(pool):
    """``dst.copy_(src)`` across devices: the gradient lands on src's device, as on two GPUs."""
    x = torch.randn(6, dtype=torch.float64)
    src = x.cuda(1).requires_grad_()
    dst = torch.zeros(6, dtype=torch.float64, device="cuda:0")
    dst.copy_(src)
    (dst * dst).sum().backward()
    assert src.grad.device == torch.device("cuda", 1)
    torch.testing.assert_close(src.grad.cpu(), 2 * x)
    (src.to("cuda:0") * 3).sum().backward()  # and accumulates with a gradient from .to()
    torch.testing.assert_close(src.grad.cpu(), 2 * x + 3)


def test_copy_between_two_gpus_of_one_gateway(pool):
    """cuda:1 and cuda:2 are b's two (simulated) GPUs, so two workers of it: the copy goes through
    that gateway, not the client."""
    _, b, _ = pool
    x = torch.randn(300, 300)
    xc = x.cuda(1)
    xc.sum().item()
    torch.zeros(1, device="cuda:2").item()
    before = _transfer_bytes_in(b)
    remotecuda.stats(reset=True)
    y = xc.to("cuda:2")
    assert y.device == torch.device("cuda", 2) and torch.equal(y.cpu(), x)
    assert remotecuda.stats()["bytes_up"] < 2000
    assert wait_for(lambda: _transfer_bytes_in(b) - before >= x.nbytes, timeout=5)


def test_copy_through_the_client_where_the_source_port_is_unreachable(pool):
    """A session whose client does not reach its worker's data port (a tunnel, --no-direct) has no
    address to give the destination: its copies go through the client, as before."""
    x = torch.randn(200, 100)
    xc = x.cuda(0)
    xc.sum().item()
    src = xc._s
    endpoint, src.data_endpoint = src.data_endpoint, None
    try:
        remotecuda.stats(reset=True)
        y = xc.to("cuda:1")
        assert torch.equal(y.cpu(), x)
        st = remotecuda.stats()
        assert st["bytes_up"] > x.nbytes and st["bytes_down"] > 2 * x.nbytes  # down once, up once, down to check
    finally:
        src.data_endpoint = endpoint


class _TwoStage(nn.Module):
    """Naive model parallelism, as two-GPU tutorials write it: each stage on its own device."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__()
        self.first, self.second = first, second
        self.a = nn.Sequential(nn.Linear(8, 16), nn.ReLU()).to(first)
        self.b = nn.Linear(16, 2).to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x.to(self.first)).to(self.second))


@pytest.mark.parametrize("optimizer", ["adam_foreach", "sgd_foreach_clip_grad_norm"])
def test_a_model_split_over_two_gateways_trains_as_on_the_cpu(pool, optimizer):
    """foreach optimizers and clip_grad_norm_ group tensors by device: each device steps its own."""
    x = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(16, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def train(first: str, second: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _TwoStage(first, second).double()
        opt = (torch.optim.Adam(model.parameters(), lr=0.01, foreach=True) if optimizer == "adam_foreach"
               else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True))
        for _ in range(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y.to(second)).backward()
            if optimizer != "adam_foreach":
                nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
            opt.step()
        assert model.b.weight.device == torch.device(second)
        return [p.detach().cpu() for p in model.parameters()]
    for got, expected in zip(train("cuda:0", "cuda:1"), train("cpu", "cpu"), strict=True):
        torch.testing.assert_close(got, expected)


class _Inputs:
    """A forward pre-hook noting where each replica's slice of the batch ran."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.seen.append((args[0].get_device(), args[0].shape[0]))


def test_data_parallel_over_two_gateways_matches_local(pool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)).double()
    local = copy.deepcopy(model)
    batches = [(torch.randn(12, 8, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)) for _ in range(3)]
    seen = _Inputs()
    model.register_forward_pre_hook(seen)
    dp = nn.DataParallel(model.cuda(), device_ids=[0, 1])
    opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9)
    for x, target in batches:
        out = dp(x)
        loss = nn.functional.mse_loss(out, target.cuda())
        opt.zero_grad()
        loss.backward()
        local_out = local(x)
        local_loss = nn.functional.mse_loss(local_out, target)
        local_opt.zero_grad()
        local_loss.backward()
        assert out.device == torch.device("cuda", 0)
        torch.testing.assert_close(out.cpu(), local_out.detach())
        torch.testing.assert_close(loss.item(), local_loss.item())
        for p, q in zip(model.parameters(), local.parameters(), strict=True):
            assert p.grad.device == torch.device("cuda", 0)
            torch.testing.assert_close(p.grad.cpu(), q.grad)
        opt.step()
        local_opt.step()
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach())
    assert seen.seen == [(0, 6), (1, 6)] * len(batches)  # each gateway ran half of each batch


def _raw_pull(endpoint: str, token: bytes, timeout_s: float) -> list[protocol.Message]:
    """A stranger's PULL on a worker's data port: the messages it gets until a REPLY."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(protocol.encode(protocol.PULL, {"token": token, "rid": 7}))
        got = []
        while sock.poll(int(timeout_s * 1000)):
            got.append(protocol.decode(sock.recv_multipart()))
            if got[-1].type == protocol.REPLY:
                break
        return got
    finally:
        sock.close()


def test_a_token_serves_one_copy_and_a_wrong_one_is_refused(pool):
    """The ops a copy sends, by hand: a replayed or guessed token gets no bytes; a receive under a
    token nobody offers is a clear error; both sessions go on."""
    x = torch.arange(12.0).reshape(3, 4)
    xc, scratch = x.cuda(0), torch.zeros(1, device="cuda:1")
    src, dst = xc._s, scratch._s
    token = secrets.token_bytes(16)
    src.enqueue("rc::offer", [xc._h, token], None, None)
    h = dst.new_handle()
    dst.enqueue("rc::receive", [h, token, src.data_endpoint, torch.float32, [3, 4]], None, None)
    assert torch.equal(make(dst, h, [3, 4], [4, 1], 0, torch.float32).cpu(), x)

    wrong = dst.new_handle()  # (waits out the same bounded wait as the guess below, meanwhile)
    dst.enqueue("rc::receive", [wrong, secrets.token_bytes(16), src.data_endpoint, torch.float32, [3, 4]],
                None, None)
    dst.flush()

    replay = _raw_pull(src.data_endpoint, token, timeout_s=3)
    assert [m.type for m in replay] == [protocol.REPLY] and "used already" in replay[0].body["err"]["msg"]
    guess = _raw_pull(src.data_endpoint, secrets.token_bytes(16), timeout_s=15)
    assert guess[-1].type == protocol.REPLY and "no transfer with this token" in guess[-1].body["err"]["msg"]
    assert all(m.type == protocol.PONG for m in guess[:-1])  # keep-alives, never a PART

    with pytest.raises(remotecuda.TransferError, match="no transfer with this token"):
        make(dst, wrong, [3, 4], [4, 1], 0, torch.float32).cpu()
    assert torch.equal((xc.to("cuda:1") + 1).cpu(), x + 1)


def test_a_dead_source_gateway_is_a_clear_error(pool):
    """Gateway c is killed holding cuda:3's tensor: the copy fails on cuda:1 at once (the
    destination worker's connection to c is refused; with no news from it, liveness finds c down in
    3 s; it waited for the worker's own pull timeout, 10 s, before), and cuda:1's session goes on.
    The loss, told by that error, is not pending work for the interpreter's exit to report again.
    (Last: cuda:3 is gone for good after it.)"""
    _, _, c = pool
    x3 = torch.ones(100, device="cuda:3")
    assert x3.sum().item() == 100
    os.kill(c.proc.pid, signal.SIGKILL)
    c.proc.wait()
    y = x3.to("cuda:1")
    with pytest.raises(remotecuda.TransferError,
                       match=r"holding the source tensor \(tcp://[0-9.:]+\) (is down|closed|was refused)"):
        y.cpu()
    assert (torch.ones(3, device="cuda:1") * 2).sum().item() == 6


_CAUGHT_COPY = """
import os, signal, sys
import torch, remotecuda
remotecuda.activate(sys.argv[1:3], fallback="error")
x = torch.ones(100, device="cuda:1")
assert x.sum().item() + torch.zeros(1, device="cuda:0").item() == 100  # (both placed)
def tree(pid):
    kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return [pid, *(p for k in kids for p in tree(int(k)))]
for pid in tree(int(sys.argv[3])):  # the gateway and its session workers, at once
    os.kill(pid, signal.SIGKILL)
try:
    x.to("cuda:0").cpu()
except remotecuda.TransferError as e:
    print("caught:", e)
print((torch.ones(3, device="cuda:0") * 2).sum().item())
"""


def test_a_caught_copy_error_is_not_reported_again_at_exit(pool):
    """A script (failover off) copies from a gateway that was killed with its workers, and
    catches the error: its exit waits for no more of that gateway's work and reports nothing again
    (it said GatewayDownError and exited 1: the dead gateway's copy step counted as pending)."""
    a = pool[0]
    victim = GatewayProcess("--spare", "0")
    try:
        r = run_python("", env={"REMOTECUDA_FAILOVER": "off"}, timeout=300,
                       args=["-c", _CAUGHT_COPY, a.address, victim.address, str(victim.proc.pid)])
    finally:
        victim.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "caught: remotecuda: the copy of this tensor from another device failed" in r.stdout
    assert r.stdout.strip().endswith("6.0")
    assert "Error" not in r.stderr, r.stderr
