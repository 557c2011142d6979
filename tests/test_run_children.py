"""The processes a ``remotecuda run`` program starts (remotecuda/children.py, run_site/sitecustomize.py).

Every Python process started under ``remotecuda run`` — by the program (``subprocess``,
``os.system``), by a launcher run in its place (``remotecuda run torchrun ...``), by their own
children — activates as the program does, at its first ``import torch``. They ran plain CPU-only
PyTorch: "Torch not compiled with CUDA enabled".
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT

#: computed on 'cuda' by a child, on the CPU by the test
WORK = textwrap.dedent('''
    import sys, torch
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(5, 3, generator=g), torch.randn(4, 5, generator=g)
    model = torch.nn.Linear(5, 3).to(device)
    with torch.no_grad():
        model.weight.copy_(w.T)
        model.bias.zero_()
    out = model(x.to(device)).relu().sum(0)
    out.sum().backward()
    print("CUDA", torch.cuda.is_available(), out.device.type)
    print("OUT", [round(v, 6) for v in out.tolist()], [round(v, 6) for v in model.weight.grad.sum(1).tolist()])
''')

#: a program that starts Python children as programs do
PARENT = textwrap.dedent('''
    import os, subprocess, sys
    r = subprocess.run([sys.executable, "work.py"], capture_output=True, text=True)
    print(r.stdout, end="")
    print("WORK_RC", r.returncode, r.stderr[-2000:].replace("\\n", " | "))
    print("SHELL_RC", os.system(f"{sys.executable} work.py > shell.txt 2>&1"), open("shell.txt").read().split()[:2])
    own = "import remotecuda; remotecuda.activate(); import torch; print(torch.ones(2, device='cuda').sum().item())"
    r = subprocess.run([sys.executable, "-c", own], capture_output=True, text=True)
    print("SELF", r.returncode, r.stdout.strip(), r.stderr[-2000:].replace("\\n", " | "))
    r = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True)
    print("PASS_RC", r.returncode, repr(r.stderr))
    r = subprocess.run(["sh", "-c", "echo $REMOTECUDA_RUN"], capture_output=True, text=True)
    print("SH", r.stdout.strip())
''')


def _lines(out: str) -> dict:
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line and line.split(" ", 1)[0].isupper())


def _remotecuda_run(args: list[str], cwd, env: dict | None = None, timeout: float = 240):
    e = dict(os.environ, REMOTECUDA_FALLBACK="error")
    e.pop("REMOTECUDA_SERVERS", None)
    e.update(env or {})
    e["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, e.get("PYTHONPATH")) if p)  # the children import remotecuda
    return subprocess.run([sys.executable, "-m", "remotecuda", "run", *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=cwd)


@pytest.fixture
def work_dir(tmp_path):
    (tmp_path / "work.py").write_text(WORK)
    (tmp_path / "parent.py").write_text(PARENT)
    return tmp_path


@pytest.fixture(scope="module")
def local_out():
    """WORK's line on the local CPU, without remotecuda."""
    r = subprocess.run([sys.executable, "-c", WORK, "cpu"], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith("REMOTECUDA")})
    assert r.returncode == 0, r.stderr
    return _lines(r.stdout)["OUT"]


def test_a_python_child_of_a_run_program_uses_cuda_as_the_program_does(gateway, work_dir, local_out):
    """``subprocess.run([sys.executable, "b.py"])`` and ``os.system("python b.py")`` under ``remotecuda
    run``: the child computes on the gateway what the CPU computes; one that calls ``activate()``
    itself still can; a child that never imports torch (``python -c pass``) runs as it does, without
    a word; nor does a shell (it sees the variable, nothing more)."""
    r = _remotecuda_run(["--server", gateway.address, "python", "parent.py"], work_dir)
    seen = _lines(r.stdout)
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    assert seen["WORK_RC"].strip() == "0", seen["WORK_RC"]
    assert seen["CUDA"] == "True cuda" and seen["OUT"] == local_out, r.stdout
    assert seen["SHELL_RC"] == "0 ['CUDA', 'True']", seen["SHELL_RC"]
    assert seen["SELF"].strip() == "0 2.0", seen["SELF"]  # (as the README said to: its activate() was half made)
    assert seen["PASS_RC"] == "0 ''" and seen["SH"] == "1", r.stdout


