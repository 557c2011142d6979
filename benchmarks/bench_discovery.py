"""Discovery at scale: one process announces 200 simulated gateways, a client listens.

    python benchmarks/bench_discovery.py [--gateways 200] [--seconds 10] [--quick] [--json OUT] [--write]

A sender process (this file with ``--send``) sends one beacon per gateway per second, spread
evenly over the second, on 127.0.0.1 and a multicast group of its own; each gateway has 4-8
GPUs whose load (memory, utilization, queue, sessions, latency) changes from beacon to beacon.
The client, in this process, is remotecuda.discovery.Discovery. Measured in one run:

1. the time from starting the client to a complete list of all gateways;
2. the CPU time of the client's discovery thread (and of its whole process) per second of
   listening, over ``--seconds``, and the beacons it took in meanwhile (none lost, none dropped);
3. how late a gateway gone silent (as after ``kill -9``) and one sending its ``leaving`` beacon
   are dropped;
4. the beacon's size for 4 and 8 GPUs, and the decode cost per beacon alone;
5. ``remotecuda servers --json`` (a fresh process, default wait) listing them all.

``--write`` appends (or replaces) its section in benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_md import put_section  # noqa: E402

ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from remotecuda.discovery import SWEEP, Discovery, MulticastSource  # noqa: E402
from remotecuda_wire import beacon  # noqa: E402

GIB = 2**30
IFACE = "127.0.0.1"
NAMES = [("NVIDIA A100-SXM4-80GB", 80, [8, 0]), ("NVIDIA H100 80GB HBM3", 80, [9, 0]),
         ("NVIDIA L40S", 48, [8, 9]), ("NVIDIA RTX A6000", 48, [8, 6]), ("Tesla V100-SXM2-32GB", 32, [7, 0])]
SECTION = "# Part 6: discovery at scale (benchmarks/bench_discovery.py)"


# ---------------------------------------------------------------------------- the sender
def gateway_info(i: int, rng: random.Random) -> dict:
    """A realistic gateway description: what a gateway's beacon carries besides its envelope
    (remotecuda_server/gateway.py's ``_beacon_info``)."""
    name, gib, cap = NAMES[i % len(NAMES)]
    gpus = [{"index": k, "name": name, "kind": "cuda", "simulated": False, "capability": cap, "bf16": cap >= [8, 0],
             "total_memory": gib * GIB, "free_memory": gib * GIB, "utilization": 0.0, "queued": 0, "sessions": 0,
             "latency_ms": None} for k in range(4 + i % 5)]
    return {"gateway": "0.1.0", "protocol": 3, "torch": "2.5.1+cu124", "host": f"gpu-node-{i:03d}.lab.example",
            "sessions": 0, "gpus": gpus}


def churn(info: dict, rng: random.Random) -> None:
    """Each beacon's load differs from the last one's, as a busy gateway's does."""
    for g in info["gpus"]:
        g["free_memory"] = rng.randrange(0, g["total_memory"])
        g["utilization"] = round(rng.random(), 3)
        g["queued"] = rng.randrange(0, 12)
        g["sessions"] = rng.randrange(0, 4)
        g["latency_ms"] = round(rng.uniform(0.05, 3.0), 4)
    info["sessions"] = sum(g["sessions"] for g in info["gpus"])


def address(gid: str) -> str:
    i = int(gid[1:])
    return f"tcp://10.0.{i // 250}.{i % 250 + 1}:55555"


def send(group: str, port: int, n: int) -> None:
    """Announce ``n`` gateways until stdin closes; stdin lines "silence ID" / "leave ID" stop one
    (answered on stdout with the monotonic time it happened)."""
    rng = random.Random(0)
    infos = {f"g{i:03d}": gateway_info(i, rng) for i in range(n)}
    order = list(infos)
    seqs = dict.fromkeys(order, 0)
    silent: set[str] = set()
    sock = beacon.sender(IFACE)
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)
    t0 = time.monotonic()
    print("READY", flush=True)
    k = 0
    while True:
        gid = order[k % n]
        due = t0 + k / n  # gateway i at i/n of every second
        for key, _ in sel.select(max(0.0, due - time.monotonic())):
            line = key.fileobj.readline()  # type: ignore[union-attr]
            if not line:
                return
            what, who = line.split()
            silent.add(who)
            if what == "leave":
                sock.sendto(beacon.encode(who, address(who), seqs[who] + 1, infos[who], leaving=True), (group, port))
            print(f"{what} {who} {time.monotonic()}", flush=True)
        if time.monotonic() < due:
            continue
        k += 1
        if gid in silent:
            continue
        churn(infos[gid], rng)
        seqs[gid] += 1
        sock.sendto(beacon.encode(gid, address(gid), seqs[gid], infos[gid]), (group, port))


