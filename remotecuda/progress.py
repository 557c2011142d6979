"""Progress of a long transfer: an upload or download still going after ``REMOTECUDA_PROGRESS``
seconds (default 2) shows a bar, which is removed when it ends; a shorter one shows nothing.

Large transfers move in parts (protocol.PART_BYTES, session.py), and the bar counts their bytes
as each part leaves (ZeroMQ lets go of it) or arrives. On a terminal, or in a Jupyter kernel
without ipywidgets, the bar is tqdm's text bar on stderr (a notebook shows it in the cell's
output, redrawn in place); in a Jupyter kernel with ipywidgets installed it is tqdm's notebook
widget. ipywidgets is not a dependency: the text bar needs nothing more.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import Any

#: seconds a transfer runs before its bar appears
AFTER = 2.0


def after() -> float | None:
    """``REMOTECUDA_PROGRESS``: the seconds before a bar appears (0: at once), or "off"; default AFTER."""
    value = os.environ.get("REMOTECUDA_PROGRESS", "").strip().lower()
    if not value:
        return AFTER
    if value in ("off", "no", "false", "none"):
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        raise ValueError(f"REMOTECUDA_PROGRESS={value!r}: seconds before a transfer shows progress, "
                         "or 'off'") from None


class Progress:
    """One transfer's progress in bytes: silent for its first ``after()`` seconds, then a bar."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self.start = time.monotonic()
        self.after = after()
        self.bar: Any = None

    def update(self, n: int, total: int | None = None) -> None:
        """``n`` more bytes moved; ``total``: the transfer's size, where it grew (a download learns
        each tensor's size from its first part)."""
        self.done += n
        if total is not None:
            self.total = total
        if self.bar is None:
            if self.after is None or time.monotonic() - self.start < self.after:
                return
            self.bar = _bar(self.what, self.total, self.done)
            return
        if total is not None and self.bar.total != total:
            self.bar.total = total
        self.bar.update(n)

    def close(self) -> None:
        """The transfer ended (or failed): remove the bar."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _bar(what: str, total: int, done: int) -> Any:
    options = dict(total=total, initial=done, desc=f"remotecuda {what}", unit="B", unit_scale=True,
                   unit_divisor=1024, leave=False)
    if _notebook_widgets():
        from tqdm.notebook import tqdm as notebook_tqdm
        return notebook_tqdm(**options)
    from tqdm import tqdm
    return tqdm(file=sys.stderr, dynamic_ncols=True, **options)


def _notebook_widgets() -> bool:
    """Whether this is a Jupyter kernel that can show ipywidgets (tqdm's notebook bar needs them)."""
    ipython = sys.modules.get("IPython")
    if ipython is None or importlib.util.find_spec("ipywidgets") is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})
