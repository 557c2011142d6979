"""CUDA autocast, applied by the client.

``torch.autocast('cuda')`` is enabled on the client, but CUDA's autocast kernels never
fire on a meta-keyed tensor, so nothing would be cast. The torch-function mode calls
``apply`` for the functions below (the lists of aten/src/ATen/autocast_mode.h, at the
level of the Python functions users call); casting there, above autograd, records the
casts in the graph exactly as CUDA autocast does.
"""
from __future__ import annotations

import contextlib
import math
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F

from . import attention, call_checks
from .tensor import RemoteTensor

_LOWER: list[Callable] = [  # run in the autocast dtype (float16 / bfloat16)
    F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
    torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm,
    torch.baddbmm, torch.Tensor.baddbmm, torch.addbmm, torch.Tensor.addbmm, torch.mv, torch.Tensor.mv,
    torch.linalg.matmul, torch.linalg.vecdot,
    torch.addmv, torch.Tensor.addmv, torch.addr, torch.Tensor.addr, torch.einsum, torch.chain_matmul,
    torch.linalg.multi_dot, torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d,
    torch.conv_transpose2d, torch.conv_transpose3d, torch.convolution, torch.conv_tbc, torch.prelu,
    F.prelu, torch.lstm_cell, torch.gru_cell, torch.rnn_tanh_cell,
    torch.rnn_relu_cell,
]
_FP32: list[Callable] = [  # run in float32
    torch.acos, torch.asin, torch.cosh, torch.erfinv, torch.exp, torch.Tensor.exp, torch.expm1,
    torch.log, torch.Tensor.log, torch.log10, torch.log2, torch.log1p, torch.reciprocal, torch.rsqrt,
    torch.Tensor.rsqrt, torch.sinh, torch.tan, torch.pow, torch.Tensor.pow, torch.Tensor.__pow__,
    F.softplus, F.layer_norm, torch.layer_norm, F.group_norm, torch.group_norm, torch.norm,
    torch.Tensor.norm, F.cosine_similarity, F.poisson_nll_loss, F.cosine_embedding_loss, F.nll_loss,
    F.cross_entropy, F.hinge_embedding_loss, F.kl_div, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
    F.mse_loss, F.margin_ranking_loss, F.multilabel_margin_loss, F.soft_margin_loss,
    F.triplet_margin_loss, F.multi_margin_loss, F.binary_cross_entropy_with_logits, torch.dist,
    torch.pdist, torch.cdist, torch.renorm, torch.logsumexp, torch.Tensor.logsumexp, F.rms_norm,
    torch.rms_norm, torch.frobenius_norm, torch.nuclear_norm,
    torch.Tensor.__rpow__,  # (``2 ** x``: aten's pow.Scalar)
    torch.square, torch.arccos, torch.arcsin,  # (composites of pow, acos, asin: CUDA casts their callee)
]
_FP32_SET_OPT_DTYPE: list[Callable] = [  # float32 through their dtype= argument
    F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax,
    torch.Tensor.log_softmax, torch.prod, torch.Tensor.prod, torch.cumprod, torch.Tensor.cumprod,
    torch.cumsum, torch.Tensor.cumsum, torch.sum, torch.Tensor.sum, torch.linalg.vector_norm,
    torch.linalg.matrix_norm,
    torch.linalg.norm,  # (a vector or matrix norm)
]
_PROMOTE: list[Callable] = [  # run in the widest floating type among the inputs
    torch.addcdiv, torch.Tensor.addcdiv, torch.addcmul, torch.Tensor.addcmul, torch.atan2,
    F.bilinear, torch.cross, torch.linalg.cross, torch.dot, torch.Tensor.dot, torch.vdot, F.grid_sample,
    torch.index_put, torch.Tensor.index_put, torch.scatter_add, torch.Tensor.scatter_add,
    torch.tensordot,
]
_BANNED: list[Callable] = [F.binary_cross_entropy]


def _spellings(fns: list[Callable]) -> list[Callable]:
    """``fns`` with the other spellings of the same aten ops. CUDA autocast casts at the aten level,
    so ``x.log1p()`` and ``torch.special.log1p(x)`` are cast as ``torch.log1p(x)`` is; the mode sees
    each spelling as a function of its own (``Tensor.log1p``, ``special_log1p``)."""
    found = list(fns)
    for f in fns:
        if getattr(torch, getattr(f, "__name__", ""), None) is not f:
            continue  # (only torch.* functions have method and torch.special spellings)
        for owner in (torch.Tensor, torch.special):
            other = getattr(owner, f.__name__, None)
            if callable(other) and other not in found:
                found.append(other)
    return found

