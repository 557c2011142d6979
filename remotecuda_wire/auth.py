"""Authentication on the wire: a shared token, proven without sending it, and a MAC on every frame.

A gateway started with a token (``remotecuda start --token-file``, ``REMOTECUDA_TOKEN``) serves
only clients that hold the same token. The token never crosses the wire:

1. the client's first HELLO carries a random 16-byte nonce (``"auth"``), unsealed;
2. the gateway answers CHALLENGE with a nonce of its own (nothing else is said before proof);
3. both ends derive the session key ``K = BLAKE2b(key=token_key, client nonce || gateway nonce)``
   and from then on every message in either direction is *sealed*: its header carries a MAC
   (keyed BLAKE2b-128, personalised per direction) over the header's fields and every frame
   after it (length-prefixed, so bytes cannot move between frames). The client's HELLO is
   sent again, sealed: a valid MAC is its proof; the gateway's sealed WELCOME is the gateway's.

The receiver checks the MAC before it parses anything. Sequence numbers stop replays: each
connection of a session is a *channel* named in the (MAC-covered) header, and a receiver keeps,
per channel, the last sequence number it accepted; a message must carry a larger one. The
other connections of a session (the worker's data port, the bulk connection) are bound to it
by the same key. ``token_key`` stretches the token with scrypt, so a recorded handshake is
costly to test guesses against, but a token should be random (``remotecuda token``), not a
password. docs/SECURITY.md has the threat model; docs/PROTOCOL.md the message layout.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Container, Mapping
from typing import Any

from .protocol import MAC_SIZE, SEALED, Header, ProtocolError, decode_header, finish_header, resign

TOKEN_ENV = "REMOTECUDA_TOKEN"
TOKEN_FILE_ENV = "REMOTECUDA_TOKEN_FILE"
NONCE_BYTES = 16
#: a token shorter than this is refused: it could be guessed from one recorded handshake
MIN_TOKEN_BYTES = 16

# Channels: which connection a message travels on (client → gateway), and for the gateway's
# messages also who sent it, so each (connection, sender) pair has one ordered sequence.
FRONT, DIRECT, BULK = 0, 1, 2
SUPERVISOR, WORKER = 0x00, 0x10
CONNECTION_MASK = 0x0F

C2G, G2C = b"c2g", b"g2c"

_u64 = struct.Struct("<Q")


class AuthError(ProtocolError):
    """A message without a valid MAC, or replayed: its sender does not hold the session's key."""


def read_token(token: str | None = None, token_file: str | None = None,
               environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The shared token: given, else read from ``token_file``, else ``REMOTECUDA_TOKEN``, else the
    file ``REMOTECUDA_TOKEN_FILE`` names; None when there is none. Surrounding whitespace is not
    part of it."""
    if token is None and token_file is None:
        token, token_file = environ.get(TOKEN_ENV) or None, environ.get(TOKEN_FILE_ENV) or None
    if token is None and token_file is not None:
        try:
            with open(token_file, "rb") as f:
                data = f.read().strip()
        except OSError as e:  # say which file is meant: the variable may have been set long ago
            raise type(e)(e.errno, f"cannot read the remotecuda token file {token_file!r}: {e.strerror}") from None
    elif token is not None:
        data = token.strip().encode()
    else:
        return None
    if len(data) < MIN_TOKEN_BYTES:
        raise ValueError(f"a remotecuda token must be at least {MIN_TOKEN_BYTES} bytes "
                         "(make one with `remotecuda token`)")
    return data


_KEYS: dict[bytes, bytes] = {}


def token_key(token: bytes) -> bytes:
    """The token stretched (scrypt, ~50 ms, once per process): what keys are derived from."""
    key = _KEYS.get(token)
    if key is None:
        key = _KEYS[token] = hashlib.scrypt(token, salt=b"remotecuda token v4", n=1 << 14, r=8, p=1, dklen=32)
    return key


def session_key(tkey: bytes, client_nonce: bytes, gateway_nonce: bytes) -> bytes:
    """The key of one authenticated connection (and of the session opened on it)."""
    return hashlib.blake2b(client_nonce + gateway_nonce, key=tkey, digest_size=32,
                           person=b"remotecuda-sess").digest()


def beacon_key(tkey: bytes) -> bytes:
    """The key a gateway signs its discovery beacons with (remotecuda_wire/beacon.py)."""
    return hashlib.blake2b(key=tkey, digest_size=32, person=b"remotecuda-bkey").digest()


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _mac_base(key: bytes, direction: bytes) -> Any:
    return hashlib.blake2b(key=key, digest_size=MAC_SIZE, person=b"remotecuda-" + direction)


class Peer:
    """One end's keys for one authenticated connection or session: seals what it sends, and
    checks what it receives (MAC first, then the channel's sequence number).

    ``sends`` is this end's direction (C2G on the client). The gateway's sequence numbers are the
    Peer's own counter; the client passes its session's (one counter over all its connections)."""

    def __init__(self, key: bytes, sends: bytes):
        self.key = key
        self._send = _mac_base(key, sends)
        self._recv = _mac_base(key, G2C if sends == C2G else C2G)
        self.seq = 0
        self.last: dict[int, int] = {}  # channel → the last sequence number accepted on it

    def _mac(self, base: Any, signed: bytes, frames: list) -> bytes:
        h = base.copy()
        h.update(signed)
        for f in frames:
            buf = f.buffer if hasattr(f, "buffer") else f
            h.update(_u64.pack(buf.nbytes if isinstance(buf, memoryview) else len(buf)))
            h.update(buf)
        return h.digest()

    def seal(self, frames: list, channel: int, seq: int | None = None) -> list:
        """The message with a sealed header: MAC over the header's fields and every later frame."""
        if seq is None:
            self.seq += 1
            seq = self.seq
        signed = resign(frames[0], SEALED, channel, seq)
        return [finish_header(signed, self._mac(self._send, signed, frames[1:])), *frames[1:]]

    def open(self, frames: list, channels: Container[int], head: Header | None = None) -> Header:
        """Check a received message's header, MAC and sequence number before anything is parsed;
        AuthError (a ProtocolError) if it was not sealed with this key, was replayed, or came on a
        connection its channel does not name."""
        if not frames:
            raise ProtocolError("empty message")
        if head is None:
            head = decode_header(frames[0])
        if not head.flags & SEALED:
            raise AuthError("message is not authenticated (this session is sealed with its token's key)")
        if head.channel not in channels:
            raise AuthError(f"message sealed for channel {head.channel} came on another connection")
        if not hmac.compare_digest(self._mac(self._recv, head.signed, frames[1:]), head.mac):
            raise AuthError("message authentication failed (wrong token, or the message was altered)")
        last = self.last.get(head.channel, 0)
        if head.seq <= last:
            raise AuthError(f"replayed or reordered message (sequence number {head.seq}, "
                            f"{last} already seen on its connection)")
        self.last[head.channel] = head.seq
        return head
