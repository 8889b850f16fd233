"""The verbs Domain: RDMA through pyverbs, one NIC per rail (the NIC itself:
:mod:`transferd.rdma`).

Modules:

* ``bind``       the registry entry (``verbs``): its capabilities, its config and
                 machine checks, preflight, then one Domain per rail
* ``counting``   how a write counts exactly once on the receiver (the carrier gate)
* ``sendq``      send-queue room and doorbell batches
* ``sender``     parts in, work requests out, completions back to transfers
* ``messages``   the peer plane's SEND and ACK frames, one a message
* ``domain``     (pyverbs) the Domain itself: its queue pairs and completion dispatch
* ``links``      the peer link core over TCP (handshake, queue-pair set-up), a link's
                 traffic

``domain`` imports pyverbs, only when used; the rest is pure and tested without
pyverbs or a device.  docs/rdma.md is the user's page.
"""

from __future__ import annotations

from transferd.rdma.loader import VerbsUnavailable, pyverbs_missing

NAME = "verbs"

__all__ = ["NAME", "VerbsUnavailable", "pyverbs_missing"]
