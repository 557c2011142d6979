"""The TCP connections behind a ROUTER socket, so that idle or unauthenticated ones can be closed.

ZeroMQ hides connections: a ROUTER knows peers by routing identity and never closes one.
A peer that connects and says nothing holds a file descriptor for good (some hundred such
exhausted the supervisor's descriptors), and one that sends a multipart message it never
finishes holds the frames in memory (ZeroMQ's high-water mark counts whole messages). This
module watches the socket's monitor (an ACCEPTED event names each new connection's file
descriptor, DISCONNECTED its end) and each message's ``SRCFD`` (the descriptor it came on),
so a connection is known by descriptor and identity; ``expire`` shuts down, at the TCP level,
connections that were never trusted within ``timeout`` of being accepted, and trusted ones
that no longer serve a session and were silent for ``timeout``. ZeroMQ sees the shutdown as
the peer leaving and frees what the connection held (unfinished messages included).
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import zmq
from zmq.utils.monitor import recv_monitor_message

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # (plain ints: an enum's ``&`` makes a new member)


@dataclass
class Conn:
    accepted: float = field(default_factory=time.monotonic)
    ident: bytes | None = None
    trusted: bool = False  # it sent a message that passed every check (with a token: authenticated)
    last: float = field(default_factory=time.monotonic)  # its last trusted message
    shut: bool = False
    announced: bool = False  # its ACCEPTED event was read (a message may come first)
    #: it took the fd of a connection whose DISCONNECTED was not read yet: that one is not its own.
    #: libzmq sends it before closing the fd, so the next reading of the monitor finds it (or it
    #: was dropped, the monitor's queue being full: the flag goes then too)
    follows: bool = False


class Connections:
    def __init__(self, sock: zmq.Socket, timeout: float):
        self.timeout = timeout
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.by_fd: dict[int, Conn] = {}
        self.fd_of: dict[bytes, int] = {}
        self.shut_count = 0  # connections this side closed
        self.closed = 0  # connections that ended since the owner last looked (it resets this)
        #: fds whose connection follows one whose DISCONNECTED is still to be read (``Conn.follows``)
        self.following: set[int] = set()

    def events(self) -> list[bytes]:
        """Take the monitor's news; the identities whose connection has ended."""
        gone: list[bytes] = []
        # (asked before each read: a read that finds nothing raises, which costs more, on every message)
        while cast(int, self.monitor.getsockopt(_EVENTS)) & _POLLIN:
            ev = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                c = self.by_fd.get(fd)
                if c is not None and not c.announced:  # its first message was read before this news
                    c.announced = True
                else:
                    self.by_fd[fd] = Conn(announced=True)
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                self.closed += 1
                c = self.by_fd.get(fd)
                if c is not None and c.follows:  # the end of the connection this one took the fd from
                    c.follows = False
                    continue
                self.by_fd.pop(fd, None)
                if c is not None and c.ident is not None:
                    if self.fd_of.get(c.ident) == fd:
                        del self.fd_of[c.ident]
                    gone.append(c.ident)
        for fd in self.following:  # (every event sent is read by now: one not seen was dropped)
            if fd in self.by_fd:
                self.by_fd[fd].follows = False
        self.following.clear()
        return gone

    def seen(self, frame: zmq.Frame, ident: bytes, trusted: bool) -> None:
        """A message from ``ident`` (its first frame), and whether it passed every check."""
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            return
        c = self.by_fd.get(fd)
        if c is None or (c.ident is not None and c.ident != ident):  # (news of it not read yet, or a reused fd)
            follows = c is not None  # the fd's old connection ended; its DISCONNECTED is still to come
            if c is not None and c.ident is not None and self.fd_of.get(c.ident) == fd:
                del self.fd_of[c.ident]
            c = self.by_fd[fd] = Conn(follows=follows)
            if follows:
                self.following.add(fd)
        if c.ident is None:
            c.ident = ident
            self.fd_of[ident] = fd
        if trusted:
            c.trusted = True
            c.last = time.monotonic()

    def expire(self, in_use: Callable[[bytes], bool]) -> None:
        """Shut connections never trusted within ``timeout`` of their start, and trusted ones that
        serve no session (``in_use``) and were silent for ``timeout``."""
        now = time.monotonic()
        for fd, c in list(self.by_fd.items()):
            if c.shut or c.ident is not None and in_use(c.ident):
                continue
            if now - (c.last if c.trusted else c.accepted) > self.timeout:
                self._shut(fd, c)

    def close(self, ident: bytes) -> None:
        """Shut the connection that carries ``ident`` (a session that ended for cause)."""
        fd = self.fd_of.get(ident)
        c = self.by_fd.get(fd) if fd is not None else None
        if fd is not None and c is not None and not c.shut:
            self._shut(fd, c)

    def _shut(self, fd: int, c: Conn) -> None:
        c.shut = True
        self.shut_count += 1
        try:  # shut down the socket ZeroMQ holds (ZeroMQ then closes it), borrowed, not duplicated:
            s = socket.socket(fileno=fd)  # a duplicate needs a free descriptor, which may be none left
        except OSError:
            return
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.detach()  # (the descriptor stays ZeroMQ's)

    def stop(self) -> None:
        self.monitor.close(linger=0)
