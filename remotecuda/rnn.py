"""``nn.LSTM``/``GRU``/``RNN`` as one gateway op per call, forward and backward.

``aten::lstm`` and its kin are CompositeImplicitAutograd: on the client they would decompose
(on meta tensors) into several ops per time step and layer — ~4000 ops per training step of a
small two-layer language model, each one a client-side dispatch. A GPU runs the whole layer
stack as one cuDNN op, and a CPU as one oneDNN (or native) call. So the ``torch._VF``
functions the modules call are routed here: the call goes to the gateway as one ``rc::rnn``
op, which runs the device's own implementation. Gradients come from an autograd Function
whose backward is one ``rc::rnn_backward`` op walking the graph the forward left on the
gateway; the handles of that graph are saved for backward, so autograd frees them (and the
gateway its graph) exactly when it would free a local RNN's saved tensors.

That one op is cuDNN's RNN, whose gradient cannot be differentiated again: a GPU's gradient
through it (under ``create_graph=True``: a gradient penalty, MAML, TRPO's Hessian-vector products)
raises torch's NotImplementedError when differentiated, naming the cure, and so does this one's.
cuDNN also refuses a backward through a forward run in eval mode. The cure for both, cuDNN
disabled around the forward, takes a GPU's native RNN, whose per-step ops autograd records,
twice differentiable; so it takes torch's own path here.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C._functorch import is_functorch_wrapped_tensor, is_legacy_batchedtensor
from torch.autograd import forward_ad

from . import autocast
from .tensor import RemoteTensor, contiguous_strides, layout, wrap

#: the ``torch._VF`` functions routed here (their aten ops' names)
NAMES = ("lstm", "gru", "rnn_tanh", "rnn_relu")


class _Call:
    """One RNN call, parsed from ``_VF``'s positional arguments (both overloads: padded input
    with ``batch_first``, and packed ``data`` with CPU ``batch_sizes``)."""

    def __init__(self, name: str, args: tuple):
        self.packed = isinstance(args[1], torch.Tensor) and not args[1].is_floating_point()
        if self.packed:
            x, batch_sizes, hx, params, *flags = args
            self.batch_sizes = batch_sizes.tolist()
            self.batch_first = False
        else:
            x, hx, params, *flags = args
            self.batch_first = bool(flags[-1])
        self.op = f"aten::{name}.{'data' if self.packed else 'input'}"
        self.lstm = name == "lstm"
        self.hx = list(hx) if self.lstm else [hx]
        self.tensors = [x, *self.hx, *params]
        self.flags = flags
        self.bidirectional = bool(flags[4])

    def wire(self, tensors: list) -> list:
        """The aten op's arguments, tensors as handles (``tensors`` in ``self.tensors``' order)."""
        w = [t._w for t in tensors]
        n = len(self.hx)
        hx = w[1:1 + n] if self.lstm else w[1]
        head = [w[0], self.batch_sizes, hx] if self.packed else [w[0], hx]
        return [*head, w[1 + n:], *self.flags]

    def layouts(self) -> list:
        """The outputs' layouts as the device gives them: output (time-major, viewed batch-first
        if asked), then the final hidden state(s), shaped as ``hx``."""
        x = self.tensors[0]
        width = (2 if self.bidirectional else 1) * self.hx[0].shape[-1]
        shape = (*x.shape[:-1], width)
        if self.batch_first:
            t_major = contiguous_strides((shape[1], shape[0], width))
            out = layout(shape, (t_major[1], t_major[0], 1), 0, x.dtype)
        else:
            out = layout(shape, contiguous_strides(shape), 0, x.dtype)
        return [out, *(_dense(h) for h in self.hx)]


def _dense(t: torch.Tensor) -> tuple:
    """The layout of a contiguous tensor shaped as ``t``."""
    return layout(t.shape, contiguous_strides(tuple(t.shape)), 0, t.dtype)


def _send(s: Any, name: str, args: list, lays: list) -> list:
    """Queue one op whose outputs have the layouts ``lays``; their wrappers."""
    handles = [s.new_handle() for _ in lays]
    s.enqueue(name, args, None, handles)
    return [wrap(s, h, lay) for h, lay in zip(handles, lays)]


def _forward(call: _Call, tensors: list, needs: list | None) -> list:
    """The ``rc::rnn`` op: the outputs; with ``needs`` (which tensors want a gradient) also the
    gateway graph's roots (the same outputs, under handles of their own) and leaves."""
    lays = call.layouts()
    graph = lays + [_dense(t) for t, need in zip(tensors, needs) if need] if needs else []
    return _send(tensors[0]._s, "rc::rnn", [call.op, call.wire(tensors), needs, [list(k[2]) for k, _ in lays]],
                 lays + graph)


