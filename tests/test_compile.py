"""torch.compile while active: graphs traced on the client, defined once on a real gateway and
run there as one op per forward and one per backward; results compared with local CPU eager."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from remotecuda_wire.protocol import Handle

from conftest import ROOT, GatewayProcess, interception_removed


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _compiled_vs_local(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 5) -> tuple:
    local = copy.deepcopy(model)
    expected = _train(local, x, y, steps)
    remote = model.cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback
        got = _train(torch.compile(remote), x.cuda(), y.cuda(), steps)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(local.state_dict().items(), remote.state_dict().items()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6, msg=name)
    return local, remote


def test_mlp_training_equals_local(remote):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    _compiled_vs_local(model, x, y)


def test_cnn_with_batchnorm_training_then_eval_equals_local(remote):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 2 * 2, 5))
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    local, remote_model = _compiled_vs_local(model, x, y)  # running stats included: they land on the buffers
    local.eval()
    compiled = torch.compile(remote_model.eval())
    with torch.no_grad():
        torch.testing.assert_close(compiled(x.cuda()).cpu(), local(x), rtol=1e-5, atol=1e-6)


def test_inference_function_with_pytree_outputs(remote):
    def f(x, w, *, scale):
        h = torch.relu(x @ w) * scale
        return {"h": h, "sum": h.sum(1), "n": h.shape[0]}

    compiled = torch.compile(f)
    x, w = torch.randn(5, 7), torch.randn(7, 3)
    expected = f(x, w, scale=0.5)
    with torch.no_grad():
        got = compiled(x.cuda(), w.cuda(), scale=0.5)
    assert got["n"] == 5
    torch.testing.assert_close(got["h"].cpu(), expected["h"])
    torch.testing.assert_close(got["sum"].cpu(), expected["sum"])


def test_a_none_among_the_outputs_is_returned_as_none(remote):
    """nanoGPT's and llm.c's forward returns ``(logits, None)`` without targets and ``(None, loss)``
    with ``return_logits=False``: a None output kept its place (it was taken for a tensor's, and
    the call failed with StopIteration)."""
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 10)

        def forward(self, idx, targets=None, return_logits=True):
            logits = self.head(self.emb(idx))
            loss = None if targets is None else F.cross_entropy(logits.view(-1, 10), targets.view(-1))
            return (logits if return_logits else None), loss

    torch.manual_seed(5)
    local = LM()
    compiled = torch.compile(copy.deepcopy(local).cuda())
    idx, targets = torch.randint(0, 10, (2, 3)), torch.randint(0, 10, (2, 3))
    logits, loss = compiled(idx.cuda())
    assert loss is None
    torch.testing.assert_close(logits.cpu(), local(idx)[0])
    logits, loss = compiled(idx.cuda(), targets.cuda(), return_logits=False)
    assert logits is None
    torch.testing.assert_close(loss.cpu(), local(idx, targets)[1])
    assert not compiled.__dict__["_compiled"].warned


@contextmanager
def enqueued():
    """The names of the ops queued in the block (on any session)."""
    from remotecuda.session import Session
    names: list[str] = []
    enqueue = Session.enqueue

    def counting(self, name, *args):
        names.append(name)
        return enqueue(self, name, *args)
    Session.enqueue = counting
    try:
        yield names
    finally:
        Session.enqueue = enqueue


def test_a_graph_is_defined_once_then_run_as_one_op_per_call(remote):
    import remotecuda

    @torch.compile
    def f(x):
        for _ in range(20):  # 40 aten ops eagerly
            x = x * 1.01 + 0.01
        return x

    x = torch.randn(32).cuda()
    with enqueued() as first:
        y = f(x)
    with enqueued() as later:
        for _ in range(10):
            y = f(y)
    # (the trace also keeps the device's RNG state as it found it: rc::rng_get / rc::rng_set)
    assert first.count("rc::program_define") == 1 and first[-1] == "rc::program_run", first
    assert not any(n.startswith("aten::") for n in first), first
    assert later == ["rc::program_run"] * 10
    torch.cuda.synchronize()
    remotecuda.stats(reset=True)
    y = f(y)
    assert remotecuda.stats()["ops"] == 1
    expected = x.cpu()
    for _ in range(12 * 20):
        expected = expected * 1.01 + 0.01
    torch.testing.assert_close(y.cpu(), expected)


def test_a_training_step_is_one_op_forward_and_one_backward(remote):
    torch.manual_seed(2)
    model = torch.compile(nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)]).cuda())
    x = torch.randn(4, 32).cuda()
    model(x).sum().backward()  # traces the forward and backward
    with enqueued() as names:
        model(x).sum().backward()
    assert names.count("rc::program_run") == 2
    assert "rc::program_define" not in names
    assert not any(n.startswith(("aten::addmm", "aten::mm")) for n in names), names


def test_dropout_draws_from_the_gateway_generator_as_eager_does(remote):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5)).cuda()
    x = torch.randn(4, 8).cuda()
    torch.cuda.manual_seed(7)
    eager = model(x)
    eager.square().sum().backward()
    eager_grad = model[0].weight.grad.cpu()
    model.zero_grad()
    compiled = torch.compile(model)
    torch.cuda.manual_seed(7)
    got = compiled(x)
    got.square().sum().backward()
    # the same draws, from the same generator, in the same order; and the same mask in backward
    torch.testing.assert_close(got.detach().cpu(), eager.detach().cpu())
    torch.testing.assert_close(model[0].weight.grad.cpu(), eager_grad)
    assert (got == 0).any() and (got != 0).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_is_traced_with_cudas_casts(remote, dtype):
    """nanoGPT's GPU path: a compiled model called inside ``torch.autocast('cuda')``. The graph
    holds CUDA autocast's casts (linear in the low dtype, layer_norm and the loss in float32,
    their gradients cast back), so a step equals eager autocast's and runs as graphs, not eagerly;
    a call outside autocast is another trace, in float32."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.ln, self.head = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

        def forward(self, x, y):
            h = self.ln(F.gelu(self.fc(x)))
            logits = self.head((h @ h.mT).softmax(-1) @ h)
            return logits, F.cross_entropy(logits, y)

    torch.manual_seed(4)
    eager = Net().cuda()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model)
    x, y = torch.randn(4, 16).cuda(), torch.randint(0, 8, (4,)).cuda()
    results = []
    for net, call in ((eager, eager), (model, compiled)):
        with torch.autocast("cuda", dtype=dtype):
            logits, loss = call(x, y)
        loss.backward()
        results.append([logits.dtype, loss.dtype, logits.float().cpu(), loss.cpu(),
                        *(p.grad.cpu() for p in net.parameters())])
    assert results[0][:2] == [dtype, torch.float32]
    assert results[1][:2] == results[0][:2]
    torch.testing.assert_close(results[1][2:], results[0][2:], rtol=0, atol=0)
    with enqueued() as names, torch.autocast("cuda", dtype=dtype):
        compiled(x, y)
    assert names == ["rc::program_run"], names
    assert compiled(x, y)[0].dtype == torch.float32
    assert not compiled.__dict__["_compiled"].warned


