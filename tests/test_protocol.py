"""The wire protocol: encode/decode round trips, fuzzed decoding, and bad input sent by
hand to a real gateway process while well-behaved clients keep being served."""
from __future__ import annotations

import os
import socket
import struct
import tempfile
import threading
import time
import zlib

import msgpack
import pytest
import torch
import xxhash
import zmq
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remotecuda_wire import frames as wire
from remotecuda_wire import protocol
from remotecuda_wire.protocol import Handle, ProtocolError

from conftest import GatewayProcess, run_python, wait_for

# ============================================================================ unit level


def _roundtrip_tensor(t: torch.Tensor, codec=None) -> tuple[torch.Tensor, list]:
    desc, frame = protocol.encode_payload(protocol.tensor_bytes(t), codec)
    frames = protocol.encode(protocol.OPS, {"ops": [["rc::upload", [1, 0, t.dtype, list(t.shape), None], None, None]]},
                             [(desc, frame)], seq=7)
    frames = [bytes(f) for f in frames]  # what the wire delivers
    msg = protocol.decode(frames)
    assert msg.type == protocol.OPS and msg.seq == 7
    (d, f), = msg.payloads
    _, (h, idx, dtype, shape, _key), _, _ = msg.body["ops"][0]
    assert (h, idx, dtype, shape) == (1, 0, t.dtype, list(t.shape))
    out = protocol.tensor_from_bytes(protocol.decode_payload(d, f), dtype, shape)
    return out, desc


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool,
                                   torch.int64, torch.int8, torch.uint8, torch.complex64, torch.complex128])
@pytest.mark.parametrize("shape", [(3, 5), (0,), (2, 0, 4), ()])
def test_tensor_roundtrip(dtype, shape):
    g = torch.Generator().manual_seed(0)
    if dtype.is_complex:
        t = torch.randn(shape, dtype=dtype, generator=g)
    elif dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
    elif dtype == torch.bool:
        t = torch.rand(shape, generator=g) > 0.5
    else:
        t = torch.randint(0, 100, shape, generator=g).to(dtype)
    out, desc = _roundtrip_tensor(t)
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t)
    assert desc[0] == t.numel() * t.element_size()


def test_noncontiguous_conj_and_neg_views_roundtrip():
    base = torch.randn(6, 4, dtype=torch.complex64)
    for t in (base.t(), base.conj(), base[::2, 1:], torch.randn(4, 4).t()[1:]):
        out, _ = _roundtrip_tensor(t)
        assert torch.equal(out, t.resolve_conj())


@pytest.mark.parametrize("codec", protocol.CODECS)
def test_compressed_frames_kept_only_where_they_save(codec):
    zeros = torch.zeros(64, 1024)  # 256 KiB that compresses to almost nothing
    out, desc = _roundtrip_tensor(zeros, codec)
    assert desc[1] == codec and torch.equal(out, zeros)
    frame = protocol.encode_payload(protocol.tensor_bytes(zeros), codec)[1]
    assert len(frame) < 2048
    noise = torch.randn(64, 1024)  # float noise barely compresses: sent raw even when asked
    out, desc = _roundtrip_tensor(noise, codec)
    assert desc[1] == "raw" and torch.equal(out, noise)
    assert _roundtrip_tensor(zeros)[1][1] == "raw"
    forced, desc = _roundtrip_tensor(torch.arange(5000, dtype=torch.int64), codec)
    assert desc[1] == codec and torch.equal(forced, torch.arange(5000))


def test_body_values_roundtrip():
    body = {"a": [Handle(3), Handle(2**63 + 5)], "dt": [torch.bfloat16, torch.bool, torch.complex64],
            "dev": [torch.device("cuda", 1), torch.device("cpu")], "mf": torch.channels_last,
            "lay": torch.strided, "c": 1.5 - 2j, "size": torch.Size([2, 3]), "s": "x", "n": None,
            "f": 0.1, "i": -7, "b": b"\x00\x01"}
    msg = protocol.decode(protocol.encode(protocol.REPLY, body, seq=3))
    got = msg.body
    assert got["a"] == [Handle(3), Handle(2**63 + 5)]
    assert got["dt"] == [torch.bfloat16, torch.bool, torch.complex64]
    assert got["dev"] == [torch.device("cuda:1"), torch.device("cpu")]
    assert got["mf"] is torch.channels_last and got["lay"] is torch.strided
    assert got["c"] == 1.5 - 2j and got["size"] == [2, 3]
    assert (got["s"], got["n"], got["f"], got["i"], got["b"]) == ("x", None, 0.1, -7, b"\x00\x01")
    with pytest.raises(TypeError, match="cannot send"):
        protocol.encode(protocol.OPS, {"x": object()})


def test_decode_rejects_each_kind_of_damage():
    frames = protocol.encode(protocol.OPS, {"ops": []}, [protocol.encode_payload(memoryview(b"abcd"))])
    assert protocol.decode(frames).payloads[0][0][0] == 4
    cases = {
        "header and body frames are required": frames[:1],
        f"header is {protocol.HEADER_SIZE - 1} bytes": [frames[0][:-1], *frames[1:]],
        "header integrity check failed": [bytes([frames[0][0] ^ 1]) + frames[0][1:], *frames[1:]],
        "body is": [frames[0], frames[1][:-1], frames[2]],
        "body integrity check failed": [frames[0], bytes([frames[1][0] ^ 0x40]) + frames[1][1:], frames[2]],
        "0 payload frames, header says 1": frames[:2],
        "2 payload frames, header says 1": [*frames, b"extra"],
    }
    for why, bad in cases.items():
        with pytest.raises(ProtocolError, match=why):
            protocol.decode(bad)


# ---------------------------------------------------------------------------- fuzzing

