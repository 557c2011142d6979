"""Checks a GPU's kernels make at the call that torch's meta kernels leave out.

A 'cuda' op's output metadata comes from its meta kernel (dispatch.py). Where that kernel
accepts arguments the device's kernel refuses on the host, before any launch (a convolution's
zero dilation, ``uniform_(2, 1)``, an ``out=`` of the wrong dtype), the op was queued and its
error came at the next sync point, as an asynchronous one, where a GPU raises it at the call.
Each check here is the device kernel's own condition, with its message (the aten file is named);
``Dispatcher._compute`` runs them on a cache miss, before the meta kernel, and a refusal is asked
of the gateway (``Dispatcher._refused``: one round trip, on errors only), whose device words the
error. So a condition only needs to cover the device's refusals and stay off the accepted calls
programs make. A check reads only what the dispatch-cache key holds (dtypes, shapes, strides,
ints; the float values of the ops in ``READS_FLOATS``), so a cached signature passed its checks.

Conditions that need the tensors' values (an index out of range, a negative probability) are
checked by the device's kernel, asynchronously on a GPU too, and are not here.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

_INTERNAL_OVERLAP = ("unsupported operation: more than one element of the written-to tensor refers to a single "
                     "memory location. Please clone() the tensor before performing the operation.")


def _arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any = None) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def _convolution(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/Convolution.cpp, ``check_shape_forward`` (ConvParams)."""
    padding, dilation, output_padding = args[4], args[5], args[7]
    if any(p < 0 for p in padding):
        raise RuntimeError("negative padding is not supported")
    if any(p < 0 for p in output_padding):
        raise RuntimeError("negative output_padding is not supported")
    if any(d < 1 for d in dilation):
        raise RuntimeError("dilation should be greater than zero")


