"""The fast value read (remotecuda_wire/fastread.py): a read with nothing queued or unanswered goes
as a READ and comes back as a VALUE, answered by the worker's I/O thread; results and errors equal
local PyTorch's, anything queued takes the general path, and a forged or replayed READ is refused
like any message."""
from __future__ import annotations

import struct
import textwrap
import time

import pytest
import torch
import xxhash
import zmq

import remotecuda
from remotecuda_wire import auth, fastread, protocol
from remotecuda_wire.protocol import Handle

from conftest import Client, GatewayProcess, run_python, still_served

TOKEN = "fast-read-token-0123456789abcdef"


def _counts() -> tuple[int, int]:
    st = remotecuda.stats()
    return st["fast_reads"], st["blocking_round_trips"]


def _reads(dev: str) -> list:
    """Reads of tensors made (and read once) before: each a value read with nothing queued."""
    values = [torch.tensor([2.5], device=dev), torch.tensor(7, device=dev), torch.tensor([True], device=dev),
              torch.tensor([1 - 2j], device=dev), torch.tensor([0.1], dtype=torch.float16, device=dev),
              torch.tensor([-(2 ** 62)], device=dev), torch.arange(6, device=dev).view(2, 3)]
    for v in values:
        v.sum().item()  # (a general read: what was queued for it has run)
    out: list = []
    for v in values[:-1]:
        out += [v.item(), bool(v), float(v.real) if v.is_complex() else float(v)]
    grid = values[-1]
    out += [grid.tolist(), grid.cpu(), grid[1].cpu(), grid.t().cpu()]
    return out


def test_reads_go_fast_and_equal_local(remote):
    local = _reads("cpu")
    before = _counts()
    got = _reads("cuda")
    fast, trips = (a - b for a, b in zip(_counts(), before))
    # the seven sums' reads, and three of views (queued ops: real, [1], t()), went the general way
    assert fast == trips - 10 == 19, (fast, trips)
    for g, want in zip(got, local, strict=True):
        if isinstance(want, torch.Tensor):
            assert g.device.type == "cpu" and g.dtype == want.dtype and torch.equal(g, want)
        else:
            assert type(g) is type(want) and g == want


def test_a_read_after_queued_ops_takes_the_general_path(remote):
    x = torch.tensor([1.0], device="cuda")
    x.item()
    fast0, _ = _counts()
    y = x * 3  # queued: the read must wait for it
    assert y.item() == 3.0 and _counts()[0] == fast0
    assert y.item() == 3.0 and _counts()[0] == fast0 + 1  # (now nothing is queued)
    s = remotecuda.runtime.active().pool.sessions[0]
    s.fast_read = False  # a worker that does not offer READ (an older gateway): the general path
    try:
        assert (y + 1).item() == 4.0 and y.item() == 3.0 and _counts()[0] == fast0 + 1
    finally:
        s.fast_read = True


def test_a_refused_read_raises_local_pytorchs_error(remote):
    x = torch.ones(2, device="cuda")
    x.sum().item()
    fast0, _ = _counts()
    with pytest.raises(RuntimeError) as local:
        torch.ones(2).item()
    with pytest.raises(RuntimeError) as got:
        x.item()  # the worker sends it the general way, whose reply carries the error
    assert str(got.value) == str(local.value) and _counts()[0] == fast0
    y = x.sum()
    assert y.item() == 2.0 and y.item() == 2.0 and _counts()[0] == fast0 + 1  # the session goes on, fast again


def _read_frames(c: Client, kind: int, handle: int) -> list:
    c.seq += 1
    c.rid += 1
    frames = fastread.encode_read(kind, c.rid, 0, handle, c.seq)
    return c.peer.seal(frames, auth.DIRECT) if c.peer is not None else frames


def _answer(c: Client, sock: zmq.Socket) -> protocol.Message:
    assert sock.poll(20000), "the worker did not answer"
    frames = sock.recv_multipart()
    head = protocol.decode_header(frames[0])
    if c.peer is not None:
        c.peer.last.clear()
        c.peer.open(frames, range(256), head)
    return fastread.decode_value(frames, head) if head.type == protocol.VALUE else protocol.decode(frames)