_VALID = protocol.encode(
    protocol.OPS,
    {"ops": [["aten::add.Tensor", [Handle(1), Handle(2)], {"alpha": 2}, [3]],
             ["aten::empty.memory_format", [[2, 3]], {"dtype": torch.bfloat16, "device": torch.device("cuda:0"),
                                                     "memory_format": torch.contiguous_format}, [4]],
             ["aten::mul.Scalar", [Handle(3), 1 + 2j], {}, [5]],
             ["rc::fetch", [5], None, {"base": None}]],
     "n0": 12, "rel": [7, 8], "req": 1},
    [protocol.encode_payload(memoryview(bytes(range(256)) * 20), "zstd"),
     protocol.encode_payload(memoryview(b"\x01\x02\x03\x04"))], seq=5)
_VALID = [bytes(f) for f in _VALID]


def _seal(body: bytes, n_pl: int, msg_type: int = protocol.OPS, version: int = protocol.VERSION,
          magic: bytes = protocol.MAGIC, seq: int = 0, body_len: int | None = None) -> bytes:
    """A header with valid checks around whatever body bytes (so mutations reach the parser)."""
    head = struct.pack("<4sBBBBQIIQ", magic, version, msg_type, 0, 0, seq,
                       len(body) if body_len is None else body_len, n_pl, xxhash.xxh3_64_intdigest(body))
    head += bytes(protocol.MAC_SIZE)  # unsealed
    return head + struct.pack("<I", zlib.crc32(head))


def _mutate(data: bytes, edits: list) -> bytes:
    b = bytearray(data)
    for pos, val, kind in edits:
        if kind == 0 and b:
            b[pos % len(b)] = val
        elif kind == 1:
            b.insert(pos % (len(b) + 1), val)
        elif kind == 2 and b:
            del b[pos % len(b)]
    return bytes(b)


_edits = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255), st.integers(0, 2)), min_size=1, max_size=8)


def _decode_fully(frames: list) -> None:
    """Everything a gateway does with a message before executing it."""
    msg = protocol.decode(frames)
    for desc, frame in msg.payloads:
        protocol.decode_payload(desc, frame)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame_index=st.integers(0, 3), edits=_edits)
def test_random_mutations_only_raise_protocol_error(frame_index, edits):
    frames = list(_VALID)
    frames[frame_index] = _mutate(frames[frame_index], edits)
    try:
        _decode_fully(frames)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=_edits)
def test_mutated_bodies_with_valid_checksums_only_raise_protocol_error(edits):
    # the integrity checks stop random damage early; re-seal it so the msgpack parser sees it
    body = _mutate(_VALID[1], edits)
    try:
        _decode_fully([_seal(body, 2, seq=5), body, *_VALID[2:]])
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=200), n_frames=st.integers(0, 3))
def test_arbitrary_bodies_only_raise_protocol_error(body, n_frames):
    try:
        _decode_fully([_seal(body, n_frames), body, *([b"x" * 8] * n_frames)])
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(desc=st.one_of(st.lists(st.one_of(st.integers(-2**64 + 1, 2**64 - 1), st.text(max_size=5), st.none(),
                                          st.binary(max_size=8)), max_size=4), st.integers(), st.none()),
       frame=st.binary(max_size=64))
def test_arbitrary_payload_descriptors_only_raise_protocol_error(desc, frame):
    try:
        protocol.decode_payload(desc, frame)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(codec=st.sampled_from(protocol.CODECS), raw_n=st.integers(0, 1 << 20), frame=st.binary(max_size=256),
       data=st.binary(min_size=1, max_size=4096), cut=st.integers(0, 4096))
def test_damaged_compressed_frames_only_raise_protocol_error(codec, raw_n, frame, data, cut):
    real = protocol.CODEC_IMPLS[codec].compress(memoryview(data * 8))
    for n, f in ((raw_n, frame), (len(data) * 8, real[:cut]), (raw_n, real)):
        try:
            protocol.decode_payload([n, codec, protocol.payload_digest(data * 8)], f)
        except ProtocolError:
            pass


