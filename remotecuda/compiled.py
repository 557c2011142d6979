"""``torch.compile`` while active: a model's graph traced here, run as one gateway op per call.

Dynamo cannot trace the ``RemoteTensor`` wrapper, and does not need to: the model is traced
without it, by AOTAutograd over fake tensors made from the remote tensors' metadata (CPU
stand-ins; see ``_device_neutral``). That gives ATen FX graphs — the forward, and the
backward when gradients are wanted — which go to the gateway once each as plain data
(``rc::program_define``: op names and arguments, checked there against the aten allowlist;
remotecuda_server/programs.py). Each call of the compiled model is then one
``rc::program_run`` op for the forward and, through the autograd Function AOTAutograd
builds, one for ``loss.backward()``: a training step costs the client a few ops instead of
one per aten op. On a CUDA gateway the graphs are compiled there by inductor.

A trace is kept per input signature (shapes, strides, dtypes, requires_grad, grad mode, the
modules' training flags, autocast's state, the other arguments), as Dynamo's guards do; under
``torch.autocast('cuda')`` the graph holds CUDA autocast's casts (``autocast.stand_ins``). A
call the trace cannot take — a branch on a tensor's value, ``.item()``, an op outside the
allowlist, inputs not all on one gateway — runs eagerly instead, with one warning saying why:
never a wrong result. Randomness (dropout) draws from the gateway's default generator, as eager ops do.
A call on CPU tensors only goes to torch's own ``torch.compile`` (``Compiled._on_cpu``).

The trace runs the call's Python for real, once per AOTAutograd pass, so the plain attributes of
its modules (numbers, flags: a cache's fill level) are the trace's to keep right, as Dynamo keeps
them (``_attributes``): each pass starts from their values before the call, the changes the
call made are set again after each run of its graph (Dynamo replays a frame's attribute
stores), and the attributes a call changes are part of the key (Dynamo guards on what it reads).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import operator
import traceback
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.utils._pytree as pytree

from remotecuda_wire.protocol import Handle

from . import autocast, flex_attention
from .dispatch import DeviceMismatch, library_kernels
from .tensor import RemoteTensor, layout, wrap

#: torch's own ``torch.compile`` (interception replaces it with ``compile``), for calls on CPU tensors
_torch_compile = torch.compile
#: what CPU-only torch says when the code torch's own torch.compile runs asks for 'cuda' (a
#: ``.cuda()`` or a factory inside: remotecuda's mode, that makes them remote, is stepped aside)
_NO_CUDA_HERE = ("not linked with support for cuda", "Torch not compiled with CUDA", "from the 'CUDA' backend")
#: traces kept per compiled object, as Dynamo's ``cache_size_limit``; past it, new signatures run eagerly
MAX_TRACES = 8
_ids = itertools.count(1)
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format,
          torch.layout)
_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)
#: where a traced call's output has a tensor, among its other leaves (which may be None: ``return logits, None``)
_TENSOR = object()
#: an attribute a module does not have (in a trace's key, and in ``_restore``)
_ABSENT = object()
#: (module, attribute name) -> value: a module's plain attributes (see ``_attributes``)
Attributes = dict[tuple[torch.nn.Module, str], Any]
#: (module, attribute name) -> (object, shallow copy of a container): its other attributes (see ``_objects``)
Objects = dict[tuple[torch.nn.Module, str], tuple[Any, Any]]


class Unsupported(Exception):
    """Why a call cannot run as a compiled graph (it then runs eagerly)."""


def compile(model: Any = None, **kwargs: Any) -> Any:
    """``torch.compile``: ``model`` (a module or a function) traced and run on its gateway."""
    if model is None:
        return lambda m: compile(m, **kwargs)
    if kwargs.get("disable") or flex_attention.compiles_to_itself(model):
        return model
    if isinstance(model, torch.nn.Module):
        return CompiledModule(model, kwargs)
    compiled = Compiled(model, kwargs)
    functools.update_wrapper(compiled, model)
    return compiled


class Compiled:
    """A compiled callable: its traces per input signature, or why a signature runs eagerly."""

    def __init__(self, fn: Callable, options: dict[str, Any], *, automatic: bool = False) -> None:
        """``automatic``: compiled by step replay (step_replay.py), not by the program: a signature
        is traced at its second call (a call seen once may be the only one), and a call that runs
        eagerly says so in the log only (the program asked for no compilation).

        An ``automatic`` one refers to its module weakly, here and in its tree and traces: step
        replay keeps it in a table keyed weakly by the module, which a strong reference from the
        value would keep alive for as long as the program runs."""
        self._fn: Callable[[], Any] = weakref.ref(fn) if automatic else (lambda: fn)
        self.automatic = automatic
        #: signatures called once, not traced yet (``automatic`` only)
        self.once: set[tuple] = set()
        #: the modules whose parameters and buffers become graph inputs (see ``_modules``; the
        #: module itself when ``automatic``)
        self._modules = None if automatic else _modules(fn)
        self.traces: dict[tuple, _Trace | str] = {}
        #: the modules' attributes that a traced call changed: their values are in the key
        self.watched: list[tuple[weakref.ref[torch.nn.Module], str]] = []
        self.warned = False
        self.options = options  # (torch.compile's own, for calls on CPU tensors)
        #: torch's own compiled ``fn`` once called on CPU tensors; False once it met 'cuda' inside
        self.local: Callable | None | bool = None
        self._tree: Tree | None = None

    @property
    def fn(self) -> Callable:
        return cast(Callable, self._fn())

    @property
    def modules(self) -> list[torch.nn.Module]:
        return self._modules if self._modules is not None else [cast(torch.nn.Module, self.fn)]

    def tree(self) -> Tree:
        """The modules' tree as it is now: the one walked before while its fingerprint holds."""
        tree = self._tree
        if tree is None or not tree.holds():
            tree = self._tree = Tree(self.modules)
        return tree

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(self.tree(), args, kwargs)

    def call(self, tree: Tree, args: tuple, kwargs: dict) -> Any:
        """A call, with ``tree`` (``self.tree()``: step replay has it already)."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        held = tree.tensors
        if self.local is not False and _all_cpu(leaves, held) and _only_mode_is_remotecudas():
            try:
                return self._on_cpu(args, kwargs)
            except Exception as e:
                if not any(s in str(e) for s in _NO_CUDA_HERE):
                    raise
                self.local = False
                self._warn("it makes 'cuda' tensors from CPU ones, which torch's own torch.compile (that takes "
                           "calls on CPU tensors) cannot do here")
                return self.fn(*args, **kwargs)
        leaves = _scalars_on_device(leaves, held)
        tensors = held + [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors:  # (nothing for a gateway to run: create_block_mask, say)
            return self.fn(*args, **kwargs)
        why = _why_eager(tensors) or _mutable_argument(leaves)
        if why is None:
            session = cast(RemoteTensor, tensors[0])._s
            key = self._key(tree, leaves, spec, tensors)
            entry = self.traces.get(key) if key is not None else "an argument is not hashable"
            if isinstance(entry, _Trace) and entry.session is not session:
                entry = None  # (a new session: the gateway does not know the old one's graphs)
            if entry is None and len(self.traces) >= MAX_TRACES:
                entry = f"it was traced for {MAX_TRACES} input signatures already"
            elif entry is None and self.automatic and key not in self.once:
                self.once.add(cast(tuple, key))
                return self.fn(*args, **kwargs)
            elif entry is None:
                entry = self._trace(tree.state, leaves, spec, tensors)
                self.traces[self._watch(entry, cast(tuple, key))] = entry
            if isinstance(entry, _Trace):
                return entry.run(tensors)
            why = entry
        self._warn(why)
        return self.fn(*args, **kwargs)

    def _on_cpu(self, args: tuple, kwargs: dict) -> Any:
        """A call on CPU tensors only: torch's own ``torch.compile`` (Dynamo, inductor) with
        remotecuda's dispatch mode stepped aside, as plain PyTorch compiles it (Dynamo skips a
        frame while a dispatch mode is on; nothing here is the gateway's)."""
        from torch.utils._python_dispatch import _disable_current_modes
        if self.local is None:
            _prime_dynamo()
            if self.options.get("backend", "inductor") == "inductor":
                _prime_inductor()
            self.local = _torch_compile(self.fn, **self.options)
        with _disable_current_modes():
            return cast(Callable, self.local)(*args, **kwargs)

    def _key(self, tree: Tree, leaves: list, spec: Any, tensors: list) -> tuple | None:
        autocast_dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        key = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast_dtype, tree.training,
               tuple(m().__dict__.get(n, _ABSENT) for m, n in self.watched),
               tree.ids, tuple([(t._k, t.requires_grad) for t in tensors]),
               tuple([None if isinstance(x, torch.Tensor) else _leaf_key(x) for x in leaves]), spec)
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def _watch(self, entry: _Trace | str, key: tuple) -> tuple:
        """The key a new trace is kept under: the attributes it changed are watched from now on,
        and it serves the values they had before it (the key's watched values are its 5th item)."""
        if not isinstance(entry, _Trace):
            return key
        new = [k for k in entry.effects if k not in self.watched]
        if not new:
            return key
        self.watched += new
        return (*key[:4], key[4] + tuple(entry.before.get(k, _ABSENT) for k in new), *key[5:])

    def _warn(self, why: str) -> None:
        if not self.warned:
            self.warned = True
            name = getattr(self.fn, "__qualname__", None) or type(self.fn).__name__
            if self.automatic:
                logging.getLogger("remotecuda").debug("step replay runs %s eagerly: %s", name, why)
            else:
                warnings.warn(f"remotecuda: torch.compile runs {name} eagerly: {why}", stacklevel=3)

    def _trace(self, state: list, leaves: list, spec: Any, tensors: list) -> _Trace | str:
        """A new trace, or why the call runs eagerly; then with its modules' attributes as they
        were before it (the eager call changes them itself)."""
        before, objects = _attributes(self.modules), _objects(self.modules)
        try:
            trace = _Trace(self.fn, self.modules, [(i, n) for i, n, _ in state], leaves, spec, tensors, before,
                           inductor=self.options.get("backend", "inductor") == "inductor")
            _restore_objects(self.modules, objects)  # (what parametrizing for the trace rebuilt, as it was)
            return trace
        except Unsupported as e:
            _restore(self.modules, before)
            _restore_objects(self.modules, objects)
            return str(e)
        except Exception as e:  # noqa: BLE001 - whatever stops the trace, the call still runs eagerly
            _restore(self.modules, before)
            _restore_objects(self.modules, objects)
            return _reason(e)


