"""Where a session's devices go: the GPU pool's placement strategies.

Pure logic, so a decision can be tested, logged and replayed: the pool gives it what it knows of
each GPU (``GpuState``: the gateways' beacons and STATUS replies, plus this client's own round
trips and recent placements) and what the session has done so far (``SessionProfile``), and gets
back a ``Placement``: the GPUs, the strategy that chose them and one line saying why. No torch,
no network, no clock, no randomness: the same inputs give the same answer.

Every strategy leaves CPU gateways (``--device cpu`` without simulated GPUs) out while any GPU,
real or simulated, can serve: a CPU gateway is a fallback, not a peer (and it reports its host's
memory as free, so it would win on memory).

Strategies (``STRATEGIES``):

* ``load-balancing`` — the GPU with the least load: its sessions, those this client placed there
  that the gateway may not report yet, queued work and utilization (``GpuState.load``); among
  equals, the least loaded gateway, so sessions spread over machines as well as GPUs.
* ``memory-aware`` — the most free memory, never a GPU with less free memory than the session
  holds; GPUs within ``MEMORY_BAND`` of the most free count as equal, then fewest sessions.
* ``latency-optimized`` — the lowest round trip plus the estimated wait behind queued work;
  estimates within ``LATENCY_BAND_MS`` / ``LATENCY_BAND`` count as equal, then least load.
* ``adaptive`` (the default) — narrows the pool to GPUs that suit the session (those it fits
  in, when any; then those that run its dtypes natively, e.g. bf16 for bfloat16, when enough
  do), then picks memory-aware for a large footprint (``LARGE_BYTES``, ``LARGE_FRACTION``),
  latency-optimized for a session that syncs every few ops (``SYNC_EVERY_OPS``),
  load-balancing otherwise.

Exact ties are broken in a stable order (address, GPU index), rotated by ``spread``: a number
that differs between clients, so that clients reading the same beacons do not all pick the same
GPU. Placing several devices prefers distinct GPUs and counts each pick as placed on its GPU, so
load-balancing spreads them while latency-optimized keeps them on the nearest gateway.

``REMOTECUDA_DEVICES`` (``parse_devices``) says how many devices a session wants and may pin
each to a gateway and a GPU: ``2``, or ``host1:55555/0,any``, or ``any/A100``.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import RemoteCUDAError

STRATEGIES = ("adaptive", "load-balancing", "memory-aware", "latency-optimized")
DEFAULT_STRATEGY = "adaptive"
#: the gateway port a reason leaves out of an address (``remotecuda start``'s default)
DEFAULT_PORT = 55555

#: load-balancing: a second of work queued on a GPU weighs like one more session there, and so
#: does a GPU kept fully busy (utilization 100 %, by anyone)
QUEUE_MS_PER_SESSION = 1000.0
#: memory-aware: GPUs with free memory within this fraction of the most free are equal
MEMORY_BAND = 0.05
#: latency-optimized: estimates within this many ms, or this fraction, of the lowest are equal
#: (round trips measured on a LAN differ by noise)
LATENCY_BAND_MS = 0.5
LATENCY_BAND = 0.10
#: adaptive: a footprint is large from this size, or from this fraction of the free memory of
#: the smallest GPU it fits in (then where it goes matters more than who else is there)
LARGE_BYTES = 1 << 30
LARGE_FRACTION = 0.25
#: adaptive: a session that syncs (reads a value) at least once per this many ops waits on
#: round trips more than on compute
SYNC_EVERY_OPS = 10
#: adaptive: dtypes a GPU runs natively only with some capability: what it is called, and the test
DTYPE_NEEDS: dict[str, tuple[str, Callable[[GpuState], bool]]] = {
    "bfloat16": ("bf16", lambda g: g.bf16),
    "float8_e4m3fn": ("compute capability ≥ 8.9", lambda g: g.capability >= (8, 9)),
    "float8_e5m2": ("compute capability ≥ 8.9", lambda g: g.capability >= (8, 9)),
}


class PlacementError(RemoteCUDAError):
    """No GPU in the pool can take the session as asked (none known, a pin matches nothing, or
    memory-aware finds none with enough free memory)."""


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU as the client knows it: the gateway's latest report, the round trip this client
    measured to that gateway (None until measured) and ``placed``, the sessions this client
    placed there that the gateway's report may not count yet."""

    gateway_id: str
    address: str  # what clients connect to: "tcp://host:port" or "host:port"
    index: int  # the GPU's index on its gateway
    name: str = ""
    kind: str = "cuda"  # "cuda", or "cpu" for a gateway serving its CPU (simulated GPUs run there too)
    simulated: bool = False
    capability: tuple[int, int] = (0, 0)
    bf16: bool = True
    total_memory: int = 0
    free_memory: int = 0
    utilization: float = 0.0  # the fraction of recent time the GPU was busy, 0–1 (as gateways report it)
    queued: int = 0  # ops queued on the GPU's sessions, not yet run
    sessions: int = 0
    latency_ms: float = 0.0  # the gateway's recent time per op on this GPU
    rtt_ms: float | None = None
    placed: int = 0

    @classmethod
    def from_report(cls, gateway_id: str, address: str, gpu: Mapping[str, Any],
                    rtt_ms: float | None = None, placed: int = 0) -> GpuState:
        """From one entry of a beacon's or STATUS reply's ``gpus`` list; fields a gateway does
        not report read as idle (free memory as the total)."""
        total = int(gpu.get("total_memory", 0))
        cap = gpu.get("capability") or (0, 0)
        return cls(gateway_id, address, int(gpu["index"]), str(gpu.get("name", "")),
                   str(gpu.get("kind", "cuda")), bool(gpu.get("simulated", False)),
                   (int(cap[0]), int(cap[1])), bool(gpu.get("bf16", True)), total,
                   int(gpu.get("free_memory", total)), float(gpu.get("utilization", 0.0)),
                   int(gpu.get("queued", 0)), int(gpu.get("sessions", 0)),
                   float(gpu.get("latency_ms", 0.0)), rtt_ms, placed)

    @property
    def key(self) -> tuple[str, int]:
        return self.gateway_id, self.index

    @property
    def queue_ms(self) -> float:
        """How long a new op would wait behind the queued ones, from the recent time per op."""
        return self.queued * self.latency_ms

    @property
    def load(self) -> float:
        """Sessions here, counting this client's recent placements, plus queued work and
        utilization in sessions' worth (``QUEUE_MS_PER_SESSION``)."""
        return (self.sessions + self.placed + self.queued * self.latency_ms / QUEUE_MS_PER_SESSION
                + self.utilization)

    @property
    def host(self) -> str:
        return _split_address(self.address)[0]

    @property
    def port(self) -> int | None:
        return _split_address(self.address)[1]

    @property
    def is_gpu(self) -> bool:
        """A real or simulated GPU, not a gateway serving its CPU."""
        return self.kind != "cpu" or self.simulated

    def label(self) -> str:
        """'gw 10.0.0.2 GPU 1 (A100 simulated)', for reasons and logs."""
        host, port = _split_address(self.address)
        where = host if port in (None, DEFAULT_PORT) else f"{host}:{port}"
        what = " ".join(w for w in (self.name, "simulated" if self.simulated else "") if w)
        return f"gw {where} GPU {self.index}" + (f" ({what})" if what else "")