def test_a_branch_on_a_value_runs_eagerly_with_one_warning(remote):
    def f(x):
        if x.sum() > 0:
            return x * 2
        return x - 1

    compiled = torch.compile(f)
    xs = [torch.randn(6) for _ in range(3)] + [torch.ones(6), -torch.ones(6)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [compiled(x.cuda()).cpu() for x in xs]
    eager = [str(w.message) for w in caught if "eagerly" in str(w.message)]
    assert len(eager) == 1, eager
    assert "reads a tensor's value" in eager[0]
    for x, g in zip(xs, got):
        torch.testing.assert_close(g, f(x))


def test_a_forward_that_keeps_a_tensor_or_fills_a_list_runs_eagerly(remote):
    """A trace cannot repeat such stores at each run, and would have left its stand-in tensors
    there (the attribute was a FunctionalTensor, and ``cpu()`` of it failed)."""
    class Keeps(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.last, self.calls = nn.Linear(4, 4), None, []

        def forward(self, x):
            h = self.lin(x)
            self.last = h.detach()
            self.calls.append(x.shape[0])
            return h.relu().sum()

    model = Keeps().cuda()
    compiled = torch.compile(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (2, 2, 3):
            x = torch.randn(n, 4)
            compiled(x.cuda())
            w, b = model.lin.weight.cpu(), model.lin.bias.cpu()
            torch.testing.assert_close(model.last.cpu(), x @ w.T + b)
    assert model.calls == [2, 2, 3]
    eager = [str(w.message) for w in caught if "eagerly" in str(w.message)]
    assert len(eager) == 1 and "it changes Keeps.last while it runs" in eager[0], eager


def test_a_compiled_lstm_keeps_its_own_weight_list(remote):
    """nn.LSTM rebuilds its list of weights when they are swapped, as for the trace's stand-ins:
    the list is put back after the trace (it kept FunctionalTensors), and its rebuilding is no
    effect that keeps the call from being traced."""
    torch.manual_seed(3)
    lstm = nn.LSTM(4, 6, batch_first=True)
    x = torch.randn(2, 3, 4)
    expected = lstm(x)[0]
    remote_lstm = lstm.cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # traced, not eager
        compiled = torch.compile(remote_lstm)
        got = [compiled(x.cuda())[0].cpu() for _ in range(2)]
    for g in got:
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6)
    assert all(w is getattr(remote_lstm, n) for w, n in zip(remote_lstm._flat_weights, remote_lstm._flat_weights_names))
    torch.testing.assert_close(remote_lstm(x.cuda())[0].cpu(), expected, rtol=1e-5, atol=1e-6)


def test_a_compiled_training_step_runs_eagerly_saying_it_runs_backward(remote):
    """``@torch.compile`` on a whole step (forward, ``loss.backward()``, ``opt.step()``), as
    compiled-optimizer tutorials write it: the step runs eagerly, with the same values, and the
    warning says why (PyTorch's own message, "Cannot backprop through mirrored meta, file a bug
    in PyTorch", said nothing the user could act on)."""
    torch.manual_seed(6)
    local = nn.Linear(8, 2)
    model = copy.deepcopy(local).cuda()
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))

    def make_step(net: nn.Module) -> object:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            return loss
        return step

    step, expected = torch.compile(make_step(model)), make_step(local)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [step(x.cuda(), y.cuda()).item() for _ in range(2)]
    torch.testing.assert_close(got, [expected(x, y).item() for _ in range(2)])
    torch.testing.assert_close(model.weight.cpu(), local.weight)
    eager = [str(w.message) for w in caught if "eagerly" in str(w.message)]
    assert len(eager) == 1 and "runs backward() or autograd.grad() inside" in eager[0], eager


