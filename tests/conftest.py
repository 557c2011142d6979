"""Shared fixtures: real gateway processes on 127.0.0.1, and the client activated against one."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch
import zmq

from remotecuda import children
from remotecuda_wire import auth, protocol
from remotecuda_wire.protocol import Handle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the dispatch cache's cross-check mode (remotecuda/dispatch_cache.py) for the whole run, and for the
#: programs tests start: every cache hit recomputes its metadata and must equal the cached entry
os.environ.setdefault("REMOTECUDA_CHECK_CACHE", "1")


def private_discovery() -> str:
    """A multicast group and UDP port for one test run (or one test) alone: "GROUP:PORT"."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"239.255.{random.randint(101, 254)}.{random.randint(1, 254)}:{port}"


#: beacons stay on loopback, on a group of this run's own: no gateway a test starts (they inherit
#: this environment) sends through the default route, and parallel runs do not hear each other
os.environ["REMOTECUDA_DISCOVERY_IFACE"] = "127.0.0.1"
os.environ["REMOTECUDA_DISCOVERY"] = private_discovery()


class GatewayProcess:
    """A `remotecuda start --device cpu` process on a free loopback port (announcing itself with
    ``discovery``, on the run's private group unless the environment says otherwise)."""

    def __init__(self, *extra: str, discovery: bool = False):
        cmd = [sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
               *([] if discovery else ["--no-discovery"]), "--quiet", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=ROOT)
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"gateway did not start: {line!r}")
        self.endpoint = line.split()[1]
        self.address = self.endpoint.replace("tcp://", "")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def gateway():
    gw = GatewayProcess("--spare", "2")
    yield gw
    gw.stop()


#: the variables an activation tells the processes it starts (remotecuda/children.py), as the run
#: was given them (None: not set)
_TOLD_GIVEN = {name: os.environ.get(name) for name in children.VARIABLES.values()}
#: whether the run itself is a ``remotecuda run`` program's child (children.tell_run)
_RUN_GIVEN = children.RUN in os.environ


def _unname_harness_gateways() -> None:
    """An activation tells the processes the program starts the options it was given (its
    gateways as ``REMOTECUDA_SERVERS``, ``fallback="error"`` as ``REMOTECUDA_FALLBACK``...; set
    again whenever its interception is installed); this process's activations are the harness's,
    and the programs its tests start (a discovery test, a CURVE client, a fallback test) choose
    their own: nor are they activated at their ``import torch`` (children.tell_run) unless they say so."""
    for name, given in _TOLD_GIVEN.items():
        if given is None:
            os.environ.pop(name, None)
    if not _RUN_GIVEN:
        children.untell_run(os.environ)


def harness_activate(addresses: str | list[str]) -> object:
    """``activate(addresses)`` for the test process itself (see ``_unname_harness_gateways``)."""
    import remotecuda
    rt = remotecuda.activate(addresses, fallback="error")
    _unname_harness_gateways()
    return rt


@pytest.fixture(autouse=True)
def _harness_gateways_unnamed():
    """Each test starts with no gateways named by the harness's activations (an earlier test's
    ``interception_removed`` installed the interception, and its variable, again)."""
    _unname_harness_gateways()


@pytest.fixture(scope="session")
def _activation(gateway):
    """remotecuda activated against the session's gateway for the whole test run (in this process)."""
    import remotecuda
    harness_activate(gateway.address)
    yield
    remotecuda.deactivate()


@pytest.fixture
def remote(_activation, gateway):
    """The active runtime: a test module that activates over gateways of its own (and deactivates
    the run's activation meanwhile) activates anew after it, so ask each time."""
    import remotecuda
    return remotecuda.runtime.active() or harness_activate(gateway.address)


def reset_fp32_precision() -> None:
    """torch's TF32 settings (its newer API) as a fresh process has them: a test that set them
    leaves the next one a state the legacy getters may refuse to read."""
    from remotecuda import flags
    torch.set_float32_matmul_precision("highest")  # (the legacy API's state, which mixes with the newer's)
    for backend, op in flags.FP32_PRECISION:
        torch._C._set_fp32_precision_setter(backend, op, flags.DEFAULTS[f"fp32_precision.{backend}.{op}"])


