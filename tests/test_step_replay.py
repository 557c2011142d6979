"""Step replay (remotecuda/step_replay.py): a model's repeated calls traced once and replayed on a
real gateway as one op each; every result compared with the same loop run locally on the CPU."""
from __future__ import annotations

import copy
import json
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import run_python


@pytest.fixture
def replaying(remote):
    """The run's activation with replay on for the test (as ``activate(replay=True)`` has it)."""
    from remotecuda import interception
    remote.interception.remove()
    remote.replay = True
    remote.interception = interception.install(remote)
    yield remote
    remote.interception.remove()
    remote.replay = False
    remote.interception = interception.install(remote)


class Encoder(nn.Module):
    """Many ops per parameter (attention, layer norms) and a batch norm's buffers."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.norm, self.head = nn.BatchNorm1d(16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.enc(x).mean(1)))


def _steps(model: nn.Module, batches: list, rt=None) -> tuple[list[float], list[int]]:
    """SGD steps over ``batches``; the losses, and the ops each step sent (with ``rt``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, ops = [], []
    for x, y in batches:
        before = rt.pool.counters()["ops"] if rt else 0
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        ops.append(rt.pool.counters()["ops"] - before if rt else 0)
    return losses, ops


def _on_cuda(batches: list) -> list:
    return [(x.cuda(), y.cuda()) for x, y in batches]


def _close(remote_model: nn.Module, local_model: nn.Module) -> None:
    for (name, a), (_, b) in zip(local_model.state_dict().items(), remote_model.state_dict().items()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5, msg=name)


def test_a_repeated_training_step_is_replayed_with_eager_results(replaying):
    torch.manual_seed(0)
    model = Encoder()
    batches = [(torch.randn(4, 6, 16), torch.randint(0, 3, (4,))) for _ in range(6)]
    local = copy.deepcopy(model)
    expected, _ = _steps(local, batches)
    remote = model.cuda()
    got, ops = _steps(remote, _on_cuda(batches), replaying)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    _close(remote, local)
    # step 0 eager, step 1 traced, then replayed: the forward and backward one op each
    assert max(ops[2:]) * 3 < ops[0], ops
    remote.eval()
    local.eval()
    with torch.no_grad():
        for _ in range(3):  # (eval and no_grad: another signature, traced at its second call)
            torch.testing.assert_close(remote(batches[0][0].cuda()).cpu(), local(batches[0][0]), rtol=1e-4, atol=1e-5)


def test_new_shapes_and_value_branches_fall_back_with_eager_results(replaying):
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if h.sum() > 0:  # a value read: this model is never replayed
                h = h * 2
            return self.b(h.relu())

    torch.manual_seed(1)
    for model in (Branchy(), nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))):
        sizes = [4, 4, 2, 4, 2, 2, 3, 4]  # a batch size seen once, twice, and alternating
        batches = [(torch.randn(n, 8) * (1 if i % 2 else -1), torch.randint(0, 2, (n,)))
                   for i, n in enumerate(sizes)]
        local = copy.deepcopy(model)
        expected, _ = _steps(local, batches)
        got, _ = _steps(model.cuda(), _on_cuda(batches), replaying)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        _close(model, local)


def test_hooks_and_attributes_a_forward_sets_stay_eager(replaying):
    class Keeps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)
            self.last: torch.Tensor | None = None
            self.seen: list[int] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x).tanh()
            self.last = h.detach()
            self.seen.append(len(self.seen))
            return self.b(h)

    torch.manual_seed(2)
    model = Keeps().cuda()
    calls = []
    for i in range(4):
        x = torch.randn(3, 8)
        out = model(x.cuda())
        assert isinstance(model.last, torch.Tensor) and model.last.device.type == "cuda"
        torch.testing.assert_close(model.last.cpu(), torch.tanh(x @ model.a.weight.cpu().T + model.a.bias.cpu()))
        assert model.seen == list(range(i + 1))
        torch.testing.assert_close(out.cpu(), model.last.cpu() @ model.b.weight.cpu().T + model.b.bias.cpu())
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).cuda()
    for _ in range(3):
        plain(torch.randn(2, 8, device="cuda"))
    plain[0].register_forward_hook(lambda m, i, o: calls.append(o.shape))
    for _ in range(3):  # replayed before the hook: with it, every call runs its Python again
        plain(torch.randn(2, 8, device="cuda"))
    assert calls == [torch.Size([2, 8])] * 3


def test_replay_is_off_unless_asked():
    from remotecuda import step_replay
    assert step_replay.wanted(None) is False
    assert step_replay.wanted(True) is True
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REMOTECUDA_REPLAY", "sometimes")
        with pytest.raises(ValueError, match="REMOTECUDA_REPLAY"):
            step_replay.wanted(None)
        mp.setenv("REMOTECUDA_REPLAY", "1")
        assert step_replay.wanted(None) is True


