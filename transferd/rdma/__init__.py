"""RDMA through pyverbs (rdma-core 44 and later): one NIC's resources, below both the
``rdma://`` transport (:mod:`transferd.transports.rdma`) and the verbs Domain
(:mod:`transferd.domains.verbs`), which neither imports the other.

Modules, from pure to device:

* ``constants``   the libibverbs numbers the pure modules use
* ``loader``      importing pyverbs, and why it cannot be where it cannot
* ``devices``     discovery: devices, ports, GIDs, NUMA nodes, or why there are none
* ``exchange``    what two ends exchange to connect queue pairs (a rail's, a channel's)
* ``mrtable``     local registrations: the lkey of an address
* ``wrplan``      write parts to work-request specs (sharding, max message, SGEs)
* ``completions`` what each completion-queue entry means (dispatch, receive reposting)
* ``wr``          (pyverbs) SendWR chains, receive slots, templates
* ``resources``   (pyverbs) context, protection domain, CQ, queue pairs, registration
* ``slots``       (device) registered message slots
* ``cqloop``      (device) busy-poll, then the completion channel (or a timer)
* ``channel``     (device) the RC SEND/RECV carrier of rdma://

``wr``, ``resources``, ``slots`` and ``channel`` import pyverbs, only when used; the
rest is pure and tested without pyverbs or a device.  docs/rdma.md is the user's page.
"""

from __future__ import annotations

from .loader import VerbsUnavailable, pyverbs_missing

__all__ = ["VerbsUnavailable", "pyverbs_missing"]
