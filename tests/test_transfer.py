"""The transfer path: content cache, compression policy, statistics, prefetch."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

import remotecuda
from remotecuda_wire import protocol
from remotecuda_wire.cache import CacheMirror, ContentCache
from remotecuda_wire.compression import LinkModel

from conftest import ROOT, GatewayProcess, run_python


def test_content_cache_lru_and_lfu():
    lru = ContentCache(100, "lru")
    lru.put(b"a", 1, 40)
    lru.put(b"b", 2, 40)
    assert lru.get(b"a") == 1  # a is now the most recent
    assert lru.put(b"c", 3, 40) == [b"b"]
    assert b"a" in lru and b"c" in lru and lru.evictions == 1
    lfu = ContentCache(100, "lfu")
    lfu.put(b"a", 1, 40)
    lfu.put(b"b", 2, 40)
    lfu.get(b"a")
    lfu.get(b"b")
    lfu.get(b"a")
    assert lfu.put(b"c", 3, 40) == [b"b"]  # b was used less often
    assert lfu.put(b"huge", 0, 1000) == [] and b"huge" not in lfu  # larger than the whole cache
    with pytest.raises(ValueError):
        ContentCache(10, "fifo")


def test_cache_mirror_knows_certain_misses_from_the_first_part():
    m = CacheMirror(100, "lru")
    m.put(b"a", (40, b"first-a"), 40)
    m.put(b"b", (40, b"first-b"), 40)
    assert m.may_hold((40, b"first-a")) and not m.may_hold((41, b"first-a"))
    m.put(b"c", (40, b"first-a"), 40)  # same size and first part, other content: evicts a
    assert b"a" not in m and m.may_hold((40, b"first-a"))
    m.put(b"d", (40, b"first-d"), 40)  # evicts b, then c is the only one left with first-a
    assert not m.may_hold((40, b"first-b")) and m.may_hold((40, b"first-a"))
    m.put(b"e", (40, b"first-e"), 40)
    assert not m.may_hold((40, b"first-a"))


def test_codec_choice():
    link = LinkModel(1e8)  # 100 MB/s; on loopback speeds the outcome depends on this machine's CPU
    zeros = protocol.tensor_bytes(torch.zeros(1 << 20))
    floats = protocol.tensor_bytes(torch.randn(1 << 20))
    assert link.choose(zeros, protocol.CODECS) in protocol.CODECS
    assert link.choose(zeros, ["zstd"]) == "zstd", "only codecs the peer decodes"
    assert link.choose(zeros, []) is None
    assert link.choose(floats, protocol.CODECS) is None, "random floats barely compress: sent raw"
    assert LinkModel(1.0).choose(floats, protocol.CODECS) is None, "not even on the slowest link"
    assert link.choose(protocol.tensor_bytes(torch.zeros(100)), protocol.CODECS) is None  # too small to bother
    slow = LinkModel(1e6)  # a 1 MB/s link: anything that shrinks is worth compressing
    assert slow.choose(protocol.tensor_bytes(torch.randint(0, 10, (1 << 16,))), protocol.CODECS) is not None
    slow.observe(10 << 20, 0.01)
    assert slow.bytes_per_s > 1e6


def test_codec_settings():
    assert protocol.enabled_codecs(None) == tuple(protocol.CODEC_IMPLS)
    assert protocol.enabled_codecs("zstd, LZ4") == tuple(protocol.CODEC_IMPLS)  # fastest first
    with pytest.raises(ValueError, match="REMOTECUDA_CODECS='zstd,brotli'"):  # (misspelt: not raw in silence)
        protocol.enabled_codecs("zstd,brotli")
    assert protocol.enabled_codecs("none") == protocol.enabled_codecs("") == ()
    assert protocol.common_codecs(None) == ("zstd",), "a peer from before negotiation decodes zstd only"
    assert protocol.common_codecs(["zstd", "lz4", "brotli"]) == protocol.CODECS
    with pytest.raises(protocol.ProtocolError):
        protocol.common_codecs("lz4")


def test_zstd_alone_without_lz4_installed():
    r = run_python("import sys; sys.modules['lz4'] = None\n"
                   "from remotecuda_wire import protocol, compression\n"
                   "import torch\n"
                   "buf = protocol.tensor_bytes(torch.zeros(1 << 20))\n"
                   "print(protocol.CODECS, compression.LinkModel(1e6).choose(buf, ['lz4', 'zstd']))")
    assert r.returncode == 0 and r.stdout.split() == ["('zstd',)", "zstd"], r.stderr[-2000:]


@pytest.mark.usefixtures("remote")
def test_second_epoch_sends_almost_nothing():
    data = [(torch.randn(256, 256), torch.randint(0, 10, (256,))) for _ in range(24)]  # 6 MiB
    w = torch.randn(256, 10, device="cuda")
    sent, losses = [], []
    for _ in range(2):
        torch.cuda.synchronize()
        remotecuda.stats(reset=True)
        total = torch.zeros((), device="cuda")
        for x, y in data:
            total = total + torch.nn.functional.cross_entropy(x.cuda() @ w, y.cuda())
        losses.append(total.item())
        sent.append(remotecuda.stats())
    assert losses[0] == losses[1]
    assert sent[1]["bytes_up"] <= 0.01 * sent[0]["bytes_up"], sent
    assert sent[1]["cache_hits"] == 48 and sent[1]["cache_misses"] == 0
    assert sent[1]["cache_bytes_saved"] >= sum(x.numel() * 4 + y.numel() * 8 for x, y in data)


@pytest.mark.usefixtures("remote")
def test_mutating_a_cached_source_sends_the_new_values():
    x = torch.ones(1024)
    a = x.cuda()
    x[3] = 5.0  # same tensor object, new content: a new digest
    b = x.cuda()
    assert a.cpu()[3].item() == 1.0 and b.cpu()[3].item() == 5.0
    a.add_(1)  # a gateway tensor made from a cache hit is its own copy
    c = torch.ones(1024).cuda()
    assert c.cpu().sum().item() == 1024


@pytest.mark.parametrize("codec", protocol.CODECS)
def test_compressible_uploads_shrink_on_the_wire(remote, monkeypatch, codec):
    torch.cuda.synchronize()
    s = remote.session(0)
    monkeypatch.setattr(s.link, "bytes_per_s", 1e8)  # as on a 100 MB/s link
    monkeypatch.setattr(s, "codecs", (codec,))
    used = []
    encode = protocol.encode_payload

    def spy(buf, codec=None, digest=None):
        desc, frame = encode(buf, codec, digest)
        used.append(desc[1])
        return desc, frame
    monkeypatch.setattr(protocol, "encode_payload", spy)
    remotecuda.stats(reset=True)
    x = torch.zeros(1 << 20)  # 4 MiB of zeros
    x[12345] = 7.0 + protocol.CODECS.index(codec)  # a byte to get wrong; new content (no cache hit) per codec
    z = x.cuda()
    assert torch.equal(z.cpu(), x)
    st = remotecuda.stats()
    assert used == [codec]
    assert st["compressed_bytes_saved"] > 3 << 20 and st["bytes_up"] < 1 << 20


@pytest.mark.usefixtures("remote")
def test_stats_keys_and_gateway_totals(gateway):
    st = remotecuda.stats()
    for key in ("ops", "messages", "bytes_up", "bytes_down", "blocking_round_trips", "cache_hits",
                "cache_misses", "cache_bytes_saved", "compressed_bytes_saved"):
        assert key in st and st[key] >= 0
    (torch.ones(3, device="cuda") * 2).sum().item()
    deadline = time.monotonic() + 10
    while True:  # workers report their counters to the supervisor every half second
        status = remotecuda.gateway_status(gateway.address)
        if status["sessions"] and status["sessions"][0].get("ops", 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status["devices"][0]["kind"] == "cpu"
    row = status["sessions"][0]
    assert row["ops"] > 0 and row["bytes_in"] > 0 and row["messages_in"] > 0
    assert status["totals"]["ops"] >= row["ops"]


@pytest.mark.usefixtures("remote")
def test_prefetch_keeps_batches_in_order():
    batches = [{"x": torch.full((3,), float(i)), "y": (torch.tensor(i), i)} for i in range(7)]
    got = list(remotecuda.prefetch(batches, depth=3))
    assert len(got) == 7
    for i, b in enumerate(got):
        assert b["x"].is_cuda and b["x"].cpu().tolist() == [float(i)] * 3
        assert b["y"][0].is_cuda and b["y"][1] == i


def test_training_on_prefetched_large_batches_matches_local(remote):
    """Batches of 2 MiB go in parts on the bulk connection and land when the step first uses
    them; the loss curve and the weights come out as a local CPU run's."""
    def run(device: str) -> tuple[list, torch.Tensor]:
        g = torch.Generator().manual_seed(5)
        data = [(torch.randn(512, 1024, generator=g), torch.randn(512, 1, generator=g)) for _ in range(6)]
        model = torch.nn.Linear(1024, 1)
        with torch.no_grad():
            model.weight.copy_(torch.randn(1, 1024, generator=g) * 0.01)
            model.bias.zero_()
        model = model.to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = remotecuda.prefetch(data, device=device) if device == "cuda" else iter(data)
        losses = []
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, model.weight.detach().cpu()

    local_losses, local_w = run("cpu")
    losses, w = run("cuda")
    assert losses == pytest.approx(local_losses, rel=1e-5)
    torch.testing.assert_close(w, local_w, rtol=1e-5, atol=1e-6)


