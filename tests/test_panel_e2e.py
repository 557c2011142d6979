"""End to end: the JupyterLab "GPU pool" panel in headless Chromium, against JupyterLab on
127.0.0.1, two simulated gateways announcing themselves on a private multicast group, and a
notebook on the "Python (RemoteCUDA)" kernel. The browser steps are in
labextension/e2e/panel.e2e.mjs (playwright-core driving Debian's chromium); screenshots go to
tests/_artifacts/panel/. Needs the package installed (pip install -e . builds the extension),
node, and labextension/node_modules (npm ci): scripts/test.sh provides them."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid

import pytest

from conftest import ROOT, private_discovery, stop_group, wait_for

CHROMIUM = os.environ.get("REMOTECUDA_CHROMIUM", "/usr/bin/chromium")
LABEXT = os.path.join(ROOT, "labextension")
ARTIFACTS = os.path.join(ROOT, "tests", "_artifacts", "panel")

TRAIN = """import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 8).cuda(), torch.randn(64, 1).cuda()
for step in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
print(f"loss {loss.item():.4f}")"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notebook(path: str, cells: list[str], kernel: str, display_name: str) -> None:
    nb = {"nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"name": kernel, "display_name": display_name, "language": "python"}},
          "cells": [{"cell_type": "code", "id": uuid.uuid4().hex[:8], "metadata": {}, "execution_count": None,
                     "outputs": [], "source": src} for src in cells]}
    with open(path, "w") as f:
        json.dump(nb, f)


class Gateway:
    """A simulated one-GPU gateway in its own process group, so that killing the group is a crash."""

    def __init__(self, name: str, env: dict):
        cmd = [sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--gpus", "1", "--gpu-name", name,
               "--port", "0", "--quiet"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=ROOT,
                                     env=env, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"gateway did not start: {line!r}")
        self.address = line.split()[1].replace("tcp://", "")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=20)


@pytest.fixture
def chromium() -> str:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium; scripts/test.sh installs it)")
    if shutil.which("node") is None:
        pytest.fail("node is needed to drive the browser (scripts/test.sh's environment has it)")
    if not os.path.isdir(os.path.join(LABEXT, "node_modules", "playwright-core")):
        pytest.fail("labextension/node_modules is missing: run `npm ci` in labextension/ (scripts/test.sh does)")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_core.paths import jupyter_path
    if not any(os.path.isfile(os.path.join(d, "remotecuda-labextension", "package.json"))
               for d in jupyter_path("labextensions")) or "remotecuda" not in KernelSpecManager().find_kernel_specs():
        pytest.fail("the JupyterLab extension or the kernelspec is not installed: run `pip install -e .` "
                    "(it builds labextension/; scripts/test.sh does)")
    return CHROMIUM


def test_panel_end_to_end(chromium, tmp_path):
    env = dict(os.environ, REMOTECUDA_DISCOVERY=private_discovery(), REMOTECUDA_DISCOVERY_IFACE="127.0.0.1",
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    env.pop("REMOTECUDA_SERVERS", None)
    env.pop("REMOTECUDA_DEVICES", None)
    root = tmp_path / "notebooks"
    root.mkdir()
    _notebook(str(root / "panel.ipynb"), [TRAIN, "%remotecuda strategy", "import time\ntime.sleep(10)"],
              "remotecuda", "Python (RemoteCUDA)")
    _notebook(str(root / "plain.ipynb"), ["1 + 1"], "python3", "Python 3 (ipykernel)")
    # no "Jupyter news?" prompt over the panel in the screenshots
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    gateways = [Gateway("Sim A100", env), Gateway("Sim H100", env)]
    port, token = _free_port(), uuid.uuid4().hex
    url = f"http://127.0.0.1:{port}/"
    with open(tmp_path / "jupyterlab.log", "w") as log:  # the child keeps its own copy of the descriptor
        lab = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
                                f"--port={port}",
                                f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
                                "--LabApp.news_url=",
                                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                               env=env, cwd=str(root), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        def pool() -> dict | None:
            try:
                req = urllib.request.Request(url + "remotecuda/pool", headers={"Authorization": f"token {token}"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    return json.load(r)
            except OSError:
                return None
        assert wait_for(lambda: lab.poll() is not None or ((p := pool()) is not None and len(p["gateways"]) == 2),
                        timeout=90) and lab.poll() is None, \
            f"JupyterLab's /remotecuda/pool did not list both gateways: {pool()}"
        shutil.rmtree(ARTIFACTS, ignore_errors=True)
        run = subprocess.run(
            ["node", os.path.join(LABEXT, "e2e", "panel.e2e.mjs")], cwd=LABEXT, capture_output=True, text=True,
            timeout=420, env=dict(env, CHROMIUM=chromium, LAB_URL=url, TOKEN=token, NOTEBOOK="panel.ipynb",
                                  PLAIN_NOTEBOOK="plain.ipynb",
                                  ARTIFACTS=ARTIFACTS, GATEWAYS=",".join(g.address for g in gateways),
                                  KILL_PID=str(-gateways[1].proc.pid), KILL_ADDRESS=gateways[1].address))
        print(run.stdout, run.stderr)
        assert run.returncode == 0, f"browser steps failed (screenshots in {ARTIFACTS}):\n{run.stdout}\n{run.stderr}"
        for name in ("1-pool-before-training", "2-after-training", "3-while-sleeping", "4-one-gateway-left",
                     "5-plain-kernel", "6-plain-kernel-loaded"):
            assert os.path.getsize(os.path.join(ARTIFACTS, f"{name}.png")) > 0
        traces = [f for f in os.listdir(ARTIFACTS) if f.endswith(".trace.json")]  # the trace link's download
        assert len(traces) == 1, traces
        with open(os.path.join(ARTIFACTS, traces[0])) as f:
            assert any(e["ph"] == "X" and e["cat"] == "ops" for e in json.load(f)["traceEvents"])
    finally:
        stop_group(lab)
        for g in gateways:
            g.stop()
        with open(tmp_path / "jupyterlab.log") as f:
            print("--- jupyterlab log (tail)\n" + "".join(f.readlines()[-40:]))
