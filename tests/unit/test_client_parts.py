"""The client is composed of parts (issue 18.3): no mixins, no cycles, nothing of the daemon.

``Client`` holds its parts (engine operations, copies, CUDA IPC, leases, watchers),
each taking the Client as the small interface of client/calls.py; the methods of
DESIGN.md's API stay on Client (and SyncClient) and hand the call on.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import client
from client import Client, SyncClient
from client.copies import Copies
from client.cuda_ipc import CudaIpc
from client.engine import EngineOps
from client.leases import Leases
from client.watchers import Watchers
from tests.helpers import REPO

CLIENT = Path(client.__file__).parent

# DESIGN.md's API (and what the parts add to it): every one is a method of Client.
API = [
    "connect", "alloc_buffer", "set_tensor", "set_tensor_async", "get_tensor",
    "get_tensor_async", "copy_tensor", "buffer_clear", "free_buffer", "flush", "synchronize",
    "stats", "main_address", "reg_mr", "dereg_mr", "submit_single_write",
    "submit_paged_writes", "expect_imm_count", "add_peer_group", "submit_scatter",
    "submit_barrier", "submit_send", "submit_recvs", "imm_count", "copy_from_device",
    "copy_to_device", "use_copy_staging", "register_cuda_memory", "lease", "renew_lease",
    "end_lease", "alloc_uvm_watcher",
]


def test_client_is_composed_not_mixed_in() -> None:
    assert Client.__mro__ == (Client, object)
    c = Client("tcp://127.0.0.1:1")
    parts = {"engine": EngineOps, "copies": Copies, "cuda_ipc": CudaIpc, "leases": Leases,
             "watchers": Watchers}
    for name, cls in parts.items():
        assert isinstance(getattr(c, name), cls), name
    for name in API:
        assert callable(getattr(Client, name, None)), name
    # Each API method of a part keeps its signature on Client.
    for name, part in (("reg_mr", EngineOps), ("submit_single_write", EngineOps),
                       ("expect_imm_count", EngineOps), ("copy_from_device", Copies),
                       ("alloc_uvm_watcher", Watchers), ("renew_lease", Leases),
                       ("register_cuda_memory", CudaIpc)):
        want = list(inspect.signature(getattr(part, name)).parameters)
        assert list(inspect.signature(getattr(Client, name)).parameters) == want, name


def test_no_part_imports_the_client_back_and_no_mixin_ignores() -> None:
    for path in sorted(CLIENT.glob("*.py")):
        text = path.read_text()
        # A mixin's method says ``self: Client`` and silences mypy with ignore[misc].
        assert "self: Client" not in text, path.name
        for line in text.splitlines():
            assert not ("def " in line and "type: ignore[misc]" in line), (path.name, line)
        # Not parts: the Client itself, the package, and the two fronts built on it
        # (SyncClient; InprocClient, the same API on an engine in this process).
        if path.name in ("client.py", "__init__.py", "sync.py", "inproc.py"):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                mod = ("." * node.level) + (node.module or "")
                assert mod not in (".client", "client.client"), f"{path.name} imports {mod}"
                if mod == ".":
                    assert "client" not in {a.name for a in node.names}, path.name


def test_import_client_loads_nothing_of_the_daemon() -> None:
    code = ("import sys, client; print(sorted(m for m in sys.modules if m.startswith("
            "('rpc_server', 'transferd.engine', 'transferd.memory', 'transferd.daemon', "
            "'transferd.workers', 'transferd.metrics', 'transferd.domains.group', "
            "'transferd.domains.tcp'))))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_sync_client_captures_the_callers_cuda_state_itself() -> None:
    # What CuPy keeps per thread is resolved before the call leaves the caller's thread.
    for name in ("copy_from_device", "copy_to_device", "register_cuda_memory"):
        assert name in SyncClient.__dict__, name