_LOW = (torch.float16, torch.bfloat16)
#: the tensors the policies cast: remote ones, and any while a compiled call is traced (``stand_ins``)
_cast = threading.local()


@contextlib.contextmanager
def stand_ins() -> Iterator[None]:
    """While ``torch.compile`` traces a call (compiled.py): its tensors are CPU stand-ins for
    remote ones, so the policies cast them as CUDA autocast casts the device's tensors, and the
    graph holds the casts (the conversions, and their gradients' in the backward)."""
    before = getattr(_cast, "kinds", (RemoteTensor,))
    _cast.kinds = (torch.Tensor,)
    try:
        yield
    finally:
        _cast.kinds = before


def _castable(x: Any) -> TypeGuard[torch.Tensor]:
    return isinstance(x, getattr(_cast, "kinds", (RemoteTensor,)))


def _map(args: Any, fn: Callable) -> Any:
    if _castable(args):
        return fn(args)
    if type(args) in (list, tuple):
        return type(args)(_map(a, fn) for a in args)
    return args


def _cast_to(dtype: torch.dtype, eligible: Callable) -> Callable:
    def cast(t: RemoteTensor) -> Any:
        return t.to(dtype) if t.is_floating_point() and eligible(t.dtype) and t.dtype != dtype else t
    return cast


def lowered(args: Any) -> Any:
    """``args`` with their remote floating-point tensors (float64 excepted) cast to autocast's
    lower-precision dtype, as CUDA autocast casts the arguments of the ops on its lower list."""
    return _map(args, _cast_to(torch.get_autocast_dtype("cuda"), lambda d: d != torch.float64))


def _lower(func: Callable, args: tuple, kwargs: dict) -> Any:
    return func(*lowered(args), **{k: lowered(v) for k, v in kwargs.items()})


def _fp32(func: Callable, args: tuple, kwargs: dict) -> Any:
    cast = _cast_to(torch.float32, lambda d: d in _LOW)
    return func(*_map(args, cast), **{k: _map(v, cast) for k, v in kwargs.items()})


def _fp32_dtype(func: Callable, args: tuple, kwargs: dict) -> Any:
    x = args[0] if args else kwargs.get("input")
    if _castable(x) and x.dtype in _LOW and kwargs.get("dtype") is None:
        kwargs = dict(kwargs, dtype=torch.float32)
    return func(*args, **kwargs)


def _promote(func: Callable, args: tuple, kwargs: dict) -> Any:
    dtypes = []
    _map((args, tuple(kwargs.values())), lambda t: dtypes.append(t.dtype) if t.is_floating_point() else None)
    if not dtypes:
        return func(*args, **kwargs)
    widest = dtypes[0]
    for d in dtypes[1:]:
        widest = torch.promote_types(widest, d)
    cast = _cast_to(widest, lambda d: True)
    return func(*_map(args, cast), **{k: _map(v, cast) for k, v in kwargs.items()})


def _banned(func: Callable, args: tuple, kwargs: dict) -> Any:
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
        "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
        "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
        "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
        "safe to autocast.")


