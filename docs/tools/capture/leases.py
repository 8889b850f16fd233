"""The owner, lease and cancel examples: LEASE, a buffer it owns, END_LEASE; CANCEL."""

from __future__ import annotations

from capture.live import Capture, Daemons
from capture.registry import example, session
from transferd.protocol import Command


@example("LEASE")
def ex_lease(ds: Daemons) -> Capture:
    with session(ds["main"], "LEASE kv/req-42 for 10 s, a buffer it owns, END_LEASE") as (c, cap):
        c.send(Command.LEASE, 2, {"lease": "kv/req-42", "ttl_ms": 10000})
        c.recv()
        c.send(Command.ALLOC_BUFFER, 3, {"device": "cpu", "size": 64, "lease": "kv/req-42"})
        c.recv()
        c.send(Command.END_LEASE, 4, {"lease": "kv/req-42"})
        c.recv()
    cap.note = (
        "`created` is true: no lease of that name existed (a second LEASE renews it and "
        "says false). The ALLOC_BUFFER reply names its owner because the request did. "
        "END_LEASE freed the one buffer the lease owned."
    )
    return cap


@example("ENGINE_CANCEL")
def ex_cancel(ds: Daemons) -> Capture:
    with session(ds["main"], "EXPECT_IMM_COUNT on immediate 5 with a 60 s deadline, then "
                 "CANCEL of its seq") as (c, cap):
        c.send(Command.EXPECT_IMM_COUNT, 2, {"imm": 5, "count": 1, "timeout_ms": 60000})
        c.recv()
        c.send(Command.CANCEL, 3, {"seq": 2})
        c.recv()
        c.recv()
    cap.note = (
        "The expectation's own EVENT|ERROR CANCELLED (its cmd and seq) comes first, then "
        "CANCEL's reply: `cancelled` is true because the CANCEL ended it. Nothing of "
        "immediate 5 was consumed."
    )
    return cap