def _check_devices(call: _Call) -> None:
    """C++'s own check, with the devices named as a GPU names them: the wrappers' C++ device is meta
    ("found input tensor at meta and hidden tensor at cpu" for a forgotten ``h0.to(device)``)."""
    x = call.tensors[0]
    n = len(call.hx)
    for kind, group in (("hidden", call.tensors[1:1 + n]), ("parameter", call.tensors[1 + n:])):
        for t in group:
            if isinstance(t, RemoteTensor) != isinstance(x, RemoteTensor):
                raise RuntimeError(f"Input and {kind} tensors are not at the same device, found input tensor at "
                                   f"{x.device} and {kind} tensor at {t.device}")


class _RNN(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: RemoteTensor) -> tuple:
        needs = list(ctx.needs_input_grad[1:])
        outs = _forward(call, list(tensors), needs)
        n = 1 + len(call.hx)
        ctx.save_for_backward(*outs[n:])  # the gateway's graph: roots, then leaves
        ctx.n, ctx.needs, ctx.train = n, needs, bool(call.flags[3])
        # (what a second differentiation reaches, as it reaches cuDNN's saved inputs: not saved
        # tensors, which the gateway's graph holds already, but an input's own reference)
        ctx.differentiable = [t for t, need in zip(tensors, needs) if need]
        ctx.set_materialize_grads(False)
        return tuple(outs[:n])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        if not ctx.train:  # cuDNN's check (a module in eval mode), which a CPU-served gateway would not make
            raise RuntimeError("cudnn RNN backward can only be called in training mode")
        saved = ctx.saved_tensors
        roots, leaves = saved[:ctx.n], saved[ctx.n:]
        lays = [_dense(t) for t in leaves]

        def walk(gs: list) -> list:
            return _send(roots[0]._s, "rc::rnn_backward", [[t._w for t in roots], [t._w for t in leaves],
                                                           [None if g is None else g._w for g in gs]], lays)
        got = _per_sample(walk, list(grads))
        if torch.is_grad_enabled():  # create_graph=True: differentiable in name only, as cuDNN's
            got = list(_CudnnRnnBackward.apply(len(got), *got, *ctx.differentiable))
        it = iter(got)
        return (None, *(next(it) if need else None for need in ctx.needs))


def _batched(g: Any) -> bool:
    return g is not None and is_legacy_batchedtensor(g)


def _per_sample(walk: Callable[[list], list], grads: list) -> list:
    """``walk(grads)``, where gradients batched by autograd's vmap (``autograd.grad(...,
    is_grads_batched=True)``, ``jacobian(..., vectorize=True)``), which the gateway op cannot
    take, are walked one sample at a time and batched again: vmap's own fallback for an op without
    a batching rule, as cuDNN's RNN backward has none."""
    if not any(_batched(g) for g in grads):
        return walk(grads)
    level = torch._C._vmapmode_increment_nesting() - 1  # (the level in force: torch has no getter for it)
    torch._C._vmapmode_decrement_nesting()
    physical = [torch._remove_batch_dim(g, level, 1, 0) if _batched(g) else g for g in grads]
    size = next(p.shape[0] for p, g in zip(physical, grads) if _batched(g))
    samples = [walk([p[i] if _batched(g) else p for p, g in zip(physical, grads)]) for i in range(size)]
    return [torch._add_batch_dim(torch.stack(parts), 0, level) for parts in zip(*samples)]


#: torch's reason (``kCudnnDoubleBackwardMsg``) after its words for a derivative not implemented
_DOUBLE_BACKWARD = (
    "the derivative for '_cudnn_rnn_backward' is not implemented. Double backwards is not supported for "
    "CuDNN RNNs due to limitations in the CuDNN API. To run double backwards, please disable the CuDNN "
    "backend temporarily while running the forward pass of your RNN. For example: \nwith "
    "torch.backends.cudnn.flags(enabled=False):\n    output = model(inputs)")


