"""``torch.Generator(device='cuda')``: a generator that lives on the gateway.

A CPU-only torch cannot make a CUDA generator, and the Python object passed as
``generator=`` reaches ``__torch_dispatch__`` as a fresh ``torch._C.Generator`` (its
identity is lost, its state is not). So the client object is a CPU generator that
serves as a carrier: its own seed encodes the gateway generator's id, and the seed the
user set is kept in Python. The generator belongs to the session it was made in
(cuda_api.Generator, the ``torch.Generator`` stand-in, makes it); the dispatcher turns
the carrier back into the gateway's reference with ``wire_ref``.
"""
from __future__ import annotations

import itertools
import random
import weakref
from typing import Any

import torch

from remotecuda_wire.protocol import GeneratorRef

_MAGIC = 0x5EED << 48
_DEFAULT_MAGIC = 0x5EEF << 48  # a device's default generator (DefaultCudaGenerator)
_MASK = 0xFFFF << 48
_ids = itertools.count(1)  # ids are never reused, over all runtimes
#: id → generator, while it lives: which carriers are ours
_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
DEFAULT_SEED = 67280421310721  # what a fresh CUDA generator starts from


def seed_value(seed: Any) -> int:
    """``seed`` as torch's ``Generator.manual_seed`` keeps it (an int from -2**63 to 2**64 - 1, kept
    as an unsigned 64-bit number: ``initial_seed()`` after -1 is 2**64 - 1), else torch's own error
    at the call: one over 64 bits could not be sent to the gateway."""
    return torch._C.Generator().manual_seed(seed).initial_seed()


def state_bytes(new_state: Any) -> bytes:
    """The bytes of a generator state a program sets, checked at the call as torch checks it (a
    CPU ByteTensor): sent unchecked, a float state went as its bytes, and the gateway's refusal
    came at a later sync, as an unrelated op's error about the state's size."""
    if not isinstance(new_state, torch.Tensor):
        raise TypeError(f"expected a torch.ByteTensor, but got {type(new_state).__name__}")
    if new_state.dtype != torch.uint8 or new_state.layout != torch.strided or new_state.device.type != "cpu":
        raise TypeError("RNG state must be a torch.ByteTensor")
    return new_state.detach().contiguous().numpy().tobytes()


