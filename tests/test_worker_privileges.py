"""Least privilege (issue 15, item 7): what a session worker of a real gateway gives up, read from
/proc, and the warning a gateway started as root off loopback gives (remotecuda_server/privileges.py)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import psutil
import pytest
import torch

from remotecuda_server.privileges import NOFILE
from remotecuda_wire import auth, protocol

from conftest import ROOT, Client, GatewayProcess, wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _status_field(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    raise AssertionError(f"/proc/{pid}/status has no {name}")


def _limit(pid: int, name: str) -> tuple[str, str]:
    """(soft, hard) of one row of /proc/<pid>/limits."""
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith(name):
                soft, hard = line[len(name):].split()[:2]
                return soft, hard
    raise AssertionError(f"/proc/{pid}/limits has no {name!r}")


def _tmpdir(pid: int) -> str:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    return env[b"TMPDIR"].decode()


def _workers(gw: GatewayProcess) -> list[psutil.Process]:
    return [p for p in psutil.Process(gw.proc.pid).children() if "remotecuda_server.worker" in " ".join(p.cmdline())]


def test_a_worker_drops_privileges_and_has_a_private_temp_dir(monkeypatch):
    """Each worker (a spare, and one serving a session): NoNewPrivs set, no core dumps, a bounded
    number of open files, a TMPDIR of its own (mode 0700) that is removed when the worker has exited."""
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    gw = GatewayProcess("--spare", "1")
    c = Client(gw.endpoint)
    try:
        c.hello()
        x = torch.arange(4.0)
        assert torch.equal(c.add(x, x), x * 3)  # the session's worker serves, under these limits
        assert wait_for(lambda: len(_workers(gw)) >= 2, 60)  # and a spare is started
        workers = _workers(gw)
        tmps = set()
        for w in workers:  # (a spare drops them once it has imported torch, before it is ready)
            assert wait_for(lambda w=w: _status_field(w.pid, "NoNewPrivs") == "1", 120), w.pid
            assert _limit(w.pid, "Max core file size") == ("0", "0")
            assert _limit(w.pid, "Max open files") == (str(NOFILE), str(NOFILE))
            tmp = _tmpdir(w.pid)
            st = os.stat(tmp)
            assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, (tmp, oct(st.st_mode))
            tmps.add(tmp)
        assert len(tmps) == len(workers), "two workers share a temporary directory"
        c.send(protocol.BYE, {})
        # the session's worker exits; its directory goes with it (and each spare's when it ends)
        assert wait_for(lambda: sum(os.path.exists(t) for t in tmps) < len(tmps), 60), \
            "a worker's temporary directory outlived it"
        gw.stop()
        assert not any(os.path.exists(t) for t in tmps)
    finally:
        c.close()
        gw.stop()


def test_a_gateway_started_as_root_off_loopback_warns(tmp_path):
    """As root, off loopback (with a token; on a port no one is told of, no discovery: nothing is
    sent anywhere), the gateway starts and says that it should not run as root."""
    if os.geteuid() != 0:
        pytest.skip("not running as root")
    token = tmp_path / "token"
    token.write_text("a-token-for-this-test-0123456789")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTECUDA_TOKEN")}
    proc = subprocess.Popen([sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
                             "--no-discovery", "--quiet", "--spare", "0", "--host", "0.0.0.0",
                             "--token-file", str(token)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            cwd=ROOT, env=env)
    try:
        assert proc.stdout.readline().startswith("READY "), "the gateway did not start"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "running as root off loopback" in err, err
