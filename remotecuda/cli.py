"""The ``remotecuda`` command: ``start`` a gateway, ``run`` a script with interception on, list ``servers``,
make a ``token`` or CURVE ``keys``."""
from __future__ import annotations

import argparse
import atexit
import builtins
import importlib.machinery
import io
import os
import runpy
import signal
import sys
import types
import warnings
import zipfile
from collections.abc import Callable
from typing import Any

from remotecuda_wire.limits import CACHE_BYTES, MAX_QUEUED

from . import __version__, children


def _is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (127.0.0.0/8, ::1)."""
    import ipaddress
    import socket
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def _port(text: str) -> int:
    """A TCP port for ``--port``: 0 (a free one) to 65535; ZeroMQ would take others and wrap them."""
    port: int = _number(int)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535 (0: a free one), got {text}")
    return port


def _number(kind: type[int] | type[float], least: float = 0, above: bool = False) -> Callable[[str], Any]:
    """An argparse type: ``kind`` of ``text``, at least ``least`` (``above`` it), else a usage error (exit 2)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'a whole' if kind is int else 'a'} number, got {text!r}") \
                from None
        if not (value > least if above else value >= least):  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be {'more than' if above else 'at least'} {least:g}, got {text}")
        return value
    return parse


def _ipv4(text: str) -> str:
    """``--discovery-iface``: an interface's IPv4 address (what IP_MULTICAST_IF takes)."""
    import ipaddress
    try:
        return str(ipaddress.IPv4Address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"the interface's IPv4 address, e.g. 10.0.0.5, got {text!r}") from None


def _gateway_token(a: argparse.Namespace) -> tuple[bytes | None, str | None]:
    """The gateway's token, or None; and why the gateway must not start, or None."""
    from remotecuda_wire import auth
    try:
        token = auth.read_token(a.token, a.token_file)
    except (OSError, ValueError) as e:
        return None, f"remotecuda start: {e}"
    if token is None and not a.insecure and not a.curve_clients and not _is_loopback(a.host):
        return None, (f"remotecuda start: --host {a.host} is reachable from other machines, and no token is set: "
                      "anyone who reaches the port could run code on this machine's GPUs. Give a token "
                      "(--token-file FILE, REMOTECUDA_TOKEN or REMOTECUDA_TOKEN_FILE; make one with "
                      "`remotecuda token`) or CURVE keys (--curve-secret, --curve-clients), or --insecure "
                      "on a network you trust entirely.")
    return token, None


def _admin_token(a: argparse.Namespace, token: bytes | None) -> tuple[bytes | None, str | None]:
    """The admin token (remotecuda_wire/admin.py), or None; and why the gateway must not start, or None."""
    from remotecuda_wire.admin import read_admin_token
    try:
        admin = read_admin_token(a.admin_token, a.admin_token_file)
    except (OSError, ValueError) as e:
        return None, f"remotecuda start: admin token: {e}"
    if admin is not None and token is None:
        return None, ("remotecuda start: an admin token needs a session token (--token-file): a gateway "
                      "without one shows its STATUS to anyone")
    if admin is not None and admin == token:
        return None, "remotecuda start: the admin token must differ from the session token"
    return admin, None


def _keys(a: argparse.Namespace) -> int:
    """``remotecuda keys NAME DIR``: a new CURVE key pair (remotecuda_wire/curve.py)."""
    from remotecuda_wire import curve
    try:
        public, secret = curve.make_keys(a.dir, a.name)
    except (OSError, RuntimeError) as e:
        print(f"remotecuda keys: {e}", file=sys.stderr)
        return 2
    print(f"public key: {public} ({curve.load_public(str(public)).decode()})\nsecret key pair: {secret} (mode 0600)")
    return 0


