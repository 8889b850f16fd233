"""Which RDMA devices the verbs tests run on, or why there are none (shared by tests/rdma/
and the Domain conformance suite).

``make rdma-check`` (scripts/rdma-check.sh) sets TRANSFERD_RDMA_DEVICES (soft-RoCE
devices it made, or real NICs); run by hand, the first ACTIVE device found is used.
"""

from __future__ import annotations

import os

from transferd.rdma.devices import discover
from transferd.rdma.loader import pyverbs_missing


def rdma_devices() -> tuple[list[str], str | None]:
    """(devices for daemon a and b, or why there are none: pyverbs missing, no device
    (and whether soft-RoCE could give one), no ACTIVE port)."""
    given = [d for d in os.environ.get("TRANSFERD_RDMA_DEVICES", "").split(",") if d]
    if (why := pyverbs_missing()) is not None:
        return [], why
    report = discover()
    active = [d.name for d in report.devices if any(p.active for p in d.ports)]
    if given:
        missing = [d for d in given if d not in active]
        if missing:
            return [], f"TRANSFERD_RDMA_DEVICES names {missing}, not ACTIVE here"
        return given, None
    if not active:
        return [], f"no RDMA device with an ACTIVE port: {report.reason}"
    return active[:1], None
