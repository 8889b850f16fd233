#!/bin/bash
# A/B of the RPC figures: baseline tree $BASE (e.g. git worktree add --detach /tmp/rpc4base main,
# ln -s $PWD/.venv /tmp/rpc4base/.venv) vs this checkout, alternating rounds, one venv.
# Usage: BASE=/tmp/rpc4base docs/probes/batch_ab.sh OUTDIR [ROUNDS] [BENCHMARKS]
OUT=$1; R=${2:-2}; ONLY=${3:-batching,latency,scale_clients}; NEW=$(pwd); PY=$NEW/.venv/bin/python
mkdir -p "$OUT"
for r in $(seq "$R"); do
  for tree in "${BASE:?set BASE}" "$NEW"; do
    name=$( [ "$tree" = "$NEW" ] && echo new || echo base )
    echo "$(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) $name round $r" >> "$OUT/log"
    # PYTHONPATH reaches the daemons too: each arm runs its own tree's client and daemon.
    (cd "$tree" && PYTHONPATH=$tree $PY -m benchmarks --only "$ONLY" \
        --json "$OUT/$name-$r.json" > "$OUT/$name-$r.txt" 2>&1)
  done
done
echo "$(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) end" >> "$OUT/log"
