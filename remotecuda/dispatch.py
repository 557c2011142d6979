"""The op dispatcher: every aten op on a RemoteTensor comes here.

For each op it (1) walks the arguments once, in schema order, turning tensors into
gateway handles and building the dispatch-cache key; (2) finds the output metadata in
the cache, or computes it once by running the meta kernel on plain meta tensors built
from the wrappers' metadata (never on the wrappers: Python meta kernels read the
overridden ``.device`` and fall into CUDA's lazy init); (3) creates output wrappers
with fresh client-chosen handles and queues the op. No reply is awaited.

Ops whose output the client cannot predict (data-dependent shapes such as
``nonzero``, non-tensor results such as ``_local_scalar_dense``, ops without a meta
kernel) take the *describe* path: the gateway runs the op once, keeps the outputs
under handles from a block the client reserved, and replies with their metadata.

The cache, its keys, entries and counters are in dispatch_cache.py. The runtime
(runtime.py) makes one Dispatcher per activation and owns it, with its op table, cache and
per-thread state; the dispatch mode and ``RemoteTensor.dispatch`` call its ``dispatch``
while it is installed.
"""
from __future__ import annotations

import functools
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._C import _DisableTorchDispatch
from torch._prims_common import canonicalize_dim, make_contiguous_strides_for

from remotecuda_wire import layouts
from remotecuda_wire.protocol import DTYPE_EXT, OP_NAMESPACES

from . import call_checks, downloads, known, sparse, transfer
from . import dispatch_cache as dc
from .device_type import DEVICE
from .dispatch_cache import ArgOut, Bypass, ConstOut, DispatchCache, Entry, NewOut, NewTensor, Outputs, ViewOut
from .errors import GatewayLostError, RemoteCUDAError
from .generator import wire_ref
from .tensor import RemoteStorage, RemoteTensor, extent, is_pinned, layout, make, refresh_key, wrap

aten = torch.ops.aten
_Tag = torch.Tag
_ATOMIC = frozenset((int, float, bool, str, type(None), complex))
#: argument types that are never a wrapper (checked before the slower isinstance)
_PLAIN = _ATOMIC | {list, tuple}
_META = torch.device("meta")
_CUDA = torch.device("cuda")
#: return types whose values the meta kernel gets right (SymInts are shapes, e.g. flash attention's max_q)
_TENSOR_RETURNS = {"Tensor", "List[Tensor]", "Optional[Tensor]", "List[Optional[Tensor]]", "SymInt"}
#: ops that accept CPU tensors (of any size) next to CUDA ones, as on a real GPU
_CPU_OK = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
           aten._index_put_impl_.default, aten.copy_.default, aten._to_copy.default}
#: ops that change a tensor's own shape/stride/storage in place
_METADATA_MUTATION = {aten.resize_.default, aten.resize_as_.default, aten.set_.source_Tensor,
                      aten.set_.source_Tensor_storage_offset}


class DeviceMismatch(RuntimeError):
    """Tensors of an op on two devices. A traceback names it ``RuntimeError``, as a GPU's torch
    names its most common error (the class stays distinct for compiled.py to recognise)."""


DeviceMismatch.__module__ = "builtins"
DeviceMismatch.__name__ = DeviceMismatch.__qualname__ = "RuntimeError"


@dataclass(slots=True, eq=False)
class OpMeta:
    """What the schema says about an op, computed once per OpOverload.

    Hashed by identity: it heads the op's dispatch-cache key, in place of the OpOverload,
    whose ``__hash__`` is a Python function.
    """

    func: Any
    name: str  # wire name, aten::name.overload
    ret_alias: tuple  # per return: None or (position, arg name, is_write)
    multi: bool  # several returns (a tuple)
    bypass: str | None  # why the gateway must describe every call's outputs (dispatch_cache's reasons)
    fully_inplace: bool  # every output is a written argument
    metadata_mutation: bool
    cpu_ok: bool
    float_values: bool  # float arguments' values are part of the cache key (see _float_values)
    special: Any = None  # a handler replacing the common path (transfers, copies)


def _op_meta(func: Any) -> OpMeta:
    schema = func._schema
    ns_name = schema.name
    name = f"{ns_name}.{func._overloadname}"
    sargs = schema.arguments
    ret_alias = []
    for r in schema.returns:
        ai = r.alias_info
        found = None
        if ai is not None:
            sets = set(ai.before_set) or _element_aliases(schema)
            for j, a in enumerate(sargs):
                if a.alias_info is not None and set(a.alias_info.before_set) & sets:
                    found = (None if a.kwarg_only else j, a.name, bool(ai.is_write))
                    break
        ret_alias.append(found)
    fully_inplace = (all(ra is not None and ra[2] for ra in ret_alias) if ret_alias else schema.is_mutable)
    return OpMeta(func, name, tuple(ret_alias), len(schema.returns) > 1, _bypass(func), fully_inplace,
                  _Tag.inplace_view in func.tags or func in _METADATA_MUTATION, func in _CPU_OK,
                  (not fully_inplace and _float_values(sargs)) or func in call_checks.READS_FLOATS)


#: ops that read their ``info`` to raise at the call, on a GPU too (every overload, ``out=`` ones
#: included): ``_linalg_check_errors`` (of ``linalg.cholesky``, ``inv``, ``solve``) and the kernels
#: that call it inside: ``svd`` and ``eigh`` (so ``svdvals``, ``eigvalsh``, ``matrix_rank``,
#: ``cond``...), ``pinv``, ``cholesky_inverse``, the legacy ``cholesky``, and ``eig``, which a GPU
#: runs on the host; the ``*_ex`` ops asked to ``check_errors`` are ``_check_errors``
_CHECK_AT_CALL = frozenset({aten._linalg_check_errors, aten._linalg_svd, aten._linalg_eigh, aten.linalg_pinv,
                            aten.cholesky_inverse, aten.cholesky, aten.linalg_eig})


def _element_aliases(schema: Any) -> set:
    """The alias sets of a returned list's elements: ``split``, ``chunk`` and ``unbind`` return
    ``Tensor(a)[]``, views of ``self`` each, where the binding shows the list's own, empty set."""
    return set(re.findall(r"Tensor\((\w+)\)\[\]", str(schema).partition(" -> ")[2]))


def _bypass(func: Any) -> str | None:
    """Why ``func``'s outputs can never come from the cache, or None."""
    if func.overloadpacket in _CHECK_AT_CALL:
        return dc.CHECKS_AT_CALL
    if not all(str(r.type) in _TENSOR_RETURNS for r in func._schema.returns):
        return dc.NON_TENSOR_OUTPUT
    if _Tag.data_dependent_output in func.tags:
        return dc.DATA_DEPENDENT_OUTPUT
    if _Tag.dynamic_output_shape in func.tags and func is not aten.index.Tensor:
        return dc.DYNAMIC_OUTPUT_SHAPE  # (index's meta kernel tells: a boolean mask is refused there)
    return None


def _float_values(sargs: Any) -> bool:
    """Whether float arguments' values must be in the cache key: where they can set an output's
    shape. Elsewhere only their type is, so that an optimizer step with a new learning rate each
    step still hits. From the schema: a ``float[]`` argument (upsampling's ``scale_factors``, the
    only float arguments among aten's tensor ops that size an output), or no tensor argument at all
    (factories: ``arange(0, 1.5, .1)``). Cross-check mode (REMOTECUDA_CHECK_CACHE=1, on in the
    tests) recomputes every hit with the actual values, so an op that breaks this rule fails there."""
    types = [str(a.type) for a in sargs]
    return any(t in _FLOAT_LISTS for t in types) or not any(t in _TENSOR_ARGS for t in types)


#: schema types (as ``str(argument.type)``) of float lists and of tensor arguments, for _float_values
_FLOAT_LISTS = {"List[float]", "Optional[List[float]]"}
_TENSOR_ARGS = {"Tensor", "Optional[Tensor]", "List[Tensor]", "List[Optional[Tensor]]"}
#: ops whose tensors must share a dtype, which their meta kernels do not check (a float64 batch
#: into a float32 nn.Linear): refused here at once, as on a device, not at the next sync point
_SAME_DTYPE = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
               aten.mv.default, aten.addmv.default}
#: ops whose meta kernel accepts any ``dim``: (the tensor's position, the dim's position or None,
#: its name); the device's kernel refuses one out of range, so the gateway is asked, at the call
_UNCHECKED_DIM: dict[Any, tuple[int, int | None, str]] = {
    aten._softmax.default: (0, 1, "dim"), aten._log_softmax.default: (0, 1, "dim"),
    aten._softmax_backward_data.default: (1, 2, "dim"), aten.sort.default: (0, 1, "dim"),
    aten.sort.stable: (0, None, "dim")}


def _tensor_dtype(args: tuple, i: int) -> torch.dtype | None:
    return args[i].dtype if len(args) > i and isinstance(args[i], torch.Tensor) else None


