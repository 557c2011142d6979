"""The dispatch cache (remotecuda/dispatch_cache.py): typed entries, hit/miss/bypass counts,
its counters in ``remotecuda.stats()`` and ``%remotecuda status``, and the cross-check mode."""
from __future__ import annotations

import pytest
import torch

import remotecuda
from remotecuda import dispatch_cache as dc

aten = torch.ops.aten


def _dispatcher():
    """The active runtime's dispatcher (its op table and metadata cache)."""
    return remotecuda.runtime.current().dispatcher


@pytest.fixture
def cache(remote):
    """The dispatcher's cache, emptied and with its counters at zero."""
    x = torch.ones(7, 13, device="cuda")
    torch.cuda.synchronize()
    _dispatcher().cache.clear()
    remotecuda.stats(reset=True)
    yield x
    _dispatcher().cache.clear()


def _counts() -> dict:
    return {k: v for k, v in remotecuda.stats().items() if k.startswith("metadata_cache_")}


def test_hits_misses_and_typed_entries(cache):
    x = cache
    x + 1
    x + 1  # same signature: a hit
    x + 2.5  # a float, not an int: promotes differently, so a new signature
    x + 3.5  # the float's value is not in add's key: a hit
    st = _counts()
    assert (st["metadata_cache_hits"], st["metadata_cache_misses"], st["metadata_cache_bypasses"]) == (2, 2, 0)
    assert st["metadata_cache_entries"] == 2
    entries = list(_dispatcher().cache.values())
    assert all(type(e) is dc.NewTensor for e in entries)
    assert entries[0].layout[0] == (torch.float32, (7, 13), (13, 1), 0)
    values, indices = x.max(dim=1)  # two new tensors: an Outputs entry
    entry = _dispatcher().cache[next(k for k in _dispatcher().cache if k[0].name == "aten::max.dim")]
    assert type(entry) is dc.Outputs and entry.multi and all(type(i) is dc.NewOut for i in entry.items)
    assert indices.dtype == torch.int64 and values.shape == (7,)


def test_data_dependent_ops_bypass_with_a_reason(cache):
    x = cache
    mask = x > 0  # a miss
    n = mask.nonzero()  # tagged dynamic_output_shape: always described by the gateway, never cached
    mask.nonzero()
    m1 = x[mask]  # index's meta kernel cannot size a boolean-mask result: a negative entry ...
    m2 = x[mask]  # ... found in the cache, and still a bypass rather than a hit
    st = _counts()
    assert st["metadata_cache_bypass_reasons"] == {dc.DYNAMIC_OUTPUT_SHAPE: 2, dc.NO_META_KERNEL: 2}
    assert (st["metadata_cache_hits"], st["metadata_cache_misses"], st["metadata_cache_bypasses"]) == (0, 1, 4)
    assert n.shape == (91, 2) and m1.shape == m2.shape == (91,)
    assert dc.Bypass(dc.NO_META_KERNEL) in _dispatcher().cache.values()


def test_reset_and_stats_keys(cache):
    cache * 2
    assert remotecuda.stats(reset=True)["metadata_cache_misses"] == 1
    st = _counts()
    assert st["metadata_cache_misses"] == 0 and st["metadata_cache_bypass_reasons"] == {}
    assert st["metadata_cache_entries"] == 1  # the counters reset, not the cache


def test_status_shows_the_counters(cache, capsys):
    from IPython.core.interactiveshell import InteractiveShell

    from remotecuda.ipython import Extension, RemoteCUDAMagics
    x = cache
    x.sin()
    x.sin()
    (x > 0).nonzero()
    shell = InteractiveShell.instance()
    ext = Extension(shell)
    st = ext.status()
    assert st["metadata_cache"]["metadata_cache_hits"] == 1
    assert st["metadata_cache"]["metadata_cache_bypass_reasons"] == {dc.DYNAMIC_OUTPUT_SHAPE: 1}
    RemoteCUDAMagics(shell, ext).remotecuda("status")
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "metadata cache" in ln)
    assert "1 hits, 2 misses" in line and f"1 ops described by the gateway: {dc.DYNAMIC_OUTPUT_SHAPE} 1" in line, out


def test_cross_check_catches_a_corrupted_entry(cache, monkeypatch):
    x = cache
    monkeypatch.setattr(_dispatcher().cache, "check", True)
    x * 3
    x * 3  # checked: the entry is what the meta kernel says
    key = next(k for k in _dispatcher().cache if k[0].name == "aten::mul.Tensor")
    good = _dispatcher().cache[key]
    _dispatcher().cache[key] = dc.NewTensor(((torch.float32, (13, 7), (7, 1), 0), True))
    with pytest.raises(dc.CacheCrossCheckError, match="aten::mul.Tensor"):
        x * 3
    _dispatcher().cache[key] = good
    assert (x * 3).shape == (7, 13)


def test_float_values_in_the_key_come_from_the_schema(cache, monkeypatch):
    op_meta = _dispatcher().op_meta
    assert op_meta(aten.upsample_nearest2d.vec).float_values  # scale_factors: float[] sizes the output
    assert op_meta(aten.arange.start_step).float_values  # a factory
    assert not op_meta(aten.add.Tensor).float_values
    assert not op_meta(aten.upsample_nearest2d.default).float_values  # output_size given: scales don't size
    monkeypatch.setattr(_dispatcher().cache, "check", True)  # the rule is checked on every hit
    img = cache[None, None]
    for f in (2.0, 3.0, 2.0):
        assert torch.nn.functional.interpolate(img, scale_factor=f).shape == (1, 1, 7 * int(f), 13 * int(f))


def test_eviction_is_first_in_first_out(monkeypatch):
    monkeypatch.setattr(dc, "CACHE_ENTRIES_MAX", 2)
    c = dc.DispatchCache()
    for k in ("a", "b", "c"):
        c.store((k,), dc.InPlace())
    assert list(c) == [("b",), ("c",)] and c.info().evictions == 1
