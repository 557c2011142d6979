"""The GPU pool on real gateways: gateway processes on loopback with simulated GPUs of different
sizes and capabilities, announcing themselves on a multicast group of this file's own, and
client processes whose devices are placed among them by each strategy. Results are compared
with the same computation on the local CPU; the placements are read from ``remotecuda.stats()``
and from the one log line each placement writes to stderr."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT, GatewayProcess, private_discovery, run_python, wait_for

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from delay_proxy import DelayProxy  # noqa: E402

#: name: (memory, compute capability). T4 has the most memory but no bf16; V100 is reached only
#: through a delay proxy (its beacons give the proxy's address)
FLEET = {"T4": ("160MB", "7.5"), "A100": ("128MB", "8.0"), "L4": ("96MB", "8.9"), "V100": ("64MB", "7.0")}
FAR = "V100"
DELAY_MS = 100  # each way
#: a gateway started with the others but stopped (SIGSTOP) at once, so no client hears it until a
#: test lets it go on: it joins the pool late
LATE = ("H100", "256MB", "9.0")

#: the client: activates (discovery unless REMOTECUDA_SERVERS), prints the devices as placed before
#: and after its workload, and checks the workload against the local CPU
CLIENT = textwrap.dedent(r'''
    import json, sys, torch, remotecuda
    remotecuda.activate(fallback="error")
    work = sys.argv[1]

    def show(tag):
        print(tag, json.dumps(remotecuda.stats()["devices"]), flush=True)

    n = torch.cuda.device_count()
    print("COUNT", n, flush=True)
    show("BEFORE")
    if "--go" in sys.argv:  # started ahead (torch imported, activated): begin when told
        sys.stdin.readline()
    torch.manual_seed(0)
    if work == "model":  # a large model: 40 MiB of parameters, moved at once
        m = torch.nn.Linear(2560, 4096)
        x = torch.randn(8, 2560)
        want = m(x)
        got = m.cuda()(x.cuda()).cpu()
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    elif work == "reads":  # a value read every few ops
        x, r = torch.arange(1000.), torch.arange(1000., device="cuda")
        for i in range(5):
            x, r = x * 0.5 + 1, r * 0.5 + 1
            assert r.sum().item() == x.sum().item()
    elif work == "bf16":  # a small model in bfloat16
        m = torch.nn.Linear(64, 64).to(torch.bfloat16)
        x = torch.randn(4, 64, dtype=torch.bfloat16)
        want = m(x)
        got = m.cuda()(x.cuda()).cpu()
        assert torch.equal(got, want), (got - want).abs().max()
    elif work == "devices":  # every device: the count first, then each placed by its own first need
        assert all(not d["placed"] for d in remotecuda.stats()["devices"])
        name = torch.cuda.get_device_name(1)  # places cuda:1 only
        placed = [d["placed"] for d in remotecuda.stats()["devices"]]
        assert placed == [i == 1 for i in range(n)], placed
        assert "simulated" in repr(remotecuda.stats()["devices"][1]) and name
        torch.cuda.set_device(2)
        assert torch.cuda.current_device() == 2 and not remotecuda.stats()["devices"][2]["placed"]
        x = torch.randn(100)
        with torch.cuda.device(3):
            assert torch.ones(2, device="cuda").device.index == 3
        for i in range(n):
            got = (x.to(f"cuda:{i}") * i).sum().item()
            assert abs(got - (x * i).sum().item()) < 1e-3
        print("PROPS", json.dumps([torch.cuda.get_device_properties(i).name for i in range(n)]), flush=True)
        print("CUDA", torch.version.cuda, flush=True)  # (the current device's runtime: discovered, then placed)
    elif work == "late":  # cuda:0 now; cuda:1 (pinned to a gateway that is not there yet) when told
        assert (torch.ones(2, device="cuda:0") * 2).sum().item() == 4
        print("READY", flush=True)
        sys.stdin.readline()
        assert torch.ones(3, device="cuda:1").sum().item() == 3
    elif work == "hold":  # open the session when told, and hold it until stdin closes
        sys.stdin.readline()
        mib = int(sys.argv[2]) if len(sys.argv) > 2 else 0
        held = torch.ones(max(1, mib * 2**20 // 4), device="cuda")
        assert held.sum().item() == held.numel()
        show("OPEN")
        sys.stdin.read()
        sys.exit(0)
    show("AFTER")
''')


def placed_names(devices: list[dict]) -> list[str]:
    return [d["name"] for d in devices]


@pytest.fixture(scope="module")
def fleet():
    """Four gateways announcing themselves on a private group: FLEET's simulated GPUs, V100
    advertised through a delay proxy."""
    group = private_discovery()
    saved = os.environ.get("REMOTECUDA_DISCOVERY")
    os.environ["REMOTECUDA_DISCOVERY"] = group
    proxy = DelayProxy(1, delay_ms=DELAY_MS).start()

    def start(name: str) -> GatewayProcess:
        memory, cap = FLEET[name]
        extra = ["--advertise", proxy.address] if name == FAR else []
        return GatewayProcess("--gpus", "1", "--gpu-memory", memory, "--gpu-name", name, "--gpu-capability", cap,
                              "--spare", "2", *extra, discovery=True)

    def start_late() -> GatewayProcess:
        gw = GatewayProcess("--gpus", "1", "--gpu-memory", LATE[1], "--gpu-name", LATE[0],
                            "--gpu-capability", LATE[2], discovery=True)
        os.kill(gw.proc.pid, signal.SIGSTOP)
        return gw

    with ThreadPoolExecutor(len(FLEET) + 1) as ex:
        late = ex.submit(start_late)
        gws = dict(zip(FLEET, ex.map(start, FLEET)))
        late_gw = late.result()
    proxy.target = ("127.0.0.1", int(gws[FAR].address.rsplit(":", 1)[1]))
    try:
        yield {"group": group, "gws": gws, "proxy": proxy, "late": late_gw}
    finally:
        os.kill(late_gw.proc.pid, signal.SIGCONT)
        for gw in [*gws.values(), late_gw]:
            gw.stop()
        proxy.stop()
        if saved is None:
            os.environ.pop("REMOTECUDA_DISCOVERY", None)
        else:
            os.environ["REMOTECUDA_DISCOVERY"] = saved


def client(fleet, work: str, **env: str):
    """Run CLIENT with ``work`` against the fleet; its output lines by tag, and its stderr."""
    e = {"REMOTECUDA_DISCOVERY": fleet["group"], "REMOTECUDA_SERVERS": "", **env}
    r = run_python(CLIENT, env=e, args=["-c", CLIENT, work], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return _tagged(r.stdout), r.stderr


def _tagged(stdout: str) -> dict:
    out = {}
    for line in stdout.splitlines():
        tag, _, rest = line.partition(" ")
        out[tag] = json.loads(rest) if rest[:1] in "[{" else rest
    return out


def placement_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("remotecuda: cuda:")]


class Holder:
    """A client process that opens its session when told and holds it (and ``mib`` on its GPU)
    until closed."""

    def __init__(self, fleet, mib: int = 0, **env: str):
        e = {**os.environ, "REMOTECUDA_DISCOVERY": fleet["group"], "REMOTECUDA_SERVERS": "", **env}
        self.p = subprocess.Popen([sys.executable, "-c", CLIENT, "hold", str(mib)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=e)

    def open(self) -> dict:
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        for line in self.p.stdout:
            if line.startswith("OPEN "):
                return json.loads(line[5:])[0]
        raise AssertionError(f"the holder ended: {self.p.stderr.read()[-3000:]}")

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def test_memory_aware_takes_the_most_free_memory_and_avoids_a_nearly_full_gpu(fleet):
    gws = fleet["gws"]
    filler = Holder(fleet, 140, REMOTECUDA_DEVICES=f"{gws['T4'].address}/T4")  # pinned, by address and name
    e = {**os.environ, "REMOTECUDA_DISCOVERY": fleet["group"], "REMOTECUDA_SERVERS": "",
         "REMOTECUDA_STRATEGY": "memory-aware"}
    p = subprocess.Popen([sys.executable, "-c", CLIENT, "model", "--go"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=e)
    try:
        d = filler.open()
        assert d["name"] == "T4" and d["gateway"] == gws["T4"].endpoint, d
        stdout, err = p.communicate("go\n", timeout=120)  # the client places only now
        assert p.returncode == 0, err[-3000:]
        out = _tagged(stdout)
    finally:
        p.kill()
        filler.close()
    (dev,) = out["AFTER"]
    assert dev["name"] == "A100" and dev["strategy"] == dev["requested"] == "memory-aware", dev
    assert "gw 127.0.0.1" in dev["reason"] and "(A100 simulated) has 122.1 MiB free" in dev["reason"], dev
    (line,) = placement_lines(err)
    assert line.startswith("remotecuda: cuda:0 placed at its first upload") and line.endswith(dev["reason"]), err


def test_latency_optimized_avoids_the_gateway_behind_a_delay_proxy(fleet):
    out, err = client(fleet, "devices", REMOTECUDA_STRATEGY="latency-optimized", REMOTECUDA_DEVICES="4")
    assert out["COUNT"] == "4"
    devs = out["AFTER"]
    assert all(d["placed"] and d["strategy"] == "latency-optimized" for d in devs), devs
    assert FAR not in placed_names(devs), devs  # (which of the others: their loopback round trips decide)
    assert out["PROPS"] == placed_names(devs)
    assert out["CUDA"] == "12.8"  # (a simulated GPU's)
    assert all("rtt" in d["reason"] for d in devs) and len(placement_lines(err)) == 4, err
    # cuda:1 was placed first, by a question about its properties
    assert placement_lines(err)[0].startswith("remotecuda: cuda:1 placed at a question about its properties: ")


def test_load_balancing_spreads_six_sessions_over_three_gateways(fleet):
    """Six client processes, each opening its session while the ones before hold theirs: two per
    gateway (an explicit list of three gateways: the point is the spread, not discovery)."""
    gws = fleet["gws"]
    three = ",".join(gws[n].address for n in ("T4", "A100", "L4"))
    holders = [Holder(fleet, REMOTECUDA_SERVERS=three, REMOTECUDA_DEVICES="1",
                      REMOTECUDA_STRATEGY="load-balancing") for _ in range(6)]
    try:
        placed = [h.open()["name"] for h in holders]
    finally:
        for h in holders:
            h.close()
    assert sorted(placed) == ["A100", "A100", "L4", "L4", "T4", "T4"], placed


def test_adaptive_chooses_by_the_session_and_says_why(fleet):
    with ThreadPoolExecutor(3) as ex:
        (model, model_err), (reads, reads_err), (bf16, bf16_err) = ex.map(
            lambda work: client(fleet, work), ["model", "reads", "bf16"])
    (dev,) = model["AFTER"]  # a large model: the most free memory
    assert dev["requested"] == "adaptive" and dev["strategy"] == "memory-aware", dev
    assert dev["reason"].startswith("adaptive → memory-aware: session holds 40.0 MiB")
    (line,) = placement_lines(model_err)
    assert line.startswith("remotecuda: cuda:0 placed at its first upload") and line.endswith(dev["reason"])
    (dev,) = reads["AFTER"]  # reads a value every few ops: the nearest
    assert dev["strategy"] == "latency-optimized" and dev["name"] != FAR, dev
    assert dev["reason"].startswith("adaptive → latency-optimized: a sync every "), dev
    assert placement_lines(reads_err)[0].startswith("remotecuda: cuda:0 placed at its first value read ")
    (dev,) = bf16["AFTER"]  # bfloat16: a GPU that has it
    assert dev["name"] in ("A100", "L4"), dev
    assert "bfloat16 → only GPUs with bf16 (2 of 4)" in dev["reason"], dev
    (line,) = placement_lines(bf16_err)
    assert line.startswith("remotecuda: cuda:0 placed at its first upload") and line.endswith(dev["reason"])


def test_nothing_found_is_an_error_or_the_local_cpu(fleet):
    env = {"REMOTECUDA_DISCOVERY": private_discovery(), "REMOTECUDA_SERVERS": ""}
    code = ("import remotecuda, torch\n"
            "try:\n    remotecuda.activate(fallback='error')\n"
            "except remotecuda.GatewayUnavailableError as e:\n    print('ERROR', e)\n"
            "remotecuda.deactivate()\n"
            "remotecuda.activate()\n"
            "print('COUNT', torch.cuda.device_count(), torch.ones(3, device='cuda').sum().item())\n")
    r = run_python(code, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    err = r.stdout.split("ERROR ", 1)[1].splitlines()[0]
    assert "no beacon heard on multicast" in err and "REMOTECUDA_FALLBACK=error" in err, err
    assert "COUNT 1 3.0" in r.stdout and "running 'cuda' work on the local CPU" in r.stderr


def test_a_gateway_that_joins_later_takes_devices_placed_later(fleet):
    """The pool follows discovery after activation: a gateway heard only after cuda:0 was placed
    is where cuda:1, pinned to its GPU's name, goes."""
    from remotecuda.discovery import Discovery, MulticastSource
    e = {**os.environ, "REMOTECUDA_DISCOVERY": fleet["group"], "REMOTECUDA_SERVERS": "",
         "REMOTECUDA_DEVICES": f"any,any/{LATE[0]}"}
    p = subprocess.Popen([sys.executable, "-c", CLIENT, "late"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT, env=e)
    try:
        assert wait_for(lambda: p.stdout.readline().startswith("READY"), 120), p.stderr.read()[-3000:]
        group, port = fleet["group"].split(":")
        with Discovery(MulticastSource(group, int(port), "127.0.0.1")) as d:
            os.kill(fleet["late"].proc.pid, signal.SIGCONT)  # its beacons start now
            assert wait_for(lambda: any(g.address == fleet["late"].endpoint for g in d.snapshot()), 10)
        stdout, err = p.communicate("go\n", timeout=120)
        assert p.returncode == 0, err[-3000:]
    finally:
        p.kill()
    devs = _tagged(stdout)["AFTER"]
    assert devs[0]["name"] != LATE[0] and devs[1]["name"] == LATE[0], devs
    assert devs[1]["gateway"] == fleet["late"].endpoint and devs[1]["simulated"], devs


def test_a_pin_reaches_a_gateway_that_does_not_announce_itself(gateway):
    """docs/POOL.md: "A pin's HOST:PORT is asked directly, so a gateway that does not announce itself
    (--no-discovery) can still be pinned": with no beacon heard, such a pin fell back to the local CPU."""
    host_port = gateway.address.removeprefix("tcp://")
    r = run_python("import torch, remotecuda\n"
                   "remotecuda.activate()\n"
                   "print((torch.ones(3, device='cuda') * 2).sum().item(), torch.cuda.get_device_name(0))\n",
                   env={"REMOTECUDA_DEVICES": f"{host_port}/0", "REMOTECUDA_FALLBACK": "error",
                        "REMOTECUDA_SERVERS": "", "REMOTECUDA_DISCOVERY": private_discovery()}, timeout=180)
    assert r.returncode == 0 and r.stdout.split()[0] == "6.0" and "fallback" not in r.stdout, r.stderr