_Module = torch.nn.Module
#: the methods a module may override to give other parameters or submodules than its dicts hold
_WALKS = ("named_parameters", "named_buffers", "named_modules", "modules", "parameters", "buffers",
          "_named_members")


class Tree:
    """The modules a compiled callable runs, as walked at one call: their parameters and buffers,
    training flags and whether a module hook is set, kept while their fingerprint holds.

    Walking the tree at every call (``modules()``, ``named_parameters()``, ``named_buffers()``,
    for the key, the graph inputs and step replay's checks) cost a replayed MLP step ~4k client
    instructions per op; the fingerprint is one flat pass over the modules' dicts. It holds each
    module's training flag, whether it has hooks, and the name and identity of each of its
    parameters, buffers and submodules, which is all ``named_parameters()`` and the others read;
    the tree keeps what it fingerprints alive, so no identity in it can be another object's,
    except the top modules, held weakly (see ``Compiled``): a dead one fails ``holds``.
    A module that overrides one of those walks (``_WALKS``) is walked at every call."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        mods = [x for top in modules for x in top.modules()]
        self.tops = [weakref.ref(m) for m in modules]
        self.below = [m for m in mods if not any(m is top for top in modules)]
        #: (module index, name, tensor) for each parameter and buffer of the modules
        self.state = [(i, n, t) for i, m in enumerate(modules)
                      for n, t in itertools.chain(m.named_parameters(), m.named_buffers())]
        self.tensors = [t for _, _, t in self.state]
        #: the first module's first parameter (step replay's test of where the model is)
        self.first = next(modules[0].parameters(), None) if modules else None
        self.training = tuple(x.training for x in mods)
        self.ids = tuple((i, n, id(t)) for i, n, t in self.state)
        #: whether a module has a forward or backward hook (step replay leaves such calls eager)
        self.hooked = any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                          for m in mods)
        plain = all(getattr(type(m), w) is getattr(_Module, w) for m in mods for w in _WALKS)
        self.print = _fingerprint([*modules, *self.below]) if plain else None

    def holds(self) -> bool:
        """Whether the modules are still as walked."""
        tops = [r() for r in self.tops]
        return (self.print is not None and all(m is not None for m in tops)
                and _fingerprint([*cast(list[torch.nn.Module], tops), *self.below]) == self.print)


def _fingerprint(mods: list[torch.nn.Module]) -> list:
    out: list = []
    add = out.append
    for m in mods:
        add(m.training)
        add(not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks))
        for d in (m._parameters, m._buffers, m._modules):
            for n, v in d.items():
                add(n)
                add(id(v))
    return out


class CompiledModule(torch.nn.Module):
    """What ``torch.compile(module)`` gives, as torch's ``OptimizedModule``: the module under
    ``_orig_mod`` (its parameters, state_dict and attributes reached through it), called
    through its traces."""

    def __init__(self, mod: torch.nn.Module, options: dict[str, Any]) -> None:
        super().__init__()
        self._orig_mod = mod
        self.__dict__["_compiled"] = Compiled(mod, options)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_compiled"](*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)


def _all_cpu(leaves: list, held: list) -> bool:
    """Whether a call's tensors (arguments, the modules' parameters and buffers: ``held``) are all
    plain CPU ones, and there is at least one."""
    tensors = held + [x for x in leaves if isinstance(x, torch.Tensor)]
    return bool(tensors) and all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
                                 for t in tensors)


def _only_mode_is_remotecudas() -> bool:
    """Whether remotecuda's dispatch mode is the only one on this thread's stack (under a
    user's own mode, Dynamo skips the frames as plain PyTorch's does: the call runs eagerly)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from .interception import RemoteDispatchMode
    return torch._C._len_torch_dispatch_stack() == 1 and isinstance(_get_current_dispatch_mode(),
                                                                    RemoteDispatchMode)


