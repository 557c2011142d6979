"""Parity with PyTorch's own OpInfo database: every op, run on 'cuda' through a gateway,
must give what local PyTorch gives on the CPU.

For each OpInfo (``torch.testing._internal.common_methods_invocations.op_db``) the first few
float32 sample inputs are run twice: locally on the CPU with remotecuda's modes popped (the
reference), and on 'cuda' through the session's gateway (every tensor of input/args/kwargs
moved with ``.to('cuda')``, outputs brought back with ``.cpu()``). Results are compared as
PyTorch's ``test_compare_cpu`` does, with ``output_process_fn_grad`` applied, and with
``assert_close`` tolerances (its float32 defaults, widened by any ``toleranceOverride`` the
OpInfo declares for float32). Random ops and ops whose output is uninitialised memory are
left out. Only samples that run locally count.

Every failure (op, sample index, what went wrong) is written to
``tests/_artifacts/opinfo_failures.txt``; the test asserts a pass rate of at least
``MIN_PASS_RATE``. ``REMOTECUDA_OPINFO_SAMPLES`` (default 3) bounds the samples per op and
``REMOTECUDA_OPINFO_OPS`` (comma-separated substrings) narrows the ops, for debugging.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import time
import traceback
import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree

ARTIFACTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_artifacts")
FAILURES_FILE = os.path.join(ARTIFACTS, "opinfo_failures.txt")
PROGRESS_FILE = os.path.join(ARTIFACTS, "opinfo_progress.txt")  # the sample in flight, for crashes
SAMPLES_PER_OP = int(os.environ.get("REMOTECUDA_OPINFO_SAMPLES", "3"))
MIN_PASS_RATE = 0.90
DTYPE = torch.float32

#: random ops (their values depend on generator state, which CUDA and the CPU do not share)
#: and ops whose output is uninitialised memory
NONDETERMINISTIC = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal",
    "uniform", "randn", "randn_like", "rand_like", "randint", "randint_like",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "nn.functional.rrelu",
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
}


def _op_id(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _ops() -> list:
    from torch.testing._internal.common_methods_invocations import op_db
    only = [s for s in os.environ.get("REMOTECUDA_OPINFO_OPS", "").split(",") if s]
    out = []
    for op in op_db:
        if op.name in NONDETERMINISTIC:
            continue
        if only and not any(s in _op_id(op) for s in only):
            continue
        if not op.supports_dtype(DTYPE, "cpu"):
            continue
        out.append(op)
    return out


def _tolerance(op: Any) -> dict:
    """assert_close's float32 defaults, widened by the OpInfo's own float32 toleranceOverrides."""
    from torch.testing._internal.common_device_type import toleranceOverride
    atol, rtol = 1e-5, 1.3e-6
    for d in op.decorators:
        decorators = getattr(d, "decorators", None)
        if not decorators or not d.active_if:
            continue
        if d.device_type not in (None, "cpu", "cuda"):
            continue
        if d.dtypes is not None and DTYPE not in d.dtypes:
            continue
        for dec in decorators:
            if isinstance(dec, toleranceOverride) and DTYPE in dec.d:
                atol, rtol = max(atol, dec.d[DTYPE].atol), max(rtol, dec.d[DTYPE].rtol)
    return {"atol": atol, "rtol": rtol}


@contextlib.contextmanager
def _local_only():
    """Pop remotecuda's torch-function and dispatch modes: plain local PyTorch inside."""
    from torch.utils._python_dispatch import _disable_current_modes
    fmodes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        with _disable_current_modes():
            yield
    finally:
        for m in reversed(fmodes):
            torch._C._push_on_torch_function_stack(m)


