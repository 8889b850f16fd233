#!/bin/bash
# Compile the small write's hot modules of checkout $1 with mypyc, in place (issue 17, wave 7:
# measured, not kept). Built in a scratch copy (setuptools would read the project's
# pyproject.toml), the .so files copied back next to their sources; they shadow the .py
# files until removed: `find $1 -name '*.cpython-*.so' -delete`. ~3.5 min on one CPU.
set -e
T=$(realpath ${1:?checkout}); W=/tmp/td-probe-mypyc; PY=${PY:-$T/.venv/bin/python}
rm -rf $W && mkdir -p $W && cp -r $T/transferd $T/rpc_server $T/client $W/ && cd $W
printf '[mypy]\nignore_missing_imports = True\ncheck_untyped_defs = True\n' > mypy.ini
cat > setup.py <<'PY'
import sys
from setuptools import setup
from mypyc.build import mypycify
setup(name="hot", ext_modules=mypycify(sys.argv.pop(1).split(","), opt_level="3"))
PY
# (transferd/memory/buffers.py and protocol/values.py are left out: a class attribute
# aliasing a method, and object.__new__ of a dataclass, which compiled classes refuse.)
M=transferd/protocol/frames.py,transferd/protocol/peer_wire.py,transferd/protocol/peer_link.py
M=$M,transferd/protocol/peer_inbound.py,transferd/protocol/peer_outbound.py
M=$M,transferd/protocol/peer_landing.py,transferd/domains/link_io.py,transferd/protocol/connection.py
M=$M,rpc_server/session.py,rpc_server/engine_handlers.py,transferd/engine/engine.py
M=$M,transferd/engine/peer_slots.py,transferd/engine/plan.py,transferd/engine/inflight.py
M=$M,transferd/service/service.py,transferd/service/ops.py,transferd/domains/group.py
M=$M,transferd/domains/tcp/domain.py,transferd/transports/carriers.py,transferd/engine/port.py
M=$M,transferd/engine/regions.py,client/connection.py
$PY setup.py $M build_ext --inplace -j 2 > build.log 2>&1
for f in $(find . -path ./build -prune -o -name '*.so' -print); do cp $f $T/$f; done
echo "compiled into $T:"; find $T -name '*.cpython-*.so' -newer setup.py | sed "s|$T/||"
