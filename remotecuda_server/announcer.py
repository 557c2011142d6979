"""A gateway announcing itself: its beacon (remotecuda_wire/beacon.py) every ``beacon.INTERVAL``.

The supervisor calls ``Announcer.send`` from its own loop, between messages, with the figures
it keeps (no thread reads the supervisor's state behind its back). Sending a datagram never
blocks: a beacon that cannot go out now (no route yet, a full buffer) is skipped, and the next
one tries again. On shutdown one last beacon says ``leaving``, so clients drop the gateway at
once instead of waiting for it to expire. A gateway with a token signs them (``key``).
"""
from __future__ import annotations

import ipaddress
import socket
import time
from typing import Any

from remotecuda_wire import beacon


def interface(host: str, iface: str | None) -> str | None:
    """The interface beacons leave by: the one named, else loopback for a gateway bound to a
    loopback address (only this machine can reach it; and tests stay off the network), else
    the system's choice (None)."""
    if iface:
        return iface
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        loopback = False
    return "127.0.0.1" if loopback else None


def address(host: str, port: int, advertise: str | None, iface: str | None, group: str) -> str:
    """The endpoint the beacon gives clients: ``--advertise HOST:PORT`` (a proxy, a tunnel, NAT),
    else the bound one; a gateway bound to every interface gives the address of the one its
    beacons leave by."""
    if advertise:
        h, sep, p = advertise.strip().removeprefix("tcp://").rpartition(":")
        if not sep or not h or not p.isdigit():
            raise ValueError(f"--advertise is HOST:PORT, got {advertise!r}")
        return f"tcp://{h}:{p}"
    if host in ("0.0.0.0", "*", ""):
        host = iface or _source_address(group)
    return f"tcp://{host}:{port}"


def _source_address(group: str) -> str:
    """The address this machine sends to ``group`` from (a connected UDP socket sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((group, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class Announcer:
    def __init__(self, gateway_id: str, address: str, group: str, port: int, iface: str | None,
                 key: bytes | None = None):
        self.gateway_id, self.address, self.group, self.port, self.iface = gateway_id, address, group, port, iface
        self.key = key  # auth.beacon_key of the gateway's token: its beacons are signed
        self.sock = beacon.sender(iface)
        self.sock.setblocking(False)
        self.seq = 0
        self.next_at = 0.0  # (monotonic) when the next beacon is due

    def describe(self) -> str:
        """Where it announces, for the start banner."""
        return (f"announcing {self.address} on {self.group}:{self.port} via {self.iface or 'the default interface'}"
                + (", signed" if self.key is not None else ""))

    def send(self, info: dict[str, Any], leaving: bool = False) -> None:
        data = beacon.encode(self.gateway_id, self.address, self.seq, info, leaving, self.key)
        self.seq += 1
        self.next_at = time.monotonic() + beacon.INTERVAL
        try:
            self.sock.sendto(data, (self.group, self.port))
        except OSError:  # (no route, a full buffer: the next beacon tries again)
            pass

    def close(self) -> None:
        self.sock.close()
