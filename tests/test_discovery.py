"""Discovery (remotecuda/discovery.py) and `remotecuda servers`: real multicast on 127.0.0.1, each
test on a group and port of its own, beacons sent by the test (beacon.sender) or by real gateways."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading

import msgpack
import pytest

from remotecuda import cli
from remotecuda.discovery import Discovery, MulticastSource, ServerListSource
from remotecuda_wire import beacon

from conftest import ROOT, GatewayProcess, wait_for

GIB = 2**30


@pytest.fixture
def group(monkeypatch):
    """A test-unique multicast group and port on 127.0.0.1, in the environment as a gateway and
    client read it (REMOTECUDA_DISCOVERY, REMOTECUDA_DISCOVERY_IFACE)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"239.255.{random.randint(101, 199)}.{random.randint(1, 254)}"
    monkeypatch.setenv("REMOTECUDA_DISCOVERY", f"{addr}:{port}")
    monkeypatch.setenv("REMOTECUDA_DISCOVERY_IFACE", "127.0.0.1")
    monkeypatch.delenv("REMOTECUDA_SERVERS", raising=False)
    return addr, port


class Beacons:
    """Beacons sent by the test, as a gateway sends them."""

    def __init__(self, group: tuple[str, int]):
        self.group = group
        self.sock = beacon.sender("127.0.0.1")

    def send(self, gid: str, port: int, seq: int = 1, leaving: bool = False, **info) -> None:
        info = {"gateway": "0.1.0", "host": f"box-{gid}", "sessions": 1, "gpus": gpus(2), **info}
        self.raw(beacon.encode(gid, f"tcp://127.0.0.1:{port}", seq, info, leaving))

    def raw(self, data: bytes) -> None:
        self.sock.sendto(data, self.group)


def gpus(n: int, used: int = 3 * GIB) -> list[dict]:
    """GPUs as a gateway's beacon describes them (remotecuda_server/gateway.py's ``gpus``)."""
    return [dict(index=i, name="Sim A100", kind="cpu", simulated=True, capability=[8, 0], bf16=True,
                 total_memory=24 * GIB, free_memory=24 * GIB - used, utilization=0.4, queued=2, sessions=1,
                 latency_ms=0.7) for i in range(n)]


def ids(d: Discovery) -> list[str]:
    return sorted(g.id for g in d.snapshot())


def test_join_update_and_listeners(group):
    b = Beacons(group)
    events = []
    with Discovery() as d:
        assert isinstance(d.source, MulticastSource)
        d.subscribe(lambda kind, g: events.append((kind, g.id, g.seq)))
        b.send("a", 5001)
        b.send("b", 5002, gpus=gpus(1))
        found = d.wait(2, timeout=10)
        assert [g.address for g in found] == ["tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"]
        a = found[0]
        assert (a.id, a.host, a.version, a.sessions, len(a.gpus)) == ("a", "box-a", "0.1.0", 1, 2)
        assert "magic" not in a.info and a.gpus[0]["free_memory"] == 21 * GIB
        b.send("a", 5001, seq=2, gpus=gpus(2, used=20 * GIB))
        assert wait_for(lambda: d.snapshot()[0].seq == 2, timeout=10)
        assert d.snapshot()[0].gpus[0]["free_memory"] == 4 * GIB
    assert sorted(events) == [("joined", "a", 1), ("joined", "b", 1), ("updated", "a", 2)]


def test_silent_gateway_expires(group):
    b = Beacons(group)
    left = threading.Event()
    with Discovery() as d:
        d.subscribe(lambda kind, g: left.set() if kind == "left" else None)
        b.send("quiet", 5003)
        assert [g.id for g in d.wait(1, timeout=10)] == ["quiet"]
        assert left.wait(beacon.EXPIRY + 10)  # no beacon after the first: dropped after EXPIRY
        assert d.snapshot() == []


def test_leaving_beacon_drops_at_once(group):
    b = Beacons(group)
    with Discovery(expiry=600) as d:  # silence alone would keep it listed for 10 minutes
        b.send("a", 5004)
        b.send("b", 5005)
        d.wait(2, timeout=10)
        b.send("a", 5004, seq=2, leaving=True)
        assert wait_for(lambda: ids(d) == ["b"], timeout=10)


def test_restarted_gateway_replaces_its_old_self(group):
    """A gateway killed and started again on its port has a new id; the old entry goes at once."""
    b = Beacons(group)
    with Discovery(expiry=600) as d:
        b.send("old", 5006, seq=7)
        d.wait(1, timeout=10)
        b.send("new", 5006, seq=1)
        assert wait_for(lambda: ids(d) == ["new"], timeout=10)


def test_garbage_stale_and_unknown_versions_ignored(group):
    b = Beacons(group)
    with Discovery(expiry=600) as d:
        b.send("a", 5007, seq=5, sessions=5)
        d.wait(1, timeout=10)
        b.raw(b"\x00garbage\xff" * 3)
        b.raw(msgpack.packb([1, 2, 3]))
        b.raw(msgpack.packb({"magic": "remotecuda-gateway", "v": beacon.BEACON_VERSION + 1, "id": "future",
                             "addr": "tcp://127.0.0.1:5008", "seq": 1, "gpus": []}))
        b.raw(msgpack.packb({"magic": "remotecuda-gateway", "v": beacon.BEACON_VERSION, "id": "no-addr", "seq": 1}))
        b.raw(msgpack.packb({"magic": "something-else", "v": beacon.BEACON_VERSION, "id": "other",
                             "addr": "tcp://127.0.0.1:5009", "seq": 1}))
        b.raw(b"\x81" + b"x" * (beacon.MAX_BYTES + 10))  # larger than any beacon
        b.send("a", 5007, seq=4, sessions=4)  # overtaken on the way: older than what was heard
        b.send("last", 5010)  # loopback keeps the order: once this is heard, all the above were read
        assert wait_for(lambda: "last" in ids(d), timeout=10)
        assert ids(d) == ["a", "last"]
        assert d.snapshot()[0].sessions == 5
        assert d._thread.is_alive()


