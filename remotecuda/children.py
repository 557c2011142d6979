"""What the processes a program starts are told of its activation.

A child that activates remotecuda itself (a ``torch.multiprocessing.spawn`` worker, a script run
by ``subprocess``, a DataLoader worker of the 'spawn' context, a forked child of a program that
used 'cuda') reads its configuration from the environment. A program that configured its
activation by arguments (``activate("host:port", devices="2", strategy="memory-aware")``) has
none there, so its children would find other gateways (multicast), see another number of
devices, be placed by another strategy: on a GPU machine a child sees the GPUs its parent sees.
So each option given by argument is set in the environment the children inherit, as
``remotecuda run --server`` does, while the activation lasts (``tell``); a forked child keeps it
for good (``tell_forked``: it undoes the parent's interception, and with it ``tell``'s
variables). A variable the user set is left as it is.

A child that does not activate itself (``subprocess.run([sys.executable, "b.py"])``, torchrun's
workers) is activated at its first ``import torch`` (``tell_run``), whether the program was started
by ``remotecuda run`` or called ``activate()`` itself (``%load_ext remotecuda``): on a GPU machine
every process sees the GPUs. And a program that runs on a local fallback CPU gateway tells its
children that gateway's address: each would otherwise start one of its own (seconds, and memory,
per child), and a GPU machine's processes share its GPUs.
"""
from __future__ import annotations

import os
import sys
import types
from collections.abc import Mapping, MutableMapping
from typing import Any

#: what each ``activate()`` option is called in the environment
VARIABLES = {"servers": "REMOTECUDA_SERVERS", "devices": "REMOTECUDA_DEVICES", "strategy": "REMOTECUDA_STRATEGY",
             "fallback": "REMOTECUDA_FALLBACK", "sync": "REMOTECUDA_SYNC", "replay": "REMOTECUDA_REPLAY"}


#: in the environment of an activated program: the Python processes it starts activate
RUN = "REMOTECUDA_RUN"
#: the directory, put first on their PYTHONPATH, whose ``sitecustomize.py`` activates them
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_site")


def settings(servers: str | list[str] | None, devices: str | None, strategy: str | None, fallback: str | None,
             sync: bool | None, replay: bool | None = None) -> dict[str, str]:
    """The environment variables that say the options ``activate()`` was given (None: not given,
    the environment's or the default applies, and the children inherit that already)."""
    given = {"servers": servers if isinstance(servers, str) or servers is None else ",".join(servers),
             "devices": devices, "strategy": strategy, "fallback": fallback,
             "sync": None if sync is None else "1" if sync else "0",
             "replay": None if replay is None else "1" if replay else "0"}
    return {VARIABLES[k]: v for k, v in given.items() if v}


def variables(told: dict[str, str], fallback: str | None, env: Mapping[str, str]) -> dict[str, str]:
    """What ``env`` is given so that the processes started with it activate as this activation:
    ``told`` (the options given by argument) where ``env`` has no value of the user's, the local
    fallback gateway's address as REMOTECUDA_SERVERS (``fallback``; the servers named, if any,
    did not answer), and ``tell_run``'s variables."""
    given = {name: value for name, value in told.items() if name not in env}
    if fallback is not None:
        given[VARIABLES["servers"]] = fallback
    run = dict(env)
    tell_run(run)
    given.update({name: run[name] for name in (RUN, "PYTHONPATH") if env.get(name) != run[name]})
    return given


def tell(patches: Any, told: dict[str, str], fallback: str | None) -> None:
    """Set ``variables`` in the environment while interception is installed (undone with it)."""
    for name, value in variables(told, fallback, os.environ).items():
        patches.set_item(os.environ, name, value)


def tell_forked(told: dict[str, str], fallback: str | None) -> None:
    """In a child forked from an activation that was told: keep ``variables`` in the environment for
    good (the parent's fallback gateway serves the child's children while the parent lives)."""
    os.environ.update(variables(told, fallback, os.environ))


def tell_run(env: MutableMapping[str, str]) -> None:
    """Make every Python process started with ``env`` (and their own children, which inherit it)
    activate as a ``remotecuda run`` program, at its first ``import torch`` (run_site/sitecustomize.py):
    ``subprocess``, ``os.system``, ``torchrun``'s and ``accelerate launch``'s workers, spawned
    ``multiprocessing`` children all see 'cuda' as the program does."""
    env[RUN] = "1"
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if SITE not in entries:
        env["PYTHONPATH"] = os.pathsep.join([SITE, *entries])


def untell_run(env: MutableMapping[str, str]) -> None:
    """Undo ``tell_run`` in ``env``: a gateway started under ``remotecuda run`` (the fallback CPU
    gateway, a program's own ``remotecuda start``) serves 'cuda'; its workers are no programs of it."""
    env.pop(RUN, None)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE]
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        env.pop("PYTHONPATH", None)


def activate_run_child() -> None:
    """In a process started under ``remotecuda run`` that has just imported torch: activate as the
    program was activated (its settings are in the environment: ``--server`` as REMOTECUDA_SERVERS,
    the others as the user set them). An error (no gateway, with REMOTECUDA_FALLBACK=error) is
    raised by the ``import torch``, as it is by the program's activation."""
    if os.environ.get(RUN) and not _imported_by_remotecuda(sys._getframe(1)):
        import remotecuda
        remotecuda.activate()


def _imported_by_remotecuda(frame: types.FrameType | None) -> bool:
    """Whether remotecuda's own code is importing torch (a frame of its packages' modules below
    ``frame``): ``activate()``, which then activates with its own arguments (a child's explicit
    ``activate(...)``, ``remotecuda run`` itself), or a module of remotecuda's imported for its own
    use. Activating there would run inside that module's import, half made (its names not there
    yet: "partially initialized module 'remotecuda.interception'")."""
    while frame is not None:
        if frame.f_globals.get("__name__", "").partition(".")[0] in _PACKAGES:
            return True
        frame = frame.f_back
    return False


#: remotecuda's packages (pyproject.toml's wheel)
_PACKAGES = ("remotecuda", "remotecuda_wire", "remotecuda_server", "remotecuda_kernel")