def test_frames_send_and_recv_keep_a_message_whole():
    """remotecuda_wire/frames.py, the value read's send and receive: every frame in order, one
    message at a time (a frame's ``more`` flag, not RCVMORE), tracked sends, NOBLOCK's Again."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://test-frames")
        b.connect("inproc://test-frames")
        msg = protocol.encode(protocol.OPS, {"ops": [], "n0": 0}, [protocol.encode_payload(memoryview(b"x" * 70000))])
        wire.send(a, msg, copy=False)
        wire.send(a, [b"one"])
        tracker = wire.send(a, [b"h", bytes(100_000)], copy=False, track=True)
        got = wire.recv(b)
        assert [bytes(f) for f in got] == [bytes(f) for f in msg]
        assert protocol.decode(got).payloads[0][1].bytes == b"x" * 70000
        assert [f.bytes for f in wire.recv(b, zmq.NOBLOCK)] == [b"one"]
        assert [len(f.bytes) for f in wire.recv(b)] == [1, 100_000]
        tracker.wait(5)
        with pytest.raises(zmq.Again):
            wire.recv(b, zmq.NOBLOCK)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


# ============================================================================ against a real gateway

@pytest.fixture(scope="module")
def gw():
    g = GatewayProcess("--spare", "2")
    yield g
    g.stop()


def fetched(msg: protocol.Message) -> torch.Tensor:
    """The tensor an ``rc::fetch`` REPLY carries."""
    assert msg.type == protocol.REPLY and msg.body["err"] is None, msg.body
    res = msg.body["res"]
    return protocol.tensor_from_bytes(protocol.decode_payload(*msg.payloads[res["pl"]]), res["dtype"],
                                      res["shape"]).clone()


class RawClient:
    """A DEALER socket speaking the protocol by hand."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.seq = self.rid = self.h = 0

    def close(self) -> None:
        self.sock.close(0)

    def send_frames(self, frames: list) -> None:
        self.sock.send_multipart(frames)

    def send(self, msg_type: int, body: dict, payloads=()) -> None:
        self.seq += 1
        self.sock.send_multipart(protocol.encode(msg_type, body, payloads, self.seq))

    def recv(self, timeout: float = 20.0) -> protocol.Message:
        assert self.sock.poll(int(timeout * 1000)), "the gateway did not answer"
        return protocol.decode(self.sock.recv_multipart())

    def quiet(self, timeout: float = 0.3) -> bool:
        """Nothing more arrives (no stray replies)."""
        return not self.sock.poll(int(timeout * 1000))

    def error(self) -> str:
        msg = self.recv()
        assert msg.type == protocol.ERROR, (protocol.TYPE_NAMES[msg.type], msg.body)
        return msg.body["msg"]

    def hello(self) -> dict:
        self.send(protocol.HELLO, {"device": 0})
        msg = self.recv(60)
        assert msg.type == protocol.WELCOME and msg.body["session"] is True, msg.body
        return msg.body

    def handle(self) -> int:
        self.h += 1
        return self.h

    def request(self, ops: list, payloads=(), req_op=None) -> protocol.Message:
        """Send ops plus a request op; return the REPLY (or an ERROR)."""
        self.rid += 1
        ops = [*ops, req_op or ["rc::sync", [], None, {"base": None}]]
        self.send(protocol.OPS, {"ops": ops, "n0": 0, "req": self.rid}, payloads)
        while True:
            msg = self.recv()
            if msg.type != protocol.REPLY or msg.body.get("rid") == self.rid:
                return msg

    def upload_op(self, t: torch.Tensor, idx: int) -> tuple[int, list, tuple]:
        h = self.handle()
        return h, ["rc::upload", [h, idx, t.dtype, list(t.shape), None], None, None], \
            protocol.encode_payload(protocol.tensor_bytes(t))

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """HELLO'd session: upload a and b, aten::add, fetch."""
        ha, up_a, pa = self.upload_op(a, 0)
        hb, up_b, pb = self.upload_op(b, 1)
        hc = self.handle()
        msg = self.request([up_a, up_b, ["aten::add.Tensor", [Handle(ha), Handle(hb)], {"alpha": 2}, [hc]]],
                           [pa, pb], ["rc::fetch", [hc], None, {"base": None}])
        out = fetched(msg)
        self.send(protocol.OPS, {"ops": [], "rel": [ha, hb, hc]})
        return out


@pytest.fixture(scope="module")
def good(gw):
    """A well-behaved client with a session, checked after every bad input."""
    c = RawClient(gw.endpoint)
    c.hello()
    yield c
    c.send(protocol.BYE, {})
    c.close()


_checks = [0]


def assert_still_served(gw, good) -> None:
    assert gw.proc.poll() is None, "the gateway process died"
    _checks[0] += 1
    g = torch.Generator().manual_seed(_checks[0])
    a, b = torch.randn(64, 33, generator=g), torch.randn(64, 33, generator=g)
    assert torch.equal(good.add(a, b), torch.add(a, b, alpha=2))
    # and a newcomer is still answered (a full new session: see the library client test)
    c = RawClient(gw.endpoint)
    try:
        c.send(protocol.HELLO, {"device": None})
        msg = c.recv()
        assert msg.type == protocol.WELCOME and msg.body["protocol"] == protocol.VERSION
    finally:
        c.close()


@pytest.fixture
def bad(gw):
    c = RawClient(gw.endpoint)
    yield c
    c.close()


@pytest.fixture(scope="module")
def offender(gw):
    """One misbehaving client with a session; its session must survive each rejected message."""
    c = RawClient(gw.endpoint)
    c.hello()
    yield c
    c.send(protocol.BYE, {})
    c.close()


@pytest.fixture
def bad_session(offender):
    assert offender.quiet(0.05), "a stray message from the previous test"
    return offender


def _header_only(msg_type=protocol.HELLO, body=None):
    return protocol.encode(msg_type, body if body is not None else {"device": 0})[:1]


def test_good_client_baseline(gw, good):
    assert_still_served(gw, good)


@pytest.mark.parametrize("case", ["header_only", "short_body", "missing_payload", "extra_payload"])
@pytest.mark.parametrize("in_session", [False, True], ids=["supervisor", "worker"])
def test_truncated_messages(gw, good, bad, offender, case, in_session):
    if in_session:
        bad = offender
    t = protocol.OPS if in_session else protocol.HELLO
    body = {"ops": [], "n0": 0, "req": 1} if in_session else {"device": 0}
    pl = [protocol.encode_payload(memoryview(b"\x00" * 16))] * 2
    frames = [bytes(f) for f in protocol.encode(t, body, pl, seq=1)]
    expect = {
        "header_only": (frames[:1], "truncated message: header and body frames are required"),
        "short_body": ([frames[0], frames[1][:-3], *frames[2:]], r"truncated message: body is \d+ bytes, header says"),
        "missing_payload": (frames[:3], "truncated message: 1 payload frames, header says 2"),
        "extra_payload": ([*frames, b"zz"], "3 payload frames, header says 2"),
    }
    bad.send_frames(expect[case][0])
    msg = bad.recv()
    assert msg.type == protocol.ERROR and msg.body["kind"] == "protocol"
    import re
    assert re.search(expect[case][1], msg.body["msg"]), msg.body["msg"]
    assert bad.quiet()
    if in_session:  # the offender's own session survives a rejected message
        x = torch.ones(5)
        assert torch.equal(bad.add(x, x), x * 3)
    assert_still_served(gw, good)


