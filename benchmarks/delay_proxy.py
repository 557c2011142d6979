"""A userspace TCP delay proxy on loopback: how latency is injected here (no ``tc netem``).

Listens on 127.0.0.1 and forwards every connection to 127.0.0.1:TARGET. Each chunk read
from one side is held for ``delay`` seconds and then written to the other side, in order,
in each direction: a reader thread keeps reading while earlier chunks wait (per-direction
queue of (due time, bytes); a writer thread sleeps until each chunk is due). So a round
trip through the proxy costs 2 x delay more than without it.

With ``rate`` (bytes/s) each direction is also a link of that bandwidth, shared by all the
proxy's connections, as a network is and loopback is not: a chunk leaves no sooner than the
link has finished the chunks before it (of any connection, in the order their slots were taken), and the
reader stops reading while a window's worth of bytes waits (TCP's backpressure), so a sender
sees the link's speed. Moving the bytes costs the proxy little CPU, so the time a transfer
takes here is mostly waiting, as on a real link.

As a library (in-process, threads)::

    from delay_proxy import DelayProxy
    with DelayProxy(target_port=5555, delay_ms=25) as p:   # p.port is the port to connect to
        ...
        p.delay_ms = 0          # takes effect for chunks read from now on
        p.rate = 125e6          # bytes/s each way (1 Gbit/s); None: unlimited

As a script (what benchmarks/bench_transfer.py uses, so the proxy does not share the
client's GIL)::

    python benchmarks/delay_proxy.py --target 5555 --delay-ms 25 [--rate-mbit 1000] [--port 0] [--max-seconds 600]

prints ``READY 127.0.0.1:PORT``, then reads commands on stdin, one a line: ``delay MS``
(answers ``OK MS``), ``rate MBIT`` (0: unlimited; answers ``OK MBIT``), ``quit``. It exits on ``quit``, when stdin closes (its parent is gone)
or after ``--max-seconds``. ``--selftest`` measures round trips through an echo server at
0 and 25 ms and exits.
"""
from __future__ import annotations

import argparse
import collections
import ipaddress
import socket
import sys
import threading
import time

CHUNK = 1 << 20
RATED_CHUNK = 64 << 10  # a rate-limited link moves small chunks, so its pace is smooth
WINDOW = 4 << 20  # bytes a rate-limited direction holds before its reader waits
_EOF = None


class _Pipe:
    """One direction of one connection: reader -> (due, bytes) queue -> writer."""

    def __init__(self, proxy: DelayProxy, src: socket.socket, dst: socket.socket, name: str, direction: str):
        self.proxy, self.src, self.dst, self.direction = proxy, src, dst, direction
        self.q: collections.deque = collections.deque()
        self.queued = 0  # bytes in q
        self.cv = threading.Condition()
        self.reader = threading.Thread(target=self._read, name=f"{name}-read", daemon=True)
        self.writer = threading.Thread(target=self._write, name=f"{name}-write", daemon=True)

    def start(self) -> None:
        self.reader.start()
        self.writer.start()

    def _push(self, item) -> None:
        with self.cv:
            while item is not _EOF and self.proxy.rate and self.queued >= WINDOW:
                self.cv.wait(0.1)
            self.q.append(item)
            self.queued += len(item[1]) if item is not _EOF else 0
            self.cv.notify_all()

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(RATED_CHUNK if self.proxy.rate else CHUNK)
                if not data:
                    break
                self._push((time.monotonic() + self.proxy.delay_s, data))
        except OSError:
            pass
        self._push(_EOF)

    def _write(self) -> None:
        try:
            while True:
                with self.cv:
                    while not self.q:
                        self.cv.wait()
                    item = self.q.popleft()
                    self.queued -= len(item[1]) if item is not _EOF else 0
                    self.cv.notify_all()
                if item is _EOF:
                    try:
                        self.dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                due, data = item
                if self.proxy.rate:
                    due = self.proxy.link_slot(self.direction, due, len(data))
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self.dst.sendall(data)
        except OSError:  # the other side went away: close both so the reader stops too
            self.proxy._close_pair(self.src, self.dst)


