"""Value reads of a remote tensor taken straight to its session: ``x.item()``, ``float(x)``,
``int(x)``, ``bool(x)`` and ``x.tolist()``, in place of torch's methods on RemoteTensor.

torch's own path to a value goes C++ method → ``aten::item`` → autograd → the Python key → the
dispatch mode → ``Dispatcher.dispatch`` → the metadata cache's bypass → ``Session.request``: about
22 µs and a fifth of the client's instructions per read before the read itself leaves
(benchmarks/RESULTS.md, Part 11), where a value read with nothing queued is one small message
each way (remotecuda_wire/fastread.py). A read whose path holds nothing else takes the session
directly; any other goes torch's way, so that what stands in that path still sees it:

- a ``__torch_function__`` of the tensor's class (another library's subclass) or a function mode
  (autocast's, a user's), which C++ calls first;
- a dispatch mode other than remotecuda's (a user's ``TorchDispatchMode``, FlopCounter), or the
  Python key excluded (a read on a meta stand-in raises torch's "cannot be called on meta tensors");
- ``torch.jit.trace`` (its "Converting a tensor to a Python number" warning), a decode's known
  values (known.py, read on the client), a user's 'meta' factory;
- anything torch refuses or warns about before dispatch, or converts with a check of its own:
  a tensor of another number of elements than one, ``float()`` of a tensor requiring grad (its
  warn-once), a complex ``float()``/``int()``, a uint64 ``int()``.

What the read returns is what the gateway's ``_local_scalar_dense`` gave, as torch returns it
(``item()``: the Python number of the tensor's kind; ``float()``/``int()``/``bool()``: that number
converted as C++ converts it). No autograd node is involved either way: a read records nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .dispatch import Dispatcher
from .tensor import RemoteTensor

_C = torch._C
_BASE = _C.TensorBase
_has_torch_function = _C._has_torch_function_unary
handle_torch_function = torch.overrides.handle_torch_function
_tracing = _C._get_tracing_state
_modes = _C._len_torch_dispatch_stack
_mode_at = _C._get_dispatch_stack_at
_excluded = _C._dispatch_tls_is_dispatch_key_excluded
_PYTHON_KEY = _C.DispatchKey.Python
_ITEM = "aten::_local_scalar_dense.default"
#: dtypes whose ``float()``/``int()`` torch converts with a check the Python conversion lacks
_NOT_FLOAT = frozenset((torch.complex32, torch.complex64, torch.complex128))
_UINT64 = frozenset((torch.uint64,))  # (C++ reads its values past 2**63 as an overflowing int64)
_NOT_INT = _NOT_FLOAT | _UINT64


def methods(dispatcher: Dispatcher, mode: type) -> dict[str, Callable[..., Any]]:
    """RemoteTensor's value-reading methods while active, by name, bound to the runtime's
    dispatcher; ``mode``: remotecuda's dispatch mode class (the one mode that may be on the stack
    for a read to pass it by)."""
    local = dispatcher.local
    slow_tolist = vars(RemoteTensor)["tolist"]  # (torch's way: through t.cpu())

    def plain(t: RemoteTensor) -> bool:
        """Whether torch's path from a method of ``t`` to the dispatcher's read holds nothing but
        remotecuda's own layers (see the module's docstring)."""
        if _has_torch_function(t) or _tracing() is not None or _excluded(_PYTHON_KEY):
            return False
        n = _modes()
        if n > 1 or (n == 1 and not isinstance(_mode_at(0), mode)):
            return False
        return not dispatcher.propagate and not local.user_meta

    def scalar(t: RemoteTensor) -> Any:
        """``t``'s one element, read from its session (what ``_local_scalar_dense`` gives)."""
        s = t._s
        local.vdev = s.vdev  # (as any op of t's sets it: 'meta' factories of a backward go there)
        return s.request(_ITEM, [t._w])

    def item(t: RemoteTensor) -> Any:
        if plain(t) and t.numel() == 1:
            return scalar(t)
        return _BASE.item(t)

    def to_float(t: RemoteTensor) -> float:
        if plain(t) and t.numel() == 1 and not t.requires_grad and t._k[0] not in _NOT_FLOAT:
            return float(scalar(t))
        return _BASE.__float__(t)

    def to_int(t: RemoteTensor) -> int:
        if plain(t) and t.numel() == 1 and t._k[0] not in _NOT_INT:
            return int(scalar(t))
        return _BASE.__int__(t)

    def to_bool(t: RemoteTensor) -> bool:
        if plain(t) and t.numel() == 1 and t._k[0] not in _UINT64:
            return bool(scalar(t))
        return _BASE.__bool__(t)

    def tolist(t: RemoteTensor) -> Any:
        """Its values, downloaded as ``t.cpu()`` downloads them (``Dispatcher.download``), without
        the copy op's way through the dispatcher; a complex one (a lazy conjugate or negative view,
        which torch's copy resolves) through ``t.cpu()``. A subclass's ``__torch_function__`` or a
        function mode sees ``tolist`` itself, as for a local tensor (torch's C++ ``tolist``, which
        refuses tensor subclasses, cannot be handed to them)."""
        if _has_torch_function(t):
            return handle_torch_function(tolist, (t,), t)
        if plain(t) and t._k[0] not in _NOT_FLOAT:
            local.vdev = t._s.vdev
            return dispatcher.download(t).tolist()
        return slow_tolist(t)

    return {"item": item, "__float__": to_float, "__int__": to_int, "__bool__": to_bool, "tolist": tolist}
