"""The warnings a program sees under remotecuda are those it sees on a GPU machine: the same
category and words, at the same line (the user's, where torch's ``stacklevel`` or a C++
``TORCH_WARN`` puts it), as often under the default once-per-location filter, and raised at the
same call under ``simplefilter("error")``.

One program of snippets runs in two fresh interpreters, on the CPU and on 'cuda' through the
session's gateway; each snippet runs twice under the "default" filter (once-per-location: the
second run shows nothing new) and once under "error"; the two records must be equal.
"""
from __future__ import annotations

import json
import os

import pytest

from conftest import run_python

#: each ``def name(dev)`` is a snippet (the warnings of the gateway's kernels, raised at a sync
#: point, are tests/test_kernel_warnings.py's)
PROGRAM = '''
import torch, torch.nn as nn, torch.nn.functional as F


def download_between(dev):
    a, b = torch.randn(3, 1, device=dev), torch.randn(3, device=dev)
    F.mse_loss(a, b)
    torch.randn(1000, device=dev).cpu()


def softmax_without_dim(dev):
    F.softmax(torch.randn(2, 3, device=dev))


def scheduler_before_optimizer(dev):
    opt = torch.optim.SGD(nn.Linear(2, 2).to(dev).parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, 1).step()


def autocast_softmax_without_dim(dev):
    with torch.autocast(dev):
        F.softmax(torch.randn(2, 3, device=dev))


def autocast_loss_module(dev):
    with torch.autocast(dev):
        nn.MSELoss()(torch.randn(3, 1, device=dev), torch.randn(3, device=dev))


def autocast_cpp_warning(dev):
    x = torch.ones(2, 3, 4, device=dev)
    with torch.autocast(dev):
        x.T


def autocast_under_the_programs_own_filter(dev):
    import warnings
    raised = None
    with warnings.catch_warnings():
        warnings.filterwarnings("error", module="program")
        try:
            with torch.autocast(dev):
                F.softmax(torch.randn(2, 3, device=dev))
        except UserWarning as e:
            raised = e
    if raised is not None:
        warnings.warn(f"raised: {raised}")


def nested_autocast_softmax_without_dim(dev):
    with torch.autocast(dev), torch.autocast(dev, enabled=False):
        F.softmax(torch.randn(2, 3, device=dev))


def nested_autocast_typed_storage(dev):
    with torch.autocast(dev, dtype=torch.bfloat16), torch.autocast(dev, dtype=torch.bfloat16):
        torch.ones(2, device=dev).storage()


def tensor_of_a_tensor(dev):
    torch.tensor(torch.ones(3, device=dev))


def tensor_of_a_tensor_on_the_device(dev):
    torch.tensor(torch.ones(3, device=dev), device=dev)


def sparse_of_indices_on_the_device(dev):
    i = torch.tensor([[0, 1], [1, 0]], device=dev)
    torch.sparse_coo_tensor(i, torch.ones(2, device=dev), (2, 2))


def reset_max_memory_allocated(dev):
    try:
        torch.cuda.reset_max_memory_allocated()
    except AttributeError:  # (a CPU build has no allocator to reset, once it has warned)
        pass


def generate_with_a_deprecated_argument(dev):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).to(dev).eval()
    ids = torch.tensor([[3, 4, 5]], device=dev)
    model.generate(ids, max_new_tokens=2, past_key_values=None, attention_mask=torch.ones_like(ids), pad_token_id=2)

def _autocast_softmax(dev):
    with torch.autocast(dev):
        F.softmax(torch.randn(2, 3, device=dev))


def filter_error_for_every_warning(dev):
    import warnings
    raised = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            _autocast_softmax(dev)
        except UserWarning as e:
            raised = e
    warnings.warn(f"raised: {raised}")


def filter_ignore_by_the_programs_module(dev):
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="program")
        _autocast_softmax(dev)
    warnings.warn("after")


def filter_shown_only_for_the_programs_module(dev):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("default", module="program")
        _autocast_softmax(dev)


def filter_by_the_programs_line(dev):
    import inspect, warnings
    line = inspect.getsourcelines(_autocast_softmax)[1] + 2
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", lineno=line)
        _autocast_softmax(dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("always", lineno=line)
        _autocast_softmax(dev)
    warnings.warn("after")


def warning_instance_of_a_library(dev):
    import warnings

    class Noted(UserWarning):
        def __init__(self, text, note):
            super().__init__(text)
            self.note = note

    def doubled(x):  # (hands itself to torch's function modes, as torch's own functions do)
        if torch.overrides.has_torch_function_unary(x):
            return torch.overrides.handle_torch_function(doubled, (x,), x)
        warnings.warn(Noted("doubled() is noted", "its note"), stacklevel=2)
        return x * 2

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with torch.autocast(dev):
                doubled(torch.ones(2, device=dev))
        except Exception as e:
            seen = [f"{type(e).__name__}: {e}"]
    got = [(type(w.message).__name__, w.message.note, w.lineno) if hasattr(w, "message") else w for w in seen]
    warnings.warn(f"seen: {got}")


def filter_once(dev):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("once")
        _autocast_softmax(dev)
        F.softmax(torch.randn(2, 3, device=dev))
        torch.tensor(torch.ones(3, device=dev))
        torch.tensor(torch.ones(3, device=dev))
'''

