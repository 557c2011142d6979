"""The `remotecuda` command and activation paths, run as real processes against real gateways."""
from __future__ import annotations

import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

import remotecuda

from conftest import ROOT, GatewayProcess, run_python, wait_for

BIN = os.path.join(os.path.dirname(sys.executable), "remotecuda")

TRAIN = r'''
import sys
import torch


def train(device):
    g = torch.Generator().manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(64, 8, generator=g)
    y = x.sum(1, keepdim=True).sin()
    model = model.to(device)
    x, y = x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return x.device, losses


if __name__ == "__main__":
    device, losses = train("cuda")
    print("DEVICE", device, torch.cuda.is_available())
    print("ARGV", sys.argv[1:])
    print("FIRST_LOSS %.8f" % losses[0])
    print("FINAL_LOSS %.8f" % losses[-1])
    code = [a for a in sys.argv if a.startswith("--exit=")]
    sys.exit(int(code[0][7:]) if code else 0)
'''


@pytest.fixture(scope="module")
def train_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "train.py"
    path.write_text(TRAIN)
    return str(path)


@pytest.fixture(scope="module")
def expected_losses(train_script):
    """The same script's losses on the local CPU, computed in this process without remotecuda."""
    mod = runpy.run_path(train_script, run_name="not_main")
    device, losses = mod["train"]("cpu")
    assert device.type == "cpu" and losses[-1] < losses[0] * 0.5
    return losses


def _parse(out: str) -> dict:
    return dict(line.split(" ", 1) for line in out.splitlines() if line and line.split(" ", 1)[0].isupper()
                and " " in line)


def _check_training(r, expected, argv=None, code=0):
    assert r.returncode == code, (r.stdout, r.stderr[-3000:])
    f = _parse(r.stdout)
    assert f["DEVICE"] == "cuda:0 True", r.stdout
    first, final = float(f["FIRST_LOSS"]), float(f["FINAL_LOSS"])
    assert first == pytest.approx(expected[0], rel=1e-5, abs=1e-7)
    assert final == pytest.approx(expected[-1], rel=1e-4, abs=1e-6)
    assert final < first * 0.5
    if argv is not None:
        assert f["ARGV"] == repr(argv)
    assert "RuntimeWarning" not in r.stderr and "fallback" not in r.stderr


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _run(args, env=None, timeout=180):
    e = dict(os.environ)
    e.pop("REMOTECUDA_SERVERS", None)
    e.pop("REMOTECUDA_FALLBACK", None)
    e.update(env or {})
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)


# ---------------------------------------------------------------------------- remotecuda run

def test_run_console_script_argv_and_exit_code(gateway, train_script, expected_losses):
    args = ["alpha", "--beta=2", "gamma delta", "--exit=3"]
    r = _run([BIN, "run", "--server", gateway.address, "python", train_script, *args])
    _check_training(r, expected_losses, argv=args, code=3)


def test_python_dash_m_remotecuda_run(gateway, train_script, expected_losses):
    r = _run([sys.executable, "-m", "remotecuda", "run", "--server", gateway.address,
              sys.executable, train_script, "x"])
    _check_training(r, expected_losses, argv=["x"], code=0)


def test_run_of_a_command_that_is_not_python_runs_it_telling_its_python_children(gateway):
    """``remotecuda run torchrun ...``, ``accelerate launch``, a shell script: the command runs in
    remotecuda's place (its exit status is the run's) with the Python processes it starts told to
    activate (tests/test_run_children.py); one not found is said as a shell says it (127)."""
    r = _run([sys.executable, "-m", "remotecuda", "run", "--server", gateway.address,
              "sh", "-c", 'echo "$REMOTECUDA_RUN $REMOTECUDA_SERVERS"; exit 3'])
    assert (r.returncode, r.stdout) == (3, f"1 {gateway.address}\n"), r.stderr
    r = _run([sys.executable, "-m", "remotecuda", "run", "no-such-command-here"])
    assert (r.returncode, r.stderr) == (127, "remotecuda run: no-such-command-here: No such file or directory\n")


