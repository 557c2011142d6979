"""The gateway's side of the GPU pool: several (simulated) GPUs, their memory enforced, their
figures in STATUS and in multicast beacons, and liveness pings answered while workers are busy.

Real gateway processes (`remotecuda start --device cpu --gpus N`), real clients in fresh
interpreters, real multicast on 127.0.0.1, each beacon test on a group of its own."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import zmq

from remotecuda_server import memory_account
from remotecuda_server.devices import detect, parse_size, simulated_devices
from remotecuda_server.load import GpuLoad
from remotecuda_wire import beacon, protocol

from conftest import ROOT, GatewayProcess, private_discovery, run_python, wait_for

MB = 10**6
MIB = 2**20
GPUS = ("--gpus", "3", "--gpu-memory", "64MB,96MiB,1GiB", "--gpu-name", "Sim A100,Sim T4,Sim H100",
        "--gpu-capability", "8.0,7.5,9.0", "--spare", "1")
FIGURES = {"index", "name", "kind", "simulated", "capability", "bf16", "total_memory", "free_memory",
           "utilization", "queued", "sessions", "latency_ms"}


@pytest.fixture(scope="module")
def sim():
    """A gateway with three simulated GPUs of different sizes, names and capabilities."""
    gw = GatewayProcess(*GPUS)
    yield gw
    gw.stop()


def ask(address: str, msg_type: int, body: dict, timeout: float = 10.0) -> protocol.Message:
    """One message to a gateway's port, without a session, and its answer."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    try:
        sock.send_multipart(protocol.encode(msg_type, body))
        assert sock.poll(int(timeout * 1000)), f"no answer from {address}"
        return protocol.decode(sock.recv_multipart())
    finally:
        sock.close()


def status(address: str) -> dict:
    return ask(address, protocol.STATUS, {}).body


def near(free: int, expected: int) -> bool:
    """Free memory as expected, but for the few bytes of results a session holds (a sum's scalar)."""
    return expected - 64 <= free <= expected


# ---------------------------------------------------------------------------- simulated GPUs

def test_sizes_and_lists():
    assert [parse_size(s) for s in ("24GB", "24GiB", "512MB", "1.5GiB", "1000", "64 mib")] == \
        [24 * 10**9, 24 * 2**30, 512 * MB, 3 * 2**29, 1000, 64 * MIB]
    for bad in ("24XB", "-1GB", "0", "GB", "1e9"):
        with pytest.raises(ValueError):
            parse_size(bad)
    two = simulated_devices(2, "1GB", "A,B", "7.0")
    assert [(d.name, d.total_memory, d.capability, d.bf16, d.kind, d.simulated) for d in two] == \
        [("A", 10**9, [7, 0], False, "cpu", True), ("B", 10**9, [7, 0], False, "cpu", True)]
    with pytest.raises(ValueError, match="3 values for 2"):
        simulated_devices(2, "1GB,2GB,3GB")


def test_op_latency_keeps_its_last_measure_through_a_window_of_unmeasurably_brief_ops():
    """A closing session's frees take no measurable time: a window of only those read as a GPU of
    0 ms latency (a CI run of test_per_gpu_figures_... read 0 once its load had ended), which the
    latency-optimized placement would prefer."""
    load = GpuLoad(0.0)
    load.report({}, {"busy_s": 0.5, "run_s": 0.4, "ops": 100})
    load.sample(1.0)
    assert load.latency() == 4.0
    for t in (5.0, 9.0):  # (the window moves past the measured ops)
        load.sample(t)
    load.report({"run_s": 0.4, "ops": 100}, {"run_s": 0.4, "ops": 103})
    assert load.latency() == 4.0


