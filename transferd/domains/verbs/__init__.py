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
* ``framing``    frames over a message transport (cut, whole-message reader, scatter)
* ``msgtransport`` the asyncio transport of rdma:// over any carrier of whole messages
* ``bind``       the registry entry (``verbs``): preflight, then one Domain per rail
* ``wr``         (pyverbs) SendWR chains, receive slots, templates
* ``resources``  (pyverbs) context, protection domain, CQ, queue pairs, registration
* ``cqloop``     (device) busy-poll, then the completion channel (or a timer)
* ``domain``     (pyverbs) the Domain itself: its queue pairs and completion dispatch
* ``links``      (pyverbs) the peer handshake, the queue-pair set-up, a link's traffic
* ``channel``    (pyverbs) the RC SEND/RECV carrier of rdma://

``wr``, ``resources``, ``domain``, ``links`` and ``channel`` import pyverbs, only when
used; the rest is pure and tested without pyverbs or a device.
docs/rdma.md is the user's page.
"""

from __future__ import annotations

from .loader import VerbsUnavailable, pyverbs_missing

NAME = "verbs"

__all__ = ["NAME", "VerbsUnavailable", "pyverbs_missing"]
