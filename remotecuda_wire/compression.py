"""Which codec, if any, sends a payload soonest over the link it crosses.

Float weights and activations barely compress (ratio ~1.08); zeros, masks and integer
labels do. Per payload of ``n`` bytes, a 64 KiB sample is compressed and decompressed with
each codec both ends speak (``protocol.CODECS`` limited to the peer's list): that gives the
codec's ratio ``r`` and this machine's encode and decode speeds ``z`` and ``d``. Sent with
it, the payload costs ``n/z + r·n/L + n/d`` on a link of speed ``L``; raw, ``n/L``. The
cheapest wins; a codec that keeps 90 % of the bytes or more is never chosen (its frame
would be dropped for the raw bytes anyway). The receiver's decode speed is taken to be ours.

The sampling stays cheap: codecs are tried fastest first (lz4, then zstd), and since a
later codec does not encode faster than an earlier one, the search stops as soon as a
codec's encoding alone takes as long as the best estimate so far; a codec is decoded only
when its encoding and transfer already beat that estimate. So random floats on a fast link
cost one lz4 and at most one zstd compression of the sample, and nothing more.

``L`` starts at ``REMOTECUDA_LINK_MBPS`` (default 1000 MB/s, loopback-like) and then follows
the transfers the session measures; the gateway keeps the default for downloads.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Collection

from . import protocol
from .limits import env_number

SAMPLE = 64 << 10
#: a codec call's fixed cost, left out when the sample's speed is extrapolated to the payload
CALL_OVERHEAD = 5e-6
MIN_BYTES = 4 << 10


def _seconds(fn: Callable, *args) -> tuple[float, bytes]:
    t = time.perf_counter()
    out = fn(*args)
    return max(time.perf_counter() - t - CALL_OVERHEAD, 1e-7), out


class LinkModel:
    """The speed of one link, and the codec choice it implies."""

    def __init__(self, bytes_per_s: float | None = None):
        if bytes_per_s is None:
            bytes_per_s = env_number("REMOTECUDA_LINK_MBPS", 1000, least=1e-3) * 1e6
        self.bytes_per_s = bytes_per_s

    def observe(self, nbytes: int, seconds: float) -> None:
        """A measured transfer; large ones only, so per-message latency does not dominate."""
        if nbytes >= (1 << 20) and seconds > 0:
            self.bytes_per_s = 0.7 * self.bytes_per_s + 0.3 * (nbytes / seconds)

    def choose(self, buf: memoryview, codecs: Collection[str]) -> str | None:
        """The codec among ``codecs`` that sends ``buf`` soonest, or None when raw is soonest."""
        n = buf.nbytes
        if n < MIN_BYTES:
            return None
        sample = buf[:SAMPLE]
        scale = n / sample.nbytes
        best, best_s = None, n / self.bytes_per_s
        for name in protocol.CODECS:  # fastest first
            codec = protocol.CODEC_IMPLS[name]
            if name not in codecs or n > codec.max_bytes:
                continue
            encode_s, packed = _seconds(codec.compress, sample)
            if encode_s * scale >= best_s:
                break  # neither this codec nor a slower one can win
            ratio = len(packed) / sample.nbytes
            sent_s = encode_s * scale + ratio * n / self.bytes_per_s
            if ratio >= protocol.MAX_RATIO or sent_s >= best_s:
                continue
            decode_s, _ = _seconds(codec.decompress, memoryview(packed), sample.nbytes)
            if sent_s + decode_s * scale < best_s:
                best, best_s = name, sent_s + decode_s * scale
        return best