def test_queued_ops_go_out_while_the_client_is_busy_elsewhere(remote):
    """A batch is not held back until the next sync: the background flusher sends it after
    the batch window, so the gateway works while the user's code does something else."""
    x = torch.ones(3, device="cuda")
    torch.cuda.synchronize()
    s = remote.session(0)
    y = x * 2
    assert s._ops, "the op is queued, not sent at once"
    deadline = time.monotonic() + 2.0
    while s._ops and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not s._ops, "queued ops were not flushed in the background"
    assert y.cpu().tolist() == [2.0, 2.0, 2.0]


def test_a_message_of_several_steps_frees_each_steps_tensors_where_they_died(remote, monkeypatch):
    """The client tells where in its ops each tensor was dropped, so the gateway frees a step's
    temporaries before the next step runs, even when many steps share one message; never
    before an op that uses them."""
    from remotecuda import session as session_module
    bodies = []
    encode = protocol.encode

    def recording(msg_type, body, *a, **kw):
        if msg_type == protocol.OPS:
            bodies.append(body)
        return encode(msg_type, body, *a, **kw)

    x = torch.randn(64, 64)
    xr = x.cuda()
    torch.cuda.synchronize()
    monkeypatch.setattr(session_module, "BATCH_WINDOW", 60.0)  # every step in one message
    monkeypatch.setattr(protocol, "encode", recording)
    sums = []
    for i in range(6):
        y = (xr * i).relu().sum()
        sums.append(y * 1)
    got = torch.stack(sums).cpu()
    monkeypatch.setattr(protocol, "encode", encode)
    torch.testing.assert_close(got, torch.stack([(x * i).relu().sum() for i in range(6)]))
    body = next(b for b in bodies if len(b["ops"]) >= 18)
    early = 0
    for h, at in zip(body["rel"], body["rel_at"]):
        ref = protocol.handle_ext(h)
        used = [i for i, op in enumerate(body["ops"]) if _mentions(op[1], ref)]
        assert all(i < at for i in used), (h, at, used)
        early += at < len(body["ops"]) - 1
    assert early >= 10, body["rel_at"]