def test_the_variable_turns_it_on_for_a_program(gateway):
    code = textwrap.dedent(f"""
        import json, torch, torch.nn as nn, remotecuda
        rt = remotecuda.activate({gateway.address!r}, fallback="error")
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]).cuda()
        x = torch.randn(4, 8, device="cuda")
        ops = []
        for _ in range(4):
            before = rt.pool.counters()["ops"]
            model(x).sum().backward()
            ops.append(rt.pool.counters()["ops"] - before)
        print(json.dumps(ops))
    """)
    off = run_python(code)
    on = run_python(code, env={"REMOTECUDA_REPLAY": "1"})
    assert off.returncode == 0 and on.returncode == 0, off.stderr[-2000:] + on.stderr[-2000:]
    off_ops, on_ops = json.loads(off.stdout.splitlines()[-1]), json.loads(on.stdout.splitlines()[-1])
    assert on_ops[-1] * 2 < off_ops[-1], (off_ops, on_ops)


def _mlp(depth: int = 2) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, 3))


def _replayed_backward_ops(model: nn.Module, rt) -> int:
    """The ops a replayed training step's ``backward()`` sends, its gradients checked against
    local CPU torch's at each step."""
    batches = [(torch.randn(4, 8), torch.randint(0, 3, (4,))) for _ in range(4)]
    local = copy.deepcopy(model)
    opt = torch.optim.SGD(local.parameters(), lr=0.05)
    expected = []
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(local(x), y).backward()
        expected.append([p.grad.clone() for p in local.parameters()])
        opt.step()
    remote = model.cuda()
    opt = torch.optim.SGD(remote.parameters(), lr=0.05)
    for i, (x, y) in enumerate(_on_cuda(batches)):
        opt.zero_grad()
        loss = F.cross_entropy(remote(x), y)
        before = rt.pool.counters()["ops"]
        loss.backward()
        ops = rt.pool.counters()["ops"] - before
        for p, g in zip(remote.parameters(), expected[i]):
            assert p.grad is not None and p.grad.device.type == "cuda" and not p.grad.requires_grad
            torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-4, atol=1e-6)
        opt.step()
    _close(remote, local)
    return ops


def test_a_replayed_backward_stores_gradients_without_an_op_per_parameter(replaying):
    """The backward's gradients are stored in ``.grad`` as the graph gave them, where the engine's
    AccumulateGrad would send a ``detach`` per parameter and step: a replayed backward sends as
    many ops for 4 parameters as for 12."""
    torch.manual_seed(3)
    assert _replayed_backward_ops(_mlp(1), replaying) == _replayed_backward_ops(_mlp(5), replaying)