def test_a_child_with_its_own_sitecustomize_still_runs_it(gateway, work_dir, local_out):
    """A child whose environment has a ``sitecustomize`` of its own (a cluster's, a user's) runs it, as
    Python would have, and is activated too: remotecuda's stands in front of it and runs it."""
    (work_dir / "site").mkdir()
    (work_dir / "site" / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = __file__\n")
    (work_dir / "probe.py").write_text(
        "import os, runpy, sys, sitecustomize\n"
        "here = sitecustomize.__file__\n"
        "print('SITE', os.environ.get('SITE_RAN') == here, os.path.basename(here))\n"
        "sys.argv = ['work.py']\n"
        "runpy.run_path('work.py')\n")
    (work_dir / "own.py").write_text(
        "import os, subprocess, sys\n"
        "env = dict(os.environ, PYTHONPATH=os.environ['PYTHONPATH'] + os.pathsep + os.path.abspath('site'))\n"
        "r = subprocess.run([sys.executable, 'probe.py'], env=env, capture_output=True, text=True)\n"
        "print(r.stdout, r.stderr[-2000:], end='')\n")
    r = _remotecuda_run(["--server", gateway.address, "python", "own.py"], work_dir)
    seen = _lines(r.stdout)
    assert r.returncode == 0 and seen.get("SITE") == "True sitecustomize.py", (r.stdout, r.stderr[-3000:])
    assert seen["CUDA"] == "True cuda" and seen["OUT"] == local_out, r.stdout


TORCHRUN_TRAIN = textwrap.dedent('''
    import os, torch, torch.distributed as dist
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo")
    device = torch.device("cuda", local_rank)
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    model = model.to(device)
    x = torch.randn(8, 4, generator=g).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
    print("RANK", dist.get_rank(), dist.get_world_size(), torch.cuda.current_device(), x.device)
    print("LOSS", "%.6f" % loss.item())
    dist.destroy_process_group()
''')


def _single_process_loss() -> str:
    """TORCHRUN_TRAIN's loss on the local CPU, one process (world size 1: all_reduce keeps a gradient)."""
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(8, 4, generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return f"{loss.item():.6f}"


def test_torchrun_with_one_process_trains_on_cuda(gateway, tmp_path):
    """``remotecuda run torchrun --nproc_per_node 1 train.py``: the launcher is run in remotecuda's place
    and its worker is activated: LOCAL_RANK → ``set_device``, an env:// gloo process group on
    127.0.0.1, collectives on 'cuda' tensors; the loss is the CPU's."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("no torchrun next to this Python")
    (tmp_path / "train.py").write_text(TORCHRUN_TRAIN)
    with socket.socket() as s:  # (torchrun's static rendezvous takes a port, not 0)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _remotecuda_run(["--server", gateway.address, torchrun, "--nproc_per_node", "1", "--master_addr",
                         "127.0.0.1", "--master_port", str(port), "train.py"], tmp_path, env={"OMP_NUM_THREADS": "1"})
    seen = _lines(r.stdout)
    assert r.returncode == 0 and seen.get("RANK") == "0 1 0 cuda:0", (r.stdout, r.stderr[-3000:])
    assert seen["LOSS"] == _single_process_loss()


#: a program that starts a gateway of its own and a child that uses it
SERVE = textwrap.dedent('''
    import os, subprocess, sys
    gw = subprocess.Popen([sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0",
                           "--no-discovery", "--quiet"], stdout=subprocess.PIPE, text=True)
    address = gw.stdout.readline().split()[1].replace("tcp://", "")
    r = subprocess.run([sys.executable, "work.py"], capture_output=True, text=True,
                       env=dict(os.environ, REMOTECUDA_SERVERS=address))
    print(r.stdout, end="")
    print("WORK_RC", r.returncode, r.stderr[-2000:].replace("\\n", " | "))
    gw.terminate()
    gw.wait()
''')


def test_a_gateway_started_under_run_serves_its_clients(gateway, work_dir, local_out):
    """A gateway started under ``remotecuda run`` (by the program, or as the fallback of a child that
    found none) inherits the run's environment: its session workers, which import torch, must not
    activate remotecuda (their 'cuda' would be another gateway's) but serve the gateway's device."""
    (work_dir / "serve.py").write_text(SERVE)
    r = _remotecuda_run(["--server", gateway.address, "python", "serve.py"], work_dir)
    seen = _lines(r.stdout)
    assert r.returncode == 0 and seen["WORK_RC"].strip() == "0", (r.stdout, r.stderr[-3000:])
    assert seen["CUDA"] == "True cuda" and seen["OUT"] == local_out, r.stdout


#: spawned children as a DDP-style program and a DataLoader start them
SPAWNING = textwrap.dedent('''
    import torch, torch.multiprocessing as mp
    from torch.utils.data import DataLoader, TensorDataset


    def work(rank, queue):
        torch.cuda.set_device(rank)
        queue.put((torch.cuda.current_device(), torch.arange(4.0, device="cuda").pow(2).sum().item()))


    if __name__ == "__main__":
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(work, args=(queue,), nprocs=1)
        print("SPAWNED", *queue.get())
        loader = DataLoader(TensorDataset(torch.arange(8.0).view(4, 2)), batch_size=2, num_workers=1,
                            multiprocessing_context="spawn")
        print("BATCHES", [b.cuda().sum().item() for b, in loader])
''')


def test_spawned_children_of_a_run_program_use_cuda(gateway, tmp_path):
    """``torch.multiprocessing.spawn`` children (``torch.cuda.set_device(rank)`` first thing, as DDP-style
    programs do) are activated, as a GPU's see its CUDA devices; a DataLoader's spawned workers (also
    activated, at their ``import torch``) still load CPU batches, which the program moves."""
    (tmp_path / "spawning.py").write_text(SPAWNING)
    r = _remotecuda_run(["--server", gateway.address, "python", "spawning.py"], tmp_path)
    seen = _lines(r.stdout)
    assert r.returncode == 0 and seen.get("SPAWNED") == "0 14.0", (r.stdout, r.stderr[-3000:])
    assert seen["BATCHES"] == "[6.0, 22.0]"


#: a child that uses 'cuda' without activating remotecuda itself
ONES = "import torch; print(torch.ones(2, device='cuda').sum().item())"

#: a program that activates remotecuda itself (not under ``remotecuda run``) and starts Python children
ACTIVATING = textwrap.dedent('''
    import os, subprocess, sys, remotecuda
    child = [sys.executable, "-c", sys.argv[2]]

    def started(tag):
        r = subprocess.run(child, capture_output=True, text=True)
        print(tag, r.returncode, r.stdout.strip() or r.stderr.strip().splitlines()[-1])

    remotecuda.activate(sys.argv[1])
    import torch
    print("PARENT", torch.ones(3, device="cuda").sum().item())
    started("CHILD")
    pid = os.fork()  # (after CUDA's initialization: the forked child cannot use 'cuda', its own children can)
    if pid == 0:
        started("FORKED")
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
    remotecuda.deactivate()
    started("AFTER")
''')


def test_the_children_of_a_program_that_activates_itself_use_cuda(gateway, tmp_path):
    """``remotecuda.activate("host:port")`` in the program (or ``%load_ext remotecuda``), and then
    ``subprocess.run([sys.executable, "b.py"])``: the child uses the program's gateway at its
    ``import torch``, as under ``remotecuda run`` (it ran plain CPU torch: "Torch not compiled with
    CUDA enabled"); so does the child of a forked child; after ``deactivate()`` a child is plain again."""
    (tmp_path / "activating.py").write_text(ACTIVATING)
    e = {k: v for k, v in os.environ.items() if not k.startswith("REMOTECUDA")}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, e.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "activating.py", gateway.address, ONES], capture_output=True, text=True,
                       timeout=240, env=dict(e, REMOTECUDA_FALLBACK="error"), cwd=tmp_path)
    seen = _lines(r.stdout)
    assert r.returncode == 0 and seen.get("PARENT") == "3.0", (r.stdout, r.stderr[-3000:])
    assert seen["CHILD"] == "0 2.0" and seen["FORKED"] == "0 2.0", r.stdout
    assert seen["AFTER"].startswith("1 AssertionError: Torch not compiled with CUDA enabled"), r.stdout


#: a program on the local fallback gateway whose child reports where its 'cuda' is
FALLING_BACK = textwrap.dedent('''
    import os, subprocess, sys, warnings, remotecuda
    warnings.simplefilter("ignore")
    rt = remotecuda.activate(sys.argv[1])
    child = ("import torch, remotecuda; rt = remotecuda.activate(); "
             "print(torch.ones(2, device='cuda').sum().item(), rt.pool.devices[0].endpoint)")
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    print("CHILD", r.returncode, r.stdout.strip())
    print("WARNED", "no gateway is reachable" in r.stderr)
    print("FALLBACK", rt.pool.devices[0].endpoint)
''')


def test_children_of_a_program_on_the_fallback_gateway_share_it(tmp_path):
    """No gateway answers, REMOTECUDA_FALLBACK=cpu: the program runs on a local CPU gateway, and its
    Python children (here one that activates itself) use that one: each started one of its own, with
    its warning, seconds each."""
    (tmp_path / "falling_back.py").write_text(FALLING_BACK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    e = {k: v for k, v in os.environ.items() if not k.startswith("REMOTECUDA")}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, e.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "falling_back.py", nobody], capture_output=True, text=True, timeout=240,
                       env=dict(e, REMOTECUDA_FALLBACK="cpu"), cwd=tmp_path)
    seen = _lines(r.stdout)
    assert r.returncode == 0 and "FALLBACK" in seen, (r.stdout, r.stderr[-3000:])
    assert seen["CHILD"] == f"0 2.0 {seen['FALLBACK']}" and seen["WARNED"] == "False", r.stdout


def test_a_malformed_setting_under_a_launcher_is_run_s_usage_error(tmp_path):
    """``REMOTECUDA_STRATEGY=fastest remotecuda run torchrun ...``: one line and exit 2 from ``run``,
    before the launcher runs, as for a python program (each worker refused it at its ``import torch``,
    after the launcher had started them all)."""
    r = _remotecuda_run(["sh", "-c", f"echo ran; {sys.executable} -c \"{ONES}\""], tmp_path,
                        env={"REMOTECUDA_STRATEGY": "fastest"}, timeout=60)
    assert r.returncode == 2 and "ran" not in r.stdout and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert r.stderr.startswith("remotecuda run: REMOTECUDA_STRATEGY: unknown scheduling strategy 'fastest'")
