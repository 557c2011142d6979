"""When to compress a payload: only where it pays for the link it crosses.

Float weights and activations barely compress (ratio ~1.08); zeros, masks and integer
labels do. Per payload, a 64 KiB sample is compressed: that gives the ratio ``r`` and
this machine's compression speed ``z``. Sending compressed costs ``n/z + r·n/L`` on a
link of speed ``L``, raw costs ``n/L``; compress when ``z·(1 − r) > L``. ``L`` starts at
``REMOTECUDA_LINK_MBPS`` (default 1000 MB/s, loopback-like) and then follows the
transfers measured by the session.
"""
from __future__ import annotations

import os
import time

import zstandard

SAMPLE = 64 << 10
#: a compress call's fixed cost, left out when the sample's speed is extrapolated to the payload
CALL_OVERHEAD = 5e-6
MIN_BYTES = 4 << 10
_compressor = zstandard.ZstdCompressor(level=1)
_compressor.compress(bytes(SAMPLE))  # the first call allocates the context: keep it out of the timing


class LinkModel:
    def __init__(self, bytes_per_s: float | None = None):
        if bytes_per_s is None:
            bytes_per_s = float(os.environ.get("REMOTECUDA_LINK_MBPS", "1000")) * 1e6
        self.bytes_per_s = bytes_per_s

    def observe(self, nbytes: int, seconds: float) -> None:
        """A measured transfer; large ones only, so per-message latency does not dominate."""
        if nbytes >= (1 << 20) and seconds > 0:
            self.bytes_per_s = 0.7 * self.bytes_per_s + 0.3 * (nbytes / seconds)

    def should_compress(self, buf: memoryview) -> bool:
        if buf.nbytes < MIN_BYTES:
            return False
        sample = buf[:SAMPLE]
        t = time.perf_counter()
        packed = _compressor.compress(sample)
        dt = max(time.perf_counter() - t - CALL_OVERHEAD, 1e-7)
        ratio = len(packed) / sample.nbytes
        return ratio < 0.9 and (sample.nbytes / dt) * (1 - ratio) > self.bytes_per_s