@dataclass(frozen=True, slots=True)
class SessionProfile:
    """What a session has done so far, or is about to do with its first batch of ops: the
    bytes it holds or is uploading, its ops, its syncs (value reads) and the dtypes it uses
    ("bfloat16"; a "torch." prefix is dropped). Placement happens when the session first needs
    its device, so all of it may be zero."""

    allocated_bytes: int = 0
    ops: int = 0
    syncs: int = 0
    dtypes: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtypes", frozenset(str(d).removeprefix("torch.") for d in self.dtypes))

    @property
    def sync_heavy(self) -> bool:
        return self.syncs > 0 and self.ops <= SYNC_EVERY_OPS * self.syncs


@dataclass(frozen=True, slots=True)
class Pin:
    """Where one device must go: a gateway host (and port) and a GPU index or words of its name
    ("A100" matches "NVIDIA A100-SXM4-80GB" but not "A10"; case-insensitive); None is "any".
    ``Pin()`` is any GPU."""

    host: str | None = None
    port: int | None = None
    gpu: int | str | None = None

    def matches(self, g: GpuState) -> bool:
        if self.host is not None or self.port is not None:
            host, port = _split_address(g.address)
            if self.host is not None and host.lower() != self.host.lower():
                return False
            if self.port is not None and port != self.port:
                return False
        if isinstance(self.gpu, int):
            return g.index == self.gpu
        return self.gpu is None or _words_in(self.gpu, g.name)

    def __str__(self) -> str:
        if self.host is None and self.gpu is None:
            return "any"
        where = (self.host or "any") + (f":{self.port}" if self.port is not None else "")
        return where + (f"/{self.gpu}" if self.gpu is not None else "")


