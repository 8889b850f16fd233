"""The per-submit address decoding is cached, bounded, and never caches a refusal."""

from __future__ import annotations

import msgpack
import pytest

from transferd.domains import rails
from transferd.protocol import values
from transferd.protocol.errors import BadRequest
from transferd.protocol.values import NetAddr


def test_a_netaddr_decoded_twice_is_the_same_value_and_a_malformed_one_always_raises() -> None:
    a = NetAddr(0x1234, 1, [("127.0.0.1", 4000), ("127.0.0.2", 4001)])
    raw = a.to_bytes()
    first = NetAddr.from_bytes(raw)
    assert first == a and NetAddr.from_bytes(raw) is first
    for _ in range(3):  # a refusal is not remembered as anything
        with pytest.raises(BadRequest, match="NetAddr: malformed"):
            NetAddr.from_bytes(msgpack.packb([99, 1, 0, [b"127.0.0.1:1"]]))
    # Not bytes: decoded the long way, same answer.
    assert NetAddr.from_bytes(bytearray(raw)) == a  # type: ignore[arg-type]
    assert values._netaddr_cached.cache_info().maxsize == 1024


def test_a_rail_parsed_twice_is_the_same_and_a_bad_one_always_raises() -> None:
    assert rails.parse_rail(b"127.0.0.1:80") == ("127.0.0.1", 80)
    hits = rails._parse_rail_cached.cache_info().hits
    assert rails.parse_rail(b"127.0.0.1:80") == ("127.0.0.1", 80)
    assert rails._parse_rail_cached.cache_info().hits == hits + 1
    for raw in (b"nohost:80", b"127.0.0.1:0", b"127.0.0.1:65536", b"\xff:1"):
        for _ in range(2):
            with pytest.raises(BadRequest):
                rails.parse_rail(raw)
    assert rails._parse_rail_cached.cache_info().maxsize == 1024
