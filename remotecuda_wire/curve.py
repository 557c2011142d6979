"""CurveZMQ (optional): every connection to a gateway encrypted, and only known clients admitted.

A gateway started with ``--curve-secret FILE`` (its key pair) and ``--curve-clients DIR`` (the
public keys of the clients it admits) makes every socket it and its workers bind a CURVE server:
the front port, each worker's data port (which also serves other workers' cross-GPU pulls). A
CURVE server alone encrypts but admits any client key, so each process (the supervisor, every
worker: one ZeroMQ context each) runs a ZAP handler that admits only the keys in ``DIR`` (read
again at each handshake, so a key added there is admitted without a restart) and the gateway's
own key (its workers pull from each other with it).

Key files are zmq.auth's certificate format (``remotecuda keys NAME DIR`` writes ``NAME.key``,
the public key to hand out, and ``NAME.key_secret``, mode 0600). A client sets
``REMOTECUDA_CURVE_SECRET`` (its ``.key_secret``) and names the gateway's public key:
``REMOTECUDA_CURVE_SERVER`` (a ``.key`` file, or the 40-character key itself) for every
gateway, or per gateway where servers are named (``REMOTECUDA_SERVERS``, ``--server``,
``activate``) as ``host:port@KEYFILE``; with the token, a gateway's signed beacon gives its key.

ZeroMQ reports a failed CURVE handshake to nobody: the connection just closes and retries.
``watch`` and ``handshake_failure`` turn a socket monitor's HANDSHAKE_FAILED_* events into a
message the client raises (docs/SECURITY.md says what CURVE and the token each protect).
"""
from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SECRET_ENV = "REMOTECUDA_CURVE_SECRET"
SERVER_ENV = "REMOTECUDA_CURVE_SERVER"
#: the ZAP domain every remotecuda CURVE server names
DOMAIN = b"remotecuda"
#: a socket monitor's events that end a handshake
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_DISCONNECTED)


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes


def available() -> bool:
    return bool(zmq.has("curve"))