ANY = Pin()


@dataclass(frozen=True, slots=True)
class Placement:
    """The GPUs for a session's devices (``gpus[i]`` is its ``cuda:i``), the strategy that chose
    them (adaptive names the one it picked; ``requested`` is what was asked) and why, in one line."""

    gpus: tuple[GpuState, ...]
    strategy: str
    requested: str
    reason: str


# ---------------------------------------------------------------------------- configuration

def check_strategy(name: str) -> str:
    """``name`` as one of ``STRATEGIES`` (case and surrounding spaces ignored), or ValueError."""
    norm = name.strip().lower()
    if norm not in STRATEGIES:
        raise ValueError(f"unknown scheduling strategy {name!r}; valid: {', '.join(STRATEGIES)}")
    return norm


def strategy_from_env(env: Mapping[str, str] | None = None) -> str:
    """``REMOTECUDA_STRATEGY``, checked, or the default."""
    value = (os.environ if env is None else env).get("REMOTECUDA_STRATEGY", "").strip()
    if not value:
        return DEFAULT_STRATEGY
    try:
        return check_strategy(value)
    except ValueError as e:
        raise ValueError(f"REMOTECUDA_STRATEGY: {e}") from None


_DEVICES_SYNTAX = ("expected a count ('2') or a comma-separated list of 'any' and HOST[:PORT][/GPU], "
                   "GPU being an index or words of its name (e.g. 'host1:55555/0,any' or 'any/A100')")
_HOST = re.compile(r"[A-Za-z0-9_.-]+")
_WORD = re.compile(r"[a-z0-9]+")


def parse_devices(text: str, source: str = "REMOTECUDA_DEVICES") -> tuple[Pin, ...]:
    """The devices a session wants, one ``Pin`` each: ``"2"`` is two of any GPU;
    ``"host1:55555/0,any"`` is GPU 0 of that gateway, then any GPU; ``"gpu-box/A100"`` a GPU
    with "A100" in its name on any gateway of host gpu-box. ValueError, naming ``source``,
    says what is wrong."""
    value = text.strip()
    if not value:
        raise ValueError(f"{source} is empty; {_DEVICES_SYNTAX}")
    if value.isdigit():
        n = int(value)
        if n < 1:
            raise ValueError(f"{source}={text!r}: a session needs at least 1 device; {_DEVICES_SYNTAX}")
        return (ANY,) * n
    return tuple(_parse_pin(item.strip(), source, text) for item in value.split(","))