def _state_tensor(state: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def remade(device: torch.device) -> torch._C.Generator:
    """A pickled 'cuda' generator made again (its state follows, by ``__setstate__``): by the
    ``torch.Generator`` of the moment, on a gateway while active."""
    return torch.Generator(device)


class CudaGenerator(torch._C.Generator):
    """A generator on ``session``'s device."""

    gid: int
    index: int
    session: Any
    #: the seed the program set, in a cell that generators sharing one state share
    #: (``graphsafe_get_state``: a CUDA generator's seed is part of its state)
    seed_cell: list[int]

    def __new__(cls, session: Any, clone_of: tuple[int | None, int] | None = None) -> CudaGenerator:
        """A fresh generator, or with ``clone_of`` = (the source's id, None for the device's
        default; its initial seed) a copy of another's state on the gateway (``clone_state``)."""
        self = cls.carrier(session, [DEFAULT_SEED if clone_of is None else clone_of[1]])
        if clone_of is None:
            self._send("rc::gen_new", [self.gid, DEFAULT_SEED])
        else:
            self._send("rc::gen_clone", [self.gid, clone_of[0]])
        return self

    def __init__(self, session: Any, clone_of: tuple[int | None, int] | None = None) -> None:
        pass

    @classmethod
    def carrier(cls, session: Any, seed_cell: list[int]) -> CudaGenerator:
        """The client's object for a new gateway generator id, which the caller then makes there."""
        self = torch._C.Generator.__new__(cls, "cpu")  # type: ignore[call-arg]  # (torch's stub)
        self.gid = next(_ids)
        self.index = session.vdev
        self.session = session
        self.seed_cell = seed_cell
        torch._C.Generator.manual_seed(self, _MAGIC | self.gid)
        _live[self.gid] = self
        return self

    @classmethod
    def sharing_state(cls, session: Any, source: int | None, seed_cell: list[int]) -> CudaGenerator:
        """``graphsafe_get_state()`` of the gateway generator ``source`` (None: the device's default):
        a generator drawing from the same state, not a copy of it."""
        self = cls.carrier(session, seed_cell)
        session.request("rc::gen_graphsafe_get", [self.gid, source])
        return self

    @property
    def user_seed(self) -> int:
        return self.seed_cell[0]

    @user_seed.setter
    def user_seed(self, seed: int) -> None:
        self.seed_cell[0] = seed

    def _send(self, op: str, args: list) -> None:
        self.session.enqueue(op, args, None, None)

    def __del__(self) -> None:
        """The gateway's generator goes with it: one made per call (``generator=torch.Generator('cuda')
        .manual_seed(s)`` given to each pipeline call) stayed there, and in every snapshot, for good."""
        s = getattr(self, "session", None)
        if s is not None and not s.closed:
            s.drop_object("rc::gen_free", self.gid)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.index)

    def manual_seed(self, seed: int) -> CudaGenerator:  # type: ignore[override]
        self.user_seed = seed_value(seed)
        self._send("rc::gen_seed", [self.gid, self.user_seed])
        return self

    def initial_seed(self) -> int:  # type: ignore[override]
        return self.user_seed

    def seed(self) -> int:  # type: ignore[override]
        s = random.getrandbits(63)
        self.manual_seed(s)
        return s

    def get_state(self) -> torch.Tensor:  # type: ignore[override]
        """The gateway generator's state, a CPU uint8 tensor (as a CUDA generator's is)."""
        return _state_tensor(self.session.request("rc::gen_get", [self.gid]))

    def set_state(self, new_state: torch.Tensor) -> CudaGenerator:  # type: ignore[override]
        """A request: the gateway's generator checks the state (its size) at the call, as a GPU's
        does, and the seed a state holds is then ``initial_seed()`` (a restored generator kept
        the seed it was made with)."""
        self.user_seed = int(self.session.request("rc::gen_set", [self.gid, state_bytes(new_state)]))
        return self

    def clone_state(self) -> CudaGenerator:  # type: ignore[override]
        """A generator of its own in this one's state, as a CUDA generator's ``clone_state`` gives:
        torch's would clone the carrier, whose seed names this same gateway generator."""
        return CudaGenerator(self.session, (self.gid, self.user_seed))

    def get_offset(self) -> int:  # type: ignore[override]
        """The gateway generator's Philox offset (a CPU-served device has none: its refusal)."""
        return philox_offset(self.session, self.gid)

    def set_offset(self, offset: int) -> CudaGenerator:  # type: ignore[override]
        set_philox_offset(self.session, self.gid, offset)
        return self

    def graphsafe_get_state(self) -> CudaGenerator:  # type: ignore[override]
        return CudaGenerator.sharing_state(self.session, self.gid, self.seed_cell)

    def graphsafe_set_state(self, state: torch._C.Generator) -> CudaGenerator:  # type: ignore[override]
        self.seed_cell = share_state(self.session, self.gid, state)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        """``copy.deepcopy`` and pickle, as torch's ``(Generator, (device,), (seed, offset, state))``."""
        return remade, (self.device,), (self.user_seed, None, self.get_state())

    def __setstate__(self, state: tuple[int, int | None, torch.Tensor]) -> None:
        """The seed and state a pickled generator had (the offset is within a CUDA state)."""
        seed, _offset, new_state = state
        self.user_seed = seed_value(seed)
        self.set_state(new_state)

    def __repr__(self) -> str:
        return f"<torch.Generator device='cuda:{self.index}' (remotecuda)>"