def test_a_cpu_model_goes_to_torchs_own_compile(remote):
    """A model on the CPU (``Trainer(torch_compile=True, use_cpu=True)``) is compiled by Dynamo, as
    plain PyTorch compiles it, with remotecuda's mode stepped aside; it ran eagerly with a warning."""
    from torch._dynamo.utils import counters
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    local = copy.deepcopy(model)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    graphs = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _train(torch.compile(model, backend="eager"), x, y, 3)
        scaled = torch.compile(lambda t: t.sin() + 1, backend="eager")(torch.ones(3))
    assert counters["stats"]["unique_graphs"] > graphs
    torch.testing.assert_close(got, _train(local, x, y, 3))
    for (name, a), (_, b) in zip(local.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(b, a, msg=name)
    torch.testing.assert_close(scaled, torch.ones(3).sin() + 1)
    with interception_removed():  # (what Dynamo compiled while active is dropped: its guards read 'cuda' state)
        torch.testing.assert_close(torch.compile(copy.deepcopy(local), backend="eager")(x), local(x))


def test_a_cpu_call_that_makes_cuda_tensors_runs_eagerly_with_a_warning(remote):
    def f(x):
        return (x.cuda() * 2 + torch.ones(3, device="cuda")).cpu()

    compiled = torch.compile(f, backend="eager")
    with pytest.warns(UserWarning, match="eagerly: it makes 'cuda' tensors"):
        out = compiled(torch.ones(3))
    torch.testing.assert_close(out, torch.full((3,), 3.0))
    torch.testing.assert_close(compiled(torch.zeros(3)), torch.ones(3))


def test_a_cpu_scalar_argument_is_traced_not_run_eagerly(remote):
    """A diffusers pipeline calls its compiled UNet with a timestep from the scheduler's CPU
    ``timesteps``: a GPU's compiled graph takes a 0-d CPU tensor beside 'cuda' ones."""
    torch.manual_seed(0)
    local = nn.Linear(4, 4)
    lin = copy.deepcopy(local).cuda()

    def f(x, t):
        return lin(x * t)

    x, ts = torch.randn(2, 4), (torch.tensor(3.0), torch.tensor(5.0))
    compiled = torch.compile(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback
        got = [compiled(x.cuda(), t).cpu() for t in ts]
    for g, t in zip(got, ts):
        torch.testing.assert_close(g, local(x * t))


def test_tensors_made_from_numbers_inside_the_call_are_built_in_the_graph(remote):
    """``torch.tensor([t], device=x.device)`` in a traced forward (a diffusers UNet given an int
    timestep) is a constant of the graph; the call ran eagerly with a warning."""
    torch.manual_seed(0)
    local = nn.Linear(4, 4)
    lin = copy.deepcopy(local).cuda()

    def step(model, x, t):
        ts = torch.tensor([t], dtype=torch.long, device=x.device)
        return model(x) * ts.float() + torch.tensor([[1.0, 2.0, 3.0, 4.0]], device=x.device) + torch.tensor(0.5)

    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.compile(lambda x, t: step(lin, x, t))(x.cuda(), 3)
        got.sum().backward()
    want = step(local, x, 3)
    want.sum().backward()
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(lin.weight.grad.cpu(), local.weight.grad)


def test_a_causal_lm_is_traced_as_under_dynamo(remote):
    """transformers skips its checks of values (the position ids' packed-sequence test) while
    ``torch.compiler.is_compiling()``, as it is under Dynamo; the call read one and ran eagerly."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    local = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         hidden_size=16, intermediate_size=32, vocab_size=64))
    model, ids = copy.deepcopy(local).cuda(), torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(model)(input_ids=ids.cuda(), labels=ids.cuda(), use_cache=False)
        got.loss.backward()
    assert not [str(w.message) for w in caught if "eagerly" in str(w.message)]
    want = local(input_ids=ids, labels=ids, use_cache=False)
    want.loss.backward()
    torch.testing.assert_close(got.logits.detach().cpu(), want.logits.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.lm_head.weight.grad.cpu(), local.lm_head.weight.grad, rtol=1e-5, atol=1e-6)


def test_a_generator_argument_is_traced_past_unless_drawn_from(remote):
    """diffusers' pipelines pass their generator to a compiled ``vae.decode``, which ignores it:
    that call ran eagerly. One that draws from it still does, and its draws are eager's."""
    torch.manual_seed(0)
    local = nn.Linear(4, 4)
    lin = copy.deepcopy(local).cuda()

    def unused(x, generator=None):
        return lin(x) + 1

    def used(x, generator=None):
        return lin(x) + torch.randn(x.shape, generator=generator).to(x.device)

    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(unused)
        got = [compiled(x.cuda(), generator=torch.Generator().manual_seed(i)).cpu() for i in range(2)]
        drawn = torch.compile(used)(x.cuda(), generator=torch.Generator().manual_seed(3)).cpu()
    eager = [str(w.message) for w in caught if "eagerly" in str(w.message)]
    assert len(eager) == 1 and ".used eagerly: it draws from a torch.Generator" in eager[0], eager
    for g in got:
        torch.testing.assert_close(g, local(x) + 1)
    torch.testing.assert_close(drawn, local(x) + torch.randn(x.shape, generator=torch.Generator().manual_seed(3)))


def test_a_view_keeps_the_traced_strides_of_its_size_one_dims(remote):
    """A fake tensor's view strides a size-1 dim unlike C++'s; the CPU group norm after it (a
    diffusers UNet's attention block at batch 1) checked its input's memory format and failed."""
    def f(x):
        return F.group_norm(x.transpose(1, 2).view(1, 16, 2, 2) + 1, 4)

    x = torch.randn(1, 4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.compile(f)(x.cuda())
    torch.testing.assert_close(got.cpu(), f(x))


@pytest.mark.parametrize("nodes, says", [
    ([["aten::save.default", [Handle(0), "/tmp/x"], {}]], "not allowed"),
    ([["os::system", ["true"], {}]], "namespace 'os' is not allowed"),
    ([["aten::add.Tensor", [Handle(0), Handle(3)], {}]], "not defined before it"),
    ([["aten::add.Tensor", [Handle(0), b"\x00"], {}]], "argument of type bytes"),
    ([["getitem", [Handle(0), "x"], {}]], "getitem takes"),
])
def test_a_graph_outside_the_allowlist_is_refused_and_the_gateway_serves_on(remote, nodes, says):
    x = torch.arange(4.0).cuda()
    s = x._s
    s.enqueue("rc::program_define", [987654, 1, nodes, [1], [[1]]], None, None)
    with pytest.raises(Exception, match=says):
        torch.cuda.synchronize()
    h = s.new_handle()
    s.enqueue("rc::program_run", [987654, [x._w]], None, [h])
    with pytest.raises(Exception, match="unknown to the gateway"):
        torch.cuda.synchronize()
    torch.testing.assert_close((x + 1).cpu(), torch.arange(4.0) + 1)



def test_an_error_inside_a_graph_is_an_op_error_naming_its_node(remote):
    x = torch.ones(2, 3).cuda()
    s = x._s
    s.enqueue("rc::program_define", [987655, 1, [["aten::mm.default", [Handle(0), Handle(0)], {}]], [1], [[3, 1]]],
              None, None)
    h = s.new_handle()
    s.enqueue("rc::program_run", [987655, [x._w]], None, [h])
    with pytest.raises(RuntimeError, match=r"in compiled graph node 0, aten::mm.default"):
        torch.cuda.synchronize()
    torch.testing.assert_close((x * 2).cpu(), torch.full((2, 3), 2.0))

def test_tied_weights_and_a_step_function_naming_its_model(remote):
    torch.manual_seed(4)
    emb, head = nn.Embedding(11, 8), nn.Linear(8, 11, bias=False)
    head.weight = emb.weight
    local = nn.Sequential(emb, nn.LayerNorm(8), head)
    model = copy.deepcopy(local).cuda()
    idx = torch.randint(0, 11, (3, 5))

    def loss_of(m, i):
        return F.cross_entropy(m(i).flatten(0, 1), i.flatten())
    loss_of(local, idx).backward()

    def step(i):  # names the model through its closure: its parameters become graph inputs
        return loss_of(model, i)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = torch.compile(step)(idx.cuda())
    loss.backward()
    torch.testing.assert_close(loss.item(), loss_of(local, idx).item())
    torch.testing.assert_close(model[0].weight.grad.cpu(), local[0].weight.grad, rtol=1e-5, atol=1e-6)


def test_the_fx_graph_inductor_gets_computes_what_the_steps_do():
    """What a CUDA gateway hands inductor (no GPU here: the graph itself, run by FX on the CPU)."""
    from remotecuda_server.ops import OpResolver
    from remotecuda_server.programs import Program
    nodes = [["aten::native_dropout.default", [Handle(0), 0.0, True], {}], ["getitem", [Handle(2), 0], {}],
             ["aten::addmm.default", [Handle(1), Handle(3), Handle(0)], {"alpha": 2}],
             ["aten::ones.default", [[3]], {"device": torch.device("cuda", 0), "dtype": torch.float32}],
             ["aten::add.Tensor", [Handle(4), Handle(5)], {}]]
    p = Program(OpResolver(), torch.device("cpu"), 2, nodes, [6, 3], [[1, 3], [3, 1]])
    x, b = torch.randn(3, 3), torch.randn(3)
    got = p.run([x, b])
    expected = torch.addmm(b, x, x, alpha=2) + 1
    torch.testing.assert_close(got[0], expected)
    assert got[0].stride() == (1, 3)  # laid out with the strides asked for
    fx_out = p.graph_module()(x, b)
    torch.testing.assert_close(fx_out[0], expected)
    torch.testing.assert_close(fx_out[1], x)


FAILOVER_CLIENT = textwrap.dedent(r'''
    import json, os, signal, sys, torch, remotecuda
    pids = json.loads(sys.argv[1])
    remotecuda.activate(fallback="error")

    def run(kill_at):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 1)).cuda()
        step = torch.compile(m)
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for i in range(30):
            if i == kill_at:
                os.kill(pids[remotecuda.stats()["devices"][0]["gateway"][6:]], signal.SIGKILL)
            x, y = torch.randn(32, 16, generator=g).cuda(), torch.randn(32, 1, generator=g).cuda()
            loss = ((step(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().cpu() for p in m.parameters()]

    ref = run(-1)
    got = run(20)
    st = remotecuda.stats()
    print("RESULT", all(torch.equal(a, b) for a, b in zip(ref, got)), len(st["failovers"]),
          st["replay_log"]["snapshots"], flush=True)
    remotecuda.deactivate()
''')


def test_compiled_graphs_survive_a_failover_after_a_snapshot():
    """A gateway killed after snapshots were taken: the graphs defined before them are defined
    again on the new gateway (replay_log's sticky ops), and training ends bit-identical."""
    gws = [GatewayProcess(), GatewayProcess()]
    try:
        env = dict(os.environ, REMOTECUDA_SERVERS=",".join(gw.address for gw in gws),
                   REMOTECUDA_SNAPSHOT_BYTES="10000")
        r = subprocess.run([sys.executable, "-c", FAILOVER_CLIENT,
                            json.dumps({gw.address: gw.proc.pid for gw in gws})],
                           capture_output=True, text=True, timeout=150, cwd=ROOT, env=env)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
        assert line, r.stdout + r.stderr[-3000:]
        _, same, failovers, snapshots = line[0].split()
        assert same == "True" and failovers == "1" and int(snapshots) > 0, (line, r.stderr[-3000:])
    finally:
        for gw in gws:
            gw.stop()
