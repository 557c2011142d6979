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
"""
from __future__ import annotations

import os
from typing import Any

#: what each ``activate()`` option is called in the environment
VARIABLES = {"servers": "REMOTECUDA_SERVERS", "devices": "REMOTECUDA_DEVICES", "strategy": "REMOTECUDA_STRATEGY",
             "fallback": "REMOTECUDA_FALLBACK", "sync": "REMOTECUDA_SYNC", "replay": "REMOTECUDA_REPLAY"}


def settings(servers: str | list[str] | None, devices: str | None, strategy: str | None, fallback: str | None,
             sync: bool | None, replay: bool | None = None) -> dict[str, str]:
    """The environment variables that say the options ``activate()`` was given (None: not given,
    the environment's or the default applies, and the children inherit that already)."""
    given = {"servers": servers if isinstance(servers, str) or servers is None else ",".join(servers),
             "devices": devices, "strategy": strategy, "fallback": fallback,
             "sync": None if sync is None else "1" if sync else "0",
             "replay": None if replay is None else "1" if replay else "0"}
    return {VARIABLES[k]: v for k, v in given.items() if v}


def tell(patches: Any, told: dict[str, str]) -> None:
    """Set ``told`` in the environment while interception is installed (undone with it)."""
    for name, value in told.items():
        if name not in os.environ:
            patches.set_item(os.environ, name, value)


def tell_forked(told: dict[str, str]) -> None:
    """In a child forked from an activation that was ``told``: keep it in the environment for good."""
    for name, value in told.items():
        os.environ.setdefault(name, value)