def _start(a: argparse.Namespace, argv: list[str]) -> int:
    children.untell_run(os.environ)  # started under `remotecuda run`: it serves 'cuda', its workers too
    token, refusal = _gateway_token(a)
    admin = None
    if not refusal:
        admin, refusal = _admin_token(a, token)
    if refusal:
        print(refusal, file=sys.stderr, flush=True)
        return 2
    from remotecuda_server.gateway import worker_env
    env = worker_env()
    if env.get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES") and sys.platform.startswith("linux"):
        # malloc reads its tunables at process start: restart once with huge pages for the large
        # receive buffers (same pid, same stdout), as the session workers get them
        os.execve(sys.executable, [sys.executable, "-m", "remotecuda", *argv], env)
    import zmq

    from remotecuda_server.devices import detect, parse_size
    try:
        session_memory = parse_size(a.session_memory) if a.session_memory is not None else None
    except ValueError as e:
        raise SystemExit(f"remotecuda start: --session-memory: {e}") from None
    from remotecuda_server.gateway import VERSION, Gateway, raise_open_file_limit
    if not _is_loopback(a.host):
        if token is None and not a.curve_clients:
            print(f"remotecuda start: WARNING: --insecure: serving {a.host} without authentication or "
                  "encryption; anyone who reaches the port runs code here", file=sys.stderr, flush=True)
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            print("remotecuda start: WARNING: running as root off loopback; a gateway needs no privileges "
                  "(run it as an unprivileged user)", file=sys.stderr, flush=True)
    raise_open_file_limit()
    try:
        devices, note = detect(a.device, a.gpus, a.gpu_memory, a.gpu_name, a.gpu_capability)
        gw = Gateway(devices, host=a.host, port=a.port, spare=a.spare, session_timeout=a.session_timeout,
                     cache_bytes=a.cache_bytes, direct=not a.no_direct, discovery=not a.no_discovery,
                     advertise=a.advertise, discovery_iface=a.discovery_iface, token=token,
                     max_sessions=a.max_sessions, max_sessions_per_peer=a.max_sessions_per_peer,
                     idle_timeout=a.idle_timeout, admin_token=admin, max_queued=a.max_queued,
                     session_memory=session_memory,
                     curve_secret=a.curve_secret, curve_clients=a.curve_clients)
    except (OSError, ValueError) as e:
        raise SystemExit(f"remotecuda start: {e}") from None
    except zmq.ZMQError as e:  # the port is taken, or --host is no address of this machine
        raise SystemExit(f"remotecuda start: cannot listen on tcp://{a.host}:{a.port}: {e.strerror} "
                         "(another gateway there? pick another --port, or --port 0 for a free one; "
                         "--host must be an address of this machine)") from None

    def stop(*_: object) -> None:
        gw.running = False
    # before the banner: a Ctrl-C as soon as "ready" shows stops the gateway cleanly (it was a
    # KeyboardInterrupt traceback through the banner's print, the gateway not shut down)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        if not a.quiet:
            print(f"RemoteCUDA gateway {VERSION}: {note}", flush=True)
            for d in devices:
                facts = f", capability {d.capability[0]}.{d.capability[1]}" if d.kind == "cuda" or d.simulated else ""
                print(f"  device {d.index}: {d.name}, {d.total_memory / 2**30:.1f} GiB{facts}"
                      + (" (simulated)" if d.simulated else ""), flush=True)
            where = gw.announcer.describe() if gw.announcer is not None else "off (--no-discovery)"
            print(f"  listening on tcp://{gw.host}:{gw.port}; discovery: {where}", flush=True)
            print("  authentication: " + ("token (every message sealed)" if token is not None else "none")
                  + ("; STATUS rows to the admin token only" if admin is not None else ""), flush=True)
            print("  encryption: " + (f"CURVE, public key {gw.curve.keys.public.decode()}, clients admitted from "
                                      f"{a.curve_clients}" if gw.curve is not None else "none"), flush=True)
            print("  status: ready (Ctrl-C to stop)", flush=True)
        print(f"READY tcp://{gw.host}:{gw.port}", flush=True)
        gw.serve()
    finally:
        gw.shutdown()
    return 0