#: ops whose meta kernels pass dtypes their device kernels refuse at the call (a float index, a
#: long softmax, a value of another dtype put into a tensor): such a signature is asked of the
#: gateway at once (``_refused``), so the error comes at the call as on a GPU, not at a later sync
_DTYPE_SUSPECT: dict[Any, Callable[[tuple], bool]] = {
    # (a one-element value may take the masked-fill path, which reads it whatever its dtype, and
    # refuses a byte mask: ``x[uint8_mask] = 0``)
    **{op: lambda a: (_tensor_dtype(a, 2) not in (None, _tensor_dtype(a, 0)) and a[2].numel() != 1
                      or any(isinstance(i, torch.Tensor) and i.dtype is torch.uint8 for i in a[1]))
       for op in (aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default)},
    aten.index_select.default: lambda a: _tensor_dtype(a, 2) not in (None, torch.int32, torch.int64),
    # (an int32 position into a KV cache by index_copy_, as gpt-fast keeps ``input_pos``; a float16
    # source into a float32 buffer)
    **{op: lambda a: _tensor_dtype(a, 2) is not torch.int64 or _tensor_dtype(a, 3) is not _tensor_dtype(a, 0)
       for op in (aten.index_copy.default, aten.index_copy_.default)},
    **{op: lambda a: (_tensor_dtype(a, 2) not in (torch.int32, torch.int64)
                      or _tensor_dtype(a, 3) is not _tensor_dtype(a, 0))
       for op in (aten.index_add.default, aten.index_add_.default)},
    **{op: lambda a: _tensor_dtype(a, 2) is not torch.int64
       for p in (aten.index_fill, aten.index_fill_) for op in (p.int_Scalar, p.int_Tensor)},
    **{op: lambda a: _tensor_dtype(a, 1) is not torch.int64 or _tensor_dtype(a, 2) is not _tensor_dtype(a, 0)
       for op in (aten.put.default, aten.put_.default)},
    # (float64 labels from NumPy into binary_cross_entropy; a complex number of two float dtypes)
    **{op: lambda a: _tensor_dtype(a, 1) is not _tensor_dtype(a, 0)
       for op in (aten.binary_cross_entropy.default, aten.polar.default, aten.complex.default)},
    # (a float64 batch into a float32 convolution, or the weights and bias of two dtypes)
    aten.convolution.default: lambda a: (_tensor_dtype(a, 1) is not _tensor_dtype(a, 0)
                                         or _tensor_dtype(a, 2) not in (None, _tensor_dtype(a, 0))),
    **{op: lambda a: _tensor_dtype(a, 1) not in (None, torch.int64)
       for op in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)},
    # (an integer to a negative integer power, multinomial of integer weights: checks the
    # device's C++ kernel makes at the call, which torch's Python meta kernels leave out)
    **{op: lambda a: type(a[1]) is int and a[1] < 0 and not (a[0].is_floating_point() or a[0].is_complex())
       for op in (aten.pow.Tensor_Scalar, aten.pow_.Scalar)},
    aten.multinomial.default: lambda a: not a[0].is_floating_point(),
    **{op: lambda a: not (_tensor_dtype(a, 0) or torch.float32).is_floating_point
       for op in (aten._softmax.default, aten._log_softmax.default)},
    **{op: lambda a: _tensor_dtype(a, 1) not in (None, torch.bool)
       for op in (aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_fill.Tensor,
                  aten.masked_fill_.Tensor, aten.masked_scatter.default, aten.masked_scatter_.default)},
}

#: ``out=`` overloads of structured linalg kernels whose meta functions (BatchLinearAlgebra.cpp's
#: ``TORCH_META_FUNC``s) give their matrices column-major strides, ``set_output_strided`` with
#: ``batched_matrix_contiguous_strides(..., /*f_contig=*/true)``, which torchgen's ``resize_out``
#: applies to an ``out`` it resizes (on every device); their Python meta kernels resize it
#: row-major, and the gateway's tensor then had other strides than the client's (a later
#: ``Q.view(-1)`` passed here and failed there)
_COLUMN_MAJOR_OUT = frozenset({aten.linalg_qr.out, aten.linalg_lu_factor_ex.out, aten.triangular_solve.X,
                               aten.linalg_lu_solve.out, aten.linalg_householder_product.out,
                               aten.linalg_ldl_factor_ex.out})


def _restride_resized_outs(m: OpMeta, kwargs: dict, out: Any) -> None:
    """Give the matrices among ``out`` (meta tensors: the op's results, its ``out=`` arguments
    after the meta kernel) that it resized the batched column-major strides of ``_COLUMN_MAJOR_OUT``.
    ``kwargs`` are the op's own, whose wrappers keep their shapes until the op is sent."""
    for r, alias in zip(out if m.multi else (out,), m.ret_alias):
        given = kwargs.get(alias[1]) if alias is not None else None
        if isinstance(r, torch.Tensor) and given is not None and r.dim() >= 2 and given.shape != r.shape:
            r.as_strided_(r.shape, make_contiguous_strides_for(r.shape, row_major=False))


@functools.cache
def _functional(func: Any) -> Any:
    """The functional overload of an ``out=`` overload (``aten.tril.out``: ``aten.tril.default``),
    the one whose arguments are the others; None for other ops, or where there is none."""
    schema = func._schema
    outs = [a for a in schema.arguments if a.is_out]
    if not outs or not all(a.kwarg_only for a in outs):
        return None
    want = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
    for name in func.overloadpacket.overloads():
        f = getattr(func.overloadpacket, name)
        if not f._schema.is_mutable and [(a.name, str(a.type)) for a in f._schema.arguments] == want:
            return f
    return None


class _OutCast(TypeError):
    """An ``out=`` of another dtype than the op's result, which the meta kernel casts into (its
    ``out_wrapper`` takes any dtype the result casts to) and the device's kernel may refuse at the
    call (a structured kernel's ``resize_out`` wants the result's dtype: ``torch.tril(x, out=y64)``)
    or accept (TensorIterator casts: ``torch.add(x, y, out=y64)``, ``torch.sum(x, 0, out=y64)``):
    the gateway is asked once (``Dispatcher._refused``), and ``entry``, the meta kernel's outputs,
    describes the signature where it accepts."""

    def __init__(self, name: str, entry: Any):
        super().__init__(f"{name}: an out= of another dtype than its result")
        self.entry = entry


def _out_casts(func: Any, margs: list, mkw: dict) -> bool:
    """Whether an ``out=`` (meta tensors, as the op was given them) has another dtype than the
    result the functional overload gives for the same arguments."""
    functional = _functional(func)
    if functional is None:
        return False
    outs = [a.name for a in func._schema.arguments if a.is_out]
    given = [mkw[n] for n in outs if isinstance(mkw.get(n), torch.Tensor)]
    try:
        with _DisableTorchDispatch():
            natural = functional(*margs, **{k: v for k, v in mkw.items() if k not in outs})
    except Exception:  # (no meta kernel, or one that needs values: the out= overload's decides)
        return False
    natural = natural if isinstance(natural, tuple) else (natural,)
    return any(isinstance(r, torch.Tensor) and r.dtype is not o.dtype for r, o in zip(natural, given))


#: advanced indexing, which takes a CPU tensor indexed with 'cuda' indices as a GPU's torch does
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


def _unshown(*args: Any, **kwargs: Any) -> None:
    """``warnings.showwarning`` while a meta kernel runs (``Dispatcher._compute``)."""


class _NeedUpload(Exception):
    """A CPU tensor sits among the arguments; take the slow path that uploads it."""


def _walk(values: Any, key: list, s: Any, float_values: bool) -> tuple[list, Any]:
    """One pass over an op's arguments in schema order: their wire forms, their parts of the
    cache key (appended to ``key``) and the session of the remote tensors among them (``s``,
    or the one found). A function rather than an object: it runs on every op."""
    out = []
    for a in values:
        t = type(a)
        if t is RemoteTensor or (t not in _PLAIN and isinstance(a, RemoteTensor)):
            if a._s is not s:
                s = _join(s, a._s)
            key.append(a._k)
            out.append(a._w)
        elif t in _ATOMIC:
            # a float's value only matters where it can shape the output: optimizer steps with a
            # new learning rate each step must still hit the cache
            key.append((t, a) if t is not float or float_values else t)
            out.append(a)
        elif t is list or t is tuple:
            key.append(("[", len(a)))
            w, s = _walk(a, key, s, float_values)
            out.append(w)
        else:
            out.append(_wire_other(a, t, key, s))
    return out, s


def _join(s: Any, other: Any) -> Any:
    """The session of an op whose arguments so far were on ``s`` (None: no tensor yet) and ``other``."""
    if s is None:
        return other
    for x in (s, other):  # a tensor of a session closed since (deactivate): not a device question
        if x.closed:
            raise GatewayLostError(f"this remotecuda session is closed{x.closed_why}")
    raise DeviceMismatch("Expected all tensors to be on the same device, but found at least two "
                         f"devices, cuda:{s.vdev} and cuda:{other.vdev}!")


def _wire_other(a: Any, t: type, key: list, s: Any) -> Any:
    """``_walk`` for the rarer argument types (devices, dtypes, generators...); ``s``: the op's
    session as found so far."""
    if t is DEVICE:
        key.append("dev")
        return _CUDA if a.type in ("cuda", "meta") else a
    if t is torch.dtype:
        key.append(a)
        ext = DTYPE_EXT.get(a)
        if ext is None:
            raise unsendable_dtype(a)
        return ext
    if t is torch.memory_format or t is torch.layout:
        key.append(a)
        return a
    if isinstance(a, torch.Tensor):
        raise _NeedUpload()
    if isinstance(a, torch.SymInt):
        a = int(a)
        key.append((int, a))
        return a
    if isinstance(a, torch._C.Generator):
        key.append("gen")
        return wire_ref(a, s)
    raise NotImplementedError(f"remotecuda cannot send an argument of type {t.__name__} to the gateway")


