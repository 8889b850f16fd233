#!/usr/bin/env bash
# `make gpu-check`: the GPU tests and GPU benchmarks, and a short report under
# $OUT (markdown and JSON; ./gpu-check-out when $OUT is unset).
#
# Runs with this machine's own python3 (or $PYTHON) and its packages, the
# checkout on the path: nothing is installed, no virtual environment is
# needed.  Without a CUDA device, or with --dry-run, it exercises its own
# plumbing and says plainly that nothing ran on a GPU.  Every section runs in
# its own process under its own time limit (scripts/gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
missing=$("$PY" - <<'PYEOF'
import importlib.util
need = ["numpy", "uvloop", "msgpack", "click", "prometheus_client", "pytest"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PYEOF
)
if [ -n "$missing" ]; then
  echo "gpu-check: $PY lacks: $missing (this script installs nothing)" | tee "$OUT/gpu-check.txt"
  exit 2
fi
{
  echo "== gpu-check $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), $("$PY" --version 2>&1)"
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
} | tee "$OUT/gpu-check.txt"
timeout 470 "$PY" scripts/gpu_check.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/gpu-check.txt"
exit "${PIPESTATUS[0]}"
