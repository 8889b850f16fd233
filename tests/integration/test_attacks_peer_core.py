"""The peer link core, attacked on live daemons: hostile peers that hold links they
proved, stall mid-frame, or lie in their frames; each test failed before its fix
(docs/security.md, "The peer link core, attacked")."""

from __future__ import annotations

import asyncio
import contextlib

from tests.helpers import async_test
from tests.integration.engine_cluster import (
    RAILS,
    WAIT,
    engine_env,
    nodes,
    start_many,
)
from tests.integration.fake_peer import FakePeer, handshake_error, raw_write


@async_test(timeout=90)
async def test_links_a_stranger_proved_and_holds_do_not_lock_out_a_real_peer() -> None:
    """No secret: a local process is a peer under its own addresses' id.  It opened
    as many authenticated links into B as B's link budget holds and kept them (one
    stalled in the middle of a write's payload): B closed every real peer's inbound
    link at once, so A's write to B failed PEER_UNREACHABLE."""
    b_d, a_d = start_many([{"env": engine_env(RAILS["b"], max_links=12)},
                           {"env": engine_env(RAILS["a"], max_links=12)}])
    held: list[FakePeer] = []
    try:
        async with nodes(b_d, a_d) as (b, a):
            addr_b = await b.client.main_address()
            dst = await b.region(64 * 1024)
            rkey = dst.desc.rkeys[0][1]

            def hoard() -> int:
                got = 0
                for _ in range(16):
                    p = FakePeer(addr_b, 0, None, timeout=3)
                    held.append(p)
                    if handshake_error(p) is not None:
                        break  # (B's link budget is full)
                    got += 1
                    if got == 1:  # one stalls in the middle of a write's payload
                        p.conn.send_raw(raw_write({"op": 1, "part": 0, "rkey": rkey,
                                                   "addrs": [dst.desc.ptr], "lens": [4096]},
                                                  b"x" * 100))
                return got

            got = await asyncio.to_thread(hoard)
            assert got >= 10, got
            src = await a.region(4096, seed=7)
            await (await a.client.submit_single_write(4096, None, (src.mr, 0),
                                                      (dst.desc, 0))).wait(WAIT)
            assert await b.read(dst, 0, 4096) == bytes(src.data)
    except BaseException:
        print("B:", b_d.output()[-6000:])
        print("A:", a_d.output()[-3000:])
        raise
    finally:
        for p in held:
            with contextlib.suppress(OSError):
                p.close()
        a_d.stop()
        b_d.stop()