@functools.cache
def _prime_dynamo() -> None:
    """Dynamo's tables of torch functions, built at its first use, built from torch's own:
    built from remotecuda's replacements, one that stands for two torch functions
    (``torch.cuda.current_stream`` and ``torch.accelerator.current_stream``) stops it, and
    they would outlive ``deactivate()``."""
    from torch._dynamo import trace_rules
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    from . import runtime
    with cast(Any, runtime.current().interception).originals():
        TorchInGraphFunctionVariable._get_handlers()
        trace_rules.get_torch_obj_rule_map()


@functools.cache
def _prime_inductor() -> None:
    """inductor's cache key, read once from torch's own ``torch.cuda``: this machine's devices
    (none), not the gateway's (whose properties a CPU gateway's GPU lacks)."""
    from torch._inductor.codecache import CacheBase

    from . import runtime
    with cast(Any, runtime.current().interception).originals():
        CacheBase.get_system()


def forget_dynamo_code() -> None:
    """At deactivation: the code Dynamo compiled while active dropped (``torch._dynamo.reset``).
    Its guards read state through remotecuda's replacements (the current 'cuda' stream), which
    plain torch then fails to give ("Accelerator expected")."""
    if _prime_dynamo.cache_info().currsize:
        torch._dynamo.reset()