def _arg_at(args: tuple, kwargs: dict, pos: int | None, name: str) -> Any:
    if pos is not None and pos < len(args):
        return args[pos]
    return kwargs.get(name)


def _made_like(m: OpMeta) -> bool:
    """Whether the op makes a new tensor taking only the layout or dtype of its first argument
    (``zeros_like``, ``randint_like``, ``new_zeros``...), not its values."""
    base = m.name.partition(".")[0]
    return base.endswith("_like") or base.startswith("aten::new_")


def meta_stand_in(a: RemoteTensor) -> torch.Tensor:
    """A meta tensor with ``a``'s dtype, shape, strides and offset."""
    dtype, shape, stride, offset = a._k
    n = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else offset
    return torch.empty((n,), dtype=dtype, device="meta").as_strided(shape, stride, offset)


def _stand_ins(a: Any) -> Any:
    """``a`` with every remote tensor replaced by its meta stand-in, all else as it is."""
    if isinstance(a, RemoteTensor):
        return meta_stand_in(a)
    if type(a) is list or type(a) is tuple:
        return type(a)(_stand_ins(v) for v in a)
    return a


def _to_meta(a: Any) -> Any:
    if isinstance(a, RemoteTensor):
        return meta_stand_in(a)
    if isinstance(a, torch.Tensor):
        return a.to("meta")
    if type(a) is list or type(a) is tuple:
        return type(a)(_to_meta(v) for v in a)
    if type(a) is DEVICE:
        return _META
    if isinstance(a, torch._C.Generator):
        return None  # meta kernels only need shapes
    return a


class ThreadState(threading.local):
    """What dispatch needs to know about the thread it runs in. Class-level defaults: a missing
    attribute would cost a caught AttributeError on every op."""

    vdev: int | None = None  # the virtual device of the last op run here
    target: int | None = None  # the device a copy is headed for (interception's Tensor.cuda)
    user_meta = 0  # > 0 inside a factory the user asked for on 'meta'
    encoder = False  # inside nn.TransformerEncoder's forward (transformer_encoder.py)


