"""What CUDA's kernels accept that the CPU's refuse (or give otherwise), on a device the gateway
serves with its CPU.

A client's 'cuda' device may run on the CPU (``--device cpu``: the CPU itself or simulated
GPUs). Programs pick code paths by ``device.type == "cuda"`` and so call CUDA's kernels with
dtypes the CPU's do not take: every Hugging Face mixture-of-experts model counts tokens per
expert with ``torch.histc`` on int32 there (CPU: ``"histc_cpu" not implemented for 'Int'``).
Such an op, on CPU tensors, runs here as CUDA's kernel computes it, exactly; everything else
(and every op on a real GPU) runs its own kernel untouched.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._prims_common import suggest_memory_format

from remotecuda_wire import layouts

#: op name (all overloads) → the CUDA kernel's computation, called with the op's arguments when
#: the CPU kernel would refuse them or give otherwise (``None``: it gives what CUDA's does, run it)
INSTEAD: dict[str, Callable[[dict], Callable | None]] = {}
#: the integer dtypes of CUDA's ``AT_DISPATCH_ALL_TYPES``
_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _instead(*names: str) -> Callable:
    def register(fn: Callable) -> Callable:
        for name in names:
            INSTEAD[name] = fn
        return fn
    return register


#: ops whose CPU kernel lays an output out otherwise than CUDA's, whose layout the meta kernel
#: (and so the client's metadata) gives: the CPU's keeps a channels-last input's layout for pixel
#: and channel shuffles, reflection/replication pads and their gradients and max_unpool2d (CUDA's:
#: contiguous), and makes log-sigmoid's and rrelu's outputs and glu's input gradient contiguous
#: (the meta kernel: the input's strides). Whatever the input's layout, LAPACK leaves an SVD's Vh
#: and eig's eigenvectors column-major where cuSOLVER's path returns them row-major (the meta
#: kernels check for CUDA), and pocketfft lays a multi-dimensional real-to-complex FFT's output
#: out otherwise than cuFFT's plan (whose strides the meta kernel reproduces). Left so, a view or
#: an ``as_strided`` the client plans on its strides reads the gateway's storage in another order
#: (``Vh.view(-1)`` fails on the gateway).
META_LAYOUT = frozenset({
    "log_sigmoid_forward", "rrelu_with_noise", "glu_backward", "pixel_shuffle", "channel_shuffle",
    "native_channel_shuffle", "max_unpool2d", "_linalg_svd", "linalg_eig", "_fft_r2c",
    *(f"{kind}_pad{n}d{grad}" for kind in ("reflection", "replication")
      for n in (1, 2, 3) for grad in ("", "_backward"))})


def cuda_like(op: Any, fn: Callable) -> Callable:
    """``fn`` (the op's callable), or, for an op CUDA takes in more dtypes than the CPU, ``fn``
    with the CUDA kernel's computation on the CPU tensors its CPU kernel refuses; for one of
    ``META_LAYOUT``, with its outputs laid out as CUDA's."""
    name = op._schema.name.split("::", 1)[1]
    pick = INSTEAD.get(name)
    if pick is not None:
        fn = _picking(op, pick, fn)
    if name in META_LAYOUT:  # (after the pick: CUDA's computation, laid out as CUDA's)
        fn = _laid_out_as_meta(op, fn)
    return fn


def _picking(op: Any, pick: Callable[[dict], Callable | None], fn: Callable) -> Callable:
    """``fn``, or the computation ``pick`` gives for the call's arguments (by name)."""
    names = [a.name for a in op._schema.arguments]
    defaults = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}

    def run(*args: Any, **kwargs: Any) -> Any:
        instead = pick(dict(defaults, **dict(zip(names, args)), **kwargs))
        return (instead or fn)(*args, **kwargs)
    return run


