"""The fast value read: a READ message and its VALUE answer, fixed binary bodies (``struct``).

A value read (``x.item()``, ``bool(x)``, ``float(x)``: ``_local_scalar_dense``; ``x.tolist()``,
``x.cpu()`` of a small tensor: ``rc::fetch``) issued while the
session has nothing queued and nothing unanswered is one op on one tensor. As a general OPS
message it costs each side a msgpack body, the worker's admission and backlog, the executor's
per-message setup and a msgpack REPLY: about ten times the work of the transport itself
(benchmarks/RESULTS.md, Part 11). A READ names the op by a one-byte kind and the tensor by its
handle; the worker's I/O thread answers it with a VALUE when its session is idle, and otherwise
runs it as the one-op OPS message it stands for (``as_ops``), answered by a plain REPLY.

Both travel under the ordinary header (protocol.py): magic, version, type, sequence number, body
length and xxh3 digest, CRC, and the MAC of a sealed session (auth.py), checked as for any
message. A worker offers READ in the WELCOME of the direct path (``"fast_read": 1``); a client
sends it only to a worker that offered it. docs/PROTOCOL.md, "READ / VALUE".
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import xxhash

from .protocol import (
    DTYPE_CODE,
    DTYPES,
    READ,
    VALUE,
    Header,
    Message,
    ProtocolError,
    encode_bytes,
    handle_ext,
    tensor_bytes,
    tensor_from_bytes,
)

#: what a worker says in its direct WELCOME when it answers READ (the layout's version)
OFFER = 1
#: the ops a READ stands for, by kind; the fetch's result is a CPU tensor
KINDS = ("aten::_local_scalar_dense.default", "rc::fetch")
KIND = {name: i for i, name in enumerate(KINDS)}
ITEM, FETCH = range(2)
#: a fetch answered in a VALUE holds at most this many bytes (more goes as the general REPLY,
#: whose payload may be compressed or sent in parts)
MAX_FETCH_BYTES = 64 << 10

#: READ: kind, request id, the op's index in the session's stream (n0), the tensor's handle
_READ = struct.Struct("<BQQQ")
#: VALUE: request id, the value's tag; then the value (below)
_VALUE = struct.Struct("<QB")
_I64, _F64, _C128 = struct.Struct("<q"), struct.Struct("<d"), struct.Struct("<dd")
#: a tensor's dtype code and number of dimensions, then that many sizes (u64), then its bytes
_TENSOR = struct.Struct("<BB")
NONE, FALSE, TRUE, INT, FLOAT, COMPLEX, TENSOR = range(7)


class Read(NamedTuple):
    kind: int
    rid: int
    n0: int
    handle: int


def encode_read(kind: int, rid: int, n0: int, handle: int, seq: int) -> list:
    return encode_bytes(READ, _READ.pack(kind, rid, n0, handle), seq)


def _body(frames: Sequence[Any], head: Header) -> memoryview:
    """The body of a READ or VALUE whose header is checked: its length and digest checked too."""
    if len(frames) != 2 or head.n_payloads:
        raise ProtocolError(f"malformed {'READ' if head.type == READ else 'VALUE'}: a header and a body")
    body = frames[1].buffer if hasattr(frames[1], "buffer") else memoryview(frames[1])
    if body.nbytes != head.body_len:
        raise ProtocolError(f"truncated message: body is {body.nbytes} bytes, header says {head.body_len}")
    if xxhash.xxh3_64_intdigest(body) != head.body_digest:
        raise ProtocolError("body integrity check failed")
    return body


def decode_read(frames: Sequence[Any], head: Header) -> Read:
    body = _body(frames, head)
    if body.nbytes != _READ.size:
        raise ProtocolError(f"malformed READ: body is {body.nbytes} bytes, expected {_READ.size}")
    read = Read(*_READ.unpack(body))
    if read.kind >= len(KINDS):
        raise ProtocolError(f"malformed READ: unknown kind {read.kind}")
    return read


def as_ops(read: Read) -> dict:
    """The OPS body a READ stands for: its op alone, a request (what the general path sends)."""
    arg = read.handle if read.kind == FETCH else handle_ext(read.handle)
    return {"ops": [[KINDS[read.kind], [arg], None, {"base": None}]], "n0": read.n0, "req": read.rid}


def value_body(rid: int, value: Any) -> bytes | None:
    """A VALUE's body for ``value`` (a Python scalar, None, or a CPU tensor); None when the layout
    has no place for it (an int past 64 bits): the general REPLY carries it then."""
    t = type(value)
    if t is bool:
        return _VALUE.pack(rid, TRUE if value else FALSE)
    if t is int:
        if not -(1 << 63) <= value < 1 << 63:
            return None
        return _VALUE.pack(rid, INT) + _I64.pack(value)
    if t is float:
        return _VALUE.pack(rid, FLOAT) + _F64.pack(value)
    if t is complex:
        return _VALUE.pack(rid, COMPLEX) + _C128.pack(value.real, value.imag)
    if value is None:
        return _VALUE.pack(rid, NONE)
    if t is torch.Tensor and value.dtype in DTYPE_CODE and value.dim() < 256:
        shape = value.shape
        return b"".join((_VALUE.pack(rid, TENSOR), _TENSOR.pack(DTYPE_CODE[value.dtype], len(shape)),
                         struct.pack(f"<{len(shape)}Q", *shape), tensor_bytes(value)))
    return None


def encode_value(body: bytes) -> list:
    """A VALUE message (the worker's sequence number is the seal's, auth.Peer.seal)."""
    return encode_bytes(VALUE, body)


def decode_value(frames: Sequence[Any], head: Header) -> Message:
    """A VALUE, with the body of the REPLY it stands for (``rid``, ``res``), so that the general wait takes it
    whenever it comes; a fetch's tensor lies over the received frame (not copied), as a REPLY's
    payload does."""
    body = _body(frames, head)
    if body.nbytes < _VALUE.size:
        raise ProtocolError("malformed VALUE: body too short")
    rid, tag = _VALUE.unpack_from(body)
    rest = body[_VALUE.size:]
    try:
        if tag <= TRUE and not rest.nbytes:
            res: Any = (None, False, True)[tag]
        elif tag == INT:
            res = _I64.unpack(rest)[0]
        elif tag == FLOAT:
            res = _F64.unpack(rest)[0]
        elif tag == COMPLEX:
            res = complex(*_C128.unpack(rest))
        elif tag == TENSOR:
            res = _tensor(rest)
        else:
            raise ProtocolError(f"malformed VALUE: tag {tag}")
    except (struct.error, RuntimeError, ValueError, OverflowError) as e:  # (a shape torch refuses too)
        raise ProtocolError(f"malformed VALUE: {e}") from None
    return Message(VALUE, {"rid": rid, "res": res, "err": None}, [], head.seq)


def _tensor(buf: memoryview) -> torch.Tensor:
    code, ndim = _TENSOR.unpack_from(buf)
    if code >= len(DTYPES):
        raise ProtocolError(f"malformed VALUE: dtype code {code}")
    shape = struct.unpack_from(f"<{ndim}Q", buf, _TENSOR.size)
    return tensor_from_bytes(buf[_TENSOR.size + 8 * ndim:], DTYPES[code], shape)

