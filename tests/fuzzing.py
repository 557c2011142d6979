"""Hostile frames for a real gateway, seeded: the fuzzer of tests/test_hostile_load.py and of
benchmarks/bench_fuzz.py's longer campaign. ``Campaign`` opens every kind of connection a peer
can hold (the front port in a session and without one, authenticated or not, the session's data
port and bulk connection, a stranger on that data port) and sends each a stream of mutated,
truncated, replayed and oversized messages made from valid ones, reading what the gateway answers."""
from __future__ import annotations

import collections
import random
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable

import torch
import xxhash
import zmq

from remotecuda_wire import auth, protocol
from remotecuda_wire.protocol import Handle

from conftest import Client, wait_for

#: message types a sealed (authenticated) fuzzer sends with mangled bodies; BYE would only end its own session
FUZZ_TYPES = [t for t in protocol.TYPE_NAMES if t != protocol.BYE]


def _frames(msg_type: int, body: bytes, extra: list, peer: auth.Peer | None, channel: int,
            n_pl: int | None = None, body_len: int | None = None) -> list:
    """A message around raw body bytes, its header consistent (or lying, by ``n_pl``/``body_len``),
    sealed by ``peer``: an authenticated client sending whatever it likes."""
    signed = struct.pack("<4sBBBBQIIQ", protocol.MAGIC, protocol.VERSION, msg_type, 0, 0, 0,
                         len(body) if body_len is None else body_len, len(extra) if n_pl is None else n_pl,
                         xxhash.xxh3_64_intdigest(body))
    frames = [protocol.finish_header(signed, bytes(protocol.MAC_SIZE)), body, *extra]
    return peer.seal(frames, channel) if peer is not None else frames


