"""CurveZMQ against real gateways (``--device cpu`` on 127.0.0.1): the right keys work and match
local torch (curve alone, and with the token); an unknown client key and a plaintext client are
refused on every port kind (the front port; a worker's data port, which serves the direct path,
the bulk connection and other workers' pulls), with a clear error on the library client; and
the bytes on the wire do not show a tensor's values (docs/SECURITY.md)."""
from __future__ import annotations

import os
import socket
import stat
import threading

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from remotecuda_wire import auth, curve, protocol

from conftest import Client, GatewayProcess, run_python

pytestmark = pytest.mark.skipif(not curve.available(), reason="libzmq without CURVE")

TOKEN = "curve-and-token-0123456789abcdef"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """The gateway's key pair, one admitted client's (alice) and one unknown (mallory)."""
    from remotecuda.cli import main
    d = tmp_path_factory.mktemp("curve")
    assert main(["keys", "gateway", str(d)]) == 0
    assert main(["keys", "alice", str(d / "clients")]) == 0
    assert main(["keys", "mallory", str(d)]) == 0
    return d


@pytest.fixture(scope="module")
def curved(keys):
    gw = GatewayProcess("--curve-secret", str(keys / "gateway.key_secret"),
                        "--curve-clients", str(keys / "clients"), "--gpus", "2", "--spare", "2")
    yield gw
    gw.stop()


def _env(keys, who: str = "alice") -> dict:
    folder = keys / "clients" if who == "alice" else keys
    return {curve.SECRET_ENV: str(folder / f"{who}.key_secret"), curve.SERVER_ENV: str(keys / "gateway.key")}


class CurveClient(Client):
    """conftest's hand-speaking client, on CURVE connections with ``pair``'s keys."""

    def __init__(self, endpoint: str, pair: curve.KeyPair, server: bytes):
        self.pair, self.server = pair, server
        super().__init__(endpoint)

    def _dealer(self, endpoint: str, routing_id: bytes | None = None) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if routing_id:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        curve.secure_client(sock, self.pair, self.server)
        sock.connect(endpoint)
        return sock


def _handshake_event(endpoint: str, pair: curve.KeyPair | None, server: bytes | None) -> int:
    """Connect (CURVE with ``pair`` to ``server``, else plaintext), send a HELLO, and return the
    first handshake event the connection reports; assert nothing at all is answered."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if pair is not None and server is not None:
        curve.secure_client(sock, pair, server)
    mon = sock.get_monitor_socket(curve.HANDSHAKE_EVENTS)
    try:
        sock.connect(endpoint)
        sock.send_multipart(protocol.encode(protocol.HELLO, {"device": 0}))
        assert mon.poll(10_000), "no handshake event within 10 s"
        event = recv_monitor_message(mon)["event"]
        assert not sock.poll(300), "a refused connection got an answer"
        return event
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)


def test_keys_command_writes_a_private_pair(keys):
    from remotecuda.cli import main
    secret = keys / "gateway.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pair = curve.load_keypair(secret)
    assert curve.load_public(str(keys / "gateway.key")) == pair.public
    assert curve.load_public(pair.public.decode()) == pair.public
    assert main(["keys", "gateway", str(keys)]) == 2  # a key pair is never overwritten
    os.chmod(secret, 0o640)
    try:
        with pytest.raises(ValueError, match="must be private"):
            curve.load_keypair(secret)
    finally:
        os.chmod(secret, 0o600)


_PROGRAM = r"""
import os, sys, torch, remotecuda
remotecuda.activate(sys.argv[1], fallback="error")
g = torch.Generator().manual_seed(0)
w = torch.randn(256, 256, generator=g)
big = torch.randn(3 << 20, generator=g)  # 12 MiB: three PARTs each way, on the bulk connection
x = torch.randn(64, 256, generator=g)
assert torch.allclose((x.cuda() @ w.cuda()).relu().cpu(), (x @ w).relu(), rtol=1e-5, atol=1e-5)
assert torch.equal((big.cuda() * 2).cpu(), big * 2)
pool = remotecuda.runtime.active().pool
if len(sys.argv) > 2:  # a copy between the gateway's GPUs: one worker pulls from the other's data port
    y = (x.cuda() + 1).to("cuda:1")
    assert y.device.index == 1 and torch.equal((y * 3).cpu(), (x + 1) * 3)
s = pool.sessions[0]
print("OK", s.direct, s.peer is not None)
"""


def test_right_keys_run_ops_that_match_local_torch(curved, keys):
    """Curve alone: direct path with its bulk connection, and a worker-to-worker copy."""
    r = run_python(_PROGRAM, env=_env(keys), args=["-c", _PROGRAM, curved.address, "copy"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["OK", "True", "False"]


def test_curve_and_token_compose(keys, tmp_path):
    """Both on; the client, given no gateway key, takes it from the gateway's token-signed beacon."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    gw = GatewayProcess("--curve-secret", str(keys / "gateway.key_secret"), "--curve-clients",
                        str(keys / "clients"), "--token-file", str(token_file), discovery=True)
    try:
        env = dict(_env(keys), REMOTECUDA_DISCOVERY=os.environ["REMOTECUDA_DISCOVERY"], **{auth.TOKEN_ENV: TOKEN})
        del env[curve.SERVER_ENV]
        r = run_python(_PROGRAM, env=env, args=["-c", _PROGRAM.replace("activate(sys.argv[1], ", "activate(")])
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["OK", "True", "True"]
    finally:
        gw.stop()


