"""Shared fixtures: real gateway processes on 127.0.0.1, and the client activated against one."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the dispatch cache's cross-check mode (remotecuda/dispatch_cache.py) for the whole run, and for the
#: programs tests start: every cache hit recomputes its metadata and must equal the cached entry
os.environ.setdefault("REMOTECUDA_CHECK_CACHE", "1")


def private_discovery() -> str:
    """A multicast group and UDP port for one test run (or one test) alone: "GROUP:PORT"."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"239.255.{random.randint(101, 254)}.{random.randint(1, 254)}:{port}"


#: beacons stay on loopback, on a group of this run's own: no gateway a test starts (they inherit
#: this environment) sends through the default route, and parallel runs do not hear each other
os.environ["REMOTECUDA_DISCOVERY_IFACE"] = "127.0.0.1"
os.environ["REMOTECUDA_DISCOVERY"] = private_discovery()


class GatewayProcess:
    """A `remotecuda start --device cpu` process on a free loopback port (announcing itself with
    ``discovery``, on the run's private group unless the environment says otherwise)."""

    def __init__(self, *extra: str, discovery: bool = False):
        cmd = [sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
               *([] if discovery else ["--no-discovery"]), "--quiet", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=ROOT)
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"gateway did not start: {line!r}")
        self.endpoint = line.split()[1]
        self.address = self.endpoint.replace("tcp://", "")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def gateway():
    gw = GatewayProcess("--spare", "2")
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def _activation(gateway):
    """remotecuda activated against the session's gateway for the whole test run (in this process)."""
    import remotecuda
    remotecuda.activate(gateway.address, fallback="error")
    yield
    remotecuda.deactivate()


@pytest.fixture
def remote(_activation, gateway):
    """The active runtime: a test module that activates over gateways of its own (and deactivates
    the run's activation meanwhile) activates anew after it, so ask each time."""
    import remotecuda
    return remotecuda.runtime.active() or remotecuda.activate(gateway.address, fallback="error")


@contextmanager
def interception_removed():
    """torch as deactivate() leaves it, for the block, with the active runtime's sessions kept
    open: its interception removed, then installed again."""
    from remotecuda import interception, runtime
    rt = runtime.current()
    rt.interception.remove()
    try:
        yield
    finally:
        rt.interception = interception.install(rt)


@pytest.fixture
def fresh_gateway():
    gw = GatewayProcess()
    yield gw
    gw.stop()


def run_python(code: str, env: dict | None = None, timeout: float = 300, args: list | None = None):
    """Run Python code in a fresh interpreter (for behaviour that needs a clean torch)."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, *(args or ["-c", code])], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=ROOT)


def wait_for(pred, timeout: float = 20.0, interval: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return False