@pytest.mark.parametrize("args, says", [
    (["start", "--bogus"], "usage: remotecuda start [-h]|remotecuda start: error: unrecognized arguments: --bogus"),
    (["servers", "x"], "usage: remotecuda servers|remotecuda servers: error: unrecognized arguments: x"),
    (["run", "--trace", "t.json", "bash", "-c", "true"],
     "usage: remotecuda run|remotecuda run: error: --trace records a python program run by remotecuda run itself"),
    (["run", "python", "-m"], "remotecuda run: error: -m needs an argument"),
    (["run"], "remotecuda run: error: no command given"),
], ids=["start flag", "servers argument", "trace of not python", "-m alone", "nothing"])
def test_a_command_line_mistake_is_said_by_its_command(args, says):
    """A mistake is a usage error (exit 2) with the command's own usage and a line saying what is wrong (a
    bad flag of start showed the top level's usage; run's mistakes showed its usage alone)."""
    r = _run([sys.executable, "-m", "remotecuda", *args], timeout=60)
    assert r.returncode == 2 and all(part in r.stderr for part in says.split("|")), r.stderr


def test_version_flag():
    r = _run([sys.executable, "-m", "remotecuda", "--version"], timeout=60)
    assert (r.returncode, r.stdout) == (0, f"remotecuda {remotecuda.__version__}\n"), r.stderr


PROBE = r'''
import pickle, sys
import torch


class Net(torch.nn.Linear):  # defined in the program: pickling finds it in sys.modules['__main__']
    pass


g = globals()
print("ARGV", sys.argv)
print("PATH0", repr(sys.path[0]))
print("GLOBALS", {k: g[k] for k in ("__name__", "__file__", "__cached__", "__package__") if k in g},
      sorted(k for k in g if k.startswith("__")))
print("SPEC", __spec__ and (__spec__.name, __spec__.origin), type(__loader__).__name__, type(__builtins__).__name__)
print("MAIN", sys.modules["__main__"].__dict__ is g)
print("PICKLE", type(pickle.loads(pickle.dumps(Net(2, 2)))).__qualname__)
'''


@pytest.fixture(scope="module")
def probe_tree(tmp_path_factory):
    """A script (also reached through a symlink and a '..'), a package with __main__ and a module."""
    root = tmp_path_factory.mktemp("probe")
    (root / "sub" / "pkg").mkdir(parents=True)
    for f in ("sub/probe.py", "sub/pkg/__main__.py", "sub/pkg/mod.py"):
        (root / f).write_text(PROBE)
    (root / "sub" / "pkg" / "__init__.py").write_text("")
    (root / "link.py").symlink_to(root / "sub" / "probe.py")
    return root


@pytest.mark.parametrize("cwd, argv", [
    (".", ["sub/probe.py", "a", "--b"]), (".", ["./sub/../sub/probe.py"]), (".", ["link.py", "x"]),
    ("sub", ["-m", "pkg.mod", "y"]), ("sub", ["-m", "pkg", "z"]), ("sub", ["-c", PROBE, "w"]),
    ("sub", ["-m", "no_such_module"]), (".", ["no_such_script.py"]),
], ids=["script", "dotdot", "symlink", "-m module", "-m package", "-c", "-m missing", "missing script"])
def test_run_sets_up_the_program_as_python_does(gateway, probe_tree, cwd, argv):
    """``remotecuda run python ...`` and ``python ...`` print the same, and exit the same."""
    env = dict(os.environ, REMOTECUDA_SERVERS=gateway.address, REMOTECUDA_FALLBACK="error")
    run = [subprocess.run(cmd + argv, capture_output=True, text=True, timeout=180, env=env,
                          cwd=probe_tree / cwd) for cmd in ([sys.executable], [BIN, "run", "python"])]
    assert run[0].returncode == run[1].returncode, (run[0].stderr, run[1].stderr)
    assert run[1].stdout == run[0].stdout and run[1].stderr == run[0].stderr
    assert run[0].returncode != 0 or "PICKLE Net" in run[0].stdout


