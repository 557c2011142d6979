"""The jupyter_server extension behind the "GPU pool" panel (remotecuda/labserver.py), in a real
Jupyter server process hearing a real gateway's beacons on this run's private multicast group."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid

import pytest

from conftest import GatewayProcess, stop_group, wait_for

pytest.importorskip("jupyter_server")


@pytest.fixture
def server(tmp_path):
    """A Jupyter server with the extension enabled by its own config (whatever is installed)."""
    config = tmp_path / "config"
    config.mkdir()
    (config / "jupyter_server_config.json").write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {"remotecuda.labserver": True}}}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = uuid.uuid4().hex
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(config), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    env.pop("REMOTECUDA_SERVERS", None)
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root",
                                 "--ip=127.0.0.1", f"--port={port}", f"--IdentityProvider.token={token}",
                                 f"--ServerApp.root_dir={tmp_path}"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}/", token, proc
    finally:
        stop_group(proc)
        print((tmp_path / "server.log").read_text()[-3000:])


def get(url: str, token: str | None) -> tuple[int, dict | None]:
    headers = {"Authorization": f"token {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, None


def test_pool_handler_lists_gateways_for_authenticated_users_only(server):
    base, token, proc = server
    url = base + "remotecuda/pool"
    gw = GatewayProcess("--gpus", "1", "--gpu-name", "Sim T4", discovery=True)
    try:
        def mine() -> dict | None:
            try:
                status, body = get(url, token)
            except OSError:  # not listening yet
                return None
            assert status == 200
            found = [g for g in body["gateways"] if g["address"] == gw.endpoint]
            return found[0] if found else None
        assert wait_for(lambda: proc.poll() is not None or mine() is not None, timeout=60) and proc.poll() is None
        g = mine()
        assert g["gpus"][0]["name"] == "Sim T4" and g["gpus"][0]["simulated"] is True
        assert g["gpus"][0]["total_memory"] > 0 and "utilization" in g["gpus"][0]
        # the load history the sparkline draws: samples of (seconds ago, utilization, memory used)
        assert wait_for(lambda: len(mine()["gpus"][0]["history"]) >= 2, timeout=20)
        t, util, mem = mine()["gpus"][0]["history"][-1]
        assert t <= 0 and 0 <= util <= 1 and 0 <= mem <= 1
        _, body = get(url, token)
        assert body["source"].startswith("multicast") and body["error"] is None and body["history_seconds"] > 0

        # as Jupyter's own API: no token, no pool
        assert get(url, None)[0] == 403
        assert get(url, "wrong-token")[0] == 403
    finally:
        gw.stop()
    assert wait_for(lambda: mine() is None, timeout=20), "a gateway that left stays in the pool"
