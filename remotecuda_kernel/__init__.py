"""The "Python (RemoteCUDA)" Jupyter kernel: an IPython kernel with ``%load_ext remotecuda``
already done, so ``torch.cuda`` means the RemoteCUDA gateways from the first cell.

    python -m remotecuda_kernel install [--user | --sys-prefix | --prefix PREFIX]
"""
from __future__ import annotations

__version__ = "0.1.0"
KERNEL_NAME = "remotecuda"
DISPLAY_NAME = "Python (RemoteCUDA)"
