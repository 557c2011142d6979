"""The wire protocol shared by the client and the gateway.

A message is a list of ZeroMQ frames::

    [header, body, payload_0, payload_1, ...]

* ``header`` is a fixed 52-byte struct: magic, version, type, flags, channel, sequence
  number, body length, payload count, an xxh3-64 digest of the body, a MAC (zero unless the
  message is sealed, see auth.py) and a CRC32 of the header itself, so a damaged or foreign
  message is rejected before anything is parsed.
* ``body`` is msgpack. Tensors, dtypes and devices travel as small msgpack extension
  types (never pickle); everything else is plain msgpack data.
* payloads are raw tensor bytes, one frame each, described in ``body["pl"]`` by
  ``[raw_nbytes, codec, digest]``; they are never copied into the msgpack body.
  ``codec`` is ``"raw"`` or one of ``CODECS`` that the receiver listed (the gateway in
  WELCOME, the client in HELLO); ``digest`` is the xxh3-128 of the raw bytes: the
  integrity check, and the same digest the upload cache keys by (cache.py), so each side
  hashes a payload once.

docs/PROTOCOL.md describes the message types and the op encoding.
"""
from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn

import msgpack
import numpy as np
import torch
import xxhash
import zstandard

try:
    import lz4.block
except ImportError:  # lz4 is optional: zstd alone then
    lz4 = None

MAGIC = b"RCDA"
VERSION = 5

# message types
HELLO, WELCOME, OPS, REPLY, ERROR, PING, PONG, BYE, CANCEL, STATUS, PART, PULL, CHALLENGE, READ, VALUE = range(1, 16)
TYPE_NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", OPS: "OPS", REPLY: "REPLY", ERROR: "ERROR",
              PING: "PING", PONG: "PONG", BYE: "BYE", CANCEL: "CANCEL", STATUS: "STATUS", PART: "PART",
              PULL: "PULL", CHALLENGE: "CHALLENGE", READ: "READ", VALUE: "VALUE"}  # READ, VALUE: fastread.py

#: magic, version, type, flags, channel, seq, body_len, n_payloads, body_digest; then the MAC, then the CRC
_HEADER = struct.Struct("<4sBBBBQIIQ")
_CRC = struct.Struct("<I")  # a header frame's last field
MAC_SIZE = 16
HEADER_SIZE = _HEADER.size + MAC_SIZE + 4
#: header flag: the message carries a MAC (auth.py) over its header and every frame
SEALED = 1

#: the largest tensor payload a peer accepts (raw bytes, after decompression)
MAX_PAYLOAD_BYTES = 1 << 36
#: the largest msgpack body a peer accepts
MAX_BODY_BYTES = 64 << 20
#: the size of one PART message's payload (the last part of a tensor may be shorter)
PART_BYTES = 4 << 20
#: downloads above this come as PART messages: one frame this large lands in memory the
#: receiving process touches for the first time (glibc maps every allocation over 32 MiB
#: afresh), a page fault per 4 KiB page, which cost more than copying 4 MiB parts into place
DOWNLOAD_PARTS_ABOVE = 32 << 20

#: the namespaces of the ops that travel by name (``aten::add.Tensor``), the gateway's allowlist
#: (remotecuda_server/ops.py): aten, and torch's own custom ops. A library's ops (a
#: ``torch.library.custom_op``) run on the client as their 'cuda' kernel, whose ops travel.
OP_NAMESPACES = frozenset(("aten", "torch_nn"))

# msgpack extension codes
EXT_HANDLE, EXT_DTYPE, EXT_DEVICE, EXT_MEMFMT, EXT_LAYOUT, EXT_COMPLEX, EXT_GENERATOR = range(1, 8)

DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.complex32, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
]
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
MEMORY_FORMATS = [torch.contiguous_format, torch.channels_last, torch.channels_last_3d,
                  torch.preserve_format]
MEMFMT_CODE = {m: i for i, m in enumerate(MEMORY_FORMATS)}
LAYOUTS = [torch.strided, torch.sparse_coo]
LAYOUT_CODE = {lay: i for i, lay in enumerate(LAYOUTS)}

_u64 = struct.Struct("<Q")
_c128 = struct.Struct("<dd")


class ProtocolError(Exception):
    """A message that does not follow this protocol; the peer that sent it is at fault."""


@dataclass(frozen=True)
class Handle:
    """A tensor held by the gateway, named by the id the client gave it."""

    id: int


@dataclass(frozen=True)
class GeneratorRef:
    """A random number generator held by the gateway (``torch.Generator(device='cuda')``)."""

    id: int


