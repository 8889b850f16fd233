"""Importing pyverbs, and saying plainly why it cannot be used where it cannot.

pyverbs comes from the system's rdma-core (``make rdma-deps``), never from PyPI (see
docs/rdma.md).  Nothing in ``transferd`` imports it at module level: a daemon without
RDMA never loads it, and the pure verbs modules (planning, counting, completion
dispatch, the exchange messages) work without it.
"""

from __future__ import annotations

import importlib
import resource
from types import ModuleType

from transferd.protocol.errors import BadRequest

# Registering the memory a NIC may write pins it: the daemon's RLIMIT_MEMLOCK must
# cover the registered buffers.  Below this (the old 64 KiB default) nothing works.
MIN_MEMLOCK = 64 << 20


class VerbsUnavailable(BadRequest):
    """RDMA cannot be used here (the verbs Domain, rdma://); the message names what is
    missing."""


def load_pyverbs() -> ModuleType:
    """The ``pyverbs`` package, or VerbsUnavailable saying why not."""
    try:
        pv = importlib.import_module("pyverbs")
        for sub in ("device", "pd", "cq", "qp", "mr", "wr", "addr", "enums"):
            importlib.import_module(f"pyverbs.{sub}")
    except ImportError as exc:
        raise VerbsUnavailable(
            f"pyverbs is not importable ({exc}): install the system's python3-pyverbs "
            "and run `make rdma-deps` (docs/rdma.md)"
        ) from None
    return pv


def pyverbs_missing() -> str | None:
    """Why pyverbs cannot be imported, or None when it can (for test skips)."""
    try:
        load_pyverbs()
    except VerbsUnavailable as exc:
        return exc.message
    return None


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK's soft limit in bytes; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def memlock_problem(need: int = MIN_MEMLOCK) -> str | None:
    limit = memlock_limit()
    if limit is not None and limit < need:
        return (f"RLIMIT_MEMLOCK is {limit >> 10} KiB, below the {need >> 20} MiB that "
                "memory registration needs: raise it (systemd LimitMEMLOCK=infinity, "
                "ulimit -l unlimited; docs/rdma.md)")
    return None
