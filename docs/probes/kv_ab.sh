#!/bin/bash
# A/B of a workloads figure: `python -m benchmarks --only $BENCH` (default workloads_kv;
# BENCH=workloads_moe for the MoE one) of $BASE (a baseline checkout, e.g. git worktree
# add --detach /tmp/kvbase main) and $1 (default /work/main), alternating, ROUNDS ($2,
# default 2) each; records in /tmp/$BENCH-ab-NAME-ROUND.json (workloads_kv: /tmp/kvab-...).
# Each tree's daemons and roles run its own code (PYTHONPATH), with $PY (default this
# checkout's venv python).
T=${1:-/work/main}; R=${2:-2}; PY=${PY:-$(pwd)/.venv/bin/python}; B=${BENCH:-workloads_kv}
if [ "$B" = workloads_kv ]; then J=/tmp/kvab; KEEP="^transferd|^plain|late:"; N=12
else J=/tmp/$B-ab; KEEP="^4 |^8 |x  *[0-9.]*x|^MISS|^PASS|load average"; N=40; fi
for r in $(seq $R); do
  for t in ${BASE:-/tmp/kvbase} $T; do
    n=$(basename $t)
    echo "== round $r $n $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $t && PYTHONPATH=$t $PY -m benchmarks --only $B --json $J-$n-$r.json \
      2>&1 | grep -E "$KEEP" | head -$N)
  done
done
echo "== end $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
