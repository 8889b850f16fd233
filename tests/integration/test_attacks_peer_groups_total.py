"""ADD_PEER_GROUP from one client over many connections: the addresses the daemon keeps.

engine.max_peer_groups (64) and engine.max_group_peers (1,024) bound one connection:
65,536 NetAddrs kept until it closes (+10 to +20 MiB a connection, measured, when each
names new addresses). Nothing bounded their sum, and a client may open as many
connections as it likes.
"""

from __future__ import annotations

import random

from tests.conftest import DaemonFactory
from tests.helpers import RawConn
from transferd.domains.rails import rail_bytes
from transferd.protocol.constants import Command
from transferd.protocol.values import NetAddr

GROUP = 500
TOTAL = 1200


def _group(c: RawConn, rng: random.Random) -> dict[str, str] | None:
    """One group of GROUP made-up peers (at a closed port); None if made, else the error."""
    rail = rail_bytes("127.0.0.1", 9)
    addrs = [NetAddr(rng.getrandbits(63) | 1, 0, (rail,)).to_bytes() for _ in range(GROUP)]
    f = c.request(Command.ADD_PEER_GROUP, {"addrs": addrs})
    return dict(f.body) if f.is_error else None


def test_peer_group_addresses_of_all_connections_together_are_capped(
        daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(env={"TRANSFERD_ENGINE_MAX_GROUP_PEERS_TOTAL": str(TOTAL)})
    rng = random.Random(7)
    first, second = RawConn.to(d, timeout=30), RawConn.to(d, timeout=30)
    for c in (first, second):
        c.hello()
    assert _group(first, rng) is None and _group(first, rng) is None  # 1,000
    refused = _group(second, rng)  # 1,500 would pass 1,200
    assert refused is not None and refused["code"] == "TOO_LARGE", refused
    assert "engine.max_group_peers_total" in refused["message"], refused
    assert not second.request(Command.GET_DEVICES, {}).is_error  # served on
    first.close()  # its groups go, and their addresses with them
    for _ in range(200):  # until the close reached the daemon (bounded)
        if _group(second, rng) is None:
            break
    else:
        raise AssertionError("no room after the first connection closed")
    assert _group(second, rng) is None  # 1,000 of 1,200
    assert _group(second, rng) is not None
    second.close()