def _uniform(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/DistributionTemplates.h, ``uniform_impl_``."""
    low, high = _arg(args, kwargs, 1, "from", 0.0), _arg(args, kwargs, 2, "to", 1.0)
    if low > high:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={low} > to={high}")


def _index_add(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/TensorAdvancedIndexing.cpp, ``index_func_meta_impl``: ``source`` has
    ``self``'s shape but at ``dim``."""
    self, dim, source = args[0], args[1], _arg(args, kwargs, 3, "source")
    self_sizes, source_sizes = list(self.shape), list(source.shape)
    if source.dim() != 0 and self.dim() != 0:
        d = dim % self.dim() if -self.dim() <= dim < self.dim() else dim
        if d < len(self_sizes) and d < len(source_sizes):
            del self_sizes[d], source_sizes[d]
    if self_sizes != source_sizes:
        raise RuntimeError("source tensor shape must match self tensor shape, excluding the specified dimension. "
                           f"Got self.shape = {list(self.shape)} source.shape = {list(source.shape)}")


def _bucketize(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/Bucketization.cpp, ``bucketize_out_cpu``/``_cuda``."""
    boundaries = _arg(args, kwargs, 1, "boundaries")
    if boundaries.dim() != 1:
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({boundaries.dim()})")


def _multinomial(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/Distributions.cpp, ``multinomial_out``: the checks made before any
    value is read (those on the probabilities' values need them, and a GPU's are asynchronous
    where it samples with replacement)."""
    self, n_sample = args[0], _arg(args, kwargs, 1, "num_samples")
    out = kwargs.get("out")
    if out is not None and out.dtype is not torch.int64:
        raise RuntimeError(f"multinomial expects Long tensor out, got: {c10_name(out.dtype)}")
    if n_sample <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if self.dim() > 0:
        if not _arg(args, kwargs, 2, "replacement", False) and n_sample > self.shape[-1]:
            raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
        if self.shape[-1] > 2 ** 24:
            raise RuntimeError("number of categories cannot exceed 2^24")


def _complex_out(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/TensorFactories.cpp, ``complex_check_dtype``."""
    out, real = kwargs["out"], args[0]
    want = torch.complex128 if real.dtype is torch.float64 else (
        torch.complex32 if real.dtype is torch.float16 else torch.complex64)
    if out.dtype is not want:
        raise RuntimeError(f"Expected object of scalar type {c10_name(want)} but got scalar type "
                           f"{c10_name(out.dtype)} for argument 'out'")


def _same_dtype_out(*names: str) -> Callable[[tuple, dict], None]:
    """A structured kernel's ``out=`` (torchgen's ``resize_out``, in every backend's generated
    Register*.cpp) must have its result's dtype, where the Python meta kernel (``out_wrapper``)
    accepts any dtype the result can be cast to."""
    def check(args: tuple, kwargs: dict) -> None:
        for name in names:
            out = kwargs.get(name)
            if out is not None and out.dtype is not args[0].dtype:
                raise RuntimeError(f"Expected out tensor to have dtype {c10_name(args[0].dtype).lower()}, "
                                   f"but got {c10_name(out.dtype).lower()} instead")
    return check


def _as_strided_scatter(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/TensorShape.cpp, ``as_strided_scatter``: the view is taken of a clone
    of ``self`` (a storage of ``self.numel()`` elements), checked by Resize.h's
    ``checkInBoundsForStorage``."""
    self, size, stride = args[0], _arg(args, kwargs, 2, "size"), _arg(args, kwargs, 3, "stride")
    offset = _arg(args, kwargs, 4, "storage_offset") or 0
    item = self.element_size()
    needed = 0 if 0 in size else item * (1 + sum((n - 1) * s for n, s in zip(size, stride)))
    if needed and needed + offset * item > self.numel() * item:
        raise RuntimeError(f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and "
                           f"itemsize {item} requiring a storage size of {needed + offset * item} are out of "
                           f"bounds for storage of size {self.numel() * item}")


def _layer_norm(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/cuda/layer_norm_kernel.cu (``LayerNormKernelImplInternal`` reads
    ``gamma``/``beta`` as the input's type) and ATen/native/mixed_dtype.h (the CPU takes float
    parameters for a half or bfloat16 input, and nothing else of another dtype)."""
    x = args[0]
    for p in (_arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "bias")):
        if p is not None and p.dtype is not x.dtype and not (
                p.dtype is torch.float32 and x.dtype in (torch.float16, torch.bfloat16)):
            raise RuntimeError(f"expected scalar type {c10_name(x.dtype)} but found {c10_name(p.dtype)}")


def _random_from(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/DistributionTemplates.h, ``random_from_to_impl``."""
    low, high = _arg(args, kwargs, 1, "from"), _arg(args, kwargs, 2, "to")
    if high is not None and low >= high:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")


def _random_to(args: tuple, kwargs: dict) -> None:
    """``random_(to)``: ``random_(0, to)`` (DistributionTemplates.h, ``random_from_to_impl``)."""
    _random_from((args[0], 0, _arg(args, kwargs, 1, "to")), {})


def _bernoulli(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/DistributionTemplates.h, ``bernoulli_impl_``."""
    p = _arg(args, kwargs, 1, "p", 0.5)
    if not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")


def _std_var(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/ReduceOps.cpp, ``std_var_out`` and ``std_var_mean_out``."""
    if not (args[0].is_floating_point() or args[0].is_complex()):
        raise RuntimeError("std and var only support floating point and complex dtypes")


def _sort(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/cuda/Sort.cpp (and native/Sort.cpp for the CPU's words)."""
    if args[0].is_complex():
        raise RuntimeError("Sort currently does not support complex dtypes on CUDA.")


def _index_select(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/TensorAdvancedIndexing.cpp and cuda/Indexing.cu, ``index_select_out``."""
    if _arg(args, kwargs, 2, "index").dim() > 1:
        raise IndexError("index_select(): Index is supposed to be a vector")


def _searchsorted(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/BucketizationUtils.h, ``searchsorted_pre_check``."""
    side, sorter = kwargs.get("side"), kwargs.get("sorter")
    if side is not None and side not in ("left", "right"):
        raise RuntimeError(f"torch.searchsorted(): side can only be 'left' or 'right' but got {side}")
    if sorter is not None and sorter.dtype is not torch.int64:
        raise RuntimeError(f"torch.searchsorted(): sorter must be a tensor of long dtype but got dtype "
                           f"{c10_name(sorter.dtype)}")


def _fft_half(last_dim_size: int | None) -> Callable[[tuple, dict], None]:
    """aten/src/ATen/native/cuda/CuFFTPlanCache.h, ``CuFFTConfig``: cuFFT plans a half-precision
    transform only on power-of-two signal sizes (for ``_fft_c2r``, the output's last one is
    ``last_dim_size``, at that position)."""
    def check(args: tuple, kwargs: dict) -> None:
        self, dim = args[0], _arg(args, kwargs, 1, "dim")
        if self.dtype not in (torch.float16, torch.complex32):
            return
        signal = [self.shape[d] for d in dim]
        if last_dim_size is not None and signal:
            signal[-1] = _arg(args, kwargs, last_dim_size, "last_dim_size")
        if any(n & (n - 1) for n in signal):
            raise RuntimeError("cuFFT only supports dimensions whose sizes are powers of two when computing in half "
                               f"precision, but got a signal size of{signal}")
    return check


class GPURefuses(Exception):
    """The error (its argument) a GPU's kernel raises for these arguments, whatever device serves
    the gateway: raised at the call as it is, not asked of the gateway (a CPU one would run the op),
    as the other checks' errors are."""


def _float_only(cuda_name: str) -> Callable[[tuple, dict], None]:
    """aten/src/ATen/native/cuda/Blas.cpp: CUDA's matrix products take floating and complex dtypes
    only, where the CPU's take integers too (``a @ b`` of two LongTensors); ``cuda_name`` is the
    name CUDA's dispatch gives in its refusal."""
    def check(args: tuple, kwargs: dict) -> None:
        dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32  # (mixed: the dtype check's error)
        if not (dtype.is_floating_point or dtype.is_complex):
            raise GPURefuses(RuntimeError(f'"{cuda_name}" not implemented for \'{c10_name(dtype)}\''))
    return check


def c10_name(dtype: torch.dtype) -> str:
    """c10's name of a dtype, as torch's messages print it (``Float``, ``Long``, ``ComplexDouble``)."""
    return _C10_NAMES.get(dtype, str(dtype).removeprefix("torch."))


_C10_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
              torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
              torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat",
              torch.complex128: "ComplexDouble", torch.complex32: "ComplexHalf"}

#: per op overload, its device kernel's checks at the call that its meta kernel leaves out
_CHECKS: dict[Any, Callable[[tuple, dict], None]] = {
    aten.convolution.default: _convolution,
    **dict.fromkeys((aten.uniform_.default, aten.uniform.default, aten.uniform.out), _uniform),
    **dict.fromkeys((aten.index_add.default, aten.index_add_.default, aten.index_add.out), _index_add),
    **dict.fromkeys((aten.bucketize.Tensor, aten.bucketize.Scalar, aten.bucketize.Tensor_out,
                     aten.bucketize.Scalar_out), _bucketize),
    **dict.fromkeys((aten.multinomial.default, aten.multinomial.out), _multinomial),
    aten.complex.out: _complex_out,
    aten.aminmax.out: _same_dtype_out("min", "max"),
    aten.as_strided_scatter.default: _as_strided_scatter,
    aten.native_layer_norm.default: _layer_norm,
    **dict.fromkeys((getattr(aten.random_, "from"), getattr(aten.random, "from"), aten.random.from_out),
                    _random_from),
    **dict.fromkeys((aten.random_.to, aten.random.to, aten.random.to_out), _random_to),
    **dict.fromkeys((aten.bernoulli_.float, aten.bernoulli.p), _bernoulli),
    **dict.fromkeys((aten.std.correction, aten.var.correction, aten.std_mean.correction, aten.var_mean.correction,
                     aten.std.correction_out, aten.var.correction_out), _std_var),
    **dict.fromkeys((aten.sort.default, aten.sort.stable, aten.sort.values, aten.sort.values_stable), _sort),
    **dict.fromkeys((aten.index_select.default, aten.index_select.out), _index_select),
    **dict.fromkeys((aten.searchsorted.Tensor, aten.searchsorted.Scalar, aten.searchsorted.Tensor_out,
                     aten.searchsorted.Scalar_out), _searchsorted),
    **dict.fromkeys((aten._fft_r2c.default, aten._fft_r2c.out, aten._fft_c2c.default, aten._fft_c2c.out),
                    _fft_half(None)),
    **dict.fromkeys((aten._fft_c2r.default, aten._fft_c2r.out), _fft_half(3)),
    **{op: _float_only(name) for op, name in (
        (aten.mm.default, "addmm_cuda"), (aten.addmm.default, "addmm_cuda"), (aten.bmm.default, "bmm_cuda"),
        (aten.baddbmm.default, "baddbmm_cuda"), (aten.mv.default, "addmv_impl_cuda"),
        (aten.addmv.default, "addmv_impl_cuda"), (aten.dot.default, "dot"), (aten.vdot.default, "vdot"))},
}

#: ops that write a tensor's metadata, not its elements, and are not tagged ``inplace_view``
_METADATA_ONLY = frozenset((aten.resize_, aten.resize_as_, aten.set_, aten.detach_))

#: ops whose kernels write an expanded tensor (FillKernel.cpp: ``set_check_mem_overlap(false)``,
#: "fill is idempotent"): not asked of the gateway, which would then describe every such call
_OVERLAP_ACCEPTED = frozenset((aten.fill_, aten.zero_))

#: ops whose checks, here or in their meta kernels, read float arguments, which must then be part
#: of their cache key (else ``x.geometric_(0.5)`` cached, ``x.geometric_(2.0)`` hit its entry)
READS_FLOATS = frozenset((aten.uniform_.default, aten.uniform.default, aten.uniform.out, aten.bernoulli_.float,
                          aten.bernoulli.p, aten.geometric_.default, aten.log_normal_.default,
                          aten.histc.default, aten.histc.out))


def check(func: Any, args: tuple, kwargs: dict) -> None:
    """Raise the error ``func``'s device kernel raises at the call for these arguments, where
    its meta kernel does not; the arguments' tensors are the op's wrappers."""
    own = _CHECKS.get(func)
    if own is not None:
        own(args, kwargs)
    for pos, name in _written(func):
        t = _arg(args, kwargs, pos, name) if pos is not None else kwargs.get(name)
        if isinstance(t, torch.Tensor) and _overlaps_itself(t):
            raise RuntimeError(_INTERNAL_OVERLAP)


def _overlaps_itself(t: torch.Tensor) -> bool:
    """aten/src/ATen/MemoryOverlap.cpp ``has_internal_overlap``'s ``Yes``: a dimension of stride
    0 and size above 1 (an ``expand``ed tensor), which the kernels that write a tensor refuse
    (``assert_no_internal_overlap``, TensorIterator's outputs); one that accepts it after all is
    told so by the gateway."""
    return any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride()))


@functools.cache
def _written(func: Any) -> tuple[tuple[int | None, str], ...]:
    """The tensor arguments whose values ``func`` writes, checked for internal overlap: (position,
    or None where keyword-only; name). None for the ops that change a tensor's metadata only
    (``t_``, ``resize_``, ``set_``) and for those that accept an expanded tensor (``fill_``)."""
    if torch.Tag.inplace_view in func.tags or func.overloadpacket in _METADATA_ONLY | _OVERLAP_ACCEPTED:
        return ()
    return tuple((None if a.kwarg_only else i, a.name) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write and str(a.type) == "Tensor")
