"""Layout sweep over PyTorch's OpInfo database: does the metadata the client reports for every
tensor an op makes (forward, and backward where the op supports autograd) match the tensor the
gateway's kernel really made, for inputs laid out in several ways?

For each OpInfo (float32) and its first samples, each tensor argument is laid out as one of
``LAYOUTS`` (contiguous, transposed, channels-last, broadcast, a slice with a storage offset,
contiguous with an offset) — on the device, after the upload, so the gateway holds that layout —
and the op is run locally on the CPU and on 'cuda' (a CPU gateway of its own). Every wrapper the
client makes meanwhile (outputs, views, the backward's intermediates and gradients) is kept
alive and, at the end of the sample, its shape, strides and storage offset are compared with the
gateway's own tensor under the same handle (``rc::live``, the failover snapshot's listing).
Strides of size-1 dimensions and the layout of empty tensors are ignored (nothing reads them).
Values are compared too, outputs and gradients against local ones.

Run: ``PYTHONPATH=. python tests/scripts/layout_sweep.py [op-substring ...]`` (several minutes
for all ops). It prints each disagreement (op that made the tensor, layout, client vs gateway)
and the counts. Where CUDA's layout differs from the CPU's, the meta kernel's (CUDA's) is what
the client reports and the gateway must conform (remotecuda_wire/layouts.py,
remotecuda_server/cuda_kernels.py META_LAYOUT): only client vs gateway is a disagreement.
"""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_opinfo_parity import NONDETERMINISTIC, _call, _cases, _local_only, _map, _op_id, _tensors, _tolerance, op_db  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

import remotecuda  # noqa: E402
from remotecuda import attention, compiled, dispatch, rnn  # noqa: E402
from remotecuda import session as session_mod  # noqa: E402
from remotecuda import tensor as tensor_mod  # noqa: E402

#: samples per op
SAMPLES = 2


def _transposed(x: torch.Tensor) -> torch.Tensor | None:
    if x.dim() >= 2 and x.shape[-1] > 1 < x.shape[-2]:
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    return None


def _channels_last(x: torch.Tensor) -> torch.Tensor | None:
    if x.dim() == 4 and x.shape[1] > 1 and x.shape[2] * x.shape[3] > 1:
        return x.contiguous(memory_format=torch.channels_last)
    if x.dim() == 5 and x.shape[1] > 1 and x.shape[2] * x.shape[3] * x.shape[4] > 1:
        return x.contiguous(memory_format=torch.channels_last_3d)
    return None


def _broadcast(x: torch.Tensor) -> torch.Tensor | None:
    """Other values (the first row repeated), stride 0 along dim 0."""
    return x[:1].expand_as(x) if x.dim() >= 1 and x.shape[0] > 1 else None


def _sliced(x: torch.Tensor) -> torch.Tensor | None:
    """Same values, a slice of a wider tensor: strided, with a storage offset."""
    if x.dim() == 0 or x.numel() == 0:
        return None
    wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 2, dtype=x.dtype, device=x.device)
    wide[..., 1:-1] = x
    return wide[..., 1:-1]


def _offset(x: torch.Tensor) -> torch.Tensor | None:
    """Same values, contiguous, at storage offset 3."""
    if x.numel() == 0:
        return None
    flat = torch.zeros(x.numel() + 3, dtype=x.dtype, device=x.device)
    flat[3:] = x.reshape(-1)
    return flat[3:].view(x.shape)


LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor | None]] = {
    "contiguous": lambda x: None, "transposed": _transposed, "channels_last": _channels_last,
    "broadcast": _broadcast, "sliced": _sliced, "offset": _offset}


def _laid_out(tree: Any, how: Callable, on_cpu: frozenset, first: int = 0) -> tuple[Any, bool]:
    """``tree``'s tensors (but those kept on the CPU) laid out by ``how``; whether any changed."""
    leaves, spec = pytree.tree_flatten(tree)
    changed = False
    out = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and (first + i) not in on_cpu and x.layout == torch.strided:
            with torch.no_grad():
                y = how(x.detach())
            if y is not None:
                changed = True
                x = y.requires_grad_() if x.requires_grad and x.is_leaf else (
                    x + (y - x).detach() if x.requires_grad else y)
        out.append(x)
    return pytree.tree_unflatten(out, spec), changed


class Recorder:
    """Every wrapper the client makes (kept alive until checked) and the op that made each handle."""

    def __init__(self) -> None:
        self.wrappers: list = []
        self.made_by: dict[int, str] = {}
        self.on = False

    def install(self) -> None:
        orig_wrap = tensor_mod.wrap

        def wrap(*a: Any, **k: Any) -> Any:
            t = orig_wrap(*a, **k)
            if self.on:
                self.wrappers.append(t)
            return t
        for mod in (dispatch, attention, compiled, rnn):
            mod.wrap = wrap  # type: ignore[attr-defined]
        orig_enqueue = session_mod.Session.enqueue

        def enqueue(s: Any, name: str, args: list, kwargs: Any, outs: Any) -> None:
            if self.on and outs:
                for h in outs:
                    if isinstance(h, int):
                        self.made_by[h] = name
            return orig_enqueue(s, name, args, kwargs, outs)
        session_mod.Session.enqueue = enqueue  # type: ignore[method-assign]

    def clear(self) -> None:
        self.wrappers.clear()
        self.made_by.clear()


def _norm(shape: Any, stride: Any, offset: int) -> tuple:
    if 0 in shape:
        return (tuple(shape),)
    return tuple(shape), tuple(s for n, s in zip(shape, stride) if n != 1), offset


def _gateway_rows(s: Any) -> dict:
    n = 1 << 16
    base = s.reserve(n)
    live = s.request("rc::live", [base, n])
    for k in range(len(live["storages"])):
        s.release(base + k)
    return {row[0]: row for row in live["handles"]}


