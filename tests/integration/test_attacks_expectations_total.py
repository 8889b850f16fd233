"""EXPECT_IMM_COUNTs from one client over many connections: the daemon's memory.

engine.max_expectations bounds one connection (65,536), and each waiting expectation
on its own immediate costs the daemon about 4 KiB (its Op, timer, inflight entry, the
immediate's queue): one connection at the cap, +270 MiB. Nothing bounded the sum, and
a client may open as many connections as the descriptors allow: four connections took
the daemon +1,080 MiB in 20 s, a hundred would take 27 GiB.
"""

from __future__ import annotations

import itertools

from tests.conftest import DaemonFactory
from tests.helpers import RawConn
from transferd.protocol.constants import Command, Flag
from transferd.protocol.frames import encode_frame

PER_CONNECTION = 1000
TOTAL = 2500
_seqs = itertools.count(1000)  # a seq of its own for every request: one pending per seq


def _expect(c: RawConn, first_imm: int, n: int, timeout_ms: int = 3_600_000) -> list[str]:
    """``n`` one-way EXPECT_IMM_COUNTs, each on an immediate of its own, then a
    SYNCHRONIZE: the code of each refusal (an EVENT|ERROR) in order."""
    c.send_raw(b"".join(
        encode_frame(Command.EXPECT_IMM_COUNT, Flag.NO_REPLY, next(_seqs),
                     {"imm": first_imm + i, "count": 1, "timeout_ms": timeout_ms})
        for i in range(n)))
    sync = c.send(Command.SYNCHRONIZE, {}, seq=next(_seqs))
    codes = []
    for _ in range(n + 1):
        f = c.recv()
        if f.seq == sync and not f.is_event:
            return codes
        assert f.is_event and f.is_error, f
        codes.append(f"{f.body['code']}: {f.body['message']}")
    raise AssertionError("no SYNCHRONIZE reply")


def test_expectations_of_all_connections_together_are_capped(
        daemon_factory: DaemonFactory) -> None:
    """engine.max_expectations_total bounds them over all connections: past it, one more
    is TOO_LARGE naming the key (the connection served on), and room comes back when a
    connection holding some closes."""
    d = daemon_factory(env={"TRANSFERD_ENGINE_MAX_EXPECTATIONS": str(PER_CONNECTION),
                            "TRANSFERD_ENGINE_MAX_EXPECTATIONS_TOTAL": str(TOTAL)})
    conns = []
    refused = []
    for k in range(3):
        c = RawConn.to(d, timeout=60)
        c.hello()
        conns.append(c)
        refused.append(_expect(c, k * PER_CONNECTION + 1, PER_CONNECTION))
    assert refused[0] == [] and refused[1] == [], refused[:2]
    assert len(refused[2]) == 3 * PER_CONNECTION - TOTAL, len(refused[2])
    assert all(r.startswith("TOO_LARGE") and "engine.max_expectations_total" in r
               for r in refused[2]), refused[2][:2]
    # A fourth connection gets none; it is served all the same.
    late = RawConn.to(d, timeout=60)
    late.hello()
    got = _expect(late, 10_001, 10)
    assert len(got) == 10 and "engine.max_expectations_total" in got[0], got
    assert not late.request(Command.GET_DEVICES, {}).is_error
    # The first connection closes: its 1,000 are gone, and so much room is back.
    conns[0].close()
    ok = RawConn.to(d, timeout=60)
    ok.hello()
    for _ in range(100):  # the close reaches the daemon (bounded)
        if not _expect(ok, 20_001, 1):
            break
    else:
        raise AssertionError("no room after a connection's close")
    assert len(_expect(ok, 30_001, PER_CONNECTION)) == 1  # 999 more fit: 1,000 - 1 taken
    # The per-connection cap is what it was.
    more = _expect(conns[1], 40_001, 1)
    assert len(more) == 1 and "engine.max_expectations =" in more[0], more
    for c in (*conns[1:], late, ok):
        c.close()