def _modules(fn: Callable) -> list[torch.nn.Module]:
    """The modules a compiled callable runs: itself, a bound method's owner, and the modules a
    function names in its closure or globals (``def step(x): return model(x)``)."""
    if isinstance(fn, torch.nn.Module):
        return [fn]
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return [owner]
    code, found = getattr(fn, "__code__", None), []
    if code is not None:
        cells = [_content(c) for c in (getattr(fn, "__closure__", None) or ())]
        named = getattr(fn, "__globals__", {})
        found = [*cells, *(named[n] for n in code.co_names if n in named)]
    seen: dict[int, torch.nn.Module] = {}
    for m in found:
        if isinstance(m, torch.nn.Module):
            seen.setdefault(id(m), m)
    return list(seen.values())


def _content(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _attributes(modules: list[torch.nn.Module]) -> Attributes:
    """The plain values (numbers, flags, strings, dtypes...) that the modules and their submodules
    hold as attributes: the Python state a traced call may read and change, such as
    rotary-embedding-torch's ``cached_freqs_seq_len`` beside the buffer it describes. (Other
    objects a call changes are not followed.)"""
    return {(m, n): v for top in modules for m in top.modules() for n, v in vars(m).items()
            if isinstance(v, _PLAIN)}


def _restore(modules: list[torch.nn.Module], saved: Attributes) -> None:
    """The modules' plain attributes put back to ``saved``; those added since, removed."""
    for m, n in _attributes(modules).keys() - saved.keys():
        del m.__dict__[n]
    for (m, n), v in saved.items():
        m.__dict__[n] = v


def _objects(modules: list[torch.nn.Module]) -> Objects:
    """The other objects the modules hold as attributes (tensors, lists, dicts — their
    parameters and buffers included —, configs), with a shallow copy of each container: a call
    that replaces one or changes a container's contents does something a trace cannot repeat
    at each run, and while tracing it would keep stand-in tensors there (``self.last = h``)."""
    def copy(v: Any) -> Any:
        return next((kind(v) for kind in (list, dict, set) if isinstance(v, kind)), None)
    return {(m, n): (v, copy(v)) for top in modules for m in top.modules() for n, v in vars(m).items()
            if not isinstance(v, _PLAIN) and n != "_modules"}


def _unchanged_objects(modules: list[torch.nn.Module], before: Objects) -> None:
    """Raise Unsupported naming the first object attribute a traced call replaced, added or
    changed (a container replaced by an equal one is unchanged)."""
    def same_item(a: Any, b: Any) -> bool:
        if a is b:
            return True
        if isinstance(a, torch.Tensor) or type(a) is not type(b):
            return False
        if isinstance(a, weakref.ref):
            return a() is b()
        try:
            return bool(a == b)  # (a name, a number)
        except Exception:  # noqa: BLE001 - an object that cannot say: changed
            return False

    def same(old: Any, copy: Any, now: Any) -> bool:
        if now is not old and (copy is None or type(now) is not type(old)):
            return False
        if isinstance(copy, dict):
            return copy.keys() == now.keys() and all(same_item(copy[k], now[k]) for k in copy)
        if isinstance(copy, list):
            return len(copy) == len(now) and all(same_item(a, b) for a, b in zip(copy, now))
        return copy is None or copy == now
    after = _objects(modules)
    for (m, n), (v, _) in after.items():
        old, copy = before.get((m, n), (_ABSENT, None))
        if not same(old, copy, v) and not _derived(m, n):
            raise Unsupported(f"it changes {type(m).__name__}.{n} while it runs, which a trace cannot repeat")


#: attributes a module rebuilds from its parameters when they are swapped (for the trace's
#: stand-ins, in its forward): caches, not effects; put back after the trace like the others
_DERIVED = ((torch.nn.RNNBase, ("_flat_weights", "_flat_weight_refs")),)


def _derived(module: torch.nn.Module, name: str) -> bool:
    return any(isinstance(module, kind) and name in names for kind, names in _DERIVED)


def _restore_objects(modules: list[torch.nn.Module], saved: Objects) -> None:
    """The modules' object attributes, and the containers' contents, put back to ``saved``."""
    for (m, n) in _objects(modules).keys() - saved.keys():
        del m.__dict__[n]
    for (m, n), (v, copy) in saved.items():
        m.__dict__[n] = v
        if isinstance(copy, list):
            v[:] = copy
        elif isinstance(copy, (dict, set)):
            v.clear()
            v.update(copy)


def _changed(before: Attributes, after: Attributes) -> Attributes:
    """The attributes ``after`` has that ``before`` lacks or holds another value of."""
    def same(old: Any, new: Any) -> bool:
        return old is new or (type(old) is type(new) and old == new)
    return {k: v for k, v in after.items() if not same(before.get(k, _ABSENT), v)}


def _scalars_on_device(leaves: list, state: list) -> list:
    """0-d CPU tensor arguments put on the call's 'cuda' device. A GPU's compiled graph takes them
    as they are, as eager ops do (the timestep a diffusers pipeline passes its UNet from a
    scheduler's CPU ``timesteps``); one graph holds one device's tensors here, and a scalar's
    values are the same on either, so without this the call would run eagerly."""
    remote = next((t for t in (*state, *leaves) if isinstance(t, RemoteTensor)), None)
    if remote is None:
        return leaves
    return [x.to(remote.device) if type(x) is torch.Tensor and x.dim() == 0 and x.device.type == "cpu"
            and not x.requires_grad else x for x in leaves]


def _why_eager(tensors: list) -> str | None:
    s = getattr(tensors[0], "_s", None)
    if s is None or [t for t in tensors if not isinstance(t, RemoteTensor) or t._s is not s]:
        return "its tensors (arguments, parameters and buffers) are not all on one 'cuda' device"
    return None


def _leaf_key(x: Any) -> tuple:
    """A non-tensor argument's part of a trace's key. A generator's is its device only: a graph
    cannot hold one (a trace that draws from it runs eagerly), so a trace that did not use it
    serves any (diffusers' pipelines pass theirs to ``vae.decode``, which ignores it)."""
    if isinstance(x, torch.Generator):
        return (torch.Generator, x.device.type)
    return (type(x), x)


def _mutable_argument(leaves: list) -> str | None:
    """Why an argument keeps the call from being traced: the trace runs the Python code for real
    on stand-ins, so an object it is given (transformers' KV cache) would be changed by it and
    keep stand-in tensors (Dynamo replays such side effects; this tracer cannot)."""
    for x in leaves:
        if not isinstance(x, (torch.Tensor, *_PLAIN, torch.nn.Module, type, *_CALLABLES, torch.Generator)):
            return f"it takes a {type(x).__name__}, an object the trace would change"
    return None


def _reason(e: Exception) -> str:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    if isinstance(e, DataDependentOutputException):
        return "it reads a tensor's value while it runs (a branch on a tensor, .item(), ...)"
    if isinstance(e, DynamicOutputShapeException):
        return f"an op's output shape depends on values ({e})"
    if isinstance(e, DeviceMismatch) or "plain meta tensor reached" in str(e):
        # (the trace's stand-ins met a remote tensor: one held elsewhere, e.g. in a static KV cache)
        return ("it uses a 'cuda' tensor that is neither its argument nor a parameter or buffer of a module "
                "it names (compile the module, or pass the tensor)")
    frames = traceback.extract_tb(e.__traceback__)
    if any(f.filename.endswith(("_higher_order_ops/cond.py", "_higher_order_ops/while_loop.py",
                                "_higher_order_ops/map.py")) for f in frames):
        # (eagerly, control_flow.py runs them)
        return "it calls torch.cond, while_loop or map on a tensor (the graph cannot hold their functions)"
    if any(f.name == "_engine_run_backward" and f.filename.endswith("autograd/graph.py") for f in frames):
        # (a whole training step compiled: AOTAutograd's trace cannot run autograd's engine inside;
        # Dynamo would split the graph at the call. PyTorch's own message blames a bug in itself.)
        return "it runs backward() or autograd.grad() inside (compile the model, and step outside)"
    return f"its trace failed ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"


@contextlib.contextmanager
def _device_neutral() -> Any:
    """The trace runs on CPU stand-ins (fake tensors: no data, no work). Meta ones would be the
    natural choice, but under the Python dispatcher AOTAutograd traces with, ops that have a
    Python meta kernel (nll_loss, var, dropout, ...) skip their autograd decomposition and
    would get no gradient; CUDA ones abort a CPU-only torch. So that the graph holds no
    CPU-only kernel, oneDNN and the fused CPU attention are off while it traces (LSTM and SDPA
    decompose into ops any device runs)."""
    flags = (torch._C._get_mkldnn_enabled(), torch._C._get_flash_sdp_enabled(),
             torch._C._get_mem_efficient_sdp_enabled(), torch._C._get_cudnn_sdp_enabled())
    torch._C._set_mkldnn_enabled(False)
    torch._C._set_sdp_use_flash(False)
    torch._C._set_sdp_use_mem_efficient(False)
    torch._C._set_sdp_use_cudnn(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(flags[0])
        torch._C._set_sdp_use_flash(flags[1])
        torch._C._set_sdp_use_mem_efficient(flags[2])
        torch._C._set_sdp_use_cudnn(flags[3])


class _Trace:
    """One input signature's graphs: AOTAutograd's runtime around ``_Program`` runners."""

    def __init__(self, fn: Callable, modules: list[torch.nn.Module], names: list[tuple[int, str]], leaves: list,
                 spec: Any, tensors: list, before: Attributes, inductor: bool) -> None:
        """``before``: the modules' attributes before the call. ``inductor``: whether torch.compile's
        backend is inductor (its default), whose warnings on compiling a graph are given here (see
        ``_warn_tf32_disabled``)."""
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import default_partition
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.nn.utils.stateless import _reparametrize_module
        from torch.utils._python_dispatch import _disable_current_modes

        self.session = tensors[0]._s
        #: the plain attributes the call changed: their values before it, and after (set after each run)
        self.before: dict[tuple[weakref.ref[torch.nn.Module], str], Any] = {}
        self.effects: dict[tuple[weakref.ref[torch.nn.Module], str], Any] = {}
        #: the outputs' pytree spec, and their leaves: the non-tensor ones, ``_TENSOR`` where a tensor goes
        self.out: tuple[Any, list] | None = None
        n_state = len(names)
        slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        trace = self
        held = [(fn, modules, before, leaves)]

        class Flat(torch.nn.Module):
            """The call with every tensor (parameters, buffers, arguments) an argument."""

            def forward(self, *flat: torch.Tensor) -> tuple:
                fn, modules, before, leaves = held[0]
                _restore(modules, before)  # (AOTAutograd runs this more than once: each run starts alike)
                filled = list(leaves)
                for i, t in zip(slots, flat[n_state:]):
                    filled[i] = t
                args, kwargs = pytree.tree_unflatten(filled, spec)
                with contextlib.ExitStack() as stack:
                    for k, m in enumerate(modules):
                        state = {n: t for (i, n), t in zip(names, flat) if i == k}
                        stack.enter_context(_reparametrize_module(m, state, tie_weights=True))
                    # (torch.compiler.is_compiling(), as under Dynamo and non-strict export: libraries
                    # skip their value checks then, such as transformers' packed-sequence test)
                    stack.enter_context(torch.compiler._compile_session_context())
                    objects = _objects(modules)  # (as parametrized: nn.LSTM's weight lists rebuilt)
                    out = fn(*args, **kwargs)
                    _unchanged_objects(modules, objects)
                outs, out_spec = pytree.tree_flatten(out)
                for x in outs:
                    if not isinstance(x, (torch.Tensor, *_PLAIN)):
                        raise Unsupported(f"it returns a {type(x).__name__}, which the trace cannot carry")
                trace.out = (out_spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in outs])
                return tuple(x for x in outs if isinstance(x, torch.Tensor))

        def partition(joint: Any, inputs: Any, **kw: Any) -> Any:
            fw_gm, bw_gm = default_partition(joint, inputs, **kw)
            _nodes(bw_gm)  # the backward is compiled at the first backward: check it can run now
            return fw_gm, bw_gm

        def fw_compiler(gm: torch.fx.GraphModule, example: Any) -> Callable:
            if inductor:
                _warn_tf32_disabled(gm)
            return _Program(self.session, gm)

        def bw_compiler(gm: torch.fx.GraphModule, example: Any) -> Callable:
            if inductor:
                _warn_tf32_disabled(gm)
            return _Backward(self.session, gm)

        fake = FakeTensorMode()  # static shapes: another shape is another trace
        with _disable_current_modes(), _device_neutral(), autocast.stand_ins():
            fakes = []
            for t in tensors:
                dtype, shape, stride, _ = t._k
                with fake:
                    f = torch.empty_strided(shape, stride, dtype=dtype, device="cpu")
                fakes.append(f.requires_grad_(t.requires_grad) if t.requires_grad else f)
            # (a plain module works as well as the GraphModule the signature names: it is traced)
            self.compiled = aot_module_simplified(cast(Any, Flat()), fakes, fw_compiler=cast(Any, fw_compiler),
                                                  bw_compiler=cast(Any, bw_compiler), partition_fn=partition,
                                                  decompositions=library_kernels(),
                                                  keep_inference_input_mutations=True)
        if self.out is None:
            raise Unsupported("the trace saw no call")
        effects = _changed(before, _attributes(modules))
        # (held by module weakly, and only those the call changed: see ``Compiled``)
        self.effects = {(weakref.ref(m), n): v for (m, n), v in effects.items()}
        self.before = {(weakref.ref(m), n): before.get((m, n), _ABSENT) for m, n in effects}
        held.clear()  # (AOTAutograd's runtime keeps ``Flat``: the trace is done with the call's objects)

    def run(self, tensors: list) -> Any:
        out = self.compiled(*tensors)
        for (m, n), v in self.effects.items():
            cast(torch.nn.Module, m()).__dict__[n] = v
        assert self.out is not None
        spec, leaves = self.out
        got = iter(out)
        return pytree.tree_unflatten([next(got) if x is _TENSOR else x for x in leaves], spec)


def _wire(v: Any, index: dict) -> Any:
    if isinstance(v, torch.fx.Node):
        return Handle(index[v])
    if isinstance(v, (list, tuple)):
        return [_wire(x, index) for x in v]
    if isinstance(v, _PLAIN):
        return v
    raise Unsupported(f"the graph holds a {type(v).__name__} argument ({v!r})")


def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return f"{target._schema.name}.{target._overloadname}"
    raise Unsupported(f"the graph calls {target}, which is not an aten op")


def _nodes(gm: torch.fx.GraphModule) -> tuple[int, list, list, list]:
    """A graph as ``rc::program_define`` sends it: input count, nodes, output value indices,
    and the outputs' layouts (None for an output that is None)."""
    index: dict[torch.fx.Node, int] = {}
    n_in, outs = 0, None
    nodes: list[list] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if nodes:
                raise Unsupported("a graph input after its first op")
            index[node] = n_in
            n_in += 1
        elif node.op == "call_function":
            name, args = _op_name(node.target), list(node.args)
            traced = _traced_view_strides(node)
            if traced is not None:
                name, args = _op_name(torch.ops.aten._reshape_alias.default), [args[0], list(args[1]), traced]
            nodes.append([name, _wire(args, index), {k: _wire(v, index) for k, v in node.kwargs.items()}])
            index[node] = n_in + len(nodes) - 1
        elif node.op == "get_attr":
            nodes += _constant(getattr(gm, str(node.target)), n_in + len(nodes), node.target)
            index[node] = n_in + len(nodes) - 1
        elif node.op == "output":
            outs = node.args[0]
        else:
            raise Unsupported(f"the graph has a {node.op} node ({node.target})")
    if not isinstance(outs, (list, tuple)):
        raise Unsupported("the graph's output is not a list")
    values: list[int] = []
    lays: list[tuple | None] = []
    for o in outs:
        if o is None:
            lays.append(None)
            continue
        val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            raise Unsupported(f"the graph returns a {type(val).__name__}, not a tensor")
        values.append(index[o])
        lays.append(layout(val.shape, val.stride(), int(val.storage_offset()), val.dtype))
    return n_in, nodes, values, lays


#: the most elements of a tensor made in the traced code that the graph builds one by one
MAX_CONSTANT = 64


def _constant(value: Any, first: int, name: Any) -> list[list]:
    """Nodes that build a tensor the traced code made from Python numbers (``torch.tensor([t])``
    for a diffusers UNet's int timestep), which the trace holds as a constant: one
    ``scalar_tensor`` per element, stacked and shaped. ``first`` is the value index of the
    first node; the last one is the tensor."""
    if isinstance(value, torch.Generator):
        raise Unsupported("it draws from a torch.Generator it is given (a graph cannot hold one)")
    if not (isinstance(value, torch.Tensor) and type(value) is torch.Tensor and value.device.type == "cpu"
            and 0 < value.numel() <= MAX_CONSTANT and value.is_contiguous()):
        raise Unsupported(f"the graph has a get_attr node ({name})")
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():  # (the compilers run under the trace's fake mode)
        numbers = value.reshape(-1).tolist()
    kw = {"dtype": value.dtype, "device": torch.device("cpu")}  # (any device named is the gateway's)
    made = [[_op_name(torch.ops.aten.scalar_tensor.default), [x], kw] for x in numbers]
    if value.dim() == 0:
        return made
    return made + [[_op_name(torch.ops.aten.stack.default), [[Handle(first + i) for i in range(len(made))]], {}],
                   [_op_name(torch.ops.aten.view.default), [Handle(first + len(made)), list(value.shape)], {}]]


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _traced_view_strides(node: torch.fx.Node) -> list | None:
    """The strides the trace gave a view whose eager kernel gives others, or None. The fake
    tensors' view can stride a size-1 dim unlike C++'s (``(1024, 1, 256, 64)`` for C++'s
    ``(64, 1, 256, 64)``): the same elements, but a kernel that checks its input's memory format
    (CPU ``native_group_norm``, after a UNet's attention block at batch 1) then finds it neither
    contiguous nor channels-last, where the trace had left out the copy it needed. The graph
    keeps the trace's strides instead."""
    val = node.meta.get("val")
    src = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if node.target not in _VIEWS or not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor):
        return None
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        eager = node.target(torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="meta"), node.args[1])
    return None if eager.stride() == val.stride() else list(val.stride())


