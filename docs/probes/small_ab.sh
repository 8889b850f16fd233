#!/bin/bash
# A/B: baseline tree $BASE (a checkout, e.g. git worktree add /tmp/base 9f8230c) vs $1 (default /work/main), alternating, N writes each
T=${1:-/work/main}; R=${2:-3}
for i in $(seq $R); do
  for tree in ${BASE:-/tmp/base} $T; do
    echo -n "$(basename $tree): "; TREE=$tree timeout 200 ${PY:-python} $(dirname $0)/small_cpu.py 4000 2>/dev/null | head -1
  done
done
