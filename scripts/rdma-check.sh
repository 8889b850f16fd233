#!/usr/bin/env bash
# `make rdma-check`: the tests that need RDMA (tests/rdma/: the engine and rdma:// suites) and the Domain conformance suite (tests/domains/, verbs among its Domains) over real verbs, and a report.
#
# Where the devices come from, first that works:
#   1. TRANSFERD_RDMA_DEVICES=dev_a,dev_b given: those (daemon a uses the first, b the second)
#   2. real NICs with an ACTIVE port (`transferd devices`): the first one for both daemons
#   3. soft-RoCE: rdma_rxe on a veth pair in two network namespaces this script creates
#      (198.18.0.1/30 and 198.18.0.2/30; RDMA devices are shared across namespaces), or
#      on loopback when veth cannot be made; torn down on exit
# Otherwise it stops and says why.  Report: $OUT/rdma-check.md and $OUT/rdma-check.json
# (OUT defaults to out/rdma).
#
# Exit: 0 every test passed; 1 a test failed; 10 pyverbs cannot be imported (make rdma-deps);
# 11 no RDMA device and no soft-RoCE module in this kernel; 12 soft-RoCE needs root and the
# `rdma` and `ip` tools (iproute2); 13 a soft-RoCE device was made but no port came up.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/rdma}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
MD="$OUT/rdma-check.md"
JSON="$OUT/rdma-check.json"
NS_A=transferd-rdma-a
NS_B=transferd-rdma-b
MADE=()

report() {  # status code, reason, devices, how
  local code=$1 reason=$2 devices=${3:-} how=${4:-}
  {
    echo "# rdma-check $(date -u +%FT%TZ) on $(hostname)"
    echo
    echo "- kernel: $(uname -r)"
    echo "- devices: ${devices:-none}"
    echo "- source: ${how:-none}"
    echo "- exit: $code"
    echo "- result: $reason"
    if [ -f "$OUT/pytest.txt" ]; then echo; echo '```'; tail -40 "$OUT/pytest.txt"; echo '```'; fi
    echo
    echo '## transferd devices'
    echo '```'
    cat "$OUT/devices.txt" 2>/dev/null
    echo '```'
  } > "$MD"
  $PY - "$code" "$reason" "$devices" "$how" "$OUT" > "$JSON" <<'PYEOF'
import json, pathlib, sys
code, reason, devices, how, out = sys.argv[1:]
devs = pathlib.Path(out, "devices.json")
print(json.dumps({"exit": int(code), "result": reason, "devices": devices.split(",") if devices else [],
                  "source": how, "discovery": json.loads(devs.read_text()) if devs.exists() else None},
                 indent=2))
PYEOF
  echo "rdma-check: $reason (exit $code; report in $MD)"
}

cleanup() {
  for dev in "${MADE[@]}"; do rdma link delete "$dev" 2>/dev/null; done
  ip netns del "$NS_A" 2>/dev/null
  ip netns del "$NS_B" 2>/dev/null
}
trap cleanup EXIT

bash scripts/rdma-deps.sh --link >/dev/null 2>&1
if ! $PY -c 'import pyverbs.device' 2>/dev/null; then
  report 10 "pyverbs cannot be imported into $PY: run make rdma-deps (docs/rdma.md)"
  exit 10
fi

discover() {
  $PY -m transferd.cli devices > "$OUT/devices.txt" 2>&1
  $PY -m transferd.cli devices --json > "$OUT/devices.json" 2>/dev/null
}

active_devices() {
  $PY - "$OUT/devices.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(",".join(d["name"] for d in r["devices"] if any(p["state"] == "ACTIVE" for p in d["ports"])))
PYEOF
}

discover
HOW=given
DEVICES=${TRANSFERD_RDMA_DEVICES:-}
if [ -z "$DEVICES" ]; then
  DEVICES=$(active_devices)
  HOW="real NICs"
fi
if [ -z "$DEVICES" ]; then
  # Soft-RoCE.
  if ! { [ -d /sys/module/rdma_rxe ] || modprobe rdma_rxe 2>/dev/null; }; then
    report 11 "no RDMA device here and no soft-RoCE: $(grep -m1 '^why:' "$OUT/devices.txt" | cut -c6-)"
    exit 11
  fi
  if [ "$(id -u)" != 0 ] || ! command -v rdma >/dev/null || ! command -v ip >/dev/null; then
    report 12 "soft-RoCE needs root and the rdma and ip tools (iproute2)"
    exit 12
  fi
  HOW="soft-RoCE on veth in network namespaces"
  if ip netns add "$NS_A" 2>/dev/null && ip netns add "$NS_B" 2>/dev/null \
     && ip link add td-rdma-a netns "$NS_A" type veth peer name td-rdma-b netns "$NS_B"; then
    ip -n "$NS_A" addr add 198.18.0.1/30 dev td-rdma-a && ip -n "$NS_A" link set td-rdma-a up
    ip -n "$NS_B" addr add 198.18.0.2/30 dev td-rdma-b && ip -n "$NS_B" link set td-rdma-b up
    ip netns exec "$NS_A" rdma link add td_rxe_a type rxe netdev td-rdma-a && MADE+=(td_rxe_a)
    ip netns exec "$NS_B" rdma link add td_rxe_b type rxe netdev td-rdma-b && MADE+=(td_rxe_b)
    DEVICES=td_rxe_a,td_rxe_b
  else
    HOW="soft-RoCE on loopback"
    rdma link add td_rxe_lo type rxe netdev lo && MADE+=(td_rxe_lo)
    DEVICES=td_rxe_lo
  fi
  sleep 1
  discover
  if [ -z "$(active_devices)" ]; then
    report 13 "soft-RoCE devices ($DEVICES) made, but no port is ACTIVE" "$DEVICES" "$HOW"
    exit 13
  fi
fi

echo "rdma-check: devices $DEVICES ($HOW)"
# Registered memory is pinned: the daemons the tests start inherit this limit.
ulimit -l unlimited 2>/dev/null || echo "rdma-check: cannot raise the memlock limit ($(ulimit -l) KiB)"
TRANSFERD_RDMA_DEVICES=$DEVICES $PY -m pytest -q -rs tests/rdma tests/domains \
  --junitxml="$OUT/rdma-junit.xml" > "$OUT/pytest.txt" 2>&1
rc=$?
if [ "$rc" = 0 ]; then
  report 0 "tests/rdma and tests/domains passed over $DEVICES" "$DEVICES" "$HOW"
else
  report 1 "tests/rdma or tests/domains failed over $DEVICES (pytest exit $rc; see $OUT/pytest.txt)" "$DEVICES" "$HOW"
  rc=1
fi
exit "$rc"
