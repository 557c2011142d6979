"""Hostile peers against real gateways (``--device cpu`` on 127.0.0.1): authentication, sealed
frames, the op allowlist's guards, bounds on what a peer can make the gateway hold, and liveness.
Each test is an attack that worked before the gateway was hardened (docs/SECURITY.md)."""
from __future__ import annotations

import os
import resource
import socket
import struct
import subprocess
import sys
import time
import zlib

import psutil
import pytest
import torch
import xxhash
import zmq
import zstandard

from remotecuda_wire import auth, protocol
from remotecuda_wire.protocol import Handle

from conftest import ROOT, Client, GatewayProcess, run_python, still_served, wait_for

TOKEN = "correct-horse-battery-staple-0123456789"


def _status(gw: GatewayProcess) -> dict:
    from remotecuda.session import gateway_status
    return gateway_status(zmq.Context.instance(), gw.endpoint, 10)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tokened(token_file):
    gw = GatewayProcess("--token-file", token_file, "--spare", "2")
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def plain():
    """No token (loopback), and short timeouts, so that liveness and idleness show quickly."""
    gw = GatewayProcess("--spare", "2", "--idle-timeout", "1.5", "--session-timeout", "4")
    yield gw
    gw.stop()


@pytest.fixture
def with_token(monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)


@pytest.fixture
def without_token(monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)


# ============================================================================ authentication

