#!/usr/bin/env bash
# Set up a virtual environment from scratch, lint, type-check, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0          # the CPU build; unpinned pulls CUDA (GBs)
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/ruff check remotecuda remotecuda_wire remotecuda_server remotecuda_kernel tests benchmarks  # lint first: rules in pyproject.toml
.venv/bin/mypy  # types of the modules listed in pyproject.toml's [tool.mypy]
exec .venv/bin/python -m pytest -ra "$@"
