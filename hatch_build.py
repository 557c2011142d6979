"""Build the JupyterLab extension (labextension/, TypeScript) into remotecuda/labextension, which
the wheel installs as a prebuilt extension (share/jupyter/labextensions/remotecuda-labextension).

Runs for every wheel, editable ones included (``pip install .``, ``pip install -e .``), as a
hatchling build hook; needs node and npm, and ``jupyterlab`` (a build requirement: its
``staging/package.json`` says which JupyterLab packages are shared, as ``jupyter labextension
build`` would). Without npm an extension built before is used. Developers rebuild by hand with

    python hatch_build.py [--development]
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SOURCE = ROOT / "labextension"
OUTPUT = ROOT / "remotecuda" / "labextension"


def build(development: bool = False) -> None:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        if (OUTPUT / "package.json").is_file():
            print("remotecuda: no node/npm; using the JupyterLab extension built before", file=sys.stderr)
            return
        raise RuntimeError("building the JupyterLab extension (labextension/) needs node and npm")
    if not (SOURCE / "node_modules" / "@jupyterlab" / "builder").is_dir():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=SOURCE, check=True)
    subprocess.run([node, str(SOURCE / "node_modules" / "typescript" / "bin" / "tsc"), "-p", str(SOURCE)],
                   check=True)
    import jupyterlab
    staging = Path(jupyterlab.__file__).parent / "staging"
    subprocess.run([node, str(SOURCE / "node_modules" / "@jupyterlab" / "builder" / "lib" / "build-labextension.js"),
                    "--core-path", str(staging), *(["--development"] if development else []), str(SOURCE)],
                   check=True, env=dict(os.environ, NODE_ENV="development" if development else "production"))


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run as a script, outside a build
    pass
else:
    class LabExtensionHook(BuildHookInterface):
        PLUGIN_NAME = "custom"

        def initialize(self, version: str, build_data: dict) -> None:
            if self.target_name == "wheel":
                build(development=version == "editable")


if __name__ == "__main__":
    build(development="--development" in sys.argv[1:])
