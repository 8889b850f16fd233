"""Payload bytes copied by Python, counted where the copy happens (off by default).

Set ``TRANSFERD_COUNT_COPIES=1`` in a process's environment (a daemon or a
client) and every place in the data paths that copies payload bytes in user
space (``bytes(view)``, ``b"".join``, a slice assignment between buffers,
``np.copyto``, a ``bytearray`` slice) adds its byte count here, by site.  The
kernel's copies (``recv_into``, ``sendmsg``) are not ours and are not counted.

Off (the default), a site costs one test of a module constant bound at import
(``if COUNTING:``): the count is never called.  ``python -m benchmarks --only
copies`` measures that guard and reads the counts (the daemon's come in its
STATS reply as ``copies`` while counting is on, see docs/protocol.md).

The counts are exact: a lock guards them, since the engine's worker thread
copies too.
"""

from __future__ import annotations

import os
import threading

ENV = "TRANSFERD_COUNT_COPIES"

# Read once, at import: sites bind it with ``from transferd.copies import COUNTING``.
COUNTING: bool = os.environ.get(ENV, "").strip() not in ("", "0", "false", "no")

# site -> [calls, bytes]
_sites: dict[str, list[int]] = {}
_lock = threading.Lock()


def count(site: str, nbytes: int) -> None:
    """``nbytes`` of payload copied at ``site`` (call only under ``if COUNTING:``)."""
    with _lock:
        entry = _sites.get(site)
        if entry is None:
            _sites[site] = [1, nbytes]
        else:
            entry[0] += 1
            entry[1] += nbytes


def snapshot() -> dict[str, dict[str, int]]:
    """Every site's calls and bytes so far: ``{site: {"calls": n, "bytes": n}}``."""
    with _lock:
        return {s: {"calls": c, "bytes": b} for s, (c, b) in sorted(_sites.items())}


def delta(after: dict[str, dict[str, int]],
          before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """What happened between two snapshots (sites with no new copies left out)."""
    out: dict[str, dict[str, int]] = {}
    for site, a in after.items():
        b = before.get(site, {"calls": 0, "bytes": 0})
        calls, nbytes = a["calls"] - b["calls"], a["bytes"] - b["bytes"]
        if calls or nbytes:
            out[site] = {"calls": calls, "bytes": nbytes}
    return out


def total(counts: dict[str, dict[str, int]]) -> int:
    """All bytes of a snapshot (or a delta)."""
    return sum(v["bytes"] for v in counts.values())
