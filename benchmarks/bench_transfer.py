"""RemoteCUDA latency and transfer benchmarks, every comparison measured in one run.

    python benchmarks/bench_transfer.py [--quick] [--json PATH] [--no-256]

Starts its own gateway (``remotecuda start --device cpu --spare 0`` on 127.0.0.1) and a delay
proxy (benchmarks/delay_proxy.py, a separate process) in front of it, and measures:

(a) blocking round trips per training step, derived from outside: the same MLP training loop
    through the proxy at 0 ms and 25 ms each way; round trips per step =
    (t25 - t0) / (2 x 0.025 s) / steps, next to ``remotecuda.stats()["blocking_round_trips"]``;
    for a loop that reads no value per step and one with ``loss.item()`` every step;
(b) the step time at 25 ms vs 0 ms for a step of ~100 ms compute (Linear 1024x1024 layers,
    forward + backward + SGD, batch calibrated here), no value read per step, one sync at the end;
(c) upload and download throughput, 4 KB ... 256 MB, fresh content per upload, against a raw
    loopback socket (sendall / recv_into) in the same run; and re-uploads the content cache serves;
(d) bytes sent in epoch 2 / epoch 1 for a dataset that fits in the upload cache;
(e) compression: zeros, integer labels, random floats (16 MB each): each codec on its own (bytes, encode
    and decode time), ``LinkModel.choose`` at the default link speed, and real uploads raw, with each
    codec forced, and automatic;
(f) an upload-heavy loop (16 MB batch + ~equal compute per step): serial (``.cuda()``, compute,
    ``.item()``) vs pipelined (``remotecuda.prefetch``, one sync at the end), against
    max(transfer, compute) and transfer + compute.

(a) and (b) go through the proxy (to a gateway on 127.0.0.2, so nothing bypasses it); (c)-(f) connect to
a gateway on 127.0.0.1 directly, and its sessions use the direct path to their worker.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench_core  # noqa: E402

DELAY_MS = 25.0
#: the network link of (f)'s third run (rate-limited proxy): 1 Gbit/s each way
LINK_MBIT = 1000
#: the proxied gateway's address: loopback, but not the one the client connects to
PROXIED_HOST = "127.0.0.2"
KB, MB = 1 << 10, 1 << 20
# (bytes, label, repetitions)
XFER_SIZES = [(4 * KB, "4 KB", 100), (64 * KB, "64 KB", 50), (1 * MB, "1 MB", 15), (16 * MB, "16 MB", 5),
              (64 * MB, "64 MB", 8), (256 * MB, "256 MB", 2)]


def log(*a) -> None:
    print("[bench_transfer]", *a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- processes

class ProxyProcess:
    """benchmarks/delay_proxy.py as a child process (its threads do not share our GIL)."""

    def __init__(self, target_port: int, delay_ms: float = 0.0, target_host: str = "127.0.0.1",
                 rate_mbit: float = 0.0):
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "delay_proxy.py"), "--target",
                                   str(target_port), "--target-host", target_host, "--delay-ms", str(delay_ms),
                                   "--rate-mbit", str(rate_mbit), "--max-seconds", "900"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        if not line.startswith("READY "):
            self.p.kill()
            raise RuntimeError(f"the delay proxy did not start: {line!r}")
        self.address = line.split()[1]

    def set_delay(self, ms: float) -> None:
        self.p.stdin.write(f"delay {ms}\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line.startswith("OK"), line

    def close(self) -> None:
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.close()
            self.p.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()


def proxy_round_trips(delays=(0.0, DELAY_MS), n: int = 20) -> dict:
    """Round trip of a 64-byte message through the proxy process to an echo server: what the proxy adds."""
    import socket

    from delay_proxy import echo_server, round_trips
    srv = echo_server()
    proxy = ProxyProcess(srv.getsockname()[1])
    out = {}
    try:
        host, port = proxy.address.rsplit(":", 1)
        c = socket.create_connection((host, int(port)))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for d in delays:
            proxy.set_delay(d)
            rtts = round_trips(c, n)
            out[d] = {"min_s": min(rtts), "median_s": statistics.median(rtts)}
        c.close()
    finally:
        proxy.close()
        srv.close()
    return out


def start_gateway_one_thread(host: str = "127.0.0.1") -> tuple[subprocess.Popen, str]:
    """A gateway whose torch computes on one thread (OMP_NUM_THREADS=1), leaving a CPU for the rest."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return bench_core.start_gateway(spare=0, host=host)
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old


def stop(gw: subprocess.Popen) -> None:
    gw.terminate()
    try:
        gw.wait(timeout=20)
    except subprocess.TimeoutExpired:
        gw.kill()
        gw.wait()


GATEWAY_PID: int | None = None