def _parse_pin(item: str, source: str, text: str) -> Pin:
    def bad(why: str) -> ValueError:
        return ValueError(f"{source}={text!r}: {why}; {_DEVICES_SYNTAX}")

    if not item:
        raise bad("an empty item")
    if item.lower() in ("any", "*"):
        return ANY
    if item.isdigit():
        raise bad(f"{item!r} in a list: a count stands alone; write 'any' once per device")
    where, slash, gpu_text = item.removeprefix("tcp://").partition("/")
    gpu_text = gpu_text.strip()
    if slash and (not gpu_text or "/" in gpu_text):
        raise bad(f"{item!r} needs one GPU index or name after '/'")
    host, colon, port_text = where.strip().partition(":")
    port = None
    if colon:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise bad(f"{item!r} has no valid port after ':' (IPv6 addresses are not supported)")
        port = int(port_text)
    if not host:
        raise bad(f"{item!r} has no host (write 'any/GPU' to pin only the GPU)")
    any_host = host.lower() in ("any", "*")
    if any_host and port is not None:
        raise bad(f"{item!r}: a port needs a host")
    if not any_host and not _HOST.fullmatch(host):
        raise bad(f"{item!r}: {host!r} is not a host name or IPv4 address")
    gpu: int | str | None = int(gpu_text) if gpu_text.isdigit() else (gpu_text or None)
    return Pin(None if any_host else host, port, gpu)


def devices_from_env(env: Mapping[str, str] | None = None) -> tuple[Pin, ...] | None:
    """``REMOTECUDA_DEVICES`` parsed, or None when it is not set (the pool's default applies)."""
    value = (os.environ if env is None else env).get("REMOTECUDA_DEVICES", "")
    return parse_devices(value) if value.strip() else None


# ---------------------------------------------------------------------------- placing

def place(gpus: Sequence[GpuState], profile: SessionProfile | None = None,
          strategy: str = DEFAULT_STRATEGY, devices: int | Sequence[Pin] = 1,
          spread: int = 0, taken: Collection[tuple[str, int]] = ()) -> Placement:
    """Choose the GPUs for one session's devices (a count, or one ``Pin`` per device) from
    ``gpus`` by ``strategy``. ``spread`` rotates the choice among exactly equal GPUs (give each
    client its own, e.g. a hash of its id). ``taken``: the keys of GPUs the client's devices
    placed before hold; memory-aware avoids them as it avoids this placement's own picks (the
    devices would share one GPU's memory), without counting them as load again (the gateways
    count their sessions). Raises PlacementError when no GPU can serve a device and ValueError
    for an unknown strategy or a count below 1."""
    requested = check_strategy(strategy)
    profile = profile or SessionProfile()
    pins: tuple[Pin, ...] = (ANY,) * devices if isinstance(devices, int) else tuple(devices)
    if not pins:
        raise ValueError("a session needs at least 1 device")
    if not gpus:
        raise PlacementError("no GPU is known: no gateway was discovered or answered")
    extra: dict[tuple[str, int], int] = {}  # this placement's own picks, per GPU
    chosen: list[GpuState | None] = [None] * len(pins)
    details: list[str] = [""] * len(pins)
    how, why = requested, ""
    narrowed: dict[Pin, tuple[list[GpuState], list[str]]] = {}  # each pin's candidates
    # pinned devices first: they have the fewest choices
    for n, i in enumerate(sorted(range(len(pins)), key=lambda j: pins[j] == ANY)):
        if pins[i] not in narrowed:
            cands = list(gpus) if pins[i] == ANY else [g for g in gpus if pins[i].matches(g)]
            if not cands:
                raise PlacementError(f"device cuda:{i} is pinned to {pins[i]}, which matches none of the "
                                     f"{len(gpus)} known GPU(s): {_sample(gpus)}")
            want = 1 if pins[i] != ANY else pins.count(ANY)
            narrowed[pins[i]] = _narrow(cands, profile, want, requested)
        cands, notes = narrowed[pins[i]]
        if n == 0:  # the strategy and its reason are decided once, for all the session's devices
            if requested == "adaptive":
                how, why = _adapt(cands, profile)
            elif how == "memory-aware" and profile.allocated_bytes:
                why = f"session holds {_bytes(profile.allocated_bytes)}"
            why = "; ".join(w for w in (why, *notes) if w)
            if how == "memory-aware":
                extra.update(dict.fromkeys(taken, 0))
        g, details[i] = _CHOOSE[how](cands, gpus, profile, extra, spread)
        chosen[i] = g
        extra[g.key] = extra.get(g.key, 0) + 1
    picked = tuple(g for g in chosen if g is not None)
    body = details[0] if len(pins) == 1 else ", ".join(f"cuda:{i} → {d}" for i, d in enumerate(details))
    head = f"adaptive → {how}" if requested == "adaptive" else how
    return Placement(picked, how, requested, f"{head}: {why + '; ' if why else ''}{body}")


