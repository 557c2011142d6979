"""Parity with PyTorch's own OpInfo database, op by op: every op, run on 'cuda' through a
gateway, must give what local PyTorch gives on the CPU.

One test per OpInfo id (``op_db``) and dtype, as PyTorch's own suite does:

- ``test_op[<op>-<dtype>]``: the first few non-empty samples (float32: 3; bfloat16, float16,
  int64: 2) run locally on the CPU with remotecuda's modes popped (the reference) and on 'cuda'
  (tensors moved with ``.to('cuda')``, except those the sample keeps on the CPU whatever the
  device, such as tensor_split's indices; outputs fetched with ``.cpu()``);
- ``test_op_noncontiguous[<op>-float32]``: the first sample made non-contiguous *on the
  gateway* (``noncontiguous_like`` applied to the uploaded tensors), against the same locally;
- ``test_op_empty[<op>-float32]``: the first samples holding a zero-size tensor (skipped for
  ops that have none among their first 40);
- ``test_grad[<op>-float32]``, for ops with ``supports_autograd``: gradients of the outputs
  (with fixed random grad_outputs, i.e. of a random scalar reduction) with respect to every
  input that requires grad, against local ones, on one sample.

Results are compared as ``test_compare_cpu`` does, after ``output_process_fn_grad``, with
``assert_close``'s dtype defaults widened by the OpInfo's own ``toleranceOverride`` for that
dtype. Ops whose values are random or uninitialised memory are compared by shape and dtype.
Samples that fail locally are skipped.

Known failures are listed, each with its reason, in ``opinfo_expected_failures.py``; they are
``xfail(strict=True)``: a listed op that starts passing fails too, so the list stays exact.
The counts by test and xfail reason category are printed at the end of the run. At the last
update (torch 2.13, CPU gateway; 4137 tests in ~75 s on 2 busy cores):

- test_op (677 ops in float32, 551 bfloat16, 546 float16, 468 int64): 2200 passed, 19 xfailed,
  23 skipped (CUDA-only jiterator ops; unfold: only empty samples);
- test_op_noncontiguous (677): 666 passed, 1 xfailed, 10 skipped;
- test_op_empty (677): 250 passed, 1 xfailed, 426 skipped (no zero-size sample);
- test_grad (540): 536 passed, 3 xfailed, 1 skipped;
- xfailed by reason: unsupported (sparse CSR) 7, cuda semantics 11, client bug 6.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.testing._comparison import default_tolerances
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.common_utils import noncontiguous_like

# importing torch's test utilities freezes the backend flags for the whole process
# (common_utils calls torch.backends.disable_global_flags()); the other tests set them as users do
torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
from torch.utils import _pytree as pytree

import remotecuda

import opinfo_expected_failures as expected

#: OpInfo samples use deprecated arguments on purpose
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

#: samples compared per op in test_op
SAMPLES = {torch.float32: 3, torch.bfloat16: 2, torch.float16: 2, torch.int64: 2}
#: how deep into an op's samples to look for non-empty (or empty) ones
SAMPLE_DEPTH = 40

#: random ops (CUDA and the CPU do not share generator state) and ops whose output is
#: uninitialised memory: only shapes and dtypes are compared
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _params(table: dict, dtypes: tuple, want: Callable[[Any], bool] = lambda op: True) -> list:
    """pytest params ``<op>-<dtype>`` for the ops supporting ``dtype`` on the CPU, with
    ``table``'s entries as strict xfails. A dtype CUDA does not support for the op (integer
    ``mm``; ``histogram`` in any dtype, its kernel being the CPU's only) is left out: a GPU refuses
    it, and so does remotecuda where it knows (dispatch.py's ``CPU_ONLY_ATEN``,
    ``call_checks._float_only``), though a CPU gateway could compute it."""
    out = []
    for op in op_db:
        for dtype in dtypes:
            if not (want(op) and op.supports_dtype(dtype, "cpu") and op.supports_dtype(dtype, "cuda")):
                continue
            key = (_op_id(op), _dtype_name(dtype))
            marks = [pytest.mark.xfail(reason=table[key], strict=True)] if key in table else []
            out.append(pytest.param(op, dtype, id="-".join(key), marks=marks))
    return out


def _tolerance(op: Any, dtype: torch.dtype) -> dict:
    """assert_close's defaults for ``dtype``, widened by the OpInfo's toleranceOverrides."""
    from torch.testing._internal.common_device_type import toleranceOverride
    rtol, atol = default_tolerances(dtype)
    for d in op.decorators:
        decorators = getattr(d, "decorators", None)
        if not decorators or not d.active_if or d.device_type not in (None, "cpu", "cuda"):
            continue
        if d.dtypes is not None and dtype not in d.dtypes:
            continue
        for dec in decorators:
            if isinstance(dec, toleranceOverride) and dtype in dec.d:
                atol, rtol = max(atol, dec.d[dtype].atol), max(rtol, dec.d[dtype].rtol)
    return {"atol": atol, "rtol": rtol}


@contextlib.contextmanager
def _local_only() -> Iterator[None]:
    """Pop remotecuda's torch-function and dispatch modes: plain local PyTorch inside."""
    from torch.utils._python_dispatch import _disable_current_modes
    fmodes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        with _disable_current_modes(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for m in reversed(fmodes):
            torch._C._push_on_torch_function_stack(m)


def _map(fn: Callable, tree: Any) -> Any:
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


def _tensors(tree: Any) -> list:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _leaf_copy(x: torch.Tensor) -> torch.Tensor:
    """A fresh leaf with x's values and requires_grad."""
    return x.detach().clone().requires_grad_(x.requires_grad)


def _upload(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cuda").requires_grad_(x.requires_grad)


@dataclasses.dataclass
class _Case:
    """A sample, and the positions (among its flattened input, args, kwargs) of the tensors it
    keeps on the CPU whatever the device (e.g. tensor_split's index tensors)."""

    sample: Any
    on_cpu: frozenset

    def arguments(self, remote: bool, noncontiguous: bool = False) -> tuple:
        """(input, args, kwargs): fresh local copies, or uploads to 'cuda' (those on_cpu excepted)."""
        s = self.sample
        leaves, spec = pytree.tree_flatten((s.input, s.args, s.kwargs))
        leaves = [(_upload if remote and i not in self.on_cpu else _leaf_copy)(x) if isinstance(x, torch.Tensor)
                  else x for i, x in enumerate(leaves)]
        inp, args, kwargs = pytree.tree_unflatten(leaves, spec)
        d = kwargs.get("device")
        if remote and d is not None and torch.device(d).type == "cpu":  # factories: build on the remote device
            kwargs = {**kwargs, "device": "cuda"}
        return _map(noncontiguous_like, (inp, args, kwargs)) if noncontiguous else (inp, args, kwargs)


def _is_empty(sample: Any) -> bool:
    return any(t.numel() == 0 for t in _tensors((sample.input, sample.args, sample.kwargs)))


def _generate(op: Any, device: str, dtype: torch.dtype, requires_grad: bool) -> Iterator:
    """The op's samples, up to one that cannot be built locally (``to``'s on 'cuda': remotecuda
    says CUDA is available). Not through ``op.sample_inputs``: its tracking walks the stack with
    ``inspect`` for every sample (~0.1 s per call under pytest)."""
    gen = op.sample_inputs_func(op, device, dtype, requires_grad)
    for _ in range(SAMPLE_DEPTH):
        try:
            yield next(gen)
        except Exception:  # StopIteration included
            return


def _cases(op: Any, dtype: torch.dtype, *, empty: bool, n: int, requires_grad: bool = False) -> list:
    """The first ``n`` samples (among the first SAMPLE_DEPTH) that hold a zero-size tensor or not.

    The tensors a sample keeps on the CPU are found by generating the samples for 'meta' too."""
    with _local_only():
        torch.manual_seed(0)
        picked = list(itertools.islice(((i, s) for i, s in enumerate(_generate(op, "cpu", dtype, requires_grad))
                                        if _is_empty(s) == empty), n))
        try:
            metas = list(itertools.islice(_generate(op, "meta", dtype, requires_grad), picked[-1][0] + 1)
                         ) if picked else []
        except Exception:  # a generator that reads values: assume nothing stays on the CPU
            metas = []
    cases = []
    for i, s in picked:
        on_cpu: frozenset = frozenset()
        if i < len(metas):
            leaves = pytree.tree_leaves((metas[i].input, metas[i].args, metas[i].kwargs))
            on_cpu = frozenset(j for j, x in enumerate(leaves)
                               if isinstance(x, torch.Tensor) and x.device.type == "cpu")
        cases.append(_Case(s, on_cpu))
    return cases


def _call(op: Any, case: _Case, arguments: tuple) -> Any:
    inp, args, kwargs = arguments
    return case.sample.output_process_fn_grad(op(inp, *args, **kwargs))


def _reference(op: Any, case: _Case, noncontiguous: bool = False) -> Any:
    """The op run locally on copies of the sample; None if the sample fails locally."""
    with _local_only():
        try:
            return _map(lambda t: t.detach().clone(), _call(op, case, case.arguments(False, noncontiguous)))
        except Exception:
            return None


def _asks_for_cpu(sample: Any) -> bool:
    """The sample names the CPU as a target device (``x.to('cpu', ...)``): its output belongs there."""
    return any((isinstance(x, torch.device) and x.type == "cpu") or x == "cpu"
               for x in pytree.tree_leaves((sample.args, sample.kwargs)) if isinstance(x, (torch.device, str)))


def _assert_same(actual: Any, expected: Any, op: Any, dtype: torch.dtype) -> None:
    with _local_only():
        if op.name in NONDETERMINISTIC:
            actual, expected = (_map(lambda t: (t.shape, t.dtype), x) for x in (actual, expected))
            assert actual == expected
        else:
            torch.testing.assert_close(actual, expected, equal_nan=True, **_tolerance(op, dtype))


def _check_forward(op: Any, case: _Case, dtype: torch.dtype, noncontiguous: bool = False) -> bool:
    """Run one sample remotely and compare; False if it does not run locally."""
    expected = _reference(op, case, noncontiguous)
    if expected is None:
        return False
    out = _call(op, case, case.arguments(True, noncontiguous))
    leaked = [] if _asks_for_cpu(case.sample) else [t for t in _tensors(out) if t.device.type != "cuda"]
    _assert_same(_map(torch.Tensor.cpu, out), expected, op, dtype)
    assert not leaked, "a plain (non-'cuda') tensor leaked out of the op"
    return True


@pytest.fixture
def gw(remote, gateway):
    """The session's gateway, with a fresh remotecuda session should a test lose its worker."""
    try:
        yield gateway
    finally:
        if remotecuda.runtime.active() is None or not _session_alive():
            remotecuda.deactivate()
            remotecuda.activate(gateway.address, fallback="error")


def _session_alive() -> bool:
    try:
        torch.cuda.synchronize()
        return True
    except remotecuda.GatewayLostError:
        return False
    except Exception:  # an op's async error, drained: the next test starts clean
        return True


def _run_forward(op: Any, dtype: torch.dtype, cases: list, noncontiguous: bool = False) -> None:
    if not cases:
        pytest.skip("no such sample")
    if not sum(_check_forward(op, c, dtype, noncontiguous) for c in cases):
        pytest.skip("no sample runs locally")


@pytest.mark.parametrize(("op", "dtype"), _params(expected.FORWARD, tuple(SAMPLES)))
def test_op(gw, op, dtype):
    _run_forward(op, dtype, _cases(op, dtype, empty=False, n=SAMPLES[dtype]))


@pytest.mark.parametrize(("op", "dtype"), _params(expected.NONCONTIGUOUS, (torch.float32,)))
def test_op_noncontiguous(gw, op, dtype):
    _run_forward(op, dtype, _cases(op, dtype, empty=False, n=1), noncontiguous=True)


@pytest.mark.parametrize(("op", "dtype"), _params(expected.EMPTY, (torch.float32,)))
def test_op_empty(gw, op, dtype):
    _run_forward(op, dtype, _cases(op, dtype, empty=True, n=2))


def _grads(op: Any, case: _Case, remote: bool, grad_outputs: list | None) -> tuple[list, list] | None:
    """(grads of the outputs w.r.t. the inputs that require grad, grad_outputs used). A gradient
    goes where its output is (``to``'s output is on the CPU: the engine refuses another device's)."""
    arguments = case.arguments(remote)
    out = _call(op, case, arguments)
    outs = [t for t in _tensors(out) if t.requires_grad and (t.is_floating_point() or t.is_complex())]
    inputs = [t for t in _tensors(arguments) if t.requires_grad]
    if not outs or not inputs:
        return None
    if grad_outputs is None:
        torch.manual_seed(0)
        grad_outputs = [torch.randn_like(t) for t in outs]
    grad_outputs_here = [_upload(g) if remote and t.is_cuda else g for g, t in zip(grad_outputs, outs)]
    grads = torch.autograd.grad(outs, inputs, grad_outputs_here, allow_unused=True)
    return list(grads), grad_outputs


@pytest.mark.parametrize(("op", "dtype"), _params(expected.BACKWARD, (torch.float32,),
                                                 lambda op: op.supports_autograd))
def test_grad(gw, op, dtype):
    for case in _cases(op, dtype, empty=False, n=3, requires_grad=True):
        with _local_only():
            try:
                local = _grads(op, case, False, None)
            except Exception:
                continue
        if local is None:
            continue
        remote_grads, _ = _grads(op, case, True, local[1])
        _assert_same(_map(torch.Tensor.cpu, remote_grads), local[0], op, dtype)
        return
    pytest.skip("no sample with a differentiable output runs locally")


def test_expected_failures_name_real_tests():
    """Every listed (op, dtype) names a collected test: typos and removed ops do not linger."""
    for table, dtypes in ((expected.FORWARD, tuple(SAMPLES)), (expected.NONCONTIGUOUS, (torch.float32,)),
                          (expected.EMPTY, (torch.float32,)), (expected.BACKWARD, (torch.float32,))):
        ids = {p.id for p in _params({}, dtypes)}
        assert not [k for k in table if "-".join(k) not in ids]


class _Counts:
    """Counts of this file's outcomes, xfails by reason category, printed at the end of the run."""

    def __init__(self) -> None:
        self.outcomes: collections.Counter = collections.Counter()
        self.reasons: collections.Counter = collections.Counter()

    def pytest_runtest_logreport(self, report: Any) -> None:
        if "test_opinfo_parity.py::" not in report.nodeid or "[" not in report.nodeid:
            return
        if report.when == "call" or (report.when == "setup" and not report.passed):
            name = report.nodeid.rpartition("::")[2].partition("[")[0]
            xfail = getattr(report, "wasxfail", None)
            self.outcomes[(name, "xfailed" if xfail is not None else report.outcome)] += 1
            if xfail is not None:
                self.reasons[xfail.split(":")[0].split(",")[0]] += 1

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tests = sorted({n for n, _ in self.outcomes})
        terminalreporter.section("OpInfo parity counts")
        for n in tests:
            terminalreporter.write_line(f"{n}: " + ", ".join(
                f"{o} {c}" for (t, o), c in sorted(self.outcomes.items()) if t == n))
        terminalreporter.write_line("xfailed by reason: " + ", ".join(
            f"{r} {c}" for r, c in self.reasons.most_common()))


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    request.config.pluginmanager.register(_Counts(), "opinfo_counts")
    yield
