"""The ``remotecuda`` command: ``start`` a gateway, ``run`` a script with interception on."""
from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys


def _start(a: argparse.Namespace, argv: list[str]) -> int:
    from remotecuda_server.gateway import worker_env
    env = worker_env()
    if env.get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES") and sys.platform.startswith("linux"):
        # malloc reads its tunables at process start: restart once with huge pages for the large
        # receive buffers (same pid, same stdout), as the session workers get them
        os.execve(sys.executable, [sys.executable, "-m", "remotecuda", *argv], env)
    from remotecuda_server.devices import detect
    from remotecuda_server.gateway import VERSION, Gateway
    devices, note = detect(a.device)
    gw = Gateway(devices, host=a.host, port=a.port, spare=a.spare, session_timeout=a.session_timeout,
                 cache_bytes=a.cache_bytes, direct=not a.no_direct)
    if not a.quiet:
        print(f"RemoteCUDA gateway {VERSION}: {note}", flush=True)
        for d in devices:
            print(f"  device {d.index}: {d.name}, {d.total_memory / 2**30:.1f} GiB"
                  + (" (simulated)" if d.simulated else ""), flush=True)
        print(f"  listening on tcp://{gw.host}:{gw.port}; discovery "
              f"{'off' if a.no_discovery else 'not available yet (use --server / REMOTECUDA_SERVERS)'}",
              flush=True)
        print("  status: ready (Ctrl-C to stop)", flush=True)
    print(f"READY tcp://{gw.host}:{gw.port}", flush=True)

    def stop(*_: object) -> None:
        gw.running = False
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        gw.serve()
    finally:
        gw.shutdown()
    return 0


def _run(a: argparse.Namespace) -> int:
    cmd = list(a.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd or os.path.basename(cmd[0]).rstrip("0123456789.") not in ("python", "python3") \
            and cmd[0] != sys.executable:
        print("usage: remotecuda run [--server HOST:PORT] python SCRIPT.py [ARGS...] | python -m MODULE",
              file=sys.stderr)
        return 2
    import remotecuda
    remotecuda.activate(a.server)
    rest = cmd[1:]
    try:
        if rest[:1] == ["-m"] and len(rest) > 1:
            sys.argv = [rest[1], *rest[2:]]
            runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
        elif rest:
            sys.argv = rest
            sys.path.insert(0, os.path.dirname(os.path.abspath(rest[0])))
            runpy.run_path(rest[0], run_name="__main__")
        else:
            print("remotecuda run: give a script or -m MODULE", file=sys.stderr)
            return 2
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        remotecuda.synchronize()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="remotecuda", description="Use a GPU on another machine from unchanged PyTorch code.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start a GPU gateway on this machine")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=55555, help="TCP port (default 55555; 0 picks a free one)")
    s.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="serve CUDA GPUs, or the CPU (auto: CUDA if present)")
    s.add_argument("--no-discovery", action="store_true", help="do not announce this gateway by multicast")
    s.add_argument("--spare", type=int, default=1, help="session workers kept started per device")
    s.add_argument("--session-timeout", type=float, default=60.0,
                   help="seconds without a message before a session is dropped")
    s.add_argument("--cache-bytes", type=int, default=512 << 20,
                   help="the most a session's upload cache may hold (default 512 MiB)")
    s.add_argument("--no-direct", action="store_true",
                   help="carry all session traffic through the one port (no per-session data ports)")
    s.add_argument("--quiet", action="store_true", help="print only the READY line")
    r = sub.add_parser("run", help="run a Python script with 'cuda' on the gateways")
    r.add_argument("--server", default=None, help="HOST:PORT[,HOST:PORT] (default REMOTECUDA_SERVERS)")
    r.add_argument("command", nargs=argparse.REMAINDER, help="python SCRIPT.py [ARGS...]")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    return _start(a, argv) if a.cmd == "start" else _run(a)


if __name__ == "__main__":
    sys.exit(main())
