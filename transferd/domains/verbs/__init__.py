"""The verbs Domain: RDMA through pyverbs (rdma-core 44 and later), one NIC per rail.

Modules, from pure to device:

* ``exchange``   the queue pair set-up two daemons exchange in the peer handshake
* ``wrplan``     write parts to work-request specs (sharding, max message, SGEs)
* ``counting``   how a write counts exactly once on the receiver (the carrier gate)
* ``sendq``      send-queue room and doorbell batches
* ``sender``     parts in, work requests out, completions back to transfers
* ``completions`` what each completion-queue entry means (dispatch, receive reposting)
* ``mrtable``    local registrations: the lkey of an address
* ``constants``  the libibverbs numbers the pure modules use
* ``loader``     importing pyverbs, and why it cannot be where it cannot
* ``devices``    discovery: devices, ports, GIDs, NUMA nodes, or why there are none
* ``wr``         (pyverbs) SendWR chains, receive slots, templates
* ``resources``  (pyverbs) context, protection domain, CQ, queue pairs, registration
* ``domain``     (pyverbs) the Domain itself and its completion-queue loop

Only ``wr``, ``resources`` and ``domain`` import pyverbs, and only when used.
docs/rdma.md is the user's page.
"""

from __future__ import annotations

from .loader import VerbsUnavailable, pyverbs_missing

NAME = "verbs"

__all__ = ["NAME", "VerbsUnavailable", "pyverbs_missing"]
