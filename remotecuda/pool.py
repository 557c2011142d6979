"""The pool: the gateways this client may use, the virtual devices its program sees, where
each device is placed, and one session per device.

**Gateways** come from discovery (discovery.py). An explicit list (``REMOTECUDA_SERVERS``,
``activate(servers=...)``, ``remotecuda run --server``) is asked directly, and no multicast is
used. Otherwise the pool listens for beacons: activation waits for the first one for up to
``LISTEN`` seconds (one beacon interval and a margin), and when none comes it asks
``DEFAULT_SERVER`` (127.0.0.1:55555, where ``remotecuda start`` listens by default: a gateway on
this machine is found even where multicast is not heard). When nothing answers, the pool starts
a gateway on the local CPU (after one warning) unless ``fallback="error"``, so unchanged code
still runs. The pool keeps listening: gateways that join later are candidates for devices
placed later.

**Virtual devices**: ``REMOTECUDA_DEVICES`` (scheduler.parse_devices: a count, or one pin per
device) says how many a program sees as ``cuda:0..N-1``. Unset, an explicit list gives all its
gateways' GPUs in order (cuda:N is the N-th GPU over the listed gateways, fixed at activation),
and a discovered pool gives one device. ``CUDA_VISIBLE_DEVICES``, when set, then picks among
them and renumbers them, as CUDA does (visible_devices.py). ``torch.cuda.device_count()`` is
their number, known without placing any.

**Placement**: a device not placed yet is placed when its session first needs it (its first
upload, value read or full batch of ops; ``Session.open``) or when its properties are asked for,
by the strategy (scheduler.place) over the candidates' STATUS, asked at that moment in one
parallel round trip (whose time is the round trip latency-optimized weighs). The session's
profile is what is known then: what it queued and why it needs the device now, the module being
moved to it (``hint``, from ``Module.cuda()``/``.to()``), and what this process did on its other
devices. One log line (logger "remotecuda") says where each device went and why; ``placements``
gives the same for ``remotecuda.stats()`` and ``%remotecuda status``.

The pool knows gateways, devices and sessions only; what a session must be told when it opens
(the seed, backend flags) is the runtime's, handed in as ``prime`` (runtime.py).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import subprocess
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import zmq

from remotecuda_wire import beacon, cache, protocol
from remotecuda_wire.lifetime import die_with_parent
from remotecuda_wire.limits import env_number

from . import visible_devices
from .discovery import Answer, Discovery, MulticastSource, ask
from .errors import GatewayAuthError, GatewayUnavailableError, RemoteCUDAError, accelerator_error
from .failover import Failover
from .failover import enabled as failover_enabled
from .liveness import Liveness
from .replay_log import ReplayLog
from .scheduler import ANY, DEFAULT_STRATEGY, GpuState, Pin, PlacementError, SessionProfile, check_strategy, place
from .session import BATCH_WINDOW, PING_EVERY, STAT_KEYS, Session

DEFAULT_SERVER = "127.0.0.1:55555"
#: how long activation listens for a first beacon: one beacon interval and a margin
LISTEN = beacon.INTERVAL + 0.5
#: how long placement lets a new listener hear every gateway's beacon once
HEAR_ALL = beacon.INTERVAL + 0.2
#: how long a gateway has to answer the STATUS asked at placement
STATUS_TIMEOUT = 1.0
#: more gateways than this: STATUS is asked of the best this many by their beacons' figures
FRESH_MAX = 16

log = logging.getLogger("remotecuda")


def _caller_level() -> int:
    """The ``stacklevel`` that names the first caller outside remotecuda (the program's
    ``activate()`` line), for a warning issued by the function calling this one."""
    inside, level = os.path.dirname(os.path.abspath(__file__)) + os.sep, 1
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


@dataclass
class VirtualDevice:
    """``cuda:index``: what it is pinned to, and once placed, where it went and why."""

    index: int
    pin: Pin = ANY
    endpoint: str = ""  # the gateway's "tcp://host:port"; "" until placed
    gpu: int = -1  # the GPU's index on its gateway
    props: dict = field(default_factory=dict)  # the gateway's description of the GPU
    gateway: dict = field(default_factory=dict)  # the gateway's inventory (versions, id)
    strategy: str = ""  # the strategy that placed it ("listed": an explicit list, in order; "fallback")
    requested: str = ""  # the strategy asked for (adaptive names the one it chose in ``strategy``)
    reason: str = ""  # one line: why there

    @property
    def placed(self) -> bool:
        return bool(self.endpoint)

    @property
    def kind(self) -> str:
        """"cuda" or "cpu": which device's kernels the gateway runs (the client picks fused ops by it)."""
        return self.props.get("kind", "cuda")

    def describe(self) -> dict:
        """Where it is and why, as ``remotecuda.stats()["devices"]`` lists it."""
        return {"device": f"cuda:{self.index}", "placed": self.placed, "pin": str(self.pin),
                "gateway": self.endpoint or None, "gpu": self.gpu if self.placed else None,
                "name": self.props.get("name"), "simulated": bool(self.props.get("simulated", False)),
                "strategy": self.strategy or None, "requested": self.requested or None,
                "reason": self.reason or None}


