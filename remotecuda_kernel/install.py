"""Install the "Python (RemoteCUDA)" kernelspec.

    python -m remotecuda_kernel install [--user | --sys-prefix | --prefix PREFIX]
                                        [--name NAME] [--display-name NAME]

``pip install remotecuda`` already puts the kernelspec into
``<prefix>/share/jupyter/kernels/remotecuda`` (with ``python`` as argv[0], which Jupyter
replaces by its own interpreter); this command is for other places, e.g. a user-level
kernelspec for a Jupyter that runs in another environment. It writes this interpreter's
path into kernel.json, as ``python -m ipykernel install`` does.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from . import DISPLAY_NAME, KERNEL_NAME

HERE = os.path.dirname(os.path.abspath(__file__))


def spec_source() -> str | None:
    """The kernelspec folder: the source checkout's kernelspec/remotecuda (editable install)
    or the copy pip put under sys.prefix."""
    for d in (os.path.join(os.path.dirname(HERE), "kernelspec", KERNEL_NAME),
              os.path.join(sys.prefix, "share", "jupyter", "kernels", KERNEL_NAME)):
        if os.path.isfile(os.path.join(d, "kernel.json")):
            return d
    return None


def kernel_dict(display_name: str = DISPLAY_NAME, executable: str | None = None) -> dict:
    src = spec_source()
    if src is not None:
        with open(os.path.join(src, "kernel.json")) as f:
            spec = json.load(f)
    else:
        spec = {"argv": ["python", "-m", "remotecuda_kernel", "-f", "{connection_file}"],
                "language": "python", "interrupt_mode": "signal", "metadata": {"debugger": True}}
    spec["display_name"] = display_name
    spec["argv"][0] = executable or sys.executable
    return spec


def install(user: bool = False, prefix: str | None = None, name: str = KERNEL_NAME,
            display_name: str = DISPLAY_NAME) -> str:
    """Install the kernelspec; return the folder it went to."""
    from jupyter_client.kernelspec import KernelSpecManager
    with tempfile.TemporaryDirectory() as td:
        os.chmod(td, 0o755)
        with open(os.path.join(td, "kernel.json"), "w") as f:
            json.dump(kernel_dict(display_name), f, indent=1)
        src = spec_source()
        if src is not None:
            for logo in ("logo-32x32.png", "logo-64x64.png"):
                if os.path.isfile(os.path.join(src, logo)):
                    shutil.copy(os.path.join(src, logo), td)
        return KernelSpecManager().install_kernel_spec(td, name, user=user, prefix=prefix)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m remotecuda_kernel install",
                                 description="Install the Python (RemoteCUDA) kernelspec.")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="into the user's Jupyter folder")
    where.add_argument("--sys-prefix", action="store_true", help=f"into {sys.prefix}")
    where.add_argument("--prefix", help="into PREFIX/share/jupyter/kernels")
    ap.add_argument("--name", default=KERNEL_NAME, help=f"kernelspec name (default {KERNEL_NAME})")
    ap.add_argument("--display-name", default=DISPLAY_NAME)
    a = ap.parse_args(argv)
    prefix = sys.prefix if a.sys_prefix else a.prefix
    user = a.user or (prefix is None and not _is_root())
    dest = install(user=user, prefix=prefix, name=a.name, display_name=a.display_name)
    print(f"Installed kernelspec {a.name} in {dest}")
    return 0


def _is_root() -> bool:
    try:
        return os.geteuid() == 0
    except AttributeError:
        return False


if __name__ == "__main__":
    sys.exit(main())
