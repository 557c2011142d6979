"""Helper processes that must not outlive the process that started them."""
from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """Ask the kernel to send this process SIGTERM when its parent ends (Linux' PR_SET_PDEATHSIG;
    elsewhere nothing). Called in the child: a local fallback gateway, a gateway's session worker."""
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        except OSError:
            pass