def _mentions(args, ref: bytes) -> bool:
    return any(_mentions(a, ref) if isinstance(a, (list, tuple)) else a == ref for a in args)


# ---------------------------------------------------------------------------- the direct path and parts

def test_sessions_take_the_direct_path(gateway, remote):
    """The op stream goes straight to the session's worker, and so does its bulk connection; the
    supervisor still keeps its accounts."""
    s = remote.session(0)
    assert s.direct, s.direct_failure
    assert s.bulk is not s.sock, s.bulk_failure
    (torch.ones(5, device="cuda") + 1).sum().item()
    deadline = time.monotonic() + 10
    while True:  # workers report their counters every half second
        row = (remotecuda.gateway_status(gateway.address)["sessions"] or [{}])[0]
        if row.get("path") == "direct" and row.get("bytes_out", 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert row["path"] == "direct" and row["messages_in"] > 0 and row["bytes_out"] > 0, row


@pytest.mark.parametrize("dtype, numel", [(torch.float32, (2 << 20) + 3),  # 2 parts and a bit
                                          (torch.int64, 1 << 20),  # exactly 2 parts
                                          (torch.float64, (3 << 19) + 1)])
def test_large_uploads_travel_in_parts_and_arrive_whole(remote, dtype, numel):
    from remotecuda_wire.protocol import PART_BYTES
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(numel, generator=g) * 1000).to(dtype)
    parts = -(-x.nbytes // PART_BYTES)
    assert parts >= 2
    remotecuda.stats(reset=True)
    y = x.cuda()
    assert torch.equal(y.cpu(), x)
    st = remotecuda.stats(reset=True)
    assert st["cache_misses"] == 1 and st["messages"] >= parts and st["bytes_up"] >= x.nbytes
    z = x.cuda()  # the same bytes again: only the key travels
    assert torch.equal((z - y).abs().max().cpu(), torch.zeros((), dtype=dtype))
    st = remotecuda.stats(reset=True)
    assert st["cache_hits"] == 1 and st["bytes_up"] < 4096
    x[-1] += 1  # one element changed, in the last part: new content, sent again
    w = x.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(w.cpu(), x) and remotecuda.stats()["cache_misses"] == 1


def test_the_same_large_tensor_uploaded_twice_before_the_first_landed(remote):
    """``x.cuda() @ x.cuda()``: the second upload sends only the key while the first one's PARTs
    are still on their way; the gateway waits for them instead of finding its cache empty."""
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(9))
    remotecuda.stats(reset=True)
    z = x.cuda() @ x.cuda()
    torch.testing.assert_close(z.cpu(), x @ x)
    assert remotecuda.stats()["cache_hits"] == 1