def _narrow(cands: list[GpuState], profile: SessionProfile, want: int,
            strategy: str) -> tuple[list[GpuState], list[str]]:
    """For memory-aware and adaptive, the GPUs the session fits in (when any does); then GPUs
    rather than CPU gateways (when any remains); for adaptive, those that run the session's
    dtypes natively while at least ``want`` remain (one per device to place, so that devices
    get distinct GPUs). Also says what was left out."""
    notes = []
    need = profile.allocated_bytes
    if strategy in ("adaptive", "memory-aware"):
        fit = [g for g in cands if g.free_memory >= need]
        if fit and len(fit) < len(cands):
            notes.append(f"{len(cands) - len(fit)} GPU(s) without {_bytes(need)} free left out")
            cands = fit
    real = [g for g in cands if g.is_gpu]
    if real and len(real) < len(cands):
        notes.append(f"{len(cands) - len(real)} CPU gateway(s) left out")
        cands = real
    if strategy == "adaptive":
        for dtype in sorted(profile.dtypes & DTYPE_NEEDS.keys()):
            what, ok = DTYPE_NEEDS[dtype]
            capable = [g for g in cands if ok(g)]
            if want <= len(capable) < len(cands):
                notes.append(f"{dtype} → only GPUs with {what} ({len(capable)} of {len(cands)})")
                cands = capable
    return cands, notes


def _adapt(cands: list[GpuState], profile: SessionProfile) -> tuple[str, str]:
    """Adaptive's choice of strategy for this session, and the profile fact behind it."""
    need = profile.allocated_bytes
    smallest = min(g.free_memory for g in cands)
    if need > 0 and (need >= LARGE_BYTES or need >= LARGE_FRACTION * smallest):
        return "memory-aware", f"session holds {_bytes(need)}"
    if profile.sync_heavy:
        every = profile.ops / profile.syncs
        return "latency-optimized", f"a sync every {every:.0f} op(s) ({profile.syncs} in {profile.ops} ops)"
    return "load-balancing", (f"nothing stands out ({profile.ops} op(s), {profile.syncs} sync(s), "
                              f"{_bytes(need)} held)")


Chooser = Callable[[list[GpuState], Sequence[GpuState], SessionProfile, dict, int], tuple[GpuState, str]]


def _load_balancing(cands: list[GpuState], pool: Sequence[GpuState], profile: SessionProfile,
                    extra: dict, spread: int) -> tuple[GpuState, str]:
    cands = _unused(cands, extra)
    if extra and cands[0].key in extra:  # every candidate taken already: count this placement's picks
        loads = [g.load + extra.get(g.key, 0) for g in cands]
    else:
        loads = [g.load for g in cands]
    best = min(loads)
    tied = [g for g, v in zip(cands, loads) if v == best]
    if len(tied) > 1:  # equal GPUs: the least loaded gateway
        per_gateway: dict[str, float] = {}
        for g in pool:
            per_gateway[g.gateway_id] = per_gateway.get(g.gateway_id, 0.0) + g.sessions + g.placed
        for key, n in extra.items():
            per_gateway[key[0]] = per_gateway.get(key[0], 0.0) + n
        g = _pick(tied, lambda t: per_gateway[t.gateway_id], spread)
    else:
        g = tied[0]
    placed = g.placed + extra.get(g.key, 0)
    return g, (f"{g.label()} has {g.sessions} session(s)" + (f" (+{placed} just placed)" if placed else "")
               + f", {g.queued} op(s) queued, {g.utilization:.0%} busy")


