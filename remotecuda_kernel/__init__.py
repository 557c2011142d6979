"""The "Python (RemoteCUDA)" Jupyter kernel: an IPython kernel with ``%load_ext remotecuda``
already done, so ``torch.cuda`` means the RemoteCUDA gateways from the first cell.

    python -m remotecuda_kernel install [--user | --sys-prefix | --prefix PREFIX]
"""
from __future__ import annotations

from remotecuda_wire._version import __version__

__all__ = ["__version__", "KERNEL_NAME", "DISPLAY_NAME"]
KERNEL_NAME = "remotecuda"
DISPLAY_NAME = "Python (RemoteCUDA)"