def test_off_loopback_without_a_token_refuses_to_start(tmp_path):
    """Nothing is bound: the command refuses before it opens a socket."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTECUDA_TOKEN")}
    cmd = [sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0", "--no-discovery"]
    r = subprocess.run([*cmd, "--host", "0.0.0.0"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "no token is set" in r.stderr and "--insecure" in r.stderr, r.stderr
    assert "READY" not in r.stdout
    short = tmp_path / "short"
    short.write_text("hunter2")
    r = subprocess.run([*cmd, "--token-file", str(short)], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 2 and "at least 16 bytes" in r.stderr


def test_a_client_without_the_token_gets_nothing_but_the_inventory(tokened, without_token):
    from remotecuda.errors import GatewayAuthError
    c = Client(tokened.endpoint)
    try:
        with pytest.raises(GatewayAuthError, match="requires a token"):
            c.hello()
        c.send(protocol.OPS, {"ops": [["aten::ones.default", [[4]], {}, [1]]]})
        msg = c.error()
        assert msg.body["kind"] == "auth"
        status = _status(tokened)  # public: what the gateway serves, not who uses it
        assert status["auth"] == "token" and isinstance(status["sessions"], int) and "totals" not in status
    finally:
        c.close()


def test_a_wrong_token_is_refused_and_the_right_one_works(tokened, monkeypatch):
    from remotecuda.errors import GatewayAuthError
    monkeypatch.setenv(auth.TOKEN_ENV, "not-the-token-but-long-enough")
    c = Client(tokened.endpoint)
    try:
        with pytest.raises(GatewayAuthError, match="token is not the gateway's"):
            c.hello()
    finally:
        c.close()
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    c = Client(tokened.endpoint)
    try:
        assert c.hello()["session"] is True and c.peer is not None
        x = torch.randn(5, 7)
        assert torch.equal(c.add(x, x), x * 3)  # forwarded through the supervisor, checked by the worker
        sock, channel = c.direct()
        assert torch.equal(c.add(x, x, sock=sock, channel=channel), x * 3)
        status = _status(tokened)  # authenticated: the sessions' counters too
        assert isinstance(status["sessions"], list) and status["totals"]["refused"].get("auth", 0) >= 1
        c.send(protocol.BYE, {})
    finally:
        c.close()


def test_a_client_with_a_token_refuses_a_gateway_without_one(plain, with_token):
    from remotecuda.errors import GatewayAuthError
    c = Client(plain.endpoint)
    try:
        with pytest.raises(GatewayAuthError, match="does not authenticate"):
            c.hello()
    finally:
        c.close()


_PROGRAM = r"""
import torch, remotecuda
remotecuda.activate(__import__("sys").argv[1], fallback="error")
g = torch.Generator().manual_seed(0)
w = torch.randn(256, 256, generator=g)
big = torch.randn(9 << 20, generator=g)  # 36 MiB: PARTs both ways
wc, bc = w.cuda(), big.cuda()
x = torch.randn(64, 256, generator=g)
assert torch.allclose((x.cuda() @ wc).relu().cpu(), (x @ w).relu(), rtol=1e-5, atol=1e-5)
assert torch.equal((bc * 2).cpu(), big * 2)
s = remotecuda.runtime.active().pool.sessions[0]
print("OK", s.direct, s.peer is not None)
"""


@pytest.mark.parametrize("direct", ["1", "0"])
def test_the_library_client_with_the_token(tokened, direct):
    """A whole program, sealed: direct path and forwarded, large uploads and downloads in parts."""
    r = run_python(_PROGRAM, env={auth.TOKEN_ENV: TOKEN, "REMOTECUDA_DIRECT": direct},
                   args=["-c", _PROGRAM, tokened.address], timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["OK", str(direct == "1"), "True"]


def test_replayed_tampered_and_unsealed_frames_are_refused(tokened, with_token):
    c = Client(tokened.endpoint)
    try:
        c.hello()
        x = torch.arange(4.0)
        hx, up, pl = c.upload_op(x, 0)
        assert c.request([up], [pl]).type == protocol.REPLY
        bump = c.send(protocol.OPS, {"ops": [["aten::add_.Tensor", [Handle(hx), Handle(hx)], {}, [hx]]]})
        assert torch.equal(c.fetch(hx), x * 2)
        c.sock.send_multipart(bump)  # replayed: refused, not run again
        msg = c.error()
        assert msg.body["kind"] == "protocol" and "replayed" in msg.body["msg"]
        assert torch.equal(c.fetch(hx), x * 2)
        # a payload swapped under a valid header: the MAC covers every frame
        ops, pls, hc = c.add_ops(x, x)
        frames = c.frames(protocol.OPS, {"ops": ops, "n0": 0}, pls)
        other = protocol.tensor_bytes(torch.full((4,), 9.0))
        frames[2] = protocol.encode_payload(other)[1]
        c.sock.send_multipart(frames)
        assert "authentication failed" in c.error().body["msg"]
        # a flipped body byte (digest fixed up, CRC fixed up): the MAC still catches it
        frames = c.frames(protocol.OPS, {"ops": [], "n0": 0})
        body = bytes(frames[1]).replace(b"n0", b"n1")
        head = protocol.decode_header(bytes(frames[0]))
        signed = struct.pack("<4sBBBBQIIQ", protocol.MAGIC, protocol.VERSION, protocol.OPS, head.flags,
                             head.channel, head.seq, len(body), 0, xxhash.xxh3_64_intdigest(body))
        c.sock.send_multipart([protocol.finish_header(signed, head.mac), body])
        assert "authentication failed" in c.error().body["msg"]
        # unsealed, in a sealed session
        c.sock.send_multipart(protocol.encode(protocol.OPS, {"ops": []}, seq=10**9))
        assert "not authenticated" in c.error().body["msg"]
        # the session goes on, on both paths; a replayed HELLO on a new data-port connection is refused
        assert torch.equal(c.add(x, x), x * 3)
        offer = c.welcome["direct"]
        sock = c._dealer(f"{c.endpoint.rsplit(':', 1)[0]}:{offer['port']}", os.urandom(16))
        hello = c.send(protocol.HELLO, {"token": offer["token"]}, sock=sock, channel=auth.DIRECT)
        assert c.recv(sock=sock).type == protocol.WELCOME
        thief = c._dealer(f"{c.endpoint.rsplit(':', 1)[0]}:{offer['port']}", os.urandom(16))
        thief.send_multipart(hello)
        assert "replayed" in c.error(sock=thief).body["msg"]
        thief.close(0)
        assert torch.equal(c.add(x, x, sock=sock, channel=auth.DIRECT), x * 3)
        c.send(protocol.BYE, {})
    finally:
        c.close()
    still_served(tokened)




# ============================================================================ the op allowlist

def test_memory_unsafe_ops_are_clear_errors(plain, without_token):
    """The reproduced out-of-bounds write (a sparse tensor with an index of 2^40, made densely),
    forged pooling indices, and _print, each an error to that client, the session intact."""
    c = Client(plain.endpoint)
    try:
        c.hello()
        hi, up_i, pi = c.upload_op(torch.tensor([[1 << 40]]), 0)
        hv, up_v, pv = c.upload_op(torch.tensor([1.0]), 1)
        hs, hd = c.handle(), c.handle()
        msg = c.request([up_i, up_v,
                         ["aten::_sparse_coo_tensor_with_dims_and_tensors.default",
                          [1, 0, [3], Handle(hi), Handle(hv)],
                          {"dtype": torch.float32, "layout": torch.sparse_coo, "device": torch.device("cuda"),
                           "pin_memory": False, "is_coalesced": True}, [hs]],
                         ["aten::_to_dense.default", [Handle(hs)], {}, [hd]]], [pi, pv])
        err = msg.body["err"]
        assert err["op"] == "aten::_sparse_coo_tensor_with_dims_and_tensors.default"
        assert "size is inconsistent with indices" in err["msg"]
        g, hx, hidx, hout = c.handle(), c.handle(), c.handle(), c.handle()
        ops = [["aten::ones.default", [[1, 1, 2, 2]], {}, [g]], ["aten::zeros.default", [[1, 1, 4, 4]], {}, [hx]],
               ["aten::full.default", [[1, 1, 2, 2], 1 << 40], {"dtype": torch.int64}, [hidx]],
               ["aten::max_pool2d_with_indices_backward.default",
                [Handle(g), Handle(hx), [2, 2], [2, 2], [0, 0], [1, 1], False, Handle(hidx)], {}, [hout]]]
        err = c.request(ops).body["err"]
        assert err["type"] == "IndexError" and "pooling index out of range" in err["msg"]
        err = c.request([["aten::_print.default", ["READY tcp://evil:1\n" * 4], {}, []]]).body["err"]
        assert err["type"] == "UnknownOpError" and "writes to the gateway's log" in err["msg"]
        x = torch.arange(5.0)
        assert torch.equal(c.add(x, x), x * 3)
        c.send(protocol.BYE, {})
    finally:
        c.close()


def test_a_sparse_tensors_indices_are_handed_out_as_a_copy(plain, without_token):
    """Writing through ``_indices()`` would make a checked sparse tensor invalid again."""
    c = Client(plain.endpoint)
    try:
        c.hello()
        hi, up_i, pi = c.upload_op(torch.tensor([[2]]), 0)
        hv, up_v, pv = c.upload_op(torch.tensor([1.0]), 1)
        hs, hidx, hd = c.handle(), c.handle(), c.handle()
        msg = c.request([up_i, up_v,
                         ["aten::sparse_coo_tensor.indices_size", [Handle(hi), Handle(hv), [3]], {}, [hs]],
                         ["aten::_indices.default", [Handle(hs)], {}, [hidx]],
                         ["aten::fill_.Scalar", [Handle(hidx), 1 << 40], {}, [hidx]],
                         ["aten::_to_dense.default", [Handle(hs)], {}, [hd]]], [pi, pv])
        assert msg.body["err"] is None, msg.body
        assert torch.equal(c.fetch(hd), torch.tensor([0.0, 0.0, 1.0]))
        c.send(protocol.BYE, {})
    finally:
        c.close()


# ============================================================================ bounds

def test_session_limits_and_one_session_per_connection(without_token):
    gw = GatewayProcess("--spare", "1", "--max-sessions", "3", "--max-sessions-per-peer", "2")
    clients = [Client(gw.endpoint) for _ in range(3)]
    try:
        clients[0].hello()
        for _ in range(5):  # more HELLOs on a connection that has a session: refused, no worker started
            clients[0].send(protocol.HELLO, {"device": 0})
            assert "one session per connection" in clients[0].error().body["msg"]
        clients[1].hello()
        from remotecuda.errors import GatewayUnavailableError
        with pytest.raises(GatewayUnavailableError, match="limit of 2 sessions for 127.0.0.1"):
            clients[2].hello()
        workers = psutil.Process(gw.proc.pid).children()
        assert len(workers) <= 2 + 1, workers  # two sessions and one spare
        assert _status(gw)["totals"]["refused"]["limit"] == 6
    finally:
        for c in clients:
            c.close()
        gw.stop()


def test_idle_connections_are_closed_and_a_spawn_failure_is_an_error(without_token):
    """Idle connections used up the supervisor's file descriptors (~240 did) until it could not
    start a worker, and that OSError killed it, with every session. Now idle connections are
    closed, and a worker that cannot start is an error to the client that waited for it."""
    gw = GatewayProcess("--spare", "0", "--idle-timeout", "1.5")
    host, port = gw.address.split(":")
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(300)]
    try:
        assert sum(_closed_by_peer(s) for s in idle) == len(idle)
        # no descriptor to spare: the next one accepts the client, and the worker cannot start
        pid = gw.proc.pid
        hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_settled_fds(pid) + 1, hard))
        c = Client(gw.endpoint)
        try:
            c.send(protocol.HELLO, {"device": 0})
            assert "could not start a session worker (OSError" in c.error().body["msg"]
        finally:
            c.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (hard, hard))
        assert gw.proc.poll() is None
        assert wait_for(lambda: _try_session(gw.endpoint), timeout=90, interval=1)
        assert _status(gw)["totals"]["refused"]["internal"] == 1
    finally:
        for s in idle:
            s.close()
        gw.stop()


def _settled_fds(pid: int) -> int:
    """How many descriptors a process holds, once the count stays put for a second."""
    n = len(os.listdir(f"/proc/{pid}/fd"))
    while True:
        time.sleep(1)
        m = len(os.listdir(f"/proc/{pid}/fd"))
        if m == n:
            return n
        n = m


def _closed_by_peer(s: socket.socket, timeout: float = 30) -> bool:
    """Whether the other end closes the connection (reading past its ZMTP greeting)."""
    s.settimeout(timeout)
    try:
        while s.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:  # (reset)
        return True


def _try_session(endpoint: str) -> bool:
    c = Client(endpoint)
    try:
        c.send(protocol.HELLO, {"device": 0})
        msg = c.recv(60)
        if msg.type != protocol.WELCOME:
            return False
        x = torch.ones(2)
        ok = torch.equal(c.add(x, x), x * 3)
        c.send(protocol.BYE, {})
        return ok
    finally:
        c.close()


def _rss(gw: GatewayProcess) -> int:
    return psutil.Process(gw.proc.pid).memory_info().rss


def _zmtp(endpoint: str) -> socket.socket:
    """A raw ZMTP 3.0 connection (NULL mechanism) that has greeted the gateway as a DEALER: a
    ZeroMQ socket never sends a message it has not finished, an attacker's code does."""
    host, port = endpoint[len("tcp://"):].split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32))
    greeting = b""
    while len(greeting) < 64:
        greeting += s.recv(64 - len(greeting))
    prop = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    ready = b"\x05READY" + prop
    s.sendall(b"\x04" + bytes([len(ready)]) + ready)
    return s


