#!/usr/bin/env bash
# Set up, start a local gateway on whatever device this machine has, and train a model through it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e .
.venv/bin/remotecuda start --port 0 --no-discovery > .demo-gateway.log 2>&1 &
GW=$!
trap 'kill $GW 2>/dev/null' EXIT
for _ in $(seq 600); do grep -q '^READY ' .demo-gateway.log 2>/dev/null && break; sleep 0.1; done
cat .demo-gateway.log | grep -v '^READY'
ADDR=$(grep '^READY ' .demo-gateway.log | sed 's|READY tcp://||')
.venv/bin/remotecuda run --server "$ADDR" python examples/train_mlp.py
