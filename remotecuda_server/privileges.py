"""What a session worker gives up before it serves a client: least privilege.

A worker runs a client's ops. The op allowlist and its guards (ops.py, guards.py) are the
defence; these limits are for when one fails, so that a worker a client took over can do as
little as possible beyond its own session:

- **no new privileges** (``PR_SET_NO_NEW_PRIVS``): nothing it executes gains privileges from a
  setuid or setgid bit or file capabilities; inherited by every process it starts;
- **no core dumps** (``RLIMIT_CORE`` 0): a crash does not write the session's tensors to disk;
- **a bounded number of open files** (``RLIMIT_NOFILE``, soft and hard, ``NOFILE``): the
  supervisor raises its own limit for its connections, and a worker would inherit that;
- **a private temporary directory** (``TMPDIR``, mode 0700, under the supervisor's own private
  directory): what torch or a library writes to the temp directory is the session's alone, and
  the supervisor removes it when the worker has exited, however it ended.

Linux only, where the calls exist; elsewhere each is skipped.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import sys

#: open files a worker may hold: its sockets (its client's connections, copies between workers),
#: the libraries' files; a few hundred in practice
NOFILE = 4096
_PR_SET_NO_NEW_PRIVS = 38


def drop() -> None:
    """Give up, in this process (a session worker, at its start), what it does not need."""
    no_new_privs()
    try:
        import resource
    except ImportError:  # (not a Unix)
        return
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    bound = NOFILE if hard == resource.RLIM_INFINITY else min(NOFILE, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (bound, bound))


def no_new_privs() -> bool:
    """``prctl(PR_SET_NO_NEW_PRIVS, 1)``; whether it is set."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0


def private_tmp(parent: str, name: str) -> str:
    """A new temporary directory for one worker, readable by its user alone: its TMPDIR."""
    path = os.path.join(parent, f"tmp-{name}")
    os.mkdir(path, 0o700)
    return path


def remove_tmp(path: str) -> None:
    """A worker's temporary directory and what it left there (the worker has exited)."""
    shutil.rmtree(path, ignore_errors=True)