def _interpolate(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.interpolate``: its upsampling ops are on CUDA's float32 list; ``mode='area'`` is an
    adaptive average pool, which is on no list and keeps its input's dtype."""
    mode = args[3] if len(args) > 3 else kwargs.get("mode", "nearest")
    return func(*args, **kwargs) if mode == "area" else _fp32(func, args, kwargs)


def _pairwise_distance(x1: torch.Tensor, x2: torch.Tensor, p: float = 2.0, eps: float = 1e-6,
                       keepdim: bool = False) -> torch.Tensor:
    """aten/src/ATen/native/Distance.cpp, ``pairwise_distance``: a norm over the last dimension."""
    return torch.norm(x1 - x2 + eps, p, max(x1.dim(), x2.dim()) - 1, keepdim)


def _cov(input: torch.Tensor, *, correction: int = 1, fweights: torch.Tensor | None = None,
         aweights: torch.Tensor | None = None) -> torch.Tensor:
    """aten/src/ATen/native/Correlation.cpp, ``cov``: its sums (float32 under CUDA autocast) and its
    ``mm`` (lower precision), with its checks."""
    if input.dim() > 2:
        raise RuntimeError("cov(): expected input to have two or fewer dimensions but got an input with "
                           f"{input.dim()} dimensions")
    if input.dtype is torch.bool:
        raise RuntimeError("cov(): bool dtype is not supported for input")
    x = input.view(1, -1) if input.dim() < 2 else input
    n = x.size(1)
    w = None
    for name, given, kind, ok in (("fweights", fweights, "integral", lambda d: not d.is_floating_point and
                                   not d.is_complex and d is not torch.bool),
                                  ("aweights", aweights, "floating point", lambda d: d.is_floating_point)):
        if given is None:
            continue
        if given.dim() > 1:
            raise RuntimeError(f"cov(): expected {name} to have one or fewer dimensions but got {name} with "
                               f"{given.dim()} dimensions")
        if not ok(given.dtype):
            raise RuntimeError(f"cov(): expected {name} to have {kind} dtype but got {name} with "
                               f"{call_checks.c10_name(given.dtype)} dtype")
        if given.numel() != n:
            raise RuntimeError(f"cov(): expected {name} to have the same numel as there are observations in the "
                               f"input but got {given.numel()} != {n}")
        if n != 0 and not bool(given.min().ge(0)):
            raise RuntimeError(f"cov(): {name} cannot be negative")
        w = given if w is None else w * given
    w_sum = w.sum() if w is not None else torch.scalar_tensor(n, dtype=torch.long, device=x.device)
    if w is not None and not bool(w_sum.ne(0)):
        raise RuntimeError("cov(): weights sum to zero, can't be normalized")
    avg = (x * w if w is not None else x).sum(1) / w_sum
    if w is None:
        norm_factor = torch.scalar_tensor(n - correction, dtype=torch.long, device=x.device)
    elif correction == 0:
        norm_factor = w_sum
    elif aweights is None:
        norm_factor = w_sum - correction
    elif fweights is None and n == 1 and correction == 1:
        norm_factor = torch.scalar_tensor(0, dtype=torch.long, device=x.device)
    else:
        norm_factor = w_sum - correction * (w * aweights).sum() / w_sum
    if bool(norm_factor.le(0)):
        torch.cov(torch.zeros(1, 1))  # (its warning, as ATen words it: a CPU call that gives it)
        norm_factor = torch.zeros_like(norm_factor)
    if n == 1 and (fweights is None) != (aweights is None):
        x.zero_()  # (in place, as ATen's does)
        x = x if x.is_floating_point() or x.is_complex() else x.to(torch.float32)
    else:
        x = x - avg.unsqueeze(1)
    c = torch.mm(x, (x * w if w is not None else x).t().conj())
    if c.is_complex() and (x.size(0) == 1 or x.size(1) == 1):
        c = torch.complex(c.real, torch.zeros_like(c.real))
    return torch.true_divide(c, norm_factor).squeeze()


def _corrcoef(input: torch.Tensor) -> torch.Tensor:
    """aten/src/ATen/native/Correlation.cpp, ``corrcoef``: ``cov``, normalized."""
    if input.dim() > 2:
        raise RuntimeError("corrcoef(): expected input to have two or fewer dimensions but got an input with "
                           f"{input.dim()} dimensions")
    c = torch.cov(input)
    if c.dim() == 0:
        return c / c
    d = c.diagonal()
    stddev = torch.sqrt(d.real if d.is_complex() else d)
    c = c / stddev.view(-1, 1)
    c = c / stddev.view(1, -1)
    if c.is_complex():
        return torch.complex(c.real.clip(-1, 1), c.imag.clip(-1, 1))
    return c.clip(-1, 1)


def _along(t: torch.Tensor, dim: int, start: int, stop: int | None) -> torch.Tensor:
    """``t.slice(dim, start, stop)``, as ATen's bodies write it."""
    return t[(slice(None),) * dim + (slice(start, stop),)]


def _spacing(x: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """Integration.cpp: the differences of the sample points ``x``, viewed to broadcast with ``y``'s."""
    if x.dim() == 1:
        x = x.view([1] * dim + [-1] + [1] * (y.dim() - dim - 1))
    elif x.dim() < y.dim():
        x = x.view((1,) * (y.dim() - x.dim()) + tuple(x.shape))
    return _along(x, dim, 1, None) - _along(x, dim, 0, -1)


def _trapezoid(y: torch.Tensor, x: torch.Tensor | None = None, *, dx: float = 1, dim: int = -1) -> torch.Tensor:
    """aten/src/ATen/native/Integration.cpp, ``trapezoid``: its ``sum`` (float32 under CUDA autocast)."""
    dim %= max(y.dim(), 1)
    if y.size(dim) == 0:
        return y.new_zeros(y.shape[:dim] + y.shape[dim + 1:])
    if x is None:
        return (y.sum(dim) - (y.select(dim, 0) + y.select(dim, -1)) * 0.5) * float(dx)
    return ((_along(y, dim, 0, -1) + _along(y, dim, 1, None)) * _spacing(x, y, dim)).sum(dim) / 2.0


def _cumulative_trapezoid(y: torch.Tensor, x: torch.Tensor | None = None, *, dx: float = 1,
                          dim: int = -1) -> torch.Tensor:
    """aten/src/ATen/native/Integration.cpp, ``cumulative_trapezoid``: its ``cumsum`` (float32 under CUDA autocast)."""
    dim %= max(y.dim(), 1)
    pairs = _along(y, dim, 0, -1) + _along(y, dim, 1, None)
    if x is None:
        return (float(dx) / 2.0 * pairs).cumsum(dim)
    return (pairs * _spacing(x, y, dim)).cumsum(dim) / 2.0


def _mvlgamma(input: torch.Tensor, p: int) -> torch.Tensor:
    """aten/src/ATen/native/UnaryOps.cpp, ``mvlgamma``: a ``sum`` of lgammas, float32 under CUDA autocast
    (for the half-precision inputs it is used for)."""
    if p < 1:  # (which its meta kernel does not check)
        raise RuntimeError("p has to be greater than or equal to 1")
    args = torch.arange(-p * 0.5 + 0.5, 0.5, 0.5, dtype=input.dtype, device=input.device)
    return (args + input.unsqueeze(-1)).lgamma_().sum(-1).add_(p * (p - 1) * math.log(math.pi) * 0.25)


def _mvlgamma_(input: torch.Tensor, p: int) -> torch.Tensor:
    """``mvlgamma_``: ``mvlgamma``'s float32 sum, copied back into the half-precision input."""
    return input.copy_(_mvlgamma(input, p))


def _pinv(input: torch.Tensor, rcond: Any = None, hermitian: bool = False, *, atol: Any = None,
          rtol: Any = None) -> torch.Tensor:
    """aten/src/ATen/native/LinearAlgebra.cpp, ``linalg_pinv`` (all its overloads): V·S⁺·Uᴴ of an SVD (of
    an eigendecomposition if ``hermitian``), whose final ``matmul`` CUDA autocast runs in lower precision."""
    if rcond is not None:  # (the rcond overloads: no absolute tolerance)
        atol, rtol = (torch.zeros((), dtype=rcond.dtype, device=rcond.device) if isinstance(rcond, torch.Tensor)
                      else 0.0), rcond

    def f64(v: Any) -> torch.Tensor:  # (get_atol_rtol's tolerances given as numbers, or none)
        return v if isinstance(v, torch.Tensor) else torch.full((), v, dtype=torch.float64, device=input.device)
    if rtol is None:
        default = f64(torch.finfo(input.dtype).eps * max(input.shape[-2:]))
        rtol = default if atol is None else torch.where(f64(atol) > 0, f64(0.0), default)
    atol, rtol = f64(0.0 if atol is None else atol), f64(rtol)
    if input.numel() == 0:
        u, s, v = input.svd()
        return torch.matmul(v * s.reciprocal().unsqueeze(-2), u.mH)
    if hermitian:
        s, u = torch.linalg.eigh(input)
        size, vh = s.abs(), u.mH
        largest = size.amax(-1, keepdim=True)
    else:
        u, s, vh = torch.linalg.svd(input, full_matrices=False)
        size, largest = s, s.narrow(-1, 0, 1)
    tol = torch.max(atol.unsqueeze(-1), rtol.unsqueeze(-1) * largest)
    s_pinv = torch.where(size > tol, s.reciprocal(), torch.zeros((), dtype=s.dtype, device=s.device))
    return torch.matmul(vh.mH * s_pinv.to(input.dtype).unsqueeze(-2), u.mH)


def _pinverse(input: torch.Tensor, rcond: float = 1e-15) -> torch.Tensor:
    return _pinv(input, rcond)


def _matrix_power(input: torch.Tensor, n: int) -> torch.Tensor:
    """aten/src/ATen/native/LinearAlgebra.cpp, ``linalg_matrix_power`` (for ``|n| >= 2``): its ``matmul``s
    (lower precision under CUDA autocast), in its order: by the bits of ``n``, from the lowest."""
    a = torch.linalg.inv(input) if n < 0 else input
    n = abs(n)
    if n == 2:
        return torch.matmul(a, a)
    if n == 3:
        return torch.matmul(torch.matmul(a, a), a)
    z = result = None
    while n > 0:
        bit, n = n % 2, n // 2
        z = a if z is None else torch.matmul(z, z)
        if bit:
            result = z if result is None else torch.matmul(result, z)
    assert result is not None
    return result


def _norm_except_dim(v: torch.Tensor, pow: float, dim: int) -> torch.Tensor:
    """aten/src/ATen/native/WeightNorm.cpp, ``norm_except_dim``: a ``norm`` (float32 under CUDA autocast)
    over every dimension but ``dim``."""
    if dim == -1:
        return v.norm(pow)
    if dim == 0:
        return v.contiguous().view(v.size(0), -1).norm(pow, 1).view([v.size(0)] + [1] * (v.dim() - 1))
    if dim == v.dim() - 1:
        return v.contiguous().view(-1, v.size(-1)).norm(pow, 0).view([1] * (v.dim() - 1) + [v.size(-1)])
    return _norm_except_dim(v.transpose(0, dim), pow, 0).transpose(0, dim)


def _weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """WeightNorm.cpp, ``_weight_norm``, off its fused kernel: ``v * (g / norm_except_dim(v))``, whose
    ``norm`` CUDA autocast runs in float32 (so a half-precision weight norm gives float32)."""
    v, g = v.contiguous(), g.contiguous()
    return v * (g / _norm_except_dim(v, 2, dim))


def _unfused_low_weight_norm(args: tuple, kwargs: dict) -> bool:
    """``_weight_norm`` of half-precision tensors that ATen computes by ``norm_except_dim``: its fused
    kernel (on no list) serves float32 and bfloat16 over the first or last dimension."""
    v = args[0] if args else kwargs.get("v")
    g = args[1] if len(args) > 1 else kwargs.get("g")
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if not (_castable(v) and _castable(g)) or not {v.dtype, g.dtype} & set(_LOW):
        return False
    return torch.float16 in (v.dtype, g.dtype) or dim not in (0, v.dim() - 1)


def _low_input(args: tuple, kwargs: dict) -> bool:
    """Whether a floating-point input is of half precision (only their inner sums are cast) and no
    ``out=`` is given (a call with one runs as the op)."""
    found = []
    _map((args, tuple(kwargs.values())), lambda t: found.append(t.dtype in _LOW))
    return any(found) and kwargs.get("out") is None


def _float_matrix(args: tuple, kwargs: dict) -> bool:
    """Whether ``pinv``'s inner ``matmul`` is cast: a float32 input (half ones are refused, float64 and
    complex ones are not cast), no ``out=``."""
    x = args[0] if args else kwargs.get("input")
    return _castable(x) and x.dtype is torch.float32 and kwargs.get("out") is None


def _float_matrix_power(args: tuple, kwargs: dict) -> bool:
    """``matrix_power`` with a power that multiplies (``|n| >= 2``), of a float32 matrix."""
    n = args[1] if len(args) > 1 else kwargs.get("n")
    return _float_matrix(args, kwargs) and isinstance(n, int) and abs(n) >= 2


#: C++ composites on none of CUDA's lists whose inner ops are (``F.pairwise_distance``'s norm,
#: ``torch.cov``'s sums and ``mm``, ``torch.trapezoid``'s sum, ``linalg.pinv``'s and ``matrix_power``'s
#: matmuls, weight norm's norm): CUDA autocast casts those inner ops, which a remote tensor's op runs below the mode (a
#: C++ body, or one op the gateway runs), so each runs as this transcription of its ATen body, under
#: it. (No general way exists: torch._decomp has Python bodies for few of them, and a C++ body's inner
#: calls meet only the dispatcher, below autograd, where a cast would not be recorded. A listed op's
#: inner calls are not cast: CUDA's policies run it with autocast off, as ``tensordot``'s ``mm``.)
DECOMPOSED: dict[Callable, Callable] = {
    torch.pairwise_distance: _pairwise_distance,
    torch.cov: _cov, torch.Tensor.cov: _cov, torch.corrcoef: _corrcoef, torch.Tensor.corrcoef: _corrcoef,
    torch.trapezoid: _trapezoid, torch.trapz: _trapezoid, torch.cumulative_trapezoid: _cumulative_trapezoid,
    torch.mvlgamma: _mvlgamma, torch.Tensor.mvlgamma: _mvlgamma, torch.special.multigammaln: _mvlgamma,
    torch.Tensor.mvlgamma_: _mvlgamma_, torch.linalg.pinv: _pinv, torch.pinverse: _pinverse,
    torch.Tensor.pinverse: _pinverse, torch.linalg.matrix_power: _matrix_power, torch.matrix_power: _matrix_power,
    torch.Tensor.matrix_power: _matrix_power, torch._weight_norm: _weight_norm,
}
#: the transcriptions above used only for some calls (the others' inner ops are not cast, and they run
#: as the op), once the op accepts the call's arguments (run on meta stand-ins of the remote tensors)
_WHEN: dict[Callable, Callable[[tuple, dict], bool]] = {
    **dict.fromkeys((torch.trapezoid, torch.trapz, torch.cumulative_trapezoid, torch.mvlgamma,
                     torch.Tensor.mvlgamma, torch.special.multigammaln, torch.Tensor.mvlgamma_), _low_input),
    **dict.fromkeys((torch.linalg.pinv, torch.pinverse, torch.Tensor.pinverse), _float_matrix),
    **dict.fromkeys((torch.linalg.matrix_power, torch.matrix_power, torch.Tensor.matrix_power), _float_matrix_power),
    torch._weight_norm: _unfused_low_weight_norm,
}


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def decomposition(func: Callable, args: tuple, kwargs: dict,
                  user_meta: Callable[[], contextlib.AbstractContextManager]) -> Callable | None:
    """The transcription (``DECOMPOSED``) to run for this call of ``func`` under autocast('cuda'), if any.
    ``user_meta``: the scope in which 'meta' tensors stay meta (interception's), for ATen's checks."""
    inner = DECOMPOSED.get(func)
    if inner is None or not torch.is_autocast_enabled("cuda") or not has_remote(args, kwargs):
        return None
    when = _WHEN.get(func)
    if when is not None:
        if not when(args, kwargs):
            return None
        try:
            with user_meta():
                func(*_map(args, _meta), **{k: _map(v, _meta) for k, v in kwargs.items()})
        except Exception:
            return None  # (a call ATen refuses runs as the op, which says why in its own words)
    return inner

POLICY: dict[Callable, Callable] = {F.interpolate: _interpolate}
for _fs, _p in ((_LOWER, _lower), (_FP32, _fp32), (_FP32_SET_OPT_DTYPE, _fp32_dtype),
                (_PROMOTE, _promote), (_BANNED, _banned)):
    for _f in _spellings(_fs):
        POLICY[_f] = _p


def sdpa(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Scaled dot-product attention: CUDA's autocast casts it (lower precision), then the fused path."""
    if torch.is_autocast_enabled("cuda") and has_remote(args, kwargs):
        args, kwargs = lowered(args), {k: lowered(v) for k, v in kwargs.items()}
    return attention.sdpa(func, args, kwargs)


def composite(func: Callable) -> bool:
    """Whether ``func`` is a Python function of torch.nn.functional not on the lists, whose body
    calls ops that are (``multi_head_attention_forward``'s linear and softmax, ``normalize``'s
    norm): CUDA autocast casts at the aten level, so those inner calls are cast too."""
    return type(func) is types.FunctionType and func.__module__ == "torch.nn.functional" \
        and not _CHECKS.isdisjoint(func.__code__.co_names)  # (boolean_dispatch's wrappers check in their callee)


_CHECKS = frozenset(("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"))


def body(func: Callable) -> Callable:
    """``func`` whose own first check for ``__torch_function__`` overrides finds none: run under the
    autocast mode, it proceeds to its body (whose calls the mode sees) instead of handing itself
    to the mode again. Only its globals differ, so the functions it calls keep their checks."""
    never = {name: (lambda *a, **k: False) for name in _CHECKS}
    g = {**func.__globals__, **never}
    f = types.FunctionType(func.__code__, g, func.__name__, func.__defaults__, func.__closure__)
    f.__kwdefaults__ = func.__kwdefaults__
    return f


def has_remote(args: tuple, kwargs: dict) -> bool:
    found = []
    _map((args, tuple(kwargs.values())), lambda t: found.append(True))
    return bool(found)


def apply(policy: Callable, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` with CUDA's autocast policy if autocast('cuda') is on and a remote tensor is involved."""
    if not torch.is_autocast_enabled("cuda") or not has_remote(args, kwargs):
        return func(*args, **kwargs)
    return policy(func, args, kwargs)