def _values_equal(a: Any, b: Any, op: Any) -> bool:
    with _local_only():
        if op.name in NONDETERMINISTIC:
            return _map(lambda t: (t.shape, t.dtype), a) == _map(lambda t: (t.shape, t.dtype), b)
        try:
            torch.testing.assert_close(a, b, equal_nan=True, **_tolerance(op, torch.float32))
            return True
        except Exception:
            return False


def _run(op: Any, case: Any, how: Callable, remote: bool, grad: bool) -> tuple[Any, list] | None:
    """(outputs, gradients) of the sample with its tensors laid out by ``how``; None if no tensor
    takes that layout."""
    inp, args, kwargs = case.arguments(remote)
    (inp, args, kwargs), changed = _laid_out((inp, args, kwargs), how, case.on_cpu)
    if not changed and how is not LAYOUTS["contiguous"]:
        return None
    leaves = [t for t in _tensors((inp, args, kwargs)) if t.requires_grad]
    out = _call(op, case, (inp, args, kwargs))
    grads: list = []
    if grad:
        outs = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
        if outs and leaves:
            torch.manual_seed(1)
            with _local_only():
                gos = [torch.randn(t.shape, dtype=t.dtype) for t in outs]
            gos = [g.to("cuda") if remote and t.is_cuda else g for g, t in zip(gos, outs)]
            gos, _ = _laid_out(gos, how, frozenset())
            grads = [g for g in torch.autograd.grad(outs, leaves, gos, allow_unused=True)]
    return out, grads


def _check_sample(op: Any, case: Any, label: str, how: Callable, rec: Recorder, counts: collections.Counter,
                  report: Callable[[str], None]) -> None:
    """One sample in one layout: run it locally and remotely, compare values and every tensor's
    layout, client vs gateway."""
    grad = bool(op.supports_autograd)
    with _local_only():
        try:
            local = _run(op, case, how, False, grad)
        except Exception:
            try:
                local = _run(op, case, how, False, False)
            except Exception:
                counts["local error"] += 1
                return
    if local is None:
        return
    counts["samples"] += 1
    rec.clear()
    rec.on = True
    try:
        remote = _run(op, case, how, True, bool(local[1]))
        assert remote is not None
        out_cpu = _map(torch.Tensor.cpu, remote[0])
        grads_cpu = [None if g is None else g.cpu() for g in remote[1]]
    except Exception as e:
        counts["remote error"] += 1
        report(f"ERROR {label}: {type(e).__name__}: {str(e)[:200]}")
        _drain()
        return
    finally:
        rec.on = False
    for what, got, want in (("forward", out_cpu, local[0]), ("backward", grads_cpu, local[1])):
        if what == "backward" and not got:
            continue
        if not _values_equal(got, want, op):
            counts["values differ"] += 1
            report(f"VALUES {label}: {what}")
    _check_layouts(rec, label, counts, report)
    rec.clear()


def _check_layouts(rec: Recorder, label: str, counts: collections.Counter, report: Callable[[str], None]) -> None:
    """Every wrapper the sample made, against the gateway's tensor under its handle."""
    wrappers = [t for t in rec.wrappers if not t.__dict__["_s"].closed]
    if not wrappers:
        return
    try:
        rows = _gateway_rows(wrappers[0].__dict__["_s"])
    except Exception as e:
        report(f"LIVE {label}: {type(e).__name__}: {str(e)[:200]}")
        _drain()
        return
    seen = set()
    for t in wrappers:
        h = t.__dict__["_h"]
        row = rows.get(h)
        if row is None or h in seen:
            continue
        seen.add(h)
        counts["tensors"] += 1
        if _norm(t.shape, t.stride(), t.storage_offset()) != _norm(row[3], row[4], row[5]):
            counts["disagreements"] += 1
            report(f"LAYOUT {label}: {rec.made_by.get(h, '?')} client shape {tuple(t.shape)} stride {t.stride()} "
                   f"offset {t.storage_offset()}; gateway shape {tuple(row[3])} stride {tuple(row[4])} "
                   f"offset {row[5]}")


def sweep(ops: list, report: Callable[[str], None]) -> collections.Counter:
    """Every op's first SAMPLES float32 samples in every layout; the counts by outcome."""
    rec = Recorder()
    rec.install()
    counts: collections.Counter = collections.Counter()
    for op in ops:
        try:
            cases = _cases(op, torch.float32, empty=False, n=SAMPLES, requires_grad=bool(op.supports_autograd))
        except Exception:
            continue
        for ci, case in enumerate(cases):
            for lname, how in LAYOUTS.items():
                _check_sample(op, case, f"{_op_id(op)} [{ci}] {lname}", how, rec, counts, report)
    return counts


def _drain() -> None:
    try:
        torch.cuda.synchronize()
    except Exception:
        pass


def main() -> None:
    wanted = sys.argv[1:]
    ops = [op for op in op_db if op.supports_dtype(torch.float32, "cpu")
           and (not wanted or any(w in _op_id(op) for w in wanted))]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    gw = subprocess.Popen([sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
                           "--no-discovery", "--quiet"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                          text=True, cwd=root)
    try:
        line = gw.stdout.readline()  # type: ignore[union-attr]
        remotecuda.activate(line.split()[1].replace("tcp://", ""), fallback="error")
        t0 = time.time()
        counts = sweep(ops, lambda m: print(m, flush=True))
        print(f"{len(ops)} ops in {time.time() - t0:.0f} s:", dict(counts), flush=True)
        remotecuda.deactivate()
    finally:
        gw.terminate()
        gw.wait(timeout=20)


if __name__ == "__main__":
    main()
