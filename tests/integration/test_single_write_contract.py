"""SINGLE_WRITE's body against the contract (docs/protocol.md, SINGLE_WRITE and "Values
on the wire"), over generated bodies on a live daemon: the handler reads the usual body
in one pass and anything else field by field; whichever path a body takes, it is refused
BAD_REQUEST exactly when a field is malformed (the model below, written from the page,
not from the handler), and otherwise it is taken and its completion comes ``ok``.

Every field's variants one at a time, then random mixes of several (seeded: a failure
names the body and is reproducible).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from tests.helpers import DaemonProcess, RawConn
from transferd.protocol.constants import Command, ErrorCode, Flag

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
GOOD_TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ABSENT = object()
_wids = itertools.count(1 << 40)


def _fresh_wid() -> int:
    return next(_wids)  # a write id names one write: every taken body a new one


def variants(mr: int, desc: list[Any]) -> dict[str, list[tuple[Any, bool]]]:
    """Per field, (value, well formed?) as the contract says; ABSENT: the key left out."""
    ptr, size, rkeys = desc
    return {
        "len": [(16, True), (0, True), (True, False), (-1, False), (1.5, False),
                ("16", False), (None, False), (ABSENT, False)],
        "imm": [(ABSENT, True), (None, True), (7, True), (U32, True), (U32 + 1, False),
                (-1, False), (True, False), (1.5, False), ("7", False)],
        "src": [([mr, 0], True), ([mr, 16], True), ([mr], False), ([mr, 0, 0], False),
                ("x", False), ([True, 0], False), ([mr, -1], False), ([mr, 1.0], False),
                ({"a": 1}, False), ([mr, False], False), ([float(mr), 0], False),
                (ABSENT, False)],
        "dst": [([desc, 4096], True), ([desc, 0], True), ([desc], False),
                ([b"x", 0], False), ([desc, -1], False), ([desc, True], False),
                ([desc, 1.5], False), ([[float(ptr), size, rkeys], 0], False),
                ([[ptr, size, [[rkeys[0][0], -1]]], 0], False),
                ([[ptr, size, "x"], 0], False), ([[ptr, True, rkeys], 0], False),
                (ABSENT, False)],
        "wid": [(ABSENT, True), (None, True), ("fresh", True), (-1, False), (True, False),
                ("1", False), (1.5, False)],
        "verify": [(ABSENT, True), (None, True), (False, True), (1, False), (0, False),
                   ("yes", False)],
        "traceparent": [(ABSENT, True), (None, True), (GOOD_TP, True), ("nope", False),
                        (5, False), (GOOD_TP.encode(), False), ("ff" + GOOD_TP[2:], False)],
        "zz_extra": [(ABSENT, True), (1, True), ("x", True)],  # unknown keys are ignored
    }


def _body(choice: dict[str, Any]) -> dict[str, Any]:
    body = {}
    for k, v in choice.items():
        if v is ABSENT:
            continue
        body[k] = _fresh_wid() if v == "fresh" and k == "wid" else v
    return body


def _check(c: RawConn, body: dict[str, Any], good: bool) -> None:
    f = c.request(Command.SINGLE_WRITE, body)
    if not good:
        assert f.flags == int(Flag.REPLY | Flag.ERROR), (body, f)
        assert f.body["code"] == ErrorCode.BAD_REQUEST.value, (body, f.body)
        return
    assert f.flags == int(Flag.REPLY), (body, f.body)
    event = c.recv()
    assert event.seq == f.seq and event.flags == int(Flag.EVENT), (body, event)
    assert event.body == {"ok": True}, (body, event)


def test_generated_single_write_bodies_are_judged_as_the_contract_says(
        daemon: DaemonProcess) -> None:
    with RawConn.to(daemon) as c:
        c.hello()
        buf = c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 8192})
        mr = c.request(Command.REG_MR, {"buffer": buf.body["buffer"]})
        mr_id, desc = mr.body["mr"], mr.body["desc"]
        table = variants(mr_id, desc)
        base = {k: vs[0][0] for k, vs in table.items()}
        # Each variant alone.
        for k, vs in table.items():
            for v, ok in vs:
                _check(c, _body({**base, k: v}), ok)
        # Random mixes: each field malformed with a fair chance, so both paths see bodies
        # with one, two or more things wrong, and good bodies with every optional field.
        rng = random.Random(20261202)
        for _ in range(300):
            choice, good = {}, True
            for k, vs in table.items():
                v, ok = rng.choice(vs) if rng.random() < 0.5 else vs[0]
                choice[k] = v
                good = good and ok
            _check(c, _body(choice), good)
        assert daemon.alive()
