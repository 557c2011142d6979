"""What the program-parity test files share: a registry of programs, each run once on 'cuda'
(through the gateway) and once on the local CPU, and the comparison of their results."""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch


def registry() -> tuple[dict[str, Callable[[str], Any]], Callable]:
    """A file's programs by name, and the decorator that registers one (``fn(device) -> result``)."""
    cases: dict[str, Callable[[str], Any]] = {}

    def case(fn: Callable[[str], Any]) -> Callable:
        cases[fn.__name__] = fn
        return fn
    return cases, case


def data(*shape: int, seed: int = 0) -> torch.Tensor:
    """Seeded CPU data, the same on both runs whatever the device's generator does."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return [to_cpu(v) for v in x]
    return x


def assert_matches_local(fn: Callable[[str], Any]) -> None:
    got, want = to_cpu(fn("cuda")), to_cpu(fn("cpu"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)


Findings = Callable[[Any], dict[str, torch.Tensor]]


def _one_training_step(model: torch.nn.Module, step: Callable[[torch.nn.Module, str], Any],
                       loss_of: Callable[[Any], torch.Tensor], outputs_of: Findings,
                       decodes: Callable | None, dev: str) -> dict[str, torch.Tensor]:
    model.to(dev).train()
    torch.manual_seed(0)
    out = step(model, dev)
    loss = loss_of(out)
    loss.backward()
    found = {"loss": loss, "grads": torch.stack([p.grad.float().norm() for p in model.parameters()
                                                  if p.grad is not None])}
    found.update(outputs_of(out))
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    found["stepped"] = torch.stack([p.detach().float().norm() for p in model.parameters()])
    if decodes is not None:
        model.eval()
        with torch.no_grad():
            found.update(decodes(model, dev))
    return {k: v.detach().cpu().double() for k, v in found.items()}


def assert_architecture_matches_local(name: str, model: torch.nn.Module,
                                      step: Callable[[torch.nn.Module, str], Any],
                                      loss_of: Callable[[Any], torch.Tensor], outputs_of: Findings,
                                      decodes: Callable | None = None) -> None:
    """One training step of ``model`` (a forward, its loss's backward, an AdamW step; then ``decodes``
    under no_grad) on 'cuda' matches a deep copy's on the CPU: the Hugging Face zoo files' check.
    Dropouts are switched off: the configs name theirs differently, and they are not what is compared."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    twin = copy.deepcopy(model)
    expected = _one_training_step(model, step, loss_of, outputs_of, decodes, "cpu")
    got = _one_training_step(twin, step, loss_of, outputs_of, decodes, "cuda")
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{name} {k}: {m}")