@pytest.mark.parametrize("ending", ["raise ValueError('boom')", "sys.exit('bye')", "sys.exit(4)",
                                    "sys.exit()", "raise KeyboardInterrupt", "pass", "def ("])
def test_run_ends_as_python_does(gateway, tmp_path, ending):
    path = tmp_path / "end.py"
    path.write_text(f"import sys\n\n\ndef main():\n    {ending}\n\n\nmain()\n")
    env = dict(os.environ, REMOTECUDA_SERVERS=gateway.address, REMOTECUDA_FALLBACK="error")
    run = [subprocess.run(cmd + [str(path)], capture_output=True, text=True, timeout=180, env=env,
                          cwd=tmp_path) for cmd in ([sys.executable], [BIN, "run", "python"])]
    assert (run[1].returncode, run[1].stdout, run[1].stderr) == (run[0].returncode, run[0].stdout,
                                                                 run[0].stderr)


def test_run_reads_the_program_from_stdin(gateway):
    """`remotecuda run python - ARGS` runs the program on stdin, as `python -` does (it was a usage error)."""
    program = "import sys, torch\nprint(sys.argv, torch.ones(2, device='cuda').sum().item())\nsys.exit(3)\n"
    env = dict(os.environ, REMOTECUDA_SERVERS=gateway.address, REMOTECUDA_FALLBACK="error")
    r = subprocess.run([sys.executable, "-m", "remotecuda", "run", "python", "-", "a b", "-c"], input=program,
                       capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert (r.returncode, r.stdout) == (3, "['-', 'a b', '-c'] 2.0\n"), r.stderr


FLAGS = r'''
import sys
print("FLAGS", sys.flags.optimize, sys.flags.dont_write_bytecode, sys.flags.dev_mode, sys.flags.safe_path,
      sys.warnoptions, sys._xoptions, sys.argv[1:], sys.stdout.write_through)
try:
    assert False
except AssertionError:
    print("ASSERTS ON")
print("PATH0", sys.path[0])
'''


@pytest.mark.parametrize("options", [["-u", "-O", "-W", "ignore::DeprecationWarning", "-X", "dev", "-B"],
                                     ["-uOWerror::FutureWarning", "-P"]], ids=["separate", "grouped"])
def test_run_keeps_python_options(gateway, tmp_path, options):
    """``remotecuda run python -u -O ... train.py`` (job scripts' ``python -u``) acts as ``python -u -O ...``."""
    (tmp_path / "flags.py").write_text(FLAGS)
    env = dict(os.environ, REMOTECUDA_SERVERS=gateway.address, REMOTECUDA_FALLBACK="error", PYTHONPATH=ROOT)
    env.pop("PYTHONUNBUFFERED", None)
    run = [subprocess.run(cmd + [*options, "flags.py", "a", "-u"], capture_output=True, text=True, timeout=180,
                          env=env, cwd=tmp_path)
           for cmd in ([sys.executable], [sys.executable, "-m", "remotecuda", "run", "python"])]
    assert (run[1].returncode, run[1].stdout, run[1].stderr) == (run[0].returncode, run[0].stdout,
                                                                 run[0].stderr)
    assert run[0].stdout.startswith("FLAGS 1 ") and "ASSERTS ON" not in run[0].stdout


def test_run_server_reaches_the_programs_child_processes(gateway, tmp_path):
    """A process the program starts runs plain PyTorch; its own ``activate()`` finds ``--server``'s gateway."""
    child = "import remotecuda, torch; remotecuda.activate(); print(torch.ones(2, device='cuda').sum().item())"
    (tmp_path / "parent.py").write_text(f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {child!r}])\n")
    r = _run([sys.executable, "-m", "remotecuda", "run", "--server", gateway.address, "python",
              str(tmp_path / "parent.py")], env={"REMOTECUDA_FALLBACK": "error"})
    assert (r.returncode, r.stdout) == (0, "2.0\n"), r.stderr[-3000:]


