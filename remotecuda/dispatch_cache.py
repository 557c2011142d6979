"""The dispatch cache: each op signature's output metadata, so a meta kernel runs once per signature.

Modelled on FakeTensor's dispatch cache (torch/_subclasses/fake_tensor.py: ``_DispatchCacheKey``,
``_DispatchCacheValidEntry``, ``_DispatchCacheBypassEntry``, ``_BypassDispatchCache``): typed
entries, a negative entry for signatures whose outputs only the gateway can tell, every bypass
counted under its reason, and a cross-check mode (``REMOTECUDA_CHECK_CACHE=1``) in which the
dispatcher recomputes every cached entry on each hit and raises ``CacheCrossCheckError`` on any
difference.

The key is a plain tuple that ``dispatch._walk`` builds in its one pass over the arguments: the
op's ``OpMeta``; then per argument, in schema order, a remote tensor's ``(dtype, shape, stride,
offset)``, ``(type, value)`` for an atom (a float's type alone where its value cannot shape the
outputs: see ``OpMeta.float_values``), ``("[", n)`` before a list's items, a marker for a
device or generator; the keyword arguments' names; for factories the default dtype. A tuple and
not a class like FakeTensor's ``_DispatchCacheKey``: a tuple hashes and compares in C, where a
``__hash__``/``__eq__`` written in Python would run on every lookup.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: Bound on the number of cached signatures. A training step uses a few hundred; the bound is for
#: programs that keep making new shapes (growing sequence lengths), whose entries (a key and a
#: layout, a few hundred bytes each) would otherwise grow without end: 65536 of them is some tens
#: of MB. Eviction is first in, first out: an LRU order would cost a ``move_to_end`` on every hit,
#: while an evicted signature that is still in use costs one meta-kernel run to come back.
CACHE_ENTRIES_MAX = 65536

# Why an op's outputs are described by the gateway instead of computed here (``Bypass.reason``).
#: the schema returns something other than tensors (a Scalar, a bool): only the device knows it
NON_TENSOR_OUTPUT = "non-tensor output"
#: tagged ``data_dependent_output``: the output's values decide its metadata
DATA_DEPENDENT_OUTPUT = "data-dependent output"
#: tagged ``dynamic_output_shape`` (``nonzero``, ``unique``, ``masked_select``...)
DYNAMIC_OUTPUT_SHAPE = "dynamic output shape"
#: the op has no meta kernel (``NotImplementedError`` on meta)
NO_META_KERNEL = "no meta kernel"
#: the meta kernel needed the data (``index`` with a boolean mask)
META_NEEDS_DATA = "meta kernel needs data"
#: the meta kernel refused the arguments and the device accepted them: the device has the last word
META_REFUSED = "meta kernel refused"
#: an op that reads its result on a GPU to raise at the call (``_linalg_check_errors``: ``except
#: torch.linalg.LinAlgError`` around ``cholesky`` expects the error there, not at a later sync)
CHECKS_AT_CALL = "checks at the call"
#: an op whose kernel may refuse (or warn) under ``torch.use_deterministic_algorithms(True)``,
#: which a GPU does on the host, at the call, while the setting is on
DETERMINISM_AT_CALL = "deterministic algorithms: alerts at the call"


@dataclass(frozen=True, slots=True)
class NewTensor:
    """The common entry: the op returns one new tensor with this layout (see ``tensor.layout``)."""

    layout: tuple


@dataclass(frozen=True, slots=True)
class InPlace:
    """Every output is a written argument and there is no meta kernel (fused optimizer steps):
    the op returns its first argument."""


@dataclass(frozen=True, slots=True)
class Outputs:
    """Any other result: per return, an output spec, a list of them (``List[Tensor]``), or None."""

    multi: bool  # the op returns a tuple
    items: tuple


@dataclass(frozen=True, slots=True)
class Bypass:
    """A negative entry: this signature's outputs are described by the gateway (one round trip)."""

    reason: str


# Output specs: one per tensor (or integer) an op returns, inside ``Outputs.items``.
@dataclass(frozen=True, slots=True)
class NewOut:
    """A new tensor with this layout."""

    layout: tuple


@dataclass(frozen=True, slots=True)
class ViewOut:
    """A new view of argument (``pos``, ``name``), with this layout."""

    pos: int | None  # None: a keyword-only argument
    name: str
    layout: tuple


@dataclass(frozen=True, slots=True)
class ArgOut:
    """The written argument (``pos``, ``name``) itself (in-place and out= ops); ``resized``: the
    layout the op gives it where that is not its own (an ``out=`` tensor of another shape, which
    the kernel resizes), else None."""

    pos: int | None
    name: str
    resized: tuple | None = None


@dataclass(frozen=True, slots=True)
class ConstOut:
    """A shape-like integer result (a SymInt return): no tensor, nothing on the gateway."""

    value: int


Entry = NewTensor | InPlace | Outputs | Bypass


class CacheCrossCheckError(AssertionError):
    """Cross-check mode found a cached entry that differs from the metadata computed afresh."""


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """A snapshot of the cache's counters (FakeTensor's ``DispatchCacheInfo``)."""

    hits: int  # metadata found in the cache
    misses: int  # metadata computed by a meta kernel, then cached
    bypasses: dict[str, int] = field(default_factory=dict)  # described by the gateway, by reason
    size: int = 0
    evictions: int = 0

    def as_stats(self) -> dict:
        """The counters as ``remotecuda.stats()`` reports them."""
        return {"metadata_cache_hits": self.hits, "metadata_cache_misses": self.misses,
                "metadata_cache_bypasses": sum(self.bypasses.values()),
                "metadata_cache_bypass_reasons": dict(self.bypasses),
                "metadata_cache_entries": self.size, "metadata_cache_evictions": self.evictions}


class DispatchCache(dict):
    """key → ``Entry``, with its counters. A dict subclass with slots, so that the lookup on
    every op stays ``dict.get`` and the counters are plain slot attributes."""

    __slots__ = ("hits", "misses", "bypasses", "evictions", "check")

    def __init__(self, check: bool = False) -> None:
        super().__init__()
        self.hits = self.misses = self.evictions = 0
        self.bypasses: dict[str, int] = {}
        #: cross-check mode: the dispatcher recomputes every entry it finds here
        self.check = check

    def store(self, key: tuple, entry: Entry) -> None:
        """Cache ``entry``, evicting the oldest one at the bound."""
        if len(self) >= CACHE_ENTRIES_MAX:
            self.pop(next(iter(self)))
            self.evictions += 1
        self[key] = entry

    def bypass(self, reason: str) -> None:
        """Count one op whose outputs the gateway describes."""
        self.bypasses[reason] = self.bypasses.get(reason, 0) + 1

    def info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, dict(self.bypasses), len(self), self.evictions)

    def reset_counters(self) -> None:
        self.hits = self.misses = self.evictions = 0
        self.bypasses.clear()
