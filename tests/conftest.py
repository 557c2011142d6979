"""Shared fixtures: real gateway processes on 127.0.0.1, and the client activated against one."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the dispatch cache's cross-check mode (remotecuda/dispatch_cache.py) for the whole run, and for the
#: programs tests start: every cache hit recomputes its metadata and must equal the cached entry
os.environ.setdefault("REMOTECUDA_CHECK_CACHE", "1")


class GatewayProcess:
    """A `remotecuda start --device cpu` process on a free loopback port."""

    def __init__(self, *extra: str):
        cmd = [sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
               "--no-discovery", "--quiet", *extra]
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
def remote(gateway):
    """remotecuda activated against the session's gateway for the whole test run (in this process)."""
    import remotecuda
    rt = remotecuda.activate(gateway.address, fallback="error")
    yield rt
    remotecuda.deactivate()


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