def _laid_out_as_meta(op: Any, fn: Callable) -> Callable:
    """``fn`` whose tensor outputs take the strides the client's metadata gives them: op's meta
    kernel's, corrected where both sides correct it (``layouts.CONTIGUOUS``); a copy only where
    the CPU's differ."""
    contiguous = f"{op._schema.name}.{op._overloadname}" in layouts.CONTIGUOUS

    def as_meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return [as_meta(v) for v in x] if isinstance(x, (list, tuple)) else x

    def conform(out: Any, meta: Any) -> Any:
        if isinstance(out, torch.Tensor) and out.stride() != meta.stride():
            return torch.empty_strided(out.shape, meta.stride(), dtype=out.dtype, device=out.device).copy_(out)
        if isinstance(out, tuple):
            return tuple(conform(o, m) for o, m in zip(out, meta))
        return out

    def run(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if kwargs.get("out") is not None:  # (an out= variant writes where it is told)
            return out
        meta = op(*as_meta(args), **{k: as_meta(v) for k, v in kwargs.items()})
        return conform(out, layouts.contiguous(meta) if contiguous else meta)
    return run


@_instead("histc")
def _histc(a: dict) -> Callable | None:
    """CUDA's histc takes integer tensors (the CPU's only floating ones): each value's bin is
    ``(v - min) * bins / (max - min)`` in integer arithmetic, min and max truncated to the
    dtype, the top edge in the last bin, the counts in the input's dtype."""
    t = a["self"]
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype not in _INTEGERS:
        return None

    def histc(self: torch.Tensor, bins: int = 100, min: Any = 0, max: Any = 0, *, out: Any = None) -> torch.Tensor:
        if bins <= 0:
            raise RuntimeError("bins must be > 0")
        x = self.reshape(-1).long()
        lo, hi = int(min), int(max)
        if lo == hi and x.numel() > 0:
            lo, hi = int(x.min()), int(x.max())
        if lo == hi:
            lo, hi = lo - 1, hi + 1
        if lo > hi:
            raise RuntimeError("max must be larger than min")
        x = x[(x >= lo) & (x <= hi)]
        counts = torch.bincount(((x - lo) * bins // (hi - lo)).clamp_(max=bins - 1), minlength=bins).to(self.dtype)
        if out is None:
            return counts
        return out.resize_(counts.shape).copy_(counts)
    return histc


@_instead("native_batch_norm")
def _batch_norm(a: dict) -> Callable | None:
    """In eval mode the CPU kernel saves empty statistics; CUDA's (and the meta kernel, which the
    client's metadata follows) the running mean and its invstd, which torch.func's batch rules
    expand (jacrev through an eval BatchNorm)."""
    if a["training"] or a["running_mean"] is None or a["running_var"] is None:
        return None

    def batch_norm(input: torch.Tensor, weight: Any, bias: Any, running_mean: torch.Tensor,
                   running_var: torch.Tensor, training: bool, momentum: float, eps: float) -> tuple:
        out, _, _ = torch.ops.aten.native_batch_norm.default(input, weight, bias, running_mean, running_var,
                                                             training, momentum, eps)
        return out, running_mean.clone(), (running_var + eps).rsqrt()
    return batch_norm


@_instead("mm", "bmm", "addmm", "baddbmm")
def _matmul_out_dtype(a: dict) -> Callable | None:
    """``torch.mm(a, b, out_dtype=torch.float32)`` (and bmm, addmm, baddbmm's ``out_dtype``
    overloads) has only CUDA kernels: a half or bfloat16 product accumulated and returned in
    float32, not rounded to the inputs' dtype. Models take that path on 'cuda' (Kolibri's and
    Ergo's routers under ``no_grad``). On the CPU the same product is the float32 one of the
    inputs made float32 (exactly representable), checked as CUDA checks the dtypes."""
    out_dtype = a.get("out_dtype")
    mats = [a[k] for k in ("mat1", "mat2", "batch1", "batch2", "self") if isinstance(a.get(k), torch.Tensor)]
    if out_dtype is None or any(t.device.type != "cpu" for t in mats):
        return None

    def matmul(*args: Any, out: Any = None, **kwargs: Any) -> Any:
        kwargs.pop("out_dtype", None)
        tensors = [t for t in args if isinstance(t, torch.Tensor)]
        self, operands = (None, tensors) if len(tensors) == 2 else (tensors[0], tensors[1:])
        dtype = operands[0].dtype
        if operands[1].dtype != dtype:
            raise RuntimeError("input dtypes must be the same")
        if out_dtype != dtype and not (out_dtype == torch.float32 and dtype in (torch.float16, torch.bfloat16)):
            raise RuntimeError("out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs")
        wide = [t.to(out_dtype) for t in operands]
        if self is None:
            result = (torch.mm if wide[0].dim() == 2 else torch.bmm)(*wide)
        else:
            add = torch.addmm if wide[0].dim() == 2 else torch.baddbmm
            result = add(self.to(out_dtype), *wide, **kwargs)
        if out is None:
            return result
        return out.resize_(result.shape).copy_(result)
    return matmul


@_instead("native_dropout_backward")
def _dropout_backward(a: dict) -> Callable | None:
    """CUDA's dropout backward allocates its result in the gradient's suggested memory format
    (contiguous for a transposed gradient), as torch's meta kernel, and so the client's metadata,
    does; the CPU's is a TensorIterator product that keeps a transposed gradient transposed, and
    the next ``view`` of it, valid on a GPU, failed here."""
    grad = a["grad_output"]
    if not isinstance(grad, torch.Tensor) or grad.device.type != "cpu":
        return None

    def dropout_backward(grad_output: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.ops.aten.native_dropout_backward.default(grad_output, mask, scale)
        return out.contiguous(memory_format=suggest_memory_format(grad_output))
    return dropout_backward


@_instead("linalg_lstsq")
def _lstsq(a: dict) -> Callable | None:
    """CUDA has one least-squares driver, ``gels`` (QR, no rank revealed), and it is CUDA's
    default; the CPU's default is ``gelsy``, which returns the rank and no residuals. A program
    reading ``torch.linalg.lstsq(A, B).residuals`` on 'cuda' gets them on a GPU (an empty tensor
    here before), its ``rank`` is empty there, and a driver other than ``gels`` is refused there
    with CUDA's words (``driver="gelsd"``, which the CPU takes)."""
    if not isinstance(a["self"], torch.Tensor) or a["self"].device.type != "cpu":
        return None
    driver = a.get("driver")
    if driver is not None and driver.lower() != "gels":
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("torch.linalg.lstsq: `driver` other than `gels` is not supported on CUDA")
        return refused

    def lstsq(*args: Any, **kwargs: Any) -> Any:
        kwargs["driver"] = "gels"
        op = torch.ops.aten.linalg_lstsq
        return (op.out if "solution" in kwargs else op.default)(*args, **kwargs)
    return lstsq


#: the drivers cuSOLVER's SVD takes (``torch.linalg.svd(A, driver=...)``)
_SVD_DRIVERS = ("gesvd", "gesvdj", "gesvda")


@_instead("_linalg_svd")
def _svd(a: dict) -> Callable | None:
    """``torch.linalg.svd(A, driver="gesvdj")`` (and ``svdvals``) picks one of cuSOLVER's
    drivers, a CUDA-only argument the CPU's kernel refuses ("only supported on CUDA inputs").
    Each driver computes the same decomposition, so here it is LAPACK's; a name cuSOLVER does
    not know is refused with CUDA's words."""
    driver = a.get("driver")
    if driver is None or not isinstance(a["A"], torch.Tensor) or a["A"].device.type != "cpu":
        return None
    if driver not in _SVD_DRIVERS and a["A"].numel() > 0:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"torch.linalg.svd: unknown svd driver {driver} in svd_cusolver computation. "
                               "Check doc at https://pytorch.org/docs/stable/generated/torch.linalg.svd.html")
        return refused

    def svd(*args: Any, driver: Any = None, **kwargs: Any) -> Any:
        op = torch.ops.aten._linalg_svd
        return (op.U if "U" in kwargs else op.default)(*args, **kwargs)
    return svd


#: half-precision FFTs (cuFFT's, on power-of-two sizes): the dtype each is computed in here
_HALF_FFT = {torch.float16: torch.float32, torch.complex32: torch.complex64}


@_instead("_fft_r2c", "_fft_c2c", "_fft_c2r")
def _fft_half(a: dict) -> Callable | None:
    """cuFFT transforms half and complex-half signals whose sizes are powers of two
    (``torch.fft.rfft2`` of a ``model.half()`` Fourier layer); the CPU's FFT refuses them ("MKL
    FFT doesn't support tensors of type: Half"). Here each is computed in single precision and
    rounded to the half dtype; another size is refused with cuFFT's words."""
    t = a["self"]
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype not in _HALF_FFT:
        return None
    signal = [t.shape[d] for d in a["dim"]]
    if "last_dim_size" in a:  # (c2r: the real output's size)
        signal[-1] = a["last_dim_size"]
    if any(n & (n - 1) for n in signal):
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("cuFFT only supports dimensions whose sizes are powers of two when computing "
                               f"in half precision, but got a signal size of{signal}")
        return refused
    name = "_fft_r2c" if "onesided" in a else "_fft_c2r" if "last_dim_size" in a else "_fft_c2c"
    op = getattr(torch.ops.aten, name).default
    narrow = torch.float16 if name == "_fft_c2r" else torch.complex32

    def fft(self: torch.Tensor, *args: Any, out: Any = None, **kwargs: Any) -> torch.Tensor:
        result = op(self.to(_HALF_FFT[self.dtype]), *args, **kwargs).to(narrow)
        if out is None:
            return result
        return out.resize_(result.shape).copy_(result)
    return fft


def _lu_no_pivot(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LU factorization without row exchanges (cuSOLVER's ``getrf`` with no pivots, which the
    CPU's LAPACK path refuses): Gaussian elimination over the batch, laid out as the meta kernel
    lays ``LU`` out (column-major), pivots ``1..k`` as CUDA reports them, and ``info`` the first
    zero pivot (1-based), whose column is then left unscaled, as LAPACK's ``getf2`` leaves it."""
    LU = A.clone()
    m, n = A.shape[-2], A.shape[-1]
    k = min(m, n)
    info = torch.zeros(A.shape[:-2], dtype=torch.int32)
    for j in range(k):
        pivot = LU[..., j, j]
        zero = pivot == 0
        info = torch.where((info == 0) & zero, j + 1, info)
        LU[..., j + 1:, j] /= torch.where(zero, 1, pivot).unsqueeze(-1)
        LU[..., j + 1:, j + 1:] -= LU[..., j + 1:, j:j + 1] * LU[..., j:j + 1, j + 1:]
    pivots = torch.arange(1, k + 1, dtype=torch.int32).expand(*A.shape[:-2], k).contiguous()
    return LU.mT.contiguous().mT, pivots, info


def _filled(result: tuple, outs: tuple) -> tuple:
    """``result`` written into an ``out=`` op's outputs (or ``result`` itself, without them); an
    output of another shape takes the result's strides, as a structured kernel's ``set_output``."""
    if any(o is None for o in outs):
        return result
    for o, r in zip(outs, result):
        if o.shape != r.shape:
            o.resize_(r.shape).as_strided_(r.shape, r.stride())
        o.copy_(r)
    return outs


@_instead("linalg_lu_factor_ex")
def _lu_factor_no_pivot(a: dict) -> Callable | None:
    """``torch.linalg.lu_factor(A, pivot=False)`` (and ``lu_factor_ex``, the legacy ``torch.lu``):
    CUDA factors without pivoting; the CPU refuses ("LU without pivoting is not implemented on
    the CPU")."""
    A = a["A"]
    if a["pivot"] or not isinstance(A, torch.Tensor) or A.device.type != "cpu" or A.numel() == 0:
        return None

    def lu_factor_ex(A: torch.Tensor, *, pivot: bool, check_errors: bool = False, LU: Any = None, pivots: Any = None,
                     info: Any = None) -> tuple:
        result = _lu_no_pivot(A)
        if check_errors:
            torch.ops.aten._linalg_check_errors(result[2], "torch.linalg.lu_factor_ex", is_matrix=A.dim() == 2)
        return _filled(result, (LU, pivots, info))
    return lu_factor_ex


@_instead("linalg_lu")
def _lu_no_pivot_unpacked(a: dict) -> Callable | None:
    """``torch.linalg.lu(A, pivot=False)``: ``L`` and ``U`` of the unpivoted factorization and, as on
    CUDA, an empty ``P``."""
    A = a["A"]
    if a["pivot"] or not isinstance(A, torch.Tensor) or A.device.type != "cpu" or A.numel() == 0:
        return None

    def lu(A: torch.Tensor, *, pivot: bool, P: Any = None, L: Any = None, U: Any = None) -> tuple:
        LU, _, _ = _lu_no_pivot(A)
        k = min(A.shape[-2], A.shape[-1])
        eye = torch.eye(A.shape[-2], k, dtype=A.dtype)
        lower = (LU[..., :, :k].tril(-1) + eye).contiguous()
        upper = LU[..., :k, :].triu().contiguous()
        return _filled((A.new_empty(0), lower, upper), (P, L, U))
    return lu
