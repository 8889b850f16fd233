#!/bin/bash
# A/B of the KV figure: `python -m benchmarks --only workloads_kv` of $BASE (a baseline
# checkout, e.g. git worktree add --detach /tmp/kvbase main) and $1 (default /work/main),
# alternating, ROUNDS ($2, default 2) each; records in /tmp/kvab-NAME-ROUND.json.
# Each tree's daemons and roles run its own code (PYTHONPATH), with $PY (default this
# checkout's venv python).
T=${1:-/work/main}; R=${2:-2}; PY=${PY:-$(pwd)/.venv/bin/python}
for r in $(seq $R); do
  for t in ${BASE:-/tmp/kvbase} $T; do
    n=$(basename $t)
    echo "== round $r $n $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $t && PYTHONPATH=$t $PY -m benchmarks --only workloads_kv --json /tmp/kvab-$n-$r.json \
      2>&1 | grep -E "^transferd|^plain|late:" | head -12)
  done
done
echo "== end $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