def make_keys(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """A new key pair as ``NAME.key`` (public) and ``NAME.key_secret`` (0600, created so)."""
    if not available():
        raise RuntimeError("this libzmq was built without CURVE (zmq.has('curve') is False)")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = d / f"{name}.key", d / f"{name}.key_secret"
    for p in (public, secret):
        if p.exists():
            raise FileExistsError(f"{p} exists (remove it first: a key pair is not overwritten)")
    old = os.umask(0o077)  # the secret file is never readable by others, not even for a moment
    try:
        zmq.auth.create_certificates(str(d), name)
    finally:
        os.umask(old)
    public.chmod(0o644)
    return public, secret


def load_keypair(path: str | os.PathLike) -> KeyPair:
    """A key pair from a ``.key_secret`` file; ValueError if it holds no secret key or others may read it."""
    p = Path(path)
    if p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{p}: a CURVE secret key file must be private (chmod 600 {p})")
    public, secret = zmq.auth.load_certificate(str(p))
    if secret is None:
        raise ValueError(f"{p} holds no secret key (give the .key_secret file of `remotecuda keys`)")
    return KeyPair(public, secret)


def load_public(spec: str) -> bytes:
    """A public key: the 40 Z85 characters themselves, or a key file holding it."""
    if len(spec) == 40 and not os.path.exists(spec):
        try:
            zmq.utils.z85.decode(spec)
            return spec.encode()
        except ValueError:
            pass
    return zmq.auth.load_certificate(spec)[0]


def _known_keys(directory: Path) -> set[bytes]:
    keys = set()
    for f in directory.glob("*.key"):
        try:
            keys.add(zmq.auth.load_certificate(str(f))[0])
        except (OSError, ValueError):
            continue  # (not a key file)
    return keys


class Server:
    """One process's CURVE server side: its key pair, and the ZAP handler (in ``ctx``) that
    admits only known client keys. ``secure`` makes a socket a CURVE server; call it before bind."""

    def __init__(self, ctx: zmq.Context, keys: KeyPair, clients: str | os.PathLike):
        self.keys = keys
        self.clients = Path(clients)
        if not self.clients.is_dir():
            raise ValueError(f"--curve-clients {clients}: not a directory of client public keys (.key files)")
        self.denied = 0
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve_callback(domain=DOMAIN.decode(), credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP handler's question: may this (Z85) client key connect?"""
        ok = key == self.keys.public or key in _known_keys(self.clients)
        self.denied += not ok
        return ok

    def secure(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)

    def stop(self) -> None:
        self.auth.stop()


def secure_client(sock: zmq.Socket, keys: KeyPair, server: bytes) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is ``server`` (before connect)."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, server)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


# ---------------------------------------------------------------------- the client's configuration
_PAIRS: dict[str, KeyPair] = {}


def client_keys(environ: Mapping[str, str] = os.environ) -> KeyPair | None:
    """The client's key pair (``REMOTECUDA_CURVE_SECRET``), or None: no CURVE."""
    path = environ.get(SECRET_ENV)
    if not path:
        return None
    if path not in _PAIRS:
        _PAIRS[path] = load_keypair(path)
    return _PAIRS[path]


def split_server(entry: str) -> tuple[str, str | None]:
    """A ``REMOTECUDA_SERVERS`` entry as its address and the gateway's public key spec (``@KEY``), if any."""
    address, _, key = entry.partition("@")
    return address.strip(), key.strip() or None


def _host_port(endpoint: str) -> str:
    return endpoint.strip().removeprefix("tcp://")


def server_key(endpoint: str, environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The public key of the gateway at ``endpoint`` (its front port): its own in
    ``REMOTECUDA_SERVERS`` or in a server list the program gave (``name``), else
    ``REMOTECUDA_CURVE_SERVER``, else one a signed beacon gave."""
    for entry in environ.get("REMOTECUDA_SERVERS", "").split(","):
        address, key = split_server(entry)
        if key and _host_port(address) == _host_port(endpoint):
            return load_public(key)
    if _host_port(endpoint) in _NAMED:
        return _NAMED[_host_port(endpoint)]
    spec = environ.get(SERVER_ENV)
    if spec:
        return load_public(spec)
    return _ANNOUNCED.get(_host_port(endpoint))


#: gateways' public keys named with their addresses (``HOST:PORT@KEY`` given to activate, --server),
#: and from token-signed beacons (discovery.py), by HOST:PORT
_NAMED: dict[str, bytes] = {}
_ANNOUNCED: dict[str, bytes] = {}


def name(address: str, spec: str) -> None:
    """Remember the key a server list gives for ``address`` (``HOST:PORT@KEY``); ValueError at
    once if ``spec`` is no key."""
    try:
        _NAMED[_host_port(address)] = load_public(spec)
    except (OSError, ValueError) as e:
        raise ValueError(f"{address}@{spec}: not a CURVE public key or key file ({e})") from None


def pin(endpoint: str, key: Any) -> None:
    """Remember the key a signed beacon gave for ``endpoint`` (a token holder's proof of origin)."""
    if isinstance(key, str) and len(key) == 40:
        _ANNOUNCED[_host_port(endpoint)] = key.encode()


_watches = itertools.count()


def watch(sock: zmq.Socket) -> zmq.Socket:
    """A monitor of ``sock``'s handshakes (its own inproc address each time: a socket watched
    again soon after ``unwatch`` would find pyzmq's fixed one still bound)."""
    addr = f"inproc://remotecuda-handshake-{os.getpid()}-{next(_watches)}"
    sock.monitor(addr, HANDSHAKE_EVENTS)
    mon = sock.context.socket(zmq.PAIR)
    mon.connect(addr)
    return mon


def unwatch(sock: zmq.Socket, mon: zmq.Socket) -> None:
    sock.disable_monitor()
    mon.close(linger=0)


def handshake_failure(event: int, curve: bool) -> str | None:
    """What a socket monitor's event says about a handshake that failed; None for the others."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return ("the gateway refused this client's CURVE key (it is not among the gateway's "
                "--curve-clients keys)")
    if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        return ("the security handshake failed: " + (
            "the gateway's public key is not the one this client names, or it does not use CURVE"
            if curve else "the gateway uses CURVE encryption (set REMOTECUDA_CURVE_SECRET and the "
                          "gateway's public key: docs/SECURITY.md)"))
    return None