RUNNER = '''
import importlib.util, json, os, sys, traceback, warnings
import torch
mode, path = sys.argv[1], sys.argv[2]
if mode == "remote":
    import remotecuda
    remotecuda.activate(fallback="error")
spec = importlib.util.spec_from_file_location("program", path)
program = importlib.util.module_from_spec(spec)
spec.loader.exec_module(program)
dev = "cuda" if mode == "remote" else "cpu"
out = {}
for name in [n for n, f in vars(program).items() if callable(f) and getattr(f, "__module__", "") == "program"]:
    f = getattr(program, name)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        f(dev)
        f(dev)
    shown = [[w.category.__name__, str(w.message), os.path.basename(w.filename), w.lineno] for w in seen]
    raised = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            f(dev)
        except Warning as e:
            lines = [t.lineno for t in traceback.extract_tb(e.__traceback__) if t.filename == path]
            raised = [type(e).__name__, str(e), lines[-1] if lines else None]
    out[name] = {"shown": shown, "raised": raised}
print("RESULT" + json.dumps(out))
'''


def _run(mode: str, path: str, env: dict) -> dict:
    r = run_python(RUNNER, env=env, args=["-c", RUNNER, mode, path], timeout=240)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[0][len("RESULT"):])


@pytest.fixture(scope="module")
def records(gateway, tmp_path_factory):
    """Each snippet's warnings, on the CPU and on 'cuda': ``{name: (local, remote)}``."""
    path = os.path.join(str(tmp_path_factory.mktemp("warnings")), "program.py")
    with open(path, "w") as f:
        f.write(PROGRAM)
    local = _run("local", path, {})
    remote = _run("remote", path, {"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_FALLBACK": "error"})
    return {name: (local[name], remote.get(name)) for name in local}


def _check(records: dict, name: str) -> None:
    local, remote = records[name]
    assert local["shown"], f"{name} warns of nothing on the CPU: the snippet checks nothing"
    assert remote == local


def test_a_download_does_not_show_shown_once_warnings_again(records):
    """A download (``.cpu()``, ``print``) between two runs of a warning line: shown once, as on a
    GPU. Each download entered ``warnings.catch_warnings`` to silence torch's note that a zmq frame
    is read-only, which marks the filters changed: every once-per-location warning of the program
    was shown again after it (a loss-shape warning at every step of a training loop)."""
    _check(records, "download_between")


@pytest.mark.parametrize("name", ["softmax_without_dim", "scheduler_before_optimizer"])
def test_warnings_that_were_already_at_the_users_line(records, name):
    _check(records, name)


@pytest.mark.parametrize("name", ["autocast_softmax_without_dim", "autocast_loss_module", "autocast_cpp_warning",
                                  "tensor_of_a_tensor", "generate_with_a_deprecated_argument"])
def test_warnings_made_under_remotecudas_frames_are_at_the_programs_line(records, name):
    """torch's stacklevels count a plain call's frames, and remotecuda's own sat between the
    program and torch: the autocast mode's ``__torch_function__`` (with torch's hand-over to it),
    a route's handler calling the original (``torch.tensor``), ``generate()``'s wrapper. The
    warning was shown at remotecuda's line, and counted once per remotecuda line
    (remotecuda/warning_location.py)."""
    _check(records, name)


def test_a_warning_instance_a_library_made_is_the_one_the_program_gets(records):
    """A warning made under remotecuda's frames was made again at the program's line from its
    category and text, which a library's warning class that takes more than the text cannot be
    built from (a TypeError out of the library's ``warnings.warn``), and which loses what the
    instance carries; the program gets the instance the library made, as on a GPU."""
    _check(records, "warning_instance_of_a_library")


@pytest.mark.parametrize("name", ["nested_autocast_softmax_without_dim", "nested_autocast_typed_storage"])
def test_warnings_under_nested_autocast_blocks_are_at_the_programs_line(records, name):
    """Nested ``torch.autocast('cuda')`` blocks (transformers' rotary embeddings turn autocast off
    inside the user's block) stack two autocast modes, so a torch function that warns hands
    itself over twice. Past the inner hand-over the warning was placed at the outer mode's
    frame, remotecuda's, and issued again there, then found at the inner one's line (the same
    line) and issued again: a RecursionError out of ``F.softmax(x)`` or ``t.storage()``."""
    _check(records, name)


def test_the_programs_filters_meet_such_warnings_at_its_line(records):
    """A filter for the program's own module (``filterwarnings("error", module=...)``) applies to
    them, as it does on a GPU; it did not match remotecuda's module, where they were placed."""
    _check(records, "autocast_under_the_programs_own_filter")


