"""``python -m remotecuda_kernel -f CONNECTION_FILE`` starts the kernel (what kernel.json runs);
``python -m remotecuda_kernel install ...`` installs the kernelspec."""
from __future__ import annotations

import sys


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "install":
        from .install import main as install_main
        sys.exit(install_main(sys.argv[2:]))
    from ipykernel.kernelapp import IPKernelApp

    from .kernel import RemoteCUDAKernel
    IPKernelApp.launch_instance(kernel_class=RemoteCUDAKernel)


if __name__ == "__main__":
    main()