def test_wrong_protocol_version(gw, good, bad, offender):
    body = protocol.pack_body({"device": 0})
    bad.send_frames([_seal(body, 0, protocol.HELLO, version=99), body])
    assert f"protocol version 99 is not supported (this side speaks {protocol.VERSION})" in bad.error()
    # and in a session, to the worker path: the supervisor checks every header
    bad = offender
    body = protocol.pack_body({"ops": [], "req": 1})
    bad.send_frames([_seal(body, 0, protocol.OPS, version=99), body])
    assert "protocol version 99" in bad.error()
    assert bad.quiet()
    assert_still_served(gw, good)


@pytest.mark.parametrize("in_session", [False, True], ids=["supervisor", "worker"])
def test_corrupted_body_digest(gw, good, bad, offender, in_session):
    if in_session:
        bad = offender
    t, body = (protocol.OPS, {"ops": [], "req": 1}) if in_session else (protocol.HELLO, {"device": 0})
    head, data = protocol.encode(t, body, seq=1)
    data = bytes([data[0]]) + bytes([data[1] ^ 0x01]) + data[2:]
    bad.send_frames([head, data])
    assert bad.error() == "body integrity check failed"
    # a corrupted payload frame is caught by its own digest
    if in_session:
        x = torch.arange(8.0)
        h, up, (desc, frame) = bad.upload_op(x, 0)
        frame = bytearray(frame)
        frame[3] ^= 0xFF
        msg = bad.request([up], [(desc, bytes(frame))])
        assert msg.type == protocol.ERROR and msg.body["msg"] == "payload integrity check failed"
        assert bad.quiet()
    assert_still_served(gw, good)