def _memory_aware(cands: list[GpuState], pool: Sequence[GpuState], profile: SessionProfile,
                  extra: dict, spread: int) -> tuple[GpuState, str]:
    need = profile.allocated_bytes
    fit = [g for g in cands if g.free_memory >= need]
    if not fit:
        most = max(cands, key=lambda t: t.free_memory)
        raise PlacementError(f"memory-aware: no GPU has the {_bytes(need)} this session holds free "
                             f"(most free: {most.label()}, {_bytes(most.free_memory)})")
    fit = _unused(fit, extra)
    floor = max(g.free_memory for g in fit) * (1 - MEMORY_BAND)
    tied = [g for g in fit if g.free_memory >= floor]
    g = _pick(tied, lambda t: (t.sessions + t.placed + extra.get(t.key, 0), -t.free_memory), spread)
    return g, f"{g.label()} has {_bytes(g.free_memory)} free"


def _latency_optimized(cands: list[GpuState], pool: Sequence[GpuState], profile: SessionProfile,
                       extra: dict, spread: int) -> tuple[GpuState, str]:
    cands = _unused(cands, extra)
    measured = [g.rtt_ms for g in cands if g.rtt_ms is not None]
    unknown = max(measured) if measured else 0.0  # not measured: no better than the worst measured

    def estimate(g: GpuState) -> float:
        return (unknown if g.rtt_ms is None else g.rtt_ms) + g.queue_ms

    est = [estimate(g) for g in cands]
    best = min(est)
    ceiling = best + max(LATENCY_BAND_MS, best * LATENCY_BAND)
    tied = [g for g, e in zip(cands, est) if e <= ceiling]
    g = _pick(tied, lambda t: (t.load + extra.get(t.key, 0), estimate(t)), spread)
    rtt = "rtt not measured yet" if g.rtt_ms is None else f"rtt {g.rtt_ms:.1f} ms"
    return g, f"{g.label()}: {rtt} + queue ~{g.queue_ms:.1f} ms"


_CHOOSE: dict[str, Chooser] = {"load-balancing": _load_balancing, "memory-aware": _memory_aware,
                               "latency-optimized": _latency_optimized}


def _unused(cands: list[GpuState], extra: dict) -> list[GpuState]:
    """Those of ``cands`` this placement has not taken yet, if any: distinct GPUs first."""
    return ([g for g in cands if g.key not in extra] or cands) if extra else cands


def _pick(tied: list[GpuState], rank: Callable[[GpuState], Any], spread: int) -> GpuState:
    """The best of ``tied`` by ``rank``; among exact equals the ``spread``-th in stable order."""
    ranks = [rank(g) for g in tied]
    best = min(ranks)
    equal = [g for g, r in zip(tied, ranks) if r == best]
    if len(equal) == 1:
        return equal[0]
    equal.sort(key=lambda g: (g.address, g.index, g.gateway_id))
    return equal[spread % len(equal)]


def _split_address(address: str) -> tuple[str, int | None]:
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not sep or not port.isdigit():
        return address.removeprefix("tcp://"), None
    return host, int(port)


def _words_in(words: str, name: str) -> bool:
    """Whether ``words`` are consecutive words of ``name`` (letters and digits; case ignored)."""
    want, have = _WORD.findall(words.lower()), _WORD.findall(name.lower())
    return bool(want) and any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _sample(gpus: Sequence[GpuState], most: int = 4) -> str:
    shown = ", ".join(g.label() for g in gpus[:most])
    return shown + (f", … ({len(gpus) - most} more)" if len(gpus) > most else "")
