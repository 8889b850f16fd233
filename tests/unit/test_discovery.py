"""The directory, its rules and bounds, the records, the config keys, the HTTP layer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import pytest

from transferd.config import ConfigError, load
from transferd.config_discovery import parse_endpoints
from transferd.discovery.directory import Directory
from transferd.discovery.etcd_client import prefix_end
from transferd.discovery.names import Limits, check_name
from transferd.discovery.records import Change, Kind, Op, Peer, decode_value, encode_value
from transferd.discovery.service import record_to_wire
from transferd.protocol.errors import BadRequest, NotFound, OverLimit
from transferd.protocol.values import MrDesc, NetAddr

A, B = object(), object()  # two owners


def directory(**limits: int) -> tuple[Directory, list[Change]]:
    d = Directory("node-a", Limits(**limits))
    seen: list[Change] = []
    d.subscribe("", A, lambda ch, new: seen.append(ch))
    return d, seen


def test_publish_lookup_unpublish_and_the_changes_watchers_see() -> None:
    d, seen = directory()
    d.publish("kv/1", Kind.BYTES, b"one", A)
    assert d.lookup("kv/1").data == b"one"
    d.publish("kv/1", Kind.BYTES, b"two", A)  # the same owner replaces it
    d.unpublish("kv/1")
    assert [(c.op, c.value) for c in seen] == [(Op.PUT, b"one"), (Op.PUT, b"two"),
                                               (Op.DELETE, b"two")]
    with pytest.raises(NotFound):
        d.lookup("kv/1")
    with pytest.raises(NotFound):
        d.unpublish("kv/1")


def test_a_name_is_its_owners_alone() -> None:
    d, _ = directory()
    d.publish("x", Kind.BYTES, b"a", A)
    with pytest.raises(BadRequest, match="another owner"):
        d.publish("x", Kind.BYTES, b"b", B)

    def only_a(e: Any) -> None:
        raise BadRequest("not yours")

    with pytest.raises(BadRequest, match="not yours"):
        d.unpublish("x", only_a)
    assert d.lookup("x").data == b"a"


@pytest.mark.parametrize("name", ["", "x" * 257, "a\nb", "nul\x00", "del\x7f", 7, None])
def test_bad_names_are_refused(name: Any) -> None:
    with pytest.raises(BadRequest):
        check_name(name)
    d, _ = directory()
    with pytest.raises(BadRequest):
        d.publish(name, Kind.BYTES, b"", A)


def test_a_name_of_256_bytes_is_the_longest() -> None:
    check_name("é" * 128)
    with pytest.raises(BadRequest, match="257 bytes"):
        check_name("é" * 128 + "x")


def test_every_bound_is_exceeded_by_one_and_refused() -> None:
    d, _ = directory(max_names_per_owner=2, max_names=3, max_value_bytes=8)
    d.publish("a1", Kind.BYTES, b"12345678", A)
    with pytest.raises(OverLimit, match="max_value_bytes"):
        d.publish("a0", Kind.BYTES, b"123456789", A)
    d.publish("a2", Kind.BYTES, b"", A)
    with pytest.raises(OverLimit, match="max_names_per_owner"):
        d.publish("a3", Kind.BYTES, b"", A)
    d.publish("a2", Kind.BYTES, b"again", A)  # a replacement is not one more
    d.publish("b1", Kind.BYTES, b"", B)
    with pytest.raises(OverLimit, match=r"discovery\.max_names"):
        d.publish("b2", Kind.BYTES, b"", B)
    assert d.owned_by(A) == 2 and d.owned_by(B) == 1


def test_an_owner_gone_takes_its_names_and_watches() -> None:
    d, seen = directory()
    d.publish("a", Kind.BYTES, b"1", A)
    d.publish("b", Kind.BYTES, b"2", B)
    assert d.owner_gone(B) == 1
    assert [c.name for c in seen if c.op is Op.DELETE] == ["b"]
    d.owner_gone(A)  # A's watch goes first: nothing more delivered, its own names' end neither
    d.publish("c", Kind.BYTES, b"3", None)
    assert [c.name for c in seen] == ["a", "b", "b"]
    with pytest.raises(NotFound):
        d.lookup("a")
    assert d.watches == 0


class FakeRegion:
    closed = False


def test_an_mrdescs_name_goes_with_its_region() -> None:
    d, seen = directory()
    r = FakeRegion()
    desc = MrDesc(4096, [(NetAddr(1, 0, [("127.0.0.1", 1)]), 9)], 64)
    d.publish("kv/desc", Kind.MR_DESC, desc.to_bytes(), A, region=r)
    assert d.region_gone(r) == 1
    assert seen[-1].op is Op.DELETE and seen[-1].value == desc
    # Deregistered before the callback came: a lookup already finds it gone.
    r2 = FakeRegion()
    d.publish("kv/desc", Kind.MR_DESC, desc.to_bytes(), A, region=r2)
    r2.closed = True
    with pytest.raises(NotFound):
        d.lookup("kv/desc")
    assert seen[-1].op is Op.DELETE


def test_a_ttl_ends_a_name() -> None:
    async def go() -> None:
        d, seen = directory()
        d.publish("short", Kind.BYTES, b"x", A, ttl=0.05)
        d.publish("long", Kind.BYTES, b"y", A)
        await asyncio.sleep(0.15)
        assert [c.name for c in seen if c.op is Op.DELETE] == ["short"]
        d.lookup("long")

    asyncio.run(go())


def test_the_mirror_local_wins_and_every_record_is_bounded() -> None:
    d, seen = directory(max_cluster_names=2, max_value_bytes=16)
    assert d.remote_put("r1", "bytes", b"remote", "node-b")
    assert d.lookup("r1").node == "node-b"
    with pytest.raises(BadRequest, match="published through node 'node-b'"):
        d.publish("r1", Kind.BYTES, b"mine", A)
    with pytest.raises(BadRequest, match="node 'node-b'"):
        d.unpublish("r1")
    assert not d.remote_put("r2", "bytes", b"x" * 17, "node-b")  # over the value size
    assert not d.remote_put("r3", "nonsense", b"x", "node-b")  # not a kind
    assert not d.remote_put("r4", "mr_desc", b"\x01garbage", "node-b")  # does not parse
    assert not d.remote_put("bad\nname", "bytes", b"x", "node-b")
    assert d.remote_put("r5", "bytes", b"x", "node-c")
    assert not d.remote_put("r6", "bytes", b"x", "node-c")  # over max_cluster_names
    assert d.ignored == 5
    d.remote_reset([("r5", "bytes", b"y", "node-c")])
    assert sorted(d.remote) == ["r5"] and d.lookup("r5").data == b"y"
    assert [(c.op, c.name, c.value) for c in seen[-2:]] == [(Op.PUT, "r5", b"y"),
                                                           (Op.DELETE, "r1", b"remote")]


def test_listing_is_sorted_paged_and_bounded() -> None:
    d, _ = directory(max_names_per_owner=100)
    for i in range(25):
        d.publish(f"p/{i:02}", Kind.BYTES, b"", A)
    d.publish("q/0", Kind.BYTES, b"", A)
    page, more = d.listing("p/", 10)
    assert [e.name for e in page] == [f"p/{i:02}" for i in range(10)] and more
    page, more = d.listing("p/", 10, after="p/19")
    assert [e.name for e in page] == [f"p/{i}" for i in range(20, 25)] and not more


def test_watch_bounds() -> None:
    d = Directory("n", Limits(max_watches=3, max_watches_per_connection=2))
    d.subscribe("", A, lambda c, new: None)
    d.subscribe("", A, lambda c, new: None)
    with pytest.raises(OverLimit, match="max_watches_per_connection"):
        d.subscribe("", A, lambda c, new: None)
    d.subscribe("", B, lambda c, new: None)
    with pytest.raises(OverLimit, match=r"discovery\.max_watches"):
        d.subscribe("", B, lambda c, new: None)


def test_values_round_trip_and_a_bad_one_is_refused() -> None:
    addr = NetAddr(5, 0, [("127.0.0.1", 80)])
    desc = MrDesc(1, [(addr, 2)], 3)
    for v in (addr, desc, b"raw"):
        kind, raw = encode_value(v)
        assert decode_value(kind, raw) == v
    with pytest.raises(BadRequest):
        encode_value("a str")
    with pytest.raises(BadRequest):
        decode_value("net_addr", b"\xc1")
    with pytest.raises(BadRequest, match="kind"):
        decode_value("float", b"")
    ch = Change.from_body({"op": "delete", "name": "n", "kind": "bytes", "value": b"v",
                           "node": "x"})
    assert (ch.op, ch.value, ch.node) == (Op.DELETE, b"v", "x")


def test_a_forged_node_record_is_trimmed_or_refused() -> None:
    addr = NetAddr(5, 0, [("127.0.0.1", 80)])
    import base64

    good = {"name": "b", "node": "05", "addr": base64.b64encode(addr.to_bytes()).decode(),
            "version": [1, 2, 0], "rails": ["127.0.0.1:80"], "urls": ["tcp://h:1"] * 99,
            "capabilities": {"deep": {"er": {"and": {"deeper": {"still": {"x": 1}}}}},
                             **{f"k{i}": i for i in range(100)}}}
    wire = record_to_wire(good)
    assert wire is not None and wire["node"] == 5 and len(wire["urls"]) == 16
    assert len(wire["capabilities"]) == 32
    peer = Peer.from_body(wire)
    assert peer.addr == addr and peer.version == (1, 2, 0)
    for bad in ({"addr": "not base64!"}, {"addr": base64.b64encode(b"\x01junk").decode()},
                {"node": "zz"}, {"version": ["a"]}, {"name": "b\x1b[2J"}, {"name": ""},
                {"rails": ["127.0.0.1:80\x1b[1A"]}, {"server": "s\u202e"},
                {"urls": ["tcp://h:1\u2028"]}, {"urls": ["tcp://" + "h" * 600]},
                {"capabilities": {"k": "\x07"}}, {"capabilities": {"\x9b": 1}},
                {"rails": [80]}):
        assert record_to_wire({**good, **bad}) is None, bad
    # A list is cut to its bound before its strings are judged: a 17th rail is not read.
    assert record_to_wire({**good, "rails": ["r"] * 16 + ["\x1b"]}) is not None


def test_a_node_name_with_a_control_character_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"discovery\.node_name.*control"):
        load(env={"TRANSFERD_DISCOVERY_NODE_NAME": "node\x1b[31m"})


def test_endpoints_and_the_config_checks() -> None:
    assert parse_endpoints("etcd://10.0.0.1:2379,[::1]:2380") == [("10.0.0.1", 2379),
                                                                 ("::1", 2380)]
    for url in ("http://h:1", "etcd://h", "etcd://h:0", "etcd://user:pw@h:2379"):
        with pytest.raises(ValueError):
            parse_endpoints(url)
    with pytest.raises(ConfigError, match="credentials do not go in the URL"):
        load(env={"TRANSFERD_DISCOVERY_URL": "etcd://u:p@127.0.0.1:2379"})
    with pytest.raises(ConfigError, match=r"discovery\.timeout_s"):
        load(env={"TRANSFERD_DISCOVERY_TTL_S": "3", "TRANSFERD_DISCOVERY_TIMEOUT_S": "2"})
    with pytest.raises(ConfigError, match=r"discovery\.password_file"):
        load(env={"TRANSFERD_DISCOVERY_PASSWORD_FILE": "/x"})
    assert load().discovery.url == "" and not load().discovery.etcd


def test_prefix_end() -> None:
    assert prefix_end(b"/transferd/") == b"/transferd0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"


def test_the_http_stream_reads_split_and_joined_objects_and_bounds_them() -> None:
    from transferd.discovery.http import HttpConnection, Unavailable

    objs = [{"result": {"events": [{"kv": {"key": "a" * n}}]}} for n in (1, 500, 3)]
    wire = b"".join(json.dumps(o).encode() + b"\n" for o in objs)

    async def go(body: bytes, max_response: int) -> list[Any]:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.readuntil(b"\r\n\r\n")
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(0, len(body), 7):  # objects cut anywhere, chunk by chunk
                part = body[i:i + 7]
                w.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                await w.drain()
            w.write(b"0\r\n\r\n")
            await w.drain()
            w.close()

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        got: list[Any] = []
        conn = HttpConnection("127.0.0.1", port, timeout=2, max_response=max_response)
        try:
            async for o in conn.stream("/v3/watch", {}):
                got.append(o)
        except Unavailable as exc:
            got.append(str(exc))
        srv.close()
        return got

    got = asyncio.run(go(wire, 1 << 20))
    assert got[:3] == objs and "the stream ended" in got[3]
    got = asyncio.run(go(b'{"never": "' + b"x" * 5000, 4096))
    assert len(got) == 1 and "over 4096 bytes" in got[0]


def test_a_dribbled_never_ending_object_costs_its_bytes_not_a_parse_per_read() -> None:
    # A lying server: 1.5 MB of an object that never ends, then 1,000 small pieces of
    # it, one at a time.  Parsed again at each read, that is 1,000 parses of 1.5 MB
    # (seconds of the daemon's loop, for a peer that spends nothing); with each byte
    # looked at once, the pieces cost what they weigh.
    from transferd.discovery.http import HttpConnection, Unavailable

    async def go(first: bytes, pieces: int, max_response: int = 16 << 20) -> str:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.readuntil(b"\r\n\r\n")
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" +
                    f"{1 << 40:x}\r\n".encode() + first)  # a chunk size that lies
            with contextlib.suppress(OSError):
                await w.drain()
                await asyncio.sleep(0.05)
                for _ in range(pieces):
                    w.write(b"x" * 256)
                    await w.drain()
                    await asyncio.sleep(0.0005)  # each its own read on the other side
            w.close()

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        conn = HttpConnection("127.0.0.1", port, timeout=2, max_response=max_response)
        try:
            async for _ in conn.stream("/v3/watch", {}):
                pass
        except Unavailable as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            srv.close()
        return "ended"

    t0 = time.process_time()
    out = asyncio.run(asyncio.wait_for(go(b'{"result": "' + b"x" * (3 << 20), 1000), 60))
    cpu = time.process_time() - t0
    assert out.startswith("Unavailable") and "closed" in out, out
    assert cpu < 1.0, f"{cpu:.2f} s of CPU: the stream was parsed again at every read"
    # Over the bound: refused as TooLarge (an Unavailable), read no further.
    out = asyncio.run(go(b'{"result": "' + b"x" * (3 << 19), 0, max_response=1 << 20))
    assert out.startswith("TooLarge") and "over 1048576 bytes" in out, out
    # JSON nested past Python's stack is a malformed reply, not a RecursionError.
    out = asyncio.run(go(b"[" * 100_000 + b"\n", 0))
    assert out.startswith("Unavailable"), out


def test_names_refuse_control_format_and_separator_characters() -> None:
    for bad in ("a\x85b", "a\u2028b", "a\u2029b", "\u202eab", "a\ufeff", "a\u200db",
                "a\x00", "a\tb", "a\x7f"):
        with pytest.raises(BadRequest, match="character"):
            check_name(bad)
    for good in ("kv/é", "日本/0", "a b", "\U0001f600", "a\u00a0b", "a/../b"):
        assert check_name(good) == good


def test_a_name_refuses_exactly_what_a_log_line_or_a_listing_escapes() -> None:
    from transferd.discovery import names
    from transferd.logs import HOSTILE

    assert frozenset(names._REFUSED) == HOSTILE