def _clone(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _to_cuda(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.to("cuda") if isinstance(x, torch.Tensor) else x, tree)


def _cuda_kwargs(kwargs: dict) -> dict:
    kw = _to_cuda(kwargs)
    d = kw.get("device")
    if d is not None and torch.device(d).type == "cpu":  # factories: build on the remote device
        kw["device"] = "cuda"
    return kw


def _not_on_cuda(tree: Any) -> list:
    """Paths of tensor outputs that did not stay on 'cuda' (a plain tensor leaking out)."""
    leaves, _ = pytree.tree_flatten(tree)
    return [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.device.type != "cuda"]


def _asks_for_cpu(sample: Any) -> bool:
    """The sample names the CPU as a target device (``x.to('cpu', ...)``): its output belongs there."""
    leaves = pytree.tree_leaves((sample.args, sample.kwargs))
    return any((isinstance(x, torch.device) and x.type == "cpu") or x == "cpu"
               for x in leaves if isinstance(x, (torch.device, str)))


def _to_cpu(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, tree)


def _summary(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    if isinstance(e, AssertionError) and len(msg) > 1:  # assert_close: keep the numbers
        first = " | ".join(line.strip() for line in msg[:6] if line.strip())
    return f"{type(e).__name__}: {first[:400]}"


def _samples(op: Any) -> list:
    torch.random.default_generator.manual_seed(0)
    gen = op.sample_inputs("cpu", DTYPE, requires_grad=False)
    return list(itertools.islice(gen, SAMPLES_PER_OP))


def _sync_quietly() -> None:
    try:
        torch.cuda.synchronize()
    except Exception:
        pass


def test_opinfo_parity(remote):
    os.makedirs(ARTIFACTS, exist_ok=True)
    ops = _ops()
    failures: list[str] = []
    passed = ran_locally = 0
    timings: list[tuple[float, str]] = []
    t_start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in ops:
            name = _op_id(op)
            t_op = time.monotonic()
            try:
                with _local_only():
                    samples = _samples(op)
            except Exception:
                continue
            tol = _tolerance(op)
            for i, sample in enumerate(samples):
                # reference, on clones (the remote run below gets the sample's own tensors)
                try:
                    with _local_only():
                        ref_sample = (_clone(sample.input), _clone(sample.args), _clone(sample.kwargs))
                        expected = op(ref_sample[0], *ref_sample[1], **ref_sample[2])
                        expected = sample.output_process_fn_grad(expected)
                        expected = _clone(expected)  # detach from inputs an op may return as-is
                except Exception:
                    continue
                ran_locally += 1
                with open(PROGRESS_FILE, "w") as f:
                    f.write(f"{name}\tsample {i}\n")
                stage = "upload"
                try:
                    inp, args, kwargs = _to_cuda(sample.input), _to_cuda(sample.args), _cuda_kwargs(sample.kwargs)
                    stage = "run"
                    out = op(inp, *args, **kwargs)
                    stage = "process"
                    out = sample.output_process_fn_grad(out)
                    stage = "device"
                    leaked = [] if _asks_for_cpu(sample) else _not_on_cuda(out)
                    stage = "fetch"
                    actual = _to_cpu(out)
                    stage = "compare"
                    with _local_only():
                        torch.testing.assert_close(actual, expected, equal_nan=True, **tol)
                    if leaked:
                        raise AssertionError(f"output tensor(s) {leaked} not on 'cuda' (a plain tensor leaked)")
                    passed += 1
                except Exception as e:
                    where = traceback.extract_tb(e.__traceback__)[-1]
                    failures.append(f"{name}\tsample {i}\t{stage}\t{_summary(e)}"
                                    f"\t[{os.path.basename(where.filename)}:{where.lineno}]")
                    _sync_quietly()
            timings.append((time.monotonic() - t_op, name))
    elapsed = time.monotonic() - t_start

    rate = passed / ran_locally if ran_locally else 0.0
    with open(FAILURES_FILE, "w") as f:
        f.write(f"# {len(failures)} failures of {ran_locally} locally-running samples "
                f"({len(ops)} ops, <= {SAMPLES_PER_OP} samples each); pass rate {rate:.1%}; "
                f"{elapsed:.0f} s\n")
        f.write("# op\tsample\tstage\terror\t[where]\n")
        for line in failures:
            f.write(line + "\n")
    slowest = ", ".join(f"{n} {t:.1f}s" for t, n in sorted(timings, reverse=True)[:5])
    print(f"\nOpInfo parity: {passed}/{ran_locally} samples pass remotely ({rate:.1%}) over {len(ops)} ops "
          f"in {elapsed:.0f} s; failures in {FAILURES_FILE}; slowest ops: {slowest}")
    assert ran_locally > 0
    assert rate >= MIN_PASS_RATE, (f"only {rate:.1%} of {ran_locally} OpInfo samples match local PyTorch; "
                                   f"see {FAILURES_FILE}")