def gateway_pids() -> set[int]:
    """The gateway's process tree (supervisor + workers), or nothing when none is running."""
    if GATEWAY_PID is None:
        return set()
    pids = {GATEWAY_PID}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == GATEWAY_PID:
                        pids.add(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def cpu_seconds(pids: set[int] | None = None) -> float:
    """CPU time used so far by this process and the gateway's process tree (``pids``: found
    afresh unless given; reading known ones costs microseconds, finding them milliseconds)."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for pid in gateway_pids() if pids is None else pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


QUIET_LOG: list = []


def cpu_idle(window: float = 0.5) -> float:
    """Fraction of all CPUs idle over the next `window` seconds (/proc/stat)."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v[:8])
    i0, t0 = read()
    time.sleep(window)
    i1, t1 = read()
    return (i1 - i0) / max(1, t1 - t0)


def wait_for_quiet(section: str, want: float = 0.85, max_wait: float = 5.0) -> None:
    """The machine is shared: wait (bounded) until the CPUs are mostly idle before a section."""
    t0 = time.monotonic()
    idle = cpu_idle()
    while idle < want and time.monotonic() - t0 < max_wait:
        idle = cpu_idle()
    QUIET_LOG.append({"section": section, "idle": idle, "waited_s": time.monotonic() - t0})
    log(f"{section}: CPUs {idle:.0%} idle after waiting {time.monotonic() - t0:.1f} s")


def sync() -> None:
    torch.cuda.synchronize()


def session():
    import remotecuda
    return remotecuda.runtime.current().session(0)


# ---------------------------------------------------------------------------- (a) round trips per step

def small_mlp(device: str):
    return bench_core.small_mlp(device, init_scale=None)


def timed_loop(step, steps: int, read_each: bool) -> tuple[float, int]:
    """(seconds for `steps` steps + one final read, blocking round trips counted by the client)."""
    import remotecuda
    sync()
    remotecuda.stats(reset=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
        if read_each:
            loss.item()
    loss.item()  # the one value read at the end (also the sync)
    dt = time.perf_counter() - t0
    return dt, remotecuda.stats()["blocking_round_trips"]


def measure_round_trips(proxy: ProxyProcess, steps: dict, repeats: int) -> dict:
    step = small_mlp("cuda")
    for _ in range(5):
        step()
    step().item()
    out = {}
    for variant, read_each in (("no_read", False), ("item_each_step", True)):
        n = steps[variant]
        times = {0: [], 25: []}
        rts = {0: [], 25: []}
        for _ in range(repeats):  # interleaved, so slow drifts of the machine hit both delays
            for d in (0, 25):
                proxy.set_delay(d if d == 0 else DELAY_MS)
                dt, rt = timed_loop(step, n, read_each)
                times[d].append(dt)
                rts[d].append(rt)
        t0, t25 = min(times[0]), min(times[25])
        out[variant] = {
            "steps": n, "t0_s": t0, "t25_s": t25,
            "step_ms_0": t0 / n * 1e3, "step_ms_25": t25 / n * 1e3,
            "derived_rt_per_step": (t25 - t0) / (2 * DELAY_MS / 1e3) / n,
            "counted_rt_per_step": statistics.median(rts[25]) / n,
            "counted_rt_total": statistics.median(rts[25]),
            "times_0": times[0], "times_25": times[25],
        }
        log(f"(a) {variant}: {out[variant]['derived_rt_per_step']:.3f} derived vs "
            f"{out[variant]['counted_rt_per_step']:.3f} counted round trips / step")
    proxy.set_delay(0)
    return out


# ---------------------------------------------------------------------------- (b) latency hidden by async

WIDTH, LAYERS = 1024, 3


def big_model(device: str, batch: int):
    torch.manual_seed(1)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch, WIDTH, device=device)
    target = torch.zeros(batch, WIDTH, device=device)
    return bench_core.train_step(model, opt, x, target)


def step_seconds(step, n: int = 3) -> float:
    """One step's time: n steps and one read, best of 3 (the read is amortised over n)."""
    def run() -> float:
        step().item()
        t0 = time.perf_counter()
        for _ in range(n):
            loss = step()
        loss.item()
        return (time.perf_counter() - t0) / n
    return min(run() for _ in range(3))


def calibrate_big_batch(device: str, target_s: float = 0.100) -> tuple[int, float]:
    """Batch size whose step takes ~target_s on `device` (for "cuda": the CPU gateway at 0 ms)."""
    batch = 256
    t = step_seconds(big_model(device, batch))
    for _ in range(4):
        new = max(16, min(4096, int(round(batch * target_s / t / 16)) * 16))
        if abs(new - batch) <= max(16, 0.05 * batch):
            break
        batch = new
        t = step_seconds(big_model(device, batch))
    return batch, t


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_latency_hiding(proxy: ProxyProcess, batch: int, steps: int, repeats: int) -> dict:
    step = big_model("cuda", batch)
    step().item()
    times = {0: [], 25: []}
    rts = []
    for _ in range(repeats):
        for d in (0, 25):
            proxy.set_delay(d if d == 0 else DELAY_MS)
            dt, rt = timed_loop(step, steps, read_each=False)
            times[d].append(dt)
            if d == 25:
                rts.append(rt)
    proxy.set_delay(0)
    t0, t25 = min(times[0]), min(times[25])
    r = {"batch": batch, "steps": steps, "step_ms_0": t0 / steps * 1e3, "step_ms_25": t25 / steps * 1e3,
         "ratio": t25 / t0, "times_0": times[0], "times_25": times[25], "counted_rt_total": max(rts)}
    log(f"(b) step {r['step_ms_0']:.1f} ms at 0 ms, {r['step_ms_25']:.1f} ms at 25 ms: x{r['ratio']:.3f}")
    return r


# ---------------------------------------------------------------------------- (c) throughput

def fresh(base: torch.Tensor, i: int) -> torch.Tensor:
    """Make base's content new (one element changed, in place): the content cache has not seen it."""
    base.view(-1)[0] = float(1000 + i) if base.is_floating_point() else 1000 + i
    return base


def measure_throughput(sizes: list, quick: bool) -> list:
    """Remote uploads and downloads, each rep next to one raw TCP transfer each way, so the
    ratio compares the two under the same load (on a shared machine the ceiling swings)."""
    rows = []
    serial = 0
    primed = prime_upload_cache()
    raw = bench_core.RawTCP(max(n for n, _, _ in sizes))
    pids = gateway_pids()
    for nbytes, label, reps in sizes:
        reps = min(reps, 3) if quick else reps
        base = torch.randn(nbytes // 4)
        ups, downs, cached, issue, raw_ups, raw_downs = [], [], [], [], [], []
        cpu = {"up": [], "down": [], "tcp_up": [], "tcp_down": []}  # CPU seconds per transfer, all processes
        for i in range(reps + 1):  # the first of each size is a warm-up
            for _ in range(1 if i else 2):
                p0 = time.process_time()  # (raw TCP's two ends are threads of this process)
                raw_ups.append(raw.up(nbytes))
                p1 = time.process_time()
                raw_downs.append(raw.down(nbytes))
                cpu["tcp_up"].append(p1 - p0)
                cpu["tcp_down"].append(time.process_time() - p1)
            serial += 1
            t = fresh(base, serial)
            sync()
            c0 = cpu_seconds(pids)
            t0 = time.perf_counter()
            r = t.to("cuda")
            ti = time.perf_counter()
            sync()
            t1 = time.perf_counter()
            c1 = cpu_seconds(pids)
            t1b = time.perf_counter()
            back = r.cpu()
            t2 = time.perf_counter()
            c2 = cpu_seconds(pids)
            if i == 0:
                assert torch.equal(back, t)
            else:
                ups.append(t1 - t0)
                downs.append(t2 - t1b)
                issue.append(ti - t0)
                cpu["up"].append(c1 - c0)
                cpu["down"].append(c2 - c1)
            if i < 3 and nbytes >= 64 * KB:  # the same bytes again: the gateway's cache has them
                t3 = time.perf_counter()
                r2 = t.to("cuda")
                sync()
                cached.append(time.perf_counter() - t3)
                del r2
            del r, back
        row = {"nbytes": nbytes, "label": label, "reps": reps,
               "up_min_s": min(ups), "up_med_s": statistics.median(ups),
               "down_min_s": min(downs), "down_med_s": statistics.median(downs),
               "issue_med_s": statistics.median(issue),
               "cached_up_min_s": min(cached) if cached else None,
               "tcp_up_min_s": min(raw_ups), "tcp_down_min_s": min(raw_downs),
               "cpu_s": {k: statistics.mean(v) for k, v in cpu.items()}}
        rows.append(row)
        log(f"(c) {label}: up {nbytes / row['up_min_s'] / 1e9:.3f} GB/s, down {nbytes / row['down_min_s'] / 1e9:.3f} GB/s")
        del base
    raw.close()
    rows[0]["primed_uploads"] = primed
    return rows


def prime_upload_cache(nbytes: int = 16 * MB) -> int:
    """Fill the session's upload cache with fresh uploads until it evicts one: the steady state of a
    training loop, where each new upload reuses an evicted one's memory instead of fresh pages. How many."""
    mirror = session().cache
    primer = torch.randn(nbytes // 4)
    n = 0
    while mirror is not None and mirror.evictions == 0:
        n += 1
        fresh(primer, 1_000_000 + n)
        primer.to("cuda")
    sync()
    return n


# ---------------------------------------------------------------------------- (d) epoch-2 bytes

def measure_epochs(n_batches: int = 64) -> dict:
    import remotecuda
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g))
            for _ in range(n_batches)]
    out = {"batches": n_batches, "dataset_bytes": sum(x.nbytes + y.nbytes for x, y in data)}

    # transfers only: the batches moved to the device, nothing else
    per_epoch = []
    for _epoch in range(2):
        sync()
        remotecuda.stats(reset=True)
        t0 = time.perf_counter()
        kept = [(x.cuda(), y.cuda()) for x, y in data]
        sync()
        dt = time.perf_counter() - t0
        st = remotecuda.stats()
        per_epoch.append({"bytes_up": st["bytes_up"], "seconds": dt, "cache_hits": st["cache_hits"],
                          "cache_misses": st["cache_misses"], "cache_bytes_saved": st["cache_bytes_saved"]})
        del kept
    out["transfer_only"] = per_epoch

    # with a training step per batch (linear classifier, cross-entropy, SGD), on a second dataset
    # of the same shape (new content: the cache has not seen it)
    data = [(torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g))
            for _ in range(n_batches)]
    model = torch.nn.Linear(64, 10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_epoch = []
    for _epoch in range(2):
        sync()
        remotecuda.stats(reset=True)
        t0 = time.perf_counter()
        for x, y in data:
            xb, yb = x.cuda(), y.cuda()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
        loss.item()
        dt = time.perf_counter() - t0
        st = remotecuda.stats()
        per_epoch.append({"bytes_up": st["bytes_up"], "seconds": dt, "cache_hits": st["cache_hits"],
                          "cache_misses": st["cache_misses"], "cache_bytes_saved": st["cache_bytes_saved"],
                          "ops": st["ops"]})
    out["with_training"] = per_epoch
    for k in ("transfer_only", "with_training"):
        e1, e2 = out[k]
        out[k + "_ratio"] = e2["bytes_up"] / e1["bytes_up"]
        log(f"(d) {k}: epoch 1 {e1['bytes_up']:,} B, epoch 2 {e2['bytes_up']:,} B ({out[k + '_ratio']:.2%})")
    return out


# ---------------------------------------------------------------------------- (e) compression

def payload_kinds(nbytes: int) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"zeros (float32)": torch.zeros(nbytes // 4),
            "labels int64 in [0,10)": torch.randint(0, 10, (nbytes // 8,), generator=g),
            "random floats (float32)": torch.randn(nbytes // 4, generator=g)}


def measure_codec(nbytes: int, reps: int) -> dict:
    """Each codec alone, on this machine's CPU: no network."""
    from remotecuda_wire import protocol
    from remotecuda_wire.compression import LinkModel
    out = {}
    link = LinkModel()
    for name, t in payload_kinds(nbytes).items():
        buf = protocol.tensor_bytes(t)
        choices = [link.choose(buf, protocol.CODECS) or "raw" for _ in range(20)]
        row = {"raw_bytes": buf.nbytes, "default_link_bytes_per_s": link.bytes_per_s,
               "encode_raw_s": min(_time(lambda: protocol.encode_payload(buf)) for _ in range(reps)),  # noqa: B023
               "auto": {c: choices.count(c) for c in sorted(set(choices))}, "codecs": {}}
        for codec in protocol.CODECS:
            impl = protocol.CODEC_IMPLS[codec]
            frame = impl.compress(buf)
            row["codecs"][codec] = {
                "wire_bytes": len(frame), "ratio": len(frame) / buf.nbytes,
                "kept": len(frame) < buf.nbytes * protocol.MAX_RATIO,  # else encode_payload sends it raw
                "encode_s": min(_time(lambda: impl.compress(buf)) for _ in range(reps)),  # noqa: B023 (called at once)
                "decode_s": min(_time(lambda: impl.decompress(memoryview(frame), buf.nbytes))  # noqa: B023
                                 for _ in range(reps))}
        out[name] = row
        log(f"(e) codec {name}: " + ", ".join(
            f"{c} {v['wire_bytes']:,} B ({v['ratio']:.3f}) enc {v['encode_s'] * 1e3:.1f} ms dec {v['decode_s'] * 1e3:.1f} ms"
            for c, v in row["codecs"].items()) + f"; auto {row['auto']}")
    return out


def measure_compression_e2e(nbytes: int, reps: int) -> dict:
    """Real uploads (and their downloads) of fresh content: raw, each codec forced, automatic."""
    import remotecuda
    s = session()
    default_link = float(os.environ.get("REMOTECUDA_LINK_MBPS", "1000")) * 1e6  # not what the session measured
    negotiated = s.codecs
    # mode: (link speed, codecs): a very fast link never compresses, a very slow one always does
    modes = {"off": (1e15, negotiated), **{c: (1.0, (c,)) for c in negotiated}, "auto": (default_link, negotiated)}
    out = {}
    serial = 0
    for name, base in payload_kinds(nbytes).items():
        out[name] = {}
        for mode, (link_speed, codecs) in modes.items():
            times, wire, down_times, down_bytes = [], [], [], []
            for i in range(reps + 1):
                serial += 1
                t = fresh(base, serial)
                s.link.bytes_per_s, s.codecs = link_speed, codecs
                sync()
                remotecuda.stats(reset=True)
                t0 = time.perf_counter()
                r = t.to("cuda")
                sync()
                dt = time.perf_counter() - t0
                st = remotecuda.stats()
                t1 = time.perf_counter()
                back = r.cpu()
                dd = time.perf_counter() - t1
                st2 = remotecuda.stats()
                if i == 0:
                    assert torch.equal(back, t)
                    continue
                times.append(dt)
                wire.append(st["bytes_up"])
                down_times.append(dd)
                down_bytes.append(st2["bytes_down"] - st["bytes_down"])
                del r, back
            out[name][mode] = {"upload_s": min(times), "bytes_up": int(statistics.median(wire)),
                               "bytes_up_all": wire, "download_s": min(down_times),
                               "bytes_down": int(statistics.median(down_bytes)), "bytes_down_all": down_bytes}
        log(f"(e) e2e {name}: " + ", ".join(f"{m} {v['upload_s'] * 1e3:.1f} ms/{v['bytes_up']:,} B"
                                            for m, v in out[name].items()))
    s.link.bytes_per_s, s.codecs = default_link, negotiated
    return out


# ---------------------------------------------------------------------------- (f) pipelining

def batches(base: torch.Tensor, n: int, tag: int) -> list:
    """n distinct batches (fresh content each: nothing the cache has seen)."""
    out = []
    for i in range(n):
        b = base.clone()
        b[0, 0] = float(10_000 * tag + i)
        out.append(b)
    return out


def measure_pipelining(steps: int, repeats: int, batch_bytes: int = 16 * MB) -> dict:
    import remotecuda
    rows = batch_bytes // 4 // 1024
    base = torch.randn(rows, 1024)
    tag = [0]

    def loader(n: int = steps) -> list:
        tag[0] += 1
        return batches(base, n, tag[0])

    def compute(xb: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (xb @ w).relu().mean()

    # transfer alone: `steps` fresh batches streamed, one sync at the end
    cpu = {}

    def transfer_only() -> float:
        data = loader()
        sync()
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        kept = [b.cuda() for b in data]
        sync()
        dt = time.perf_counter() - t0
        cpu.setdefault("transfer", []).append((cpu_seconds() - c0) / steps)
        del kept
        return dt / steps

    transfer_only()
    t_x = min(transfer_only() for _ in range(repeats))

    # compute alone (batch already on the gateway); calibrate the width so compute ~ transfer
    resident = base.cuda()
    sync()

    def compute_only(w: torch.Tensor, key: str = "calibration") -> float:
        sync()
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = compute(resident, w)
        loss.item()
        dt = (time.perf_counter() - t0) / steps
        cpu.setdefault(key, []).append((cpu_seconds() - c0) / steps)
        return dt

    k = 256
    for _ in range(3):
        w = torch.randn(1024, k, device="cuda") * 0.01
        c = min(compute_only(w) for _ in range(2))
        new = max(16, min(8192, int(round(k * t_x / c / 16)) * 16))
        if abs(new - k) <= 16:
            break
        k = new
    w = torch.randn(1024, k, device="cuda") * 0.01
    t_c = min(compute_only(w, "compute") for _ in range(repeats))

    def serial() -> float:
        data = loader()
        sync()
        t0 = time.perf_counter()
        for b in data:
            xb = b.cuda()
            loss = compute(xb, w)
            loss.item()
        return (time.perf_counter() - t0) / steps

    def pipelined(n: int, item_each_step: bool) -> float:
        """Seconds for n steps, each batch moved ahead by prefetch."""
        data = loader(n)
        sync()
        t0 = time.perf_counter()
        for xb in remotecuda.prefetch(data, depth=2):
            loss = compute(xb, w)
            if item_each_step:
                loss.item()
        loss.item()
        return time.perf_counter() - t0

    ser, pip = [], {(n, item): [] for n in (steps, 2 * steps) for item in (False, True)}
    for _ in range(repeats):
        ser.append(serial())
        for (n, item), times in pip.items():
            times.append(pipelined(n, item))

    def steady(item: bool) -> float:
        """Per step once the pipeline is full: (2N steps - N steps) / N, so filling it (the first
        batch's transfer, which nothing can overlap) drops out; the median over repeats of the
        difference within each repeat (the two runs of a pair saw about the same load)."""
        return statistics.median(b - a for a, b in zip(pip[steps, item], pip[2 * steps, item])) / steps

    r = {"batch_bytes": batch_bytes, "steps": steps, "width_k": k, "transfer_s": t_x, "compute_s": t_c,
         "serial_s": min(ser), "pipelined_s": steady(False), "pipelined_item_s": steady(True),
         "pipelined_fill_s": min(pip[steps, False]) / steps, "max_s": max(t_x, t_c), "sum_s": t_x + t_c,
         "serial_all": ser, "pipelined_all": {f"{n} steps{', item()' if item else ''}": v for (n, item), v in pip.items()},
         "nproc": os.cpu_count(),
         "cpu_transfer_s": min(cpu["transfer"]), "cpu_compute_s": min(cpu["compute"])}
    r["cpu_bound_s"] = (r["cpu_transfer_s"] + r["cpu_compute_s"]) / r["nproc"]
    log(f"(f) transfer {t_x * 1e3:.1f} ms, compute {t_c * 1e3:.1f} ms, serial {r['serial_s'] * 1e3:.1f} ms, "
        f"pipelined {r['pipelined_s'] * 1e3:.1f} ms, with item() each step {r['pipelined_item_s'] * 1e3:.1f} ms")
    return r


# ---------------------------------------------------------------------------- main

def measure(quick: bool = False, with_256: bool = True) -> dict:
    import remotecuda
    t_start = time.perf_counter()
    res: dict = {"load_before": list(os.getloadavg()), "delay_ms": DELAY_MS}
    torch.manual_seed(0)

    # --- local, before remotecuda is active
    sizes = [s for s in XFER_SIZES if with_256 or s[0] < 256 * MB]
    res["codec"] = measure_codec(16 * MB, 3)
    pr = proxy_round_trips()
    res["proxy_rtt"] = {"0": pr[0.0], "25": pr[DELAY_MS]}
    log(f"proxy alone: round trip {pr[0.0]['median_s'] * 1e3:.2f} ms at 0, {pr[DELAY_MS]['median_s'] * 1e3:.2f} ms at 25 (medians)")

    # (a), (b): a gateway on 127.0.0.2, reachable only through the proxy (as through a tunnel, so the
    # session's direct data port is out of reach and every message takes the proxy's delay)
    gw, address = bench_core.start_gateway(spare=0, host=PROXIED_HOST)
    gw_port = int(address.rsplit(":", 1)[1])
    global GATEWAY_PID
    GATEWAY_PID = gw.pid
    proxy = None
    try:
        # --- through the delay proxy: (a), (b)
        proxy = ProxyProcess(gw_port, target_host=PROXIED_HOST)
        remotecuda.activate(proxy.address, fallback="error")
        res["proxied_session_direct"] = remotecuda.runtime.current().session(0).direct  # False: all via the proxy
        wait_for_quiet("(a) round trips")
        res["round_trips"] = measure_round_trips(proxy, steps={"no_read": 20 if quick else 60,
                                                               "item_each_step": 15 if quick else 30},
                                                 repeats=2 if quick else 7)
        wait_for_quiet("(b) calibration")
        batch, remote_step = calibrate_big_batch("cuda")
        log(f"(b) calibrated batch {batch}: gateway step {remote_step * 1e3:.1f} ms")
        wait_for_quiet("(b) latency hiding")
        res["latency_hiding"] = measure_latency_hiding(proxy, batch, steps=10 if quick else 20, repeats=2 if quick else 7)
        res["latency_hiding"]["calibration_step_ms"] = remote_step * 1e3
        res["stats_proxy_phase"] = remotecuda.stats()
        remotecuda.deactivate()
        proxy.close()
        proxy = None
        # the same step locally on this CPU, for reference (remotecuda is off again)
        res["big_step_local"] = {"batch": batch, "step_ms": step_seconds(big_model("cpu", batch)) * 1e3,
                                 "width": WIDTH, "layers": LAYERS}

        assert not remotecuda.is_active()
        stop(gw)

        # --- direct: (c)-(f)
        gw, address = bench_core.start_gateway(spare=0)
        GATEWAY_PID = gw.pid
        remotecuda.activate(address, fallback="error")
        res["session_direct"] = remotecuda.runtime.current().session(0).direct
        x = torch.ones(4, device="cuda")
        x.sum().item()
        wait_for_quiet("(c) throughput")
        res["throughput"] = measure_throughput(sizes, quick)
        res["tcp"] = [{"nbytes": row["nbytes"], "up_min_s": row["tcp_up_min_s"], "down_min_s": row["tcp_down_min_s"]}
                      for row in res["throughput"]]
        wait_for_quiet("(d) epochs")
        res["epochs"] = measure_epochs()
        wait_for_quiet("(e) compression")
        res["compression"] = measure_compression_e2e(16 * MB, 2 if quick else 5)
        wait_for_quiet("(f) pipelining")
        res["pipelining"] = measure_pipelining(steps=6 if quick else 8, repeats=2 if quick else 5)
        remotecuda.deactivate()
        stop(gw)

        # --- (f) again with a gateway whose torch uses one thread, leaving a CPU for the transfer
        gw, address = start_gateway_one_thread()
        GATEWAY_PID = gw.pid
        remotecuda.activate(address, fallback="error")
        torch.ones(4, device="cuda").sum().item()
        wait_for_quiet("(f) pipelining, 1 thread")
        res["pipelining_1thread"] = measure_pipelining(steps=6 if quick else 8, repeats=2 if quick else 5)
        remotecuda.deactivate()
        stop(gw)

        # --- (f) once more over a network link (rate-limited proxy): the transfer is then mostly
        # waiting on the link, as from a laptop to a GPU server, not CPU work on these 2 cores
        gw, address = start_gateway_one_thread(PROXIED_HOST)
        GATEWAY_PID = gw.pid
        proxy = ProxyProcess(int(address.rsplit(":", 1)[1]), target_host=PROXIED_HOST, rate_mbit=LINK_MBIT)
        remotecuda.activate(proxy.address, fallback="error")
        torch.ones(4, device="cuda").sum().item()
        wait_for_quiet("(f) pipelining, 1 Gbit/s link")
        res["pipelining_link"] = measure_pipelining(steps=6 if quick else 8, repeats=2 if quick else 5,
                                                    batch_bytes=8 * MB)
        res["pipelining_link"]["link_mbit"] = LINK_MBIT
        remotecuda.deactivate()
    finally:
        if proxy is not None:
            proxy.close()
        if remotecuda.is_active():
            remotecuda.deactivate()
        stop(gw)
    res["load_after"] = list(os.getloadavg())
    res["quiet"] = QUIET_LOG
    res["elapsed_s"] = time.perf_counter() - t_start
    return res


# ---------------------------------------------------------------------------- report

def _table(header: tuple, body: list) -> str:
    return bench_core._table(header, body)


def gbps(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def targets(r: dict) -> dict:
    """The issue's targets this suite measures: name -> (measured text, met?)."""
    out = {}
    tp = {row["nbytes"]: row for row in r["throughput"]}
    tcp = {row["nbytes"]: row for row in r["tcp"]}
    up64 = gbps(64 * MB, tp[64 * MB]["up_min_s"]) / gbps(64 * MB, tcp[64 * MB]["up_min_s"])
    out["loopback 64 MB upload ≥ 70% of raw TCP"] = (f"{up64:.0%} ({gbps(64 * MB, tp[64 * MB]['up_min_s']):.2f} vs "
                                                     f"{gbps(64 * MB, tcp[64 * MB]['up_min_s']):.2f} GB/s)", up64 >= 0.70)
    e = r["epochs"]["transfer_only_ratio"]
    out["epoch-2 bytes ≤ 1% of epoch-1 bytes"] = (
        f"{e:.2%} (batches only); {r['epochs']['with_training_ratio']:.1%} with the training step's op messages",
        e <= 0.01)
    lh = r["latency_hiding"]["ratio"]
    out["step at 25 ms within 10% of 0 ms"] = (f"x{lh:.3f} ({r['latency_hiding']['step_ms_0']:.1f} → "
                                               f"{r['latency_hiding']['step_ms_25']:.1f} ms/step)", lh <= 1.10)
    p = r["pipelining"]
    pr = p["pipelined_s"] / p["max_s"]
    out["pipelined ≈ max(transfer, compute) on loopback (within 10%)"] = (
        f"{p['pipelined_s'] * 1e3:.0f} ms vs max {p['max_s'] * 1e3:.0f} ms (x{pr:.2f}); serial {p['serial_s'] * 1e3:.0f} ms, "
        f"sum {p['sum_s'] * 1e3:.0f} ms", pr <= 1.10)
    if "pipelining_link" in r:
        q = r["pipelining_link"]
        qr = q["pipelined_s"] / q["max_s"]
        out[f"pipelined ≈ max(transfer, compute) over a {LINK_MBIT:,} Mbit/s link (within 10%)"] = (
            f"{q['pipelined_s'] * 1e3:.0f} ms vs max {q['max_s'] * 1e3:.0f} ms (x{qr:.2f}); with `loss.item()` each step "
            f"{q['pipelined_item_s'] * 1e3:.0f} ms (x{q['pipelined_item_s'] / q['max_s']:.2f}); serial {q['serial_s'] * 1e3:.0f} ms, "
            f"sum {q['sum_s'] * 1e3:.0f} ms", qr <= 1.10)
    out["(no target) pipelined vs this machine's CPU-bound floor"] = ("; ".join(
        f"{label}: {v['pipelined_s'] * 1e3:.0f} vs {v['cpu_bound_s'] * 1e3:.0f} ms (x{v['pipelined_s'] / v['cpu_bound_s']:.2f})"
        for label, v in (("default threads", p), ("1 gateway thread", r["pipelining_1thread"]))), None)
    return out


def _mb_range(values: list) -> str:
    lo, hi = min(values) / MB, max(values) / MB
    return f"{lo:.2f} MB" if abs(hi - lo) < 0.01 else f"{lo:.2f}–{hi:.2f} MB (varies by run)"


PIPELINING_VARIANTS = (("pipelining", "loopback, gateway torch threads: default"),
                       ("pipelining_1thread", "loopback, gateway torch threads: 1 (OMP_NUM_THREADS=1)"),
                       ("pipelining_link", f"{LINK_MBIT:,} Mbit/s link, gateway torch threads: 1"))


def markdown(r: dict, heading: str = "##") -> str:
    h = heading
    parts = []

    # (a)
    rt = r["round_trips"]
    rows = []
    for variant, label in (("no_read", "no value read per step"), ("item_each_step", "`loss.item()` every step")):
        v = rt[variant]
        rows.append((f"{label} ({v['steps']} steps)", f"{v['step_ms_0']:.2f} ms", f"{v['step_ms_25']:.2f} ms",
                     f"{v['derived_rt_per_step']:.3f}", f"{v['counted_rt_per_step']:.3f}"))
    parts.append(f"""{h} (a) Blocking round trips per training step, measured from outside

MLP 32-64-64-1, Adam, batch 256: N steps then one `loss.item()`, through the delay proxy at 0 ms and
{r['delay_ms']:.0f} ms each way (best of {len(rt['no_read']['times_0'])} runs per delay, the two delays interleaved).
The gateway for (a) and (b) binds {PROXIED_HOST}, reachable only through the proxy, as through a tunnel: its
sessions cannot use their direct data port (direct path used: {'yes' if r.get('proxied_session_direct') else 'no'}),
so every message pays the proxy's delay.

{_table(("loop", "step at 0 ms", f"step at {r['delay_ms']:.0f} ms", "round trips / step, derived (t25 − t0) / 2d", "`blocking_round_trips` / step"), rows)}

- derived = (t{r['delay_ms']:.0f} − t0) / (2 × {r['delay_ms'] / 1e3:.3f} s) / steps: every blocking round trip pays the
  added 2 × {r['delay_ms']:.0f} ms once, so this counts them without trusting the client's own counter. Both columns
  include the one final read (1/N per step: {1 / rt['no_read']['steps']:.3f} and {1 / rt['item_each_step']['steps']:.3f}).
- the proxy alone (64-byte echo, same run) adds {(r['proxy_rtt']['25']['median_s'] - r['proxy_rtt']['0']['median_s']) * 1e3:.2f} ms per round trip at {r['delay_ms']:.0f} ms
  (nominal {2 * r['delay_ms']:.0f} ms; medians {r['proxy_rtt']['0']['median_s'] * 1e3:.2f} → {r['proxy_rtt']['25']['median_s'] * 1e3:.2f} ms).
- reading: the two columns should agree. A no-read loop should cost ~0 round trips per step (ops stream
  without waiting); `item()` every step costs exactly 1. Here they differ by """ + ", ".join(
        f"{abs(rt[v]['derived_rt_per_step'] - rt[v]['counted_rt_per_step']):.3f}" for v in ("no_read", "item_each_step")) + """ per step
  (no read, `item()`): the derived figure carries the timing noise of this shared machine, ±(noise in t) / 50 ms / N.
""")

    # (b)
    lh, loc = r["latency_hiding"], r["big_step_local"]
    drift = ("" if abs(lh['step_ms_0'] / lh['calibration_step_ms'] - 1) < 0.2 else
             f" The best runs came out at {lh['step_ms_0']:.0f} ms/step, not ~100 ms: calibration ran while the shared"
             " machine was busier; a shorter step makes the target harder, not easier.")
    parts.append(f"""{h} (b) Latency hidden by asynchronous ops: a ~{lh['step_ms_0']:.0f} ms step (calibrated for ~100 ms) at {r['delay_ms']:.0f} ms vs 0 ms

{loc['layers']} × Linear({loc['width']}, {loc['width']}) (+ReLU), MSE, SGD, batch {lh['batch']} (calibrated so the step on this CPU gateway
takes ~100 ms: {lh['calibration_step_ms']:.1f} ms at calibration; the same step in local eager PyTorch here: {loc['step_ms']:.1f} ms),
{lh['steps']} steps, no value read per step, one sync at the end; best of {len(lh['times_0'])} runs per delay, the delays interleaved.{drift}

| | step at 0 ms | step at {r['delay_ms']:.0f} ms | ratio | target |
| --- | --- | --- | --- | --- |
| remote step (best of runs) | {lh['step_ms_0']:.1f} ms | {lh['step_ms_25']:.1f} ms | x{lh['ratio']:.3f} | ≤ x1.10: {verdict(lh['ratio'] <= 1.10)} |

- reading: with no per-step read the only waiting is the final sync, so {r['delay_ms']:.0f} ms each way costs one
  {2 * r['delay_ms']:.0f} ms round trip over all {lh['steps']} steps (≈ {2 * r['delay_ms'] / lh['steps']:.1f} ms/step, x{1 + 2 * r['delay_ms'] / lh['steps'] / lh['step_ms_0']:.3f}
  at this step time). Blocking round trips counted at {r['delay_ms']:.0f} ms: {lh['counted_rt_total']} per {lh['steps']} steps.
""")

    # (c)
    tcp = {row["nbytes"]: row for row in r["tcp"]}
    rows = []
    for row in r["throughput"]:
        n = row["nbytes"]
        tc = tcp[n]
        cached = (f"{row['cached_up_min_s'] * 1e3:.2f} ms ({gbps(n, row['cached_up_min_s']):.2f} GB/s eff.)"
                  if row["cached_up_min_s"] else "—")
        rows.append((row["label"],
                     f"{gbps(n, row['up_min_s']):.3f} ({row['up_min_s'] * 1e3:.2f} ms; median {row['up_med_s'] * 1e3:.1f})",
                     f"{gbps(n, row['down_min_s']):.3f} ({row['down_min_s'] * 1e3:.2f} ms)",
                     f"{gbps(n, tc['up_min_s']):.3f} / {gbps(n, tc['down_min_s']):.3f}",
                     f"{tc['up_min_s'] / row['up_min_s']:.0%} / {tc['down_min_s'] / row['down_min_s']:.0%}",
                     f"{row['issue_med_s'] * 1e3:.2f} ms",
                     cached,
                     (f"{c['up'] * 1e3:.0f} / {c['tcp_up'] * 1e3:.0f} ms; {c['down'] * 1e3:.0f} / {c['tcp_down'] * 1e3:.0f} ms"
                      if (c := row.get("cpu_s")) and n >= 16 * MB else "—")))
    parts.append(f"""{h} (c) Upload / download throughput vs the raw loopback socket

Direct connection (no proxy). Every upload carries fresh content (one element changed), so the content cache
cannot hide the transfer. Measured in a session whose upload cache is already full (primed with
{r['throughput'][0].get('primed_uploads', 0)} fresh 16 MB uploads until it evicted one), as in a training loop after its
first 512 MiB: each new upload then reuses an evicted one's memory.
Upload = `.to('cuda')` + `torch.cuda.synchronize()`, download = `.cpu()`; both
include one blocking round trip. Best of {r['throughput'][0]['reps']}…{r['throughput'][-1]['reps']} runs per size (fewer for large sizes); raw TCP is
plain Python sockets (sendall / recv_into, 1-byte ack for uploads), one transfer each way next to each remote run
(so both see the same load on this shared machine), best of those.

{_table(("size (float32)", "upload GB/s", "download GB/s", "raw TCP up / down GB/s", "remote as % of raw (up / down)", "upload: client part (median)", "cached re-upload (same bytes)", "CPU per transfer, all processes, remote / raw TCP: up; down (mean)"), rows)}

- target: 64 MB upload ≥ 70 % of raw TCP — {verdict(tcp[64 * MB]['up_min_s'] / next(x for x in r['throughput'] if x['nbytes'] == 64 * MB)['up_min_s'] >= 0.70)}.
- the session uses the direct path ({'yes' if r.get('session_direct') else 'NO'}): one socket from the client to
  the session's worker; uploads of 1 MiB and more go as PART messages of up to 4 MiB on the session's bulk
  connection (its second socket to the worker), each checked and copied into place by the worker while
  the next is on the wire.
- reading: small sizes are bounded by the round trip (client → worker and back, two Python processes),
  large sizes by copies and per-byte work (the client's xxh3-128 of the tensor, the kernel's two TCP copies,
  the worker's digest check and its copy into the tensor), all on the same 2 CPUs as the benchmark.
- CPU per transfer: the CPU time of every process involved (client with its ZeroMQ and flush threads,
  supervisor, worker; raw TCP's two ends are threads of the benchmark), so where the remote column is
  larger the gap is work on top of the kernel's copies, and on 2 CPUs it is at least half that gap in time
  (the gateway's process times count in 10 ms ticks: a mean over the runs).
- "client part": time until `.to('cuda')` returns (hash for the cache, compression check, and for ≥ 1 MB
  until ZeroMQ has sent the zero-copy frames); the rest of the upload time is the gateway side and the reply.
- cached re-upload: the gateway already holds the bytes, so only the digest travels; the time is the client's
  hash of the tensor plus one round trip.
- every fresh upload is also kept by the session's upload cache (512 MiB): until the cache is full each one
  lands in memory the gateway process touches for the first time (a page fault per page, about 1 GB/s on this
  VM); once it is full, evicted entries' memory is reused. Hence the priming.
- a download lands in memory the client process touches for the first time, as `.cpu()` of a CUDA tensor
  does; raw TCP's receive buffer is the same one every time. Up to 32 MiB the returned tensor is a view
  of ZeroMQ's receive buffer (no copy after the socket); above, glibc would map that buffer afresh, a page
  fault per 4 KiB page (about 1 GB/s here), so larger downloads come as 4 MiB PART messages, each copied
  into numpy memory (transparent huge pages: few faults) as it arrives.
""")

    # (d)
    ep = r["epochs"]
    rows = []
    for k, label in (("transfer_only", "batches only (`.cuda()` each batch, sync)"),
                     ("with_training", "batches + a training step per batch")):
        e1, e2 = ep[k]
        rows.append((label, f"{e1['bytes_up']:,}", f"{e2['bytes_up']:,}", f"{ep[k + '_ratio']:.2%}",
                     f"{e2['cache_hits']} / {e2['cache_hits'] + e2['cache_misses']}",
                     f"{e1['seconds'] * 1e3:.0f} / {e2['seconds'] * 1e3:.0f} ms"))
    parts.append(f"""{h} (d) Epoch 2 vs epoch 1: bytes sent

{ep['batches']} batches of 256×64 float32 + 256 int64 labels ({ep['dataset_bytes'] / MB:.2f} MB in all, well inside the 512 MB
upload cache).

{_table(("loop", "epoch-1 bytes up", "epoch-2 bytes up", "epoch 2 / epoch 1", "epoch-2 cache hits", "epoch time 1 / 2"), rows)}

- target: epoch-2 ≤ 1 % of epoch-1 bytes — {verdict(ep['transfer_only_ratio'] <= 0.01)} for the data ({ep['transfer_only_ratio']:.2%}).
- reading: in epoch 2 each batch travels as a 16-byte digest (`rc::upload_cached`). With a training step
  per batch the op messages themselves (~{ep['with_training'][1]['ops'] / ep['batches']:.0f} ops per step) are sent again every epoch and
  are not data; they are why the second row's ratio is higher.
""")

    parts.append(compression_markdown(r["codec"], r["compression"], h))

    # (f)
    p = r["pipelining"]
    variants = [(name, r[key]) for key, name in PIPELINING_VARIANTS if key in r]

    def cells(key: str, fmt=lambda v: f"{v * 1e3:.1f} ms") -> str:
        return " | ".join(fmt(v[key]) for _, v in variants)
    head = " | ".join(name for name, _ in variants)
    sep = " | ".join("---" for _ in variants)
    parts.append(f"""{h} (f) Upload-heavy loop: pipelined vs serial

Each step uploads a fresh batch (N×1024 float32) and computes `(x @ W).relu().mean()`
with W 1024×K, K calibrated on the gateway so compute ≈ transfer; {p['steps']} steps, best of runs. A pipelined
loop's first batch crosses before anything can overlap it, so its steady-state step is measured as
(T(2N steps) − T(N steps)) / N, N = {p['steps']}, the two run back to back, median over the repeats; the row
with the fill shows the best T(N) / N. Measured three
times: over loopback with the gateway's default torch threads; over loopback with a gateway whose torch uses one
thread (so one CPU is left for the transfer's processes on this {p['nproc']}-CPU machine); and with that gateway
behind a {LINK_MBIT:,} Mbit/s link (`delay_proxy.py --rate-mbit`, a userspace proxy that paces each direction
to the link's rate with a 4 MB window), where a transfer is mostly waiting on the link, as from a laptop to a
GPU server.

| per step | {head} |
| --- | {sep} |
| batch | {cells('batch_bytes', lambda v: f"{v / MB:.0f} MB")} |
| K (width of W) | {cells('width_k', str)} |
| transfer alone ({p['steps']} uploads streamed, one sync) | {cells('transfer_s')} |
| the link's own time for one batch (bytes ÷ rate): no step can be shorter | {' | '.join(
    f"{v['batch_bytes'] * 8 / (v['link_mbit'] * 1e6) * 1e3:.1f} ms" if v.get('link_mbit') else "—" for _, v in variants)} |
| compute alone (batch already on the gateway) | {cells('compute_s')} |
| max(transfer, compute): the pipelining ideal | {cells('max_s')} |
| transfer + compute: no overlap | {cells('sum_s')} |
| **serial**: `.cuda()`, compute, `loss.item()` each step | {cells('serial_s')} |
| **pipelined**: `remotecuda.prefetch(loader, depth=2)`, one sync at the end; steady state | {cells('pipelined_s')} |
| **pipelined, `loss.item()` each step**; steady state | {cells('pipelined_item_s')} |
| pipelined, {p['steps']} steps including the pipeline's fill (one sync at the end) | {cells('pipelined_fill_s')} |
| pipelined / max(transfer, compute) | {' | '.join(f"x{v['pipelined_s'] / v['max_s']:.2f}" for _, v in variants)} |
| CPU time per step, all processes: transfer | {cells('cpu_transfer_s')} |
| CPU time per step, all processes: compute | {cells('cpu_compute_s')} |
| CPU-bound floor: (CPU transfer + CPU compute) / {p['nproc']} CPUs | {cells('cpu_bound_s')} |

- target: pipelined ≈ max(transfer, compute) (taken here as within 10 %): """ + "; ".join(
        f"{name}: x{v['pipelined_s'] / v['max_s']:.2f} of the max, {verdict(v['pipelined_s'] / v['max_s'] <= 1.10)} "
        f"(serial x{v['serial_s'] / v['sum_s']:.2f} of the sum)" for name, v in variants) + f""".
- reading: on this {p['nproc']}-CPU machine the "transfer" is itself CPU work (client hash and send, worker
  receive, digest check and copy) competing with the compute's threads for the same cores, so
  no schedule beats the CPU-bound floor; where the floor is below max(transfer, compute) and pipelined is still
  near transfer + compute, the overlap is being lost in the software, not the machine. On a GPU gateway the
  compute leaves the CPUs free and only the copies compete. Over the link the transfer is mostly waiting
  (its CPU time is the row above), so there the pipelined step can come to max(transfer, compute).
- a steady-state figure is a difference of two totals (median of {len(p['serial_all'])} pairs), so it carries a
  few ms of noise either way (it can come out under the link's own time, which no step can beat).
""")
    return "\n".join(parts)


def _pays_below(c: dict, raw_bytes: int) -> str:
    """The link speed under which a codec saves time: n/L > n/z + r·n/L + n/d (compression.py)."""
    if not c["kept"]:
        return "never"
    return f"{raw_bytes * (1 - c['ratio']) / (c['encode_s'] + c['decode_s']) / 1e6:,.0f} MB/s"


def compression_markdown(codec: dict, e2e: dict, h: str = "##") -> str:
    """Section (e) of the report."""
    names = list(next(iter(codec.values()))["codecs"])
    rows = []
    for kind, c in codec.items():
        cells = [kind, f"{c['raw_bytes']:,}", f"{c['encode_raw_s'] * 1e3:.1f} ms"]
        for name in names:
            v = c["codecs"][name]
            cells += [f"{v['wire_bytes']:,} ({v['ratio']:.3f})" + ("" if v["kept"] else ", sent raw"),
                      f"{v['encode_s'] * 1e3:.1f} / {v['decode_s'] * 1e3:.1f} ms", _pays_below(v, c["raw_bytes"])]
        cells.append(", ".join(f"{choice} {k}/20" for choice, k in c["auto"].items()))
        rows.append(tuple(cells))
    head = ["payload", "raw bytes", "encode raw (digest)"]
    for name in names:
        head += [f"{name}: on the wire (wire/raw)", f"{name}: encode / decode", f"{name} pays on links slower than"]
    head.append("automatic choice (20 tries)")
    modes = list(next(iter(e2e.values())))
    rows2 = []
    for kind, per_mode in e2e.items():
        cells = [kind]
        for m in modes:
            v = per_mode[m]
            cells.append(f"{v['upload_s'] * 1e3:.1f} ms, {_mb_range(v['bytes_up_all'])}")
        downs = [b for m in modes for b in per_mode[m]["bytes_down_all"]]
        cells.append(f"{min(per_mode[m]['download_s'] for m in modes) * 1e3:.1f} ms, {_mb_range(downs)}")
        rows2.append(tuple(cells))
    link_mbps = next(iter(codec.values()))["default_link_bytes_per_s"] / 1e6
    kinds = list(codec)
    zeros, labels = codec[kinds[0]], codec[kinds[1]]

    def shrink(c: dict) -> str:
        return " and ".join(f"~{1 / c['codecs'][n]['ratio']:,.0f}x with {n}" for n in names)

    def faster(kind: str) -> str:
        """Which forced codec beat raw for this payload on this loopback, if any."""
        won = [m for m in names if e2e[kind][m]["upload_s"] < e2e[kind]["off"]["upload_s"]]
        return ", ".join(won) if won else "none"
    return f"""{h} (e) Compression: zeros, integer labels, random floats (16 MB each)

Each codec alone (`protocol.CODEC_IMPLS[...]`: lz4 block, zstd level 1; decode includes its size checks),
best of 3 on this CPU, and `LinkModel.choose` at the default link speed {link_mbps:,.0f} MB/s (it samples 64 KiB):

{_table(tuple(head), rows)}

Real uploads (fresh content, `.to('cuda')` + sync; best of runs): raw (link speed set very high), each codec
forced (link speed set very low, only that codec allowed), and automatic (the default link model, all codecs);
bytes up as counted by the client (whole messages):

{_table(("payload", *(f"{m}: time, bytes up" for m in modes), "download (gateway decides, all runs): best time, bytes down"), rows2)}

- reading: zeros shrink {shrink(zeros)}; integer labels {shrink(labels)}; random floats do not
  compress (no frame is < 90 % of raw) and go raw whatever is asked. "pays on links slower than" is the
  policy's own criterion, n/L > n/z + r·n/L + n/d, evaluated on the whole 16 MB: lz4 encodes and decodes
  faster, zstd shrinks more: the policy weighs both per payload, so lz4 tends to win on fast links and
  zstd on slow ones.
- forced codecs that beat raw on this loopback: zeros {faster(kinds[0])}; labels {faster(kinds[1])};
  random floats {faster(kinds[2])}.
- the decision rests on timing one 64 KiB sample, so on a loaded machine it can flip between runs for the
  same content (the automatic-choice column and byte ranges show it did). Single 16 MB uploads on this
  shared machine scatter by tens of ms; compare bytes first, times second.
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    ap.add_argument("--no-256", action="store_true", help="skip the 256 MB transfer")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    a = ap.parse_args()
    r = measure(quick=a.quick, with_256=not a.no_256)
    print(markdown(r))
    for name, (text, ok) in targets(r).items():
        print(f"{name}: {text} -> {'—' if ok is None else 'met' if ok else 'MISSED'}")
    print(f"total {r['elapsed_s']:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1, default=str)


if __name__ == "__main__":
    main()