@contextmanager
def interception_removed():
    """torch as deactivate() leaves it, for the block, with the active runtime's sessions kept
    open: its interception removed, then installed again."""
    from remotecuda import interception, runtime
    rt = runtime.current()
    rt.interception.remove()
    try:
        yield
    finally:
        rt.interception = interception.install(rt)


@pytest.fixture
def fresh_gateway():
    gw = GatewayProcess()
    yield gw
    gw.stop()


@contextmanager
def active_over(addresses):
    """remotecuda active over ``addresses`` only (every device visible) for a block, then the
    activation that was there before (the run's own), as a module fixture of its own pool needs."""
    import remotecuda
    from remotecuda import visible_devices
    previous = remotecuda.runtime.active()
    restore = previous and list(dict.fromkeys(d.endpoint.removeprefix("tcp://") for d in previous.pool.devices))
    remotecuda.deactivate()
    hidden = os.environ.pop(visible_devices.VAR, None)
    try:
        harness_activate(addresses)
        yield
    finally:
        remotecuda.deactivate()
        os.environ.pop(visible_devices.VAR, None)  # (the block may have set it, as a program does)
        if hidden is not None:
            os.environ[visible_devices.VAR] = hidden
        if restore:
            harness_activate(restore)


def run_python(code: str, env: dict | None = None, timeout: float = 300, args: list | None = None):
    """Run Python code in a fresh interpreter (for behaviour that needs a clean torch)."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, *(args or ["-c", code])], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=ROOT)


def stop_group(proc: subprocess.Popen, grace: float = 20) -> None:
    """End a process started with start_new_session=True and everything it started (a Jupyter
    server and its kernels): SIGTERM to its group, SIGKILL after ``grace`` seconds."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def wait_for(pred, timeout: float = 20.0, interval: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