def test_an_unfinished_multipart_message_is_let_go(plain):
    """Frames of a message that never ends stay in ZeroMQ's memory (its high-water mark counts
    whole messages); the connection, never trusted, is closed after --idle-timeout and the memory
    returned."""
    before = _rss(plain)
    s = _zmtp(plain.endpoint)
    chunk = b"\x03" + struct.pack(">Q", 1 << 20) + os.urandom(1 << 20)  # a long frame, MORE set
    try:
        for _ in range(300):
            s.sendall(chunk)
    except OSError:
        pass  # (closed under us: what this test wants)
    s.settimeout(30)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    finally:
        s.close()
    assert wait_for(lambda: _rss(plain) < before + (64 << 20), timeout=20), (_rss(plain) - before) >> 20
    still_served(plain)


def test_oversized_frames_and_bodies_before_a_session(plain):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(plain.endpoint)
    try:
        sock.send(bytes(80 << 20))  # one frame over MAXMSGSIZE (64 MiB + 64): the connection is dropped
        assert mon.poll(30_000)
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
    before = _rss(plain)
    c = Client(plain.endpoint)
    try:
        body = b"\xdc" + struct.pack(">H", 0) + b"\x80" * (16 << 20)  # (not even a map: never parsed)
        for t in (protocol.STATUS, protocol.HELLO, protocol.PING):
            head = struct.pack("<4sBBBBQIIQ", protocol.MAGIC, protocol.VERSION, t, 0, 0, 1, len(body), 0,
                               xxhash.xxh3_64_intdigest(body)) + bytes(protocol.MAC_SIZE)
            c.sock.send_multipart([head + struct.pack("<I", zlib.crc32(head)), body])
            assert c.error().body["msg"] == "message body over the size limit"
        assert _rss(plain) < before + (200 << 20)
    finally:
        c.close()
    still_served(plain)