class Header(NamedTuple):
    """A checked header's fields; ``signed`` is the part the MAC covers (all but the MAC and the CRC)."""

    type: int
    seq: int
    body_len: int
    n_payloads: int
    body_digest: int
    flags: int
    channel: int
    mac: bytes
    signed: bytes


@dataclass
class Message:
    type: int
    body: dict
    payloads: list = field(default_factory=list)
    seq: int = 0


# ---------------------------------------------------------------------------- encoding

def handle_ext(handle: int) -> bytes:
    """A handle in its wire form inside op arguments: 8 bytes little-endian, msgpack ``bin``
    (no aten argument is ever ``bytes``). Built once per tensor, so sending it costs nothing
    per op; ``Handle`` (an extension type) is accepted too."""
    return _u64.pack(handle)


#: dtypes in their wire form, so an op's dtype argument needs no encoding callback
DTYPE_EXT = {d: msgpack.ExtType(EXT_DTYPE, bytes((i,))) for i, d in enumerate(DTYPES)}


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, Handle):
        return msgpack.ExtType(EXT_HANDLE, _u64.pack(obj.id))
    if isinstance(obj, GeneratorRef):
        return msgpack.ExtType(EXT_GENERATOR, _u64.pack(obj.id))
    if isinstance(obj, torch.dtype):
        return DTYPE_EXT.get(obj) or _unsendable(f"a tensor dtype the wire has no code for ({obj})")
    if isinstance(obj, torch.device):
        return msgpack.ExtType(EXT_DEVICE, (obj.type + ("" if obj.index is None else f":{obj.index}")).encode())
    if isinstance(obj, torch.memory_format):
        return msgpack.ExtType(EXT_MEMFMT, bytes((MEMFMT_CODE[obj],)))
    if isinstance(obj, torch.layout):
        return msgpack.ExtType(EXT_LAYOUT, bytes((LAYOUT_CODE[obj],)))
    if isinstance(obj, complex):
        return msgpack.ExtType(EXT_COMPLEX, _c128.pack(obj.real, obj.imag))
    if isinstance(obj, torch.Size):
        return list(obj)
    return _unsendable(f"a {type(obj).__name__}")


def _unsendable(what: str) -> NoReturn:
    """Encoding's refusal of a value, a TypeError (one of ``UNSENDABLE``): the session refuses
    that op alone, where any other error would leave it queued to fail every later message."""
    raise TypeError(f"remotecuda cannot send {what} to the gateway")


def _ext_hook(code: int, data: bytes) -> Any:
    try:
        if code == EXT_HANDLE:
            return Handle(_u64.unpack(data)[0])
        if code == EXT_GENERATOR:
            return GeneratorRef(_u64.unpack(data)[0])
        if code == EXT_DTYPE:
            return DTYPES[data[0]]
        if code == EXT_DEVICE:
            return torch.device(data.decode())
        if code == EXT_MEMFMT:
            return MEMORY_FORMATS[data[0]]
        if code == EXT_LAYOUT:
            return LAYOUTS[data[0]]
        if code == EXT_COMPLEX:
            return complex(*_c128.unpack(data))
    except (IndexError, struct.error, RuntimeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed extension value (code {code}): {e}") from None
    raise ProtocolError(f"unknown extension code {code}")


#: what encoding raises for a value the wire cannot carry (``_default``: TypeError; an int over 64
#: bits: OverflowError; a str with a lone surrogate: UnicodeEncodeError, a ValueError). A client
#: sends such an op as ``rc::refused``, and the gateway raises the same type again from it.
UNSENDABLE: tuple[type[Exception], ...] = (TypeError, ValueError, OverflowError)


def pack_body(body: dict) -> bytes:
    return msgpack.packb(body, default=_default, use_bin_type=True)


def unpack_body(data: bytes | memoryview) -> dict:
    try:
        body = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"malformed message body: {e}") from None
    if not isinstance(body, dict):
        raise ProtocolError("message body is not a map")
    return body


# ---------------------------------------------------------------------------- codecs

#: a compressed frame is kept only if it is smaller than this fraction of the raw bytes
MAX_RATIO = 0.9
_local = threading.local()  # a zstd compressor per thread: making one costs ~100 µs, sharing one is unsafe


def _zstd_compress(buf: memoryview) -> bytes:
    if not hasattr(_local, "zstd"):
        _local.zstd = zstandard.ZstdCompressor(level=1)
    return _local.zstd.compress(buf)


