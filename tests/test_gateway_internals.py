"""The gateway's internal protocol: its named parts, and docs/PROTOCOL.md kept in step with them.

No gateway process: these check the registries and run the executor directly on the CPU."""
from __future__ import annotations

import os
import re

import pytest
import torch

from remotecuda_server import internal
from remotecuda_server.executor import INTERNAL_OPS, Executor, Upload
from remotecuda_wire import protocol
from remotecuda_wire.protocol import ProtocolError

from conftest import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "docs", "PROTOCOL.md"), encoding="utf-8") as f:
    DOC = f.read()


def _section(start: str) -> str:
    """The doc's text from ``start`` to the next heading."""
    at = DOC.index(start)
    end = DOC.find("\n#", at)
    return DOC[at:] if end < 0 else DOC[at:end]


def _documented_internal_ops() -> set[str]:
    table = _section("Internal ops (`rc::`")
    names: set[str] = set()
    for row in re.findall(r"^\|([^|\n]*)\|", table, re.M):
        names.update(re.findall(r"`(rc::\w+)`", row))
    return names


def test_internal_op_table_matches_registry():
    documented = _documented_internal_ops()
    assert documented, "docs/PROTOCOL.md has no table of rc:: ops"
    assert sorted(set(INTERNAL_OPS) - documented) == [], "served, not in docs/PROTOCOL.md's table"
    assert sorted(documented - set(INTERNAL_OPS)) == [], "in docs/PROTOCOL.md's table, not served"


def test_each_internal_op_states_its_arguments():
    for name, op in INTERNAL_OPS.items():
        assert re.fullmatch(r"\[.*\]( or \[.*\])?", op.args), (name, op.args)
        assert callable(op.method), name


def test_protocol_version_in_doc_matches_code():
    stated = re.search(r"Protocol version: \*\*(\d+)\*\*", DOC)
    assert stated and int(stated.group(1)) == protocol.VERSION
    header_row = re.search(r"^\| 4 \| 1 \| u8 \| version \| `(\d+)`", DOC, re.M)
    assert header_row and int(header_row.group(1)) == protocol.VERSION
    welcome = re.search(r'"protocol": (\d+),', DOC)
    assert welcome and int(welcome.group(1)) == protocol.VERSION


def test_internal_message_kinds_are_distinct_and_documented():
    kinds = {k: v for k, v in vars(internal).items() if k.isupper() and isinstance(v, bytes)}
    assert len(set(kinds.values())) == len(kinds)
    assert all(v == k.encode() for k, v in kinds.items())  # what a packet capture shows is the name
    doc = _section("## Gateway internals")
    assert [k for k in kinds if f"`{k}" not in doc] == []


def _upload(t: torch.Tensor) -> Upload:
    buf = protocol.tensor_bytes(t)
    return Upload(t, None, [protocol.encode_payload(buf)[0][2]], [buf])


def test_executor_serves_internal_ops_from_prepared_uploads():
    ex = Executor(torch.device("cpu"))
    x = torch.arange(6, dtype=torch.float32)
    ops = [["rc::upload", [1, 0, torch.float32, [6], None], None, None],
           ["aten::mul.Tensor", [protocol.Handle(1), protocol.Handle(1)], None, [2]],
           ["rc::fetch_many", [1, 2], None, {"base": None}]]
    result, err, payloads = ex.run({"ops": ops, "n0": 0, "req": 1}, prepared={1: _upload(x)})
    assert err is None and [r["pl"] for r in result] == [0, 1]
    got = [torch.frombuffer(bytearray(protocol.decode_payload(*p)), dtype=torch.float32) for p in payloads]
    assert torch.equal(got[0], x) and torch.equal(got[1], x * x)
    assert ex.stats["uploads"] == 1 and ex.stats["downloads"] == 2


