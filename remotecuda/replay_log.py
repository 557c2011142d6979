"""The replay log: what a session would need to be rebuilt on another GPU (failover.py).

A session's state on its gateway is a pure function of the op stream the client sent: handles
are the client's (``Session.new_handle``), ops run in order, and random streams follow from
their seeds. So the log keeps exactly that stream, since the session's last snapshot:

- **entries**: every OPS message as it was packed for the wire (its msgpack body, so keeping
  it costs no second encoding), and whether its request was answered;
- **blobs**: the bytes of every upload an entry refers to, by content key (the same digest the
  upload cache uses, so a tensor uploaded again costs nothing more), in memory up to
  ``REMOTECUDA_LOG_MEMORY`` bytes and past that in a local folder of the log's own (inside
  ``REMOTECUDA_LOG_DIR``, else the system's temporary folder), removed when the log is closed;
- **a snapshot**: the session's live tensors, downloaded by storage (views share their base's,
  so aliasing survives), its generators' states and the op index it was taken at. Taking one
  truncates the entries (``Session.snapshot``): when the log passes ``REMOTECUDA_SNAPSHOT_BYTES``
  or on ``remotecuda.checkpoint()``.

The log never sends anything: the session writes to it (``record``, ``upload``) and failover.py
reads it back (``entries``, ``blob``, ``snapshot``) to replay the stream on a fresh session with
the same handle ids.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from remotecuda_wire.limits import env_number

#: keep this many bytes of uploads in memory; the rest go to the spill folder
MEMORY_BYTES = 64 << 20
#: take a snapshot when the log holds this many bytes (messages and uploads)
SNAPSHOT_BYTES = 256 << 20
#: the op names that carry an upload's bytes (replayed from the blobs)
UPLOAD_OPS = frozenset({"rc::upload", "rc::upload_cached"})
#: the ops a snapshot does not replace: replayed after it, on a failover
STICKY_OPS = frozenset({"rc::set_flags", "rc::program_define"})


def _env_bytes(name: str, default: int) -> int:
    return int(env_number(name, default))


@dataclass
class Entry:
    """One OPS message: its packed body, and whether its request (if any) was answered."""

    body: bytes
    request: bool
    answered: bool = False
    ops: int = 0


@dataclass
class Snapshot:
    """Live tensors at one point of the stream (see ``Session.snapshot``)."""

    op_index: int  # the op stream's index when it was taken: replay numbers ops on from here
    storages: dict[int, tuple[bytes, int]] = field(default_factory=dict)  # storage id → (blob key, bytes)
    handles: list[list] = field(default_factory=list)  # [handle, storage id, dtype, shape, stride, offset(, math bits)]
    rng: bytes = b""
    generators: list[list] = field(default_factory=list)  # [generator id, state bytes]
    seconds: float = 0.0  # how long taking it took

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.storages.values())


class BlobStore:
    """Bytes by content key, in memory up to a bound and past it in a folder of its own (made
    on the first spill, inside ``parent`` or the system's temporary folder; removed by ``close``)."""

    def __init__(self, memory_bytes: int, parent: str | None = None) -> None:
        self.memory_bytes = memory_bytes
        self.parent = parent
        self._folder: str | None = None
        self._mem: dict[bytes, bytes] = {}
        self._disk: dict[bytes, int] = {}  # key → size
        self.in_memory = 0
        self.spilled = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._mem or key in self._disk

    def put(self, key: bytes, data: Any) -> int:
        """Keep ``data`` under ``key`` (a copy); the bytes this added (0: it was kept already)."""
        if key in self:
            return 0
        raw = bytes(data)
        if self.in_memory + len(raw) <= self.memory_bytes:
            self._mem[key] = raw
            self.in_memory += len(raw)
            return len(raw)
        if self._folder is None:
            if self.parent is not None:
                os.makedirs(self.parent, exist_ok=True)
            self._folder = tempfile.mkdtemp(prefix="remotecuda-log-", dir=self.parent)
        with open(self._path(key), "wb") as f:
            f.write(raw)
        self._disk[key] = len(raw)
        self.spilled += len(raw)
        return len(raw)

    def get(self, key: bytes) -> bytes:
        raw = self._mem.get(key)
        if raw is not None:
            return raw
        with open(self._path(key), "rb") as f:
            return f.read()

    def keep_only(self, keys: set[bytes]) -> None:
        """Forget every blob but ``keys`` (after a snapshot)."""
        for key in [k for k in self._mem if k not in keys]:
            self.in_memory -= len(self._mem.pop(key))
        for key in [k for k in self._disk if k not in keys]:
            self.spilled -= self._disk.pop(key)
            try:
                os.unlink(self._path(key))
            except OSError:
                pass

    def close(self) -> None:
        self._mem.clear()
        self._disk.clear()
        self.in_memory = self.spilled = 0
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def _path(self, key: bytes) -> str:
        assert self._folder is not None
        return os.path.join(self._folder, key.hex())


class ReplayLog:
    """A session's op stream since its last snapshot (see the module's docstring)."""

    def __init__(self, memory_bytes: int | None = None, snapshot_bytes: int | None = None,
                 folder: str | None = None) -> None:
        self.snapshot_bytes = (snapshot_bytes if snapshot_bytes is not None
                               else _env_bytes("REMOTECUDA_SNAPSHOT_BYTES", SNAPSHOT_BYTES))
        self.blobs = BlobStore(memory_bytes if memory_bytes is not None
                               else _env_bytes("REMOTECUDA_LOG_MEMORY", MEMORY_BYTES),
                               folder or os.environ.get("REMOTECUDA_LOG_DIR") or None)
        self.entries: list[Entry] = []
        #: upload handle → (blob key, dtype, shape), for the uploads the entries name
        self.uploads: dict[int, tuple[bytes, torch.dtype, list]] = {}
        #: ``rc::set_flags`` and ``rc::program_define`` ops seen: flags and compiled graphs outlive a
        #: snapshot (they are session state, not tensors); compacted at each snapshot (``truncate``)
        self.sticky: list[list] = []
        self.freed: set[int] = set()  # compiled graphs freed since the last snapshot
        self.snapshot: Snapshot | None = None
        self.body_bytes = 0  # the entries' packed bodies
        self.upload_bytes = 0  # uploads kept since the snapshot (a snapshot's own bytes do not count toward the next)
        self.ops = 0  # ops in the entries
        self.snapshots = 0  # taken so far

    # ------------------------------------------------------------------ written by the session
    def upload(self, h: int, key: bytes, data: Any, dtype: torch.dtype, shape: list) -> None:
        """An upload under handle ``h``: its bytes kept by content key (once per content)."""
        self.upload_bytes += self.blobs.put(key, data)
        self.uploads[h] = (key, dtype, list(shape))

    def record(self, body: bytes, ops: list, request: bool) -> None:
        """One OPS message as sent (``body``: its packed body; ``ops``: its op list)."""
        self.entries.append(Entry(body, request, ops=len(ops)))
        self.body_bytes += len(body)
        self.ops += len(ops)
        for op in ops:
            if op[0] in STICKY_OPS:
                self.sticky.append(op)
            elif op[0] == "rc::program_free":
                self.freed.update(op[1])

    def answered(self) -> None:
        """The last entry's request was answered: a replay does not ask for its value again."""
        if self.entries:
            self.entries[-1].answered = True

    @property
    def nbytes(self) -> int:
        """What the log holds: packed messages and uploads (in memory and spilled)."""
        return self.body_bytes + self.blobs.in_memory + self.blobs.spilled

    def due(self) -> bool:
        """Whether the log has passed its bound and a snapshot should be taken."""
        return self.body_bytes + self.upload_bytes > self.snapshot_bytes and bool(self.entries)

    def truncate(self, snapshot: Snapshot) -> None:
        """The snapshot replaces everything logged so far."""
        self.snapshot = snapshot
        self.snapshots += 1
        self.entries = []
        self.uploads = {}
        self.body_bytes = self.upload_bytes = self.ops = 0
        self.blobs.keep_only({key for key, _ in snapshot.storages.values()})
        self.sticky = self._compacted()
        self.freed = set()

    def _compacted(self) -> list[list]:
        """The sticky ops as the snapshot's state needs them: the flags' changes merged into one
        ``rc::set_flags``, the graphs freed since dropped. Kept whole, they grew with every step of
        a loop that sets a flag each step (Lightning's "bf16-true" sets the default dtype twice)."""
        flags: dict = {}
        programs = []
        for op in self.sticky:
            if op[0] == "rc::set_flags":
                flags.update(op[1][0])
            elif op[1][0] not in self.freed:
                programs.append(op)
        return [*([["rc::set_flags", [flags], None, None]] if flags else []), *programs]

    # ------------------------------------------------------------------ read by failover
    def blob(self, key: bytes) -> bytes:
        return self.blobs.get(key)

    def info(self) -> dict[str, Any]:
        """For ``remotecuda.stats()["replay_log"]``."""
        return {"entries": len(self.entries), "ops": self.ops, "bytes": self.nbytes,
                "bytes_in_memory": self.body_bytes + self.blobs.in_memory, "bytes_spilled": self.blobs.spilled,
                "snapshots": self.snapshots,
                "snapshot_bytes": self.snapshot.nbytes if self.snapshot is not None else 0}

    def close(self) -> None:
        self.entries = []
        self.uploads = {}
        self.blobs.close()