def test_run_refuses_python_options_it_cannot_keep(gateway):
    r = _run([sys.executable, "-m", "remotecuda", "run", "--server", gateway.address, "python", "-S", "x.py"])
    assert r.returncode == 2 and "usage: remotecuda run" in r.stderr


@pytest.mark.parametrize("ending, code", [("main()", 1), ("sys.exit(main())", 1), ("sys.exit(main() + 3)", 3)])
def test_run_shows_a_pending_remote_error_however_the_program_ends(gateway, tmp_path, ending, code):
    """An error of queued work is shown at the program's end, also after ``sys.exit(main())``
    (it was lost there, with exit status 0)."""
    (tmp_path / "pend.py").write_text(
        "import sys, torch\n\n\ndef main():\n    x = torch.zeros(3, device='cuda')\n"
        "    x[torch.tensor([7], device='cuda')]\n    print('QUEUED')\n    return 0\n\n\n" + ending + "\n")
    r = _run([sys.executable, "-m", "remotecuda", "run", "--server", gateway.address, "python",
              str(tmp_path / "pend.py")])
    assert (r.returncode, r.stdout) == (code, "QUEUED\n")
    assert "IndexError: index 7 is out of bounds for dimension 0 with size 3" in r.stderr


ACTIVATE = r'''
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch, remotecuda
    remotecuda.activate()
    x = torch.arange(12.0).reshape(3, 4).to("cuda")
    y = (x @ x.T).relu() * 0.5
    print("AVAILABLE", torch.cuda.is_available(), torch.cuda.device_count())
    print("DEVICE", y.device, y.is_cuda)
    print("NAME", torch.cuda.get_device_name(0))
    print("RESULT", y.sum().item())
    torch.cuda.synchronize()
relevant = [w for w in caught if issubclass(w.category, RuntimeWarning)]
print("RUNTIME_WARNINGS", len(relevant))
for w in relevant:
    print("WARNING", str(w.message).replace("\n", " "))
    print("WHERE", w.filename, w.lineno)
'''
_EXPECTED_RESULT = float(((torch.arange(12.0).reshape(3, 4) @ torch.arange(12.0).reshape(3, 4).T).relu() * 0.5).sum())


def test_env_servers_with_plain_activate(gateway):
    r = run_python(ACTIVATE, env={"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_FALLBACK": "error"})
    assert r.returncode == 0, r.stderr[-3000:]
    f = _parse(r.stdout)
    assert f["AVAILABLE"] == "True 1" and f["DEVICE"] == "cuda:0 True"
    assert float(f["RESULT"]) == _EXPECTED_RESULT
    assert f["NAME"].startswith("CPU (") and "fallback" not in f["NAME"]
    assert f["RUNTIME_WARNINGS"] == "0"


