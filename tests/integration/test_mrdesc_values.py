"""An MrDesc's numbers on the wire: ``ptr``, ``size`` and every ``rkey`` are u64
(docs/protocol.md, "Values on the wire"), and a destination range lies inside the 64-bit
address space even where the MrDesc's ``size`` is 0 (unknown).  Anything else is refused
on arrival, typed, on every command that takes an MrDesc, and the daemon serves on.

Before these checks a negative ``ptr`` or ``rkey`` reached the peer frame's ``struct``
packing (INTERNAL, a traceback in the log); a float, a bool or a numeric string was
taken through ``int()``; and a ``ptr`` plus offset past 2**64 with ``size`` 0 raised in
the link's send path, where a write queued behind it while the link was being set up
never went (its EVENT never came).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.helpers import DaemonProcess, RawConn
from transferd.protocol.constants import Command, ErrorCode, Flag

REFUSED = int(Flag.REPLY | Flag.ERROR)
U64 = (1 << 64) - 1
PAGE = 4096


def _setup(c: RawConn) -> tuple[int, list[Any]]:
    buf = c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 4 * PAGE})
    assert buf.flags == int(Flag.REPLY), buf.body
    mr = c.request(Command.REG_MR, {"buffer": buf.body["buffer"], "access": "rw"})
    assert mr.flags == int(Flag.REPLY), mr.body
    return mr.body["mr"], mr.body["desc"]


def _bad_descs(desc: list[Any]) -> list[tuple[str, list[Any]]]:
    ptr, size, rkeys = desc
    (addr, _rkey), = rkeys
    return [
        ("ptr -1", [-1, size, rkeys]),
        ("ptr bool", [True, size, rkeys]),
        ("ptr float", [float(ptr), size, rkeys]),
        ("ptr str", [str(ptr), size, rkeys]),
        ("size -1", [ptr, -1, rkeys]),
        ("size float", [ptr, float(size), rkeys]),
        ("rkey -1", [ptr, size, [[addr, -1]]]),
        ("rkey float", [ptr, size, [[addr, 1.0]]]),
        ("rkey bool", [ptr, size, [[addr, False]]]),
        ("region past 2**64", [U64 - 100, size, rkeys]),
    ]


def _bodies(mr: int, desc: list[Any]) -> dict[str, tuple[Command, dict[str, Any]]]:
    """One body per command that takes an MrDesc, ``desc`` in the MrDesc's place."""
    return {
        "SINGLE_WRITE": (Command.SINGLE_WRITE, {"len": 16, "src": [mr, 0], "dst": [desc, 0]}),
        "PAGED_WRITES": (Command.PAGED_WRITES, {"page_len": 16, "src": [mr, [[0], PAGE, 0]],
                                                "dst": [desc, [[1], PAGE, 0]]}),
        "SCATTER": (Command.SCATTER, {"mr": mr, "dsts": [[16, 0, desc, 0]]}),
        "BARRIER": (Command.BARRIER, {"imm": 1, "dsts": [desc]}),
        "SINGLE_READ": (Command.SINGLE_READ, {"len": 16, "dst": [mr, 0], "src": [desc, 0]}),
    }


@pytest.mark.parametrize("cmd", ["SINGLE_WRITE", "PAGED_WRITES", "SCATTER", "BARRIER",
                                 "SINGLE_READ"])
def test_an_mrdesc_number_that_is_not_a_u64_is_bad_request(
        daemon: DaemonProcess, cmd: str) -> None:
    with RawConn.to(daemon) as c:
        c.hello()
        mr, desc = _setup(c)
        for why, bad in _bad_descs(desc):
            command, body = _bodies(mr, bad)[cmd]
            f = c.request(command, body)
            assert f.flags == REFUSED, (why, f)
            assert f.body["code"] == ErrorCode.BAD_REQUEST.value, (why, f.body)
            assert "MrDesc" in f.body["message"], (why, f.body)
        # The connection goes on: the good MrDesc is taken and its completion comes.
        command, body = _bodies(mr, desc)[cmd]
        f = c.request(command, body)
        assert f.flags == int(Flag.REPLY), f.body
        event = c.recv()
        assert event.flags == int(Flag.EVENT) and event.body == {"ok": True}, event


def test_an_arm_with_a_bad_mrdesc_is_bad_request(daemon: DaemonProcess) -> None:
    with RawConn.to(daemon) as c:
        c.hello()
        mr, desc = _setup(c)
        w = c.request(Command.ALLOC_UVM_WATCHER, {})
        assert w.flags == int(Flag.REPLY), w.body
        for why, bad in _bad_descs(desc):
            f = c.request(Command.ARM_PAGED_WRITES, {
                "watcher": w.body["watcher"], "value": 1, "page_len": 16, "imm": None,
                "src": [mr, [[0], PAGE, 0]], "dst": [bad, [[1], PAGE, 0]]})
            assert f.flags == REFUSED, (why, f)
            assert f.body["code"] == ErrorCode.BAD_REQUEST.value, (why, f.body)


def _unknown_size(desc: list[Any], ptr: int) -> list[Any]:
    return [ptr, 0, desc[2]]


