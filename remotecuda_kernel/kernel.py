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
        # through the extension manager, so %load_ext/%unload_ext/%reload_ext see it as loaded;
        # the extension also closes the gateway sessions on shutdown and restart
        self.shell.extension_manager.load_extension("remotecuda")
        from remotecuda.ipython import extension
        ext = extension(self.shell)
        if ext is not None:
            ext.defer_notices()  # e.g. "no gateway reachable": shown in the first cell

    @property
    def banner(self) -> str:  # type: ignore[override]
        return (super().banner + f"\n{DISPLAY_NAME} {remotecuda.__version__}: 'cuda' runs on "
                "RemoteCUDA gateways; %remotecuda status shows them.\n")