def test_executor_sets_deterministic_algorithms_without_loading_inductor():
    """``torch.use_deterministic_algorithms`` imports inductor and Dynamo (seconds, holding the
    session's ops); the gateway sets torch's flag itself."""
    r = run_python(
        "import sys, torch\n"
        "from remotecuda_server.executor import Executor\n"
        "ex = Executor(torch.device('cpu'))\n"
        "ops = [['rc::set_flags', [{'deterministic_algorithms': [True, True]}], None, None]]\n"
        "assert ex.run({'ops': ops, 'n0': 0, 'req': 1})[1] is None\n"
        "assert torch.are_deterministic_algorithms_enabled()\n"
        "assert torch.is_deterministic_algorithms_warn_only_enabled()\n"
        "print('torch._inductor' in sys.modules, 'torch._dynamo' in sys.modules)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_executor_sets_the_fp32_precision_a_client_set():
    """(The newer TF32 API's flags: remotecuda/flags.py; applied here in this process, then undone.)"""
    ex = Executor(torch.device("cpu"))
    try:
        _, err, _ = ex.run({"ops": [["rc::set_flags", [{"fp32_precision.generic.all": "tf32",
                                                         "fp32_precision.cuda.matmul": "ieee"}], None, None]],
                            "n0": 0, "req": 1})
        assert err is None
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("ieee", "tf32")
    finally:
        torch.backends.fp32_precision = "none"
        torch.backends.cuda.matmul.fp32_precision = "none"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
        torch.backends.cudnn.rnn.fp32_precision = "tf32"
    bad = ["rc::set_flags", [{"fp32_precision.cpu.all": "tf32"}], None, None]
    _, err, _ = ex.run({"ops": [bad], "n0": 1, "req": 2})
    assert err["type"] == "UnknownOpError" and "fp32_precision.cpu.all" in err["msg"]


def test_an_upload_whose_parts_failed_is_the_error_of_the_op_that_uses_it():
    """Parts past the session's quota fail the upload; landed at the next message's start, it
    was the whole message's error (the worker's "malformed OPS message"), by the timing of the
    parts; it is the first op using the tensor's, an OutOfMemoryError, whenever they came."""
    ex = Executor(torch.device("cpu"))
    _, err, _ = ex.run({"ops": [["rc::upload", [1, None, torch.float32, [4], None, 0], None, None]], "n0": 0})
    assert err is None
    ex.parts.fail(1, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16 bytes."))
    ops = [["aten::ones", [[2]], {"device": torch.device("cpu")}, [2]],
           ["aten::mul.Tensor", [protocol.Handle(1), protocol.Handle(1)], None, [3]]]
    _, err, _ = ex.run({"ops": ops, "n0": 1, "req": 1})
    assert (err["type"], err["index"]) == ("OutOfMemoryError", 2), err
    assert "Tried to allocate 16 bytes" in err["msg"]


def test_executor_reports_unknown_internal_op_and_missing_upload():
    ex = Executor(torch.device("cpu"))
    _, err, _ = ex.run({"ops": [["rc::no_such_op", [], None, [1]]], "n0": 0, "req": 1})
    assert err["type"] == "UnknownOpError" and err["msg"] == "unknown internal op rc::no_such_op"
    with pytest.raises(ProtocolError, match="upload of tensor 1: its bytes are missing"):
        ex.run({"ops": [["rc::upload", [1, 0, torch.float32, [1], None], None, None]], "n0": 1})


def test_gateway_depends_on_the_wire_not_the_client():
    """The gateway's modules import ``remotecuda_wire`` and torch, never the client package."""
    import subprocess
    import sys
    code = ("import sys, remotecuda_server.gateway, remotecuda_server.worker, remotecuda_server.executor; "
            "print(sorted(m for m in sys.modules if m == 'remotecuda' or m.startswith('remotecuda.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_snapshot_keeps_lazy_conjugate_and_negative_bits():
    """A failover snapshot restores each tensor as a view of its storage's bytes: a lazy
    conjugate's or negative's bit, which gives those bytes their meaning, is kept with it."""
    ex = Executor(torch.device("cpu"))
    z = torch.tensor([1 + 2j, 3 - 1j])
    ops = [["rc::upload", [1, 0, torch.complex64, [2], None], None, None],
           ["aten::_conj.default", [protocol.Handle(1)], None, [2]],
           ["aten::_neg_view.default", [protocol.Handle(1)], None, [3]],
           ["rc::live", [100, 10], None, {"base": None}]]
    live, err, _ = ex.run({"ops": ops, "n0": 0, "req": 1}, prepared={1: _upload(z)})
    assert err is None
    assert [len(row) for row in live["handles"]] == [6, 7, 7]  # (a plain row as a client before the bits reads it)
    restore = [["rc::restore_view", [100, *row[2:]], None, [10 + row[0]]] for row in live["handles"]]
    _, err, _ = ex.run({"ops": restore, "n0": 4})
    assert err is None
    assert [(ex.handles[h].is_conj(), ex.handles[h].is_neg()) for h in (11, 12, 13)] == \
        [(False, False), (True, False), (False, True)]
    assert torch.equal(ex.handles[12].resolve_conj(), z.conj().resolve_conj())