def test_a_range_past_the_address_space_is_out_of_bounds_on_a_link_being_set_up(
        daemon_factory: Any) -> None:
    """A fresh daemon, so its link to itself is set up by these writes: the one past
    2**64 is refused on arrival, and the good one sent right behind it lands."""
    d: DaemonProcess = daemon_factory()
    with RawConn.to(d) as c:
        c.hello()
        mr, desc = _setup(c)
        # ptr + offset past 2**64 (size 0: the initiator cannot check against the region).
        bad = [
            (Command.SINGLE_WRITE, {"len": 16, "src": [mr, 0],
                                    "dst": [_unknown_size(desc, U64 - 8), 0]}),
            (Command.SINGLE_WRITE, {"len": 16, "src": [mr, 0],
                                    "dst": [_unknown_size(desc, U64 - 8 * PAGE), 16 * PAGE]}),
            (Command.PAGED_WRITES, {"page_len": 16, "src": [mr, [[0, 1], PAGE, 0]],
                                    "dst": [_unknown_size(desc, U64 - 2 * PAGE),
                                            [[0, 3], PAGE, 0]]}),
            (Command.SINGLE_READ, {"len": 16, "dst": [mr, 0],
                                   "src": [_unknown_size(desc, U64 - 8), 0]}),
        ]
        seq = 100
        for cmd, body in bad:
            seq += 1
            c.send(cmd, body, seq=seq, flags=Flag.NO_REPLY)
        good = seq + 1
        c.send(Command.SINGLE_WRITE, {"len": 16, "imm": 9, "src": [mr, 0],
                                      "dst": [desc, PAGE]}, seq=good, flags=Flag.NO_REPLY)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + 10
        while len(got) < len(bad) + 1 and time.monotonic() < deadline:
            f = c.recv()
            got[f.seq] = f
        assert len(got) == len(bad) + 1, f"only {sorted(got)} answered within 10 s"
        for s in range(101, 101 + len(bad)):
            f = got[s]
            assert f.flags == int(Flag.EVENT | Flag.ERROR), f
            assert f.body["code"] == ErrorCode.OUT_OF_BOUNDS.value, f.body
        assert got[good].flags == int(Flag.EVENT) and got[good].body == {"ok": True}
        assert d.alive()
        assert "Traceback" not in d.output(), d.output()


def _bad_pages() -> list[tuple[str, Any]]:
    return [
        ("stride float", [[0], 4096.0, 0]),
        ("offset float", [[1], PAGE, 0.0]),
        ("index float", [[1.0], PAGE, 0]),
    ]


def test_a_pages_number_that_is_not_an_integer_is_bad_request(daemon: DaemonProcess) -> None:
    """Pages' indices, stride and offset are integers (docs/protocol.md): a float is
    refused, never truncated into another page's address (4096.5 -> 4096)."""
    with RawConn.to(daemon) as c:
        c.hello()
        mr, desc = _setup(c)
        w = c.request(Command.ALLOC_UVM_WATCHER, {})
        good = [[1], PAGE, 0]
        for why, bad in _bad_pages():
            for cmd, body in (
                    (Command.PAGED_WRITES, {"page_len": 16, "src": [mr, good],
                                            "dst": [desc, bad]}),
                    (Command.PAGED_WRITES, {"page_len": 16, "src": [mr, bad],
                                            "dst": [desc, good]}),
                    (Command.PAGED_READS, {"page_len": 16, "dst": [mr, good],
                                           "src": [desc, bad]}),
                    (Command.ARM_PAGED_WRITES, {"watcher": w.body["watcher"], "value": 1,
                                                "page_len": 16, "imm": None,
                                                "src": [mr, bad], "dst": [desc, good]})):
                f = c.request(cmd, body)
                assert f.flags == REFUSED, (why, cmd.name, f)
                assert f.body["code"] == ErrorCode.BAD_REQUEST.value, (why, cmd.name, f.body)
                assert "Pages" in f.body["message"], (why, cmd.name, f.body)


@pytest.mark.parametrize("cmd", ["SINGLE_WRITE", "PAGED_WRITES", "SCATTER", "BARRIER",
                                 "SINGLE_READ"])
def test_an_mrdesc_with_more_rkeys_than_rails_can_be_is_refused_before_decoding_them(
        daemon: DaemonProcess, cmd: str) -> None:
    # One rkey per rail, at most 16 (the peer handshake's MAX_RAILS).  140,000 rkeys, each
    # a distinct NetAddr, fit a 4 MiB body: each was decoded (1.4 s of the daemon's loop,
    # everybody's frames waiting) before the rail count was looked at.
    from transferd.protocol.values import NetAddr

    with RawConn.to(daemon) as c:
        c.hello()
        mr, desc = _setup(c)
        ptr, size, _ = desc
        wide = [[NetAddr(i, 0, [b"127.0.0.1:%d" % (1 + i % 65000)]).to_bytes(), 1]
                for i in range(130_000)]
        for rkeys in (wide[:17], wide):
            command, body = _bodies(mr, [ptr, size, rkeys])[cmd]
            t0 = time.monotonic()
            f = c.request(command, body)
            took = time.monotonic() - t0
            assert f.flags == REFUSED, f
            assert f.body["code"] == ErrorCode.BAD_REQUEST.value, f.body
            assert "at most 16" in f.body["message"], f.body
        assert took < 5.0, took  # (the request and its refusal, not the cost of each rkey)
        # A NetAddr of more rails than a daemon can have is malformed too.
        addr = NetAddr(1, 0, [b"127.0.0.1:1"] * 17).to_bytes()
        f = c.request(Command.ADD_PEER_GROUP, {"addrs": [addr]})
        assert f.flags == REFUSED and f.body["code"] == ErrorCode.BAD_REQUEST.value, f.body
        assert "NetAddr" in f.body["message"], f.body
        command, body = _bodies(mr, desc)[cmd]
        f = c.request(command, body)
        assert f.flags == int(Flag.REPLY), f.body
        event = c.recv()
        assert event.flags == int(Flag.EVENT) and event.body == {"ok": True}, event
