"""The discovery beacon: what a gateway announces on UDP multicast about once a second, and
the sockets that send and receive it.

A beacon is one UDP datagram holding a small msgpack map (see ``encode``). It is versioned by
``BEACON_VERSION``; a receiver drops anything it cannot read (another program on the group, a
newer gateway) without a word. Multicast stays on the interface named by the caller: tests
and benchmarks pass 127.0.0.1, so nothing leaves through the default route.

A gateway with a token *signs* its beacons (``encode(key=...)``, the key from
``auth.beacon_key``): the map ends with the sending time ``"t"`` and a MAC ``"mac"`` (keyed
BLAKE2b-128 over every byte before the MAC's own 16), at fixed offsets from the datagram's end,
so ``check`` verifies one without parsing it. A listener with the token accepts only beacons
signed with it and not older than ``MAX_SKEW``; one without a token accepts only unsigned ones
(it could not use a gateway that requires a token). Replays within ``MAX_SKEW`` are the
listener's to refuse, by the beacon's ``seq`` (remotecuda/discovery.py).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket
import struct
import time
from typing import Any

import msgpack

BEACON_VERSION = 1
#: the group and port gateways announce on (``REMOTECUDA_DISCOVERY=GROUP:PORT`` changes them)
DEFAULT_GROUP = "239.255.100.100"
DEFAULT_PORT = 55556
#: seconds between two beacons of one gateway
INTERVAL = 1.0
#: a gateway not heard from for this long has left (three beacons missed, at most)
EXPIRY = 2.5
#: a beacon is one datagram; larger ones are refused on both sides
MAX_BYTES = 16 * 1024
_MAGIC = "remotecuda-gateway"
#: the envelope's keys, first in every beacon in this order, so a listener reads them without the rest
ENVELOPE = ("magic", "v", "id", "addr", "seq", "leaving")
#: a signed beacon's last two keys: the sender's time.time() and the MAC
SIGNATURE = ("t", "mac")
MAC_BYTES = 16
#: a signed beacon sent longer ago than this (by the listener's clock) is refused: a replay, or
#: clocks that disagree (gateways and clients with a token keep their clocks within this, e.g. NTP)
MAX_SKEW = 10.0
# the signature as msgpack encodes it: "t" float64, "mac" bin8 of MAC_BYTES, last in the map
_TAIL = struct.Struct(">3sd6s16s")
_T, _MAC = b"\xa1t\xcb", b"\xa3mac\xc4" + bytes([MAC_BYTES])


def group_from_env() -> tuple[str, int]:
    """``REMOTECUDA_DISCOVERY`` ("GROUP:PORT", either part may be left out) or the defaults."""
    text = os.environ.get("REMOTECUDA_DISCOVERY", "").strip()
    if not text:
        return DEFAULT_GROUP, DEFAULT_PORT
    group, sep, port = text.rpartition(":")
    if not sep:
        group, port = text, ""
    if port and not (port.isdigit() and 0 < int(port) < 65536) or group and not _is_multicast(group):
        raise ValueError(f"REMOTECUDA_DISCOVERY is GROUP:PORT, an IPv4 multicast group and a UDP port "
                         f"(default {DEFAULT_GROUP}:{DEFAULT_PORT}), got {text!r}")
    return group or DEFAULT_GROUP, int(port) if port else DEFAULT_PORT


def _is_multicast(group: str) -> bool:
    try:
        return ipaddress.IPv4Address(group).is_multicast
    except ValueError:
        return False


def iface_from_env() -> str | None:
    """``REMOTECUDA_DISCOVERY_IFACE``: the IPv4 address of the interface to use, or None (the system's choice)."""
    return os.environ.get("REMOTECUDA_DISCOVERY_IFACE", "").strip() or None


def encode(gateway_id: str, address: str, seq: int, info: dict[str, Any], leaving: bool = False,
           key: bytes | None = None, now: float | None = None) -> bytes:
    """A beacon: ``gateway_id`` (random per gateway start), ``address`` the endpoint clients
    connect to ("tcp://host:port"), ``seq`` counting beacons, ``info`` the gateway's
    description (versions, ``gpus`` with their load). ``leaving`` says the gateway is stopping.
    With ``key`` (``auth.beacon_key``) it is signed, as sent at ``now`` (time.time())."""
    body = {"magic": _MAGIC, "v": BEACON_VERSION, "id": gateway_id, "addr": address, "seq": seq,
            "leaving": leaving, **{k: v for k, v in info.items() if k not in SIGNATURE}}
    if key is not None:
        body.update(t=float(time.time() if now is None else now), mac=bytes(MAC_BYTES))
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_BYTES:
        raise ValueError(f"a beacon of {len(data)} bytes exceeds {MAX_BYTES}")
    if key is not None:
        data = data[:-MAC_BYTES] + _mac(key, data[:-MAC_BYTES])
    return data


def _mac(key: bytes, signed: bytes) -> bytes:
    return hashlib.blake2b(signed, key=key, digest_size=MAC_BYTES, person=b"remotecuda-bcn").digest()


def check(data: bytes, key: bytes | None, now: float | None = None) -> str | None:
    """Why a listener holding ``key`` (None: no token) refuses the beacon ``data``, or None when
    it may read it: "signed" (a gateway this listener cannot check nor use), "unsigned", "forged"
    (a MAC not made with ``key``), "stale" (sent more than ``MAX_SKEW`` from ``now``). A
    hash over the datagram, no parsing: cheap enough for every beacon of 200 gateways."""
    tail = _TAIL.unpack_from(data, len(data) - _TAIL.size) if len(data) > _TAIL.size else None
    signed = tail is not None and tail[0] == _T and tail[2] == _MAC
    if key is None:
        return "signed" if signed else None
    if not signed:
        return "unsigned"
    assert tail is not None
    if not hmac.compare_digest(tail[3], _mac(key, data[:-MAC_BYTES])):
        return "forged"
    if not abs((time.time() if now is None else now) - tail[1]) <= MAX_SKEW:  # (not: a NaN is refused too)
        return "stale"
    return None


def decode(data: bytes) -> dict[str, Any] | None:
    """The beacon in ``data``, or None when it is not one this version reads."""
    if len(data) > MAX_BYTES:
        return None
    try:
        body = msgpack.unpackb(data, raw=False, max_str_len=MAX_BYTES, max_bin_len=MAC_BYTES,
                               max_array_len=1024, max_map_len=1024, strict_map_key=True)
    except Exception:  # noqa: BLE001 - anything unreadable is not a beacon
        return None
    if not isinstance(body, dict) or body.get("magic") != _MAGIC or body.get("v") != BEACON_VERSION:
        return None
    if not isinstance(body.get("id"), str) or not isinstance(body.get("addr"), str) \
            or not isinstance(body.get("seq"), int) or not isinstance(body.get("gpus", []), list):
        return None
    return body


def decode_envelope(data: bytes) -> dict[str, Any] | None:
    """The envelope alone (``ENVELOPE``'s keys) of a beacon this version reads, or None: about a
    fifth of ``decode``'s cost, for a listener that hears many gateways every second and reads
    their descriptions only when it needs them (``decode`` then)."""
    if len(data) > MAX_BYTES:
        return None
    try:
        u = msgpack.Unpacker(raw=False, max_buffer_size=MAX_BYTES, max_str_len=MAX_BYTES, max_bin_len=MAC_BYTES,
                             max_array_len=1024, max_map_len=1024, strict_map_key=True)
        u.feed(data)
        if u.read_map_header() < len(ENVELOPE):
            return None
        env = {}
        for key in ENVELOPE:
            if u.unpack() != key:
                return None
            env[key] = u.unpack()
    except Exception:  # noqa: BLE001 - anything unreadable is not a beacon
        return None
    if env["magic"] != _MAGIC or env["v"] != BEACON_VERSION or not isinstance(env["id"], str) \
            or not isinstance(env["addr"], str) or not isinstance(env["seq"], int):
        return None
    return env


def sender(iface: str | None, ttl: int = 1) -> socket.socket:
    """A UDP socket that sends to the group out of ``iface`` (an IPv4 address), TTL ``ttl``."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, ttl)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)  # clients on this machine hear it
    if iface:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(iface))
    return s


def receiver(group: str, port: int, iface: str | None) -> socket.socket:
    """A UDP socket joined to ``group`` on ``iface`` (any interface when None), bound to ``port``;
    several listeners on one machine share the port."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((group, port))  # the group, not 0.0.0.0: other traffic to the port is not ours
    mreq = struct.pack("4s4s", socket.inet_aton(group), socket.inet_aton(iface or "0.0.0.0"))
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
    return s