def test_a_tensor_copied_onto_the_device_warns_as_torch_does(records):
    """``torch.tensor(t, device='cuda')`` of a 'cuda' tensor: torch's copy-construct warning,
    which the call made on the client never reached."""
    _check(records, "tensor_of_a_tensor_on_the_device")


def test_a_program_given_with_dash_c_gets_its_warning_at_its_line(gateway):
    """``python -c`` (and a kernel's ``__main__``) has a module whose loader cannot give its source:
    making the warning again at its line asked that loader, which raised ImportError ("'__main__'
    is not a built-in module") out of the program's call (a failover's warning ended the run)."""
    code = ("import warnings, torch, remotecuda\nremotecuda.activate()\nt = torch.ones(2, device='cuda')\n"
            "with warnings.catch_warnings(record=True) as seen:\n    warnings.simplefilter('always')\n"
            "    torch.tensor(t)\nprint('SEEN', [(w.category.__name__, w.filename, w.lineno) for w in seen])\n")
    r = run_python(code, env={"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_FALLBACK": "error"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SEEN [('UserWarning', '<string>', 6)]" in r.stdout, r.stdout


@pytest.mark.parametrize("name", ["filter_error_for_every_warning", "filter_ignore_by_the_programs_module",
                                  "filter_shown_only_for_the_programs_module", "filter_by_the_programs_line",
                                  "filter_once"])
def test_the_programs_filters_decide_at_its_line(records, name):
    _check(records, name)


#: a library function that hands itself to torch's function modes (as torch's own Python functions
#: do: the autocast mode of a 'cuda' autocast takes it) and deprecates itself
DEPRECATED_HELPER = '''
import sys, torch, warnings
dev = sys.argv[1]
if dev == "cuda":
    import remotecuda
    remotecuda.activate()


def doubled(x):
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(doubled, (x,), x)
    warnings.warn("doubled() is deprecated", DeprecationWarning, stacklevel=2)
    return x * 2


with torch.autocast(dev):
    doubled(torch.ones(2, device=dev))
print("DONE")
'''


def _warning_lines(program: str, gateway, tmp_path) -> tuple:
    """``program`` run as a file with Python's default filters, on 'cpu' and on 'cuda': its path,
    and the warning lines each run printed."""
    path = tmp_path / "main.py"
    path.write_text(program)
    env = {"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_FALLBACK": "error", "PYTHONWARNINGS": ""}
    seen = {}
    for dev in ("cpu", "cuda"):
        r = run_python("", env=env, args=[str(path), dev])
        assert r.returncode == 0 and "DONE" in r.stdout, r.stderr[-3000:]
        seen[dev] = [line for line in r.stderr.splitlines() if "Warning" in line]
    return path, seen


def test_the_default_filters_show_a_deprecation_in_main_as_python_does(gateway, tmp_path):
    """Python's default filters show a DeprecationWarning placed in ``__main__`` and ignore one
    placed in any other module. Placed in remotecuda's autocast mode, it met "ignore" there and was
    dropped before remotecuda could move it to the program's line."""
    path, seen = _warning_lines(DEPRECATED_HELPER, gateway, tmp_path)
    assert seen["cpu"] == [f"{path}:17: DeprecationWarning: doubled() is deprecated"]
    assert seen["cuda"] == seen["cpu"]


#: a warning of the program's, shown once at its line by the default filter, before and after the
#: program's first elementwise op on the device
SHOWN_BEFORE_THE_FIRST_OP = '''
import sys, torch, warnings
dev = sys.argv[1]
if dev == "cuda":
    import remotecuda
    remotecuda.activate()
for _ in range(2):
    warnings.warn("a note of the program's")
    (torch.ones(2, device=dev) / 2).sum().item()
print("DONE")
'''


def test_the_first_op_does_not_show_shown_warnings_again(gateway, tmp_path):
    """Python forgets which warnings each line has shown whenever a filter is added. torch's
    Python reference kernels, which remotecuda runs for a 'cuda' tensor's shapes and dtypes,
    import sympy at their first call, and sympy's import adds a filter: a warning the program
    had shown was shown again after its first op on 'cuda' (a GPU runs no such kernel)."""
    path, seen = _warning_lines(SHOWN_BEFORE_THE_FIRST_OP, gateway, tmp_path)
    assert seen["cpu"] == [f"{path}:8: UserWarning: a note of the program's"]
    assert seen["cuda"] == seen["cpu"]


def test_a_sparse_tensor_of_cuda_indices_warns_that_its_invariant_checks_are_off(records):
    """``torch.sparse_coo_tensor`` of 'cuda' indices and values, opting neither in nor out of
    the invariant checks: C++'s once-a-process warning, which the client's own sparse tensor
    (sparse.py) never reached; now torch's constructor on meta stand-ins gives it."""
    _check(records, "sparse_of_indices_on_the_device")


def test_torch_cudas_own_deprecation_warnings_are_given(records):
    """``torch.cuda.reset_max_memory_allocated`` warns that it resets every peak; remotecuda's
    replacement of it did not (torch's own now runs, calling the replaced reset_peak_memory_stats)."""
    _check(records, "reset_max_memory_allocated")