#: the products inductor means when it says TF32 would speed a graph up (``is_tf32_warning_applicable``)
_TF32_OPS = ("mm", "addmm", "bmm", "baddbmm")


def _warn_tf32_disabled(gm: torch.fx.GraphModule) -> None:
    """Inductor's warning when it compiles a graph with float32 matrix products for a GPU from
    Ampere on while TF32 is off for them ("TensorFloat32 tensor cores ... available but not
    enabled"), which every ``torch.compile`` of a float32 model meets there: inductor's own check
    of the graph reads its values' device, 'cpu' in this trace. torch's conditions on the device
    are read first (importing inductor takes seconds), then torch's function warns, in its words
    and at its line, as on a GPU."""
    if torch.backends.cuda.matmul.fp32_precision == "tf32" or torch.cuda.get_device_capability() < (8, 0):
        return
    for name in _TF32_OPS:
        for node in gm.graph.find_nodes(op="call_function", target=getattr(torch.ops.aten, name).default):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dtype == torch.float32:
                from torch._inductor.compile_fx import _warn_tf32_disabled as warn
                warn()
                return


class _Program:
    """One graph defined on the session's gateway; calling it queues one ``rc::program_run``
    and gives the outputs' wrappers (None where the graph returns None)."""

    def __init__(self, session: Any, gm: torch.fx.GraphModule) -> None:
        n_in, nodes, self.values, self.lays = _nodes(gm)
        self.session, self.id, self.n_in = session, next(_ids), n_in
        values = iter(self.values)  # (one per output that is not None)
        #: output position -> its value index, for the outputs that are not None
        self.outputs = {i: next(values) for i, lay in enumerate(self.lays) if lay is not None}
        session.enqueue("rc::program_define",
                        [self.id, n_in, nodes, self.values, [list(lay[0][2]) for lay in self.lays if lay is not None]],
                        None, None)

    _boxed_call = True  # AOTAutograd passes the arguments as one list

    def __call__(self, args: list) -> list:
        s = self.session
        if len(args) != self.n_in or [a for a in args if not isinstance(a, RemoteTensor) or a._s is not s]:
            raise RuntimeError("remotecuda: a compiled graph was called with tensors that are not on its gateway")
        base = s.reserve(len(self.outputs))  # (one call for all the outputs' handles: a step makes dozens)
        s.enqueue("rc::program_run", [self.id, [a._w for a in args]], None, list(range(base, base + len(self.outputs))))
        got = iter(range(base, base + len(self.outputs)))
        return [None if lay is None else wrap(s, next(got), lay) for lay in self.lays]

    def __del__(self) -> None:
        s = getattr(self, "session", None)  # (None: __init__ refused the graph before defining it)
        if s is not None and not s.closed:
            s.drop_object("rc::program_free", self.id)


