"""The few libibverbs numbers the pure modules need, without importing pyverbs.

They are fixed by <infiniband/verbs.h> (an ABI); tests/unit/test_verbs_wr.py checks
them against pyverbs.enums wherever pyverbs imports.
"""

from __future__ import annotations

import enum


class WrOpcode(enum.IntEnum):
    """enum ibv_wr_opcode."""

    RDMA_WRITE = 0
    RDMA_WRITE_WITH_IMM = 1
    SEND = 2
    SEND_WITH_IMM = 3
    RDMA_READ = 4


class WcOpcode(enum.IntEnum):
    """enum ibv_wc_opcode (the ones our queue pairs produce)."""

    SEND = 0
    RDMA_WRITE = 1
    RDMA_READ = 2
    RECV = 128
    RECV_RDMA_WITH_IMM = 129


class WcStatus(enum.IntEnum):
    """enum ibv_wc_status (those named in messages; others print as numbers)."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13


def status_name(status: int) -> str:
    try:
        return WcStatus(status).name
    except ValueError:
        return f"status {status}"


IBV_SEND_SIGNALED = 2
IBV_WC_WITH_IMM = 2
# Up to this many work requests are linked through ibv_send_wr.next and handed to the
# NIC by one ibv_post_send (one doorbell), as the article's ConnectX Domain does.
CHAIN_MAX = 4
