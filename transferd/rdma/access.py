"""Access rights on a verbs rail, as libibverbs numbers: a region's ``ibv_reg_mr``
flags from its rights, a queue pair's ``qp_access_flags`` and its READ depths within the
device's limits.  Pure (the numbers are fixed by <infiniband/verbs.h>, an ABI;
tests/unit/test_verbs_reads.py checks them against pyverbs.enums where it imports).

- :func:`mr_access`: ``IBV_ACCESS_REMOTE_READ`` only where ``"r"`` was granted,
  ``IBV_ACCESS_REMOTE_WRITE`` only where ``"w"`` was: the NIC itself then refuses
  (REM_ACCESS_ERR at the reader) a read of a write-only region, as the tcp responder
  refuses it (NOT_FOUND).
- :func:`rd_atomic`: the queue pair's ``max_rd_atomic`` (READs this side has in flight)
  and ``max_dest_rd_atomic`` (the peer's READs it serves at once).
"""

from __future__ import annotations

from transferd.protocol.errors import BadRequest

# enum ibv_access_flags
IBV_ACCESS_LOCAL_WRITE = 1
IBV_ACCESS_REMOTE_WRITE = 2
IBV_ACCESS_REMOTE_READ = 4
IBV_ACCESS_RELAXED_ORDERING = 1 << 20  # IBV_ACCESS_OPTIONAL_FIRST

# What a queue pair asks for at most (the device may allow fewer).
WANT_RD_ATOMIC = 16


def mr_access(access: str) -> int:
    """``ibv_reg_mr`` flags for a region with rights ``access`` ("w", "r", "rw")."""
    if access not in ("w", "r", "rw"):
        raise BadRequest(f"access {access!r} is not one of 'w', 'r' or 'rw'")
    flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING
    if "w" in access:
        flags |= IBV_ACCESS_REMOTE_WRITE
    if "r" in access:
        flags |= IBV_ACCESS_REMOTE_READ
    return flags


def qp_access(serves_reads: bool) -> int:
    """A queue pair's ``qp_access_flags``: remote reads only on one that serves them."""
    flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE
    return flags | IBV_ACCESS_REMOTE_READ if serves_reads else flags


def rd_atomic(max_qp_init_rd_atom: int, max_qp_rd_atom: int,
              want: int = WANT_RD_ATOMIC) -> tuple[int, int]:
    """(max_rd_atomic, max_dest_rd_atomic) for a queue pair on this device: as many as
    asked, at most what it allows, at least 1 (the RC minimum)."""
    return (max(1, min(want, max_qp_init_rd_atom)), max(1, min(want, max_qp_rd_atom)))
