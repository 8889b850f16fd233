#!/usr/bin/env bash
# `make rdma-deps`: pyverbs for the project's virtual environment, from the system.
#
# PyPI's pyverbs builds its own rdma-core yet links the system's libibverbs, and then
# needs a symbol of its own version (IBVERBS_PRIVATE_<its version>): on Debian 12
# (rdma-core 44) it builds and fails to import.  The distribution's package matches the
# system's libibverbs and its providers, so that is the one we use.  The venv sees it
# through a .pth file naming a directory that holds one symlink, `pyverbs`: the venv
# gets that package and nothing else of the system's site-packages.
#
#   scripts/rdma-deps.sh            install python3-pyverbs if missing, then link it
#   scripts/rdma-deps.sh --link     link only, never install (best effort: `make venv`)
#
# Exit status: 0 linked and importable; 3 no system pyverbs (and --link, or no known
# package manager); 4 found but it does not import into this venv (a Python ABI mismatch,
# say); 1 the install failed.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
MODE=${1:-install}

find_system_pyverbs() {
  local d
  for d in /usr/lib/python3/dist-packages /usr/lib64/python3*/site-packages \
           /usr/lib/python3*/site-packages /usr/local/lib/python3*/dist-packages; do
    if [ -f "$d/pyverbs/__init__.py" ]; then echo "$d/pyverbs"; return 0; fi
  done
  return 1
}

if ! src=$(find_system_pyverbs); then
  if [ "$MODE" = "--link" ]; then
    echo "rdma-deps: no system pyverbs (python3-pyverbs) installed; the verbs tests skip" >&2
    exit 3
  fi
  if command -v apt-get >/dev/null; then
    echo "rdma-deps: installing python3-pyverbs (Debian/Ubuntu)"
    apt-get install -y python3-pyverbs || { echo "rdma-deps: apt-get failed" >&2; exit 1; }
  elif command -v dnf >/dev/null; then
    echo "rdma-deps: installing python3-pyverbs (RHEL/Fedora)"
    dnf install -y python3-pyverbs || { echo "rdma-deps: dnf failed" >&2; exit 1; }
  else
    echo "rdma-deps: no apt-get or dnf here: install your distribution's python3-pyverbs" >&2
    exit 3
  fi
  src=$(find_system_pyverbs) || { echo "rdma-deps: installed, but pyverbs not found" >&2; exit 3; }
fi

site=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim=$(cd "$VENV" && pwd)/system-pyverbs
mkdir -p "$shim"
ln -sfn "$src" "$shim/pyverbs"
echo "$shim" > "$site/transferd-system-pyverbs.pth"
if ! out=$($PY -c 'import pyverbs.device, pyverbs.wr; pyverbs.wr.SendWR(num_sge=1, sg=[pyverbs.wr.SGE(0, 0, 0)])' 2>&1); then
  rm -f "$site/transferd-system-pyverbs.pth"
  echo "rdma-deps: $src does not import into $PY: $out" >&2
  exit 4
fi
echo "rdma-deps: $PY imports pyverbs from $src (through $site/transferd-system-pyverbs.pth)"