# ---------------------------------------------------------------------------- the client
def free_group() -> tuple[str, int]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((IFACE, 0))
        port = s.getsockname()[1]
    return f"239.255.{random.randint(101, 199)}.{random.randint(1, 254)}", port


def beacon_sizes() -> dict:
    rng = random.Random(1)
    out = {}
    for gpus in (4, 8):
        sizes = []
        for i in range(50):
            info = gateway_info(gpus - 4, rng)
            churn(info, rng)
            sizes.append(len(beacon.encode(f"{i:032x}", "tcp://10.0.0.1:55555", 123456, info)))
        out[gpus] = {"min": min(sizes), "max": max(sizes), "mean": statistics.mean(sizes)}
    return out


def decode_cost(n: int = 20000) -> dict:
    """µs per 8-GPU beacon for ``beacon.decode`` and ``beacon.decode_envelope`` (what a listener
    runs per beacon), best of 5 each."""
    rng = random.Random(2)
    info = gateway_info(4, rng)
    churn(info, rng)
    data = beacon.encode("f" * 32, "tcp://10.0.0.1:55555", 1, info)
    out = {}
    for fn in (beacon.decode, beacon.decode_envelope):
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                fn(data)
            best = min(best, time.perf_counter() - t)
        out[fn.__name__] = best / n * 1e6
    return out


def thread_cpu(t: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))  # type: ignore[arg-type]


def measure(n: int, seconds: float) -> dict:
    group, port = free_group()
    sender = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--send", f"{group}:{port}",
                               "--gateways", str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert sender.stdout is not None and sender.stdin is not None
    try:
        assert sender.stdout.readline().strip() == "READY"
        time.sleep(1.5)  # the gateways have been announcing for a while when the client starts
        counts = {"joined": 0, "updated": 0, "left": 0}
        left_at: dict[str, float] = {}
        last_beacon: dict[str, float] = {}

        def on(kind: str, g) -> None:
            counts[kind] += 1
            if kind == "left":
                left_at[g.id] = time.monotonic()
                last_beacon[g.id] = g.last_seen
        t0 = time.perf_counter()
        d = Discovery(MulticastSource(group, port, IFACE))
        d.subscribe(on)
        complete = len(d.wait(n, timeout=30))
        t_complete = time.perf_counter() - t0
        # listening: this thread sleeps, so the process's CPU time is the discovery thread's and ZeroMQ-free
        c0, tc0, w0, u0 = time.process_time(), thread_cpu(d._thread), time.perf_counter(), counts["updated"]
        time.sleep(seconds)
        c1, tc1, w1, u1 = time.process_time(), thread_cpu(d._thread), time.perf_counter(), counts["updated"]
        wall = w1 - w0
        listed = len(d.snapshot())
        flaps = counts["left"]
        # a gateway gone silent (kill -9) and one saying it leaves
        sender.stdin.write("silence g000\n")
        sender.stdin.flush()
        silenced_at = float(sender.stdout.readline().split()[2])
        sender.stdin.write("leave g001\n")
        sender.stdin.flush()
        leave_at = float(sender.stdout.readline().split()[2])
        end = time.monotonic() + 10
        while not all(x in left_at for x in ("g000", "g001")) and time.monotonic() < end:
            time.sleep(0.05)
        # the command a person runs, against the same 198 gateways
        env = dict(os.environ, REMOTECUDA_DISCOVERY=f"{group}:{port}", REMOTECUDA_DISCOVERY_IFACE=IFACE)
        env.pop("REMOTECUDA_SERVERS", None)
        tc = time.perf_counter()
        cli = subprocess.run([sys.executable, "-m", "remotecuda", "servers", "--json"], capture_output=True,
                             text=True, timeout=60, env=env, cwd=ROOT)
        cli_s = time.perf_counter() - tc
        d.close()
    finally:
        sender.stdin.close()
        sender.wait(timeout=10)
    return {
        "gateways": n, "gpus": sum(4 + i % 5 for i in range(n)), "complete": complete,
        "time_to_complete_s": t_complete, "listen_s": wall,
        "thread_cpu_ms_per_s": (tc1 - tc0) / wall * 1e3, "process_cpu_ms_per_s": (c1 - c0) / wall * 1e3,
        "beacons_per_s": (u1 - u0) / wall, "listed_after": listed, "flaps": flaps,
        "silent_dropped_after_s": left_at["g000"] - silenced_at if "g000" in left_at else None,
        "silent_dropped_after_last_beacon_s": left_at["g000"] - last_beacon["g000"] if "g000" in left_at else None,
        "leaving_dropped_after_s": left_at["g001"] - leave_at if "g001" in left_at else None,
        "cli_listed": len(json.loads(cli.stdout)) if cli.returncode == 0 else 0, "cli_s": cli_s,
        "sizes": beacon_sizes(), "decode_us": decode_cost(),
    }