class Dispatcher:
    """Turns aten calls on RemoteTensors into queued remote ops.

    ``session_of(i)``: the session of virtual device ``cuda:i`` (None: the current device), where
    factories and copies between devices go. ``cache``: the metadata cache (dispatch_cache.py).
    """

    def __init__(self, session_of: Callable[[int | None], Any], cache: DispatchCache) -> None:
        self.session_of = session_of
        self.ops: dict[int, OpMeta] = {}
        self.cache = cache
        #: the metadata cache kept for each default dtype (``torch.set_default_dtype``): type
        #: promotions to a float (``int_tensor / 3``) depend on it, and Lightning's "bf16-true"
        #: switches it around every step
        self.caches: dict[torch.dtype, DispatchCache] = {torch.float32: cache}
        self.local = ThreadState()
        #: inside a decode (decode.py): ops on known values are computed on the client too (known.py)
        self.propagate = False
        #: ``fn()`` as user code runs (interception sets it: with its dispatch mode on, which torch
        #: takes off while the mode handles an op): for a library op's kernel, which makes tensors
        self.as_user: Callable[[Callable[[], Any]], Any] = lambda fn: fn()
        #: the bytes of the largest tensor an op has made, seen at metadata cache misses (a larger
        #: tensor has a new signature). A step making one may run out of memory where the steps
        #: before did not: interception's waits for the gateway's errors look at it
        self.largest_new = 0

    def default_dtype_set(self, dtype: torch.dtype) -> None:
        """Use the metadata cache of ``dtype``, the new default dtype."""
        cache = self.caches.get(dtype)
        if cache is None:
            cache = self.caches[dtype] = DispatchCache(self.cache.check)
        self.cache = cache

    # ------------------------------------------------------------------ entry points
    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.propagate:
            return known.run(func, args, kwargs, self._dispatch)
        return self._dispatch(func, args, kwargs)

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        m = self.ops.get(id(func)) or self.op_meta(func)
        dev = kwargs.get("device") if kwargs else None
        if self.local.user_meta or (type(dev) is DEVICE and dev.type == "cpu" and m.special is None):
            # x.new_zeros(2, device='cpu'), zeros_like(x, device='meta'), x.to('meta'): a tensor made
            # here from the remote ones' metadata (user_meta: the user asked for 'meta', see interception)
            with _DisableTorchDispatch():
                return func(*_stand_ins(args), **{k: _stand_ins(v) for k, v in kwargs.items()})
        if type(dev) is DEVICE and dev.type == "cuda" and _made_like(m) and isinstance(args[0], RemoteTensor):
            # zeros_like(x, device='cuda:1'), x.new_zeros(n, device=1): made on the device named,
            # which need not be x's
            vdev = dev.index if dev.index is not None else self.session_of(None).vdev
            if vdev != args[0]._dev:
                return self.factory(func, (meta_stand_in(args[0]), *args[1:]), kwargs, vdev)
        if m.special is not None:
            return m.special(self, m, args, kwargs)
        return self.run(m, args, kwargs)

    def op_meta(self, func: Any) -> OpMeta:
        """``func``'s OpMeta, kept by ``id(func)`` (OpOverload hashes in Python); the entry
        keeps ``func`` alive, so the id cannot be reused."""
        m = self.ops.get(id(func))
        if m is None:
            m = self.ops[id(func)] = _op_meta(func)
            m.special = _SPECIAL.get(func) or (_prim if hasattr(func, "impl_aten")
                                               else _library_op if _runs_here(func)
                                               else _no_cuda_kernel if func.namespace not in OP_NAMESPACES
                                               or func in CPU_ONLY_ATEN
                                               else None)
        return m

    def factory(self, func: Any, args: tuple, kwargs: dict, vdev: int | None) -> Any:
        """An op with no remote tensor argument whose output goes to a 'cuda' device."""
        if self.propagate and func is not aten._to_copy.default:
            return known.run(func, args, kwargs, lambda f, a, k: self._factory(f, a, k, vdev))
        return self._factory(func, args, kwargs, vdev)

    def _factory(self, func: Any, args: tuple, kwargs: dict, vdev: int | None) -> Any:
        m = self.op_meta(func)
        s = self.session_of(vdev)
        if func is aten._to_copy.default:
            return self.upload(args[0], s, kwargs)
        if _made_like(m) and args and not isinstance(args[0], RemoteTensor):
            # zeros_like(a CPU or meta tensor, device='cuda'), its new_zeros: only its layout
            # (new_*: its dtype) matters, send no data
            src = args[0]
            new_op = m.name.startswith("aten::new_")
            shape, stride = ([0], [1]) if new_op else (list(src.shape), list(src.stride()))
            like = self.run(self.op_meta(aten.empty_strided.default), (shape, stride),
                            {"dtype": src.dtype, "device": _CUDA}, s, factory=True)
            args = (like, *args[1:])
        return self.run(m, args, kwargs, s, factory=True)

    def _run_with_cpu_tensors(self, m: OpMeta, args: tuple, kwargs: dict, session: Any, factory: bool) -> Any:
        """``run`` of an op with CPU tensors among its arguments: a sparse tensor's, a CPU tensor
        indexed, or the CPU tensors uploaded. It runs in ``run``'s handler of ``_NeedUpload``, which
        is remotecuda's own signal, not an error: an error raised here (torch's device mismatch, a
        shape error) is raised without it as its context, which Python would show ("During handling
        of the above exception, another exception occurred", remotecuda's frames) and a GPU's error
        has not."""
        try:
            if sparse.involved(args) or (kwargs and sparse.involved(kwargs)):
                return sparse.dispatch(m.func, args, kwargs)
            if m.func in _INDEXING and session is None and not isinstance(args[0], RemoteTensor):
                return _index_cpu_tensor(m, args, kwargs)
            args, kwargs = self._upload_cpu_args(m, args, kwargs, session)
            return self.run(m, args, kwargs, session, factory)
        except BaseException as e:
            if isinstance(e.__context__, _NeedUpload):
                e.__context__ = None
            raise

    # ------------------------------------------------------------------ the common path
    def run(self, m: OpMeta, args: tuple, kwargs: dict, session: Any = None, factory: bool = False) -> Any:
        parts: list = [m]  # of the cache key
        wkw = None
        try:
            wargs, s = _walk(args, parts, session, m.float_values)
            if kwargs:
                values, s = _walk(kwargs.values(), parts, s, m.float_values)
                wkw = dict(zip(kwargs, values))
                parts.append(tuple(kwargs))
        except _NeedUpload:
            return self._run_with_cpu_tensors(m, args, kwargs, session, factory)
        if s is None:
            raise RuntimeError(f"remotecuda: op {m.name} has no remote tensor argument")
        self.local.vdev = s.vdev
        if factory:
            parts.append(torch.get_default_dtype())
        if m.bypass is not None:
            return self._bypassed(m.bypass, m, s, wargs, wkw, args, kwargs)
        key = tuple(parts)
        cache = self.cache
        entry = cache.get(key)
        if type(entry) is NewTensor:  # the common case, a hit for one new tensor: inline
            cache.hits += 1
            if cache.check:
                self._cross_check(m, key, entry, args, kwargs)
            h = s.new_handle()
            outs = [h]
            result = wrap(s, h, entry.layout)
        else:
            if entry is None:
                try:
                    entry = self._compute(m, args, kwargs)
                except call_checks.GPURefuses as e:
                    raise e.args[0] from None
                except Exception as e:
                    return self._refused(m, key, s, wargs, wkw, args, kwargs, e)
                largest = _check_fits(entry, s)
                if largest > self.largest_new:
                    self.largest_new = largest
                cache.store(key, entry)
                if type(entry) is not Bypass:
                    cache.misses += 1
            else:
                if cache.check:
                    self._cross_check(m, key, entry, args, kwargs)
                if type(entry) is not Bypass:
                    cache.hits += 1
            if type(entry) is Bypass:
                return self._bypassed(entry.reason, m, s, wargs, wkw, args, kwargs)
            outs = []
            result = _build(entry, s, args, kwargs, outs)
        s.enqueue(m.name, wargs, wkw, outs)
        if m.metadata_mutation:
            _mutate_wrapper(m.func, args, kwargs)
        return result

    def _compute(self, m: OpMeta, args: tuple, kwargs: dict) -> Entry:
        """Output metadata from the meta kernel, as a cache entry."""
        if m.func in _SAME_DTYPE and len({a.dtype for a in args if isinstance(a, torch.Tensor)}) > 1:
            raise TypeError(f"{m.name}: tensors of different dtypes")  # for the gateway to word
        suspect = _DTYPE_SUSPECT.get(m.func)
        if suspect is not None and suspect(args):
            raise TypeError(f"{m.name}: dtypes its kernels may refuse")  # (the gateway says whether they do)
        unchecked = _UNCHECKED_DIM.get(m.func)
        if unchecked is not None:
            pos, dim_pos, name = unchecked
            dim = args[dim_pos] if dim_pos is not None and len(args) > dim_pos else kwargs.get(name, -1)
            canonicalize_dim(args[pos].dim(), dim)  # IndexError: for the gateway to word
        call_checks.check(m.func, args, kwargs)  # (the device's checks at the call its meta kernel leaves out)
        margs = [_to_meta(a) for a in args]
        mkw = {k: _to_meta(v) for k, v in kwargs.items()}
        # (a warning a Python meta kernel gives, the kernel that runs on the gateway gives too,
        # worded as on a GPU, and remote_warnings.py raises it: not shown twice, nor in other
        # words. The filters still apply: an "error" one raises at the call, as on a GPU; and they
        # are not touched, which would make the program's shown-once warnings show again)
        shown, warnings.showwarning = warnings.showwarning, _unshown
        try:
            with _DisableTorchDispatch():
                out = m.func(*margs, **mkw)
            casts = _out_casts(m.func, margs, mkw)
        except NotImplementedError:
            return _NO_META_KERNEL
        except RuntimeError as e:
            if m.fully_inplace and "meta" in str(e).lower():
                return _IN_PLACE  # e.g. fused optimizer kernels: no meta, outputs are inputs
            if _is_data_dependent(e):
                return _META_NEEDS_DATA
            raise
        except Exception as e:
            if _is_data_dependent(e):
                return _META_NEEDS_DATA
            raise
        finally:
            warnings.showwarning = shown
        if m.name in layouts.CHOSEN:  # (its layout is the backend's choice: the shared rule)
            out = layouts.conform(m.name, margs, mkw, out)
        elif m.name in layouts.ELEMENTWISE:  # (its meta kernel forgets the layout its kernels give)
            out = layouts.elementwise(margs, out)
        elif m.name in layouts.CONTIGUOUS:
            out = layouts.contiguous(out)
        elif m.func in _COLUMN_MAJOR_OUT:
            _restride_resized_outs(m, kwargs, out)
        rets = out if m.multi else (out,)
        items: list[Any] = []
        # (a metadata-mutating op's own change is applied after it is sent: _mutate_wrapper)
        given = None if m.metadata_mutation else (args, kwargs)
        for r, alias in zip(rets, m.ret_alias):
            if isinstance(r, torch.Tensor):
                items.append(_spec(r, alias, given))
            elif isinstance(r, (list, tuple)):
                items.append([_spec(x, alias, given) if isinstance(x, torch.Tensor) else None for x in r])
            elif isinstance(r, (int, torch.SymInt)):
                items.append(ConstOut(int(r)))
            else:
                items.append(None)
        if not m.multi and len(items) == 1 and type(items[0]) is NewOut:
            return NewTensor(items[0].layout)
        entry = Outputs(m.multi, tuple(items))
        if casts:
            raise _OutCast(m.name, entry)
        return entry

    def _cross_check(self, m: OpMeta, key: tuple, entry: Entry, args: tuple, kwargs: dict) -> None:
        """Cross-check mode: the metadata computed afresh for this call must be the cached entry."""
        if torch._C._get_tracing_state() is not None:
            return  # (see _refused)
        try:
            fresh = self._compute(m, args, kwargs)
        except _OutCast as e:
            fresh = e.entry
        except Exception:
            fresh = _META_REFUSED
        if fresh != entry:
            raise dc.CacheCrossCheckError(
                f"remotecuda dispatch cache: the cached entry for {m.name} differs from the metadata "
                f"computed afresh\n  key:    {key}\n  cached: {entry}\n  fresh:  {fresh}")

    def _refused(self, m: OpMeta, key: tuple, s: Any, wargs: list, wkw: Any, args: tuple, kwargs: dict,
                 meta_error: Exception) -> Any:
        """The meta kernel refused the op; the gateway's device has the last word (one round trip,
        on errors only). Its error is the one local PyTorch gives ("mat1 and mat2 shapes cannot be
        multiplied", not the meta kernel's "a and b must have same reduction dim"); where it runs
        the op after all, its outputs are the op's, and the gateway describes this signature from
        now on (an accepted ``_OutCast``: the meta kernel, as it was right)."""
        try:
            out = self._bypassed(dc.META_REFUSED, m, s, wargs, wkw, args, kwargs)
        except RemoteCUDAError:
            raise meta_error from None  # no gateway to ask
        except Exception as e:
            raise e from None  # (not "during handling of" the meta kernel's error)
        if torch._C._get_tracing_state() is None:  # (torch.jit.trace makes sizes tensors: meta kernels refuse them)
            self.cache.store(key, meta_error.entry if isinstance(meta_error, _OutCast) else _META_REFUSED)
        return out

    def _bypassed(self, reason: str, m: OpMeta, s: Any, wargs: list, wkw: Any, args: tuple, kwargs: dict) -> Any:
        """Count a bypass of the cache, then have the gateway run the op and describe its outputs."""
        self.cache.bypass(reason)
        return self._describe(m, s, wargs, wkw, args, kwargs)

    def _describe(self, m: OpMeta, s: Any, wargs: list, wkw: Any, args: tuple, kwargs: dict) -> Any:
        base = s.reserve(1024)
        res = s.request(m.name, wargs, wkw, base=base)
        if m.multi:
            return tuple(_described(v, a, s, args, kwargs) for v, a in zip(res, m.ret_alias))
        return _described(res, m.ret_alias[0] if m.ret_alias else None, s, args, kwargs)

    # ------------------------------------------------------------------ CPU tensors
    def _upload_cpu_args(self, m: OpMeta, args: tuple, kwargs: dict, session: Any) -> tuple:
        """Put CPU tensors among an op's arguments on its device, where CUDA would accept them."""
        s = session
        if s is None:
            for a in _iter_tensors(list(args) + list(kwargs.values())):
                if isinstance(a, RemoteTensor):
                    s = a._s
                    break
        for i, sa in enumerate(m.func._schema.arguments):
            if sa.alias_info is not None and sa.alias_info.is_write:
                written = args[i] if i < len(args) and not sa.kwarg_only else kwargs.get(sa.name)
                if any(not isinstance(t, RemoteTensor) for t in _iter_tensors([written])):
                    # (uploaded, the copy on the gateway would be written and the CPU tensor left as it was)
                    raise DeviceMismatch("Expected all tensors to be on the same device, but found at least two "
                                         f"devices, cuda:{s.vdev} and cpu!")

        def conv(a: Any) -> Any:
            if isinstance(a, RemoteTensor):
                return a
            if isinstance(a, torch.Tensor):
                if a.device.type == "meta":
                    raise RuntimeError(f"remotecuda: a plain meta tensor reached op {m.name}; "
                                       "please report this as a bug")
                if a.dim() > 0 and not m.cpu_ok and session is None:
                    raise DeviceMismatch("Expected all tensors to be on the same device, but found at "
                                         f"least two devices, cuda:{s.vdev} and cpu!")
                return self.upload(a, s)
            if type(a) is list or type(a) is tuple:
                return type(a)(conv(v) for v in a)
            return a
        return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}

    def upload(self, cpu: torch.Tensor, s: Any, kwargs: dict | None = None) -> torch.Tensor:
        """A CPU tensor copied to session ``s``'s device (``_to_copy`` semantics): a RemoteTensor."""
        if cpu.is_nested:
            raise strided_nested()  # (a jagged one moves as its parts: its own dispatch runs first)
        kwargs = kwargs or {}
        if cpu.dtype not in DTYPE_EXT:
            raise unsendable_dtype(cpu.dtype)
        if cpu.layout is torch.sparse_coo:
            return sparse.upload(cpu, lambda t: self.upload(t, s) if not isinstance(t, RemoteTensor) else
                                 t if t._s is s else self.between(t, s.vdev, {}), kwargs.get("dtype"))
        if cpu.layout is not torch.strided:
            raise not_dense(cpu.layout, "moved to")
        dtype = kwargs.get("dtype")
        if dtype is not None and dtype != cpu.dtype:
            cpu = cpu.to(dtype)
        mf = kwargs.get("memory_format")
        non_blocking = bool(kwargs.get("non_blocking"))
        if mf is not None and mf not in (torch.preserve_format, torch.contiguous_format):
            contiguous = cpu.contiguous()
            t = make(s, s.upload(contiguous, non_blocking), contiguous.shape, contiguous.stride(), 0,
                     contiguous.dtype)
            return t.contiguous(memory_format=mf)
        if mf is not torch.contiguous_format and not cpu.is_contiguous():
            # preserve_format keeps the strides of a dense layout (a transpose, channels_last):
            # send the bytes in memory order and rebuild the same view on the gateway
            strides = cpu.stride()
            perm = sorted(range(cpu.dim()), key=lambda d: (-strides[d], -cpu.shape[d]))
            base = cpu.permute(perm)
            if base.is_contiguous():
                t = make(s, s.upload(base, non_blocking), base.shape, base.stride(), 0, base.dtype)
                return t.permute([perm.index(d) for d in range(cpu.dim())])
        contiguous = cpu.contiguous()
        t = make(s, s.upload(contiguous, non_blocking), contiguous.shape, contiguous.stride(), 0,
                 contiguous.dtype)
        known.remember(t, contiguous)
        return t

    def target_vdev(self, dev: Any) -> int | None:
        """Where a CPU tensor goes: an explicit cuda index, the one ``Tensor.to`` asked for, else current."""
        if dev is not None and dev.type == "cuda" and dev.index is not None:
            return dev.index
        return self.local.target

    def between(self, src: RemoteTensor, index: int, kwargs: dict) -> torch.Tensor:
        """``src`` copied to virtual device ``index`` (``_to_copy`` semantics): worker to worker
        (transfer.py), else through the client."""
        dst = self.session_of(index)
        # the last op here is on the destination: the zeros a backward formula makes for an unused
        # output ('meta' factories) follow it, and a pipeline's backward crosses here to the earlier stage
        self.local.vdev = index
        out = transfer.move(src, dst)
        if out is None:
            return self.upload(self.download(src), dst, kwargs)
        dtype, mf = kwargs.get("dtype"), kwargs.get("memory_format")
        if (dtype is not None and dtype != out.dtype) or mf not in (None, torch.preserve_format):
            kw = {k: v for k, v in (("dtype", dtype), ("memory_format", mf)) if v is not None}
            out = self.run(self.op_meta(aten._to_copy.default), (out,), kw)
        return out

    def download(self, t: RemoteTensor) -> torch.Tensor:
        if self.propagate:  # inside a decode, a copy of known values (known.py) is read here, as an item is
            cpu = known.value(t)
            if cpu is not None:
                return cpu.contiguous().clone()
        fetched = downloads.take(t)  # fetched ahead with others (torch.save, Module.cpu...)
        return fetched if fetched is not None else t._s.request("rc::fetch", [t._h])