def _flip(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if not b:
            break
        op = rng.random()
        i = rng.randrange(len(b))
        if op < 0.6:
            b[i] = rng.randrange(256)
        elif op < 0.8:
            del b[i:i + rng.randint(1, 8)]
        else:
            b[i:i] = rng.randbytes(rng.randint(1, 8))
    return bytes(b)


def _swap(rng: random.Random, body: dict, handles: int) -> dict:
    """The body with one value deep inside (an op's name, an argument, a handle, a size) replaced by
    a hostile one."""
    hostile = [0, -1, 1 << 40, -(1 << 63), (1 << 64) - 1, 1.5, float("nan"), float("inf"), "", "x" * 300,
               None, True, [], [1 << 40], [-1, 3], [[[]]], {}, {"base": 1 << 40}, torch.float64, torch.bool,
               Handle(rng.randint(0, handles + 2)), Handle((1 << 64) - 1),
               protocol.handle_ext(rng.randint(0, handles + 2)), b"\xff" * 8, b"abc", "aten::empty.memory_format",
               "aten::as_strided", "rc::fetch", "rc::upload", "rc::free", "builtins::eval"]

    def walk(node):
        if isinstance(node, list) and node and rng.random() < 0.7:
            i = rng.randrange(len(node))
            return [*node[:i], walk(node[i]), *node[i + 1:]]
        if isinstance(node, dict) and node and rng.random() < 0.7:
            k = rng.choice(list(node))
            return {**node, k: walk(node[k])}
        return rng.choice(hostile)

    if not body:
        return {rng.choice(["ops", "t", "device", "rid"]): rng.choice(hostile)}
    k = rng.choice(list(body))  # (the body itself stays a map, as encode needs)
    return {**body, k: walk(body[k])}


class Fuzzer:
    """Seeded hostile frames on one socket: mutated, truncated, replayed and oversized messages, made
    from valid ones (sealed with ``peer`` for ``channel`` when the connection has authenticated).
    ``parts``: the connection is a bulk one, whose valid messages are PARTs; ``pulls``: a stranger's
    on a worker's data port, whose valid messages are other workers' (PULLs of a copy)."""

    def __init__(self, seed: int, sock: zmq.Socket, client: Client, peer: auth.Peer | None, channel: int,
                 parts: bool = False, pulls: bool = False):
        self.rng = random.Random(seed)
        self.sock, self.client, self.peer, self.channel = sock, client, peer, channel
        self.parts, self.pulls = parts, pulls
        self.sent: list[list] = []
        self.frames = 0  # messages sent
        self.answers: collections.Counter = collections.Counter()  # what came back, by reason

    def valid(self) -> tuple[dict, tuple, list]:
        """A valid message: (body, payloads, frames)."""
        c, r = self.client, self.rng
        kind = r.randrange(4)
        if self.parts and kind < 3:  # the first part of an upload that never finishes, or a later one
            data = protocol.encode_payload(memoryview(r.randbytes(r.randint(1, 4096))))
            total = data[0][0] * r.randint(1, 3)
            return self._both(protocol.PART, {"h": c.handle(), "off": 0 if kind < 2 else data[0][0],
                                              "total": total}, [data])
        if self.pulls and kind < 3:  # a copy's PULL, with a token no offer holds, or a HELLO with a wrong token
            if kind == 2:
                return self._both(protocol.HELLO, {"token": r.randbytes(16)})
            return self._both(protocol.PULL, {"token": r.randbytes(16), "rid": r.randrange(1 << 31),
                                              "codecs": ["zstd"]})
        if kind == 0:
            ops, pls, hc = c.add_ops(torch.arange(float(r.randint(1, 64))), torch.ones(1))
            ops = [*ops, ["rc::fetch", [hc], None, {"base": None}]]
            return self._both(protocol.OPS, {"ops": ops, "n0": 0, "req": 1}, pls)
        if kind == 1:
            h = c.handle()
            op = ["aten::empty.memory_format", [[r.randint(0, 1 << 12)]], {"dtype": torch.float32}, [h]]
            return self._both(protocol.OPS, {"ops": [op, ["aten::add_.Tensor", [Handle(h), Handle(h)], {}, [h]]],
                                             "n0": 0})
        if kind == 2:
            return self._both(protocol.PING, {})
        if self.peer is None:  # a stranger's first step of the handshake
            return self._both(protocol.HELLO, {"device": 0, "auth": r.randbytes(auth.NONCE_BYTES)})
        return self._both(protocol.STATUS, {})

    def _both(self, msg_type: int, body: dict, payloads=()) -> tuple[dict, tuple, list]:
        return body, tuple(payloads), self._sealed(msg_type, body, payloads)

    def _sealed(self, msg_type: int, body: dict, payloads=()) -> list:
        frames = protocol.encode(msg_type, body, payloads)
        return [bytes(f) for f in (self.peer.seal(frames, self.channel) if self.peer is not None else frames)]

    def message(self) -> list:
        r = self.rng
        what = r.random()
        if what < 0.1 and self.sent:  # replayed verbatim
            return r.choice(self.sent)
        body, payloads, frames = self.valid()
        if len(self.sent) < 64:
            self.sent.append(frames)
        else:
            self.sent[r.randrange(64)] = frames
        if what < 0.2:  # as it is: real work, and a message to replay later
            return frames
        if what < 0.4:  # bytes flipped anywhere, the header's checks left as they fall
            i = r.randrange(len(frames))
            frames = [*frames[:i], _flip(r, frames[i]), *frames[i + 1:]]
            if r.random() < 0.5:
                head = frames[0][:-4]
                frames[0] = head + struct.pack("<I", zlib.crc32(head))
            return frames
        if what < 0.55:  # a mangled body, consistent and sealed: it reaches the parser
            return _frames(r.choice(FUZZ_TYPES), _flip(r, frames[1]), frames[2:], self.peer, self.channel)
        if what < 0.7:  # well-formed msgpack, sealed, with one value swapped: it reaches the executor
            kind = r.choice(FUZZ_TYPES) if r.random() < 0.2 else \
                protocol.PART if self.parts else protocol.PULL if self.pulls else protocol.OPS
            return self._sealed(kind, _swap(r, body, self.client.h), payloads)
        if what < 0.85:  # truncated: frames dropped, or a frame cut short
            if r.random() < 0.5:
                return frames[:r.randrange(len(frames))] or [frames[0][:r.randrange(protocol.HEADER_SIZE)]]
            i = r.randrange(len(frames))
            return [*frames[:i], frames[i][:r.randrange(len(frames[i]) + 1)], *frames[i + 1:]]
        # oversized: headers that claim more than is sent, or more than is allowed; now and then a big frame
        pick = r.randrange(4)
        if pick == 0:
            return _frames(protocol.OPS, frames[1], frames[2:], self.peer, self.channel, body_len=r.randrange(1 << 32))
        if pick == 1:
            return _frames(protocol.OPS, frames[1], frames[2:], self.peer, self.channel, n_pl=r.randrange(1 << 32))
        if pick == 2:
            return [*frames, *(b"\0" * r.randint(1, 4096) for _ in range(r.randint(1, 64)))]
        big = r.randbytes(1 << 10) * (r.randint(64, 1024) if r.random() < 0.05 else 1)
        return _frames(r.choice(FUZZ_TYPES), big, [], self.peer, self.channel)

    def run(self, n: int, others: list[zmq.Socket]) -> None:
        for i in range(n):
            frames = self.message()
            if not frames:
                continue
            try:
                self.sock.send_multipart(frames)
            except zmq.Again:
                raise AssertionError(f"the gateway stopped reading this connection (at frame {i})") from None
            self.frames += 1
            if i % 100 == 0:
                for s in (self.sock, *others):
                    drain(s, self.answers)


def reason(frames: list) -> str:
    """What an answer says, digits left out: ``TYPE`` or ``ERROR kind: message``."""
    try:
        head = protocol.decode_header(frames[0])
        msg = protocol.decode(frames)
    except protocol.ProtocolError as e:
        return f"(undecodable answer: {e})"
    if head.type != protocol.ERROR:
        return protocol.TYPE_NAMES[head.type]
    text = re.sub(r"\d+", "N", str(msg.body.get("msg")))
    return f"ERROR {msg.body.get('kind')}: {re.sub(r'[(:].*', '', text).strip()[:70]}"


def drain(sock: zmq.Socket, answers: collections.Counter | None = None) -> None:
    """Read what has come on ``sock``, counting it by ``reason`` into ``answers``."""
    while sock.poll(0):
        frames = sock.recv_multipart()
        if answers is not None:
            answers[reason(frames)] += 1


def until(sock: zmq.Socket, want, what: str, timeout: float = 60.0) -> None:
    """Read (and drop) what comes on ``sock`` until a message ``want(header, frames)`` accepts."""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000)), f"no answer to {what}: the connection hangs"
        frames = sock.recv_multipart()
        try:
            head = protocol.decode_header(frames[0])
        except protocol.ProtocolError:
            continue
        if want(head, frames):
            return


