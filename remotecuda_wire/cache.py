"""The content-addressed upload cache, run identically on both ends.

The gateway keeps recently uploaded payloads keyed by their content key, bounded by
bytes, evicting by LRU or LFU. The client keeps a mirror of the same bookkeeping: both
see the same sequence of uploads in the same order (ops execute in issue order), so
both evict the same entries, and the client knows, without asking, whether the gateway
still holds a payload — it then sends only the digest. Nothing is ever sent twice while
it stays cached, and no round trip is spent finding out.
"""
from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from typing import Any

import xxhash

from .limits import CACHE_BYTES as DEFAULT_BYTES  # defined there: the command line reads it without torch
from .protocol import payload_digest

#: payloads smaller than this are sent as they are: the digest would cost more than it saves
MIN_BYTES = 1 << 10
POLICIES = ("lru", "lfu")


def content_key(part_digests: list[bytes]) -> bytes:
    """The cache key of a payload sent as parts with these digests (one part: its digest).

    Built from the digests the wire already carries, so the gateway checks integrity and
    finds the key in one pass over the bytes, part by part as they arrive."""
    if len(part_digests) == 1:
        return part_digests[0]
    return xxhash.xxh3_128_digest(b"".join(part_digests))


def part_digests(buf: memoryview, part_bytes: int) -> list[bytes]:
    """The digests of a payload cut into parts of ``part_bytes``."""
    return [payload_digest(buf[i:i + part_bytes]) for i in range(0, buf.nbytes, part_bytes)] \
        or [payload_digest(buf)]


class ContentCache:
    """digest → value, bounded by the sum of the entries' sizes."""

    def __init__(self, capacity: int = DEFAULT_BYTES, policy: str = "lru"):
        if policy not in POLICIES:
            raise ValueError(f"cache policy must be one of {POLICIES}, not {policy!r}")
        self.capacity, self.policy = capacity, policy
        self.entries: OrderedDict[bytes, list] = OrderedDict()  # digest → [value, nbytes, uses, tick]
        self.size = 0
        self.evictions = 0
        self._tick = itertools.count()

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes) -> Any:
        """The value, counted as a use (moves it up for LRU, counts it for LFU); None if absent."""
        e = self.entries.get(key)
        if e is None:
            return None
        e[2] += 1
        e[3] = next(self._tick)
        self.entries.move_to_end(key)
        return e[0]

    def put(self, key: bytes, value: Any, nbytes: int) -> list[bytes]:
        """Insert (if it fits at all); returns the evicted digests."""
        if key in self.entries or nbytes > self.capacity:
            return []
        evicted = []
        while self.size + nbytes > self.capacity:
            victim = self._victim()
            self._evict(victim)
            evicted.append(victim)
        self.entries[key] = [value, nbytes, 1, next(self._tick)]
        self.size += nbytes
        return evicted

    def _evict(self, key: bytes) -> list:
        entry = self.entries.pop(key)
        self.size -= entry[1]
        self.evictions += 1
        return entry

    def _victim(self) -> bytes:
        if self.policy == "lru":
            return next(iter(self.entries))
        return min(self.entries.items(), key=lambda kv: (kv[1][2], kv[1][3]))[0]


class CacheMirror(ContentCache):
    """The client's copy of the gateway's bookkeeping. Its values are each payload's
    (size, first-part digest), so it can also say that a payload is certainly *not*
    cached after hashing only its first part: a large upload then starts streaming while
    the rest is hashed, instead of after."""

    def __init__(self, capacity: int = DEFAULT_BYTES, policy: str = "lru"):
        super().__init__(capacity, policy)
        self._prefixes: Counter = Counter()

    def put(self, key: bytes, prefix: tuple, nbytes: int) -> list[bytes]:
        new = key not in self.entries
        evicted = super().put(key, prefix, nbytes)
        if new and key in self.entries:
            self._prefixes[prefix] += 1
        return evicted

    def _evict(self, key: bytes) -> list:
        entry = super()._evict(key)
        self._prefixes[entry[0]] -= 1
        if not self._prefixes[entry[0]]:
            del self._prefixes[entry[0]]
        return entry

    def may_hold(self, prefix: tuple) -> bool:
        return prefix in self._prefixes
