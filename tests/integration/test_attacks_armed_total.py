"""ARM_PAGED_WRITES from one client over many connections: the pages they hold.

An armed write keeps its page lists until it fires; engine.max_armed_pages_per_connection
(262,144) bounded one connection, about 21 MiB of the daemon's memory at the cap
(measured: +24, +45, +66, +87 MiB for one to four connections, each with one watcher and
four arms of 65,536 pages). Nothing bounded the sum: a client may open a connection per
watcher (engine.max_watchers, 4096), some 86 GiB.
"""

from __future__ import annotations

from tests.conftest import DaemonFactory
from tests.helpers import RawConn
from transferd.protocol.constants import Command

PER_CONNECTION = 1000
TOTAL = 2500
PAGES = 250  # per arm: four fill a connection


def _arm(c: RawConn, watcher: int, mr: int, desc: object) -> dict[str, str] | None:
    """One armed write of PAGES pages (never fired: its value is never reached); None
    when armed, else the refusal's body."""
    idx = list(range(PAGES))
    f = c.request(Command.ARM_PAGED_WRITES, {
        "watcher": watcher, "value": 1 << 60, "page_len": 1, "imm": None,
        "src": [mr, [idx, 1, 0]], "dst": [desc, [idx, 1, 0]]})
    return dict(f.body) if f.is_error else None


def test_armed_pages_of_all_connections_together_are_capped(
        daemon_factory: DaemonFactory) -> None:
    """engine.max_armed_pages_total bounds them over all connections: an arm that would
    pass it is TOO_LARGE naming the key, the connection served on; a connection's close
    (its arms dropped) gives the room back."""
    d = daemon_factory(env={"TRANSFERD_ENGINE_MAX_ARMED_PAGES_PER_CONNECTION":
                            str(PER_CONNECTION),
                            "TRANSFERD_ENGINE_MAX_ARMED_PAGES_TOTAL": str(TOTAL)})
    setup = RawConn.to(d, timeout=60)
    setup.hello()
    buf = setup.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 4096}).body["buffer"]
    reg = setup.request(Command.REG_MR, {"buffer": buf}).body
    mr, desc = reg["mr"], reg["desc"]

    def connect() -> tuple[RawConn, int]:
        c = RawConn.to(d, timeout=60)
        c.hello()
        return c, c.request(Command.ALLOC_UVM_WATCHER, {}).body["watcher"]

    conns = [connect() for _ in range(3)]
    outcomes = [[_arm(c, w, mr, desc) for _ in range(4)] for c, w in conns]
    assert outcomes[0] == [None] * 4 and outcomes[1] == [None] * 4, outcomes[:2]
    assert outcomes[2][:2] == [None, None], outcomes[2]
    for refused in outcomes[2][2:]:
        assert refused is not None and refused["code"] == "TOO_LARGE", refused
        assert "engine.max_armed_pages_total" in refused["message"], refused
    # The per-connection bound is what it was.
    c1, w1 = conns[1]
    refused = _arm(c1, w1, mr, desc)
    assert refused is not None and "max_armed_pages_per_connection" in refused["message"]
    assert not c1.request(Command.GET_DEVICES, {}).is_error  # served on
    # The first connection goes: its 1,000 pages are dropped, so much room is back.
    conns[0][0].close()
    c2, w2 = conns[2]
    for _ in range(100):  # until the close reached the daemon (bounded)
        if _arm(c2, w2, mr, desc) is None:
            break
    else:
        raise AssertionError("no room after a connection's close")
    assert _arm(c2, w2, mr, desc) is None  # its own 1,000 now
    assert _arm(c2, w2, mr, desc) is not None
    for c, _ in conns[1:]:
        c.close()
    setup.close()