def endpoint(server: str) -> str:
    """'host:port' (or a tcp:// URL) → a ZeroMQ endpoint."""
    server = server.strip()
    if server.startswith("tcp://"):
        return server
    host, sep, port = server.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"remotecuda: a server is HOST:PORT, got {server!r}")
    return f"tcp://{host or '127.0.0.1'}:{port}"


class Pool:
    """The gateways, the virtual devices, their placement and a session per device (see the
    module's docstring).

    ``servers``: an explicit list (empty: discovery); ``devices``: one pin per device
    (REMOTECUDA_DEVICES; None: the default above); ``strategy``: for devices placed from now on
    (``set_strategy``); ``codecs``: the payload codecs sessions offer; ``prime``: called with
    each session as it opens, before any other op is queued on it.
    """

    def __init__(self, servers: Sequence[str] = (), devices: Sequence[Pin] | None = None,
                 strategy: str = DEFAULT_STRATEGY, fallback: str = "cpu", sync: bool = False,
                 connect_timeout: float = 3.0, codecs: Sequence[str] = protocol.CODECS,
                 prime: Callable[[Session], Any] | None = None):
        self.ctx = zmq.Context()
        self.sync = sync
        self.codecs = tuple(codecs)
        self.prime = prime
        self.strategy = check_strategy(strategy)
        #: rotates this client's choice among exactly equal GPUs (clients reading the same figures do not herd)
        self.spread = random.SystemRandom().randrange(1 << 30)
        #: the upload cache bound that sessions opened from now on ask the gateway for
        self.cache_bytes = int(env_number("REMOTECUDA_CACHE_BYTES", cache.DEFAULT_BYTES))
        self.cache_policy = os.environ.get("REMOTECUDA_CACHE_POLICY", "").strip().lower() or "lru"
        if self.cache_policy not in ("lru", "lfu"):
            raise ValueError(f"REMOTECUDA_CACHE_POLICY={self.cache_policy!r}: 'lru' (the default) or 'lfu'")
        self.devices: list[VirtualDevice] = []
        self.sessions: dict[int, Session] = {}
        self.fallback_gateway: subprocess.Popen | None = None
        #: the gateways asked directly (an explicit list, or DEFAULT_SERVER), in order
        self.named: list[str] = [endpoint(s) for s in servers]
        #: the multicast listener, while the pool follows it
        self.discovery: Discovery | None = None
        #: where gateways were looked for, for messages
        self.found_via = "the named servers " + ", ".join(self.named) if self.named else ""
        self._lock = threading.Lock()  # opening sessions
        self._placing = threading.Lock()  # one placement at a time: each counts the ones before
        self._hints = threading.local()  # per thread: the module being moved to 'cuda' (``hint``)
        #: moves a session whose GPU fails to another (failover.py); None: REMOTECUDA_FAILOVER=off
        self.failover = Failover(self.relocate) if failover_enabled() else None
        self._listening_since = 0.0
        pins = list(devices) if devices is not None else None
        refused: dict[str, str] = {}  # why a security handshake failed, by endpoint
        if self.named:
            answers = ask(self.ctx, self.named, connect_timeout, refused)
            unreachable = [refused.get(ep, f"no RemoteCUDA gateway answered at {ep} within {connect_timeout:.1f} s")
                           for ep, a in zip(self.named, answers) if a is None]
            if any(answers):
                self._listed(answers, pins)
        else:
            unreachable = self._discover(pins)
        if not self.devices:
            if fallback == "error":
                raise (GatewayAuthError if refused else GatewayUnavailableError)(
                    "no RemoteCUDA gateway is reachable (" + "; ".join(unreachable) + "); "
                    "REMOTECUDA_FALLBACK=error forbids running on the local CPU")
            warnings.warn("remotecuda: no gateway is reachable (" + "; ".join(unreachable) + "); "
                          "running 'cuda' work on the local CPU instead", RuntimeWarning, stacklevel=_caller_level())
            self._start_local_gateway(pins)
        #: every device found, of which CUDA_VISIBLE_DEVICES picks ``devices`` (``_apply_visible``)
        self._found = self.devices
        #: whether a device was used (CUDA initialized): CUDA_VISIBLE_DEVICES is read no more
        self._initialized = False
        self._apply_visible()
        self._stop = threading.Event()
        self._pending = threading.Event()
        self._flusher = threading.Thread(target=self._background, name="remotecuda-flush", daemon=True)
        self._flusher.start()
        #: heartbeats to the gateways in use: marks a silent one down and its sessions lost (liveness.py)
        self.liveness = Liveness(self.ctx, lambda: list(self.sessions.values()),
                                 lambda: {d.endpoint for d in self.devices if d.placed}).start()
        if self.discovery is not None:
            self.discovery.subscribe(self.liveness.on_discovery)
        atexit.register(self.close)

    @property
    def initialized(self) -> bool:
        """Whether a device was used: CUDA's initialization (``_initialize``)."""
        return self._initialized

    @property
    def is_fallback(self) -> bool:
        return self.fallback_gateway is not None

    @property
    def fallback_endpoint(self) -> str | None:
        """The local fallback gateway's address (None: none started), for the processes this one
        starts (children.py) and its forked children (``Runtime.forked_before_initialization``)."""
        return self._found[0].endpoint if self.fallback_gateway is not None else None

    # ------------------------------------------------------------------ finding gateways
    def _listed(self, answers: list[Answer | None], pins: list[Pin] | None) -> None:
        """An explicit list: with no pins, cuda:N are its gateways' GPUs in order, placed now."""
        if pins is not None:
            self.devices = [VirtualDevice(i, pin) for i, pin in enumerate(pins)]
            return
        for ep, a in zip(self.named, answers):
            if a is None:
                continue
            for d in a.status.get("devices", []):
                i = len(self.devices)
                self.devices.append(VirtualDevice(
                    i, ANY, ep, d["index"], d, _inventory(a.status), "listed", "listed",
                    f"the named servers' GPUs in order: GPU {d['index']} of {ep[6:]}"))

    def _discover(self, pins: list[Pin] | None) -> list[str]:
        """Listen for beacons (and ask DEFAULT_SERVER meanwhile); what was not found, for messages."""
        try:
            source = MulticastSource.from_env()
            where = source.describe()
        except OSError as e:  # no multicast here (no interface to join the group on)
            source, where = None, f"no multicast (cannot join the beacons' group: {e})"
        if source is not None:
            self.discovery = Discovery(source)
            self._listening_since = time.monotonic()
        local = ask(self.ctx, [endpoint(DEFAULT_SERVER)], min(0.5, LISTEN))[0]
        heard = (self.discovery.wait(1, self._listening_since + LISTEN - time.monotonic())
                 if self.discovery is not None else [])
        if heard:
            self.found_via = where
            self.devices = [VirtualDevice(i, pin) for i, pin in enumerate(pins or [ANY])]
            return []
        if self.discovery is not None:
            self.discovery.close()
            self.discovery = None
        missed = [f"no beacon heard on {where} within {LISTEN:.1f} s" if source is not None else where]
        # a pin's HOST:PORT is asked directly (docs/POOL.md): a gateway started --no-discovery is pinned too
        pinned = list(dict.fromkeys(endpoint(f"{p.host}:{p.port}") for p in pins or [] if p.host and p.port))
        answers = ask(self.ctx, pinned, LISTEN) if pinned else []
        named = [ep for ep, a in zip(pinned, answers) if a is not None]
        missed += [f"no RemoteCUDA gateway answered at {ep} within {LISTEN:.1f} s" for ep in pinned if ep not in named]
        if local is None and not named:
            return [*missed, f"none answered at {DEFAULT_SERVER}"]
        if local is not None and endpoint(DEFAULT_SERVER) not in named:
            named.append(endpoint(DEFAULT_SERVER))
            answers.append(local)
        log.info("no gateway announced itself on %s; using %s", where, ", ".join(ep[6:] for ep in named))
        self.named = named
        self.found_via = f"{', '.join(ep[6:] for ep in named)} (no beacon heard on {where})"
        self._listed([a for a in answers if a is not None], pins)
        return []

    def _start_local_gateway(self, pins: list[Pin] | None) -> None:
        cmd = [sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
               "--no-discovery", "--quiet"]
        # its own session: Jupyter's "Interrupt kernel" signals the kernel's whole process group,
        # and a SIGINT stops a gateway (ipykernel still terminates it at kernel shutdown)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True, preexec_fn=die_with_parent)  # a killed client's helper
        line = proc.stdout.readline() if proc.stdout else ""  # "READY tcp://127.0.0.1:PORT" once it listens
        if not line.startswith("READY "):
            proc.kill()
            raise GatewayUnavailableError("could not start a local CPU gateway for the fallback")
        self.fallback_gateway = proc
        ep = line.split()[1]
        a = ask(self.ctx, [ep], 60.0)[0]
        if a is None:
            raise GatewayUnavailableError("the local CPU gateway started for the fallback does not answer")
        gpus = a.status.get("devices", [])
        for i in range(len(gpus) if pins is None else len(pins)):  # (pins cannot apply: all on it)
            d = gpus[i % len(gpus)]
            self.devices.append(VirtualDevice(i, ANY, ep, d["index"], dict(d, name=d["name"] + " [local fallback]"),
                                              _inventory(a.status), "fallback", "fallback",
                                              "no gateway found: a gateway on this machine's CPU"))

    # ------------------------------------------------------------------ devices and placement
    def _apply_visible(self) -> None:
        """The devices found that CUDA_VISIBLE_DEVICES leaves visible, renumbered (visible_devices.py)."""
        value = os.environ.get(visible_devices.VAR)
        visible = visible_devices.from_env(len(self._found))
        #: the devices CUDA_VISIBLE_DEVICES hid, and its value, for messages
        self.hidden = (0 if visible is None else len(self._found) - len(visible), value)
        self.devices = (list(self._found) if visible is None
                        else [replace(self._found[i], index=n) for n, i in enumerate(visible)])

    def visible(self) -> list[VirtualDevice]:
        """The devices. CUDA reads CUDA_VISIBLE_DEVICES when it initializes, at a program's first
        use of a device, and torch's ``device_count()`` reads it afresh until then; a notebook sets
        it in its first cell, which runs after the RemoteCUDA kernel activated. So until a device
        is used, a changed value applies here too."""
        if not self._initialized and os.environ.get(visible_devices.VAR) != self.hidden[1]:
            self._apply_visible()
        return self.devices

    def _initialize(self) -> None:
        """CUDA's initialization, at the first use of a device: the environment CUDA reads then is
        read a last time (a notebook sets it in its first cell, after the RemoteCUDA kernel activated):
        CUDA_VISIBLE_DEVICES, and CUDA_LAUNCH_BLOCKING, whose 1 makes every op synchronous, as
        REMOTECUDA_SYNC does (torch's CUDA errors advise it, to raise an error at its line)."""
        self.visible()
        if os.environ.get("CUDA_LAUNCH_BLOCKING", "") not in ("", "0"):
            self.sync = True
            for s in list(self.sessions.values()):
                s.sync = True
        self._initialized = True

    def check(self, index: int) -> VirtualDevice:
        """Virtual device ``cuda:index``, placed or not; an invalid index raises as CUDA does.
        The first call is CUDA's initialization (``_initialize``)."""
        if not self._initialized:
            self._initialize()
        if not self.devices:
            raise RuntimeError(f"No CUDA GPUs are available ({visible_devices.VAR}={self.hidden[1]!r} hides all "
                               f"{self.hidden[0]} of remotecuda's virtual devices)")
        if not 0 <= index < len(self.devices):
            raise accelerator_error(f"CUDA error: invalid device ordinal (cuda:{index}; remotecuda has "
                                    f"{len(self.devices)} device(s))")
        return self.devices[index]

    def device(self, index: int, why: str = "properties") -> VirtualDevice:
        """Virtual device ``cuda:index``, placed now if it is not yet (its properties are asked for)."""
        d = self.check(index)
        if not d.placed:
            s = self.sessions.get(index)
            own = s.first_need(why) if s is not None and not s.connected else SessionProfile()
            self.place(index, own, why)
        return d

    @contextlib.contextmanager
    def hint(self, footprint: Callable[[], tuple[int, Iterable[str]]]) -> Iterator[None]:
        """While a module is moved to 'cuda' on this thread, a device placed meanwhile counts it as
        held: ``footprint()`` gives its bytes and dtypes, asked only if a placement happens
        (interception's ``Module._apply``). Nested: the outermost module's."""
        if getattr(self._hints, "footprint", None) is not None:
            yield
            return
        self._hints.footprint = footprint
        try:
            yield
        finally:
            self._hints.footprint = None

    def place(self, index: int, own: SessionProfile | None = None, why: str = "") -> VirtualDevice:
        """Place ``cuda:index`` by the strategy, if it is not placed yet; ``own``: what its session
        showed at its first need, ``why`` what it needs the device for (for the log line)."""
        d = self.check(index)
        with self._placing:
            if d.placed:
                return d
            profile = self._profile(own or SessionProfile())
            states, statuses = self._states(d.pin, profile)
            try:
                mine = {(o.endpoint, o.gpu) for o in self.devices if o.placed}  # (distinct GPUs while there are enough)
                taken = [g.key for g in states if (g.address, g.index) in mine]
                p = place(states, profile, self.strategy, devices=[d.pin], spread=self.spread, taken=taken)
            except PlacementError as e:
                raise PlacementError(f"cannot place cuda:{index}: {e} (gateways found via {self.found_via})") from None
            g = p.gpus[0]
            status = statuses[g.address]
            props: dict = next((x for x in status.get("devices", []) if x.get("index") == g.index), {})
            d.endpoint, d.gpu, d.props, d.gateway = g.address, g.index, props, _inventory(status)
            d.strategy, d.requested, d.reason = p.strategy, p.requested, p.reason
        log.info("cuda:%d placed at %s: %s", index, _need(why, own), p.reason)
        return d

    def _profile(self, own: SessionProfile) -> SessionProfile:
        """The session's own first batch, the module being moved to it, and this process's history:
        the ops and value reads of the sessions opened before it."""
        footprint = getattr(self._hints, "footprint", None)
        held, dtypes = footprint() if footprint is not None else (0, ())
        ops, syncs = own.ops, own.syncs
        for s in list(self.sessions.values()):
            if s.connected:
                c = s.counters(wait=False)
                ops += int(c["ops"])
                syncs += int(c["blocking_round_trips"])
        return SessionProfile(allocated_bytes=max(own.allocated_bytes, held), ops=ops, syncs=syncs,
                              dtypes=own.dtypes | frozenset(dtypes))

    def _states(self, pin: Pin, profile: SessionProfile,
                skip_down: bool = False) -> tuple[list[GpuState], dict[str, dict]]:
        """Every candidate GPU as the scheduler reads it, from STATUS asked now (the figures of
        this moment, and its round trip), and each gateway's STATUS by address. ``skip_down``:
        not asking the gateways liveness holds down (their silence would cost STATUS_TIMEOUT)."""
        addresses = self._candidates(pin, profile)
        if skip_down:
            addresses = [a for a in addresses if self.liveness.down(a) is None]
        answers = ask(self.ctx, addresses, STATUS_TIMEOUT)
        states, statuses = [], {}
        placed: dict[tuple[str, int], int] = {}
        for d in self.devices:  # placed, not opened yet: the gateway does not count them
            s = self.sessions.get(d.index)
            if d.placed and (s is None or not s.connected):
                placed[(d.endpoint, d.gpu)] = placed.get((d.endpoint, d.gpu), 0) + 1
        for address, a in zip(addresses, answers):
            if a is None:
                continue
            statuses[address] = a.status
            rtt = a.rtt_ms
            seen = self.liveness.rtt_ms(address)
            if seen is not None:  # (queueing only ever adds to a round trip: the least is the link's)
                rtt = min(rtt, seen)
            gid = str(a.status.get("id") or address)
            for gpu in a.status.get("gpus") or a.status.get("devices", []):
                states.append(GpuState.from_report(gid, address, gpu, rtt, placed.get((address, gpu["index"]), 0)))
        if addresses and not statuses:
            raise GatewayUnavailableError(f"no gateway answered STATUS within {STATUS_TIMEOUT:.1f} s: "
                                          + ", ".join(a[6:] for a in addresses))
        return states, statuses

    def _candidates(self, pin: Pin, profile: SessionProfile) -> list[str]:
        """The gateways to ask: the named ones, or those discovery heard of (waiting until each had
        time to be heard once), and the one a pin names by HOST:PORT. Of many, the best by their
        beacons' figures."""
        pinned = [endpoint(f"{pin.host}:{pin.port}")] if pin.host and pin.port else []
        if self.discovery is None:
            return list(dict.fromkeys(self.named + pinned))
        wait = self._listening_since + HEAR_ALL - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        heard = self.discovery.snapshot()
        if len(heard) > FRESH_MAX:
            stale = [GpuState.from_report(g.id, g.address, gpu) for g in heard for gpu in g.gpus]
            try:
                best = place(stale, profile, self.strategy, devices=[pin] * FRESH_MAX, spread=self.spread).gpus
                keep = {g.address for g in best}
                heard = [g for g in heard if g.address in keep]
            except PlacementError:
                pass
        return list(dict.fromkeys([g.address for g in heard] + pinned))

    def placements(self) -> list[dict]:
        """Each device: where it is placed (or not yet), by which strategy and why, and whether its
        session is open."""
        return [dict(d.describe(), open=d.index in self.sessions and self.sessions[d.index].connected)
                for d in self.devices]

    # ------------------------------------------------------------------ sessions
    def session(self, index: int) -> Session:
        """The session of ``cuda:index``, made (and primed) on first use: greeted at once where the
        device is placed already, else at its first need (``Session.open`` → ``_locate``)."""
        s = self.sessions.get(index)
        if s is None:
            with self._lock:
                s = self.sessions.get(index)
                if s is None:
                    d = self.check(index)
                    if d.placed:
                        self.liveness.check(d.endpoint)  # a gateway found down: say so now, not after a timeout
                    s = Session(self.ctx, d.endpoint or None, d.gpu if d.placed else None, index,
                                connect_timeout=60.0, sync=self.sync, cache_bytes=self.cache_bytes,
                                cache_policy=self.cache_policy, codecs=self.codecs, wake=self._pending.set,
                                locate=self._locate)
                    if self.failover is not None:
                        s.log, s.failover = ReplayLog(), self.failover.recover
                    if self.prime is not None:
                        self.prime(s)
                    self.sessions[index] = s
        return s

    def _locate(self, s: Session, own: SessionProfile, why: str) -> tuple[str, int]:
        """Where session ``s`` goes, at its first need: its device, placed now if not yet."""
        d = self.place(s.vdev, own, why) if not self.devices[s.vdev].placed else self.devices[s.vdev]
        self.liveness.check(d.endpoint)
        return d.endpoint, d.gpu

    def relocate(self, s: Session, nbytes: int) -> tuple[str, int, str]:
        """Where session ``s`` goes when its GPU failed (failover.py): the strategy's choice among
        the GPUs that answer STATUS now and that liveness does not hold down, the same model as
        before preferred, ``nbytes`` of free memory required. The device's placement follows it."""
        d = self.devices[s.vdev]
        model = d.props.get("name")
        profile = SessionProfile(allocated_bytes=nbytes)
        with self._placing:
            states, statuses = self._states(ANY, profile, skip_down=True)
            same = [g for g in states if g.name == model]
            try:
                p = place(same, profile, self.strategy, spread=self.spread)
            except PlacementError:  # (none of that model can take it: any GPU that can)
                try:
                    p = place(states, profile, self.strategy, spread=self.spread)
                except PlacementError as e:
                    raise PlacementError(f"no GPU can take cuda:{s.vdev} ({nbytes} bytes): {e}") from None
            g = p.gpus[0]
            status = statuses[g.address]
            d.endpoint, d.gpu, d.gateway = g.address, g.index, _inventory(status)
            d.props = next((x for x in status.get("devices", []) if x.get("index") == g.index), {})
            d.strategy, d.reason = "failover", f"failover: {p.reason}"
        return d.endpoint, d.gpu, p.reason

    def _background(self) -> None:
        """Flush ops that waited a batch window while the user's code did something else, and
        keep idle sessions alive; asleep (no wake-ups) while nothing is queued."""
        while not self._stop.is_set():
            if self._pending.wait(PING_EVERY):
                self._pending.clear()
                time.sleep(BATCH_WINDOW)
            now = time.monotonic()
            for s in list(self.sessions.values()):
                try:
                    if s.maybe_flush(now):
                        self._pending.set()  # it was busy: look again after another window
                except (zmq.ZMQError, RemoteCUDAError):
                    pass  # the session is marked lost; the user's next call says so
                except Exception:  # noqa: BLE001 - ops that cannot be sent stay queued: the user's
                    pass  # next flush raises the same error in the user's thread; this one goes on

    def synchronize(self) -> None:
        """Wait for every session's queued work; raise the first pending remote error."""
        for s in list(self.sessions.values()):
            _synchronize(s)

    def finish(self) -> None:
        """Wait for the work no reply has answered yet, raising the first pending remote error
        (the interpreter's exit, runtime.py: a CUDA program's end waits for its kernels)."""
        for s in list(self.sessions.values()):
            if s.unfinished:
                _synchronize(s)

    def flush(self) -> None:
        """Send every session's queued ops without waiting for them: an interrupted cell's end
        (ipython.py), whose work runs on in the background as a GPU's launched kernels do."""
        for s in list(self.sessions.values()):
            if s.queued and not s.closed:
                s.flush()

    def cancel(self) -> None:
        """Drop every session's queued and running work (``%remotecuda cancel``, ipython.py)."""
        for s in list(self.sessions.values()):
            s.cancel()

    def counters(self, reset: bool = False, wait: bool = True) -> dict[str, Any]:
        """The sessions' counters (session.STAT_KEYS) summed; see ``Session.counters``."""
        total: dict[str, Any] = dict.fromkeys(STAT_KEYS, 0)
        for s in list(self.sessions.values()):
            for k, v in s.counters(reset=reset, wait=wait).items():
                total[k] += v
        return total

    def close(self) -> None:
        """Close every session (BYE: the gateway frees its memory) and the local fallback gateway."""
        if getattr(self, "_stop", None) is None or self._stop.is_set():
            return
        atexit.unregister(self.close)
        self._stop.set()
        self._pending.set()  # wake the flusher, which then ends
        if self._flusher is not threading.current_thread():
            self._flusher.join(timeout=1.0)  # (a send to a gone gateway may hold it; it ends after)
        self.liveness.close()
        if self.discovery is not None:
            self.discovery.close()
        for s in list(self.sessions.values()):
            try:
                s.close()
            except Exception:  # closing must never raise at exit
                pass
            if s.log is not None:
                s.log.close()
        self.sessions.clear()
        if self.fallback_gateway is not None:
            self.fallback_gateway.terminate()
            try:
                self.fallback_gateway.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.fallback_gateway.kill()
        self.ctx.term()

    def abandon(self) -> None:
        """In a forked child: forget the parent's sessions without touching their sockets."""
        atexit.unregister(self.close)
        self.sessions = {}


def _synchronize(s: Session) -> None:
    """Wait for session ``s``'s queued work, placing it for that if it has some."""
    if not s.connected and not s.closed:
        if not s.queued:
            return  # never placed, nothing asked of it
        with s.lock:
            s.open("synchronize")  # (placed for its queued work: not a value read)
    if not s.closed or s.lost is not None:  # (a gateway found down: its error, as CUDA's sticky one)
        s.synchronize()


def _inventory(status: dict) -> dict:
    """A gateway's description of itself from its STATUS (versions, id), without its figures."""
    return {k: v for k, v in status.items() if k not in ("sessions", "totals", "gpus", "devices")}


def _need(why: str, own: SessionProfile | None) -> str:
    """'its first value read (rc::fetch) after 3 op(s)', for the placement's log line."""
    ops = f" after {own.ops} op(s)" if own is not None and own.ops else ""
    if why in ("upload", "flush", "synchronize"):
        return f"its first {why}{ops}"
    if why.startswith(("rc::", "aten::")):
        return f"its first value read ({why}){ops}"
    return f"a question about its {why}" if why else "its first use"
