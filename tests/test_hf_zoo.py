"""Found by sweeping transformers' model registries (every causal LM, masked LM, seq2seq, image and
sequence classifier built from a shrunken config, forward + backward + greedy generate on 'cuda'
against the CPU): the ops those models reach that the common path got wrong. Each test shows one
cause with torch alone; the architectures that reached it run in test_hf_architectures.py."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("remote")


@pytest.mark.parametrize("op", ["mm", "bmm", "addmm", "baddbmm"])
def test_matmul_out_dtype_as_cuda_computes_it(op):
    """``torch.mm(a, b, out_dtype=torch.float32)`` has CUDA kernels only (Kolibri's and Ergo's MoE
    routers take it on 'cuda' under no_grad): half/bfloat16 operands, a float32 product not
    rounded to bfloat16. A CPU gateway gives the float32 product of the widened operands."""
    g = torch.Generator().manual_seed(0)
    batch = (3,) if op.startswith("b") else ()
    a = torch.randn(*batch, 4, 8, generator=g).bfloat16()
    b = torch.randn(*batch, 8, 5, generator=g).bfloat16()
    c = torch.randn(*batch, 4, 5, generator=g)
    fn = getattr(torch, op)
    operands = (a, b) if op in ("mm", "bmm") else (c, a, b)
    expected = fn(*(t.float() for t in operands))
    got = fn(*(t.cuda() for t in operands), out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), expected)
    with pytest.raises(RuntimeError, match="out_dtype must be the same as input dtype or fp32"):
        fn(*(t.cuda().float() for t in operands), out_dtype=torch.bfloat16).cpu()