def _divergent_steps(model: nn.Module, batches: list, how: str) -> list[torch.Tensor]:
    """Training steps that use the gradients otherwise than storing them once: what each step
    leaves (the gradients it stored or returned, and the parameters) as CPU tensors."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    seen: list[torch.Tensor] = []
    if how == "tensor hook":
        params[0].register_hook(lambda g: g * 2)
    if how == "post-accumulate hook":
        params[1].register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.cpu().clone()))
    for k, (x, y) in enumerate(batches):
        if how != "accumulated" or k % 2 == 0:
            opt.zero_grad(set_to_none=how != "zeroed")
        if how == "requires_grad flipped" and k == 2:
            params[0].requires_grad_(False)
        loss = F.cross_entropy(model(x), y)
        if how == "autograd.grad":
            seen += [g.cpu() for g in torch.autograd.grad(loss, params)]
            assert all(p.grad is None for p in params)
            continue
        if how == "inputs=":
            loss.backward(inputs=params[2:])
            assert params[0].grad is None
        elif how == "retain_graph":
            loss.backward(retain_graph=True)
            loss.backward()
        else:
            loss.backward()
        if how == "clipped":
            torch.nn.utils.clip_grad_norm_(params, 0.1)
        if how == "grad changed in place":
            params[-1].grad.mul_(3)
        seen += [p.grad.cpu().clone() for p in params if p.grad is not None]
        if how != "accumulated" or k % 2 == 1:
            opt.step()
    return seen + [p.detach().cpu() for p in params]


@pytest.mark.parametrize("how", ["accumulated", "zeroed", "tensor hook", "post-accumulate hook", "autograd.grad",
                                 "inputs=", "retain_graph", "clipped", "grad changed in place",
                                 "requires_grad flipped"])
def test_gradients_used_otherwise_keep_eager_results(replaying, how):
    torch.manual_seed(4)
    model = _mlp()
    batches = [(torch.randn(4, 8), torch.randint(0, 3, (4,))) for _ in range(6)]
    expected = _divergent_steps(copy.deepcopy(model), batches, how)
    got = _divergent_steps(model.cuda(), _on_cuda(batches), how)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_gradient_the_backward_passes_through_is_stored_as_eager_stores_it(replaying):
    """A bias added last: its gradient is the backward's incoming gradient itself (a graph input),
    which AccumulateGrad copies; changing it in place must not change what the model returned."""
    class Shift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.zeros(4, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w + self.b

    torch.manual_seed(5)
    for model, dev in ((Shift(), "cpu"), (Shift().cuda(), "cuda")):
        for _ in range(4):
            out = model(torch.randn(4, 3, device=dev))
            upstream = torch.randn(4, 3, device=dev)
            model.zero_grad()
            out.backward(upstream)
            model.b.grad.mul_(2)
            torch.testing.assert_close(upstream.cpu() * 2, model.b.grad.cpu())


def _edit(model: nn.Module, k: int) -> None:
    """Step ``k``'s change to the model's tree, made alike to the local and the remote copy."""
    if k == 3:  # a parameter replaced by a new one (the old one's id may be reused)
        model[0].weight = nn.Parameter(model[0].weight.detach() * 0.5)
    elif k == 5:  # a submodule replaced
        model[2] = nn.Linear(16, 16).to(model[0].weight.device)
        model[2].load_state_dict({"weight": torch.full((16, 16), 0.01), "bias": torch.zeros(16)})
    elif k == 7:  # one submodule's training flag
        model[3].eval()
    elif k == 9:  # a buffer added to a submodule, a parameter frozen in place
        model[0].register_buffer("extra", torch.ones(1, device=model[0].weight.device))
        model[4].weight.requires_grad_(False)
    elif k == 11:  # a submodule added
        model.append(nn.Identity())


def _edited_steps(model: nn.Module, batches: list) -> list[torch.Tensor]:
    out = []
    for k, x in enumerate(batches):
        _edit(model, k)
        for p in model.parameters():
            p.grad = None
        y = model(x)
        y.pow(2).mean().backward()
        out += [y.detach().cpu(), *(p.grad.cpu() for p in model.parameters() if p.grad is not None)]
    return out


def test_a_model_changed_between_replayed_calls_gives_eager_results(replaying):
    """A replayed call reuses its last walk of the module tree (compiled.Tree) while the tree's
    fingerprint holds: a parameter, buffer or submodule replaced or added, a training flag or
    ``requires_grad`` changed, each between replayed calls, gives what the changed model gives."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.0), nn.Linear(16, 3))
    batches = [torch.randn(4, 8) for _ in range(14)]
    expected = _edited_steps(copy.deepcopy(model), batches)
    got = _edited_steps(model.cuda(), [x.cuda() for x in batches])
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_replayed_call_does_not_walk_the_modules_again(replaying, monkeypatch):
    """Walking the tree (``named_parameters()``, ``modules()``...) at each call was ~4k client
    instructions per op of a replayed MLP step; a replayed call reads its cached walk."""
    walks = []
    for name in ("named_parameters", "named_buffers", "named_modules"):
        original = getattr(nn.Module, name)

        def counted(self, *args, _original=original, **kwargs):
            walks.append(type(self).__name__)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(nn.Module, name, counted)
    model = _mlp().cuda()
    x = torch.randn(4, 8, device="cuda")
    for _ in range(3):  # eager, traced, replayed
        model(x).sum().backward()
    walks.clear()
    for _ in range(3):
        model(x).sum().backward()
    assert walks == []


class _Counted(nn.Module):
    """A forward that sets a plain attribute: the trace keeps it as an effect of the call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.batch = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batch = x.shape[0]
        return self.lin(x)


@pytest.mark.parametrize("calls", [1, 4])
@pytest.mark.parametrize("kind", [nn.Linear, _Counted])
def test_a_module_called_under_replay_is_freed(replaying, calls, kind):
    """Step replay's table of modules is keyed weakly by the module, and what it holds (the
    module's Compiled, its tree and traces) refers to the module weakly: a module called once
    (eager), or traced and replayed, is freed when the program drops it."""
    import gc
    import weakref
    m = (kind(4, 4) if kind is nn.Linear else kind()).cuda()
    x = torch.randn(3, 4, device="cuda")
    for _ in range(calls):
        m(x).sum().backward()
    if kind is _Counted:
        assert m.batch == 3
    r = weakref.ref(m)
    del m
    gc.collect()
    assert r() is None
