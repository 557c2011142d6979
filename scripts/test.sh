#!/usr/bin/env bash
# Set up a virtual environment from scratch, lint, type-check, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0          # the CPU build; unpinned pulls CUDA (GBs)
# the JupyterLab extension's npm packages (package-lock.json), before pip: the build hook (hatch_build.py) uses them
[ labextension/node_modules/.package-lock.json -nt labextension/package-lock.json ] \
    || (cd labextension && npm ci --no-audit --no-fund --loglevel=error)
.venv/bin/python -m pip install -q -e '.[test]'    # builds the extension into the wheel, registers the kernel
(cd labextension && npm test --silent)             # the panel's TypeScript unit tests (vitest)
.venv/bin/ruff check remotecuda remotecuda_wire remotecuda_server remotecuda_kernel tests benchmarks  # lint first: rules in pyproject.toml
.venv/bin/mypy  # types of the modules listed in pyproject.toml's [tool.mypy]
exec .venv/bin/python -m pytest -ra --durations=30 -n 2 --dist loadfile "$@"