class _Backward(_Program):
    """A backward graph, whose parameter gradients it stores in their ``.grad`` itself.

    The engine would hand each gradient to the parameter's ``AccumulateGrad``, which stores
    ``grad.detach()``: one more op through the dispatcher per parameter and step (torch's
    ``__torch_dispatch__`` price and a wrapper each), the largest part of a replayed step's
    client work on a model with few ops per parameter. Where ``AccumulateGrad`` would store the
    gradient as it is (see ``_stealable``), the wrapper the graph gave is stored instead, the same
    tensor on the gateway, and the engine gets None for it (``AccumulateGrad`` does nothing with
    None). Everything else (a ``.grad`` to add to, hooks, ``autograd.grad``, ``backward(inputs=)``,
    ``create_graph``) goes through ``AccumulateGrad`` as before.

    A gradient that is one of the graph's inputs (the incoming gradient passed on as a bias's)
    is given as that input's wrapper, as a compiled graph returns the tensor it was given: a
    wrapper of its own would hide that the two are one tensor on the gateway, and
    AccumulateGrad, which copies a gradient that others hold, would store the incoming
    gradient itself (the program's output sent for it is freed with the wrapper)."""

    def __init__(self, session: Any, gm: torch.fx.GraphModule) -> None:
        super().__init__(session, gm)
        #: outputs the graph computed, each once: as a new gradient, eager's would be a tensor no
        #: other holds, which AccumulateGrad takes as it is (a graph input, such as an incoming
        #: gradient, or an output given twice, AccumulateGrad would clone)
        self.fresh = frozenset(i for i, v in self.outputs.items() if v >= self.n_in and self.values.count(v) == 1)

    def __call__(self, args: list) -> list:
        grads = super().__call__(args)
        for i, v in self.outputs.items():
            if v < self.n_in:
                grads[i] = args[v]
        return _stored_as_grads(grads, self.fresh)


