"""Sparse COO tensors on 'cuda', for what graph networks do with one: an adjacency moved to the
GPU (``adj.cuda()``, ``torch.sparse_coo_tensor(..., device='cuda')``, ``x.to_sparse()``) and
multiplied with dense features (pygcn's ``torch.spmm(adj, h)``, ``torch.sparse.mm``, ``adj @ h``),
with gradients; and ``nn.Embedding(sparse=True)``'s gradients, through the optimizers' steps.

A remote tensor is dense and strided (its wrapper carries shape and strides, and so does the
wire), so a sparse one is a wrapper of its own: its C++ layout is ``sparse_coo`` (``is_sparse``,
``layout``, ``_nnz()`` answer as torch's) and it holds its indices and values as two remote dense
tensors. The ops such a tensor meets are computed from those with dense ops on the gateway: a
product is an ``index_add`` of the scaled rows it gathers (its float sums may differ from a CPU's
in the last bits, as cuSPARSE's do). Any other op on it says so plainly; values that require
grad are refused rather than left without a gradient."""
from __future__ import annotations

from typing import Any

import torch

from .tensor import RemoteTensor

aten = torch.ops.aten
_META = torch.device("meta")


class RemoteSparse(torch.Tensor):
    """A sparse COO tensor on a remote 'cuda' device: ``_i`` (int64, sparse_dim × nnz) and ``_v``
    (nnz × dense dims) are RemoteTensors; ``_c`` says whether it is coalesced."""

    _i: torch.Tensor  # (RemoteTensors, as torch's ops on them return)
    _v: torch.Tensor
    _c: bool

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # (torch's way)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._i.device

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:
        return self._i.get_device()

    def type(self, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:  # type: ignore[override]
        """The legacy type name, as a GPU's ('torch.cuda.sparse.FloatTensor'); given a dtype, ``to``."""
        if dtype is None:
            return "torch.cuda.sparse." + torch.empty(0, dtype=self.dtype).type().removeprefix("torch.")
        if isinstance(dtype, torch.dtype):
            return self.to(dtype, non_blocking=non_blocking)
        raise _refused("legacy type conversions of sparse tensors")

    def numpy(self, *, force: bool = False) -> Any:
        """torch's refusal, which is about the layout (before the device, and with ``force`` too):
        the C++ one, reached here, refuses every tensor subclass instead."""
        raise TypeError("can't convert Sparse layout tensor to numpy. Use Tensor.to_dense() first.")

    def __reduce_ex__(self, proto: Any) -> Any:
        """Pickled as torch pickles a sparse tensor (its indices and values, 'cuda' tensors), so a
        checkpoint holding one loads where torch's would, with ``weights_only`` too."""
        return torch._utils._rebuild_sparse_tensor, (torch.sparse_coo, (self._i, self._v, self.shape, self._c))

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # (torch's stub)
        cpu = self.cpu()
        return repr(cpu)[:-1] + f", device='{self.device}')"


def make(indices: torch.Tensor, values: torch.Tensor, shape: Any, coalesced: bool) -> RemoteSparse:
    t = torch.Tensor._make_wrapper_subclass(RemoteSparse, list(shape), dtype=values.dtype,
                                            layout=torch.sparse_coo, device=_META)
    t._i, t._v, t._c = indices, values, coalesced
    return t


def upload(cpu: torch.Tensor, to_remote: Any, dtype: torch.dtype | None) -> RemoteSparse:
    """A CPU sparse COO tensor (or a remote one) put on a device by ``to_remote`` (a dense CPU or
    remote tensor → a RemoteTensor there), ``dtype`` its values' new dtype (None: kept)."""
    if cpu.requires_grad:
        raise _refused("moves of sparse tensors that require grad (a sparse leaf made on 'cuda' may)")
    i, v, c = (cpu._i, cpu._v, cpu._c) if isinstance(cpu, RemoteSparse) else \
        (cpu._indices(), cpu._values(), cpu.is_coalesced())
    if dtype is not None and dtype != v.dtype:
        v = v.to(dtype)
    return make(to_remote(i), to_remote(v), cpu.shape, c)


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """An aten op with a RemoteSparse among its arguments."""
    handler = _OPS.get(func)
    if handler is not None:
        return handler(*args, **kwargs)
    if func._opname.startswith("_foreach_"):
        return _foreach(func, args, kwargs)
    raise _refused(f"op {func.name()} on sparse tensors")


def _foreach(func: Any, args: tuple, kwargs: dict) -> Any:
    """A ``_foreach_`` op over lists holding sparse tensors (an optimizer's step over sparse
    gradients) runs tensor by tensor, as torch's own fallback runs one."""
    name = func._opname.removeprefix("_foreach_")
    each = getattr(torch.Tensor, name)
    n = len(args[0])
    results = [each(*(a[k] if type(a) in (list, tuple) else a for a in args), **kwargs) for k in range(n)]
    return None if name.endswith("_") else results


def involved(args: Any) -> bool:
    """Whether a RemoteSparse is among ``args`` (a list, tuple or dict of an op's arguments)."""
    values = args.values() if isinstance(args, dict) else args
    return any(isinstance(a, RemoteSparse) or (type(a) in (list, tuple) and involved(a)) for a in values)


def from_dense(x: RemoteTensor, sparse_dim: int | None = None, layout: Any = None, blocksize: Any = None) -> Any:
    """``x.to_sparse(sparse_dim)`` of a remote dense tensor: the indices over its first
    ``sparse_dim`` dimensions where it holds a nonzero, and the values there, coalesced."""
    k = x.dim() if sparse_dim is None else sparse_dim
    if layout not in (None, torch.sparse_coo) or blocksize is not None or not 0 < k <= x.dim():
        raise _refused(f"to_sparse to {layout} or over {k} dimensions")
    nonzero = x != 0
    if k < x.dim():
        nonzero = nonzero.flatten(k).any(-1)
    indices = nonzero.nonzero().t().contiguous()
    return make(indices, aten.index.Tensor(x, list(indices)), x.shape, True)


def build(indices: Any, values: Any, size: Any = None, *, dtype: Any = None, device: Any = None,
          pin_memory: Any = None, requires_grad: bool = False, check_invariants: Any = None,
          is_coalesced: Any = None) -> RemoteSparse:
    """``torch.sparse_coo_tensor`` of 'cuda' indices or values (a CPU one moves to the other's
    device); without ``size``, each sparse dimension is one past its largest index, as torch infers."""
    if requires_grad or (isinstance(values, torch.Tensor) and values.requires_grad and torch.is_grad_enabled()):
        raise _refused("sparse tensors made from values that require grad")
    remote = indices if isinstance(indices, RemoteTensor) else values
    indices, values = (torch.as_tensor(a, device=remote.device) for a in (indices, values))
    indices = indices.long() if indices.dtype != torch.int64 else indices
    if dtype is not None and dtype != values.dtype:
        values = values.to(dtype)
    if size is None:
        top = indices.amax(1) + 1 if indices.shape[1] else indices.new_zeros(indices.shape[0])
        size = [*top.tolist(), *values.shape[1:]]
    _check_as_torch(indices, values, size, check_invariants, is_coalesced)
    return make(indices, values, size, bool(is_coalesced))


def _check_as_torch(indices: torch.Tensor, values: torch.Tensor, size: Any, check_invariants: bool | None,
                    is_coalesced: bool | None) -> None:
    """torch's own checks of a sparse COO tensor's arguments, in its words and with its warning:
    its constructor on meta stand-ins of the same shapes checks the shapes and, where nothing
    opted in or out of the invariant checks, gives C++'s once-a-process warning that they are
    implicitly disabled (placed at the program's line by warning_location.py); where they are
    on, the check of the indices' values reads them from the gateway, as a GPU's are read."""
    check = torch.sparse.check_sparse_tensor_invariants.is_enabled() if check_invariants is None else check_invariants
    torch.sparse_coo_tensor(torch.empty(indices.shape, dtype=indices.dtype, device=_META),
                            torch.empty(values.shape, dtype=values.dtype, device=_META), size,
                            check_invariants=False if check else check_invariants, is_coalesced=is_coalesced,
                            device=_META)
    if check:
        torch._validate_sparse_coo_tensor_args(indices.cpu(), torch.zeros((), dtype=values.dtype).expand(values.shape),
                                               size, is_coalesced)


def _refused(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"remotecuda: {what} are not supported on a remote 'cuda' device (a sparse COO tensor there "
        "takes .cuda()/.cpu(), coalesce(), indices()/values(), to_dense(), t(), sum(), sums, scaling "
        "by a number or a dense mask, zeros_like, index_select, torch.sparse.softmax and products with "
        "dense tensors: torch.sparse.mm, torch.spmm, @); use t.to_dense(), or keep it on the CPU")


def _dense(x: Any, op: str) -> torch.Tensor:
    if not isinstance(x, RemoteTensor):
        raise RuntimeError(f"remotecuda: {op} of a sparse 'cuda' tensor needs a dense 'cuda' tensor, got "
                           f"{type(x).__name__} on {getattr(x, 'device', None)}")
    return x


def _product(s: RemoteSparse, x: Any, op: str) -> torch.Tensor:
    """``s @ x`` for a 2-d sparse ``s`` and a dense matrix ``x``: the scaled rows of ``x`` that
    each nonzero picks, added into the rows it names."""
    x = _dense(x, op)
    if s.dim() != 2 or s._v.dim() != 1:
        raise _refused("products of sparse tensors other than 2-d with scalar values")
    if x.dim() != 2 or x.shape[0] != s.shape[1]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({s.shape[0]}x{s.shape[1]} and "
                           f"{'x'.join(map(str, x.shape))})")
    if s.dtype != x.dtype:  # (torch's words, naming the types as C++ does)
        raise RuntimeError(f"expected scalar type {_scalar_name(s.dtype)} but found {_scalar_name(x.dtype)}")
    rows, cols = s._i[0], s._i[1]
    picked = x.index_select(0, cols) * s._v.unsqueeze(1)
    return x.new_zeros((s.shape[0], x.shape[1])).index_add_(0, rows, picked)


def _scalar_name(dtype: torch.dtype) -> str:
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")


def _mm(s: Any, x: Any) -> torch.Tensor:
    """``s @ x``, or ``x @ s`` of a dense ``x`` and a sparse ``s`` as ``(s.t() @ x.t()).t()``."""
    if isinstance(x, RemoteSparse):
        if isinstance(s, RemoteSparse):
            raise _refused("products of two sparse tensors (sparse @ sparse)")
        if s.dim() != 2 or s.shape[1] != x.shape[0]:
            raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({'x'.join(map(str, s.shape))} and "
                               f"{x.shape[0]}x{x.shape[1]})")
        return _product(_t(x), _dense(s, "mm").t(), "mm").t()
    return _product(s, x, "mm")


def _index_select(s: RemoteSparse, dim: int, index: Any) -> RemoteSparse:
    """``s.index_select(dim, index)`` over a sparse dimension: each entry once for each place its
    index there holds in ``index`` (repeats too), renumbered to that place."""
    dim %= s.dim()
    if not isinstance(s, RemoteSparse) or dim >= s._i.shape[0]:
        raise _refused("index_select of a sparse tensor over a dense dimension, or into one")
    index = _dense(index, "index_select")
    entry, place = (s._i[dim].unsqueeze(1) == index.unsqueeze(0)).nonzero().unbind(1)
    indices = s._i.index_select(1, entry)
    indices[dim] = place
    shape = list(s.shape)
    shape[dim] = index.shape[0]
    return make(indices, s._v.index_select(0, entry), shape, False)


def _mv(s: Any, v: Any) -> torch.Tensor:
    """``s @ v`` of a vector (PageRank's power iteration)."""
    if not isinstance(s, RemoteSparse) or _dense(v, "mv").dim() != 1:
        raise _refused("products of a dense tensor with a sparse one (dense @ sparse)")
    return _product(s, v.unsqueeze(1), "mv").squeeze(1)


def _addmm(self: Any, s: Any, x: Any, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    """``beta * self + alpha * (s @ x)`` (``torch.sparse.mm`` sends ``beta=0`` and a placeholder ``self``)."""
    if not isinstance(s, RemoteSparse):
        raise _refused("products of a dense tensor with a sparse one (dense @ sparse)")
    out = _product(s, x, "addmm")
    if alpha != 1:
        out = out * alpha
    if beta != 0:
        out = out + _dense(self, "addmm") * beta if beta != 1 else out + _dense(self, "addmm")
    return out


def _t(s: RemoteSparse) -> RemoteSparse:
    if s.dim() != 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 sparse and 0 dense dimensions, but self is "
                           f"{s._i.shape[0]} sparse and {s._v.dim() - 1} dense dimensions")
    return make(s._i.flip(0), s._v, (s.shape[1], s.shape[0]), False)


def _transpose(s: RemoteSparse, d0: int, d1: int) -> RemoteSparse:
    d0, d1 = d0 % s.dim(), d1 % s.dim()
    if d0 == d1:
        return s
    if s._v.dim() != 1:
        raise _refused("transposes of sparse tensors with dense dimensions")
    order = list(range(s.dim()))
    order[d0], order[d1] = order[d1], order[d0]
    shape = [s.shape[k] for k in order]
    return make(torch.stack([s._i[k] for k in order]), s._v, shape, False)


def _coalesce(s: RemoteSparse) -> RemoteSparse:
    """Indices sorted and unique, the values of repeated ones summed, as ``coalesce()`` makes them."""
    if s._c:
        return s
    sizes = s.shape[:s._i.shape[0]]
    flat = s._i[0].clone()
    for k in range(1, len(sizes)):
        flat = flat * sizes[k] + s._i[k]
    uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    values = s._v.new_zeros((uniq.shape[0], *s._v.shape[1:])).index_add_(0, inverse, s._v)
    parts = []
    for size in reversed(sizes):
        parts.append(uniq % size)
        uniq = torch.div(uniq, size, rounding_mode="floor")
    return make(torch.stack(parts[::-1]), values, s.shape, True)


def _to_dense(s: RemoteSparse, dtype: Any = None, *, masked_grad: Any = None) -> torch.Tensor:
    values = s._v if dtype is None else s._v.to(dtype)
    out = values.new_zeros(tuple(s.shape))
    return out.index_put_(tuple(s._i), values, accumulate=True)


def _to_copy(s: RemoteSparse, *, dtype: Any = None, layout: Any = None, device: Any = None,
             pin_memory: Any = None, non_blocking: bool = False, memory_format: Any = None) -> Any:
    if layout not in (None, torch.sparse_coo):
        raise _refused(f"conversions to {layout}")
    if device is not None and device.type == "cpu":
        values = s._v.cpu() if dtype is None else s._v.cpu().to(dtype)
        return torch.sparse_coo_tensor(s._i.cpu(), values, s.shape, is_coalesced=s._c, check_invariants=False)
    if device is None or device.type == "meta" or device.index in (None, s._i.get_device()):
        return make(s._i, s._v if dtype is None else s._v.to(dtype), s.shape, s._c)
    return make(s._i.to(device), s._v.to(device, dtype), s.shape, s._c)


def _copy_(dst: Any, src: Any, non_blocking: bool = False) -> RemoteSparse:
    """A sparse tensor's contents replaced by another's (``load_state_dict`` of a sparse buffer)."""
    if not isinstance(dst, RemoteSparse) or src.layout is not torch.sparse_coo or src.shape != dst.shape:
        raise _refused("copies between sparse and dense tensors, or of another shape,")
    src = src if isinstance(src, RemoteSparse) else src.to(dst.device)
    dst._i, dst._v, dst._c = src._i, src._v.to(dst.dtype), src._c
    return dst


def _sparse_mask(x: Any, mask: RemoteSparse) -> RemoteSparse:
    """``x``'s values where ``mask`` has its (coalesced) indices: to_sparse's gradient."""
    if isinstance(x, RemoteSparse):
        x = _to_dense(x)
    mask = _coalesce(mask)
    return make(mask._i, aten.index.Tensor(_dense(x, "sparse_mask"), list(mask._i)), mask.shape, True)


def _sparse_sum(s: RemoteSparse, dim: Any = None, dtype: Any = None) -> torch.Tensor:
    """``torch.sparse.sum(s, dim)`` (a GCN's degrees): sparse while sparse dimensions remain, as torch's."""
    k = s._i.shape[0]
    dims = sorted({d % s.dim() for d in ([dim] if isinstance(dim, int) else dim)})
    values = s._v if dtype is None else s._v.to(dtype)
    dense = [d - k + 1 for d in dims if d >= k]
    if dense:
        values = values.sum(dense)
    keep = [d for d in range(k) if d not in dims]
    if not keep:
        return values.sum(0)
    shape = [n for d, n in enumerate(s.shape) if d not in dims]
    return _coalesce(make(torch.stack([s._i[d] for d in keep]), values, shape, False))


def _add(a: Any, b: Any, *, alpha: Any = 1) -> torch.Tensor:
    """``a + alpha * b``: of two sparse tensors, their entries together, coalesced (as the CPU's
    sum of coalesced ones); of a dense and a sparse one, dense."""
    if isinstance(a, RemoteSparse) and isinstance(b, RemoteSparse):
        if a.shape != b.shape:
            raise RuntimeError(f"add: expected 'self' and 'other' to have same size, but self has size "
                               f"{list(a.shape)} while other has size {list(b.shape)}")
        values = torch.cat([a._v, b._v if alpha == 1 else b._v * alpha])
        return _coalesce(make(torch.cat([a._i, b._i], 1), values, a.shape, False))
    if isinstance(b, RemoteSparse) and isinstance(a, RemoteTensor):
        b = b if alpha == 1 else _mul(b, alpha)
        return _dense(a, "add").clone().index_put_(tuple(b._i), b._v.to(a.dtype), accumulate=True)
    raise _refused("sums of a sparse tensor and a dense one into a sparse result (sparse + dense)")


def _add_(a: Any, b: Any, *, alpha: Any = 1) -> Any:
    """``a += alpha * b`` (an optimizer's step with a sparse gradient, a gradient accumulated)."""
    if isinstance(a, RemoteSparse):
        total = _add(a, b, alpha=alpha)
        if not isinstance(total, RemoteSparse):
            raise _refused("sums of a sparse tensor and a dense one into a sparse result (sparse + dense)")
        a._i, a._v, a._c = total._i, total._v, total._c
        return a
    if not isinstance(b, RemoteSparse) or a.shape != b.shape:
        raise _refused("in-place sums of these tensors")
    values = b._v if alpha == 1 else b._v * alpha
    return _dense(a, "add_").index_put_(tuple(b._i), values.to(a.dtype), accumulate=True)


def _mul_(s: Any, other: Any) -> RemoteSparse:
    """``s *= number`` (SGD's momentum buffer of a sparse gradient)."""
    if not isinstance(s, RemoteSparse):
        raise _refused("in-place products of a dense tensor with a sparse one")
    s._v = _mul(s, other)._v
    return s


def _values_only(fn: Any, linear: bool = True) -> Any:
    """An op that maps zero to zero, applied to the values (``-adj``, ``adj / 2``, ``adj ** 2``);
    one that is not linear to those of the coalesced tensor, whose repeated entries are summed."""
    def op(s: Any, *args: Any, **kwargs: Any) -> RemoteSparse:
        if not isinstance(s, RemoteSparse) or any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args):
            raise _refused(f"{fn.__name__} of a sparse tensor and a tensor")
        s = s if linear else _coalesce(s)
        return make(s._i, fn(s._v, *args, **kwargs), s.shape, s._c)
    return op