def test_bad_gpu_options_are_refused():
    for args, says in [((None, "1GB", None, None), "add --gpus N"),
                       (("2", None, "a,b,c", None), "3 values for 2 simulated GPUs"),
                       (("0,1", None, None, None), "how many simulated GPUs"),
                       (("1", None, None, "8"), "MAJOR.MINOR")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            detect("cpu", *args)
    with pytest.raises(ValueError, match="use them with --device cpu --gpus N"):
        detect("cuda", None, None, "A100", None)
    r = subprocess.run([sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
                        "--gpus", "1", "--gpu-memory", "lots"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "remotecuda start: --gpu-memory: 'lots' is not a memory size" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
                        "--session-memory", "lots"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "remotecuda start: --session-memory: 'lots' is not a memory size" in r.stderr, r.stderr


ACCOUNT_USER = r'''
import sys, torch
from remotecuda_server.memory_account import MemoryAccount
a = MemoryAccount(int(sys.argv[1]), 100, 0, "Sim", int(sys.argv[2]))
sys.stdin.readline()
for _ in range(20000):  # the two processes at once: a lost update would leave the total wrong
    a.take(1)
    a.give(1)
a.take(30)
print("HELD", flush=True)
sys.stdin.readline()
try:
    a.take(60)
except torch.OutOfMemoryError as e:
    print("OOM", e, flush=True)
'''


def test_memory_account_is_exact_across_processes():
    """Workers share a simulated GPU's account through an inherited descriptor: taking and giving
    at once from two processes keeps the total exact, the size holds, and clearing a slot (a
    worker gone) returns its share."""
    fd = memory_account.create("test")
    supervisor = memory_account.MemoryAccount(fd, 100, 0, "Sim")
    users = [subprocess.Popen([sys.executable, "-c", ACCOUNT_USER, str(fd), str(k)], pass_fds=(fd,), cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for k in (1, 2)]
    try:
        for p in users:
            p.stdin.write("go\n")
            p.stdin.flush()
        assert [p.stdout.readline() for p in users] == ["HELD\n"] * 2
        said = [p.communicate("go\n", timeout=120)[0] for p in users]
        assert all(p.returncode == 0 for p in users)
        assert said == ["OOM CUDA out of memory. Tried to allocate 60 bytes. GPU 0 (Sim, simulated) has a total "
                        "capacity of 100 bytes of which 40 bytes is free. This session has 30 bytes memory in use; "
                        "other sessions on this GPU hold 30 bytes.\n"] * 2
        assert supervisor.used() == 60
        supervisor.clear(1)
        assert supervisor.used() == 30 and supervisor.free() == 70
    finally:
        supervisor.close()


WANT = [("Sim A100", 64 * MB, [8, 0], True), ("Sim T4", 96 * MIB, [7, 5], False), ("Sim H100", 2**30, [9, 0], True)]


def test_simulated_gpus_in_welcome_and_status(sim):
    welcome = ask(sim.address, protocol.HELLO, {"device": None}).body
    assert [(d["name"], d["total_memory"], d["capability"], d["bf16"]) for d in welcome["devices"]] == WANT
    assert all(d["simulated"] and d["kind"] == "cpu" for d in welcome["devices"])
    assert isinstance(welcome["id"], str) and len(welcome["id"]) == 16
    gpus = status(sim.address)["gpus"]
    assert [set(g) for g in gpus] == [FIGURES] * 3
    assert [(g["index"], g["name"], g["total_memory"], g["capability"], g["bf16"], g["simulated"], g["kind"])
            for g in gpus] == [(i, *w, True, "cpu") for i, w in enumerate(WANT)]


CLIENT = r'''
import torch, remotecuda
remotecuda.activate(fallback="error")
print("COUNT", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    with torch.cuda.device(i):
        print("GPU", i, repr(p.name), p.major, p.minor, p.total_memory,
              torch.cuda.is_bf16_supported(including_emulation=False), torch.cuda.is_bf16_supported(),
              torch.cuda.get_device_name(i) == p.name)
x = torch.ones(8 * 2**20 // 4, device="cuda:0")             # 8 MiB of the 64 MB GPU
try:
    y = torch.ones(60 * 2**20 // 4, device="cuda:0")         # 60 MiB more: past its size
    y.sum().item()
    print("NO OOM")
except torch.cuda.OutOfMemoryError as e:
    print("OOM", type(e).__name__, isinstance(e, RuntimeError))
    print("MESSAGE", str(e).replace("\n", " "))
print("AFTER", (x * 2).sum().item())                         # the session goes on
free, total = torch.cuda.mem_get_info(0)
print("FREE", free, total, torch.cuda.memory_allocated(0))
del x
z = torch.full((56 * 2**20 // 4,), 2.0, device="cuda:0")     # the freed bytes are reusable
print("REUSED", z.sum().item())
'''


def test_a_client_sees_the_simulated_gpus_and_runs_out_of_their_memory(sim):
    """get_device_properties gives each simulated GPU's own; past its size an op is a
    torch.cuda.OutOfMemoryError, and the session goes on."""
    r = run_python(CLIENT, env={"REMOTECUDA_SERVERS": sim.address})
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert "COUNT 3" in lines
    for i, (name, size, (major, minor), bf16) in enumerate(WANT):
        assert f"GPU {i} {name!r} {major} {minor} {size} {bf16} True True" in lines, r.stdout  # (T4: emulated)
    f = dict(line.split(" ", 1) for line in lines if not line.startswith(("COUNT", "GPU")))
    assert f["OOM"] == "OutOfMemoryError True", r.stdout
    assert "CUDA out of memory. Tried to allocate 60.00 MiB" in f["MESSAGE"]
    assert "GPU 0 (Sim A100, simulated)" in f["MESSAGE"] and "total capacity of 61.04 MiB" in f["MESSAGE"]
    assert float(f["AFTER"]) == 2 * 2 * 2**20
    free, total, allocated = map(int, f["FREE"].split())
    assert total == 64 * MB and 8 * MIB <= allocated < 8 * MIB + 64 and free == total - allocated  # (+ a sum)
    assert float(f["REUSED"]) == 2.0 * 56 * 2**20 / 4


HOLDER = r'''
import sys, torch, remotecuda
remotecuda.activate(fallback="error")
torch.cuda.set_device(1)
mib = int(sys.argv[1])
held = []
print("READY", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    try:
        if cmd == "take":
            held.append(torch.ones(mib * 2**20 // 4, device="cuda"))
            print("TOOK", held[-1].sum().item(), flush=True)
        elif cmd == "free":  # (as locally: the caching allocator keeps freed memory until empty_cache)
            held.clear()
            torch.cuda.empty_cache()
            print("FREED", flush=True)
    except torch.cuda.OutOfMemoryError as e:
        print("OOM", str(e).replace("\n", " "), flush=True)
'''


class Holder:
    """A client process holding MiBs on the simulated GPU cuda:1, on command."""

    def __init__(self, address: str, mib: int):
        self.p = subprocess.Popen([sys.executable, "-c", HOLDER, str(mib)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                  env={**os.environ, "REMOTECUDA_SERVERS": address})
        assert self.p.stdout.readline().strip() == "READY"

    def do(self, cmd: str) -> str:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def test_sessions_on_one_simulated_gpu_share_its_memory(sim):
    """96 MiB GPU: 60 MiB held by one session leaves too little for 60 more in another, until it frees them."""
    a, b = Holder(sim.address, 60), Holder(sim.address, 60)
    try:
        assert a.do("take").startswith("TOOK")
        assert wait_for(lambda: near(status(sim.address)["gpus"][1]["free_memory"], 36 * MIB), 10)
        answer = b.do("take")
        assert answer.startswith("OOM CUDA out of memory. Tried to allocate 60.00 MiB. "
                                 "GPU 1 (Sim T4, simulated)"), answer
        assert "36.00 MiB is free" in answer and "other sessions on this GPU hold 60.00 MiB" in answer, answer
        assert a.do("free") == "FREED"
        assert b.do("take").startswith("TOOK")  # the same session, after its OOM
        g = status(sim.address)["gpus"][1]
        assert g["sessions"] == 2 and near(g["free_memory"], 36 * MIB)
    finally:
        a.close()
        b.close()
    assert wait_for(lambda: status(sim.address)["gpus"][1]["free_memory"] == 96 * MIB, 20)


LOAD = r'''
import os, sys, torch, remotecuda
remotecuda.activate(fallback="error")
torch.cuda.set_device(2)
x = torch.randn(384, 384, device="cuda")
print("STARTED", flush=True)
while not os.path.exists(sys.argv[1]):
    for _ in range(40):
        y = x @ x
    torch.cuda.synchronize()
print("DONE", flush=True)
'''


def test_per_gpu_figures_follow_the_load_and_pings_are_answered_meanwhile(sim, tmp_path):
    stop = tmp_path / "stop"
    p = subprocess.Popen([sys.executable, "-c", LOAD, str(stop)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "REMOTECUDA_SERVERS": sim.address})
    try:
        assert p.stdout.readline().strip() == "STARTED"
        seen: dict = {"queued": 0, "utilization": 0.0, "latency_ms": 0.0, "used": 0}
        pongs = []

        def busy() -> bool:
            g = status(sim.address)["gpus"]
            assert g[0]["sessions"] == g[1]["sessions"] == 0 and g[2]["sessions"] == 1
            for k in ("queued", "utilization", "latency_ms"):
                seen[k] = max(seen[k], g[2][k])
            seen["used"] = max(seen["used"], g[2]["total_memory"] - g[2]["free_memory"])
            pongs.append(ask(sim.address, protocol.PING, {"t": 1.5}).body)
            return all(seen.values())
        assert wait_for(busy, 30, 0.05), seen
        assert seen["used"] >= 384 * 384 * 4 and 0 < seen["utilization"] <= 1
        assert all(b["t"] == 1.5 and b["id"] == pongs[0]["id"] for b in pongs)  # (and "now", for traces)
    finally:
        stop.touch()
        assert p.stdout.readline().strip() == "DONE"
        p.wait(timeout=30)
    assert wait_for(lambda: status(sim.address)["gpus"][2]["sessions"] == 0, 10)
    assert wait_for(lambda: status(sim.address)["gpus"][2]["utilization"] == 0, 15)
    g = status(sim.address)["gpus"][2]
    assert g["queued"] == 0 and g["latency_ms"] > 0 and g["free_memory"] == g["total_memory"]


# ---------------------------------------------------------------------------- beacons

@pytest.fixture
def group(monkeypatch):
    """This test's own multicast group, as the gateways it starts read it."""
    channel = private_discovery()
    monkeypatch.setenv("REMOTECUDA_DISCOVERY", channel)
    addr, port = channel.split(":")
    sock = beacon.receiver(addr, int(port), "127.0.0.1")
    sock.settimeout(0.2)
    yield sock
    sock.close()


def listen(sock: socket.socket, seconds: float) -> list[tuple[float, dict]]:
    """Every beacon heard within ``seconds``, with when it came."""
    heard = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            data = sock.recv(beacon.MAX_BYTES + 1)
        except TimeoutError:
            continue
        body = beacon.decode(data)
        assert body is not None, data
        heard.append((time.monotonic(), body))
    return heard


def test_beacons_announce_the_gateway_and_its_gpus_and_say_when_it_leaves(group):
    gw = GatewayProcess("--gpus", "2", "--gpu-memory", "2GB,4GB", "--gpu-name", "Sim L4", "--spare", "0",
                        discovery=True)
    try:
        heard = listen(group, 3.5)
        inventory = status(gw.address)
    finally:
        gw.stop()
    left = listen(group, 1.5)
    assert len(heard) >= 3, heard
    bodies = [b for _, b in heard]
    first = bodies[0]
    assert {b["id"] for b in bodies} == {inventory["id"]} and first["addr"] == gw.endpoint
    assert [b["seq"] for b in bodies] == list(range(bodies[0]["seq"], bodies[0]["seq"] + len(bodies)))
    gaps = sorted(b - a for (a, _), (b, _) in zip(heard, heard[1:]))
    assert 0.5 < gaps[len(gaps) // 2] < 2.0, gaps  # about one a second
    assert first["gateway"] == inventory["gateway"] and first["protocol"] == protocol.VERSION
    assert first["torch"] == inventory["torch"] and first["host"] == socket.gethostname()
    assert first["sessions"] == 0 and not any(b["leaving"] for b in bodies)
    assert [set(g) for g in first["gpus"]] == [FIGURES] * 2
    assert [(g["name"], g["total_memory"], g["simulated"], g["free_memory"]) for g in first["gpus"]] == \
        [("Sim L4", 2 * 10**9, True, 2 * 10**9), ("Sim L4", 4 * 10**9, True, 4 * 10**9)]
    assert [b["leaving"] for _, b in left] == [True] and left[0][1]["id"] == first["id"]


def test_advertise_and_no_discovery(group):
    """--advertise puts another address in the beacon (and the banner says where it announces);
    a --no-discovery gateway sends nothing."""
    loud = subprocess.Popen([sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--gpus", "1",
                             "--port", "0", "--spare", "0", "--advertise", "gpu-box.example:6000",
                             "--discovery-iface", "127.0.0.1"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    quiet = GatewayProcess("--spare", "0", discovery=False)
    try:
        banner = []
        while not (banner and banner[-1].startswith("READY ")):
            banner.append(loud.stdout.readline().rstrip("\n"))
        text = "\n".join(banner)
        where = "{}:{}".format(*group.getsockname())
        assert f"discovery: announcing tcp://gpu-box.example:6000 on {where} via 127.0.0.1" in text, text
        assert "device 0: Simulated GPU, 16.0 GiB, capability 8.0 (simulated)" in text, text
        heard = [b for _, b in listen(group, 3.0)]
        assert heard and {b["addr"] for b in heard} == {"tcp://gpu-box.example:6000"}
        assert {b["id"] for b in heard} == {status(banner[-1].split("//")[1])["id"]}
        loud.terminate()
        assert loud.wait(timeout=30) == 0
        after = [b for _, b in listen(group, beacon.EXPIRY)]
        assert [b["leaving"] for b in after] == [True]  # the loud one's last word; the quiet one says none
        assert status(quiet.address)["id"] != heard[0]["id"]
    finally:
        loud.kill()
        quiet.stop()


def test_memory_aware_places_a_clients_devices_on_distinct_gpus(sim):
    """Two devices placed one at a time, memory-aware: the second goes to another GPU while one
    fits (both went to the largest, sharing its memory, as README's `REMOTECUDA_DEVICES=2` says not)."""
    r = run_python("import json, torch, remotecuda\nremotecuda.activate(fallback='error')\n"
                   "print('NAMES', json.dumps([torch.cuda.get_device_name(i) for i in range(2)]))",
                   env={"REMOTECUDA_SERVERS": sim.address, "REMOTECUDA_DEVICES": "2",
                        "REMOTECUDA_STRATEGY": "memory-aware"})
    assert r.returncode == 0, r.stderr[-3000:]
    names = json.loads(r.stdout.split("NAMES ", 1)[1])
    assert len(set(names)) == 2, r.stdout + r.stderr
