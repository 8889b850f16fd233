"""The arrows of DESIGN.md point down only: what each layer loads, checked in a fresh
interpreter (run time) and in the source (type checking included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _loaded(code: str) -> list[str]:
    """The project modules a fresh interpreter has loaded after ``code``."""
    r = subprocess.run(
        [sys.executable, "-c", f"{code}; import sys; print('\\n'.join(sorted(sys.modules)))"],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return [m for m in r.stdout.split() if m.split(".")[0] in ("transferd", "rpc_server",
                                                               "client")]


def _imports(top: Path) -> list[tuple[str, str]]:
    """(file, module) for every import statement under ``top``, TYPE_CHECKING ones too."""
    out = []
    for path in sorted(top.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out += [(rel, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.append((rel, node.module))
    return out


def test_import_client_loads_no_daemon_module() -> None:
    """The client library stays light: no Domain, no engine, no server (the rdma://
    transport's NIC layer lives in transferd.rdma, below both)."""
    bad = [m for m in _loaded("import client")
           if m.startswith(("transferd.domains", "transferd.engine", "rpc_server"))]
    assert not bad, bad


@pytest.mark.parametrize(("top", "forbidden"), [
    ("transferd/transports", ("transferd.domains", "transferd.engine", "rpc_server")),
    ("transferd/rdma", ("transferd.domains", "transferd.engine", "transferd.transports",
                        "rpc_server")),
    ("transferd/protocol", ("transferd.domains", "transferd.engine", "transferd.transports",
                            "transferd.memory", "rpc_server", "client")),
    ("transferd/domains", ("transferd.engine", "rpc_server", "client")),
    ("client", ("rpc_server", "transferd.domains", "transferd.engine")),
    ("rpc_server", ("client",)),
])
def test_no_module_imports_a_layer_above_it(top: str, forbidden: tuple[str, ...]) -> None:
    bad = [f"{f}: {m}" for f, m in _imports(REPO / top) if m.startswith(forbidden)]
    assert not bad, bad


def test_the_transports_load_nothing_of_the_domains_at_run_time() -> None:
    bad = [m for m in _loaded("import transferd.transports, transferd.transports.rdma, "
                              "transferd.transports.msgtransport")
           if m.startswith(("transferd.domains", "transferd.engine"))]
    assert not bad, bad