def test_garbage(gw, good, bad):
    bad.send_frames([b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"])
    assert bad.error() == f"header is 27 bytes, expected {protocol.HEADER_SIZE}"
    bad.send_frames([os.urandom(protocol.HEADER_SIZE), b"body"])
    assert bad.error() == "header integrity check failed"
    bad.send_frames([_seal(b"\x80", 0, magic=b"HTTP"), b"\x80"])
    assert bad.error() == "not a RemoteCUDA message (bad magic)"
    bad.send_frames([_seal(b"\x80", 0, msg_type=77), b"\x80"])
    assert bad.error() == "unknown message type 77"
    bad.send_frames([_seal(b"\xc1\xc1", 0, msg_type=protocol.HELLO), b"\xc1\xc1"])
    assert bad.error().startswith("malformed message body")
    body = msgpack.packb([1, 2, 3])
    bad.send_frames([_seal(body, 0, msg_type=protocol.HELLO), body])
    assert bad.error() == "message body is not a map"
    body = msgpack.packb({"x": msgpack.ExtType(42, b"?")})
    bad.send_frames([_seal(body, 0, msg_type=protocol.HELLO), body])
    assert bad.error() == "unknown extension code 42"
    bad.send(protocol.REPLY, {"rid": 1})
    assert bad.error() == "unexpected message type REPLY"
    bad.send(protocol.OPS, {"ops": []})
    msg = bad.recv()
    assert msg.type == protocol.ERROR and msg.body["kind"] == "no_session"
    bad.send(protocol.HELLO, {"device": 5})
    assert "has no device 5" in bad.error()
    # raw bytes that are not even ZMTP, on the same port
    with socket.create_connection((gw.address.split(":")[0], int(gw.address.split(":")[1])), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(4096))
        time.sleep(0.2)
    assert_still_served(gw, good)


def test_malformed_ops_in_a_session(gw, good, bad_session):
    bad = bad_session
    bad.send(protocol.OPS, {"ops": {"not": "a list"}})
    assert bad.error() == "malformed ops list"
    bad.send(protocol.OPS, {"ops": [["aten::add.Tensor", []]]})
    assert bad.error() == "malformed op record at position 0"
    pl = [protocol.encode_payload(memoryview(b"\x00" * 16))]
    bad.send(protocol.OPS, {"ops": 5, "req": 1}, pl)  # with a payload: the worker checks it against its upload first
    assert bad.error() == "payload 0 is not named by a well-formed rc::upload of its message"
    for args in ["nonsense", [1, 0], [1, 0, torch.float32, ["x"], None], [1, 0, "f32", [4], None],
                 [1, 0, torch.float32, [2**62, 2**62], None], [1, 0, torch.float32, [4], b"not the digest"]]:
        # a malformed upload, and the same upload skipped behind a failed op
        for ops in ([["rc::upload", args, None, None]],
                    [["aten::definitely_not_an_op.default", [], {}, [7]], ["rc::upload", args, None, None]]):
            msg = bad.request(ops, pl)
            assert (msg.type == protocol.REPLY and msg.body["err"]) or \
                (msg.type == protocol.ERROR and msg.body["kind"] == "protocol"), msg.body
            assert bad.quiet(0.05)
    bad.send(protocol.OPS, {"ops": [], "rel": 5})  # used to kill the session worker
    assert "malformed release list" in bad.error()
    bad.send(protocol.OPS, {"ops": [], "rel": [[1], {"a": 1}]})
    assert "malformed release list" in bad.error()
    for at in (5, [0, 0], ["x"], [None]):
        bad.send(protocol.OPS, {"ops": [], "rel": [1], "rel_at": at})
        assert "malformed release positions" in bad.error()
    assert bad.quiet()
    x = torch.ones(3)
    assert torch.equal(bad.add(x, x), x * 3)
    assert_still_served(gw, good)


def test_a_tensor_is_freed_where_the_client_dropped_it(gw, good):
    """``rel_at`` frees a handle right after the ops queued before the client dropped it, not
    at the end of the message: a message holding several steps then peaks at one step's memory."""
    c = RawClient(gw.endpoint)
    c.hello()
    try:
        xh, x_up, x_pl = c.upload_op(torch.ones(3), 0)
        y, z = c.handle(), c.handle()
        ops = [x_up, ["aten::mul.Scalar", [Handle(xh), 2.0], None, [y]],
               ["aten::mul.Scalar", [Handle(xh), 3.0], None, [z]]]
        fetch_z = ["rc::fetch", [z], None, {"base": None}]
        c.rid += 1
        c.send(protocol.OPS, {"ops": [*ops, fetch_z], "n0": 0, "rel": [xh], "rel_at": [2], "req": c.rid}, [x_pl])
        msg = c.recv()  # x was freed after the first mul: the second one cannot find it
        assert msg.body["err"] and "unknown to the gateway" in msg.body["err"]["msg"], msg.body
        xh, x_up, x_pl = c.upload_op(torch.ones(3), 0)
        ops = [x_up, ["aten::mul.Scalar", [Handle(xh), 2.0], None, [y]],
               ["aten::mul.Scalar", [Handle(xh), 3.0], None, [z]]]
        for rel_at in ([3], [3, 2], None):  # after its last use (in any order), or (no rel_at) at the end
            c.rid += 1
            rel = [xh, y][:len(rel_at or [0])]
            body = {"ops": [*ops, fetch_z], "n0": 0, "rel": rel, "req": c.rid}
            if rel_at is not None:
                body["rel_at"] = rel_at
            c.send(protocol.OPS, body, [x_pl])
            assert torch.equal(fetched(c.recv()), torch.full((3,), 3.0))
    finally:
        c.send(protocol.BYE, {})
        c.close()
    assert_still_served(gw, good)


def test_unknown_op_and_namespace(gw, good, bad_session):
    bad = bad_session
    x = torch.arange(6.0)
    h, up, pl = bad.upload_op(x, 0)
    out1, out2 = bad.handle(), bad.handle()
    # asynchronous failure: reported with the reply to the next request, later ops skipped
    msg = bad.request([up, ["aten::definitely_not_an_op.default", [Handle(h)], {}, [out1]],
                       ["aten::neg.default", [Handle(h)], {}, [out2]]], [pl])
    assert msg.type == protocol.REPLY
    err = msg.body["err"]
    assert err["op"] == "aten::definitely_not_an_op.default" and err["index"] == 1
    assert err["type"] == "UnknownOpError"
    assert "has no op aten::definitely_not_an_op" in err["msg"] and torch.__version__ in err["msg"]
    # the skipped op's output was never computed, and says why
    msg = bad.request([], req_op=["rc::fetch", [out2], None, {"base": None}])
    assert "never computed" in msg.body["err"]["msg"] and "definitely_not_an_op" in msg.body["err"]["msg"]

    msg = bad.request([["os::system", ["echo pwned > /tmp/remotecuda-pwned"], {}, [bad.handle()]]])
    assert msg.body["err"]["type"] == "UnknownOpError"
    assert "namespace 'os' is not allowed" in msg.body["err"]["msg"]
    for name, why in [("aten::from_file.default", "is not allowed"), ("aten::add.Tensor; rm -rf", "malformed op name"),
                      ("prims::add.default", "namespace 'prims' is not allowed"),
                      ("aten::add.no_such_overload", "has no overload aten::add.no_such_overload"),
                      ("rc::no_such_internal", "unknown internal op rc::no_such_internal")]:
        msg = bad.request([[name, [], {}, [bad.handle()]]])
        assert why in msg.body["err"]["msg"], (name, msg.body)
    assert not os.path.exists("/tmp/remotecuda-pwned")
    # the error was delivered once; the session works again
    assert bad.request([]).body["err"] is None
    assert torch.equal(bad.add(x, x), x * 3)
    assert_still_served(gw, good)


def _zstd_without_size(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=False).compress(data)


def test_decompression_bombs_and_oversized_descriptors(gw, good, bad_session):
    bad = bad_session
    shape, dtype = [2048], torch.float32  # 8 KiB
    big = 256 << 20

    def upload(desc, frame, shape=shape):
        msg = bad.request([["rc::upload", [bad.handle(), 0, dtype, shape, None], None, None]], [(desc, frame)])
        assert msg.type == protocol.ERROR and msg.body["kind"] == "protocol", msg.body
        return msg.body["msg"]

    # a ~8 KiB zstd frame whose header says it inflates to 256 MiB, sent as an 8 KiB tensor
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(big))
    assert len(bomb) < 64 << 10 and zstandard.frame_content_size(bomb) == big
    msg = upload([8192, "zstd", protocol.payload_digest(bomb)], bomb)
    assert msg == f"zstd frame declares {big} bytes, descriptor says 8192"
    # the same without a declared size: inflation is capped by the descriptor
    bomb2 = _zstd_without_size(bytes(16 << 20))
    msg = upload([8192, "zstd", protocol.payload_digest(bomb2)], bomb2)
    assert msg == "zstd frame declares -1 bytes, descriptor says 8192"
    # 8 KiB of zeros, compressed, with a descriptor claiming 256 MiB
    small = zstandard.ZstdCompressor(level=1).compress(bytes(8192))
    msg = upload([big, "zstd", protocol.payload_digest(small)], small, [big // 4])
    assert msg == f"zstd frame declares 8192 bytes, descriptor says {big}"
    # a descriptor over the protocol's limit
    over = protocol.MAX_PAYLOAD_BYTES + 1
    msg = upload([over, "raw", protocol.payload_digest(b"abc")], b"abc", [over // 4])
    assert msg == f"payload declares {over} bytes, over the limit of {protocol.MAX_PAYLOAD_BYTES}"
    msg = upload([-1, "raw", protocol.payload_digest(b"abc")], b"abc")
    assert "payload declares -1 bytes" in msg
    msg = upload([8192, "brotli", protocol.payload_digest(b"abc")], b"abc")
    assert msg == f"unknown payload codec 'brotli' (this side decodes {', '.join(('raw', *protocol.CODECS))})"
    if "lz4" in protocol.CODECS:
        # an lz4 block inflates at most ~255-fold: a 4 KiB block cannot be 256 MiB
        block = protocol.CODEC_IMPLS["lz4"].compress(memoryview(bytes(big)))[:4096]
        msg = upload([big, "lz4", protocol.payload_digest(b"")], block, [big // 4])
        assert msg == f"lz4 block of 4096 bytes cannot hold {big} bytes"
        # a block of 8 MiB of zeros, sent as 8 KiB: decoding stops at the descriptor's size
        block = protocol.CODEC_IMPLS["lz4"].compress(memoryview(bytes(8 << 20)))
        msg = upload([8192, "lz4", protocol.payload_digest(bytes(8192))], block)
        assert msg.startswith("bad lz4 block")
    junk = b"\x28\xb5\x2f\xfd" + os.urandom(30)
    msg = upload([8192, "zstd", protocol.payload_digest(junk)], junk)
    assert "zstd" in msg
    # a small frame declaring 256 MiB, as its descriptor does, for an 8 KiB upload: refused by the
    # upload's dtype and shape before anything is decompressed
    msg = upload([big, "zstd", protocol.payload_digest(bytes(big))], bomb)
    assert msg == f"payload 0 declares {big} bytes; its upload's dtype and shape hold 8192"
    msg = upload(["8192", "raw", 0], b"abc")
    assert msg == "malformed payload descriptor"
    # the worker did not inflate anything: its memory stays far below the bomb's size
    import psutil
    children = psutil.Process(gw.proc.pid).children()
    assert children and max(c.memory_info().rss for c in children) < big + (200 << 20)
    assert bad.quiet()
    x = torch.ones(4)
    assert torch.equal(bad.add(x, x), x * 3)
    assert_still_served(gw, good)


def test_upload_descriptor_disagrees_with_frame(gw, good, bad_session):
    bad = bad_session
    x = torch.arange(1000, dtype=torch.float32)
    data = bytes(protocol.tensor_bytes(x))
    short = data[:3996]
    msg = bad.request([["rc::upload", [bad.handle(), 0, torch.float32, [1000], None], None, None]],
                      [([4000, "raw", protocol.payload_digest(short)], short)])
    assert msg.type == protocol.ERROR and msg.body["msg"] == "payload is 3996 bytes, descriptor says 4000"
    # descriptor and frame agree, but not with the tensor the upload op declares
    msg = bad.request([["rc::upload", [bad.handle(), 0, torch.float32, [999], None], None, None]],
                      [protocol.encode_payload(memoryview(data))])
    assert msg.type == protocol.ERROR
    assert msg.body["msg"] == "payload 0 declares 4000 bytes; its upload's dtype and shape hold 3996"
    # more descriptors than frames (the header agrees with the frames)
    body = protocol.pack_body({"ops": [], "pl": [[4, "raw", 0], [4, "raw", 0]], "req": 1})
    bad.send_frames([_seal(body, 1, protocol.OPS), body, b"abcd"])
    assert bad.error() == "payload descriptors do not match the payload frames"
    # an upload naming a payload index the message does not have: an op error, not a crash
    msg = bad.request([["rc::upload", [bad.handle(), 3, torch.float32, [1], None], None, None]])
    assert msg.type == protocol.REPLY and msg.body["err"]["type"] == "IndexError"
    assert bad.quiet()
    assert torch.equal(bad.add(x, x), x * 3)
    assert_still_served(gw, good)


_LIBRARY_CLIENT = r"""
import os, sys, time, torch, remotecuda
remotecuda.activate(sys.argv[1], fallback="error")
flag_started, flag_stop = sys.argv[2], sys.argv[3]
g = torch.Generator().manual_seed(0)
w = torch.randn(32, 32, generator=g)
wc = w.cuda()
n = 0
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    x = torch.randn(16, 32, generator=g)
    got = (x.cuda() @ wc).relu().sum(1).cpu()
    want = (x @ w).relu().sum(1)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got, want)
    n += 1
    if n == 3:
        open(flag_started, "w").close()
    if os.path.exists(flag_stop) and n > 10:
        break
    time.sleep(0.01)
print("ITERATIONS", n, torch.cuda.get_device_name(0))
"""


def test_library_client_keeps_working_during_an_attack(gw, good):
    """The real client library, in its own process, runs a checked loop while all of the
    bad input above is fired at the same gateway."""
    tmp = tempfile.mkdtemp()
    started, stop = os.path.join(tmp, "started"), os.path.join(tmp, "stop")
    script = os.path.join(tmp, "client.py")
    with open(script, "w") as f:
        f.write(_LIBRARY_CLIENT)
    result = {}
    th = threading.Thread(target=lambda: result.setdefault(
        "r", run_python("", args=[script, gw.address, started, stop], timeout=180)))
    th.start()
    try:
        assert wait_for(lambda: os.path.exists(started) or not th.is_alive(), 90), "library client never started"
        assert th.is_alive(), result["r"].stderr
        iterations_before = time.monotonic()
        bad = RawClient(gw.endpoint)
        try:
            body = protocol.pack_body({"device": 0})
            attacks = [[b"garbage"], [_seal(body, 0, protocol.HELLO, version=99), body],
                       _header_only(), [os.urandom(protocol.HEADER_SIZE), b"x"]]
            for frames in attacks * 5:
                bad.send_frames(frames)
                assert bad.recv().type == protocol.ERROR
            bad.hello()
            for _ in range(5):
                bad.send(protocol.OPS, {"ops": [], "rel": "x"})
                assert bad.recv().type == protocol.ERROR
                msg = bad.request([["os::system", ["true"], {}, [1]]])
                assert msg.body["err"]["type"] == "UnknownOpError"
                bomb = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))
                msg = bad.request([["rc::upload", [1, 0, torch.float32, [4], None], None, None]],
                                  [([16, "zstd", protocol.payload_digest(bomb)], bomb)])
                assert msg.type == protocol.ERROR
            bad.send(protocol.BYE, {})
        finally:
            bad.close()
        assert time.monotonic() - iterations_before < 60
    finally:
        open(stop, "w").close()
        th.join(200)
    r = result["r"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ITERATIONS" in r.stdout and "CPU" in r.stdout
    assert_still_served(gw, good)


def test_fuzzed_ops_messages_never_cost_the_session(gw, good, bad_session):
    """Mutated OPS bodies re-sealed with valid checks reach the worker's parser and executor:
    each costs at most an error, never the session or the gateway."""
    import random
    bad = bad_session
    rng = random.Random(20240611)
    x = torch.arange(64.0)
    h1, h2, h3 = 900001, 900002, 900003
    frames = protocol.encode(
        protocol.OPS,
        {"ops": [["rc::upload", [h1, 0, torch.float32, [64], None], None, None],
                 ["aten::mul.Scalar", [Handle(h1), 2.0], {}, [h2]],
                 ["aten::add.Tensor", [Handle(h1), Handle(h2)], {"alpha": 1}, [h3]],
                 ["aten::view.default", [Handle(h3), [8, 8]], {}, [h3 + 1]],
                 ["rc::fetch", [h3], None, {"base": 990000}]],
         "n0": 0, "rel": [h2], "req": 0},
        [protocol.encode_payload(protocol.tensor_bytes(x))])
    body, payload = bytes(frames[1]), bytes(frames[2])
    kinds = {}
    for _ in range(150):
        edits = [(rng.randrange(len(body)), rng.randrange(256), rng.randrange(3)) for _ in range(rng.randint(1, 4))]
        mutated = _mutate(body, edits)
        bad.seq += 1
        bad.send_frames([_seal(mutated, 1, protocol.OPS, seq=bad.seq), mutated, payload])
        sync = bad.request([])  # a well-formed request right behind it
        while sync.type == protocol.ERROR:
            assert sync.body["kind"] == "protocol", sync.body  # never session_lost
            kinds["error"] = kinds.get("error", 0) + 1
            sync = bad.request([]) if bad.quiet(0.05) else bad.recv()
        assert sync.type == protocol.REPLY
    assert gw.proc.poll() is None
    assert kinds.get("error", 0) > 10  # the mutations did reach the parser
    assert torch.equal(bad.add(x, x), x * 3)
    assert_still_served(gw, good)


# ============================================================================ the direct path's data port

def test_data_port_serves_only_its_session(gw, good):
    """A session worker's data port answers only the client holding the session's token;
    everyone else gets a clear error, and the session and the gateway go on."""
    owner = RawClient(gw.endpoint)
    offer = owner.hello()["direct"]
    data_ep = f"{gw.endpoint.rsplit(':', 1)[0]}:{offer['port']}"
    try:
        stranger = RawClient(data_ep)
        stranger.send(protocol.OPS, {"ops": [], "req": 1})
        assert "send HELLO with its token first" in stranger.error()
        stranger.send(protocol.HELLO, {"token": b"\x00" * 16})
        assert "send HELLO with its token first" in stranger.error()
        stranger.send(protocol.HELLO, {"token": "not bytes"})
        assert "send HELLO with its token first" in stranger.error()
        stranger.send_frames([b"garbage"])
        assert "header is 7 bytes" in stranger.error()
        stranger.close()
        direct = RawClient(data_ep)
        direct.send(protocol.HELLO, {"token": offer["token"]})
        assert direct.recv().type == protocol.WELCOME
        x = torch.randn(5, 7)
        assert torch.equal(direct.add(x, x), x * 3)
        direct.send(protocol.PING, {})
        assert direct.recv().type == protocol.PONG
        direct.send(protocol.STATUS, {})
        assert "unexpected message type STATUS" in direct.error()
        direct.close()
    finally:
        owner.send(protocol.BYE, {})
        owner.close()
    assert_still_served(gw, good)


def test_bulk_connection_needs_its_sessions_token_and_carries_only_parts(gw, good):
    """A session's second connection (for large uploads), on the gateway's port and on the
    data port: only with the session's token, only PART messages; a PART on it lands in the
    session, whose ops come on the main connection."""
    owner = RawClient(gw.endpoint)
    welcome = owner.hello()
    token = welcome["token"]
    data_ep = f"{gw.endpoint.rsplit(':', 1)[0]}:{welcome['direct']['port']}"
    try:
        for ep in (gw.endpoint, data_ep):
            stranger = RawClient(ep)
            stranger.send(protocol.HELLO, {"token": b"\x00" * 16, "bulk": True})
            assert "token" in stranger.error()
            stranger.close()
        owner.send(protocol.HELLO, {"token": token, "bulk": True})
        assert "already has a session" in owner.error()
        payload = protocol.encode_payload(memoryview(bytes(range(64)) * 4))
        for n, ep in enumerate((gw.endpoint, data_ep), start=1):
            bulk = RawClient(ep)
            bulk.send(protocol.HELLO, {"token": token, "bulk": True})
            assert bulk.recv().body == {"bulk": True}
            bulk.send(protocol.OPS, {"ops": [], "req": 1})
            assert "carries PART messages, not OPS" in bulk.error()
            h = owner.handle()
            bulk.send(protocol.PART, {"h": h, "off": 0, "total": 256}, [payload])
            msg = owner.request([["rc::upload", [h, None, torch.uint8, [256], None, n], None, None]], (),
                                ["rc::fetch", [h], None, {"base": None}])
            assert msg.type == protocol.REPLY and msg.body["err"] is None, msg.body
            assert bytes(protocol.decode_payload(*msg.payloads[0])) == bytes(range(64)) * 4
            bulk.close()
    finally:
        owner.send(protocol.BYE, {})
        owner.close()
    assert_still_served(gw, good)


def test_an_upload_in_parts_is_pending_until_an_op_needs_it(gw, good):
    """The op stream does not wait for a parted upload's bytes: a request issued after its
    upload op is answered before a single PART has been sent. The first op that uses the
    tensor waits for them; a handle released before its bytes came just lets them go."""
    c = RawClient(gw.endpoint)
    c.hello()
    try:
        data = torch.arange(64, dtype=torch.float32)
        payload = protocol.encode_payload(protocol.tensor_bytes(data))
        h, dropped = c.handle(), c.handle()
        upload = ["rc::upload", [h, None, torch.float32, [64], None, 1], None, None]
        xh, x_up, x_pl = c.upload_op(torch.ones(3), 0)
        total = c.handle()
        msg = c.request([upload, x_up, ["aten::sum.default", [Handle(xh)], None, [total]]], [x_pl],
                        ["rc::fetch", [total], None, {"base": None}])
        assert fetched(msg).item() == 3.0  # answered, with no PART sent yet
        c.send(protocol.PART, {"h": h, "off": 0, "total": 256}, [payload])
        y = c.handle()
        msg = c.request([["aten::mul.Scalar", [Handle(h), 2.0], None, [y]]], (),
                        ["rc::fetch", [y], None, {"base": None}])
        assert torch.equal(fetched(msg), data * 2)
        c.send(protocol.OPS, {"ops": [["rc::upload", [dropped, None, torch.float32, [64], None, 2], None, None]],
                              "rel": [dropped]})
        c.send(protocol.PART, {"h": dropped, "off": 0, "total": 256}, [payload])
        msg = c.request([], (), ["rc::fetch", [dropped], None, {"base": None}])
        assert msg.body["err"] and "unknown to the gateway" in msg.body["err"]["msg"], msg.body
        assert c.request([]).body["err"] is None  # rc::sync: nothing is left waiting
        # an interrupt while an op waits for the bytes stops the wait, not the upload
        late = c.handle()
        c.send(protocol.OPS, {"ops": [["rc::upload", [late, None, torch.float32, [64], None, 3], None, None],
                                      ["aten::mul.Scalar", [Handle(late), 2.0], None, [c.handle()]]], "req": 77})
        assert c.quiet(0.3)  # the mul waits for a PART that has not been sent
        c.send(protocol.CANCEL, {"rid": 77, "upto": c.seq})
        assert c.recv().body.get("cancelled") is True
        c.send(protocol.PART, {"h": late, "off": 0, "total": 256}, [payload])
        msg = c.request([], (), ["rc::fetch", [late], None, {"base": None}])
        assert torch.equal(fetched(msg), data)
    finally:
        c.send(protocol.BYE, {})
        c.close()
    assert_still_served(gw, good)


def test_malformed_upload_parts(gw, good, bad_session):
    """Large uploads come as PART messages, their op naming how many PARTs precede it; every
    way of getting that wrong is a protocol error at the op, and the session goes on."""
    bad = bad_session
    part = protocol.encode_payload(memoryview(b"\x01" * 64))
    sent = [0]

    def send_part(h: int, offset: int, total, payload=part) -> None:
        bad.send(protocol.PART, {"h": h, "off": offset, "total": total}, [payload])
        sent[0] += 1

    def finish(h: int, shape: list, last=None) -> protocol.Message:
        return bad.request([["rc::upload", [h, None, torch.float32, shape, None, sent[0] if last is None else last],
                             None, None]])
    h = bad.handle()
    cases = [
        # a part that does not start at byte 0
        ([(h, 64, 128)], [32]),
        # a gap between parts
        ([(h, 0, 192), (h, 128, 192)], [48]),
        # more bytes than announced
        ([(h, 0, 32)], [8]),
        # an absurd size
        ([(h, 0, 1 << 62)], [16]),
        # finished before all parts came
        ([(h, 0, 128)], [32]),
        # parts that cannot hold the shape
        ([(h, 0, 128), (h, 64, 128)], [33]),
        # a finish with no parts at all
        ([], [4]),
    ]
    for parts, shape in cases:
        h = bad.handle()
        for _, offset, total in parts:
            send_part(h, offset, total)
        msg = finish(h, shape)
        assert msg.type == protocol.ERROR and msg.body["kind"] == "protocol", (parts, msg.body)
        assert bad.quiet(0.05)
    # an upload op without the number of PARTs before it
    msg = bad.request([["rc::upload", [bad.handle(), None, torch.float32, [4], None], None, None]])
    assert msg.type == protocol.ERROR and "how many PART messages" in msg.body["msg"], msg.body
    # a PART that names no upload, or carries no payload
    bad.send(protocol.PART, {"off": 0, "total": 64}, [part])
    assert "malformed PART message" in bad.error()
    bad.send(protocol.PART, {"h": bad.handle(), "off": 0, "total": 64})
    assert "malformed PART message" in bad.error()
    sent[0] += 2
    # a part whose bytes do not match their digest
    h = bad.handle()
    send_part(h, 0, 64, ([64, "raw", b"\x00" * 16], b"\x01" * 64))
    msg = finish(h, [16])
    assert msg.type == protocol.ERROR and "integrity" in msg.body["msg"], msg.body
    # and a well-formed upload in two parts works on the same session
    h = bad.handle()
    send_part(h, 0, 128)
    send_part(h, 64, 128)
    msg = bad.request([["rc::upload", [h, None, torch.float32, [32], None, sent[0]], None, None]], (),
                      ["rc::fetch", [h], None, {"base": None}])
    assert bytes(fetched(msg).view(torch.uint8).numpy()) == b"\x01" * 128
    assert_still_served(gw, good)