def test_a_zstd_frame_is_checked_against_its_upload_before_it_inflates(plain):
    c = Client(plain.endpoint)
    try:
        c.hello()
        packer = zstandard.ZstdCompressor(level=1).compressobj(size=1 << 30)
        zeros = bytes(1 << 20)
        bomb = b"".join(packer.compress(zeros) for _ in range(1024)) + packer.flush()
        assert len(bomb) < 64 << 10 and zstandard.frame_content_size(bomb) == 1 << 30
        desc = [1 << 30, "zstd", protocol.payload_digest(b"")]  # (consistent with its frame)
        msg = c.request([["rc::upload", [c.handle(), 0, torch.float32, [8], None], None, None]], [(desc, bomb)])
        assert msg.type == protocol.ERROR
        assert msg.body["msg"] == f"payload 0 declares {1 << 30} bytes; its upload's dtype and shape hold 32"
        c.send(protocol.BYE, {})
    finally:
        c.close()


# ============================================================================ liveness

def _sessions(gw: GatewayProcess) -> int:
    return len(_status(gw)["sessions"])


def test_junk_to_the_data_port_does_not_keep_a_silent_session(plain):
    """The session's client goes silent (its connections stay open); junk from elsewhere to the
    worker's data port used to count as its client's activity."""
    c = Client(plain.endpoint)
    junk = None
    try:
        offer = c.hello()["direct"]
        assert _sessions(plain) >= 1
        junk = c._dealer(f"{c.endpoint.rsplit(':', 1)[0]}:{offer['port']}")
        start = time.monotonic()
        gone = False
        while time.monotonic() - start < 30 and not gone:
            junk.send_multipart([b"junk", os.urandom(64)])
            time.sleep(0.3)
            gone = any(m.type == protocol.ERROR and m.body["kind"] == "session_lost"
                       for m in _drain(c)) or _sessions(plain) == 0
        assert gone, "the silent session was kept alive"
    finally:
        if junk is not None:
            junk.close(0)
        c.close()


