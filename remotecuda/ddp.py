"""``DistributedDataParallel`` over a model on 'cuda' while active.

torch's DDP reduces gradients in C++ (its ``Reducer`` fills buckets from autograd hooks and hands
them to the process group), which a remote tensor cannot cross: gloo's C++ sees its device as
'meta'. Yet the program is ordinary (``torchrun train.py``, each process on its own GPU, DDP
around the model), and on a GPU machine with gloo the buckets go through host memory. So a DDP
made over a 'cuda' model becomes a ``StagedDDP``, which does what the Reducer does, in Python, at
the same points: the module's parameters and buffers broadcast from rank 0 when it is made, the
buffers again before each forward (``broadcast_buffers``), and at the end of each backward that
syncs (not inside ``no_sync()``) every gradient summed over the world and divided by its size,
as one flat tensor per dtype: one read and one write per backward, whatever the parameter count.
With one process the world is the process itself and nothing crosses the wire.

As DDP, a forward that will not sync (inside ``no_sync()`` or without grad) makes the next
forward skip the buffer broadcast, so that each rank's BatchNorm statistics of an accumulation
stay its own. Without ``find_unused_parameters``, a syncing backward that leaves a parameter without
a gradient leaves the reduction unfinished, and the next forward with grad raises the Reducer's
"Expected to have finished reduction in the prior iteration" error. With it, a gradient a rank did
not compute counts as zeros in the others' sum, that rank gets the reduced gradient as the others
do (its optimizer then steps it too, and the ranks' weights stay equal), and a parameter no rank
used keeps None. A copy (``copy.deepcopy``, pickling) reduces its
own parameters' gradients over the default group, as DDP's. What the Reducer offers beyond that is
refused by name (communication hooks, ``join``, static graph).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map


class StagedDDP(nn.parallel.DistributedDataParallel):
    """A DDP whose gradient reduction runs in Python, through the CPU (module docstring).
    Made by ``DistributedDataParallel(model)`` when ``model`` is on 'cuda' (distributed.py)."""

    def _stage(self, module: nn.Module, device_ids: Any = None, output_device: Any = None, dim: int = 0,
               broadcast_buffers: bool = True, process_group: Any = None, bucket_cap_mb: Any = None,
               find_unused_parameters: bool = False, check_reduction: bool = False,
               gradient_as_bucket_view: bool = False, static_graph: bool = False, **_: Any) -> None:
        """DDP's ``__init__`` for this class: its arguments, the same defaults."""
        nn.Module.__init__(self)
        if static_graph:
            self._set_static_graph()
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.device_ids = None if device_ids is None else [torch.device("cuda", d) if isinstance(d, int)
                                                           else torch.device(d) for d in device_ids]
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.static_graph = False
        self._world = dist.get_world_size(self.process_group)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._names = _names(module, self._params)
        self._debug = dist.get_debug_level() != dist.DebugLevel.OFF  # (the Reducer reads it when made)
        self._queued = False
        self._ready: set[int] = set()  # (the ids of the parameters whose gradient this backward gave)
        self._unreduced: list[int] = []  # (the indices of those a syncing backward did not give)
        self._broadcast([*module.parameters(), *module.buffers()])
        self._hook()

    def _hook(self) -> None:
        """Each parameter's gradient accumulation tells ``_accumulated``."""
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def __getstate__(self) -> dict[str, Any]:
        """DDP's: all but the process group, which cannot be copied (a copy uses the default one)."""
        state = dict(self.__dict__)
        del state["process_group"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``copy.deepcopy``, unpickling): over the default group, as DDP's, its own
        parameters hooked (a tensor's copy has none of the original's hooks)."""
        self.process_group = dist.group.WORLD
        nn.Module.__setstate__(self, state)
        self._queued, self._ready, self._unreduced = False, set(), []
        self._hook()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self._unreduced:
            self._refuse_unfinished()
        if self.device_ids:  # (DDP moves the inputs to its device, as here)
            device = self.device_ids[0]
            inputs, kwargs = tree_map(lambda a: a.to(device) if isinstance(a, torch.Tensor) else a, (inputs, kwargs))
        if self.broadcast_buffers and self.require_forward_param_sync:
            self._broadcast(list(self.module.buffers()))
        output = self.module(*inputs, **kwargs)
        # (DDP's _post_forward: a forward whose backward will not sync leaves the buffers as they are
        # on each rank until after the next forward that will)
        self.require_forward_param_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside it accumulate gradients without reducing them (DDP's idiom for
        gradient accumulation); the first one after it reduces what was accumulated."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def register_comm_hook(self, state: object, hook: Any) -> None:
        raise NotImplementedError("remotecuda: DDP communication hooks over a 'cuda' model are not supported "
                                  "(remotecuda reduces the gradients itself, through the CPU)")

    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("remotecuda: DDP's join() over a 'cuda' model is not supported")

    def _set_static_graph(self) -> None:
        raise NotImplementedError("remotecuda: DistributedDataParallel's static graph over a 'cuda' model is not "
                                  "supported (remotecuda reduces gradients itself, without a Reducer)")

    def _get_ddp_logging_data(self) -> dict:
        """The C++ logger's figures (Lightning asks whether a static graph would do): none here."""
        return {}

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values of ``tensors`` on every rank (DDP's ``_sync_module_states``)."""
        if self._world == 1 or not tensors:
            return
        with torch.no_grad():
            for group in _by_dtype(tensors).values():
                flat = torch.cat([t.detach().reshape(-1) for t in group]).cpu()
                dist.broadcast(flat, _global_rank_0(self.process_group), group=self.process_group)
                _write_back(group, flat.to(group[0].device))

    def _accumulated(self, param: torch.Tensor) -> None:
        """A parameter's gradient is in: at the end of this backward, reduce them all (once)."""
        if self.require_backward_grad_sync:
            self._ready.add(id(param))
            if not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    def _reduce(self) -> None:
        """Each gradient summed over the world and divided by its size, a flat tensor per dtype.
        Without ``find_unused_parameters``, a parameter that got no gradient leaves the reduction
        unfinished, as the Reducer's buckets wait for it: the gradients stay this rank's own, and
        the next forward refuses to start (``_refuse_unfinished``)."""
        self._queued = False
        ready, self._ready = self._ready, set()
        if not self.find_unused_parameters:
            self._unreduced = [i for i, p in enumerate(self._params) if id(p) not in ready]
            if self._unreduced:
                return
        if self._world == 1:  # (the sum of one, divided by one)
            return
        with torch.no_grad():
            if self.find_unused_parameters:
                self._give_grads_used_elsewhere()
            for group in _by_dtype(self._params).values():
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in group]).cpu()
                flat.mul_(1.0 / self._world)  # (the Reducer divides as it fills a bucket, then sums)
                dist.all_reduce(flat, group=self.process_group)
                _write_back(group, flat.to(group[0].device), grads=True)

    def _refuse_unfinished(self) -> None:
        """The Reducer's error (reducer.cpp, ``ensure_prior_reduction_finished``) at a forward after
        a backward that left parameters without a gradient; it stays, as the Reducer's does, for
        every later forward. With TORCH_DISTRIBUTED_DEBUG at INFO or DETAIL it names them."""
        rank = dist.get_rank(self.process_group)
        indices = f"Parameter indices which did not receive grad for rank {rank}: {' '.join(map(str, self._unreduced))}"
        if self._debug:
            unused = set(self._unreduced)
            names = ", ".join(name for i, name in self._names if i in unused)
            detail = f"\nParameters which did not receive grad for rank {rank}: {names}\n{indices}"
        else:
            detail = (f"\n{indices}\n In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to "
                      "either INFO or DETAIL to print out information about which particular parameters did not "
                      "receive gradient on this rank as part of this error")
        raise RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a new one. This error "
            "indicates that your module has parameters that were not used in producing loss. You can enable "
            "unused parameter detection by passing the keyword argument `find_unused_parameters=True` to "
            "`torch.nn.parallel.DistributedDataParallel`, and by \nmaking sure all `forward` function outputs "
            "participate in calculating loss. \nIf you already have done the above, then the distributed data "
            "parallel module wasn't able to locate the output tensors in the return value of your module's "
            "`forward` function. Please include the loss function and the structure of the return value of "
            "`forward` of your module when reporting this issue (e.g. list, dict, iterable)." + detail)

    def _give_grads_used_elsewhere(self) -> None:
        """A zero gradient for each parameter this rank did not use and another did, to receive the
        reduced one (the Reducer's local-used map, all-reduced; it is on the CPU, so nothing crosses
        the wire): otherwise that rank's optimizer would skip it and its weights part from the others'."""
        used = torch.tensor([p.grad is not None for p in self._params], dtype=torch.int32)
        dist.all_reduce(used, group=self.process_group)
        for p, anywhere in zip(self._params, used.tolist()):
            if p.grad is None and anywhere:
                p.grad = torch.zeros_like(p)


def _names(module: nn.Module, params: list[torch.Tensor]) -> list[tuple[int, str]]:
    """(index, name) of ``params`` in the order the Reducer names them: DDP's names (its
    ``_build_debug_param_to_name_mapping``: ``module_name.param_name``, '.weight' for the root's
    own, a shared parameter's last), in reverse (its C++ map, filled from that dict, iterates so)."""
    index = {id(p): i for i, p in enumerate(params)}
    names: dict[int, str] = {}
    for module_name, m in module.named_modules():
        for name, p in m.named_parameters(recurse=False):
            if id(p) in index:
                names[index[id(p)]] = f"{module_name}.{name}"
    return list(reversed(names.items()))


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _write_back(tensors: list[torch.Tensor], flat: torch.Tensor, grads: bool = False) -> None:
    """``flat``'s consecutive pieces copied into ``tensors`` (``grads``: into their gradients,
    a tensor without one skipped, its piece too)."""
    at = 0
    for t in tensors:
        n = t.numel()
        target = t.grad if grads else t
        if target is not None:
            target.copy_(flat[at:at + n].view(t.shape))
        at += n


def _global_rank_0(group: Any) -> int:
    return dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