def test_cpu_fallback_when_no_gateway_answers():
    port = _free_port()
    r = run_python(ACTIVATE, env={"REMOTECUDA_SERVERS": f"127.0.0.1:{port}", "REMOTECUDA_FALLBACK": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    f = _parse(r.stdout)
    assert f["AVAILABLE"] == "True 1" and f["DEVICE"] == "cuda:0 True"
    assert float(f["RESULT"]) == _EXPECTED_RESULT
    assert "local fallback" in f["NAME"]
    assert f["RUNTIME_WARNINGS"] == "1", r.stdout
    msg = f["WARNING"]
    assert "no gateway is reachable" in msg and f"127.0.0.1:{port}" in msg and "local CPU" in msg
    assert f["WHERE"] == "<string> 7", "the warning names the program's activate() line"


def test_run_falls_back_with_one_clear_line(tmp_path):
    """``remotecuda run`` with no gateway: the program runs (on the local CPU) as with ``python``, and
    stderr says why in one line, without a source line of RemoteCUDA's."""
    port = _free_port()
    (tmp_path / "t.py").write_text("import torch\nx = torch.arange(6.0, device='cuda').reshape(2, 3)\n"
                                   "print('RESULT', (x @ x.T).tolist(), x.device)\n")
    env = dict(os.environ, REMOTECUDA_SERVERS=f"127.0.0.1:{port}", PYTHONPATH=ROOT)
    env.pop("REMOTECUDA_FALLBACK", None)
    r = subprocess.run([sys.executable, "-m", "remotecuda", "run", "python", "t.py"], capture_output=True,
                       text=True, timeout=180, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == "RESULT [[5.0, 14.0], [14.0, 50.0]] cuda:0\n"
    assert r.stderr.startswith("remotecuda: no gateway is reachable (") and r.stderr.count("\n") == 1
    assert f"127.0.0.1:{port}" in r.stderr and r.stderr.endswith("running 'cuda' work on the local CPU instead\n")


def test_fallback_error_raises_gateway_unavailable():
    port = _free_port()
    code = r'''
import time, remotecuda
t = time.monotonic()
try:
    remotecuda.activate()
except remotecuda.GatewayUnavailableError as e:
    print("RAISED", type(e).__name__, isinstance(e, RuntimeError), round(time.monotonic() - t))
    print("MESSAGE", str(e))
else:
    print("NOT RAISED")
'''
    r = run_python(code, env={"REMOTECUDA_SERVERS": f"127.0.0.1:{port}", "REMOTECUDA_FALLBACK": "error"})
    assert r.returncode == 0, r.stderr[-3000:]
    f = _parse(r.stdout)
    name, is_rt, secs = f["RAISED"].split()
    assert name == "GatewayUnavailableError" and is_rt == "True" and int(secs) < 30
    assert f"127.0.0.1:{port}" in f["MESSAGE"] and "REMOTECUDA_FALLBACK=error" in f["MESSAGE"]
    assert "RuntimeWarning" not in r.stderr


# ---------------------------------------------------------------------------- remotecuda start

def _banner(*args: str) -> tuple[list[str], subprocess.Popen]:
    p = subprocess.Popen([BIN, "start", "--port", "0", "--no-discovery", *args], stdout=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, cwd=ROOT)
    lines = []
    while True:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("READY "):
            break
    return lines, p


def _stop(p: subprocess.Popen) -> int:
    p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        raise


def test_start_banner():
    (cpu_lines, cpu), (auto_lines, auto) = _banner("--device", "cpu"), _banner("--device", "auto")
    try:
        total = psutil.virtual_memory().total / 2**30
        for lines in (cpu_lines, auto_lines):
            text = "\n".join(lines)
            assert lines[0].startswith(f"RemoteCUDA gateway {remotecuda.__version__}: "), text
            assert "; discovery: off (--no-discovery)" in text
            assert re.search(rf"device 0: CPU \(\w+, {os.cpu_count()} cores\), {total:.1f} GiB$", text, re.M), text
            m = re.search(r"listening on tcp://127\.0\.0\.1:(\d+)", text)
            assert m and lines[-1] == f"READY tcp://127.0.0.1:{m.group(1)}", text
            assert "  status: ready" in text
            socket.create_connection(("127.0.0.1", int(m.group(1))), timeout=5).close()
        assert cpu_lines[0].endswith("serving on the CPU (--device cpu)")
        assert auto_lines[0].endswith("no CUDA device found: serving on the CPU"), auto_lines
        for p in (cpu, auto):
            assert p.poll() is None
    finally:
        codes = [_stop(cpu), _stop(auto)]
    assert codes == [0, 0]


def test_start_stops_cleanly_on_ctrl_c():
    """Ctrl-C (SIGINT to the terminal's process group) as soon as the banner says ready stops the gateway
    and its workers with exit 0 and nothing on stderr (a SIGINT just after READY was a KeyboardInterrupt
    traceback through the banner's print: the handler was installed after it)."""
    p = subprocess.Popen([sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
                          "--no-discovery", "--spare", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, cwd=ROOT, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        while not p.stdout.readline().startswith("READY "):
            assert p.poll() is None, p.stderr.read()
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert (p.returncode, err) == (0, ""), err
    assert wait_for(lambda: not [q for q in psutil.process_iter(["pid"]) if _in_group(q, p.pid)], 20)


def _in_group(q: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(q.pid) == pgid and q.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.Error):
        return False


def test_start_help_names_the_pool_options():
    """The discovery and GPU options are there and say what they do (none is a placebo)."""
    r = _run([BIN, "start", "--help"], timeout=60)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for option in ("--gpus", "--gpu-memory", "--gpu-name", "--gpu-capability", "--no-discovery",
                   "--advertise HOST:PORT", "--discovery-iface IP"):
        assert option in text, text
    assert "do not announce this gateway on multicast" in text and "not implemented" not in text


@pytest.mark.parametrize("flag,value", [("--port", "70000"), ("--port", "-1"), ("--spare", "-1"),
                                        ("--session-timeout", "0"), ("--idle-timeout", "nan"),
                                        ("--max-sessions", "0"), ("--discovery-iface", "eth0")])
def test_start_refuses_a_bad_value_as_a_usage_error(flag, value):
    """A value out of range is a usage error naming the option (ZeroMQ took port 70000 and -1, and
    the banner showed them; a bad interface was a bare inet_aton error)."""
    r = _run([sys.executable, "-m", "remotecuda", "start", flag, value], timeout=60)
    assert r.returncode == 2 and f"argument {flag}: " in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_start_says_its_port_is_taken():
    """A second gateway on a taken port says so in one line (it was a ZMQError traceback)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _run([sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--no-discovery",
                  "--port", str(port)], timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"remotecuda start: cannot listen on tcp://127.0.0.1:{port}: Address already in use" in r.stderr


def test_a_missing_token_file_is_named(gateway, tmp_path):
    """A token file that is not there is an error naming it as remotecuda's, on the gateway (exit 2) and
    on the client (it was a bare FileNotFoundError from open())."""
    missing = str(tmp_path / "no-token")
    r = _run([sys.executable, "-m", "remotecuda", "start", "--token-file", missing], timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"remotecuda start: [Errno 2] cannot read the remotecuda token file {missing!r}" in r.stderr
    r = run_python("import torch, remotecuda; remotecuda.activate(); torch.ones(1, device='cuda').item()",
                   env={"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_TOKEN_FILE": missing})
    assert f"FileNotFoundError: [Errno 2] cannot read the remotecuda token file {missing!r}" in r.stderr, r.stderr


@pytest.mark.parametrize("cmd,env,says", [
    (["run", "--server", "gpu-box", "python", "-c", "pass"], {},
     "remotecuda run: a server is HOST:PORT, got 'gpu-box'"),
    (["servers", "--server", "gpu-box"], {}, "remotecuda servers: a server is HOST:PORT, got 'gpu-box'"),
    (["servers"], {"REMOTECUDA_DISCOVERY": "gpu-box"}, "remotecuda servers: REMOTECUDA_DISCOVERY is GROUP:PORT"),
    (["run", "python", "-c", "pass"], {"REMOTECUDA_STRATEGY": "fastest"},
     "remotecuda run: REMOTECUDA_STRATEGY: unknown scheduling strategy 'fastest'")])
def test_a_malformed_setting_is_one_line_and_exit_2(gateway, cmd, env, says):
    """A wrong --server, REMOTECUDA_DISCOVERY or REMOTECUDA_STRATEGY is one line naming it, exit 2, as
    a usage error (they were tracebacks from deep inside activate(); REMOTECUDA_DISCOVERY=NAME a gaierror)."""
    r = _run([sys.executable, "-m", "remotecuda", *cmd], env={"REMOTECUDA_SERVERS": gateway.address, **env}
             if cmd[0] == "run" and "--server" not in cmd else env, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(says) and "Traceback" not in r.stderr, r.stderr


def test_run_says_no_gateway_in_one_line_with_fallback_error():
    """REMOTECUDA_FALLBACK=error: `remotecuda run` names the GatewayUnavailableError, exit 1, no traceback."""
    r = _run([sys.executable, "-m", "remotecuda", "run", "--server", f"127.0.0.1:{_free_port()}", "python", "-c",
              "print('ran')"], env={"REMOTECUDA_FALLBACK": "error"}, timeout=120)
    assert r.returncode == 1 and "ran" not in r.stdout and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("remotecuda run: GatewayUnavailableError: no RemoteCUDA gateway is reachable")


@pytest.mark.parametrize("setting,says", [("REMOTECUDA_CACHE_POLICY=mru", "REMOTECUDA_CACHE_POLICY='mru': 'lru'"),
                                          ("REMOTECUDA_CACHE_BYTES=1G", "REMOTECUDA_CACHE_BYTES='1G' is not a number"),
                                          ("REMOTECUDA_RETRIES=x", "REMOTECUDA_RETRIES='x' is not a number"),
                                          ("REMOTECUDA_CODECS=lz5", "REMOTECUDA_CODECS='lz5': a comma-separated"),
                                          ("REMOTECUDA_PROGRESS=soon", "REMOTECUDA_PROGRESS='soon': seconds"),
                                          ("REMOTECUDA_SYNC=ture", "REMOTECUDA_SYNC='ture': one of 1/true"),
                                          ("REMOTECUDA_FAILOVER=of", "REMOTECUDA_FAILOVER='of': one of 1/true")])
def test_a_malformed_variable_is_named(gateway, setting, says):
    """A value README's table does not allow is a ValueError naming the variable (an unknown cache
    policy or codec was taken silently, a codec as raw; a malformed number was int()'s bare message; a
    malformed REMOTECUDA_PROGRESS was raised only at the first transfer of more than 2 s)."""
    name, value = setting.split("=")
    r = run_python("import torch, remotecuda; remotecuda.activate(); print(torch.ones(1, device='cuda').item())",
                   env={"REMOTECUDA_SERVERS": gateway.address, name: value})
    assert r.returncode == 1 and f"ValueError: {says}" in r.stderr, r.stderr


def test_yes_and_no_are_spelt_as_usual():
    """``REMOTECUDA_SYNC=false`` turned synchronous mode on (any value but 0 did)."""
    from remotecuda_wire.limits import switch
    assert [switch("V", v, True) for v in ("0", "false", "No", " off ")] == [False] * 4
    assert [switch("V", v, False) for v in ("1", "TRUE", "yes", "on")] == [True] * 4
    assert switch("V", None, True) and not switch("V", "", False)


def test_one_version():
    """pyproject.toml, the client, the gateway and the kernel report one version."""
    from importlib.metadata import version

    import remotecuda_kernel
    from remotecuda_server.gateway import VERSION
    assert remotecuda.__version__ == VERSION == remotecuda_kernel.__version__ == version("remotecuda")


def test_start_device_cuda_refuses_without_a_gpu():
    r = _run([BIN, "start", "--device", "cuda", "--port", "0", "--no-discovery"], timeout=120)
    assert r.returncode != 0 and "no CUDA device" in r.stderr


# ---------------------------------------------------------------------------- session lifetime

HOLDER = r'''
import sys, time, torch, remotecuda
remotecuda.activate(sys.argv[1], fallback="error")
x = torch.ones(64, 1024, 1024, device="cuda")  # 256 MiB held by the session's worker
assert x.sum().item() == 64 * 1024 * 1024
print("HOLDING", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "check":
        print("CHECK", (x * 2).sum().item(), flush=True)
    elif cmd == "close":
        remotecuda.deactivate()
        print("CLOSED", flush=True)
time.sleep(120)
'''


def _worker_rss(gw: GatewayProcess) -> dict:
    out = {}
    for c in psutil.Process(gw.proc.pid).children():
        try:
            out[c.pid] = c.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


def _start_holder(gw, script):
    p = subprocess.Popen([sys.executable, script, gw.address], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "HOLDING"
    return p


def _session_worker(gw, before: dict) -> int:
    """The worker that holds the 256 MiB tensor."""
    after = _worker_rss(gw)
    big = [pid for pid, rss in after.items() if pid in before and rss > before[pid] + (200 << 20)]
    assert len(big) == 1, (before, after)
    return big[0]


def test_session_memory_freed_on_close_and_on_client_death(tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    gw = GatewayProcess("--session-timeout", "5")  # (pings every 2 s: a busy machine may delay one)
    try:
        assert wait_for(lambda: len(_worker_rss(gw)) == 1, 60)  # the one spare worker
        # a client that closes: its worker exits at once, not at the timeout
        before = _worker_rss(gw)
        a = _start_holder(gw, str(script))
        wa = _session_worker(gw, before)
        time.sleep(7)  # longer than --session-timeout: an idle but live client keeps its session
        a.stdin.write("check\n")
        a.stdin.flush()
        assert a.stdout.readline().strip() == f"CHECK {2.0 * 64 * 1024 * 1024}"
        assert psutil.pid_exists(wa)
        assert wait_for(lambda: len(_worker_rss(gw)) == 2, 60)  # a fresh spare is ready
        before = _worker_rss(gw)
        a.stdin.write("close\n")
        a.stdin.flush()
        assert a.stdout.readline().strip() == "CLOSED"
        t = time.monotonic()
        assert wait_for(lambda: not psutil.pid_exists(wa) or psutil.Process(wa).status() == psutil.STATUS_ZOMBIE, 10)
        assert time.monotonic() - t < 2.8, "closed session's worker lingered"
        a.kill()
        a.wait()

        # a client killed with SIGKILL sends nothing: the session times out and its worker exits
        assert wait_for(lambda: len(_worker_rss(gw)) == 1, 30)
        before = _worker_rss(gw)
        b = _start_holder(gw, str(script))
        wb = _session_worker(gw, before)
        assert wait_for(lambda: len(_worker_rss(gw)) == 2, 60)
        b.send_signal(signal.SIGKILL)
        b.wait()
        t = time.monotonic()
        assert wait_for(lambda: wb not in _worker_rss(gw), 15), "the dead client's worker is still running"
        gone_after = time.monotonic() - t
        assert gone_after < 5 + 4
        assert len(_worker_rss(gw)) == 1  # only the spare is left
        assert gw.proc.poll() is None
    finally:
        gw.stop()


def test_workers_do_not_outlive_a_killed_gateway():
    """Not even spares still importing torch when it died: the kernel's parent-death signal is
    set only once they run, so they check for their gateway themselves then."""
    gw = GatewayProcess("--spare", "2")
    assert wait_for(lambda: len(psutil.Process(gw.proc.pid).children()) == 2, 10)
    workers = psutil.Process(gw.proc.pid).children()
    gw.proc.kill()  # before the spares are ready (they take seconds to import torch)
    gw.proc.wait()

    def gone(p: psutil.Process) -> bool:
        try:
            return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    try:
        assert wait_for(lambda: all(gone(p) for p in workers), 60), [p.pid for p in workers if not gone(p)]
    finally:
        for p in workers:
            if not gone(p):
                p.kill()


def test_start_up_imports_only_what_is_used(gateway):
    """The RemoteCUDA kernel starts without torch (its first cell imports it); activation and the
    first ops do without torch._dynamo (~1 s), which only torch.compile and optimizers need."""
    code = (
        "import sys, remotecuda_kernel.kernel, remotecuda.ipython\n"
        "assert 'torch' not in sys.modules\n"
        "import torch, remotecuda\n"
        "remotecuda.activate()\n"
        "x = torch.randn(8, 4, device='cuda')\n"
        "y = torch.nn.functional.linear(x, torch.ones(3, 4, device='cuda')).relu().softmax(-1)\n"
        "print('SUM', round(y.sum().item(), 4), 'torch._dynamo' in sys.modules)\n"
        "opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2, device='cuda'))], lr=0.1)\n"
        "opt.param_groups[0]['params'][0].sum().backward()\n"
        "opt.step()  # torch's optimizers import torch._dynamo themselves: meta kernels then use it\n"
        "print('STEP', opt.param_groups[0]['params'][0].tolist(), 'torch._dynamo' in sys.modules)\n")
    r = run_python(code, env={"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_FALLBACK": "error"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SUM 8.0 False" in r.stdout and "STEP [0.8999999761581421, 0.8999999761581421] True" in r.stdout, r.stdout