_REFUSED = r"""
import os, sys, remotecuda
from remotecuda.errors import GatewayAuthError
for case in ("mallory", "plaintext", "wrong-server"):
    if case == "plaintext":
        del os.environ["REMOTECUDA_CURVE_SECRET"]
    if case == "wrong-server":
        os.environ.update(REMOTECUDA_CURVE_SECRET=sys.argv[2], REMOTECUDA_CURVE_SERVER=sys.argv[3])
    try:
        remotecuda.activate(sys.argv[1], fallback="error")
        print(case, "ACCEPTED")
    except GatewayAuthError as e:
        print(case, "REFUSED", e)
"""


def test_unknown_key_and_plaintext_client_get_a_clear_error(curved, keys):
    """The library client: an unknown key, no CURVE, and a wrong gateway key each fail with what
    went wrong (ZeroMQ drops such a connection without a word), and nothing runs on the gateway."""
    before = _status(curved, keys)["totals"]
    r = run_python(_REFUSED, env=_env(keys, "mallory"),
                   args=["-c", _REFUSED, curved.address, str(keys / "clients" / "alice.key_secret"),
                         str(keys / "mallory.key")])
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert "refused this client's CURVE key" in lines["mallory"], r.stdout
    assert "the gateway uses CURVE encryption" in lines["plaintext"], r.stdout
    assert "public key is not the one this client names" in lines["wrong-server"], r.stdout
    for line in lines.values():
        assert line.startswith("REFUSED"), r.stdout
    after = _status(curved, keys)["totals"]
    assert after["messages_in"] == before["messages_in"] + 1  # no HELLO reached it: only the STATUS that asked


def _status(gw: GatewayProcess, keys) -> dict:
    c = CurveClient(gw.endpoint, curve.load_keypair(keys / "clients" / "alice.key_secret"),
                    curve.load_public(str(keys / "gateway.key")))
    try:
        c.send(protocol.STATUS, {})
        return c.recv().body
    finally:
        c.close()


def test_every_port_refuses_unknown_keys_and_plaintext(curved, keys):
    """The front port and a worker's data port (direct path, bulk connection, workers' pulls)."""
    server = curve.load_public(str(keys / "gateway.key"))
    alice = curve.load_keypair(keys / "clients" / "alice.key_secret")
    mallory = curve.load_keypair(keys / "mallory.key_secret")
    c = CurveClient(curved.endpoint, alice, server)
    try:
        welcome = c.hello()
        data = f"{curved.endpoint.rsplit(':', 1)[0]}:{welcome['direct']['port']}"
        sock, channel = c.direct()  # alice's key opens the data port ...
        x = torch.arange(6.0)
        assert torch.equal(c.add(x, x, sock=sock, channel=channel), x * 3)
        for endpoint in (curved.endpoint, data):  # ... an unknown one or none opens no port
            assert _handshake_event(endpoint, mallory, server) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            assert _handshake_event(endpoint, None, None) in (  # (which one: how far the greeting got)
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        assert torch.equal(c.add(x, x, sock=sock, channel=channel), x * 3)  # the session is unharmed
        sock.close(0)
        c.send(protocol.BYE, {})
    finally:
        c.close()


class Relay:
    """A loopback TCP relay to ``target`` that records every byte it carries (both ways)."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.recorded = bytearray()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self.lock:
                    self.recorded += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.listener.close()


_SECRET_TENSOR = r"""
import sys, torch, remotecuda
remotecuda.activate(sys.argv[1], fallback="error")
x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(7))  # 256 KiB, incompressible
assert torch.equal((x.cuda() + 0).cpu(), x)
print("OK")
"""


@pytest.mark.parametrize("encrypted", [True, False])
def test_the_wire_does_not_show_a_tensor(curved, keys, gateway, encrypted):
    """Through a recording relay (all traffic on the front port): a known tensor's bytes are in
    the recording of a plaintext gateway's traffic, and not in a CURVE gateway's."""
    target = curved if encrypted else gateway
    host, port = target.address.rsplit(":", 1)
    relay = Relay((host, int(port)))
    try:
        env = dict(_env(keys) if encrypted else {}, REMOTECUDA_DIRECT="0", REMOTECUDA_CODECS="none")
        env.pop(curve.SERVER_ENV, None)
        server = f"127.0.0.1:{relay.port}" + (f"@{keys / 'gateway.key'}" if encrypted else "")  # (its key with it)
        r = run_python(_SECRET_TENSOR, env=env, args=["-c", _SECRET_TENSOR, server])
        assert r.returncode == 0 and r.stdout.split() == ["OK"], r.stderr
    finally:
        relay.close()
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(7))
    values = x.numpy().tobytes()
    with relay.lock:
        recorded = bytes(relay.recorded)
    assert len(recorded) > 2 * len(values)  # the tensor crossed both ways
    probes = [values[i:i + 32] for i in range(0, len(values), len(values) // 8)]
    found = sum(p in recorded for p in probes)
    assert found == (0 if encrypted else len(probes))
