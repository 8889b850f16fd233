"""What tests/rdma/ runs on: RDMA devices with an ACTIVE port, or a skip saying why not.

``make rdma-check`` (scripts/rdma-check.sh) sets TRANSFERD_RDMA_DEVICES (soft-RoCE
devices it made, or real NICs); run by hand, the first ACTIVE device found is used.
Every test here starts real daemons over real verbs; nothing is simulated.
"""

from __future__ import annotations

import pytest

from tests.rdma.devices import rdma_devices

DEVICES, WHY = rdma_devices()
needs_rdma = pytest.mark.skipif(WHY is not None, reason=f"verbs: {WHY}")