class DefaultCudaGenerator(torch._C.Generator):
    """``torch.cuda.default_generators[i]``: the generator device ``i``'s ops draw from when given
    none, read and set through ``session_of(i)`` (its session, made when first needed) as
    ``torch.cuda.manual_seed`` and ``get_rng_state`` do. As a ``generator=`` argument it means
    that default (tensor-parallel RNG trackers fork it by its state)."""

    index: int
    session_of: Any

    def __new__(cls, index: int, session_of: Any) -> DefaultCudaGenerator:
        self = torch._C.Generator.__new__(cls, "cpu")  # type: ignore[call-arg]  # (torch's stub)
        self.index, self.session_of = index, session_of
        torch._C.Generator.manual_seed(self, _DEFAULT_MAGIC | index)
        return self

    def __init__(self, index: int, session_of: Any) -> None:
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.index)

    def manual_seed(self, seed: int) -> DefaultCudaGenerator:  # type: ignore[override]
        self.session_of(self.index).enqueue("rc::seed", [seed_value(seed)], None, None)
        return self

    def initial_seed(self) -> int:  # type: ignore[override]
        return int(self.session_of(self.index).request("rc::initial_seed", []))

    def seed(self) -> int:  # type: ignore[override]
        s = random.getrandbits(63)
        self.manual_seed(s)
        return s

    def get_state(self) -> torch.Tensor:  # type: ignore[override]
        return _state_tensor(self.session_of(self.index).request("rc::rng_get", []))

    def set_state(self, new_state: torch.Tensor) -> DefaultCudaGenerator:  # type: ignore[override]
        self.session_of(self.index).enqueue("rc::rng_set", [state_bytes(new_state)], None, None)
        return self

    def clone_state(self) -> CudaGenerator:  # type: ignore[override]
        """A generator of its own in the default's state (torch's clone of the carrier would still
        mean the default)."""
        return CudaGenerator(self.session_of(self.index), (None, self.initial_seed()))

    def get_offset(self) -> int:  # type: ignore[override]
        """``torch.cuda._get_rng_state_offset`` asks this."""
        return philox_offset(self.session_of(self.index), None)

    def set_offset(self, offset: int) -> DefaultCudaGenerator:  # type: ignore[override]
        set_philox_offset(self.session_of(self.index), None, offset)
        return self

    def graphsafe_get_state(self) -> CudaGenerator:  # type: ignore[override]
        """A generator sharing the default's state (its seed asked once: the default's is the gateway's)."""
        session = self.session_of(self.index)
        return CudaGenerator.sharing_state(session, None, [self.initial_seed()])

    def graphsafe_set_state(self, state: torch._C.Generator) -> DefaultCudaGenerator:  # type: ignore[override]
        share_state(self.session_of(self.index), None, state)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return remade, (self.device,), (self.initial_seed(), None, self.get_state())

    def __repr__(self) -> str:
        return f"<torch.Generator device='cuda:{self.index}' (remotecuda: the device's default)>"


def philox_offset(session: Any, gid: int | None) -> int:
    """Generator ``gid``'s Philox offset (None: the device's default), the gateway's answer."""
    return int(session.request("rc::gen_offset", [gid, None]))


def set_philox_offset(session: Any, gid: int | None, offset: Any) -> None:
    """Set it, as a request: the gateway's generator checks the value (a multiple of 4) and a
    CPU-served device refuses, both at the call, as a GPU's generator raises there."""
    session.request("rc::gen_offset", [gid, _unsigned(offset)])


def _unsigned(offset: Any) -> int:
    """An offset as torch's binding takes it (an unsigned 64-bit number: -4 is 2**64 - 4), with its
    errors at the call for what it refuses."""
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise RuntimeError(f"manual_offset expected a long, but got {type(offset).__name__}")
    if not -2**63 <= offset < 2**64:
        raise ValueError("Overflow when unpacking long long")
    return offset % 2**64


def share_state(session: Any, gid: int | None, state: Any) -> list[int]:
    """``graphsafe_set_state(state)`` of generator ``gid`` (None: the device's default): from now on
    it draws from ``state``'s state; the seed cell it then shares with ``state`` is returned."""
    if not on_cuda(state):
        raise RuntimeError("Expected a CUDA Generator")
    ref = wire_ref(state, session)
    session.request("rc::gen_graphsafe_set", [gid, None if ref is None else ref.id])
    return state.seed_cell if isinstance(state, CudaGenerator) else [state.initial_seed()]


def on_cuda(g: Any) -> bool:
    """Whether ``g`` (as it reaches dispatch: a plain ``torch._C.Generator``) is a 'cuda' one's carrier."""
    return isinstance(g, torch._C.Generator) and torch._C.Generator.initial_seed(g) & _MASK in (_MAGIC, _DEFAULT_MAGIC)


def wire_ref(g: torch._C.Generator, session: Any = None) -> GeneratorRef | None:
    """The gateway generator behind a generator argument of an op on ``session`` (None: the
    device's default); CPU generators are an error, as on a GPU."""
    seed = torch._C.Generator.initial_seed(g)
    if seed & _MASK == _DEFAULT_MAGIC:
        return None
    gen = _live.get(seed & ~_MASK) if seed & _MASK == _MAGIC else None
    if gen is None:
        raise RuntimeError("Expected a 'cuda' device type for generator but found 'cpu'")
    if gen.session.closed:
        raise RuntimeError("remotecuda: this cuda Generator's session is closed (remotecuda was "
                           "deactivated); make a new torch.Generator('cuda')")
    if session is not None and gen.session is not session:  # (the gateway would fail the op later, elsewhere)
        raise NotImplementedError(
            f"remotecuda: a generator of cuda:{gen.index} cannot drive an op on cuda:{session.vdev} (a device's "
            f"generators live with its session on the gateway): make it on the op's device, "
            f"torch.Generator('cuda:{session.vdev}')")
    return GeneratorRef(gen.gid)