def _softmax(s: RemoteSparse, dim: int, half_to_float: bool = False) -> RemoteSparse:
    """``torch.sparse.softmax(s, dim)``: over the entries that share their other indices (missing
    ones count as -inf), on the coalesced tensor, as torch's; without gradients."""
    k = s._i.shape[0]
    dim %= s.dim()
    if s._v.dim() != 1 or half_to_float or s._v.requires_grad:
        raise _refused("softmax of sparse tensors with dense dimensions or values that require grad")
    c = _coalesce(s)
    flat = torch.zeros_like(c._i[0])
    for d in range(k):
        if d != dim:
            flat = flat * s.shape[d] + c._i[d]
    groups = torch.unique(flat, return_inverse=True)[1]
    n = c._v.shape[0]
    top = c._v.new_full((n,), float("-inf")).scatter_reduce(0, groups, c._v, "amax")
    e = (c._v - top[groups]).exp()
    return make(c._i, e / c._v.new_zeros(n).index_add(0, groups, e)[groups], s.shape, True)


def _indices(s: RemoteSparse) -> torch.Tensor:
    if not s._c:
        raise RuntimeError("Cannot get indices on an uncoalesced tensor, please call .coalesce() first")
    return s._i


def _values(s: RemoteSparse) -> torch.Tensor:
    if not s._c:
        raise RuntimeError("Cannot get values on an uncoalesced tensor, please call .coalesce() first")
    return s._v