def _servers(a: argparse.Namespace) -> int:
    """``remotecuda servers``: what discovery finds in ``--wait`` seconds, as a table or JSON; 1 when nothing."""
    import json
    import time

    from .discovery import Discovery, MulticastSource, ServerListSource, servers_from_env, source_from_env, table
    try:
        source = source_from_env(servers_from_env(a.server))
    except (OSError, ValueError) as e:  # a malformed --server / REMOTECUDA_SERVERS / _DISCOVERY, a token file
        print(f"remotecuda servers: {str(e).removeprefix('remotecuda: ')}", file=sys.stderr)
        return 2
    with Discovery(source) as d:
        if isinstance(source, ServerListSource):  # every named one answered: no need to wait longer
            found = d.wait(len(source.endpoints), a.wait)
        else:
            time.sleep(a.wait)
            found = d.snapshot()
    where = source.describe()
    if a.json:
        print(json.dumps([g.as_dict() for g in found], indent=2, default=repr))
    elif found:
        print(f"{len(found)} RemoteCUDA gateway{'s' if len(found) != 1 else ''} found via {where}:\n")
        print(table(found))
    if found:
        return 0
    if isinstance(source, MulticastSource):
        hints = ("  - start a gateway: `remotecuda start` on a GPU machine (it announces itself unless\n"
                 "    --no-discovery)\n"
                 f"  - the firewall must let multicast UDP to port {source.port} in, and beacons reach one subnet\n"
                 "    only: elsewhere, name the gateways (--server HOST:PORT or REMOTECUDA_SERVERS)\n"
                 "  - on a machine with several networks, pick the interface: REMOTECUDA_DISCOVERY_IFACE=IP")
    else:
        hints = ("  - is the gateway running there? `remotecuda start --host 0.0.0.0 --token-file FILE` on the GPU\n"
                 "    machine (and REMOTECUDA_TOKEN_FILE=FILE here)\n"
                 "  - the firewall must let TCP to its port through")
    print(f"remotecuda: no gateway found via {where} within {a.wait:g} s.\n{hints}", file=sys.stderr)
    return 1


USAGE = ("usage: remotecuda run [--server HOST:PORT] [--trace FILE.json] "
         "python [-u -O -W ARG -X OPT ...] (SCRIPT.py | -m MODULE | -c CODE | -) [ARGS...]\n"
         "       remotecuda run [--server HOST:PORT] COMMAND [ARGS...]  (torchrun, accelerate launch, ...)")

# interpreter options that keep `python OPTIONS -m remotecuda run ...` running the program as
# `python OPTIONS ...` would (not -S: without site, neither torch nor remotecuda imports)
_FLAGS, _WITH_ARG = set("bBdEIOPqsuv"), set("WX")


def _split_options(rest: list[str]) -> tuple[list[str], list[str]] | None:
    """``python``'s own options (``-u``, ``-O``, ``-W ARG``, ``-X OPT``, grouped as in ``-uO``) and the
    program (``SCRIPT.py ...``, ``-m MODULE ...`` or ``-c CODE ...``); None for an option not kept."""
    i = 0
    while i < len(rest) and rest[i].startswith("-") and rest[i] not in ("-m", "-c", "-", "--"):
        arg = rest[i][1:]
        for k, ch in enumerate(arg):
            if ch in _WITH_ARG:
                if k + 1 == len(arg):  # its argument is the next one
                    i += 1
                break
            if ch not in _FLAGS:
                return None
        i += 1
    return rest[:i], rest[i:]


def _command_mistake(cmd: list[str], is_python: bool, split: tuple[list[str], list[str]] | None) -> str | None:
    """What is wrong with ``remotecuda run``'s command, said after its usage line; None when nothing."""
    if not cmd:
        return "no command given"
    if not is_python:
        return None
    if split is None:
        return "an option of python it cannot keep (it keeps -b -B -d -E -I -O -P -q -s -u -v -W ARG -X OPT)"
    rest = split[1]
    if not rest:
        return "no program given"
    if rest[0] in ("-m", "-c") and len(rest) < 2:
        return f"{rest[0]} needs an argument"
    if rest[0].startswith("-") and rest[0] not in ("-m", "-c", "-"):
        return f"unknown option {rest[0]}"
    return None


