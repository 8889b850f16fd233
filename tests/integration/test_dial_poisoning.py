"""A client that names a peer's rail address under another node's identity (a forged
NetAddr in an MrDesc) makes this daemon dial that address and the peer answer as who it
is: the dial fails (identity) and is backed off.  The back-off is that forged identity's,
not the address's: another client's write to the real peer at that address, right after,
dials and lands; the forger's writes are still refused, backed off.

Before, the back-off was the address's: one forged write made every client's first write
to that peer fail PEER_UNREACHABLE ("not dialling ... again") for 0.25 s, doubling with
each forged write up to 10 s -- a client denying the others a peer it can name.
"""

from __future__ import annotations

from typing import Any

import msgpack

from tests.helpers import DaemonProcess, RawConn
from transferd.protocol.constants import Command, ErrorCode, Flag


def _write(c: RawConn, mr: int, desc: list[Any]) -> Any:
    f = c.request(Command.SINGLE_WRITE, {"len": 16, "src": [mr, 0], "dst": [desc, 0]})
    assert f.flags == int(Flag.REPLY), f.body
    event = c.recv()
    assert event.seq == f.seq, event
    return event


def test_a_forged_identity_backs_off_itself_not_the_peers_address(
        daemon_factory: Any) -> None:
    d: DaemonProcess = daemon_factory()  # fresh: no link to itself yet
    with RawConn.to(d) as forger, RawConn.to(d) as honest:
        forger.hello()
        honest.hello()
        buf = honest.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 8192})
        mr = honest.request(Command.REG_MR, {"buffer": buf.body["buffer"]})
        mr_id, desc = mr.body["mr"], mr.body["desc"]
        ptr, size, [[na, rkey]] = desc
        fmt, node, group, rails = msgpack.unpackb(na)
        forged = [ptr, size, [[msgpack.packb([fmt, node ^ 1, group, rails]), rkey]]]
        fbuf = forger.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 8192})
        fmr = forger.request(Command.REG_MR, {"buffer": fbuf.body["buffer"]}).body["mr"]
        for _ in range(3):  # three forged dials' worth of back-off
            e = _write(forger, fmr, forged)
            assert e.flags == int(Flag.EVENT | Flag.ERROR), e
            assert e.body["code"] == ErrorCode.PEER_UNREACHABLE.value, e.body
        # The honest client's write to the real peer at that address lands at once.
        e = _write(honest, mr_id, desc)
        assert e.flags == int(Flag.EVENT) and e.body == {"ok": True}, e.body
        # The forger is refused still (the honest dial's success forgot the address's
        # failures: one more dial at most), then backed off without a dial; the honest
        # link is not touched by it.
        for _ in range(2):
            e = _write(forger, fmr, forged)
            assert e.body["code"] == ErrorCode.PEER_UNREACHABLE.value, e.body
        assert "not dialling" in e.body["message"], e.body
        e = _write(honest, mr_id, desc)
        assert e.flags == int(Flag.EVENT) and e.body == {"ok": True}, e.body