def _mul(s: Any, other: Any) -> RemoteSparse:
    """A sparse tensor scaled by a number or a 0-d tensor (``adj * 0.5``), or multiplied by a
    dense tensor that broadcasts to its shape (a mask): each entry by the dense value at its
    index, as the CPU's product (which keeps the entries, and whether they are coalesced)."""
    if not isinstance(s, RemoteSparse):
        s, other = other, s
    if isinstance(other, RemoteSparse):
        raise _refused("products of two sparse tensors (mul)")
    if isinstance(other, torch.Tensor) and other.dim() > 0:
        if other.requires_grad or s._v.requires_grad:
            raise _refused("products of a sparse tensor with a dense one that requires grad (mul)")
        if torch.broadcast_shapes(other.shape, s.shape) != s.shape:
            raise _refused("products of a sparse tensor with a dense one of a larger shape (mul)")
        other = aten.index.Tensor(_dense(other, "mul").expand(s.shape), list(s._i))
    return make(s._i, s._v * other, s.shape, s._c)


def _zeros_like(s: RemoteSparse, *, dtype: Any = None, layout: Any = None, device: Any = None,
                pin_memory: Any = None, memory_format: Any = None) -> Any:
    """``torch.zeros_like`` of a sparse tensor: one with no entries (coalesced), as the CPU's."""
    if layout not in (None, torch.sparse_coo) or (device is not None and device.type == "cpu"):
        raise _refused(f"zeros_like of a sparse tensor to {layout or device}")
    k = s._i.shape[0]
    values = s._v.new_zeros((0, *s._v.shape[1:]), dtype=dtype or s.dtype)
    return make(s._i.new_zeros((k, 0)), values, s.shape, True)


