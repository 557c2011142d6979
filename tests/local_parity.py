"""What the program-parity test files share: a registry of programs, each run once on 'cuda'
(through the gateway) and once on the local CPU, and the comparison of their results."""
from __future__ import annotations

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