def pong(fuzzer: Fuzzer) -> None:
    """A PING through the backlog the fuzzer left, answered: the connection's reader is alive (a
    stranger on a data port is answered PINGs by no one: its PULL, then)."""
    if not fuzzer.pulls:
        fuzzer.sock.send_multipart(fuzzer._sealed(protocol.PING, {}))
        until(fuzzer.sock, lambda head, _: head.type == protocol.PONG, "a PING")
        return
    rid = 1 << 40
    fuzzer.sock.send_multipart(fuzzer._sealed(protocol.PULL, {"token": fuzzer.rng.randbytes(16), "rid": rid}))
    until(fuzzer.sock, lambda head, frames: head.type in (protocol.PONG, protocol.REPLY)
          and protocol.decode(frames).body.get("rid") == rid, "a PULL")


def session_still_works(c: Client, sock: zmq.Socket, channel: int) -> None:
    """Cancel what the fuzzer queued (an upload it said would come in parts waits for them), then
    compute on the fuzzed session and check the result: its worker survived, its executor serves."""
    assert c.peer is not None
    c.send(protocol.CANCEL, {"upto": c.peer.seq, "rid": None}, sock=sock, channel=channel)
    x = torch.arange(5.0)
    ops, pls, hc = c.add_ops(x, x)
    c.rid += 1
    rid = c.rid + 1_000_000
    c.send(protocol.OPS, {"ops": [*ops, ["rc::fetch", [hc], None, {"base": None}]], "n0": 0, "req": rid}, pls,
           sock=sock, channel=channel)
    got: list = []

    def reply(head, frames):
        msg = protocol.decode(frames)
        if msg.type == protocol.REPLY and msg.body.get("rid") == rid:
            got.append(msg)
            return True
        return False
    until(sock, reply, "a request on the fuzzed session")
    res = got[0].body["res"]
    assert got[0].body["err"] is None, got[0].body
    t = protocol.tensor_from_bytes(protocol.decode_payload(*got[0].payloads[res["pl"]]), res["dtype"], res["shape"])
    assert torch.equal(t, x * 3)


