"""Traces (remotecuda/trace.py) of real training steps on a real gateway, and the progress bar of long
transfers (remotecuda/progress.py): the trace-event file's shape, one client and one gateway event
per op with the gateway's span inside the client's, transfers and waits with their causes; the
``remotecuda run --trace`` and ``%remotecuda trace`` ways in; a bar for a slow upload and none for a
small one."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

import remotecuda

from conftest import ROOT, run_python

#: a training step: a small MLP's forward, backward and optimizer step, its loss read
STEP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, y = torch.randn(8, 16).cuda(), torch.randint(0, 4, (8,)).cuda()
for _ in range(2):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
print("loss", loss.item())
"""


def check_trace(data: dict, ops: int | None = None) -> dict[str, list[dict]]:
    """Check a trace-event object; its complete events by category."""
    assert set(data) >= {"traceEvents"} and isinstance(data["traceEvents"], list)
    by_cat: dict[str, list[dict]] = {}
    for e in data["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
            continue
        assert isinstance(e["name"], str) and e["ts"] >= 0 and e["dur"] >= 0, e
        by_cat.setdefault(e["cat"], []).append(e)
    client, gateway = by_cat["ops"], by_cat["gateway"]
    key = lambda e: (e["args"]["device"], e["args"]["op_index"])  # noqa: E731
    assert len({key(e) for e in client}) == len(client)  # one event per op
    assert sorted(map(key, client)) == sorted(map(key, gateway))  # each op ran on the gateway once
    if ops is not None:
        assert len(client) == ops
    bound = max(c["error_bound_us"] for c in data["otherData"]["clocks"].values())
    slack = 2 * bound + 2  # the offset's error is at most half a round trip; +2: the µs rounding
    ran = {key(e): e for e in gateway}
    for c in client:
        g = ran[key(c)]
        assert g["name"] == c["name"]
        assert c["ts"] - slack <= g["ts"] and g["ts"] + g["dur"] <= c["ts"] + c["dur"] + slack, (c, g, slack)
    return by_cat


def test_training_step_trace(remote, tmp_path):
    torch.cuda.synchronize()
    ops0 = remotecuda.stats()["ops"]
    tracer = remotecuda.trace.start()
    scope: dict = {}
    exec(compile(STEP, "train_step.py", "exec"), scope)
    big = torch.randn(512, 1024)  # 2 MiB: an upload and a download in parts
    back = big.cuda().mul(2).cpu()
    assert torch.equal(back, big * 2)
    path = remotecuda.trace.save(str(tmp_path / "step.json"))
    ops = remotecuda.stats()["ops"] - ops0
    remotecuda.trace.stop()
    stopped = len(tracer.export()["traceEvents"])
    assert not tracer.recording and remotecuda.runtime.current().session().trace is None
    with open(path) as f:
        data = json.load(f)
    by_cat = check_trace(data, ops=ops)
    names = [e["name"] for e in by_cat["ops"]]
    for op in ("aten::addmm.default", "aten::relu.default", "aten::threshold_backward.default", "rc::upload"):
        assert op in names, op
    uploads = [e for e in by_cat["transfers"] if e["name"] == "upload"]
    downloads = [e for e in by_cat["transfers"] if e["name"] == "download"]
    assert any(e["args"]["bytes"] == big.nbytes and e["args"].get("parts", 0) >= 1 for e in uploads), uploads
    assert any(e["args"]["bytes"] == big.nbytes for e in downloads), downloads
    assert {e["name"] for e in by_cat["messages"]} >= {"OPS", "PART"}
    assert all(e["args"]["bytes"] > 0 for e in by_cat["messages"])
    waits = by_cat["waits"]
    item = next(e for e in waits if "item()" in e["args"]["cause"])
    assert item["args"]["caller"].startswith("train_step.py:13"), item
    cpu = next(e for e in waits if e["name"] == "wait: rc::fetch")
    assert "value read" in cpu["args"]["cause"] and __file__ in cpu["args"]["caller"], cpu
    syncs = [e["args"]["caller"] for e in waits if e["name"] == "wait: rc::sync"]
    # (the first backward pass and an optimizer's first step wait: interception.py)
    assert syncs[0].startswith(("train_step.py:11", "train_step.py:12")), syncs
    assert any("remotecuda.trace.save" in c for c in syncs), syncs
    # after stop: nothing more is recorded, and nothing asks the gateway for spans
    torch.ones(3, device="cuda").add(1).cpu()
    assert len(tracer.export()["traceEvents"]) == stopped


def test_run_trace_end_to_end(gateway, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(STEP)
    out = tmp_path / "run.json"
    r = run_python("", args=["-m", "remotecuda", "run", "--server", gateway.address, "--trace", str(out),
                             "python", str(script)])
    assert r.returncode == 0, r.stderr
    assert "loss" in r.stdout and f"trace written to {out}" in r.stderr
    with open(out) as f:
        by_cat = check_trace(json.load(f))
    assert any("item()" in e["args"]["cause"] and e["args"]["caller"].startswith(f"{script}:13")
               for e in by_cat["waits"])


def test_run_trace_to_a_place_it_cannot_write_is_refused_before_the_program_runs(tmp_path):
    """(It ran the program, then said it could not write the trace, and exited 0.)"""
    for place in (tmp_path / "no" / "such" / "t.json", tmp_path):
        r = run_python("", args=["-m", "remotecuda", "run", "--trace", str(place), "python", "-c", "print('ran')"])
        assert (r.returncode, r.stdout) == (2, ""), r.stderr
        assert r.stderr == f"remotecuda run: --trace {place}: cannot write there (no such directory, or not writable)\n"


def test_trace_magic(gateway, tmp_path):
    code = textwrap.dedent(f"""
        import json
        from IPython.core.interactiveshell import InteractiveShell
        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "remotecuda")
        ip.run_line_magic("remotecuda", "trace on")
        assert ip.run_cell({STEP!r}).success
        assert ip.run_cell("z = (x * 3).sum()").success  # its remote work is waited for at the cell's end
        ip.run_line_magic("remotecuda", "trace last {tmp_path}/last.json")
        ip.run_line_magic("remotecuda", "trace off")
        ip.run_line_magic("remotecuda", "trace save {tmp_path}/all.json")
        ip.run_line_magic("remotecuda", "trace")
        import remotecuda
        print("CELLS", len(remotecuda.trace.current().cells), len(remotecuda.trace.last_cell()["traceEvents"]))
    """)
    r = run_python(code, env={"REMOTECUDA_SERVERS": gateway.address})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tracing;" in r.stdout and f"trace written to {tmp_path}/last.json" in r.stdout
    assert "trace: off" in r.stdout and "CELLS 2" in r.stdout, r.stdout
    with open(tmp_path / "all.json") as f:
        whole = check_trace(json.load(f))
    with open(tmp_path / "last.json") as f:
        last = check_trace(json.load(f))
    assert {"aten::mul.Tensor", "aten::sum.default"} <= {e["name"] for e in last["ops"]}
    assert "aten::addmm.default" not in {e["name"] for e in last["ops"]}  # the first cell's
    assert len(last["ops"]) < len(whole["ops"])
    assert any("end of a cell" in e["args"]["cause"] for e in last["waits"])


PROGRESS = """
import os, sys, torch, remotecuda
sys.path.insert(0, os.path.join(sys.argv[2], "benchmarks"))
from delay_proxy import DelayProxy
def mark(text):
    print(text, file=sys.stderr, flush=True)
with DelayProxy(target_port=int(sys.argv[1]), rate=48e6 / 8) as proxy:
    remotecuda.activate(f"127.0.0.1:{proxy.port}", fallback="error")
    big = torch.randn(8 << 20)  # 32 MiB, uploaded in parts
    x = big.cuda()
    mark("SLOW UPLOAD DONE")
    assert torch.equal(torch.ones(1000).cuda().cpu(), torch.ones(1000))
    mark("SMALL DONE")
    proxy.rate = None
    os.environ["REMOTECUDA_PROGRESS"] = "0"  # a bar at once: for a download in parts (over 32 MiB)
    y = torch.cat([x, x[:1 << 18]]).cpu()  # 33 MiB
    mark("DOWNLOAD DONE")
    assert torch.equal(y[:big.numel()], big)
    os.environ["REMOTECUDA_PROGRESS"] = "off"
    big.add(1).cuda()
    remotecuda.synchronize()
    mark("END")
"""


def test_progress_of_long_transfers(gateway):
    """Through a link of 48 Mbit/s (benchmarks/delay_proxy.py) a 32 MiB upload takes well over the
    2 s after which a bar shows (the buffers on the way hold ~14 MiB at most): its bar is on stderr,
    and gone when done. A small transfer shows none. With ``REMOTECUDA_PROGRESS=0`` a download in
    parts shows its bar at once; with ``off`` nothing shows."""
    r = run_python("", args=["-c", PROGRESS, gateway.address.rsplit(":", 1)[1], ROOT],
                   env={"REMOTECUDA_PROGRESS": "", "REMOTECUDA_DIRECT": "0"})  # (every connection through the proxy)
    assert r.returncode == 0, r.stderr
    upload, small, download, off = r.stderr.split("DONE", 3)
    assert "remotecuda upload" in upload and "32.0M" in upload, upload
    assert "remotecuda" not in small, small
    assert "remotecuda download" in download and "33.0M" in download, download
    assert "remotecuda" not in off, off


@pytest.fixture(autouse=True)
def _no_trace_left():
    yield
    rt = remotecuda.runtime.active()
    if rt is not None and rt.tracer is not None:
        remotecuda.trace.stop()
        rt.tracer = None