def machine() -> dict:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": model, "nproc": os.cpu_count(), "python": platform.python_version(),
            "date": subprocess.run(["date"], capture_output=True, text=True).stdout.strip(),
            "load": " / ".join(f"{x:.2f}" for x in os.getloadavg())}


def markdown(r: dict) -> str:
    m = r["machine"]
    s4, s8 = r["sizes"]["4"], r["sizes"]["8"]
    per_beacon_us = r["thread_cpu_ms_per_s"] * 1e3 / max(r["beacons_per_s"], 1e-9)
    return f"""One sender process announces {r['gateways']} simulated gateways ({r['gpus']} GPUs, 4-8 each, load changing
every beacon), one beacon per gateway per second spread evenly over the second, on 127.0.0.1 and a multicast group of
its own. The client is `remotecuda.discovery.Discovery` in the benchmark's process, started once the gateways have
been announcing for 1.5 s. Measured on {m['date']} ({m['cpu']}, {m['nproc']} CPUs, Python {m['python']}, load
average {m['load']} at the end; the machine is shared), all figures from the same run.

| | measured |
| --- | --- |
| time from starting the client to the complete list of {r['gateways']} | {r['time_to_complete_s']:.2f} s ({r['complete']} listed) |
| CPU of the discovery thread per second of listening (over {r['listen_s']:.0f} s) | {r['thread_cpu_ms_per_s']:.2f} ms/s ({r['thread_cpu_ms_per_s'] / 10:.2f} % of one CPU) |
| CPU of the whole client process per second of listening | {r['process_cpu_ms_per_s']:.2f} ms/s |
| beacons taken in per second / per beacon | {r['beacons_per_s']:.0f} /s; {per_beacon_us:.0f} µs of thread CPU each |
| gateways listed after listening / dropped meanwhile (flaps) | {r['listed_after']} / {r['flaps']} |
| a gateway gone silent (as after `kill -9`) dropped after | {r['silent_dropped_after_s']:.2f} s; {r['silent_dropped_after_last_beacon_s']:.2f} s after its last beacon (expiry {beacon.EXPIRY} s) |
| a gateway sending its `leaving` beacon dropped after | {r['leaving_dropped_after_s'] * 1e3:.1f} ms |
| `remotecuda servers --json` (fresh process, default 1.5 s wait) | {r['cli_listed']} listed in {r['cli_s']:.2f} s |
| beacon size, 4 GPUs (min / mean / max) | {s4['min']} / {s4['mean']:.0f} / {s4['max']} bytes |
| beacon size, 8 GPUs (min / mean / max) | {s8['min']} / {s8['mean']:.0f} / {s8['max']} bytes (limit {beacon.MAX_BYTES}) |
| `beacon.decode_envelope` (per beacon heard) / `beacon.decode` (when a description is read), 8 GPUs | {r['decode_us']['decode_envelope']:.1f} µs / {r['decode_us']['decode']:.1f} µs |

Reading: a client knows the whole pool after one beacon round (beacons every {beacon.INTERVAL:.0f} s), and
listening to {r['gateways']} gateways costs it about {r['thread_cpu_ms_per_s'] / 10:.1f} % of one CPU; the cost is per
beacon, so it grows linearly with the number of gateways. A silent gateway goes {beacon.EXPIRY} s after its last
beacon (plus at most one {SWEEP} s sweep), a leaving one at once. An 8-GPU beacon is far inside one datagram.
"""


def write(r: dict) -> None:
    """Put this part's section into benchmarks/RESULTS.md (replacing an earlier one of its own)."""
    put_section(SECTION, markdown(r))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateways", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=10.0, help="how long to measure listening")
    ap.add_argument("--quick", action="store_true", help="3 s of listening (a smoke run)")
    ap.add_argument("--json", help="write the figures here (benchmarks/run_all.py reads them)")
    ap.add_argument("--write", action="store_true", help="put the section into benchmarks/RESULTS.md")
    ap.add_argument("--send", metavar="GROUP:PORT", help=argparse.SUPPRESS)  # the sender process
    a = ap.parse_args()
    if a.send:
        group, _, port = a.send.rpartition(":")
        send(group, int(port), a.gateways)
        return
    r = measure(a.gateways, 3.0 if a.quick else a.seconds)
    r["machine"] = machine()
    r = json.loads(json.dumps(r))  # the sizes' keys as run_all.py reads them back: strings
    print(markdown(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f)
    if a.write:
        write(r)


if __name__ == "__main__":
    main()
