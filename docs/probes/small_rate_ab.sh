#!/bin/bash
T=${1:-/work/main}; R=${2:-4}
for i in $(seq $R); do
  for tree in ${BASE:-/tmp/base} $T; do
    echo -n "$(basename $tree): "; TREE=$tree timeout 120 ${PY:-python} $(dirname $0)/small_rate.py 2>/dev/null | head -1
  done
done