class Client:
    """A client speaking the protocol by hand; with a token, sealed as the library client seals."""

    def __init__(self, endpoint: str, ctx: zmq.Context | None = None):
        self.endpoint = endpoint
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self._dealer(endpoint)
        self.peer: auth.Peer | None = None
        self.seq = self.rid = self.h = 0
        self.welcome: dict = {}

    def _dealer(self, endpoint: str, routing_id: bytes | None = None) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if routing_id:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.connect(endpoint)
        return sock

    def close(self) -> None:
        self.sock.close(0)

    def frames(self, msg_type: int, body: dict, payloads=(), channel: int = auth.FRONT) -> list:
        self.seq += 1
        frames = protocol.encode(msg_type, body, payloads, self.seq)
        return self.peer.seal(frames, channel) if self.peer is not None else frames

    def send(self, msg_type: int, body: dict, payloads=(), sock: zmq.Socket | None = None,
             channel: int = auth.FRONT) -> list:
        frames = [bytes(f) for f in self.frames(msg_type, body, payloads, channel)]
        (sock or self.sock).send_multipart(frames)
        return frames

    def recv(self, timeout: float = 20.0, sock: zmq.Socket | None = None) -> protocol.Message:
        sock = sock or self.sock
        assert sock.poll(int(timeout * 1000)), "the gateway did not answer"
        frames = sock.recv_multipart()
        head = protocol.decode_header(frames[0])
        if self.peer is not None and head.flags & protocol.SEALED:
            self.peer.last.clear()  # (the test checks the gateway's side of replay, not its own)
            self.peer.open(frames, range(256), head)
        return protocol.decode(frames)

    def error(self, sock: zmq.Socket | None = None) -> protocol.Message:
        msg = self.recv(sock=sock)
        assert msg.type == protocol.ERROR, (protocol.TYPE_NAMES[msg.type], msg.body)
        return msg

    def hello(self, device: int | None = 0) -> dict:
        """A session (or, without a device, the inventory), authenticated when REMOTECUDA_TOKEN is set."""
        from remotecuda.session import handshake
        self.welcome, self.peer = handshake(self.sock, {"device": device}, 120, self.endpoint)
        if self.peer is not None:
            self.seq = self.peer.seq
        return self.welcome

    def handle(self) -> int:
        self.h += 1
        return self.h

    def request(self, ops: list, payloads=(), req_op=None, sock: zmq.Socket | None = None,
                channel: int = auth.FRONT) -> protocol.Message:
        self.rid += 1
        ops = [*ops, req_op or ["rc::sync", [], None, {"base": None}]]
        self.send(protocol.OPS, {"ops": ops, "n0": 0, "req": self.rid}, payloads, sock, channel)
        while True:
            msg = self.recv(sock=sock)
            if msg.type != protocol.REPLY or msg.body.get("rid") == self.rid:
                return msg

    def upload_op(self, t: torch.Tensor, idx: int) -> tuple[int, list, tuple]:
        h = self.handle()
        return h, ["rc::upload", [h, idx, t.dtype, list(t.shape), None], None, None], \
            protocol.encode_payload(protocol.tensor_bytes(t))

    def fetch(self, h: int, **kw) -> torch.Tensor:
        msg = self.request([], req_op=["rc::fetch", [h], None, {"base": None}], **kw)
        assert msg.type == protocol.REPLY and msg.body["err"] is None, msg.body
        res = msg.body["res"]
        return protocol.tensor_from_bytes(protocol.decode_payload(*msg.payloads[res["pl"]]), res["dtype"],
                                          res["shape"]).clone()

    def add_ops(self, a: torch.Tensor, b: torch.Tensor) -> tuple[list, list, int]:
        ha, up_a, pa = self.upload_op(a, 0)
        hb, up_b, pb = self.upload_op(b, 1)
        hc = self.handle()
        return [up_a, up_b, ["aten::add.Tensor", [Handle(ha), Handle(hb)], {"alpha": 2}, [hc]]], [pa, pb], hc

    def add(self, a: torch.Tensor, b: torch.Tensor, **kw) -> torch.Tensor:
        ops, pl, hc = self.add_ops(a, b)
        msg = self.request(ops, pl, ["rc::fetch", [hc], None, {"base": None}], **kw)
        assert msg.type == protocol.REPLY and msg.body["err"] is None, msg.body
        res = msg.body["res"]
        return protocol.tensor_from_bytes(protocol.decode_payload(*msg.payloads[res["pl"]]), res["dtype"],
                                          res["shape"]).clone()

    def direct(self) -> tuple[zmq.Socket, int]:
        """The session's op stream on its worker's data port: (socket, channel)."""
        offer = self.welcome["direct"]
        sock = self._dealer(f"{self.endpoint.rsplit(':', 1)[0]}:{offer['port']}", os.urandom(16))
        self.send(protocol.HELLO, {"token": offer["token"]}, sock=sock, channel=auth.DIRECT)
        msg = self.recv(sock=sock)
        assert msg.type == protocol.WELCOME, msg.body
        return sock, auth.DIRECT


def still_served(gw: GatewayProcess) -> None:
    """The gateway is up and serves a new client (sealed where it holds a token), which computes right."""
    assert gw.proc.poll() is None, "the gateway process died"
    c = Client(gw.endpoint)
    try:
        c.hello()
        x = torch.arange(6.0)
        assert torch.equal(c.add(x, x), x * 3)
        c.send(protocol.BYE, {})
    finally:
        c.close()


def spy_set_flags(monkeypatch) -> list[dict]:
    """The rc::set_flags ops the client queues from now on (the gateway's answer is checked separately)."""
    from remotecuda.session import Session
    sent: list[dict] = []
    enqueue = Session.enqueue

    def spy(self, name, args, kwargs, outs):
        if name == "rc::set_flags":
            sent.append(args[0])
        return enqueue(self, name, args, kwargs, outs)
    monkeypatch.setattr(Session, "enqueue", spy)
    return sent


class LoggedSubclass(torch.Tensor):
    """A subclass whose ``__torch_function__`` notes each function's name (torch's default after)."""

    seen: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})
