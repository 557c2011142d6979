"""Signed discovery beacons: a gateway with a token signs them; a client with the token hears only
those (a spoofed one, unsigned, signed with another key, old or replayed, is ignored), and a
client without a token does not list the gateway. Real gateway, real multicast on 127.0.0.1,
on a group of the test's own."""
from __future__ import annotations

import time

import pytest

from remotecuda.discovery import Discovery, MulticastSource
from remotecuda_wire import auth, beacon

from conftest import GatewayProcess, private_discovery, wait_for

TOKEN = "beacon-signing-token-0123456789abcdef"
KEY = auth.beacon_key(auth.token_key(TOKEN.encode()))


@pytest.fixture
def group(monkeypatch):
    where = private_discovery()
    monkeypatch.setenv("REMOTECUDA_DISCOVERY", where)
    monkeypatch.setenv("REMOTECUDA_DISCOVERY_IFACE", "127.0.0.1")
    for name in ("REMOTECUDA_SERVERS", auth.TOKEN_ENV, auth.TOKEN_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    addr, port = where.rsplit(":", 1)
    return addr, int(port)


def test_check_signed_unsigned_forged_stale():
    signed = beacon.encode("a", "tcp://127.0.0.1:1", 1, {"gpus": [], "t": "spoof", "mac": b"x"}, key=KEY)
    plain = beacon.encode("a", "tcp://127.0.0.1:1", 1, {"gpus": []})
    assert beacon.check(signed, KEY) is None and beacon.check(plain, None) is None
    assert beacon.check(signed, None) == "signed" and beacon.check(plain, KEY) == "unsigned"
    assert beacon.check(signed, auth.beacon_key(auth.token_key(b"another-token-0123456789"))) == "forged"
    assert beacon.check(signed[:-1] + bytes([signed[-1] ^ 1]), KEY) == "forged"
    assert beacon.check(signed, KEY, now=time.time() + 2 * beacon.MAX_SKEW) == "stale"
    old = beacon.encode("a", "tcp://127.0.0.1:1", 1, {}, key=KEY, now=time.time() - 2 * beacon.MAX_SKEW)
    assert beacon.check(old, KEY) == "stale"
    assert beacon.check(b"", KEY) == "unsigned" and beacon.check(b"\xa1t\xcb", None) is None
    body = beacon.decode(signed)
    assert body is not None and body["gpus"] == [] and isinstance(body["t"], float)


def test_token_gateway_heard_only_with_the_token_and_spoofs_ignored(group, monkeypatch):
    addr, port = group
    recorder = beacon.receiver(addr, port, "127.0.0.1")
    recorder.settimeout(10)
    sender = beacon.sender("127.0.0.1")
    tokenless = Discovery(MulticastSource(addr, port, "127.0.0.1"))
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    gw = GatewayProcess("--spare", "0", "--token", TOKEN, discovery=True)
    try:
        with Discovery(expiry=600) as d:
            assert d.source.key == KEY and "signed beacons only" in d.source.describe()
            found = d.wait(1, timeout=30)
            assert [g.address for g in found] == [gw.endpoint]
            real = found[0]
            assert real.gpus and real.version and not {"t", "mac"} & set(real.info)
            recorded = recorder.recv(beacon.MAX_BYTES + 1)  # the gateway's, to replay
            seq = beacon.decode_envelope(recorded)["seq"]
            assert wait_for(lambda: d.snapshot()[0].seq > seq, timeout=20)

            other = auth.beacon_key(auth.token_key(b"another-token-0123456789"))
            spoofs = [beacon.encode("unsigned", "tcp://127.0.0.1:6001", 1, {}),
                      beacon.encode("forged", "tcp://127.0.0.1:6002", 1, {}, key=other),
                      beacon.encode(real.id, gw.endpoint, 10**9, {"sessions": 99}, key=other),  # the real one's id
                      beacon.encode("old", "tcp://127.0.0.1:6003", 1, {}, key=KEY, now=time.time() - 60),
                      recorded]
            for data in spoofs:
                sender.sendto(data, (addr, port))
            sender.sendto(beacon.encode("marker", "tcp://127.0.0.1:6004", 1, {}, key=KEY), (addr, port))
            assert wait_for(lambda: "marker" in [g.id for g in d.snapshot()], timeout=10)  # (loopback keeps order)
            assert sorted(g.id for g in d.snapshot()) == sorted([real.id, "marker"])
            assert d.snapshot()[0].seq < 10**9 and d.snapshot()[0].sessions != 99
            refused = d.source.refused
            assert (refused["unsigned"], refused["forged"], refused["stale"], refused["replayed"]) == (1, 2, 1, 1)

            # a tokenless client cannot use the gateway: it does not list it
            assert wait_for(lambda: tokenless.source.refused["signed"] >= 3, timeout=20)
            assert tokenless.snapshot() == [] or [g.id for g in tokenless.snapshot()] == ["unsigned"]

            # a gateway gone is not brought back by replaying its beacons
            gw.stop()
            assert wait_for(lambda: real.id not in [g.id for g in d.snapshot()], timeout=20)
            sender.sendto(recorded, (addr, port))
            sender.sendto(beacon.encode("marker2", "tcp://127.0.0.1:6005", 1, {}, key=KEY), (addr, port))
            assert wait_for(lambda: "marker2" in [g.id for g in d.snapshot()], timeout=10)
            assert real.id not in [g.id for g in d.snapshot()] and refused["replayed"] == 2
    finally:
        gw.stop()
        tokenless.close()
        recorder.close()
        sender.close()