class DelayProxy:
    """TCP proxy 127.0.0.1:port -> target_host:target_port adding ``delay_ms`` each way, and
    limiting each direction to ``rate`` bytes/s when set.

    ``target_host`` may be another loopback address (127.0.0.2): a gateway bound there is
    reachable only through the proxy, as a gateway behind a tunnel is."""

    def __init__(self, target_port: int, delay_ms: float = 0.0, port: int = 0, host: str = "127.0.0.1",
                 target_host: str = "127.0.0.1", rate: float | None = None):
        if host not in ("127.0.0.1", "localhost") or not ipaddress.ip_address(target_host).is_loopback:
            raise ValueError("the delay proxy only runs on loopback")
        self.target = (target_host, int(target_port))
        self.delay_s = delay_ms / 1e3
        self.rate = rate  # bytes/s each way, or None: as fast as loopback
        self._link_free = {"up": 0.0, "down": 0.0}  # when each direction's link has sent what it was given
        self._lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind(("127.0.0.1", port))
        self._lsock.listen(16)
        self._lsock.settimeout(0.2)
        self.port = self._lsock.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.connections = 0

    @property
    def delay_ms(self) -> float:
        return self.delay_s * 1e3

    @delay_ms.setter
    def delay_ms(self, ms: float) -> None:
        self.delay_s = float(ms) / 1e3

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> DelayProxy:
        self._thread = threading.Thread(target=self._accept_loop, name="delay-proxy", daemon=True)
        self._thread.start()
        return self

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                u = socket.create_connection(self.target, timeout=5)
                u.settimeout(None)
            except OSError:
                c.close()
                continue
            for s in (c, u):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks += [c, u]
            self.connections += 1
            n = self.connections
            _Pipe(self, c, u, f"proxy{n}-up", "up").start()
            _Pipe(self, u, c, f"proxy{n}-down", "down").start()

    def link_slot(self, direction: str, due: float, nbytes: int) -> float:
        """When a chunk due at ``due`` has crossed the link, so may leave: the link first sends
        the chunks before it, then this one's bytes at its rate (leaving at the start of its slot
        would deliver each transfer's last chunk early, beating the link)."""
        with self._lock:
            done = max(due, self._link_free[direction]) + nbytes / self.rate
            self._link_free[direction] = done
            return done

    def _close_pair(self, *socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def stop(self) -> None:
        self._stop.set()
        try:
            self._lsock.close()
        except OSError:
            pass
        with self._lock:
            socks, self._socks = self._socks, []
        self._close_pair(*socks)
        if self._thread is not None:
            self._thread.join(timeout=2)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------- script

def echo_server() -> socket.socket:
    """A one-connection TCP echo server on 127.0.0.1 (in a thread): what the proxy's own delay is measured against."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def echo() -> None:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            d = conn.recv(65536)
            if not d:
                conn.close()
                return
            conn.sendall(d)

    threading.Thread(target=echo, daemon=True).start()
    return srv


def round_trips(conn: socket.socket, n: int) -> list[float]:
    """Seconds for n round trips of a 64-byte message on a connection to an echo server."""
    rtts = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.sendall(b"x" * 64)
        got = 0
        while got < 64:
            got += len(conn.recv(64 - got))
        rtts.append(time.perf_counter() - t0)
    return rtts


def echo_seconds(conn: socket.socket, nbytes: int) -> float:
    """Seconds to send nbytes to an echo server and read them all back (sending and reading overlap)."""
    t0 = time.perf_counter()
    sender = threading.Thread(target=conn.sendall, args=(b"x" * nbytes,))
    sender.start()
    got = 0
    while got < nbytes:
        got += len(conn.recv(min(1 << 20, nbytes - got)))
    sender.join()
    return time.perf_counter() - t0


def _selftest() -> None:
    """Round trip of a 64-byte message through an echo server, direct and via the proxy; then
    the time to echo 4 MB through a rate-limited proxy."""
    srv = echo_server()
    with DelayProxy(srv.getsockname()[1]) as p:
        c = socket.create_connection(("127.0.0.1", p.port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for ms in (0, 25, 5):
            p.delay_ms = ms
            rtts = round_trips(c, 10)
            print(f"delay {ms:5.1f} ms each way: round trip min {min(rtts) * 1e3:.2f} ms, "
                  f"max {max(rtts) * 1e3:.2f} ms (expected {2 * ms:.1f} ms + loopback)")
        p.delay_ms = 0
        for mbit in (None, 400):
            p.rate = mbit * 1e6 / 8 if mbit else None
            dt = echo_seconds(c, 4 << 20)
            print(f"rate {mbit or 'unlimited'} Mbit/s: 4 MB echoed in {dt * 1e3:.1f} ms "
                  f"({(4 << 20) * 8 / dt / 1e6:.0f} Mbit/s)")
        c.close()
    srv.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=int, help="port to forward to")
    ap.add_argument("--target-host", default="127.0.0.1", help="loopback address to forward to")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="delay added in each direction")
    ap.add_argument("--rate-mbit", type=float, default=0.0, help="link rate each way in Mbit/s (0: unlimited)")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")
    ap.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long (0: never)")
    ap.add_argument("--selftest", action="store_true")
    a = ap.parse_args()
    if a.selftest:
        _selftest()
        return
    if a.target is None:
        ap.error("--target is required")
    p = DelayProxy(a.target, a.delay_ms, a.port, target_host=a.target_host,
                   rate=a.rate_mbit * 1e6 / 8 or None).start()
    print(f"READY {p.address}", flush=True)
    done = threading.Event()

    def commands() -> None:
        for line in sys.stdin:
            parts = line.split()
            if parts[:1] == ["delay"] and len(parts) == 2:
                p.delay_ms = float(parts[1])
                print(f"OK {p.delay_ms:g}", flush=True)
            elif parts[:1] == ["rate"] and len(parts) == 2:
                p.rate = float(parts[1]) * 1e6 / 8 or None
                print(f"OK {parts[1]}", flush=True)
            elif parts[:1] == ["quit"]:
                break
            elif parts:
                print(f"ERR unknown command {line.strip()!r}", flush=True)
        done.set()

    threading.Thread(target=commands, daemon=True).start()
    done.wait(a.max_seconds if a.max_seconds > 0 else None)
    p.stop()


if __name__ == "__main__":
    main()
