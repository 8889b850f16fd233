"""Completion EVENTs that end in one turn of the daemon's loop go out together
(rpc_server/session.py, send_event): none is lost or repeated, and none trails a frame
written after it: SYNCHRONIZE's reply comes after the EVENT of every earlier submit, the
failures among them included (PROTOCOL.md, docs/protocol.md "Ordering and SYNCHRONIZE")."""

from __future__ import annotations

import copy
import zlib

from tests.helpers import DaemonProcess, RawConn
from transferd.protocol.constants import Command, ErrorCode, Flag

WRITES = 300


def test_a_burst_of_completions_precedes_the_synchronize_reply(daemon: DaemonProcess) -> None:
    with RawConn.to(daemon, timeout=30) as c:
        c.hello()
        bufs = []
        for _ in range(2):
            r = c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": WRITES * 64})
            assert r.flags == int(Flag.REPLY), r.body
            bufs.append(r.body["buffer"])
        data = bytes(range(256)) * (WRITES * 64 // 256)
        r = c.request(Command.SET_TENSOR, {"tensor": [bufs[0], 0, len(data)]}, data)
        assert r.flags == int(Flag.REPLY), r.body
        src = c.request(Command.REG_MR, {"buffer": bufs[0]}).body["mr"]
        desc = c.request(Command.REG_MR, {"buffer": bufs[1]}).body["desc"]
        # Every third write names an rkey nobody registered: the receiver refuses it and
        # its completion is an EVENT|ERROR.
        bad = copy.deepcopy(desc)
        bad[2][0][1] ^= 0x5A5A5A5A
        seqs = {}
        for i in range(WRITES):
            d = bad if i % 3 == 2 else desc
            seq = c.send(Command.SINGLE_WRITE, {"len": 64, "src": [src, i * 64],
                                                "dst": [d, i * 64]},
                         flags=int(Flag.NO_REPLY))
            seqs[seq] = i % 3 == 2
        sync = c.send(Command.SYNCHRONIZE)
        events: dict[int, int] = {}
        while True:
            f = c.recv()
            if f.seq == sync:
                assert f.flags == int(Flag.REPLY), f
                break
            assert f.seq in seqs, f
            assert f.seq not in events, f"EVENT of seq {f.seq} twice"
            events[f.seq] = f.flags
            if seqs[f.seq]:
                assert f.flags == int(Flag.EVENT | Flag.ERROR), f
                assert f.body["code"] == ErrorCode.NOT_FOUND.value, f.body
            else:
                assert f.flags == int(Flag.EVENT) and f.body == {"ok": True}, f
        assert set(events) == set(seqs), f"{len(seqs) - len(events)} EVENTs missing"
        # The writes that were not refused landed, byte for byte.
        got = c.request(Command.GET_TENSOR, {"tensor": [bufs[1], 0, len(data)]})
        assert got.flags == int(Flag.REPLY) and got.payload is not None, got
        want = bytearray(len(data))
        for i in range(WRITES):
            if i % 3 != 2:
                want[i * 64:(i + 1) * 64] = data[i * 64:(i + 1) * 64]
        assert zlib.crc32(got.payload) == zlib.crc32(want)
