#!/usr/bin/env bash
# Runs everything that needs a CUDA device, on a machine that has one, and
# writes the results under $OUT (or ./out): `make gpu-check`.
# On a machine without a GPU the GPU tests skip with their reason.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=.venv/bin/python
{
  echo "== $(date -u) $(hostname)"
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
} | tee "$OUT/gpu-check.txt"
if ! $PY -c "import cupy" 2>/dev/null; then
  echo "installing the gpu extra (cupy-cuda12x)" | tee -a "$OUT/gpu-check.txt"
  $PY -m pip install -q -e '.[gpu,dev]' 2>&1 | tail -2 | tee -a "$OUT/gpu-check.txt"
fi
$PY -m pytest -q -m gpu -rs --junitxml="$OUT/gpu-junit.xml" tests 2>&1 | tee -a "$OUT/gpu-check.txt"
rc=${PIPESTATUS[0]}
# pytest exits 5 when no test was collected: that is not a failure of this script.
[ "$rc" = 5 ] && rc=0
exit "$rc"