def test_a_read_while_the_executor_is_busy_waits_its_turn(fresh_gateway):
    c = Client(fresh_gateway.endpoint)
    try:
        c.hello()
        sock, channel = c.direct()
        a = torch.rand(300, 300)
        ha, up, pl = c.upload_op(a, 0)
        hx = c.handle()
        ops = [up, ["aten::zeros.default", [[1]], {"dtype": torch.float64}, [hx]]]
        for _ in range(60):  # busy for a while on the executor thread
            ops.append(["aten::mm.default", [Handle(ha), Handle(ha)], None, [c.handle()]])
            ops.append(["aten::add_.Scalar", [Handle(hx), 1], None, [hx]])
        c.send(protocol.OPS, {"ops": ops, "n0": 0}, [pl], sock=sock, channel=channel)
        sock.send_multipart(_read_frames(c, fastread.ITEM, hx))
        msg = _answer(c, sock)
        assert msg.type == protocol.REPLY and msg.body["rid"] == c.rid and msg.body["res"] == 60.0
        for _ in range(50):  # idle once its reply's bookkeeping is done (a loaded machine: a moment after)
            sock.send_multipart(_read_frames(c, fastread.ITEM, hx))
            msg = _answer(c, sock)
            assert msg.body["res"] == 60.0
            if msg.type == protocol.VALUE:
                break
            time.sleep(0.05)
        assert msg.type == protocol.VALUE
        sock.close(0)
    finally:
        c.close()


@pytest.fixture(scope="module")
def tokened(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    gw = GatewayProcess("--token-file", str(path))
    yield gw
    gw.stop()


def test_a_forged_or_replayed_read_is_refused(tokened, monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    c = Client(tokened.endpoint)
    try:
        c.hello()
        sock, channel = c.direct()
        x = torch.tensor([4.25])
        hx, up, pl = c.upload_op(x, 0)
        assert c.request([up], [pl], sock=sock, channel=channel).type == protocol.REPLY
        read = _read_frames(c, fastread.ITEM, hx)
        sock.send_multipart(read)
        msg = _answer(c, sock)
        assert msg.type == protocol.VALUE and msg.body["res"] == 4.25
        sock.send_multipart(read)  # replayed
        assert "replayed" in _answer(c, sock).body["msg"]
        # another handle under the same MAC (digest and CRC fixed up): the MAC catches it
        forged = _read_frames(c, fastread.ITEM, hx)
        head = protocol.decode_header(forged[0])
        body = struct.pack("<BQQQ", fastread.ITEM, c.rid, 0, hx + 1)
        signed = struct.pack("<4sBBBBQIIQ", protocol.MAGIC, protocol.VERSION, protocol.READ, head.flags,
                             head.channel, head.seq, len(body), 0, xxhash.xxh3_64_intdigest(body))
        sock.send_multipart([protocol.finish_header(signed, head.mac), body])
        assert "authentication failed" in _answer(c, sock).body["msg"]
        sock.send_multipart(fastread.encode_read(fastread.ITEM, c.rid, 0, hx, 10 ** 9))  # unsealed
        assert "not authenticated" in _answer(c, sock).body["msg"]
        sock.send_multipart(_read_frames(c, fastread.ITEM, hx))  # the session goes on
        assert _answer(c, sock).body["res"] == 4.25
        sock.close(0)
        c.send(protocol.BYE, {})
    finally:
        c.close()
    still_served(tokened)


def test_malformed_reads_and_values_are_protocol_errors():
    for frames in (fastread.encode_read(fastread.ITEM, 1, 0, 1, 1)[:1],
                   protocol.encode_bytes(protocol.READ, b"\x07" + bytes(24)),
                   protocol.encode_bytes(protocol.READ, b"\x00" * 5)):
        with pytest.raises(protocol.ProtocolError):
            fastread.decode_read(frames, protocol.decode_header(frames[0]))
    for body in (b"", struct.pack("<QB", 1, 9), struct.pack("<QB", 1, 3) + b"\0",
                 struct.pack("<QBBB", 1, 6, 0, 1) + struct.pack("<Q", 3) + bytes(4),
                 struct.pack("<QBBB", 1, 6, 99, 0)):
        frames = protocol.encode_bytes(protocol.VALUE, body)
        with pytest.raises(protocol.ProtocolError):
            fastread.decode_value(frames, protocol.decode_header(frames[0]))


# ---------------------------------------------------------------- reads routed around torch's dispatcher
def _plain_reads(x: torch.Tensor, grid: torch.Tensor) -> list:
    return [x.item(), float(x.detach()), int(x), bool(x), x.tolist(), grid.tolist(), f"{x:.3f}"]


def test_value_reads_go_straight_to_the_session(remote):
    """``item()``, ``float()``, ``int()``, ``bool()`` and ``tolist()`` of a remote tensor take the
    session directly (value_reads.py): no dispatch of ``_local_scalar_dense`` or ``_to_copy``
    through torch's C++ and the dispatcher (no metadata-cache bypass counted), the same values."""
    def made(dev: str) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor(-2.75, device=dev, requires_grad=True) * 1  # (item() of a grad tensor: plain)
        grid = torch.arange(6.0, device=dev).view(2, 3)
        x.sum().item(), grid.sum().item()  # (what was queued for them has run)
        return x, grid
    local = _plain_reads(*made("cpu"))
    x, grid = made("cuda")
    st = remotecuda.stats()
    bypassed, fast = sum(st["metadata_cache_bypass_reasons"].values()), st["fast_reads"]
    got = _plain_reads(x, grid)
    st = remotecuda.stats()
    assert sum(st["metadata_cache_bypass_reasons"].values()) == bypassed  # (torch's path counts one a read)
    # (format's item() too; float() of the detached view waits for the detach queued before it)
    assert st["fast_reads"] - fast == 6
    assert got == local and [type(g) for g in got] == [type(v) for v in local]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
                                   torch.int64, torch.bool, torch.complex64, torch.uint64])