def _zstd_decompress(buf: memoryview, raw_n: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(buf)
    except zstandard.ZstdError as e:
        raise ProtocolError(f"bad zstd frame: {e}") from None
    if declared != raw_n:  # zstd ignores max_output_size when the header states a size
        raise ProtocolError(f"zstd frame declares {declared} bytes, descriptor says {raw_n}")
    try:
        return zstandard.ZstdDecompressor().decompress(buf, max_output_size=raw_n)
    except zstandard.ZstdError as e:
        raise ProtocolError(f"bad zstd frame: {e}") from None


#: an lz4 block inflates at most ~255-fold, so a larger claim is a decompression bomb
LZ4_MAX_INFLATION = 256


def _lz4_compress(buf: memoryview) -> bytes:
    return lz4.block.compress(buf, store_size=False)  # the descriptor carries the size


def _lz4_decompress(buf: memoryview, raw_n: int) -> bytes:
    if raw_n > LZ4_MAX_INFLATION * buf.nbytes:
        raise ProtocolError(f"lz4 block of {buf.nbytes} bytes cannot hold {raw_n} bytes")
    try:  # the output buffer is raw_n bytes: a block that would write more fails
        return lz4.block.decompress(buf, uncompressed_size=raw_n)
    except (lz4.block.LZ4BlockError, OverflowError, ValueError) as e:
        raise ProtocolError(f"bad lz4 block: {e}") from None


@dataclass(frozen=True)
class Codec:
    """A payload codec: how its frames are made, and undone without trusting them."""

    compress: Callable[[memoryview], bytes]
    #: the frame back to ``raw_n`` bytes, bounded by ``raw_n``; ProtocolError for a bad frame
    decompress: Callable[[memoryview, int], bytes]
    #: the largest payload it encodes
    max_bytes: int = MAX_PAYLOAD_BYTES


#: the codecs this installation has, fastest first (compression.py relies on that order)
CODEC_IMPLS: dict[str, Codec] = {}
if lz4 is not None:
    CODEC_IMPLS["lz4"] = Codec(_lz4_compress, _lz4_decompress, max_bytes=0x7E000000)  # LZ4_MAX_INPUT_SIZE
CODEC_IMPLS["zstd"] = Codec(_zstd_compress, _zstd_decompress)


def enabled_codecs(setting: str | None) -> tuple[str, ...]:
    """The codecs this process sends and accepts: ``REMOTECUDA_CODECS`` (comma-separated;
    empty or ``none``: raw only) limited to those installed, or all installed when unset."""
    if setting is None:
        return tuple(CODEC_IMPLS)
    wanted = {name.strip().lower() for name in setting.split(",")} - {"", "none"}
    if wanted - {"lz4", "zstd"}:  # a misspelt codec would silently mean raw (lz4 may be uninstalled: allowed)
        raise ValueError(f"REMOTECUDA_CODECS={setting!r}: a comma-separated list of lz4 and zstd, or 'none'")
    return tuple(name for name in CODEC_IMPLS if name in wanted)


CODECS = enabled_codecs(os.environ.get("REMOTECUDA_CODECS"))


def common_codecs(offered: Any, ours: Sequence[str] = CODECS) -> tuple[str, ...]:
    """Our codecs (``ours``: this process's, or those a client read at activation) that a peer
    listed (in WELCOME or HELLO), fastest first; a peer that lists none is from before codec
    negotiation and decodes zstd only."""
    if offered is None:
        offered = ["zstd"]
    if not isinstance(offered, list):
        raise ProtocolError("malformed codec list")
    return tuple(name for name in ours if name in offered)


# ---------------------------------------------------------------------------- payloads

def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is already contiguous."""
    t = t.detach()
    if t._is_zerotensor():  # autograd's efficient zeros (e.g. sgn's gradient) have no storage
        t = torch.zeros(t.shape, dtype=t.dtype)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    if t.stride(0) != 1:  # one element under a stride-0 (expanded) size-1 dim counts as contiguous
        t = t.clone(memory_format=torch.contiguous_format)
    # numpy's stubs declare ndarray a buffer only for Python >= 3.12
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def payload_digest(buf: memoryview) -> bytes:
    return xxhash.xxh3_128_digest(buf)


def encode_payload(buf: memoryview, codec: str | None = None, digest: bytes | None = None) -> tuple[list, Any]:
    """The descriptor and the frame for one payload, compressed with ``codec`` (see
    compression.py for which) unless that saves less than 10 %; ``digest`` is the payload's
    digest when the caller already has it."""
    n = buf.nbytes
    desc = [n, "raw", digest if digest is not None else payload_digest(buf)]
    if codec is not None:
        frame = CODEC_IMPLS[codec].compress(buf)
        if len(frame) < n * MAX_RATIO:
            desc[1] = codec
            return desc, frame
    return desc, buf


def decode_payload(desc: Any, frame: Any, max_bytes: int = MAX_PAYLOAD_BYTES,
                   accepted: Sequence[str] = CODECS) -> memoryview:
    """Decompress (if needed) and check one payload frame against its descriptor's digest;
    raise ProtocolError on any mismatch, or for a codec this side did not offer (``accepted``)."""
    if not (isinstance(desc, list) and len(desc) == 3 and isinstance(desc[0], int)
            and isinstance(desc[2], bytes)):
        raise ProtocolError("malformed payload descriptor")
    raw_n, codec, digest = desc
    buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    if raw_n < 0 or raw_n > max_bytes:
        raise ProtocolError(f"payload declares {raw_n} bytes, over the limit of {max_bytes}")
    if codec == "raw":
        if buf.nbytes != raw_n:
            raise ProtocolError(f"payload is {buf.nbytes} bytes, descriptor says {raw_n}")
        out = buf
    elif codec in accepted and codec in CODEC_IMPLS:
        out = memoryview(CODEC_IMPLS[codec].decompress(buf, raw_n))
        if out.nbytes != raw_n:
            raise ProtocolError(f"decompressed payload is {out.nbytes} bytes, descriptor says {raw_n}")
    else:
        raise ProtocolError(f"unknown payload codec {codec!r} (this side decodes {', '.join(('raw', *accepted))})")
    if payload_digest(out) != digest:
        raise ProtocolError("payload integrity check failed")
    return out


def _read_only_bytes(buf: memoryview) -> torch.Tensor:
    """``torch.frombuffer`` of a read-only buffer (a zmq frame), without torch's note that it is
    read-only. The note is C++'s ``TORCH_WARN_ONCE``, so it is silenced once, at import, and
    ``catch_warnings`` is not entered for each download: entering it marks the filters changed,
    and with that every warning the program was shown once (once per location, the default)
    would be shown again after each download."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(buf, dtype=torch.uint8)


_read_only_bytes(memoryview(b"\0"))  # (the note, made and silenced once for the process)


def tensor_from_bytes(buf: memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A CPU tensor over ``buf`` (no copy); the caller copies it if it outlives the frame."""
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if buf.nbytes != numel * itemsize:
        raise ProtocolError(f"payload of {buf.nbytes} bytes cannot hold {tuple(shape)} {dtype}")
    # (under warn_always, torch's note that a zmq frame is read-only comes every time)
    flat = _read_only_bytes(buf) if torch.is_warn_always_enabled() else torch.frombuffer(buf, dtype=torch.uint8)
    if flat.data_ptr() % itemsize:
        # frame memory is only 8-byte aligned (zmq keeps its bookkeeping in front of the
        # data): typed kernels on e.g. complex128 (alignas 16) crash on it; copy as bytes
        flat = flat.clone()
    return flat.view(dtype).view(tuple(shape))


class Assembly:
    """A payload's bytes arriving in parts (PART messages), each copied into place as it comes.

    ``flat`` is the 1-D uint8 destination. Copies are byte-wise: received frames are only
    8-byte aligned, and a byte copy needs no alignment (nor, on the CPU, an OpenMP hand-off
    that costs more than a memcpy when the machine is busy)."""

    def __init__(self, flat: torch.Tensor):
        self.flat = flat
        self._host = flat.numpy() if flat.device.type == "cpu" else None
        self.filled = 0

    def add(self, offset: int, buf: memoryview) -> None:
        n = buf.nbytes
        if offset != self.filled or offset + n > self.flat.numel():
            raise ProtocolError(f"part at byte {offset} (+{n}) does not continue the "
                                f"{self.filled} of {self.flat.numel()} bytes received")
        if self._host is not None:
            np.copyto(self._host[offset:offset + n], np.frombuffer(buf, dtype=np.uint8))
        else:
            src = tensor_from_bytes(buf, torch.uint8, [n])
            self.flat[offset:offset + n].copy_(src, non_blocking=True)
        self.filled += n

    def finish(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if self.filled != self.flat.numel() or numel * itemsize != self.filled:
            raise ProtocolError(f"payload of {self.filled} bytes cannot hold {tuple(shape)} {dtype}")
        if numel == 0:  # numpy gives an empty buffer stride 0, which view(dtype) refuses
            return torch.empty(tuple(shape), dtype=dtype, device=self.flat.device)
        return self.flat.view(dtype).view(tuple(shape))


# ---------------------------------------------------------------------------- framing

def encode(msg_type: int, body: dict, payloads: Sequence[Any] = (), seq: int = 0) -> list:
    """Frames for one message; payloads are (descriptor, frame) pairs from encode_payload.
    The header is unsealed (no MAC); auth.Peer.seal seals it for an authenticated session."""
    if payloads:
        body = dict(body, pl=[d for d, _ in payloads])
    data = pack_body(body)
    signed = _HEADER.pack(MAGIC, VERSION, msg_type, 0, 0, seq, len(data), len(payloads),
                          xxhash.xxh3_64_intdigest(data))
    return [finish_header(signed, bytes(MAC_SIZE)), data, *(f for _, f in payloads)]


def encode_bytes(msg_type: int, data: bytes, seq: int = 0) -> list:
    """Frames for a message whose body is already bytes, with no payloads (fastread.py's fixed
    layouts, which are not msgpack); unsealed, as ``encode``'s."""
    signed = _HEADER.pack(MAGIC, VERSION, msg_type, 0, 0, seq, len(data), 0, xxhash.xxh3_64_intdigest(data))
    return [finish_header(signed, bytes(MAC_SIZE)), data]


def finish_header(signed: bytes, mac: bytes) -> bytes:
    """A header frame: its signed part, the MAC, and the CRC-32 of both."""
    head = signed + mac
    return head + _CRC.pack(zlib.crc32(head))


def resign(header: Any, flags: int, channel: int, seq: int) -> bytes:
    """The signed part of a header frame this side made, with new flags, channel and seq."""
    buf = header.buffer if hasattr(header, "buffer") else memoryview(header)
    _magic, _v, msg_type, _f, _c, _s, body_len, n_pl, digest = _HEADER.unpack_from(buf)
    return _HEADER.pack(MAGIC, VERSION, msg_type, flags, channel, seq, body_len, n_pl, digest)


def decode_header(frame: Any) -> Header:
    """A header frame's fields, checked (size, CRC, magic, version, type); the MAC is auth.py's to check."""
    buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    if buf.nbytes != HEADER_SIZE:
        raise ProtocolError(f"header is {buf.nbytes} bytes, expected {HEADER_SIZE}")
    raw = bytes(buf)
    if _CRC.unpack_from(raw, HEADER_SIZE - 4)[0] != zlib.crc32(raw[:-4]):
        raise ProtocolError("header integrity check failed")
    magic, version, msg_type, flags, channel, seq, body_len, n_pl, digest = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ProtocolError("not a RemoteCUDA message (bad magic)")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    if msg_type not in TYPE_NAMES:
        raise ProtocolError(f"unknown message type {msg_type}")
    return Header(msg_type, seq, body_len, n_pl, digest, flags, channel,
                  raw[_HEADER.size:_HEADER.size + MAC_SIZE], raw[:_HEADER.size])


def decode(frames: Sequence[Any], max_body: int = MAX_BODY_BYTES, head: Header | None = None) -> Message:
    """Check every frame of a message and parse it; payloads stay undecoded (see decode_payload).
    ``max_body``: a smaller bound for messages that must stay tiny (the supervisor's own);
    ``head``: ``decode_header(frames[0])`` where the caller has it already."""
    if len(frames) < 2:
        raise ProtocolError("truncated message: header and body frames are required")
    msg_type, seq, body_len, n_pl, digest = (head or decode_header(frames[0]))[:5]
    body_buf = frames[1].buffer if hasattr(frames[1], "buffer") else memoryview(frames[1])
    if body_buf.nbytes != body_len:
        raise ProtocolError(f"truncated message: body is {body_buf.nbytes} bytes, header says {body_len}")
    if body_len > max_body:
        raise ProtocolError("message body over the size limit")
    if xxhash.xxh3_64_intdigest(body_buf) != digest:
        raise ProtocolError("body integrity check failed")
    if len(frames) - 2 != n_pl:
        raise ProtocolError(f"truncated message: {len(frames) - 2} payload frames, header says {n_pl}")
    body = unpack_body(body_buf)
    pl = body.get("pl", [])
    if not isinstance(pl, list) or len(pl) != n_pl:
        raise ProtocolError("payload descriptors do not match the payload frames")
    return Message(msg_type, body, list(zip(pl, frames[2:])), seq)
