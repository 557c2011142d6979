"""Errors of streamed ops: a failure only the gateway sees (a simulated GPU out of memory, a
value-dependent kernel error) reaches the program as the exception a GPU's PyTorch raises, where
a GPU raises it or says why not, with nothing else lost and the session still usable.

The gateway here is a simulated GPU of 64 MB (``--gpus 1 --gpu-memory 64MB``): a two-layer MLP
of 4 MB whose batch of 2800 fits its forward pass and not its backward pass."""
from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, GatewayProcess, active_over

#: a batch whose forward pass fits the simulated GPU and whose backward pass does not
TOO_BIG = 2800


@pytest.fixture(scope="module")
def small_gpu():
    """remotecuda active over a gateway whose one simulated GPU has 64 MB; the run's own
    activation after."""
    gw = GatewayProcess("--spare", "1", "--gpus", "1", "--gpu-memory", "64MB")
    try:
        with active_over(gw.address):
            yield gw
    finally:
        gw.stop()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_out_of_memory_in_backward_is_raised_by_backward(small_gpu):
    """A GPU's allocator fails inside ``loss.backward()``, so the OutOfMemoryError is raised
    there; here it came at the optimizer's step (or at any later read), outside a ``try`` around
    the backward pass. The gradients the failed pass was to make are None, as on a GPU where it
    stopped before making them; those it made are readable."""
    model = _mlp().cuda()
    x, y = (t.cuda() for t in _batch(TOO_BIG))
    loss = F.cross_entropy(model(x), y)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        loss.backward()
    assert model[0].weight.grad is None and model[0].bias.grad is None  # (the pass stopped before them)
    assert all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)
    del loss
    torch.cuda.empty_cache()
    assert torch.ones(3, device="cuda").sum().item() == 3.0  # the session goes on


def test_halving_the_batch_on_out_of_memory_trains_as_the_cpu_does(small_gpu):
    """The common loop: try a step, and on ``torch.cuda.OutOfMemoryError`` free memory and retry
    with half the batch. The failed trials change nothing: the model trained at the batch that
    fit is the one a CPU trains at that batch."""
    def train(model: torch.nn.Module, device: str, bs: int, steps: int = 2) -> int:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        done = 0
        while done < steps:
            x, y = (t.to(device) for t in _batch(bs))
            try:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                done += 1
            except torch.cuda.OutOfMemoryError:
                del x, y
                loss = None
                torch.cuda.empty_cache()
                bs //= 2
        return bs

    remote = _mlp().cuda()
    fitted = train(remote, "cuda", 2 * TOO_BIG)  # out of memory in the forward pass, then in the backward
    assert fitted == TOO_BIG // 2
    local = _mlp()
    train(local, "cpu", fitted)
    for r, c in zip(remote.parameters(), local.parameters()):
        torch.testing.assert_close(r.cpu(), c, rtol=1e-5, atol=1e-6)


def test_the_error_says_what_queued_after_it_did_not_run(remote):
    """Ops queued after a failing one are skipped (a GPU would never have run the lines after the
    one that raised): those making tensors leave them "never computed", naming the failure, but
    an in-place update was dropped with nothing to show for it. The error says so now."""
    x = torch.arange(3.0, device="cuda")
    count = torch.zeros((), device="cuda")
    torch.cuda.synchronize()
    bad = x[torch.tensor([5], device="cuda")]  # fails on the gateway (a GPU: a device-side assert)
    doubled = x * 2
    count += 1
    total = bad.sum()
    with pytest.raises(IndexError, match="out of bounds") as info:
        torch.cuda.synchronize()
    note = "\n".join(info.value.__notes__)
    assert "the 3 ops queued after it" in note and "did not run" in note, note
    assert "1 of them were to update existing tensors in place" in note, note
    for t in (doubled, total):
        with pytest.raises(RuntimeError, match=r"never computed: op aten::index.Tensor failed before it \(IndexError"):
            t.cpu()
    assert count.item() == 0.0  # (as the note says)
    count += 1
    assert count.item() == 1.0 and (x * 2).tolist() == [0.0, 2.0, 4.0]  # the session goes on


def test_out_of_memory_in_generate_is_raised_by_generate(small_gpu):
    """``generate()`` reads no value per token here (decode.py): its stop check is asked with
    ``request_later`` and collected at a later step. The reply carrying the OOM answered None and
    dropped the error, which the gateway reports once: the ops after it failed on tensors never
    computed, and ``generate`` raised a RuntimeError nesting "never computed" messages, the OOM
    lost. It raises the OutOfMemoryError, and the session generates as the CPU does after it."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=5000, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    local = transformers.GPT2LMHeadModel(cfg).eval()
    remote = copy.deepcopy(local).cuda()
    ids = torch.randint(1, 5000, (2000, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        remote.generate(ids.cuda(), max_new_tokens=20, do_sample=False)
    torch.cuda.empty_cache()
    with torch.no_grad():
        out = remote.generate(ids[:2].cuda(), max_new_tokens=20, do_sample=False)
        assert torch.equal(out.cpu(), local.generate(ids[:2], max_new_tokens=20, do_sample=False))


INTERRUPTED = """\
import torch, remotecuda
remotecuda.activate(fallback="error")
m = torch.randn(1024, 1024, device="cuda") / 32
h = m
for _ in range(2000):  # ~4 TFLOP queued: minutes on a CPU gateway
    h = torch.tanh(h @ m)
print("queued", flush=True)
h.sum().item()
"""


def test_a_script_ended_by_ctrl_c_does_not_wait_for_its_queued_work(gateway):
    """Ctrl-C while a script reads a value: the KeyboardInterrupt ends it, and its exit waited,
    in silence, for all the work it had queued (minutes), until a second Ctrl-C. A GPU's program
    ends at once. It ends now, saying that the queued work is dropped."""
    env = dict(os.environ, REMOTECUDA_SERVERS=gateway.address, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-c", INTERRUPTED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "queued"
        time.sleep(1.0)  # (in the read's wait)
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "KeyboardInterrupt" in err and "remotecuda: interrupted: the remote work" in err, err
    assert elapsed < 20, f"the interrupted script took {elapsed:.1f} s to end"
    assert "remotecuda" + os.sep not in err, err  # (no traceback of remotecuda's frames)
