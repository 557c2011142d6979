"""A message's frames sent and received with fewer steps through pyzmq's Python layer.

pyzmq's ``send_multipart`` makes an enum member for every frame but the last
(``zmq.SNDMORE | flags``), and ``recv_multipart`` asks the socket option RCVMORE after every
frame, each ask looking the option up in an enum: a microsecond or two apiece, several on each
side of every round trip (a value read, benchmarks/bench_sync.py). These do the same with plain
ints, and with the received frame's own ``more`` flag; and send through pyzmq's compiled layer.

A small message is cheaper copied than not: a ``zmq.Frame`` (a receive with ``copy=False``, or a send
of one) costs several times the copy of a value read's few dozen bytes, and pyzmq copies frames under
64 KiB anyway when sending them ``copy=False``, after making a memoryview to find that out.
``recv_bytes`` takes one frame as bytes for a caller that knows from the header how many follow
(``Session._read_round_trip``, the fast read's answer).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq
import zmq.backend

_SNDMORE = int(zmq.SNDMORE)
#: the compiled ``send`` under pyzmq's Python one, whose only additions (routing_id, group) these never use:
#: ~2.7k instructions less per frame (callgrind)
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv


def send(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0, copy: bool = True, track: bool = False) -> Any:
    """``sock.send_multipart(frames, flags, copy, track)``; ``frames`` are bytes, buffers or zmq.Frames;
    ``sock`` a plain ``zmq.Socket``."""
    last = len(frames) - 1
    for i in range(last):
        _send(sock, frames[i], flags | _SNDMORE, copy, track)
    return _send(sock, frames[last], flags, copy, track)


def recv(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """``sock.recv_multipart(flags, copy=False)``: the message's frames, not copied."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames


def recv_bytes(sock: zmq.Socket, flags: int = 0) -> bytes:
    """One frame, copied into bytes (no ``zmq.Frame``: cheaper for a small one); whether more
    frames follow is the caller's to know (a message's header counts them)."""
    return _recv(sock, flags, True, False)
