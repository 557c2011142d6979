"""RemoteCUDAKernel: an IPythonKernel that only sets its identity and loads the extension."""
from __future__ import annotations

from typing import Any

from ipykernel.ipkernel import IPythonKernel

import remotecuda

from . import DISPLAY_NAME


class RemoteCUDAKernel(IPythonKernel):
    implementation = "remotecuda"  # the panel recognises the kernel by kernel_info's implementation
    implementation_version = remotecuda.__version__

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        # activated at the first execution, so the kernel is idle in ipykernel's time, not after
        # torch's import; what activation says (e.g. "no gateway reachable") shows in that cell.
        # Marked loaded, so %load_ext/%unload_ext/%reload_ext see it; the extension also closes
        # the gateway sessions on shutdown and restart
        from remotecuda.ipython import load_ipython_extension
        shell: Any = self.shell
        load_ipython_extension(shell, defer_activation=True)
        shell.extension_manager.loaded.add("remotecuda")

    @property
    def banner(self) -> str:  # type: ignore[override]
        return (super().banner + f"\n{DISPLAY_NAME} {remotecuda.__version__}: 'cuda' runs on "
                "RemoteCUDA gateways; %remotecuda status shows them.\n")
