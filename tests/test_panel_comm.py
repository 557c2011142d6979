"""The kernel side of the "GPU pool" panel (docs/JUPYTER.md, "The comm channel"), without a
browser: a real RemoteCUDA kernel (jupyter_client) and a real gateway. While a cell runs, the
kernel pushes its progress from a background thread, and a strategy request sent on a kernel
subshell (as the panel sends it) is applied and answered before the cell ends."""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import time
import uuid

import pytest

from conftest import ROOT, GatewayProcess

jupyter_client = pytest.importorskip("jupyter_client")
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402


@pytest.fixture
def kernel(tmp_path):
    gw = GatewayProcess()
    r = subprocess.run([sys.executable, "-m", "remotecuda_kernel", "install", "--prefix", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, REMOTECUDA_SERVERS=gw.address, REMOTECUDA_FALLBACK="error")
    km = KernelManager(kernel_name="remotecuda", kernel_spec_manager=KernelSpecManager(
        kernel_dirs=[str(tmp_path / "share" / "jupyter" / "kernels")]))
    km.start_kernel(env=env, cwd=ROOT)
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    try:
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
        gw.stop()


def _until(kc, pred, timeout: float) -> list[dict]:
    """IOPub messages until ``pred(msg)`` holds for one (that one included)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(msg)
        if pred(msg):
            return seen
    raise AssertionError(f"not seen within {timeout} s; got {[m['msg_type'] for m in seen]}")


def _comm_data(msgs: list[dict], type_: str) -> list[dict]:
    return [m["content"]["data"] for m in msgs
            if m["msg_type"] == "comm_msg" and m["content"]["data"].get("type") == type_]


def test_pushes_while_a_cell_runs_and_requests_on_a_subshell(kernel):
    kc = kernel
    kc.control_channel.send(kc.session.msg("create_subshell_request", {}))
    subshell = kc.control_channel.get_msg(timeout=20)["content"]["subshell_id"]

    comm_id = uuid.uuid4().hex
    opened = kc.session.msg("comm_open", {"comm_id": comm_id, "target_name": "remotecuda", "data": {}})
    kc.shell_channel.send(opened)  # on the main shell: the kernel activates there
    msgs = _until(kc, lambda m: m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                  and m["parent_header"].get("msg_id") == opened["header"]["msg_id"], 120)
    first = _comm_data(msgs, "status")[0]
    assert first["active"] and first["strategy"] == "adaptive"

    cell = kc.execute("import torch, time\nx = torch.ones(4, device='cuda') * 2\nprint(x.sum().item())\ntime.sleep(6)")
    # pushed while the cell sleeps: its clock and the ops it issued before
    running = _until(kc, lambda m: any((d.get("running") or {}).get("ops", 0) > 0
                                       for d in _comm_data([m], "live")), 60)
    running += _until(kc, lambda m: any((d.get("running") or {}).get("seconds", 0) >= 2
                                        for d in _comm_data([m], "live")), 60)
    live = [d for d in _comm_data(running, "live") if d["running"]]
    assert [d["seq"] for d in live] == sorted(d["seq"] for d in live)

    request = kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {"request": "strategy",
                                                                      "name": "memory-aware"}})
    request["header"]["subshell_id"] = subshell
    kc.shell_channel.send(request)
    answered = _until(kc, lambda m: any(d["strategy"] == "memory-aware" for d in _comm_data([m], "status"))
                      or (m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                          and m["parent_header"].get("msg_id") == cell), 30)
    assert _comm_data(answered[-1:], "status"), "the strategy request waited for the running cell"

    after = _until(kc, lambda m: bool(_comm_data([m], "cell")), 30)
    assert _comm_data(after, "cell")[-1]["status"] == "ok"

    bad = kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {"request": "strategy", "name": "fastest"}})
    kc.shell_channel.send(bad)
    errs = _until(kc, lambda m: bool(_comm_data([m], "error")), 30)
    assert "fastest" in _comm_data(errs, "error")[0]["error"]


def test_tracing_turned_on_and_the_last_cells_trace_returned(kernel):
    kc = kernel
    comm_id = uuid.uuid4().hex

    def request(data: dict) -> dict:
        msg = kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        kc.shell_channel.send(msg)
        return msg

    kc.shell_channel.send(kc.session.msg("comm_open", {"comm_id": comm_id, "target_name": "remotecuda", "data": {}}))
    first = _comm_data(_until(kc, lambda m: bool(_comm_data([m], "status")), 120), "status")[0]
    assert first["tracing"] is False and first["failovers"] == []

    request({"request": "last_trace"})  # nothing traced yet: said, not raised
    assert "no cell traced" in _comm_data(_until(kc, lambda m: bool(_comm_data([m], "error")), 30), "error")[0]["error"]

    request({"request": "trace", "on": True})
    _until(kc, lambda m: any(d["tracing"] for d in _comm_data([m], "status")), 30)

    kc.execute("import torch\ny = (torch.arange(8., device='cuda') + 1).relu()\nprint(y.sum().item())")
    cell = _comm_data(_until(kc, lambda m: bool(_comm_data([m], "cell")), 60), "cell")[-1]
    assert cell["status"] == "ok" and cell["traced"] is True

    request({"request": "last_trace"})
    got = _comm_data(_until(kc, lambda m: bool(_comm_data([m], "trace")), 60), "trace")[0]
    assert got["execution_count"] == cell["execution_count"] and got["bytes"] > 0
    events = got["trace"]["traceEvents"]
    ops = [e for e in events if e["ph"] == "X" and e["cat"] == "ops"]
    assert ops and all(isinstance(e["ts"], float | int) and e["dur"] >= 0 for e in ops)
    assert any("add" in e["name"] for e in ops)

    request({"request": "trace", "on": False})
    _until(kc, lambda m: any(d["tracing"] is False for d in _comm_data([m], "status")), 30)
    kc.execute("z = y * 2")
    assert _comm_data(_until(kc, lambda m: bool(_comm_data([m], "cell")), 60), "cell")[-1]["traced"] is False
