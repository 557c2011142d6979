"""Output layouts where torch's kernels and meta kernels disagree: the strides the client reports
for an op's output must be those of the tensor the gateway holds, or what the program plans on
them (``y.view(-1)``, ``y.as_strided(...)``, a kernel reading the storage) fails on the gateway or
reads its values in another order, while ``y.cpu()`` (fetched in the gateway's own layout) looks
right.

The cases were found by tests/scripts/layout_sweep.py (every OpInfo's samples, forward and
backward, with inputs transposed, channels-last, broadcast and sliced, the client's metadata
compared with the gateway's tensors). Two kinds:

- the CPU's kernel lays its output out otherwise than CUDA's, whose layout the meta kernel (so the
  client) gives: the gateway conforms (remotecuda_server/cuda_kernels.py, ``META_LAYOUT``);
- torch's Python meta kernel follows the input's strides where the kernels (shared by CPU and
  CUDA) return a contiguous tensor: the client's metadata follows the kernels
  (remotecuda_wire/layouts.py, ``CONTIGUOUS``).
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.usefixtures("remote")


def _randn(*shape: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _transposed(x: torch.Tensor) -> torch.Tensor:
    """x's values, its last two dimensions stored transposed (laid out where x is)."""
    return x.mT.contiguous().mT


def _grad(fn: Callable, x: torch.Tensor) -> list:
    """[output, gradient of (output * fixed weights).sum() with respect to x]."""
    x = x.detach().requires_grad_()
    y = fn(x)
    (g,) = torch.autograd.grad(y, x, _transposed(_randn(*y.shape, seed=1, device=x.device.type)))
    return [y.detach(), g]


def _unpool(x: torch.Tensor) -> torch.Tensor:
    return F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2)


#: name → the outputs to check, computed on the device given
CASES: dict[str, Callable[[str], list]] = {
    # LAPACK's Vh and eigenvectors are column-major, cuSOLVER's path's row-major
    "svd": lambda d: list(torch.linalg.svd(_randn(5, 4, device=d), full_matrices=False)),
    "svd_full": lambda d: list(torch.linalg.svd(_randn(3, 4, 5, device=d))),
    "eig": lambda d: list(torch.linalg.eig(_randn(5, 5, device=d))),
    # pocketfft's and cuFFT's multi-dimensional real-to-complex outputs
    "rfftn": lambda d: [torch.fft.rfftn(_randn(4, 6, 5, device=d))],
    # the CPU keeps a channels-last input's layout, CUDA's output is contiguous
    "max_unpool2d": lambda d: [_unpool(_randn(2, 3, 4, 6, device=d).contiguous(memory_format=torch.channels_last))],
    # Python meta kernels follow a transposed input; the kernels (CPU and CUDA) are contiguous
    "pow_scalar": lambda d: [torch.pow(2, _transposed(_randn(4, 3, device=d)))],
    "isin": lambda d: [torch.isin(_transposed(torch.arange(12, device=d).view(3, 4)), torch.tensor([1, 5], device=d))],
    "log_softmax_grad": lambda d: _grad(lambda x: F.log_softmax(x, -1), _transposed(_randn(4, 3, device=d))),
    "layer_norm_grad": lambda d: _grad(lambda x: F.layer_norm(x, (2,)), _transposed(_randn(3, 2, 2, device=d))),
}
#: outputs that are random draws (compared with themselves only)
RANDOM = {"standard_gamma": lambda d: [torch._standard_gamma(_transposed(_randn(4, 3, device=d)).abs() + 0.5)]}


def _assert_laid_out_as_told(y: torch.Tensor) -> None:
    """The gateway's storage holds y in the strides the client reports."""
    torch.testing.assert_close(y.as_strided(y.shape, y.stride(), y.storage_offset()).cpu(), y.cpu())
    if y.is_contiguous():
        torch.testing.assert_close(y.view(-1).cpu(), y.cpu().reshape(-1))


@pytest.mark.parametrize("name", list(CASES))
def test_output_is_laid_out_as_the_client_reports(name):
    got, want = CASES[name]("cuda"), CASES[name]("cpu")
    for y, expected in zip(got, want, strict=True):
        assert y.is_cuda
        _assert_laid_out_as_told(y)
        torch.testing.assert_close(y.cpu(), expected)


@pytest.mark.parametrize("name", list(RANDOM))
def test_random_output_is_laid_out_as_the_client_reports(name):
    for y in RANDOM[name]("cuda"):
        _assert_laid_out_as_told(y)


def _empty_outs(d: str, *dtypes: torch.dtype) -> tuple:
    return tuple(torch.empty(0, dtype=dt, device=d) for dt in dtypes)


_F, _L, _I = torch.float32, torch.int64, torch.int32
#: name → out= calls whose empty out tensors the kernel resizes, computed on the device given
OUT_RESIZED: dict[str, Callable[[str], tuple]] = {
    "add": lambda d: (torch.add(_randn(5, 4, device=d), 1, out=torch.empty(0, device=d)),),
    "add_wrong_size": lambda d: (torch.add(_randn(5, 4, device=d), 1, out=torch.empty(3, device=d)),),
    "max_dim": lambda d: torch.max(_randn(5, 4, device=d), 0, out=_empty_outs(d, _F, _L)),
    "sort": lambda d: torch.sort(_randn(5, 4, device=d), 0, out=_empty_outs(d, _F, _L)),
    "topk": lambda d: torch.topk(_randn(5, 4, device=d), 2, out=_empty_outs(d, _F, _L)),
    "frexp": lambda d: torch.frexp(_randn(5, 4, device=d), out=_empty_outs(d, _F, _I)),
}


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("name", list(OUT_RESIZED))
def test_out_tensor_the_kernel_resizes_takes_its_new_shape(name):
    """``torch.add(x, 1, out=torch.empty(0, device='cuda'))``: the kernel resizes the out tensor;
    its wrapper kept shape (0,), so ``out.shape`` lied and later ops on it were planned for an
    empty tensor while the gateway held the full one."""
    got, want = OUT_RESIZED[name]("cuda"), OUT_RESIZED[name]("cpu")
    for y, expected in zip(got, want, strict=True):
        assert (y.shape, y.stride()) == (expected.shape, expected.stride())
        _assert_laid_out_as_told(y)
        torch.testing.assert_close((y * 2).cpu(), expected * 2)