def _index_cpu_tensor(m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """A CPU tensor indexed with 'cuda' indices, as PyTorch treats it: reading refuses (index's
    device check), writing moves the indices (and a 0-d value) to the CPU and writes there, so
    the CPU tensor itself changes (it must not be uploaded and written on the gateway)."""
    if m.func is aten.index.Tensor:
        raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cpu)")
    values = _arg_at(args, kwargs, 2, "values")
    if isinstance(values, RemoteTensor) and values.dim() > 0:
        raise DeviceMismatch("Expected all tensors to be on the same device, but found at least two "
                             f"devices, cpu and cuda:{values._dev}!")
    args, kwargs = downloads.localized((args, kwargs), detach=True)
    with _DisableTorchDispatch():
        return m.func(*args, **kwargs)


def _is_data_dependent(e: Exception) -> bool:
    name = type(e).__name__
    return name in ("DataDependentOutputException", "DynamicOutputShapeException",
                    "GuardOnDataDependentSymNode", "UnsupportedOperatorException")


#: the entries that carry nothing but their kind, made once
_IN_PLACE = dc.InPlace()
_NO_META_KERNEL = Bypass(dc.NO_META_KERNEL)
_META_NEEDS_DATA = Bypass(dc.META_NEEDS_DATA)
_META_REFUSED = Bypass(dc.META_REFUSED)


def unsendable_dtype(dtype: torch.dtype) -> NotImplementedError:
    """The error for a dtype the protocol has no code for (quantized ones, ``bits*``, the sub-byte
    ``uint1``..``int7`` shells: none has a kernel on any device beyond views and empty tensors):
    it cannot be sent, so no remote tensor holds it."""
    hint = "dequantize() it first" if dtype in _QUANTIZED else "convert it to a supported dtype first"
    return NotImplementedError(f"remotecuda: tensors of dtype {dtype} cannot live on a remote 'cuda' device "
                               f"(the protocol does not carry it); {hint}, or keep it on the CPU")


_QUANTIZED = {torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def not_dense(lay: torch.layout, doing: str) -> NotImplementedError:
    """The error for a sparse tensor on 'cuda': a remote tensor is dense and strided (its wrapper
    carries shape and strides only), and so is what crosses the wire."""
    kind = str(lay).removeprefix("torch.")
    return NotImplementedError(
        f"remotecuda: {kind} tensors cannot be {doing} a remote 'cuda' device (only dense, strided tensors "
        f"live there); use a dense tensor instead (t.to_dense(): torch.sparse.mm and @ take dense ones too), "
        f"or keep the sparse tensor on the CPU")


def _spec(r: torch.Tensor, alias: Any, given: tuple | None) -> ArgOut | ViewOut | NewOut:
    """What output ``r`` of the meta kernel is: a written argument, a view of one, or new.
    ``given``: the op's (args, kwargs), to tell a written argument the kernel resizes (an
    ``out=`` tensor of another shape), whose wrapper must follow."""
    if r.layout is not torch.strided:
        raise not_dense(r.layout, "made on")
    lay = layout(r.shape, r.stride(), int(r.storage_offset()), r.dtype)
    if alias is not None and alias[2]:
        written = None if given is None else _arg_at(given[0], given[1], alias[0], alias[1])
        resized = isinstance(written, RemoteTensor) and written._k != lay[0]
        return ArgOut(alias[0], alias[1], lay if resized else None)
    if alias is not None:
        return ViewOut(alias[0], alias[1], lay)
    return NewOut(lay)


def _described(v: Any, alias: Any, s: Any, args: tuple, kwargs: dict) -> Any:
    """An output the gateway described (``Dispatcher._describe``), as a wrapper: a module function,
    not a closure calling itself, whose cycle would keep the op's arguments (``x`` of ``x.item()``,
    the base of a view read) alive until the garbage collector ran, their gateway memory with them."""
    if isinstance(v, dict):
        if alias is not None and alias[2]:  # an argument written (``out=``): resized as the kernel resized it
            s.release(v["h"])
            written = _arg_at(args, kwargs, alias[0], alias[1])
            lay = layout(v["shape"], v["stride"], v["offset"], v["dtype"])
            if isinstance(written, RemoteTensor) and written._k != lay[0]:
                _resize_wrapper(written, lay)
            return written
        if alias is not None:
            src = _arg_at(args, kwargs, alias[0], alias[1])
            return _view(src, make, s, v["h"], v["shape"], v["stride"], v["offset"], v["dtype"],
                         getattr(src, "_sid", None))
        return make(s, v["h"], v["shape"], v["stride"], v["offset"], v["dtype"])
    if isinstance(v, list):
        return [_described(x, alias, s, args, kwargs) for x in v]
    return v


def _view(src: Any, fn: Any, *a: Any) -> RemoteTensor:
    """``fn(*a)``, the wrapper of a view of ``src``. Under inference_mode a view of a normal tensor
    is a normal tensor (C++ builds it with its base's keys, then gives it the base's version
    counter, which an inference tensor cannot take): make that wrapper outside the mode. A view
    of a lazy conjugate or negative (``z.conj()[0]``, ``z.conj().T``) is one too, as C++ makes a
    view with its base's keys: the gateway's view has the bit already (see ``_math_bit_view``)."""
    if torch.is_inference_mode_enabled() and isinstance(src, torch.Tensor) and not src.is_inference():
        with torch.inference_mode(False):
            view = fn(*a)
    else:
        view = fn(*a)
    if isinstance(src, torch.Tensor) and (src.is_conj() or src.is_neg()):
        torch._C._set_conj(view, src.is_conj())
        torch._C._set_neg(view, src.is_neg())
    return view


#: new outputs at least this large are checked against the device's memory (smaller ones cannot
#: exceed a GPU's; checking them would cost a look-up per cache miss for nothing)
CHECKED_BYTES = 1 << 30


def _check_fits(entry: Entry, s: Any) -> int:
    """An op whose new output is larger than its GPU's whole memory raises
    ``torch.OutOfMemoryError`` here, at the call, as CUDA's allocator does: not at the next
    sync (the gateway's asynchronous error would point at no line of the user's). Only on cache
    misses: a cached signature's outputs have been checked. Returns the bytes of the largest
    new output."""
    if type(entry) is NewTensor:
        layouts_: list = [entry.layout]
    elif type(entry) is Outputs:
        layouts_ = [x.layout for it in entry.items for x in (it if type(it) is list else [it])
                    if type(x) is NewOut]
    else:
        return 0
    largest = 0
    for (dtype, shape, stride, offset), _ in layouts_:
        nbytes = (offset + extent(shape, stride)) * dtype.itemsize if 0 not in shape else 0
        largest = max(largest, nbytes)
        if nbytes < CHECKED_BYTES:
            continue
        from .runtime import active
        rt = active()
        total = rt.device(s.vdev).props.get("total_memory") if rt is not None else None
        if total and nbytes > total:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {nbytes / 2**30:.2f} GiB. GPU {s.vdev} has a "
                f"total capacity of {total / 2**30:.2f} GiB (remotecuda: refused before it was sent "
                f"to gateway {s.endpoint})")
    return largest


