"""Well-known single-file programs, round 5, shrunk (tiny sizes, few steps, seeded, synthetic
data) and run unchanged with plain ``python`` (the local CPU) and under ``remotecuda run`` on a
CPU gateway; the JSON each prints last must agree value by value (tests/test_corpus.py's rules).
The programs live in tests/corpus:

- llama_family: llama2.c's and gpt-fast's Llama (RoPE real and complex, GQA, SwiGLU, tied
  weights, fused AdamW on 'cuda', gradient accumulation), decoded greedily without a cache and
  with a static KV cache written by index_put and by index_copy_;
- mamba_kan: mamba-minimal's selective scan and efficient-kan's B-spline layers (lstsq fits,
  update_grid) trained with L-BFGS;
- whisper_decode: Whisper's encoder-decoder with a KV cache kept by forward hooks, its logit
  filters, greedy decoding and a beam search;
- dit_diffusion: DiT's adaLN-Zero transformer with the GaussianDiffusion of NumPy schedules, the
  hybrid loss, classifier-free guided DDPM and DDIM sampling;
- ddpm_unet_einops: denoising-diffusion-pytorch's einops U-Net (weight standardization, linear
  attention, min-SNR weights, self-conditioning, DDIM);
- build_nanogpt: build-nanogpt's train_gpt2.py (bfloat16 autocast with gradient accumulation,
  the HellaSwag scorer, top-k sampling with a 'cuda' ``torch.Generator``).

Beside them, the fidelity bugs they found, each shown directly."""
from __future__ import annotations

import pytest
import torch
from local_parity import data as D
from test_corpus import F16, F32, assert_program_matches

pytestmark = pytest.mark.usefixtures("remote")

PROGRAMS = [  # (program in tests/corpus, the libraries it needs beyond torch and numpy, tolerance)
    ("llama_family", (), F32),
    ("mamba_kan", (), F32),
    ("whisper_decode", (), F32),
    ("dit_diffusion", (), F32),
    ("ddpm_unet_einops", ("einops",), F32),
    ("build_nanogpt", (), F16),  # (bfloat16 autocast: the CPU's policy locally, CUDA's remotely)
]


@pytest.mark.parametrize("name,libraries,tol", PROGRAMS, ids=[name for name, _, _ in PROGRAMS])
def test_program_matches_local(gateway, name: str, libraries: tuple[str, ...], tol: tuple[float, float]):
    """The program prints under ``remotecuda run`` what it prints with plain ``python``."""
    for library in libraries:
        pytest.importorskip(library)
    assert_program_matches(gateway, name, tol)


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


def _index(dev, dtype=torch.int32):
    return torch.tensor([2, 0], dtype=dtype, device=dev)


REFUSED_AT_THE_CALL = {  # checks a GPU's kernels make on the host, which these meta kernels skip
    "index_copy_int32_position": lambda d: torch.zeros(3, 4, device=d).index_copy_(
        0, _index(d), torch.ones(2, 4, device=d)),
    "index_copy_source_dtype": lambda d: torch.zeros(3, 4, device=d).index_copy(
        0, _index(d, torch.int64), torch.ones(2, 4, device=d, dtype=torch.float64)),
    "index_add_float_index": lambda d: torch.zeros(3, 4, device=d).index_add_(
        0, _index(d, torch.float32), torch.ones(2, 4, device=d)),
    "index_add_source_dtype": lambda d: torch.zeros(3, 4, device=d).index_add(
        0, _index(d), torch.ones(2, 4, device=d, dtype=torch.float16)),
    "index_fill_int32_index": lambda d: torch.zeros(3, 4, device=d).index_fill_(1, _index(d), 1.0),
    "put_int32_index": lambda d: torch.zeros(3, 4, device=d).put_(_index(d), torch.ones(2, device=d)),
    "bce_float64_labels": lambda d: torch.nn.functional.binary_cross_entropy(
        torch.full((3,), 0.5, device=d), torch.ones(3, device=d, dtype=torch.float64)),
    "polar_two_dtypes": lambda d: torch.polar(torch.ones(2, device=d), torch.ones(2, device=d, dtype=torch.float64)),
    "conv_float64_weight": lambda d: torch.nn.functional.conv1d(  # (numpy weights put in by .data)
        torch.zeros(1, 1, 5, device=d), torch.zeros(2, 1, 3, device=d, dtype=torch.float64)),
}


@pytest.mark.parametrize("name", sorted(REFUSED_AT_THE_CALL))
def test_refused_at_the_call(name):
    """gpt-fast keeps its decode position as an int32 tensor; written into a KV cache with
    ``index_copy_`` (not its ``cache[:, :, pos] = k``), a GPU refuses it at that line. These meta
    kernels take it, so the gateway's refusal came at the next sync point, lines later, after the
    ops queued since had been dropped. Now the signature is asked of the gateway at the call."""
    fn = REFUSED_AT_THE_CALL[name]
    with pytest.raises(Exception) as local:
        fn("cpu")
    torch.cuda.synchronize()
    with pytest.raises(type(local.value)) as remote:
        fn("cuda")
    assert str(remote.value).split("\n")[0] == str(local.value).split("\n")[0]
    torch.cuda.synchronize()  # (nothing was left pending)
