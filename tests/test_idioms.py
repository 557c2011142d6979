"""Today's PyTorch idioms, unchanged, against a real gateway: the device picked with
``torch.accelerator``, a default device, backend flags, and module conversions while a
CPU autograd graph is alive. The reference for every value is local PyTorch on the CPU.
"""
from __future__ import annotations

import copy
import os
import signal
import sys
import textwrap
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import remotecuda
from remotecuda import accelerator_api, flags
from remotecuda.tensor import RemoteTensor

from conftest import interception_removed, reset_fp32_precision, run_python, spy_set_flags, wait_for

pytestmark = pytest.mark.usefixtures("remote")


def cpu_copy(t):
    return t.detach().cpu().clone()


# ---------------------------------------------------------------- torch.accelerator

def test_every_accelerator_function_speaks_for_the_gateways():
    replaced = set(torch.accelerator.__all__) - {"Graph"}  # CUDA graphs are not supported
    assert {n for n in replaced if getattr(torch.accelerator, n) is not accelerator_api.REPLACEMENTS.get(n)} == set()
    assert torch.accelerator.memory.memory_allocated is accelerator_api.memory_allocated


def test_accelerator_device_and_streams():
    acc = torch.accelerator
    assert acc.is_available()
    assert acc.current_accelerator() == torch.device("cuda") == acc.current_accelerator(check_available=True)
    assert acc.device_count() == torch.cuda.device_count() >= 1
    assert acc.current_device_index() == torch.cuda.current_device() == 0
    acc.set_device_index(0)
    acc.set_device_index(-1)  # a no-op, as in torch
    with acc.device_index(0):
        assert acc.current_device_index() == 0
    with acc.device_index(None):
        pass
    with pytest.warns(FutureWarning):
        assert acc.current_device_idx() == 0
    with pytest.warns(FutureWarning):
        acc.set_device_idx(0)
    s = acc.current_stream()
    assert s == torch.cuda.current_stream() and not s.is_capturing()
    acc.set_stream(s)
    acc.synchronize()
    assert torch.bfloat16 in acc.get_device_capability()["supported_dtypes"]
    with pytest.raises(ValueError):
        acc.current_stream("cpu")


def test_accelerator_memory_functions_measure_the_gateway():
    acc = torch.accelerator
    before = acc.memory_allocated()
    x = torch.ones(1 << 18, device=acc.current_accelerator())
    assert acc.memory_allocated() >= before + x.numel() * 4
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    assert acc.memory_reserved() >= acc.memory_allocated() and acc.max_memory_reserved() > 0
    assert acc.memory_stats()["allocated_bytes.all.current"] == acc.memory_allocated()
    free, total = acc.get_memory_info()
    assert 0 < free <= total
    acc.reset_peak_memory_stats()
    acc.reset_accumulated_memory_stats()
    acc.empty_cache()
    acc.empty_host_cache()
    assert acc.memory_allocated(0) == torch.cuda.memory_allocated(0)


def test_device_picked_with_accelerator_runs_on_the_gateway():
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    ref = copy.deepcopy(model)
    x = torch.randn(5, 4)
    out = model.to(device)(x.to(device))
    assert isinstance(out, RemoteTensor) and out.device == torch.device("cuda", 0)
    torch.testing.assert_close(out.cpu(), ref(x))


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
], ids=["Adam", "AdamW", "SGD"])
def test_optimizer_step_with_accelerator_intercepted(make_opt):
    """step() asks torch.accelerator whether the current stream captures a CUDA graph."""
    torch.manual_seed(0)
    local = nn.Linear(3, 2)
    remote = copy.deepcopy(local).to(torch.accelerator.current_accelerator())
    x = torch.randn(4, 3)
    for model, inp in ((local, x), (remote, x.cuda())):
        opt = make_opt(model.parameters())
        for _ in range(3):
            opt.zero_grad()
            model(inp).pow(2).sum().backward()
            opt.step()
    torch.testing.assert_close(cpu_copy(remote.weight), local.weight.detach())


def test_cuda_graph_capture_queries_and_nvtx():
    assert torch.cuda.is_current_stream_capturing() is False
    assert torch.cuda.graphs.is_current_stream_capturing() is False
    with torch.cuda.nvtx.range("step {}", 1):
        torch.cuda.nvtx.mark("here")


