"""SINGLE_WRITE's body, field by field, on a live daemon: every malformed field is a
BAD_REQUEST naming it, whichever way the handler reads the body (the usual request in one
pass, anything else field by field), and the daemon serves the next request."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import DaemonProcess, RawConn
from transferd.protocol.constants import Command, ErrorCode, Flag

REFUSED = int(Flag.REPLY | Flag.ERROR)


def _setup(c: RawConn) -> tuple[int, Any]:
    """A registered region of this daemon's own and its MrDesc (a write to itself)."""
    buf = c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 8192})
    assert buf.flags == int(Flag.REPLY), buf.body
    mr = c.request(Command.REG_MR, {"buffer": buf.body["buffer"]})
    assert mr.flags == int(Flag.REPLY), mr.body
    return mr.body["mr"], mr.body["desc"]


def _body(mr: int, desc: Any, **change: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"len": 16, "src": [mr, 0], "dst": [desc, 4096]}
    for k, v in change.items():
        if v is _DROP:
            body.pop(k)
        else:
            body[k] = v
    return body


_DROP = object()

# (what changes, a word the refusal must name)
MALFORMED = [
    ({"len": True}, "len"),
    ({"len": -1}, "len"),
    ({"len": 1.5}, "len"),
    ({"len": _DROP}, "len"),
    ({"imm": True}, "imm"),
    ({"imm": 1 << 32}, "imm"),
    ({"imm": -1}, "imm"),
    ({"src": "ab"}, "src"),
    ({"src": [1]}, "src"),
    ({"src": [1, 2, 3]}, "src"),
    ({"src": {"a": 1, "b": 2}}, "src"),
    ({"src": [True, 0]}, "src mr"),
    ({"src": ["x", 0]}, "src mr"),
    ({"src": [-1, 0]}, "src mr"),
    ({"src": [1, -1]}, "src offset"),
    ({"src": [1, False]}, "src offset"),
    ({"dst": [b"x", 0]}, "MrDesc"),
    ({"dst": [[0, 0, "x"], 0]}, "MrDesc"),
    ({"wid": -1}, "wid"),
    ({"wid": "1"}, "wid"),
    ({"verify": 1}, "verify"),
    ({"verify": "yes"}, "verify"),
]


@pytest.mark.parametrize("change,names", MALFORMED, ids=[repr(c) for c, _ in MALFORMED])
def test_a_malformed_single_write_field_is_refused_by_name(
        daemon: DaemonProcess, change: dict[str, Any], names: str) -> None:
    with RawConn.to(daemon) as c:
        c.hello()
        mr, desc = _setup(c)
        body = _body(mr, desc, **change)
        if "dst" in change and isinstance(change["dst"], list):
            body["dst"] = change["dst"]
        f = c.request(Command.SINGLE_WRITE, body)
        assert f.flags == REFUSED, f
        assert f.body["code"] == ErrorCode.BAD_REQUEST.value, f.body
        assert names in f.body["message"], f.body
        # The connection and the daemon go on: a good write to itself lands.
        ok = c.request(Command.SINGLE_WRITE, _body(mr, desc))
        assert ok.flags == int(Flag.REPLY), ok.body
        event = c.recv()
        assert event.flags == int(Flag.EVENT) and event.body == {"ok": True}, event


def test_a_well_formed_write_past_its_region_is_out_of_bounds(daemon: DaemonProcess) -> None:
    with RawConn.to(daemon) as c:
        c.hello()
        mr, desc = _setup(c)
        for body in (_body(mr, desc, len=8193), _body(mr, desc, src=[mr, 8190]),
                     _body(mr, desc, len=(1 << 64) - 1)):
            f = c.request(Command.SINGLE_WRITE, body)
            assert f.flags == REFUSED, f
            assert f.body["code"] == ErrorCode.OUT_OF_BOUNDS.value, f.body
        f = c.request(Command.SINGLE_WRITE, _body(mr + 1000, desc))
        assert f.flags == REFUSED and f.body["code"] == ErrorCode.NOT_FOUND.value, f.body