def _mark_coalesced(s: RemoteSparse, coalesced: bool) -> RemoteSparse:
    """``s._coalesced_(flag)``: the caller vouches that the indices are (or are not) coalesced,
    as PyG's ``to_torch_coo_tensor`` does for the sorted edge index it built."""
    s._c = coalesced
    return s


_OPS: dict[Any, Any] = {
    aten.mm.default: _mm,
    aten._sparse_mm.default: _mm,
    aten.mv.default: _mv,
    aten._sparse_addmm.default: _addmm,
    aten.addmm.default: _addmm,
    aten.t.default: _t,
    aten.transpose.int: _transpose,
    aten.coalesce.default: _coalesce,
    aten._coalesce.default: _coalesce,
    aten.to_dense.default: _to_dense,
    aten._to_dense.default: _to_dense,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.indices.default: _indices,
    aten.sparse_mask.default: _sparse_mask,
    aten.values.default: _values,
    aten._indices.default: lambda s: s._i,
    aten._values.default: lambda s: s._v,
    aten._nnz.default: lambda s: s._i.shape[1],
    aten.sparse_dim.default: lambda s: s._i.shape[0],
    aten.dense_dim.default: lambda s: s._v.dim() - 1,
    aten.is_coalesced.default: lambda s: s._c,
    aten._coalesced_.default: _mark_coalesced,
    aten.detach.default: lambda s: make(s._i, s._v, s.shape, s._c),
    aten.alias.default: lambda s: make(s._i, s._v, s.shape, s._c),
    aten.clone.default: lambda s, memory_format=None: make(s._i.clone(), s._v.clone(), s.shape, s._c),
    aten.is_pinned.default: lambda s, device=None: False,
    aten.sum.default: lambda s, dtype=None: s._v.sum(dtype=dtype),
    aten._sparse_sum.dim: _sparse_sum,
    aten._sparse_sum.dim_dtype: _sparse_sum,
    aten.add.Tensor: _add,
    aten.add_.Tensor: _add_,
    aten.neg.default: _values_only(torch.neg),
    aten.div.Scalar: _values_only(torch.div),
    aten.div.Tensor: _values_only(torch.div),
    aten.pow.Tensor_Scalar: _values_only(torch.pow, linear=False),
    aten.mul.Scalar: _mul,
    aten.mul_.Scalar: _mul_,
    aten.mul_.Tensor: _mul_,
    aten.mul.Tensor: _mul,
    aten.zeros_like.default: _zeros_like,
    aten.index_select.default: _index_select,
    aten._sparse_softmax.default: _softmax,
}