def _drain(c: Client) -> list:
    out = []
    while c.sock.poll(0):
        out.append(protocol.decode(c.sock.recv_multipart()))
    return out


_KILLED = r"""
import sys, torch, remotecuda
remotecuda.activate(sys.argv[1], fallback="error")
x = torch.ones(64 << 20, device="cuda")  # 256 MiB on the gateway
torch.cuda.synchronize()
print("READY", flush=True)
sys.stdin.read()
"""


def test_a_killed_clients_session_ends_at_once(tokened, with_token):
    """Its memory used to wait out the 60 s session timeout; the closed connection ends it now."""
    p = subprocess.Popen([sys.executable, "-c", _KILLED, tokened.address], stdout=subprocess.PIPE,
                         stdin=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "READY"
        before = _sessions(tokened)
        assert before >= 1
        killed = time.monotonic()
        p.kill()
        p.wait()
        assert wait_for(lambda: _sessions(tokened) == before - 1, timeout=30)
        assert time.monotonic() - killed < 20  # (the timeout is 60 s; DISCONNECT_GRACE is 3 s)
    finally:
        p.kill()


def test_bye_drops_the_work_queued_before_it(plain):
    c = Client(plain.endpoint)
    try:
        c.hello()
        worker = next(w for w in psutil.Process(plain.proc.pid).children() if _serves(w, c))
        a, b = c.handle(), c.handle()
        slow = [["aten::randn.default", [[1500, 1500]], {}, [a]]]
        slow += [["aten::mm.default", [Handle(a), Handle(a)], {}, [b]]] * 2000  # minutes of work
        c.send(protocol.OPS, {"ops": slow, "n0": 0})
        c.send(protocol.BYE, {})
        worker.wait(timeout=60)  # it exits as soon as the op under way ends
    finally:
        c.close()


def _serves(worker: psutil.Process, c: Client) -> bool:
    """Whether this worker process listens on the session's data port."""
    port = c.welcome["direct"]["port"]
    try:
        return any(conn.laddr and conn.laddr.port == port for conn in worker.net_connections())
    except psutil.Error:
        return False


def test_a_mangled_part_is_an_error_not_a_hang(plain):
    c = Client(plain.endpoint)
    try:
        c.hello()
        x = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: one PART
        h = c.handle()
        frames = c.frames(protocol.PART, {"h": h, "off": 0, "total": x.nbytes},
                          [protocol.encode_payload(protocol.tensor_bytes(x))])
        head = bytearray(frames[0])
        head[5] = protocol.OPS  # the type byte, CRC left as it was
        c.sock.send_multipart([bytes(head), *frames[1:]])
        assert "header integrity check failed" in c.error().body["msg"]
        msg = c.request([["rc::upload", [h, None, torch.float32, [1 << 18], None, 1], None, None],
                         ["aten::neg.default", [Handle(h)], {}, [c.handle()]]])
        assert msg.type in (protocol.ERROR, protocol.REPLY)
        err = msg.body["msg"] if msg.type == protocol.ERROR else msg.body["err"]["msg"]
        assert "did not arrive" in err
        y = torch.ones(3)
        assert torch.equal(c.add(y, y), y * 3)
        c.send(protocol.BYE, {})
    finally:
        c.close()


def test_a_malformed_bye_on_the_direct_path_is_an_error(plain):
    c = Client(plain.endpoint)
    try:
        c.hello()
        sock, channel = c.direct()
        frames = c.frames(protocol.BYE, {})
        sock.send_multipart([frames[0], frames[1] + b"\x00"])  # a body longer than its header says
        msg = c.error(sock=sock)
        assert "truncated message" in msg.body["msg"]
        x = torch.ones(3)
        assert torch.equal(c.add(x, x, sock=sock, channel=channel), x * 3)  # the session lives
        c.send(protocol.BYE, {}, sock=sock, channel=channel)
    finally:
        c.close()
