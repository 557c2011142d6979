#!/usr/bin/env bash
# GPU check for sessions lent a GPU machine (finishes within ~8 minutes):
# a gateway with --device cuda, and a client with CUDA hidden from it on the same machine,
# remote vs local figures (gpu_bench.py) and results (gpu_parity.py).
# GPU_CHECK_PARTS=parity,bench-local,bench-remote (default all) runs only the parts named; the
# table needs "$OUT/local.json", from this run or an earlier one. Needs pyzmq and zstandard importable (carry wheels if absent;
# see the device tool's README), run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-benchmarks/_out}
mkdir -p "$OUT"
"$PY" -m remotecuda start --device cuda --port 0 --no-discovery > "$OUT/gateway.log" 2>&1 &
GW=$!
trap 'kill $GW 2>/dev/null || true' EXIT
for _ in $(seq 1200); do grep -q '^READY ' "$OUT/gateway.log" && break; sleep 0.1; done
cat "$OUT/gateway.log"
ADDR=$(grep '^READY ' "$OUT/gateway.log" | sed 's|READY tcp://||')
PARTS=${GPU_CHECK_PARTS:-parity,bench-local,bench-remote}
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
if [[ ,$PARTS, == *,parity,* ]]; then
  stamp parity
  timeout 240 "$PY" benchmarks/gpu_parity.py --mode local > "$OUT/parity_local.json" || true
  CUDA_VISIBLE_DEVICES="" timeout 240 "$PY" benchmarks/gpu_parity.py --mode remote --server "$ADDR" \
    > "$OUT/parity_remote.json" || true
  "$PY" benchmarks/gpu_parity.py --compare "$OUT/parity_local.json" "$OUT/parity_remote.json" || true
fi
if [[ ,$PARTS, == *,bench-local,* ]]; then
  stamp bench local
  timeout 240 "$PY" benchmarks/gpu_bench.py --mode local | tee "$OUT/local.json"
fi
[[ ,$PARTS, == *,bench-remote,* ]] || exit 0
stamp bench remote
CUDA_VISIBLE_DEVICES="" timeout 300 "$PY" benchmarks/gpu_bench.py --mode remote --server "$ADDR" | tee "$OUT/remote.json"
stamp done
"$PY" - "$OUT/local.json" "$OUT/remote.json" <<'PYEOF'
import json, sys
local, remote = (json.loads(open(p).read().strip().splitlines()[-1]) for p in sys.argv[1:3])
print(f"{'figure':28s} {'local':>10s} {'remote':>10s} {'remote/local':>12s}")
for k in local:
    if isinstance(local[k], float):
        print(f"{k:28s} {local[k]:10.2f} {remote[k]:10.2f} {remote[k] / local[k]:12.3f}")
PYEOF