class _CudnnRnnBackward(torch.autograd.Function):
    """The gradients of cuDNN's RNN under ``create_graph=True``: as a GPU gives them, they require
    grad (autograd recorded ``_cudnn_rnn_backward``, whose inputs do), and differentiating them
    raises the NotImplementedError torch's derivative for it raises, once a second differentiation
    reaches the RNN's inputs (``inputs``, edges only). (once_differentiable's gradients would not
    require grad: a second ``grad`` would say "does not require grad", and
    ``torch.autograd.functional.hvp`` would give zeros where a GPU raises.)"""

    @staticmethod
    def forward(ctx: Any, n: int, *grads_then_inputs: torch.Tensor) -> tuple:
        return tuple(g.view_as(g) for g in grads_then_inputs[:n])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        raise NotImplementedError(_DOUBLE_BACKWARD)


def _program_torch_function(tensors: list) -> bool:
    """``has_torch_function`` of the call, but for remotecuda's CUDA autocast mode: a tensor
    subclass with a ``__torch_function__`` of its own, or a torch function mode of the program's.
    The autocast mode is in force in any ``torch.autocast('cuda')`` block, a disabled one too, as
    checkpoint's recomputation enters to restore the forward's state (which then ran torch's
    step-by-step path, saving other tensors than the forward: a CheckpointError); ``rnn`` applies
    autocast's cast itself."""
    from .interception import AutocastMode  # (interception routes ``_VF`` here: imported lazily)
    if any(not isinstance(m, AutocastMode) for m in torch.overrides._get_current_function_mode_stack()):
        return True
    return torch._C._is_torch_function_enabled() and any(
        type(t) not in (torch.Tensor, torch.nn.Parameter)
        and getattr(type(t), "__torch_function__", None) is not torch._C._disabled_torch_function_impl
        for t in tensors)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def _graph_saved_as_is() -> Iterator[None]:
    """The gateway graph's handles saved as they are, past the program's saved-tensor hooks:
    ``rc::rnn_backward`` needs those very tensors, where activation offloading (``save_on_cpu``,
    a library's pack/unpack) would give back copies, graphless on the gateway. torch's checkpoint
    keeps its hooks: it recomputes what it saves, a new gateway graph whose handles it returns."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None or getattr(top[0], "__module__", None) == "torch.utils.checkpoint":
        yield
        return
    with torch.autograd.graph.saved_tensors_hooks(_same, _same):
        yield


def _dual(tensors: list) -> bool:
    """Whether forward-mode AD (``torch.autograd.forward_ad``) carries a tangent on any of them."""
    return forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def rnn(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``torch._VF.<name>(*args)`` as one gateway op, when all its tensors are on one gateway."""
    if kwargs or len(args) != 9 or torch._C._get_tracing_state() is not None or not torch.backends.cudnn.enabled:
        # torch.jit.trace must record the one ``aten::lstm`` node a GPU's trace holds, which a
        # gateway op would leave out of the graph (and its sizes are tensors while tracing); with
        # cuDNN off a GPU runs its native RNN, step by step and twice differentiable: torch's
        # own path, whose ops reach the gateway one by one
        return func(*args, **kwargs)
    if torch.is_autocast_enabled("cuda") and autocast.has_remote(args, kwargs):
        # CUDA autocast runs cuDNN's RNN in the autocast dtype (``_cudnn_rnn_cast_reflatten``)
        args = autocast.lowered(args)
    call = _Call(func.__name__, args)
    if _program_torch_function(call.tensors) or \
            any(is_functorch_wrapped_tensor(t) for t in call.tensors) or _dual(call.tensors):
        # a subclass with its own __torch_function__ (per-sample grads' ExpandedWeight), a
        # torch.func transform's wrapper (vmap, grad, jacrev, jvp) or a forward-mode dual tensor
        # decomposes the call (one gateway op has no batching or forward-mode rule, and would
        # drop a tangent): torch's own path
        return func(*args, **kwargs)
    s = getattr(call.tensors[0], "_s", None)
    _check_devices(call)
    if s is None or call.tensors[0].dim() != (2 if call.packed else 3) or \
            not all(isinstance(t, RemoteTensor) and t._s is s for t in call.tensors):
        return func(*args, **kwargs)
    if torch.is_grad_enabled() and any(t.requires_grad for t in call.tensors):
        with _graph_saved_as_is():
            return _RNN.apply(call, *call.tensors)
    return tuple(_forward(call, call.tensors, None))
