"""A value one past a limit, and what the refusal says: the number as it was sent."""

from __future__ import annotations

from tests.conftest import DaemonFactory
from tests.helpers import RawConn
from transferd.protocol.constants import Command


def test_a_lease_ttl_one_ms_over_the_longest_says_so(daemon_factory: DaemonFactory) -> None:
    """ttl_ms 3,600,001 (memory.max_lease_ttl_s is 3600): the refusal read "lease ttl of
    3600 s is outside (0, 3600]" (``:g`` keeps six digits), which contradicts itself.
    The longest is taken, one more millisecond refused naming what was asked."""
    d = daemon_factory()
    c = RawConn.to(d, timeout=10)
    c.hello()
    ok = c.request(Command.LEASE, {"lease": "longest", "ttl_ms": 3_600_000})
    assert not ok.is_error, ok
    f = c.request(Command.LEASE, {"lease": "one-more", "ttl_ms": 3_600_001})
    assert f.is_error and f.body["code"] == "BAD_REQUEST", f
    assert "3600.001 s" in f.body["message"], f.body
    assert "memory.max_lease_ttl_s" in f.body["message"], f.body
    f = c.request(Command.LEASE, {"lease": "none", "ttl_ms": 0})
    assert f.is_error and "0.0 s" in f.body["message"], f.body
    assert not c.request(Command.GET_DEVICES, {}).is_error


def test_a_body_nested_past_msgpacks_stack_is_named(daemon_factory: DaemonFactory) -> None:
    """100,000 nested arrays in a STATS body: BAD_FRAME (and the connection closed) said
    "body is not valid msgpack: " and nothing more (msgpack's StackError has no text)."""
    import struct

    d = daemon_factory()
    c = RawConn.to(d, timeout=10)
    c.hello()
    body = b"\x81\xa1a" + b"\x91" * 100_000 + b"\xc0"
    c.send_raw(struct.pack("<2sBBIIIQ", b"TD", Command.STATS, 0, 7, len(body), 0, 0) + body)
    f = c.recv()
    assert f.is_error and f.body["code"] == "BAD_FRAME", f
    assert f.body["message"] == "body is not valid msgpack: nested too deep", f.body
    other = RawConn.to(d, timeout=10)
    other.hello()
    assert not other.request(Command.GET_DEVICES, {}).is_error
