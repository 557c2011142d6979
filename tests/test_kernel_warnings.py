"""Warnings raised by kernels on the gateway reach the program, as a GPU's reach it at the call:
here at the next sync point, with torch's category and words (remote_warnings.py,
remotecuda_server/kernel_warnings.py). Compared with the same code on the CPU."""
from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.usefixtures("remote")


def _resize_out(device: str) -> torch.Tensor:
    """``out=`` of the wrong shape: the kernel resizes it and warns (C++ TORCH_WARN, every time)."""
    out = torch.empty(2, device=device)
    torch.add(torch.ones(3, device=device), 1, out=out)
    return out


def _said(caught: list) -> list:
    return [(w.category, str(w.message)) for w in caught]


def test_a_kernel_warning_reaches_the_program_in_torch_words():
    """The resize warning stayed on the gateway (an OpOverload call does not turn C++ warnings into
    Python ones); the client saw only its Python meta kernel's, in other words, at a cache miss."""
    with warnings.catch_warnings(record=True) as local:
        warnings.simplefilter("always")
        _resize_out("cpu")
    with warnings.catch_warnings(record=True) as remote:
        warnings.simplefilter("always")
        got = _resize_out("cuda").tolist()
    assert got == [2.0, 2.0, 2.0] and _said(remote) == _said(local) and len(local) == 1
    assert remote[0].filename == __file__  # (the program's line, not remotecuda's)
    with warnings.catch_warnings(record=True) as again:  # a cache hit: the gateway still warns
        warnings.simplefilter("always")
        _resize_out("cuda").tolist()
    assert _said(again) == _said(local)


def test_a_byte_mask_write_warns_as_torch_does():
    """``index_put_`` with a uint8 mask: torch's deprecation warning, from the gateway's kernel."""
    x = torch.arange(4.0, device="cuda")
    mask = torch.tensor([1, 0, 1, 0], dtype=torch.uint8, device="cuda")
    with pytest.warns(UserWarning, match="indexing with dtype torch.uint8 is now deprecated"):
        x[mask] = torch.tensor([7.0, 8.0], device="cuda")
        assert x.tolist() == [7.0, 1.0, 8.0, 3.0]


def test_an_error_filter_raises_the_warning_and_the_session_goes_on():
    """Under ``simplefilter("error")`` the warning is raised as an exception (a GPU's at the op,
    here at the sync), and the session stays usable; a program that warns of nothing is silent."""
    out = _resize_out("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="An output with one or more elements was resized"):
            out.tolist()
        x = torch.arange(3.0, device="cuda")
        assert (x * 2).tolist() == [0.0, 2.0, 4.0] and out.tolist() == [2.0, 2.0, 2.0]


def test_deterministic_algorithms_warn_only_alerts_reach_the_program():
    """``use_deterministic_algorithms(True, warn_only=True)``: the device's kernels alert of their
    nondeterminism by warning (``put_`` does on the CPU, as many ops do on CUDA)."""
    def put(device: str) -> list:
        x = torch.zeros(5, device=device).put_(torch.tensor([0, 0], device=device), torch.ones(2, device=device))
        return x.tolist()
    # (torch.use_deterministic_algorithms imports torch._inductor first, seconds on a busy machine;
    # the setter it ends in is what remotecuda's flags follow)
    torch._C._set_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as local:
            warnings.simplefilter("always")
            expected = put("cpu")
        with warnings.catch_warnings(record=True) as remote:
            warnings.simplefilter("always")
            assert put("cuda") == expected
    finally:
        torch._C._set_deterministic_algorithms(False)
    assert _said(remote) == _said(local)
    assert "put_ does not have a deterministic implementation" in str(local[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert put("cuda") == expected  # (the setting is off again on the gateway too)


def test_a_warnings_category_is_kept():
    from remotecuda import remote_warnings
    with pytest.warns(DeprecationWarning, match="^old$"):
        remote_warnings.raise_again([["DeprecationWarning", "old"]])
    with pytest.warns(UserWarning, match="^odd$") as caught:  # (an unknown name; a malformed entry skipped)
        remote_warnings.raise_again([["NoSuchWarning", "odd"], "malformed"])
    assert len(caught) == 1


def test_a_warning_before_a_long_run_of_ops_is_not_lost():
    """The client paces a long stream with a sync marker every RUN_AHEAD ops, whose reply it
    takes by itself: the warnings that reply carried were dropped."""
    from remotecuda.session import RUN_AHEAD
    out = _resize_out("cuda")
    x = torch.zeros(1, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2 * RUN_AHEAD + 1):
            x.add_(1)
        assert x.item() == 2 * RUN_AHEAD + 1 and out.tolist() == [2.0, 2.0, 2.0]
    # (a ResourceWarning of an earlier test's file, collected meanwhile, is not the gateway's)
    assert [str(w.message)[:39] for w in caught if not issubclass(w.category, ResourceWarning)] == \
        ["An output with one or more elements was"]


def _warn_in_a_reading_loop(device: str) -> list:
    """One warning line run three times, a value read after each, under Python's default action
    (a warning shown once per line: Lightning's and transformers' deprecations in a training loop)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            warnings.warn("this argument is deprecated", FutureWarning, stacklevel=1)
            torch.randn(4, device=device).sum().item()
    return _said(caught)


def test_reading_values_keeps_a_warning_once_per_line():
    """Every download went through ``warnings.catch_warnings`` (to hide torch.frombuffer's
    read-only-buffer warning), and each change to the warning filters clears Python's record of
    the lines that already warned: a warning shown once on a GPU came back at every ``.item()``."""
    assert _warn_in_a_reading_loop("cuda") == _warn_in_a_reading_loop("cpu")
    assert len(_warn_in_a_reading_loop("cpu")) == 1