def test_routed_reads_convert_as_torch_does(remote, dtype):
    values = {torch.bool: [True, False], torch.uint8: [0, 255], torch.int8: [-128, 7],
              torch.uint64: [2 ** 63 + 5, 3], torch.complex64: [1 - 2j, 0j]}.get(
        dtype, [-2.5, float("inf"), float("nan"), 2 ** 40 + 0.5] if dtype.is_floating_point else [-(2 ** 62), 0])

    def reads(dev: str) -> list:
        out: list = []
        for v in values:
            t = torch.tensor(v, dtype=dtype, device=dev)
            t.sum().item()
            for read in (t.item, t.__float__, t.__int__, t.__bool__, t.tolist):
                try:
                    r = read()
                    out.append((type(r), r if r == r else "nan"))
                except Exception as e:  # (the same refusal: torch's own, as on a GPU)
                    out.append((type(e), str(e)))
        return out
    assert reads("cuda") == reads("cpu")


def test_refusals_before_dispatch_stay_torchs(remote):
    """A read of another number of elements than one is refused by torch's C++ before any
    dispatch, in each method's own words; the route leaves it to torch."""
    def refusals(dev: str) -> list:
        out = []
        for t in (torch.ones(2, device=dev), torch.ones(0, device=dev)):
            for read in (t.item, t.__float__, t.__int__, t.__bool__):
                with pytest.raises(Exception) as e:
                    read()
                out.append((type(e.value), str(e.value)))
        return out
    assert refusals("cuda") == refusals("cpu")


def test_what_stands_in_torchs_path_still_sees_a_read(remote):
    """A user's dispatch mode sees ``_local_scalar_dense``; a function mode and a subclass's
    ``__torch_function__`` see the method; ``torch.jit.trace`` warns of the read: as locally."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    class Functions(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    class Tagged(torch.Tensor):
        seen: list = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.seen.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    def seen(dev: str) -> list:
        x = torch.tensor([3.5], device=dev)
        x.sum().item()
        with Ops() as ops:
            values = [x.item(), float(x), int(x), bool(x)]
        with Functions() as fns:
            values += [x.item(), float(x), int(x), bool(x), x.tolist()]
        Tagged.seen = []
        tagged = x.as_subclass(Tagged)
        values += [tagged.item(), float(tagged), bool(tagged)]
        return [values, ops.seen, fns.seen, Tagged.seen]
    assert seen("cuda") == seen("cpu")

    def traced(dev: str) -> list:
        with pytest.warns(torch.jit.TracerWarning, match="Converting a tensor to a Python number"):
            torch.jit.trace(lambda t: t * t.item(), torch.tensor([2.0], device=dev))
        return [True]
    assert traced("cuda") == traced("cpu")


def test_float_of_a_tensor_requiring_grad_warns_as_torch_does(gateway):
    """torch warns once (C++'s warn-once) at ``float()`` of a tensor requiring grad: the read goes
    torch's way there, and the program sees the warning."""
    r = run_python(textwrap.dedent("""
        import warnings, torch, remotecuda
        remotecuda.activate()
        x = torch.tensor([1.5], device="cuda", requires_grad=True) * 2
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert float(x) == 3.0 and float(x) == 3.0 and x.item() == 3.0
        print([str(m.message).split(".")[0] for m in w])
    """), env={"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_FALLBACK": "error"})
    assert r.returncode == 0, r.stderr[-3000:]
    warned = "Converting a tensor with requires_grad=True to a scalar may lead to unexpected behavior"
    assert r.stdout.strip() == repr([warned])
