"""Well-known single-file programs, round 5, shrunk (tiny sizes, few steps, seeded, synthetic
data) and run unchanged with plain ``python`` (the local CPU) and under ``remotecuda run`` on a
CPU gateway; the JSON each prints last must agree value by value (tests/test_corpus.py's rules).
Beside them, the fidelity bugs they found, each shown directly."""
from __future__ import annotations

import pytest
import torch
from local_parity import data as D

pytestmark = pytest.mark.usefixtures("remote")


def test_lstsq_on_cuda_is_cudas_gels():
    """efficient-kan fits its spline coefficients with ``torch.linalg.lstsq`` on the device. CUDA's
    one driver is ``gels``, its default: no rank, residuals for a tall full-rank system; the CPU's
    default ``gelsy`` gave the rank and empty residuals, and took drivers CUDA refuses."""
    A, B = D(3, 10, 4), D(3, 10, 2, seed=1)
    want = torch.linalg.lstsq(A, B, driver="gels")
    got = torch.linalg.lstsq(A.cuda(), B.cuda())
    assert got.rank.shape == (0,) and got.rank.dtype == torch.int64
    torch.testing.assert_close(got.residuals.cpu(), want.residuals)
    torch.testing.assert_close(got.solution.cpu(), want.solution)
    with pytest.raises(RuntimeError, match="`driver` other than `gels` is not supported on CUDA"):
        torch.linalg.lstsq(A.cuda(), B.cuda(), driver="gelsd")