class Campaign:
    """One client's connections of every kind to a gateway with ``TOKEN`` (set in the environment),
    each with its seeded Fuzzer."""

    def __init__(self, endpoint: str, ctx: zmq.Context, seed: int = 0):
        self.endpoint, self.ctx = endpoint, ctx
        self.fuzz = Client(endpoint, ctx)
        self.loner = Client(endpoint, ctx)
        self.stranger = self.fuzz._dealer(endpoint)
        self.socks = [self.fuzz.sock, self.loner.sock, self.stranger]
        self.fuzz.hello()
        self.loner.hello(device=None)
        self.direct, _ = self.fuzz.direct()
        data_port = f"{endpoint.rsplit(':', 1)[0]}:{self.fuzz.welcome['direct']['port']}"
        self.bulk = self.fuzz._dealer(data_port)
        self.port_stranger = self.fuzz._dealer(data_port)
        self.socks += [self.direct, self.bulk, self.port_stranger]
        self.fuzz.send(protocol.HELLO, {"token": self.fuzz.welcome["token"], "bulk": True}, sock=self.bulk,
                       channel=auth.BULK)
        assert self.fuzz.recv(sock=self.bulk).type == protocol.WELCOME
        for s in self.socks:
            s.setsockopt(zmq.SNDTIMEO, 60_000)
        f, peer = self.fuzz, self.fuzz.peer
        self.kinds = {"front, in a session": Fuzzer(seed + 1, f.sock, f, peer, auth.FRONT),
                      "data port": Fuzzer(seed + 2, self.direct, f, peer, auth.DIRECT),
                      "bulk": Fuzzer(seed + 3, self.bulk, f, peer, auth.BULK, parts=True),
                      "data port, a stranger": Fuzzer(seed + 6, self.port_stranger, f, None, auth.DIRECT,
                                                      pulls=True),
                      "front, authenticated, no session": Fuzzer(seed + 4, self.loner.sock, self.loner,
                                                                 self.loner.peer, auth.FRONT),
                      "front, a stranger": Fuzzer(seed + 5, self.stranger, f, None, auth.FRONT)}

    def run(self, n: int, after: Callable[[str], None] = lambda name: None) -> None:
        """``n`` messages on each kind in turn; after each, its reader answers a PING (the backlog
        was read) and ``after(kind)`` runs."""
        for name, fuzzer in self.kinds.items():
            fuzzer.run(n, self.socks)
            pong(fuzzer)
            after(name)

    def check_session(self) -> None:
        session_still_works(self.fuzz, self.direct, auth.DIRECT)

    def answers(self) -> collections.Counter:
        total: collections.Counter = collections.Counter()
        for fuzzer in self.kinds.values():
            total.update(fuzzer.answers)
        return total

    def close(self) -> None:
        for s in self.socks:
            s.close(0)


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
            c.ctx.destroy(linger=0)

    def progresses(self) -> None:
        """It completes a round trip more (the gateway did not stall it), or failed."""
        n = self.done
        assert wait_for(lambda: self.done > n or self.failure is not None, 60), "the well-behaved client stalled"
        assert self.failure is None, self.failure