def _stored_as_grads(grads: list, fresh: frozenset[int]) -> list:
    """``grads``, the gradients of the engine's current node's inputs, with those that
    ``AccumulateGrad`` would store as they are stored in their parameters' ``.grad`` here and
    given to the engine as None."""
    node = torch._C._current_autograd_node()
    if node is None or torch.is_grad_enabled():  # (create_graph: AccumulateGrad keeps a graph)
        return grads
    edges = node.next_functions
    if len(edges) != len(grads):  # (inputs and gradients not one to one: leave them to the engine)
        return grads
    for i in fresh:
        acc = edges[i][0]
        if not isinstance(acc, torch._C._functions.AccumulateGrad):  # type: ignore[attr-defined]
            continue
        try:
            if not torch._C._will_engine_execute_node(acc):  # (backward(inputs=) without this one)
                continue
        except RuntimeError:  # autograd.grad(): the leaves' gradients are returned, not stored
            return grads
        param = acc.variable
        if _stealable(param, grads[i]):
            _set_grad(param, grads[i])  # (torch's own setter: the same gateway, which interception's checks for)
            grads[i] = None
    return grads


_set_grad = vars(torch._C.TensorBase)["grad"].__set__


def _stealable(param: torch.Tensor, grad: RemoteTensor) -> bool:
    """Whether ``AccumulateGrad`` would store ``grad`` (a new tensor no other holds) in ``param``
    as it is: no gradient there yet, no hook to see it first or after, and the parameter's own
    layout (dtype, shape and strides: its layout contract; else it stores a copy laid out as
    the parameter)."""
    return (isinstance(param, RemoteTensor) and param._s is grad._s and param.grad is None
            and not param._backward_hooks and param._post_accumulate_grad_hooks is None
            and param._k[:3] == grad._k[:3])