def _servers(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remotecuda", "servers", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=dict(os.environ, **(env or {})))


def test_cli_table_and_json(group, capsys):
    b = Beacons(group)
    stop = threading.Event()

    def announce() -> None:  # two gateways, a beacon round every 0.2 s while the command listens
        seq = 0
        while not stop.is_set():
            seq += 1
            b.send("a", 5011, seq=seq, gpus=gpus(2, used=12 * GIB))
            b.send("b", 5012, seq=seq, gpus=[dict(gpus(1)[0], name="Sim T4", simulated=False, total_memory=16 * GIB)])
            stop.wait(0.2)
    t = threading.Thread(target=announce, daemon=True)
    t.start()
    try:
        assert cli.main(["servers", "--wait", "1"]) == 0
        out = capsys.readouterr().out
        assert cli.main(["servers", "--json", "--wait", "1"]) == 0
        data = json.loads(capsys.readouterr().out)
    finally:
        stop.set()
        t.join()
    assert "2 RemoteCUDA gateways found via multicast " + ":".join(map(str, group)) in out
    assert "tcp://127.0.0.1:5011  host box-a  RemoteCUDA 0.1.0  1 session" in out
    assert "Sim A100 [simulated]" in out and "Sim T4  " in out and "Sim T4 [simulated]" not in out
    assert "[#####.....]  12.0 / 24.0 GiB" in out and "40 %" in out and "0.7 ms" in out
    assert [g["address"] for g in data] == ["tcp://127.0.0.1:5011", "tcp://127.0.0.1:5012"]
    assert data[0]["host"] == "box-a" and data[0]["gpus"][1]["free_memory"] == 12 * GIB
    assert data[1]["gpus"][0]["name"] == "Sim T4"


def test_cli_nothing_found(group, capsys):
    assert cli.main(["servers", "--wait", "0.3"]) == 1
    out, err = capsys.readouterr()
    where = ":".join(map(str, group))
    assert out == "" and f"no gateway found via multicast {where} (UDP) on interface 127.0.0.1" in err
    assert f"UDP to port {group[1]}" in err and "remotecuda start" in err


def test_real_gateways_join_and_leave(group, capsys, monkeypatch):
    """Three gateways started in parallel are listed; one killed with kill -9 is dropped when its
    beacons stop, one stopped (SIGTERM) at once, by its leaving beacon: a listener that would keep
    a silent gateway for 10 minutes drops it too."""
    shapes = [("--gpus", "2", "--gpu-memory", "8GB,16GB", "--gpu-name", "Sim L4,Sim A16"), (), ()]
    gws: list[GatewayProcess] = []
    with Discovery() as d, Discovery(expiry=600) as patient:
        starters = [threading.Thread(target=lambda s=s: gws.append(GatewayProcess("--spare", "0", *s, discovery=True)))
                    for s in shapes]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        try:
            assert len(gws) == 3
            found = d.wait(3, timeout=30)
            assert sorted(g.address for g in found) == sorted(gw.endpoint for gw in gws)
            sims = next(g for g in found if len(g.gpus) == 2)
            assert [(x["name"], x["simulated"], x["total_memory"]) for x in sims.gpus] == \
                [("Sim L4", True, 8 * 10**9), ("Sim A16", True, 16 * 10**9)]
            killed, stopped, kept = gws
            _named_servers_are_asked(gws, sims.address, capsys, monkeypatch)
            killed.proc.kill()
            killed.proc.wait()
            assert wait_for(lambda: killed.endpoint not in [g.address for g in d.snapshot()], timeout=20)
            assert killed.endpoint in [g.address for g in patient.snapshot()]  # it never said it was leaving
            assert cli.main(["servers", "--server", killed.address, "--wait", "1"]) == 1
            assert f"no gateway found via the named servers {killed.endpoint}" in capsys.readouterr().err
            r = _servers("--json", "--wait", "2")
            assert r.returncode == 0, r.stderr
            listed = {g["address"]: g for g in json.loads(r.stdout)}
            assert sorted(listed) == sorted([stopped.endpoint, kept.endpoint])
            assert all(g["gpus"] and g["gateway"] for g in listed.values())
            stopped.stop()
            assert wait_for(lambda: stopped.endpoint not in [g.address for g in patient.snapshot()], timeout=20)
            assert [g.address for g in d.snapshot()] == [kept.endpoint]
        finally:
            for gw in gws:
                gw.stop()


def _named_servers_are_asked(gws: list[GatewayProcess], sims: str, capsys, monkeypatch) -> None:
    """An explicit list skips multicast: the named gateways are asked for their status."""
    with Discovery(ServerListSource([gw.address for gw in gws])) as d:
        found = {g.address: g for g in d.wait(3, timeout=30)}
    assert sorted(found) == sorted(gw.endpoint for gw in gws)
    assert [x["name"] for x in found[sims].gpus] == ["Sim L4", "Sim A16"]
    assert all(isinstance(x["free_memory"], int) for g in found.values() for x in g.gpus)
    with monkeypatch.context() as m:
        m.setenv("REMOTECUDA_SERVERS", ",".join(gw.address for gw in gws))
        m.setenv("REMOTECUDA_DISCOVERY", "239.255.0.1:9")  # where nobody announces: the list skips multicast
        assert cli.main(["servers", "--json"]) == 0
    assert sorted(g["address"] for g in json.loads(capsys.readouterr().out)) == sorted(found)