def _build(entry: Entry, s: Any, args: tuple, kwargs: dict, outs: list) -> Any:
    """Output wrappers for a cache entry; appends the gateway handles to ``outs`` in flat order.
    (Dispatcher.run builds a cache hit's ``NewTensor`` inline.)"""
    if type(entry) is NewTensor:
        h = s.new_handle()
        outs.append(h)
        return wrap(s, h, entry.layout)
    if type(entry) is not Outputs:  # InPlace
        return args[0] if args else None

    def one(spec: Any) -> Any:
        if spec is None:
            return None
        t = type(spec)
        if t is ConstOut:
            return spec.value
        if t is ArgOut:
            outs.append(None)
            written = _arg_at(args, kwargs, spec.pos, spec.name)
            if spec.resized is not None:
                _resize_wrapper(written, spec.resized)
            return written
        h = s.new_handle()
        outs.append(h)
        if t is NewOut:
            return wrap(s, h, spec.layout)
        src = _arg_at(args, kwargs, spec.pos, spec.name)
        sid = src._sid if isinstance(src, RemoteTensor) else None
        return _view(src, wrap, s, h, spec.layout, sid)

    built = [[one(x) for x in it] if type(it) is list else one(it) for it in entry.items]
    if entry.multi:
        return tuple(built)
    return built[0] if built else None


def _mutate_wrapper(func: Any, args: tuple, kwargs: dict) -> None:
    """Apply a shape-changing in-place op to the wrapper's own (meta) metadata."""
    target = args[0]
    margs = [a if isinstance(a, RemoteTensor) else _to_meta(a) for a in args]
    with torch._C._AutoDispatchBelowADInplaceOrView(), _DisableTorchDispatch():
        func(*margs, **kwargs)
    refresh_key(target, args[1] if func in (aten.set_.source_Tensor, aten.set_.source_Tensor_storage_offset)
                else None)


def _resize_wrapper(t: RemoteTensor, lay: tuple) -> None:
    """Give the wrapper of an ``out=`` tensor the layout its op's kernel resized it to."""
    _, shape, stride, offset = lay[0]
    with torch._C._AutoDispatchBelowADInplaceOrView(), _DisableTorchDispatch():
        t.resize_(offset + extent(shape, stride))
        t.as_strided_(shape, stride, offset)
    refresh_key(t)


def _iter_tensors(xs: list):
    for x in xs:
        if isinstance(x, torch.Tensor):
            yield x
        elif type(x) in (list, tuple):
            yield from _iter_tensors(list(x))


# ---------------------------------------------------------------------- special ops