def test_parted_uploads_of_compressible_and_strided_tensors(remote):
    zeros = torch.zeros(3 << 20)  # 12 MiB that compress to almost nothing
    assert torch.equal(zeros.cuda().cpu(), zeros)
    t = torch.arange(float(6 << 20)).view(2048, 3072).t()  # non-contiguous: uploaded as its dense copy
    assert torch.equal(t.cuda().cpu(), t)
    assert torch.equal((t.cuda() * 2).cpu(), t * 2)


@pytest.mark.parametrize("make", [lambda: torch.randn((33 << 20) // 16 + 3, dtype=torch.complex128),  # 9 parts
                                  lambda: torch.zeros(40 << 20, dtype=torch.uint8)],  # compressible parts
                         ids=["complex128", "zeros"])
def test_large_downloads_come_in_parts_and_arrive_whole(remote, monkeypatch, make):
    """Over 32 MiB a download comes as PART messages copied into fresh memory as they arrive."""
    from remotecuda import session as session_module
    seen = []
    add = session_module.Download.add
    monkeypatch.setattr(session_module.Download, "add",
                        lambda self, msg: (seen.append(msg.body["off"]), add(self, msg)))
    x = make()
    y = x.cuda()
    assert torch.equal(y.cpu(), x)
    want = list(range(0, x.nbytes, protocol.PART_BYTES))
    # in order, in one run (a failover snapshot the large upload set off may download its own parts)
    assert any(seen[i:i + len(want)] == want for i in range(len(seen) - len(want) + 1)), seen
    assert torch.equal((y + 1).cpu(), x + 1)
    assert torch.equal(torch.ones(3, device="cuda").cpu(), torch.ones(3))  # the stream goes on


def test_a_damaged_download_is_an_error_not_a_tensor():
    """Download parts are checked like upload parts: a bad digest, a gap or a missing part make
    the download a GatewayProtocolError."""
    from remotecuda.errors import GatewayProtocolError
    from remotecuda.session import Download
    data = torch.arange(3 * protocol.PART_BYTES // 4, dtype=torch.float32)
    buf = protocol.tensor_bytes(data)

    def part(i: int, damage: bool = False) -> protocol.Message:
        piece = buf[i * protocol.PART_BYTES:(i + 1) * protocol.PART_BYTES]
        desc, frame = protocol.encode_payload(piece)
        if damage:
            frame = bytes(frame[:-1]) + bytes([frame[-1] ^ 1])
        return protocol.decode(protocol.encode(protocol.PART, {"rid": 1, "off": i * protocol.PART_BYTES,
                                                               "total": buf.nbytes}, [(desc, frame)]))

    good = Download()
    for i in range(3):
        good.add(part(i))
    assert torch.equal(good.finish(3, torch.float32, list(data.shape)), data)
    for parts, count, why in [([0, 1], 3, "2 arrived"), ([0, 2, 1], 3, "does not continue"),
                              ([1, 2], 2, "no download of it is under way"), ("damaged", 3, "integrity check")]:
        d = Download()
        for m in ([part(0), part(1, damage=True), part(2)] if parts == "damaged" else [part(i) for i in parts]):
            d.add(m)
        with pytest.raises(GatewayProtocolError, match=why):
            d.finish(count, torch.float32, list(data.shape))


def _delay_proxy_module():
    import sys
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import delay_proxy
    return delay_proxy


def _proxy(target_port: int, target_host: str, rate: float | None = None):
    return _delay_proxy_module().DelayProxy(target_port, 0.0, target_host=target_host, rate=rate).start()


def test_delay_proxy_holds_its_link_rate():
    """The benchmarks' slow link: 2 MB echoed through a 20 MB/s proxy cannot take less than
    2 MB / 20 MB/s (a lower bound, which no load can break), and arrives intact."""
    dp = _delay_proxy_module()
    srv = dp.echo_server()
    with dp.DelayProxy(srv.getsockname()[1], rate=20e6) as p:
        c = socket.create_connection(("127.0.0.1", p.port))
        assert dp.echo_seconds(c, 2_000_000) >= 2_000_000 / 20e6
        c.sendall(b"intact")
        assert c.recv(6, socket.MSG_WAITALL) == b"intact"
        c.close()
    srv.close()


FORWARDED = r'''
import sys, torch, remotecuda
rt = remotecuda.activate(sys.argv[1], fallback="error")
x = torch.randn(3 << 20)
y = x.cuda()
assert torch.equal((y * 2).cpu(), x * 2)
big = torch.randn((8 << 20) + 5)  # a download in PARTs, forwarded by the supervisor
assert torch.equal((big.cuda() + 1).cpu(), big + 1)
print("direct", rt.session(0).direct, "bulk", rt.session(0).bulk is not rt.session(0).sock)
'''


def test_forwarded_path_when_the_data_port_cannot_be_reached():
    """Behind a tunnel that passes only the gateway's port (here: a proxy to a gateway on
    127.0.0.2), the session's data port is out of reach: the session settles for the
    forwarded path and works the same."""
    gw = GatewayProcess("--host", "127.0.0.2")
    proxy = _proxy(int(gw.address.rsplit(":", 1)[1]), "127.0.0.2")
    try:
        r = run_python("", args=["-c", FORWARDED, proxy.address], timeout=120)
        assert r.returncode == 0 and "direct False bulk True" in r.stdout, r.stderr[-3000:]
        assert proxy.connections >= 2  # the op stream's and the bulk connection
    finally:
        proxy.stop()
        gw.stop()


def test_forwarded_path_on_request(gateway):
    r = run_python("", args=["-c", FORWARDED, gateway.address], env={"REMOTECUDA_DIRECT": "0"}, timeout=120)
    assert r.returncode == 0 and "direct False bulk True" in r.stdout, r.stderr[-3000:]


LOSER = r'''
import sys, time, torch, remotecuda
from remotecuda.errors import GatewayLostError
rt = remotecuda.activate(sys.argv[1], fallback="error")
x = torch.ones(4).cuda()
torch.cuda.synchronize()
print("direct", rt.session(0).direct, flush=True)
sys.stdin.readline()  # the test kills the session's worker now
t = time.monotonic()
try:
    (x + 1).cpu()
except GatewayLostError as e:
    print("LOST after %.1f s: %s" % (time.monotonic() - t, e), flush=True)
'''


def test_a_dead_worker_is_reported_on_the_direct_path():
    """The worker's death reaches a client on the direct path through the supervisor, at once."""
    import psutil
    gw = GatewayProcess("--spare", "0")
    try:
        p = subprocess.Popen([sys.executable, "-c", LOSER, gw.address], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             env=dict(os.environ, REMOTECUDA_FAILOVER="off"))  # (with it: tests/test_failover.py)
        assert p.stdout.readline().strip() == "direct True"
        workers = psutil.Process(gw.proc.pid).children()
        assert len(workers) == 1
        workers[0].kill()
        p.stdin.write("go\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=60)
        m = re.search(r"LOST after ([\d.]+) s", out)
        assert m and float(m.group(1)) < 5, (out, err[-3000:])
        assert "worker" in out
    finally:
        gw.stop()


def test_an_abandoned_upload_lets_go_of_its_parts_in_either_order():
    """An interrupt between the PARTs of an upload: the parts that came are dropped, and so are
    those still on their way, whether the abandon op or a part arrives first."""
    from remotecuda_server.executor import PartedUploads
    total = 3 * protocol.PART_BYTES
    part = memoryview(bytearray(protocol.PART_BYTES))
    for abandon_first in (False, True):
        parts = PartedUploads(torch.device("cpu"))

        def arrive(h: int, i: int) -> None:
            parts.add(h, i * protocol.PART_BYTES, total, part, b"")  # noqa: B023 (called in its iteration)
            parts.arrived()  # noqa: B023

        if not abandon_first:
            arrive(7, 0)
            assert parts.building_bytes() == total
        parts.abandon(7, 2)  # the client had sent 2 PARTs in all
        if abandon_first:
            arrive(7, 0)
        assert parts.building_bytes() == 0 and parts.abandoned == {7: 2}
        arrive(7, 1)  # late, and from the middle: no error, nothing kept
        assert parts.building_bytes() == 0 and not parts.abandoned and not parts.failed
        for i in range(3):  # the next upload is not disturbed
            arrive(8, i)
        assert parts.take(8, 5, torch.uint8, [total], lambda: False).tensor.numel() == total
    with pytest.raises(protocol.ProtocolError, match="upload_abandon"):
        parts.abandon("7", None)


INTERRUPTED = r'''
import sys, time, torch, remotecuda
from remotecuda_wire import protocol
rt = remotecuda.activate(sys.argv[1], fallback="error")
x = torch.randn(3 * protocol.PART_BYTES // 4)
real, calls = protocol.payload_digest, []
def digest(buf):
    calls.append(1)
    if len(calls) == 2:  # hashing the second part, the first one sent
        raise KeyboardInterrupt
    return real(buf)
protocol.payload_digest = digest
try:
    x.cuda()
except KeyboardInterrupt:
    print("interrupted", rt.session(0)._parts_sent)
protocol.payload_digest = real
y = x.cuda()
assert torch.equal((y * 2).cpu(), x * 2)
deadline = time.monotonic() + 20
while time.monotonic() < deadline:  # workers report every half second
    row = remotecuda.gateway_status(sys.argv[1])["sessions"][0]
    if row.get("parts_in") == 4 and row.get("partial_upload_bytes") == 0:
        break
    time.sleep(0.2)
print("parts_in", row.get("parts_in"), "partial", row.get("partial_upload_bytes"))
'''


def test_an_upload_interrupted_between_its_parts_leaves_nothing_behind():
    gw = GatewayProcess("--spare", "0")
    try:
        # without the replay log, which hashes every part before the first goes (the spy needs
        # the hash of part 2 to happen after part 1 is sent)
        r = run_python("", args=["-c", INTERRUPTED, gw.address], timeout=120, env={"REMOTECUDA_FAILOVER": "off"})
        assert r.returncode == 0, r.stderr[-3000:]
        assert "interrupted 1" in r.stdout and "parts_in 4 partial 0" in r.stdout, r.stdout + r.stderr[-3000:]
    finally:
        gw.stop()


BETWEEN_FRAMES = r'''
import signal, sys, torch, remotecuda
rt = remotecuda.activate(sys.argv[1], fallback="error")
s = rt.session(0)
x = torch.arange(6.0, device="cuda")
assert x.sum().item() == 15
from remotecuda_wire import frames as wire
real, frames = wire._send, []  # (the compiled send each frame of a message goes through)
def send(sock, frame, flags, *args):
    if sock is s.sock:
        frames.append(frame)
        if len(frames) == 2:  # Ctrl-C between the header and the body of the next message
            signal.raise_signal(signal.SIGINT)
    return real(sock, frame, flags, *args)
wire._send = send
try:
    (x * 2).sum().item()
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
wire._send = real
print("then", (x + 1).sum().item(), torch.equal((x * 3).cpu(), torch.arange(6.0) * 3))
'''


def test_an_interrupt_while_a_message_is_sent_waits_for_its_last_frame(gateway):
    """A KeyboardInterrupt between two frames of a message would leave half of it queued in
    ZeroMQ, joined to the next message: the session would be broken. It is raised once the
    message has gone whole, and the session goes on."""
    r = run_python("", args=["-c", BETWEEN_FRAMES, gateway.address], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["interrupted", "then", "21.0", "True"], r.stdout


def test_host_blocks_come_back_only_when_no_tensor_uses_them():
    from remotecuda_server.executor import Assembly, HostBlocks
    pool = HostBlocks(limit_bytes=8 << 20)
    a = pool.take(2 << 20)
    a_ptr = a.ctypes.data
    t = torch.from_numpy(a)[10:20]  # a view keeps the block in use
    del a
    b = pool.take(2 << 20)
    assert b.ctypes.data != t.data_ptr() - 10
    del t
    c = pool.take(2 << 20)
    assert c.ctypes.data == a_ptr  # a's block is free again (b is still held)
    del b, c
    assert pool.free_bytes() == 4 << 20
    pool.take(8 << 20)  # over the limit: free blocks go, oldest first, never the one handed out
    assert [e[0].nbytes for e in pool.blocks] == [8 << 20]
    # an upload assembled in a recycled block holds exactly its bytes
    x = torch.randn(1 << 19)
    for _ in range(3):
        asm = Assembly(x.nbytes, torch.device("cpu"))
        asm.add(0, protocol.tensor_bytes(x))
        y = asm.finish(torch.float32, [1 << 19])
        assert torch.equal(y, x)
        x = x + 1


# ---------------------------------------------------------------------------- codec negotiation

CODEC_CLIENT = r'''
import sys, torch, remotecuda
from remotecuda_wire import protocol
sent, received = [], []
encode, decode = protocol.encode_payload, protocol.decode_payload

def spy_encode(buf, codec=None, digest=None):
    desc, frame = encode(buf, codec, digest)
    sent.append(desc[1])
    return desc, frame

def spy_decode(desc, frame, *args, **kwargs):
    received.append(desc[1])
    return decode(desc, frame, *args, **kwargs)

protocol.encode_payload, protocol.decode_payload = spy_encode, spy_decode
rt = remotecuda.activate(sys.argv[1], fallback="error")
s = rt.session(0)
g = torch.Generator().manual_seed(0)
for x in (torch.zeros(1 << 16), torch.randint(0, 10, (1 << 15,), generator=g)):
    assert torch.equal((x.cuda() * 3 + 1).cpu(), x * 3 + 1)
print("codecs", ",".join(s.codecs), "sent", ",".join(sorted(set(sent))),
      "received", ",".join(sorted(set(received))), "saved", remotecuda.stats()["compressed_bytes_saved"] > 0)
if len(sys.argv) > 2:  # pretend negotiation failed: send a codec the gateway did not list
    s.codecs = (sys.argv[2],)
    torch.full((1 << 16,), 2.0).cuda()  # content the gateway has not cached
    try:
        torch.cuda.synchronize()
    except remotecuda.GatewayProtocolError as e:
        print("rejected:", e)
    print("still served", (torch.ones(3).cuda() * 2).sum().item())
'''
SLOW_LINK = {"REMOTECUDA_LINK_MBPS": "0.001"}  # anything that shrinks is worth compressing


def _gateway(env: dict) -> GatewayProcess:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        return GatewayProcess("--spare", "1")


@pytest.fixture(scope="module")
def slow_gateway():
    gw = _gateway(SLOW_LINK)
    yield gw
    gw.stop()


@pytest.mark.parametrize("codec", protocol.CODECS)
def test_each_codec_both_ways(slow_gateway, codec):
    """A client that decodes one codec says so in HELLO: its uploads use only that codec, and so
    do the gateway's downloads to it; the results match the CPU."""
    r = run_python("", args=["-c", CODEC_CLIENT, slow_gateway.address],
                   env=dict(SLOW_LINK, REMOTECUDA_CODECS=codec), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["codecs", codec, "sent", codec, "received", codec, "saved", "True"], r.stdout


@pytest.mark.skipif("lz4" not in protocol.CODECS, reason="lz4 is not installed")
def test_a_gateway_without_lz4_never_gets_lz4():
    """REMOTECUDA_CODECS=zstd on the gateway: WELCOME lists zstd only, so the client never sends
    lz4; a client that does anyway gets a clear protocol error, and the session goes on."""
    gw = _gateway(dict(SLOW_LINK, REMOTECUDA_CODECS="zstd"))
    try:
        r = run_python("", args=["-c", CODEC_CLIENT, gw.address, "lz4"], env=SLOW_LINK, timeout=180)
    finally:
        gw.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["codecs", "zstd", "sent", "zstd", "received", "zstd", "saved", "True"], r.stdout
    assert "unknown payload codec 'lz4' (this side decodes raw, zstd)" in lines[1], r.stdout
    assert lines[2] == "still served 6.0", r.stdout


BEHIND_A_LINK = r'''
import sys, torch, remotecuda
rt = remotecuda.activate(sys.argv[1], fallback="error")
s = rt.session(0)
assert not s.direct and s.bulk is not s.sock, (s.direct, s.bulk_failure)
w = torch.ones(4, device="cuda")
assert w.sum().item() == 4
big = torch.randn(2 << 20)  # 8 MiB: over three seconds on this link
g = big.to("cuda", non_blocking=True)
assert (w * 2).sum().item() == 8  # issued after the upload, not touching it
rows = remotecuda.gateway_status(sys.argv[2])["sessions"]
print("gateway had", rows[0]["bytes_in"], "bytes of", big.nbytes)
assert rows[0]["bytes_in"] < big.nbytes, "the op waited for the whole upload to cross the link"
assert torch.equal(g.cpu(), big)
assert torch.equal((g + 1).cpu(), big + 1)
'''


def test_an_op_does_not_wait_on_the_wire_behind_a_large_upload():
    """Large uploads travel on the session's bulk connection and land when an op first needs
    them: over a slow link (a 20 Mbit/s proxy), an op issued after a prefetched 8 MiB batch is
    answered while the batch is still crossing. The check is causal, not timed: when the
    answer comes, the gateway has not yet received the batch."""
    gw = GatewayProcess("--host", "127.0.0.2", "--spare", "0")  # no spare's `import torch` competing meanwhile
    proxy = _proxy(int(gw.address.rsplit(":", 1)[1]), "127.0.0.2", rate=2.5e6)
    try:
        r = run_python("", args=["-c", BEHIND_A_LINK, proxy.address, gw.address], timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    finally:
        proxy.stop()
        gw.stop()