def _run(a: argparse.Namespace) -> int:
    """``python ...`` with interception on: the program sees what ``python`` would show it
    (sys.argv, sys.path[0], ``__main__`` and its ``__file__``/``__spec__``), prints an uncaught
    exception as Python does (without the runtime's frames) and exits with Python's code."""
    cmd = list(a.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    is_python = bool(cmd) and (os.path.basename(cmd[0]).rstrip("0123456789.") in ("python", "python3")
                         or cmd[0] == sys.executable)
    split = _split_options(cmd[1:]) if is_python else None
    options, rest = split or ([], [])
    reason = _command_mistake(cmd, is_python, split)
    if reason is None and not is_python and a.trace:
        reason = f"--trace records a python program run by remotecuda run itself; {cmd[0]!r} is not python"
    if reason is not None:  # (said as argparse says a usage error)
        print(f"{USAGE}\nremotecuda run: error: {reason}", file=sys.stderr)
        return 2
    if not is_python:
        return _launch(a, cmd)
    if options:  # they act at the interpreter's start: start one with them, running this command
        again = [f"--server={a.server}"] * (a.server is not None) + [f"--trace={a.trace}"] * (a.trace is not None)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *options, "-m", "remotecuda", "run", *again, "python", *rest])
    if a.trace and not _writable(a.trace):  # known before the program runs, not after
        print(f"remotecuda run: --trace {a.trace}: cannot write there (no such directory, or not writable)",
              file=sys.stderr)
        return 2
    atexit.register(_exit_by_sigint)  # first registered, so it runs last, as Python's own does
    if a.server is not None:  # the processes the program starts find the same gateways (activate() there)
        os.environ["REMOTECUDA_SERVERS"] = a.server
    import remotecuda
    from remotecuda.errors import hide_runtime_frames
    with warnings.catch_warnings(record=True) as said:  # the program has no activate() line to name
        try:
            remotecuda.activate(a.server)
        except (OSError, ValueError) as e:  # a malformed setting: no program line to show
            print(f"remotecuda run: {str(e).removeprefix('remotecuda: ')}", file=sys.stderr)
            return 2
        except remotecuda.GatewayUnavailableError as e:  # REMOTECUDA_FALLBACK=error, or a refused token
            print(f"remotecuda run: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    for w in said:
        print(w.message, file=sys.stderr, flush=True)
    if a.trace:
        remotecuda.trace.start()
    code = 0
    try:
        try:
            _execute(rest)
        except SystemExit as e:  # `sys.exit(main())`: its work too is waited for below
            code = _exit_code(e.code)
        except BaseException as e:  # noqa: BLE001 - printed as Python prints an uncaught one
            sys.excepthook(type(e), e, hide_runtime_frames(e).__traceback__)
            if isinstance(e, KeyboardInterrupt):
                _INTERRUPTED.append(True)
            return 1
        try:  # the program's remote work is done before it ends, and an error in it is shown
            remotecuda.synchronize()
        except Exception as e:  # (the runtime's frames only: none shown)
            sys.excepthook(type(e), e.with_traceback(None), None)
            return code or 1
        return code
    finally:
        if a.trace:
            _save_trace(a.trace)


def _launch(a: argparse.Namespace, cmd: list[str]) -> int:
    """``remotecuda run COMMAND ...`` for a command that is not python (``torchrun``, ``accelerate
    launch``, a shell script): it runs in place of this process, and every Python process it starts
    is activated (children.tell_run); the command itself uses no 'cuda'."""
    if a.server is not None:
        os.environ["REMOTECUDA_SERVERS"] = a.server
    import remotecuda
    try:  # a malformed setting is said once, here, not by each worker's `import torch`
        remotecuda._settings()
    except (OSError, ValueError) as e:
        print(f"remotecuda run: {str(e).removeprefix('remotecuda: ')}", file=sys.stderr)
        return 2
    children.tell_run(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:  # as a shell says it: 127 not found, 126 found but not runnable
        print(f"remotecuda run: {cmd[0]}: {e.strerror}", file=sys.stderr)
        return 127 if isinstance(e, FileNotFoundError) else 126


def _writable(path: str) -> bool:
    """Whether a file can be written at ``path`` (its directory exists and takes files)."""
    if os.path.isdir(path):
        return False
    if os.path.exists(path):
        return os.access(path, os.W_OK)
    folder = os.path.dirname(os.path.abspath(path))
    return os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)


def _save_trace(path: str) -> None:
    """Write the trace of ``remotecuda run --trace``, whatever the program's end (its work is done or
    failed by now: a remote error is not raised twice)."""
    import remotecuda
    tracer = remotecuda.trace.current()
    if tracer is None:
        print(f"remotecuda: no trace written to {path}: the program deactivated remotecuda", file=sys.stderr)
        return
    try:
        tracer.stop()
    except Exception:  # noqa: BLE001 - the program's error is shown already; the trace is still written
        pass
    try:
        tracer.save(path)
    except OSError as e:
        print(f"remotecuda: could not write the trace to {path}: {e}", file=sys.stderr)
        return
    print(f"remotecuda: trace written to {path} (open it in https://ui.perfetto.dev or chrome://tracing)",
          file=sys.stderr)


def _execute(rest: list[str]) -> None:
    """Run ``python`` + ``rest`` in this process, in a fresh ``__main__`` set up as the
    interpreter sets it up (pickling what the program defines finds it there)."""
    if rest[0] == "-m":
        sys.argv = ["-m", *rest[2:]]  # runpy replaces "-m" by the module's path
        _path0(os.getcwd())
        _main_module()
        runpy._run_module_as_main(rest[1], alter_argv=True)  # what `python -m` itself runs
    elif rest[0] in ("-c", "-"):  # the code given, or the program read from stdin (`python -`)
        sys.argv = [rest[0], *rest[2 if rest[0] == "-c" else 1:]]
        _path0("")
        source, name = (rest[1], "<string>") if rest[0] == "-c" else (sys.stdin.read(), "<stdin>")
        exec(compile(source, name, "exec", dont_inherit=True), _main_module().__dict__)
    else:
        sys.argv = list(rest)
        if os.path.isdir(rest[0]) or zipfile.is_zipfile(rest[0]):  # runs its __main__.py
            if sys.flags.safe_path:  # there too, as Python does
                sys.path.insert(0, rest[0])
            else:
                sys.path[0] = rest[0]
            _main_module()
            runpy._run_module_as_main("__main__", alter_argv=False)
            return
        _path0(os.path.dirname(os.path.realpath(rest[0])))
        path = os.path.join(os.getcwd(), rest[0])  # absolute, not normalised: Python's __file__
        try:
            with io.open_code(path) as f:
                source = f.read()
        except OSError as e:
            print(f"{sys.executable}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}", file=sys.stderr)
            raise SystemExit(2) from None
        try:
            code = compile(source, path, "exec", dont_inherit=True)
        except SyntaxError as e:  # shown as Python shows it: the line, no traceback
            sys.excepthook(type(e), e.with_traceback(None), None)
            raise SystemExit(1) from None
        module = _main_module(__file__=path, __cached__=None,
                              __loader__=importlib.machinery.SourceFileLoader("__main__", path))
        exec(code, module.__dict__)


def _path0(entry: str) -> None:
    """Put the program's directory first on sys.path, as ``python`` does; under ``-P``/``-I`` Python
    puts none there (and sys.path[0] is then a real entry, kept)."""
    if not sys.flags.safe_path:
        sys.path[0] = entry


def _main_module(**attrs: object) -> types.ModuleType:
    """A new ``sys.modules['__main__']`` with the attributes the interpreter gives its own."""
    module = types.ModuleType("__main__")
    module.__dict__.update({"__annotations__": {}, "__builtins__": builtins,
                            "__loader__": importlib.machinery.BuiltinImporter, **attrs})
    sys.modules["__main__"] = module
    return module


def _exit_code(code: object) -> int:
    """Python's exit status for ``sys.exit(code)``: a non-integer is printed, and means 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


_INTERRUPTED: list[bool] = []


def _exit_by_sigint() -> None:
    """Python ends a program that a Ctrl-C stopped by SIGINT, so its parent sees that."""
    if _INTERRUPTED:
        sys.stdout.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="remotecuda",
                                description="Use a GPU on another machine from unchanged PyTorch code.")
    p.add_argument("--version", action="version", version=f"remotecuda {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start a GPU gateway on this machine")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=_port, default=55555, help="TCP port (default 55555; 0 picks a free one)")
    s.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="serve CUDA GPUs, or the CPU (auto: CUDA if present)")
    s.add_argument("--gpus", default=None,
                   help="CUDA: the devices to serve, e.g. 0,1 (default: all visible); with --device cpu: "
                        "N simulated GPUs, running on the CPU, for testing without GPUs")
    s.add_argument("--gpu-memory", default=None,
                   help="a simulated GPU's memory, enforced: 24GB, 80GiB, 512MB or bytes; "
                        "a comma-separated list gives each its own (default 16GiB)")
    s.add_argument("--gpu-name", default=None, help="a simulated GPU's name (comma-separated: each its own)")
    s.add_argument("--gpu-capability", default=None,
                   help="a simulated GPU's compute capability, e.g. 8.0 (comma-separated: each its own; "
                        "bfloat16 from 8.0; default 8.0)")
    s.add_argument("--no-discovery", action="store_true",
                   help="do not announce this gateway on multicast "
                        "(clients then name it: --server / REMOTECUDA_SERVERS)")
    s.add_argument("--advertise", default=None, metavar="HOST:PORT",
                   help="the address beacons give clients, when they reach the gateway by another one "
                        "(a proxy, a tunnel, NAT; default: the bound address)")
    s.add_argument("--discovery-iface", type=_ipv4, default=None, metavar="IP",
                   help="the interface (its IPv4 address) beacons leave by (default REMOTECUDA_DISCOVERY_IFACE; "
                        "else 127.0.0.1 for a loopback --host, else the system's choice)")
    s.add_argument("--spare", type=_number(int), default=1, help="session workers kept started per device")
    s.add_argument("--session-timeout", type=_number(float, above=True), default=60.0,
                   help="seconds without a message before a session is dropped")
    s.add_argument("--cache-bytes", type=_number(int), default=CACHE_BYTES,
                   help="the most a session's upload cache may hold (default 512 MiB)")
    s.add_argument("--no-direct", action="store_true",
                   help="carry all session traffic through the one port (no per-session data ports)")
    s.add_argument("--quiet", action="store_true", help="print only the READY line")
    s.add_argument("--token-file", default=None,
                   help="a file holding the token clients must prove they hold (default REMOTECUDA_TOKEN, "
                        "REMOTECUDA_TOKEN_FILE); required off loopback unless --insecure")
    s.add_argument("--token", default=None,
                   help="the token itself (other users may read a command line: prefer --token-file)")
    s.add_argument("--admin-token-file", default=None,
                   help="a file holding the admin token (default REMOTECUDA_ADMIN_TOKEN, "
                        "REMOTECUDA_ADMIN_TOKEN_FILE): STATUS then shows per-session rows and totals only "
                        "to a client proving it; needs a session token")
    s.add_argument("--admin-token", default=None, help="the admin token itself (prefer --admin-token-file)")
    s.add_argument("--insecure", action="store_true",
                   help="serve a non-loopback --host without a token: anyone who reaches the port runs code here")
    s.add_argument("--max-sessions", type=_number(int, 1), default=64, help="sessions at once, in all (default 64)")
    s.add_argument("--max-sessions-per-peer", type=_number(int, 1), default=16,
                   help="sessions at once from one IP address (default 16)")
    s.add_argument("--session-memory", default=None,
                   help="the most memory one session may hold, enforced (same sizes as --gpu-memory: 2GB, "
                        "512MiB, bytes); past it an op raises torch.cuda.OutOfMemoryError in that session "
                        "alone (default: no quota but the GPU's size)")
    s.add_argument("--max-queued", type=_number(int, 1), default=MAX_QUEUED,
                   help=f"ops one session may have queued, not yet run; a message past it is refused with an "
                        f"error (default {MAX_QUEUED:,})")
    s.add_argument("--idle-timeout", type=_number(float, above=True), default=30.0,
                   help="seconds a connection may stay without authenticating, or without a session and "
                        "silent, before it is closed (default 30)")
    s.add_argument("--curve-secret", default=None, metavar="FILE",
                   help="encrypt every port with CURVE: the gateway's key pair (a .key_secret file of "
                        "`remotecuda keys`); needs --curve-clients")
    s.add_argument("--curve-clients", default=None, metavar="DIR",
                   help="with --curve-secret: the directory of client public keys (.key files) admitted; "
                        "any other client key is refused")
    r = sub.add_parser("run", help="run a Python script (or a launcher: torchrun...) with 'cuda' on the gateways")
    r.add_argument("--server", default=None, help="HOST:PORT[,HOST:PORT], all their GPUs as cuda:0..N-1 "
                   "(default REMOTECUDA_SERVERS, else the gateways found on multicast)")
    r.add_argument("--trace", default=None, metavar="FILE.json",
                   help="record a trace of the program's ops, messages, transfers and waits, written to "
                        "FILE.json at its end (Chrome trace-event format: open it in https://ui.perfetto.dev)")
    r.add_argument("command", nargs=argparse.REMAINDER,
                   help="python SCRIPT.py [ARGS...] | python -m MODULE [ARGS...] | python -c CODE [ARGS...] | "
                        "python - [ARGS...] (the program from stdin) | COMMAND [ARGS...] (torchrun, accelerate "
                        "launch...); every Python process the program or command starts is activated too")
    v = sub.add_parser("servers", help="list the gateways found (multicast beacons, or --server)")
    v.add_argument("--server", default=None, help="HOST:PORT[,HOST:PORT] to ask instead of listening "
                   "(default REMOTECUDA_SERVERS; unset: listen for beacons)")
    v.add_argument("--wait", type=_number(float), default=1.5, help="seconds to listen (default 1.5: one beacon round)")
    v.add_argument("--json", action="store_true", help="print the list as JSON")
    t = sub.add_parser("token", help="print a new random token (for --token-file / REMOTECUDA_TOKEN_FILE)")
    k = sub.add_parser("keys", help="make a CURVE key pair: DIR/NAME.key (public) and DIR/NAME.key_secret (0600)")
    k.add_argument("name", help="the pair's name, e.g. gateway, or a client's (its public key file is "
                                "copied into a gateway's --curve-clients directory)")
    k.add_argument("dir", help="the directory to write them to (created if missing)")
    argv = sys.argv[1:] if argv is None else argv
    a, extra = p.parse_known_args(argv)
    if extra:  # said by the command's parser: its usage, "remotecuda start: error: ..." (not the top level's)
        {"start": s, "run": r, "servers": v, "token": t, "keys": k}[a.cmd].error(
            f"unrecognized arguments: {' '.join(extra)}")
    if a.cmd == "keys":
        return _keys(a)
    if a.cmd == "servers":
        return _servers(a)
    if a.cmd == "token":
        import secrets
        print(secrets.token_urlsafe(32))
        return 0
    return _start(a, argv) if a.cmd == "start" else _run(a)


if __name__ == "__main__":
    sys.exit(main())
