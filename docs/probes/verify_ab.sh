#!/bin/bash
# A/B of engine_verify: baseline tree $BASE vs $1, alternating, R runs each
T=${1:-/work/main}; R=${2:-3}
for i in $(seq $R); do
  for tree in ${BASE:-/tmp/base} $T; do
    echo "$(basename $tree): $(cd $tree && TRANSFERD_BENCH_VENV=/work/bench-venv timeout 300 /work/main/.venv/bin/python -m benchmarks --only engine_verify 2>&1 | sed -n 11,12p | tr -s ' ' | tr '\n' ' ')"
  done
done