def _to_copy(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    src = args[0]
    dev = kwargs.get("device")
    if not isinstance(src, RemoteTensor):  # a CPU tensor headed for 'cuda' (or leaked 'meta' options)
        return d.factory(m.func, args, kwargs, d.target_vdev(dev))
    if dev is None or dev.type == "meta" or (dev.type == "cuda" and (dev.index is None or dev.index == src._dev)):
        kw = dict(kwargs)
        kw.pop("device", None)
        return d.run(m, args, kw)
    if dev.type == "cpu":
        cpu = d.download(src)  # (contiguous)
        _, shape, stride, _ = src._k
        # e.g. x.t().cpu() keeps x.t()'s strides
        if kwargs.get("memory_format") in (None, torch.preserve_format) and _permuted_dense(shape, stride):
            cpu = torch.empty_strided(shape, stride, dtype=cpu.dtype).copy_(cpu)
        rest = {k: v for k, v in kwargs.items() if k in ("dtype", "memory_format") and v is not None}
        return cpu.to(**rest) if rest else cpu
    if dev.type == "cuda":  # another virtual device
        return d.between(src, dev.index, {k: v for k, v in kwargs.items() if k != "device"})
    raise RuntimeError(f"remotecuda: cannot copy a cuda tensor to device {dev}")


def _permuted_dense(shape: Any, stride: Any) -> bool:
    """Dense and non-overlapping but not contiguous: a layout that ``preserve_format`` keeps."""
    strides = [st for size, st in zip(shape, stride) if size != 1]
    expected = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if st != expected:
            return False
        expected *= size
    return strides != sorted(strides, reverse=True)


def _prim(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """A ``prims::`` op runs as the aten op it stands for (gateways take aten only): torch._refs'
    decompositions call prims, e.g. in a backward under torch.func's jacfwd/hessian."""
    return m.func.impl_aten(*args, **kwargs)


def _to(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """``aten.to.*`` arrives undecomposed for inference tensors; give it ``Tensor.to``'s meaning."""
    bound = m.func._schema.arguments
    vals = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
            for i, a in enumerate(bound)}
    src = vals["self"]
    other = vals.get("other")
    device = other.device if isinstance(other, torch.Tensor) else vals.get("device")
    dtype = other.dtype if isinstance(other, torch.Tensor) else vals.get("dtype")
    if isinstance(device, str):
        device = torch.device(device)
    if device is not None and device.type == "cuda" and device.index is None and isinstance(src, RemoteTensor):
        device = torch.device("cuda", src._dev)
    same_device = device is None or device == getattr(src, "device", None) or \
        (device.type == "meta" and isinstance(src, RemoteTensor))
    mf = vals.get("memory_format")
    if same_device and (dtype is None or dtype == src.dtype) and not vals.get("copy") and \
            mf in (None, torch.preserve_format):
        return src
    kw = {"dtype": dtype or src.dtype, "non_blocking": bool(vals.get("non_blocking"))}
    if device is not None:
        kw["device"] = device
    if mf is not None:
        kw["memory_format"] = mf
    return _to_copy(d, d.op_meta(aten._to_copy.default), (src,), kw)


def _copy_(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    dst, src = args[0], args[1]
    non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
    if not isinstance(dst, RemoteTensor):  # device → host
        cpu = d.download(src)
        with _DisableTorchDispatch():
            dst.copy_(cpu)
        return dst
    if not isinstance(src, RemoteTensor):
        src = d.upload(src.to(dst.dtype) if src.dtype != dst.dtype else src, dst._s,
                       {"non_blocking": non_blocking})
    elif src._s is not dst._s:
        src = d.between(src, dst._dev, {})
    return d.run(m, (dst, src), {})


def _record_stream(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> None:
    return None


def _is_pinned(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> bool:
    return is_pinned(*args, **kwargs)


#: the name each linalg ``*_ex`` kernel asked to ``check_errors`` gives ``_linalg_check_errors``
#: (torch's BatchLinearAlgebra.cpp), which its error message begins with
_CHECKED_EX = {
    **dict.fromkeys((aten.linalg_cholesky_ex.default, aten.linalg_cholesky_ex.L), "linalg.cholesky_ex"),
    **dict.fromkeys((aten.linalg_inv_ex.default, aten.linalg_inv_ex.inverse), "linalg.inv_ex"),
    **dict.fromkeys((aten.linalg_lu_factor_ex.default, aten.linalg_lu_factor_ex.out), "torch.linalg.lu_factor_ex"),
    **dict.fromkeys((aten.linalg_ldl_factor_ex.default, aten.linalg_ldl_factor_ex.out),
                    "torch.linalg.ldl_factor_ex"),
    **dict.fromkeys((aten._linalg_solve_ex.default, aten._linalg_solve_ex.result), "torch.linalg.solve_ex"),
}


def _check_errors(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """A linalg ``*_ex`` op asked to ``check_errors`` (``cholesky_ex(A, check_errors=True)``): its
    kernel reads ``info`` to raise at the call, on a GPU too, so ``except torch.linalg.LinAlgError``
    around the call catches it. Run as one op, the error came at a later sync instead. It runs
    with ``check_errors=False``, then ``_linalg_check_errors`` on its ``info``, as torch's own
    ``linalg.cholesky`` is made, which waits for the verdict (``dc.CHECKS_AT_CALL``)."""
    if not kwargs.get("check_errors"):
        return d.run(m, args, kwargs)
    out = d.run(m, args, {**kwargs, "check_errors": False})
    d.dispatch(aten._linalg_check_errors.default, (out[-1], _CHECKED_EX[m.func]), {"is_matrix": args[0].dim() == 2})
    return out


#: ops whose kernels may alert under deterministic algorithms: on a GPU (torch's list in
#: ``use_deterministic_algorithms``'s documentation, every overload) or on a CPU-served device
#: (``put_``); each packet with the condition, if any, on which its kernel can alert
_MAY_ALERT: dict[Any, Callable[[tuple, dict], bool] | None] = {
    **dict.fromkeys((aten.put_, aten.put, aten.histc, aten.bincount, aten.median, aten.nanmedian, aten.kthvalue,
                     aten.scatter_reduce, aten.scatter_reduce_, aten.nll_loss_forward, aten.nll_loss2d_forward,
                     aten._ctc_loss_backward, aten._embedding_bag_dense_backward, aten.avg_pool3d_backward,
                     aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward,
                     aten.adaptive_max_pool2d_backward, aten.adaptive_max_pool3d_backward,
                     aten.fractional_max_pool2d_backward, aten.fractional_max_pool3d_backward, aten.max_unpool2d,
                     aten.max_unpool3d, aten.upsample_linear1d_backward, aten.upsample_bilinear2d_backward,
                     aten.upsample_bicubic2d_backward, aten.upsample_trilinear3d_backward,
                     aten._upsample_bilinear2d_aa_backward, aten._upsample_bicubic2d_aa_backward,
                     aten.reflection_pad1d_backward, aten.reflection_pad2d_backward, aten.reflection_pad3d_backward,
                     aten.grid_sampler_2d_backward, aten.grid_sampler_3d_backward)),
    **dict.fromkeys((aten.cumsum, aten.cumsum_), lambda args, kwargs: _float_sum(*args, **kwargs)),
}


def _float_sum(self: Any, dim: Any, dtype: torch.dtype | None = None, **out: Any) -> bool:
    """Whether a cumsum sums floats or complex numbers, whose CUDA kernel alerts (an integer one, a
    mask's positions, stays queued)."""
    dtype = dtype or self.dtype
    return dtype.is_floating_point or dtype.is_complex


def _alerts_at_call(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """An op whose kernel may have no deterministic implementation: under
    ``torch.use_deterministic_algorithms(True)`` a GPU's refuses on the host before it starts, so
    the RuntimeError comes at the call (``try``/``except`` around it catches it; ``backward()``
    raises it), and with ``warn_only=True`` the warning is given there. Queued, the gateway's
    refusal came at a later sync, past any handler, and poisoned the ops after it. While the setting
    is on such an op runs as a request, the gateway's own kernel deciding (so the alert is the one its
    device gives, word for word); otherwise it is queued as any op."""
    condition = _MAY_ALERT[m.func.overloadpacket]
    if not torch.are_deterministic_algorithms_enabled() or (condition is not None and not condition(args, kwargs)):
        return d.run(m, args, kwargs)
    return d.run(replace(m, bypass=dc.DETERMINISM_AT_CALL, special=None), args, kwargs)


def _set_storage(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """``t.set_(storage[, offset, size, stride])``, the way torch reaches a storage's bytes (a
    TypedStorage's ``cpu()``, ``tolist()``, indexing, ``float()``, ``copy_`` between storages): a
    'cuda' storage's bytes are its gateway tensor's, so this is ``set_`` onto that tensor."""
    self, storage, *rest = args
    if not isinstance(storage, RemoteStorage) or storage.device != self.device:
        raise RuntimeError(f'Attempted to set the storage of a tensor on device "{self.device}" to a storage on '
                           f'different device "{storage.device}".  This is no longer allowed; the devices must match.')
    if m.func is aten.set_.source_Storage:
        offset, size, stride = 0, [storage.nbytes() // self.element_size()], []
    else:
        offset, size, stride = rest[0], rest[1], rest[2] if len(rest) > 2 else kwargs.get("stride", [])
    start = storage.__dict__["_start"]
    if start:
        offset = _slice_offset(self, storage, start, offset, size, stride)
    return d.dispatch(aten.set_.source_Tensor_storage_offset, (self, storage.tensor(), offset, size, stride), {})


def _slice_offset(self: torch.Tensor, storage: RemoteStorage, start: int, offset: int, size: Any, stride: Any) -> int:
    """The offset in the gateway's storage of ``self.set_(storage, offset, ...)`` onto a slice of a
    storage that begins ``start`` bytes into it. A tensor that runs past the slice's end would grow
    its storage, which a slice's cannot: torch's refusal, which the whole storage would not give."""
    span = extent(size, stride or make_contiguous_strides_for(size))
    if span and (offset + span) * self.element_size() > storage.nbytes():
        raise RuntimeError("Trying to resize storage that is not resizable")
    if start % self.element_size():
        raise NotImplementedError(
            f"remotecuda: a {self.dtype} tensor set onto a storage slice that begins {start} bytes into its "
            f"storage would be misaligned; slice at a multiple of {self.element_size()} bytes")
    return offset + start // self.element_size()


def _math_bit_view(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """``_conj``/``_neg_view`` (``z.conj()``, ``z.conj().imag``): torch's lazy conjugate and
    negative, a view of ``self`` sharing its memory with one bit flipped. The gateway's tensor is
    that view, bit and all, and so is the wrapper, so both ends agree on what its bytes mean: ops
    on the wrapper pass torch's math-bit fallback here, which resolves it (a ``clone``, which the
    gateway computes from its own bit) and writes back through ``copy_``, and the kernels that
    take the bit as it is (``copy_``, ``mm``, ``dot``, views) get it on the gateway too."""
    view = d.run(m, args, kwargs)
    if m.func is aten._conj.default:
        torch._C._set_conj(view, not view.is_conj())
    else:
        torch._C._set_neg(view, not view.is_neg())
    return view


def _math_bit_checked(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """``view_as_real`` and ``view(dtype)``, whose kernels refuse a lazy conjugate (``view(dtype)``
    a negative too), at the call on a GPU: a meta stand-in carrying the source's bits meets torch's
    own check (the cached metadata of a plain source would not)."""
    src = args[0]
    if isinstance(src, RemoteTensor) and (src.is_conj() or src.is_neg()):
        stand_in = meta_stand_in(src)
        torch._C._set_conj(stand_in, src.is_conj())
        torch._C._set_neg(stand_in, src.is_neg())
        with _DisableTorchDispatch():
            m.func(stand_in, *args[1:], **kwargs)
    return d.run(m, args, kwargs)


def _composite(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """Ops whose kernel is a composite reading an argument's values here: ``_pack_padded_sequence``'s
    CPU lengths (its ``batch_sizes`` result stays on the CPU, as on a GPU), ``linspace``'s and
    ``logspace``'s 0-d tensor ends (``item()``, then made on the device asked: the CPU by default,
    which their metadata from meta stand-ins would have called 'meta'). Run that kernel here; the
    ops it calls on the remote tensors, and its factories asked for 'cuda', come back through
    dispatch (the mode on: ``as_user``). Its checks see a cuda argument's C++ device, meta: their
    messages name the device a GPU's would."""
    try:
        return d.as_user(lambda: m.func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs))
    except RuntimeError as e:
        remote = next((a for a in _iter_tensors(list(args)) if isinstance(a, RemoteTensor)), None)
        if remote is None or " meta " not in str(e):
            raise
        raise RuntimeError(str(e).replace(" meta ", f" {remote.device} ")) from None


def _runs_here(func: Any) -> bool:
    """Whether ``func`` is a library's op (not one a gateway runs by name) with a kernel for
    'cuda' that the client can run: a ``torch.library.custom_op`` (transformers' MoE
    ``grouped_mm_fallback``), a composite, or a Python kernel registered for CUDA (a CPU-only
    torch holds no compiled CUDA kernel)."""
    return func.namespace not in OP_NAMESPACES and \
        torch._C._dispatch_has_computed_kernel_for_dispatch_key(func.name(), "CUDA")


def _library_op(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """A library's op: its 'cuda' kernel runs here, as it would beside a GPU; the ops it calls
    on the remote tensors come back through dispatch (the gateway knows no library's ops)."""
    return d.as_user(lambda: m.func.redispatch(_CUDA_KERNEL, *args, **kwargs))


_CUDA_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def _no_cuda_kernel(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """An op with no kernel for 'cuda' (a library's registered for the CPU only, or one of
    ``CPU_ONLY_ATEN``): refused at the call, as a GPU's dispatcher refuses it, rather than by the
    gateway at a later sync (or run by a CPU gateway, where a GPU's program would fail)."""
    why = ("its kernel is the CPU's only: move its input there first (.cpu())" if m.func in CPU_ONLY_ATEN
           else "a library's op runs the kernel it registers for 'cuda' or a composite one; gateways run "
                "aten ops only")
    raise NotImplementedError(
        f"Could not run '{m.func.name()}' with arguments from the 'CUDA' backend: the op has no kernel "
        f"for CUDA (remotecuda: {why})")


#: aten ops that programs call whose native_functions.yaml entry dispatches to the CPU only (no
#: CUDA or composite kernel): ``torch.histogram`` and ``torch.histogramdd`` (makemore's lecture
#: plots activations by ``torch.histogram(t, density=True)``)
CPU_ONLY_ATEN = frozenset((
    aten.histogram.bin_ct, aten.histogram.bins_tensor, aten.histogram.bin_ct_out, aten.histogram.bins_tensor_out,
    aten._histogramdd_bin_edges.default, aten._histogramdd_from_bin_cts.default,
    aten._histogramdd_from_bin_tensors.default))


def library_kernels() -> dict[Any, Callable[..., Any]]:
    """The ops defined from Python (``torch.library.custom_op``, ``Library.define``) that have a
    kernel for 'cuda' the client runs, each mapped to that kernel: for ``torch.compile``'s trace
    (compiled.py), whose graph then holds the kernel's aten ops, as a GPU's compiled graph calls
    the same kernel (the gateway knows no library's ops)."""
    table: dict[Any, Callable[..., Any]] = {}
    for qualname in sorted(torch.library._defs):
        ns, name = qualname.split("::", 1)
        packet = getattr(getattr(torch.ops, ns), name, None)
        for overload in packet.overloads() if packet is not None else ():
            op = getattr(packet, overload)
            if _runs_here(op):
                table[op] = functools.partial(op.redispatch, _CUDA_KERNEL)
    return table


class NestingAsked(Exception):
    """``nn.TransformerEncoder``'s forward would pack its batch into a nested tensor here
    (transformer_encoder.py computes what it would have). ``aligned``: a remote boolean, whether
    the mask is left-aligned, which torch's nested path needs and reads."""

    def __init__(self, aligned: torch.Tensor):
        super().__init__()
        self.aligned = aligned


def _left_aligned(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> bool:
    """Whether each row of a mask is its valid positions first, then padding: asked by
    ``nn.TransformerEncoder``'s eval fast path before it nests the batch. Inside its forward the
    answer is yes, unread: ``_nested_from_mask`` hands the real one, a remote tensor, to what
    computes the nested path's result, which is the dense one where it is no. Elsewhere the answer
    is no, which keeps a batch dense: nested tensors of the strided layout do not cross the wire."""
    return bool(d.local.encoder)


def _nested_from_mask(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    if d.local.encoder:
        valid = args[1].to(torch.int8)
        raise NestingAsked((valid[:, 1:] <= valid[:, :-1]).all())
    raise strided_nested()


def _strided_nested(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    raise strided_nested()


def strided_nested() -> NotImplementedError:
    """A nested tensor of torch's default (strided) layout is one C++ tensor of packed buffers; a
    jagged one is a Python wrapper of dense values and offsets, which can be remote (nested.py)."""
    return NotImplementedError(
        "remotecuda: nested tensors of the strided layout (torch.nested's default) cannot live on a remote "
        "'cuda' device; make them with layout=torch.jagged, whose values and offsets are dense tensors, or pad "
        "them (torch.nested.to_padded_tensor(t, 0.0))")


def _to_sparse(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """``x.to_sparse()`` of a remote tensor: a sparse COO one on its device (sparse.py)."""
    return sparse.from_dense(*args, **kwargs)


def _sparse_from_parts(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """A sparse COO tensor that C++ builds from 'cuda' indices and values (nn.Embedding(sparse=True)'s
    gradient): a RemoteSparse of them (sparse.py)."""
    size, indices, values = args[2:5]
    remote = next((a for a in (indices, values) if isinstance(a, RemoteTensor)), None)
    s = remote._s if remote is not None else d.session_of(d.target_vdev(kwargs.get("device")))
    indices, values = (a if isinstance(a, RemoteTensor) else d.upload(a, s) for a in (indices, values))
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != values.dtype:
        values = values.to(dtype)
    return sparse.make(indices, values, size, bool(kwargs.get("is_coalesced")))


def _embedding_bag_backward(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """``nn.EmbeddingBag(sparse=True)``'s gradient: the kernel's sparse branch (C++'s composite
    ``_embedding_bag_sparse_backward``, then ``embedding_sparse_backward``) written out, its dense
    ops dispatched and its sparse COO result made of remote parts (sparse.py); the gateway
    returns no sparse tensor."""
    a = _embedding_bag_backward_args(*args, **kwargs)
    if not a["sparse"]:
        return d.run(m, args, kwargs)
    grad, indices, offsets, weights = a["grad"], a["indices"], a["offsets"], a["per_sample_weights"]
    if a["scale_grad_by_freq"]:
        raise RuntimeError("embedding_backward: scale_grad_by_freq not supported with sparse gradients")
    if indices.dtype != offsets.dtype:
        indices, offsets = indices.long(), offsets.long()
    # the bag of each index, as the kernel computes it where a CPU's forward left it empty: a
    # CPU-served gateway's forward does, though the metadata (a GPU's) says it is filled
    bags = offsets.new_zeros(indices.shape[0] + 1).index_add_(0, offsets, torch.ones_like(offsets))
    bags[0] -= 1
    offset2bag = bags.cumsum(0, dtype=bags.dtype)[:indices.shape[0]]
    values = grad.index_select(0, offset2bag)
    if a["mode"] == 1:  # mean
        values = values * (1 / a["bag_size"].to(values.dtype)).unsqueeze(1).index_select(0, offset2bag)
    if weights is not None:
        values = values * weights.unsqueeze(1)
    if a["padding_idx"] != -1:
        kept = indices != a["padding_idx"]
        indices, values = indices[kept], values[kept]
    return sparse.make(indices.reshape(1, -1).long(), values.reshape(-1, grad.shape[-1]),
                       (a["num_weights"], grad.shape[-1]), False)


def _embedding_bag_backward_args(grad: Any, indices: Any, offsets: Any, offset2bag: Any, bag_size: Any,
                                 maximum_indices: Any, num_weights: int, scale_grad_by_freq: bool, mode: int,
                                 sparse: bool, per_sample_weights: Any, padding_idx: int = -1) -> dict:
    return dict(locals())


def _packed_scalars(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> Any:
    """``torch._foreach_addcdiv/addcmul(..., scalars)`` with ``scalars`` a 1-D tensor: CUDA's kernel
    reads it on the host (a CPU tensor, checked as torch checks it), so it goes to the gateway as
    the values of the ``ScalarList`` overload; uploaded, a GPU's kernel would refuse it."""
    *lists, scalars = args
    n = len(lists[0])
    if isinstance(scalars, RemoteTensor):
        raise RuntimeError(f"Expected scalars to be on CPU, got {scalars.device} instead.")
    if not scalars.is_contiguous():
        raise RuntimeError("Expected scalars to be contiguous.")
    if scalars.dim() != 1:
        raise RuntimeError(f"Expected packed scalar Tensor to be of dimension 1. Got {scalars.dim()} instead.")
    if scalars.numel() != n:
        raise RuntimeError(f"Expected length of scalars to match input of length {n} but got "
                           f"{scalars.numel()} instead.")
    return m.func.overloadpacket.ScalarList(*lists, scalars.tolist(), **kwargs)


def _shallow_copy_type(d: Dispatcher, m: OpMeta, args: tuple, kwargs: dict) -> bool:
    """``torch._has_compatible_shallow_copy_type(param, applied)``, asked by ``Module._apply``
    (``model.to('cuda')``): it arrives here only under inference_mode (autograd, whose key answers
    it otherwise, is off). A question about the tensors' C++ types, answered by its own kernel
    here: the gateway would refuse a CPU argument beside a cuda one."""
    return m.func._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args, **kwargs)


#: ``linspace``/``logspace`` given 0-d tensor ends: composites that read them (``_composite``)
_TENSOR_ENDS = tuple(getattr(getattr(aten, op), ends + out) for op in ("linspace", "logspace")
                     for ends in ("Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor") for out in ("", "_out"))

_SPECIAL = {
    aten._to_copy.default: _to_copy,
    aten._has_compatible_shallow_copy_type.default: _shallow_copy_type,
    aten.to.dtype_layout: _to,
    aten.to.device: _to,
    aten.to.dtype: _to,
    aten.to.other: _to,
    aten.copy_.default: _copy_,
    aten.record_stream.default: _record_stream,
    aten.is_pinned.default: _is_pinned,
    aten.set_.source_Storage: _set_storage,
    aten.set_.source_Storage_storage_offset: _set_storage,
    aten._pack_padded_sequence.default: _composite,
    **dict.fromkeys(_TENSOR_ENDS, _composite),
    aten._conj.default: _math_bit_view,
    aten._neg_view.default: _math_bit_view,
    aten.view_as_real.default: _math_bit_checked,
    aten.view.dtype: _math_bit_checked,
    aten._nested_tensor_from_mask_left_aligned.default: _left_aligned,
    aten._nested_tensor_from_mask.default: _nested_from_mask,
    aten._nested_tensor_from_tensor_list.default: _strided_nested,
    aten._to_sparse.default: _to_sparse,
    aten._to_sparse.sparse_dim: _to_sparse,
    aten._sparse_coo_tensor_with_dims_and_tensors.default: _sparse_from_parts,
    aten._embedding_bag_backward.default: _embedding_bag_backward,
    aten._foreach_addcdiv.Tensor: _packed_scalars,
    aten._foreach_addcdiv_.Tensor: _packed_scalars,
    aten._foreach_addcmul.Tensor: _packed_scalars,
    aten._foreach_addcmul_.Tensor: _packed_scalars,
    **dict.fromkeys(_CHECKED_EX, _check_errors),
    **{getattr(p, o): _alerts_at_call for p in _MAY_ALERT for o in p.overloads()},
}