def test_cuda_rng_state_round_trip_and_fork_rng():
    torch.manual_seed(5)
    state = torch.cuda.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    a = torch.rand(4, device="cuda").cpu()
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda").cpu(), a)
    torch.cuda.set_rng_state_all(torch.cuda.get_rng_state_all())
    with torch.random.fork_rng():
        torch.rand(4, device="cuda")
    torch.cuda.set_rng_state(state)
    torch.rand(4, device="cuda")
    with torch.random.fork_rng(device_type="cuda"):
        inside = torch.rand(4, device="cuda").cpu()
    assert torch.equal(torch.rand(4, device="cuda").cpu(), inside)  # fork_rng put the state back


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_replays_dropout(reentrant):
    """The recomputation must draw the forward's dropout mask again (else gradients are silently wrong)."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    lin = nn.Linear(64, 64).cuda()
    x = torch.randn(8, 64, device="cuda", requires_grad=True)

    def block(t):
        return nn.functional.dropout(lin(t), 0.5)
    grads = []
    for wrap in (lambda t: checkpoint(block, t, use_reentrant=reentrant), block):
        torch.manual_seed(3)
        wrap(x).pow(2).sum().backward()
        grads.append(x.grad.cpu())
        x.grad = None
    torch.testing.assert_close(grads[0], grads[1])


# ---------------------------------------------------------------- default device

def test_set_default_device_cuda():
    torch.set_default_device("cuda")
    try:
        assert torch.get_default_device() == torch.device("cuda", 0)
        torch.manual_seed(1)
        x = torch.randn(3)
        lin = nn.Linear(3, 2)
        assert x.is_cuda and lin.weight.is_cuda and isinstance(lin.weight, nn.Parameter)
        assert torch.tensor([1.0, 2.0]).is_cuda
    finally:
        torch.set_default_device(None)
    assert torch.get_default_device() == torch.device("cpu")
    torch.manual_seed(1)
    torch.testing.assert_close(x.cpu(), torch.randn(3))


def test_device_context_manager():
    with torch.device("cuda"):
        assert torch.get_default_device() == torch.device("cuda", 0)
        t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        z = torch.zeros(2, 2)
        lin = nn.Linear(2, 2)
    assert isinstance(t, RemoteTensor) and z.is_cuda and lin.weight.is_cuda
    assert (t + z).cpu().tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert torch.tensor([1.0]).device.type == "cpu"


# ---------------------------------------------------------------- cuDNN and backend flags

def test_cudnn_available_and_lstm_does_not_warn():
    assert torch.backends.cudnn.is_available()
    torch.manual_seed(0)
    local = nn.LSTM(3, 4, batch_first=True)
    remote = copy.deepcopy(local).cuda()
    x = torch.randn(2, 5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = remote(x.cuda())
    torch.testing.assert_close(out.cpu(), local(x)[0])


def test_backend_flags_reach_the_gateway_once_when_changed(monkeypatch):
    torch.ones(1, device="cuda")  # a session is open
    sent = spy_set_flags(monkeypatch)
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.benchmark, cudnn.deterministic, matmul.allow_tf32, torch.get_float32_matmul_precision())
    try:
        cudnn.benchmark = True
        cudnn.benchmark = True  # unchanged: nothing more is sent
        cudnn.deterministic = True
        matmul.allow_fp16_reduced_precision_reduction = False
        torch.set_float32_matmul_precision("high")
        assert sent == [{"cudnn.benchmark": True}, {"cudnn.deterministic": True},
                        {"matmul.allow_fp16_reduced_precision_reduction": False},
                        {"matmul.allow_tf32": True, "float32_matmul_precision": "high",
                         "fp32_precision.cuda.matmul": "tf32"}]  # (the newer API's view of it)
        n = len(sent)
        with cudnn.flags(enabled=False, benchmark=True, deterministic=True):
            assert {k: v for d in sent[n:] for k, v in d.items()} == {"cudnn.enabled": False}
            n = len(sent)
        assert {k: v for d in sent[n:] for k, v in d.items()} == {"cudnn.enabled": True}
        torch.cuda.synchronize()  # the gateway applied them (an error in rc::set_flags is raised here)
    finally:
        cudnn.benchmark, cudnn.deterministic, matmul.allow_tf32 = saved[:3]
        matmul.allow_fp16_reduced_precision_reduction = True
        torch.set_float32_matmul_precision(saved[3])


def test_fp16_accumulation_reaches_the_gateway(monkeypatch):
    """``torch.backends.cuda.matmul.allow_fp16_accumulation`` (cuBLAS half matmuls accumulating in
    half) stayed in the client, where no cuBLAS runs."""
    torch.ones(1, device="cuda")  # a session is open
    sent = spy_set_flags(monkeypatch)
    matmul = torch.backends.cuda.matmul
    try:
        matmul.allow_fp16_accumulation = True
        torch.cuda.synchronize()  # the gateway applied it (an error in rc::set_flags is raised here)
    finally:
        matmul.allow_fp16_accumulation = False
    assert sent == [{"matmul.allow_fp16_accumulation": True}, {"matmul.allow_fp16_accumulation": False}]


def test_tf32_set_through_the_newer_api_reaches_the_gateway(monkeypatch):
    """``torch.backends.fp32_precision = "tf32"`` (transformers' ``TrainingArguments(tf32=True)``)
    and its per-backend forms end in one setter the legacy flags do not see."""
    torch.ones(1, device="cuda")
    sent = spy_set_flags(monkeypatch)
    told = remotecuda.runtime.current().flags  # (what the gateways were told, sessions opened later too)

    def agree() -> bool:
        return all(told.get(f"fp32_precision.{b}.{o}", flags.DEFAULTS[f"fp32_precision.{b}.{o}"])
                   == torch._C._get_fp32_precision_getter(b, o) for b, o in flags.FP32_PRECISION)
    try:
        torch.backends.fp32_precision = "tf32"
        assert sent[0]["fp32_precision.generic.all"] == "tf32" and agree(), sent
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        assert sent[-1] == {"fp32_precision.cuda.conv": "ieee"} and agree(), sent
        torch.cuda.synchronize()  # (the gateway applied them: an error in rc::set_flags is raised here)
    finally:
        reset_fp32_precision()
    assert agree()


def test_deterministic_algorithms_apply_on_the_gateway():
    """With deterministic algorithms on, torch.empty fills floats with NaN: there and here alike."""
    torch.use_deterministic_algorithms(True)
    try:
        remote = torch.empty(3, device="cuda").cpu()
        local = torch.empty(3)
    finally:
        torch.use_deterministic_algorithms(False)
    assert remote.isnan().all() and local.isnan().all()
    assert not torch.empty(64, device="cuda").cpu().isnan().all()


# ---------------------------------------------------------------- conversions with a live graph

def _double_with_live_graph() -> tuple:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    w = m[0].weight
    out = m(torch.randn(5, 3)).sum()  # the graph holds the parameters
    m.double()
    try:
        out.backward()
        backward = "ok"
    except RuntimeError as e:
        backward = type(e).__name__
    return m[0].weight is w, m[0].weight.dtype, type(m[0].weight).__name__, backward, m[0].weight.grad is None


def test_cpu_only_double_with_a_live_graph_is_torchs_own():
    got = _double_with_live_graph()
    with interception_removed():  # the same without remotecuda (the fixture's sessions stay open)
        expected = _double_with_live_graph()
    assert got == expected
    assert not torch.__future__.get_swap_module_params_on_conversion()


def test_cuda_with_a_live_cpu_graph():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    ref = copy.deepcopy(m)
    x = torch.randn(5, 3)
    out = m(x).sum()  # alive: the swap is impossible, the conversion still works
    m.cuda()
    assert all(p.is_cuda and isinstance(p, nn.Parameter) for p in m.parameters())
    torch.testing.assert_close(m(x.cuda()).cpu(), ref(x))
    del out  # its backward now fails, as on a GPU (CPU gradients for cuda parameters)


def test_optimizer_built_before_cuda_still_trains_and_cpu_conversions_keep_identity():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    w = model.weight
    model.cuda()
    assert model.weight is w and w.is_cuda
    w0 = cpu_copy(w)
    model(torch.ones(3, 4, device="cuda")).sum().backward()
    opt.step()
    assert not torch.equal(cpu_copy(model.weight), w0)
    model.cpu()  # back across: the same objects again
    assert model.weight is w and not w.is_cuda and opt.param_groups[0]["params"][0] is w


def test_legacy_type_api_names_and_converts_cuda_types():
    x = torch.zeros(2, device="cuda")
    assert x.type() == "torch.cuda.FloatTensor" and x.double().type() == "torch.cuda.DoubleTensor"
    half = x.type(torch.cuda.HalfTensor)
    assert half.dtype == torch.float16 and half.is_cuda
    back = x.type("torch.DoubleTensor")
    assert back.dtype == torch.float64 and back.device.type == "cpu"
    assert x.type(torch.int64).dtype == torch.int64


def test_memory_summary_and_the_submodules_own_functions_ask_the_gateway():
    x = torch.zeros(1000, 1000, device="cuda")
    summary = torch.cuda.memory_summary()
    assert "RemoteCUDA memory summary" in summary and "Allocated memory" in summary
    assert torch.cuda.memory.memory_allocated() >= x.nbytes
    torch.cuda.random.manual_seed(7)
    a = torch.randn(4, device="cuda").cpu()
    torch.cuda.manual_seed(7)
    assert torch.equal(torch.randn(4, device="cuda").cpu(), a)


def test_a_parameter_tied_between_a_module_and_its_child_stays_tied():
    """Hugging Face's MLM heads tie ``head.bias`` to ``head.decoder.bias``, and the decoder's weight
    to the embeddings (converted earlier): the child then holds a remote and a local parameter."""
    torch.manual_seed(0)
    emb = nn.Embedding(6, 4)

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = nn.Linear(4, 6)
            self.decoder.weight = emb.weight
            self.bias = self.decoder.bias

    model = nn.ModuleDict({"emb": emb, "head": Head()})
    bias = model["head"].bias
    model.cuda()
    head = model["head"]
    assert head.bias is bias and head.decoder.bias is bias and head.decoder.weight is emb.weight and bias.is_cuda
    x = torch.tensor([1, 2, 3], device="cuda")
    head.decoder(model["emb"](x)).sum().backward()
    assert torch.equal(bias.grad.cpu(), torch.full((6,), 3.0))
    model.cpu()
    assert head.bias is bias and head.decoder.bias is bias and not bias.is_cuda


# ---------------------------------------------------------------- a script under `remotecuda run`

SCRIPT = '''
import torch, torch.nn as nn, remotecuda
device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"
torch.backends.cudnn.benchmark = True
model = nn.Linear(4, 2).to(device)
loss = model(torch.randn(8, 4, device=device)).pow(2).mean()
loss.backward()
print("DEVICE", device, model.weight.device, "OPS", remotecuda.stats()["ops"] > 0)
remotecuda.deactivate()
acc = torch.accelerator
print("RESTORED", acc.is_available(), acc.current_accelerator(), acc.device_count(), torch.get_default_device(),
      torch.backends.cudnn.is_available(), torch.backends.cudnn.benchmark,
      all(getattr(acc, n).__module__ == "torch.accelerator" for n in ("is_available", "device_index")),
      acc.memory_allocated.__module__, type(torch._C._set_cudnn_benchmark).__name__,
      torch.nn.Module._apply.__module__, torch.__future__.get_swap_module_params_on_conversion())
'''


def test_remotecuda_run_script_picks_the_gateway_and_deactivate_restores(gateway, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    r = run_python("", env={"REMOTECUDA_FALLBACK": "error"},
                   args=["-m", "remotecuda", "run", "--server", gateway.address, sys.executable, str(script)])
    assert r.returncode == 0, r.stderr
    assert "DEVICE cuda cuda:0 OPS True" in r.stdout
    assert ("RESTORED False None 0 cpu False True True torch.accelerator.memory builtin_function_or_method "
            "torch.nn.modules.module False") in r.stdout


def test_a_forked_child_gets_plain_torch_even_while_a_session_lock_is_held():
    """DataLoader workers are forked and seed torch first thing; a session lock another thread
    held at the fork stays held in the child, which hung there (1 run in ~25 under load)."""
    s = torch.ones(1, device="cuda")._s
    held, done = threading.Event(), threading.Event()

    def hold() -> None:  # as the flusher may hold it at the moment of the fork
        with s.lock:
            held.set()
            done.wait(30)
    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: plain CPU torch, as a forked child of a CUDA process cannot use CUDA
        torch.manual_seed(0)
        ok = not remotecuda.is_active() and torch.ones(2).sum().item() == 2.0
        os._exit(0 if ok else 1)
    status: list = []

    def reaped() -> bool:
        got, st = os.waitpid(pid, os.WNOHANG)
        status.append(st)
        return got == pid
    try:
        hung = not wait_for(reaped, 20)
        if hung:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert not hung, "the forked child hung on the parent's session lock"
        assert os.waitstatus_to_exitcode(status[-1]) == 0, "the child did not get plain CPU torch"
    finally:
        done.set()


@pytest.mark.parametrize("read", [
    lambda t: t[0, 0].item(), lambda t: float(t.sum()), lambda t: bool(t.sum() > 0), lambda t: t.nonzero(),
    lambda t: torch.tensor([t.sum(), t.mean()]), lambda t: t[t > 0].shape,
], ids=["view item", "float", "bool", "nonzero", "torch.tensor of cuda scalars", "mask"])
def test_a_read_leaves_its_tensor_free_to_go(read):
    """A tensor whose value was read goes, with its gateway memory, as soon as the program drops it, as on a
    GPU (``out[0, 0].item(); del out`` kept ``out``, and its memory, until the garbage collector ran: the
    ops the gateway describes held their arguments in a reference cycle)."""
    import gc
    import weakref
    gc.collect()
    gc.disable()
    try:
        before = torch.cuda.memory_allocated()
        t = torch.randn(256, 256, device="cuda")
        ref = weakref.ref(t)
        read(t)
        del t
        assert ref() is None
        assert torch.cuda.memory_allocated() <= before  # (an earlier test's small leftovers may go meanwhile)
    finally:
        gc.enable()
