"""Per-request caps (issue 11): tensors per batch and bytes per reply, announced in HELLO.

A batch over the cap is refused whole with TOO_LARGE before a tensor is looked
up, the connection goes on; the client splits its queued batches under the
caps the server announced.
"""

from __future__ import annotations

from typing import Any

import pytest

from client import Client
from tests.conftest import DaemonFactory
from tests.helpers import RawConn, async_test, digest, pattern
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import OverLimit


def ok(f: Any) -> Any:
    assert not f.is_error, f.body
    return f


def too_large(f: Any, word: str) -> None:
    assert f.is_error and f.body["code"] == "TOO_LARGE", f.body
    assert word in f.body["message"], f.body


def _both_served(d: Any, c: RawConn) -> None:
    """After a refusal: ``c`` is served, and so is another connection; both closed."""
    ok(c.request(Command.STATS))
    o = RawConn.to(d)
    o.hello()
    ok(o.request(Command.STATS))
    c.close()
    o.close()


def test_hello_announces_the_caps(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(env={"TRANSFERD_SERVER_MAX_TENSORS": "100",
                            "TRANSFERD_SERVER_MAX_REPLY": "4096"})
    c = RawConn.to(d)
    hello = c.hello()
    assert (hello.body["max_tensors"], hello.body["max_reply"]) == (100, 4096)
    buf = ok(c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 65536})).body["buffer"]
    # 100 tensors: served; 101: TOO_LARGE, and the connection goes on.
    ok(c.request(Command.GET_TENSORS, {"tensors": [[buf, 8 * i, 8] for i in range(100)]}))
    too_large(c.request(Command.GET_TENSORS, {"tensors": [[buf, 0, 8]] * 101}), "max_tensors")
    too_large(c.request(Command.SET_TENSORS, {"tensors": [[buf, 0, 8]] * 101},
                        b"\x07" * 808), "max_tensors")
    # Nothing of the refused SET landed; the next frame after its payload is read.
    assert ok(c.request(Command.GET_TENSOR, {"tensor": [buf, 0, 8]})).payload == bytes(8)
    # Bytes per reply: 4096 served, 4097 refused, one tensor or a batch.
    ok(c.request(Command.GET_TENSOR, {"tensor": [buf, 0, 4096]}))
    too_large(c.request(Command.GET_TENSOR, {"tensor": [buf, 0, 4097]}), "max_reply")
    too_large(c.request(Command.GET_TENSORS, {"tensors": [[buf, 0, 4096], [buf, 0, 1]]}),
              "max_reply")
    ok(c.request(Command.STATS))


def test_default_caps_are_announced(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    c = RawConn.to(d)
    hello = c.hello()
    assert hello.body["max_tensors"] == 65536
    assert hello.body["max_reply"] == hello.body["max_payload"]


@async_test()
async def test_client_splits_under_the_announced_caps(daemon_factory: DaemonFactory) -> None:
    """max_tensors 100, max_reply 64 KiB: 250 queued sets and gets of 1 KiB go in 3 + 4."""
    d = daemon_factory(env={"TRANSFERD_SERVER_MAX_TENSORS": "100",
                            "TRANSFERD_SERVER_MAX_REPLY": str(64 * 1024)})
    async with await Client.connect(d.url) as c:
        assert (c.max_tensors, c.max_reply) == (100, 64 * 1024)
        n, size = 250, 1024
        buf = await c.alloc_buffer(n * size)
        data = [pattern(size, i) for i in range(n)]
        s0 = (await c.server_stats())["commands"]
        for i in range(n):
            c.set_tensor_async(buf.tensor(i * size, size), data[i])
        futs = [c.get_tensor_async(buf.tensor(i * size, size)) for i in range(n)]
        await c.flush()
        s1 = (await c.server_stats())["commands"]
        assert [digest(f.result()) for f in futs] == [digest(x) for x in data]
        assert s1["SET_TENSORS"] - s0["SET_TENSORS"] == 3  # 100 + 100 + 50
        assert s1["GET_TENSORS"] - s0["GET_TENSORS"] == 4  # 64 KiB each: 64+64+64+58


def test_receive_pools_per_connection_are_capped(daemon_factory: DaemonFactory) -> None:
    """engine.max_recv_pools = 3: the 4th SUBMIT_RECVS is TOO_LARGE; another connection's
    own allowance is untouched, and a closed connection's pools are gone."""
    d = daemon_factory(env={"TRANSFERD_ENGINE_MAX_RECV_POOLS": "3"})
    c = RawConn.to(d)
    c.hello()
    for _ in range(3):
        ok(c.request(Command.SUBMIT_RECVS, {"len": 64, "count": 1000}))
    too_large(c.request(Command.SUBMIT_RECVS, {"len": 64, "count": 1}), "max_recv_pools")
    ok(c.request(Command.STATS))
    o = RawConn.to(d)
    o.hello()
    ok(o.request(Command.SUBMIT_RECVS, {"len": 64, "count": 1}))
    c.close()
    again = RawConn.to(d)
    again.hello()
    for _ in range(3):
        ok(again.request(Command.SUBMIT_RECVS, {"len": 64, "count": 1}))


def test_a_batch_far_over_the_cap_is_refused_at_its_length(daemon_factory: DaemonFactory) -> None:
    """650,000 tensors (issue 11's attack): refused from the list's length prefix, before
    one tensor is decoded (the message names the decoder's cap, not a count it built)."""
    d = daemon_factory()
    c = RawConn.to(d)
    c.hello()
    buf = ok(c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 4096})).body["buffer"]
    too_large(c.request(Command.GET_TENSORS, {"tensors": [[buf, 0, 1]] * 650_000}),
              "more than 65536 entries")
    # With a payload: the payload is skipped whole, nothing lands, the next frame is read.
    too_large(c.request(Command.SET_TENSORS, {"tensors": [[buf, 0, 1]] * 65_537},
                        b"\x07" * 65_537), "more than 65536 entries")
    assert ok(c.request(Command.GET_TENSOR, {"tensor": [buf, 0, 8]})).payload == bytes(8)
    # Exactly the cap is decoded and served.
    ok(c.request(Command.GET_TENSORS, {"tensors": [[buf, 0, 1]] * 65_536}))
    ok(c.request(Command.STATS))


@async_test()
async def test_the_client_raises_a_refusal_as_over_limit(daemon_factory: DaemonFactory) -> None:
    """A per-request cap's TOO_LARGE comes back as OverLimit (issue 18.5: it was rebuilt as
    the fatal TooLarge, and ``except OverLimit`` never matched); the connection goes on."""
    d = daemon_factory(env={"TRANSFERD_SERVER_MAX_REPLY": "4096"})
    async with await Client.connect(d.url) as c:
        buf = await c.alloc_buffer(8192)
        with pytest.raises(OverLimit, match="max_reply") as err:
            await c.get_tensor(buf.tensor(0, 8192))
        assert not err.value.fatal
        data = pattern(4096, 5)
        await c.set_tensor(buf.tensor(0, 4096), data)
        assert digest(await c.get_tensor(buf.tensor(0, 4096))) == digest(data)
        # A frame over the server's announced max_payload is refused by the client, before
        # it is sent (the server would close the connection for it).
        c.conn.max_payload = 4096  # as if the server had announced 4 KiB
        with pytest.raises(OverLimit, match="max_payload"):
            await c.set_tensor(buf.tensor(0, 8192), bytes(8192))
        await c.synchronize()


PAGE = 4096


def _paged_bodies(mr: int, desc: Any, src: list[Any], dst: list[Any]
                  ) -> list[tuple[Command, dict[str, Any]]]:
    """A PAGED_WRITES, a PAGED_READS and an ARM_PAGED_WRITES (on watcher 0's number,
    looked up only after the pages are counted) of ``src`` and ``dst`` pages."""
    return [
        (Command.PAGED_WRITES, {"page_len": 16, "src": [mr, [src, PAGE, 0]],
                                "dst": [desc, [dst, PAGE, 0]]}),
        (Command.PAGED_READS, {"page_len": 16, "dst": [mr, [dst, PAGE, 0]],
                               "src": [desc, [src, PAGE, 0]]}),
        (Command.ARM_PAGED_WRITES, {"watcher": 0, "value": 1, "page_len": 16,
                                    "src": [mr, [src, PAGE, 0]],
                                    "dst": [desc, [dst, PAGE, 0]]}),
    ]


def test_paged_commands_over_the_page_cap_are_refused_before_a_page_is_read(
        daemon_factory: DaemonFactory) -> None:
    """engine.max_paged_pages = 4: five pages on either side refuse a PAGED_WRITES,
    PAGED_READS or ARM_PAGED_WRITES whole with TOO_LARGE, counted before one index is
    decoded (five that are not even integers: TOO_LARGE, not BAD_REQUEST); four go, and
    this connection and another are served.  Before, 350,000 pages (a 4 MiB body) were
    each decoded and planned: 0.65 s of the daemon's loop."""
    d = daemon_factory(env={"TRANSFERD_ENGINE_MAX_PAGED_PAGES": "4"})
    c = RawConn.to(d)
    c.hello()
    buf = ok(c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 4 * PAGE})).body
    reg = ok(c.request(Command.REG_MR, {"buffer": buf["buffer"], "access": "rw"})).body
    mr, desc = reg["mr"], reg["desc"]
    four, five, junk = [0, 1, 2, 3], [0, 1, 2, 3, 0], ["x"] * 5
    for src, dst in ((five, five), (four, five), (five, four), (junk, four), (four, junk)):
        for cmd, body in _paged_bodies(mr, desc, src, dst):
            too_large(c.request(cmd, body), "engine.max_paged_pages")
    # Exactly the cap: the write is taken and lands (its completion EVENT), the read too.
    for cmd, body in _paged_bodies(mr, desc, four, four)[:2]:
        ok(c.request(cmd, body))
        event = c.recv()
        assert event.flags == int(Flag.EVENT) and event.body == {"ok": True}, event
    # The ARM at the cap gets past the count to the watcher it names (none here).
    cmd, body = _paged_bodies(mr, desc, four, four)[2]
    f = c.request(cmd, body)
    assert f.is_error and f.body["code"] == "NOT_FOUND", f.body
    _both_served(d, c)


def test_the_default_page_cap_refuses_what_a_4_mib_body_holds(
        daemon_factory: DaemonFactory) -> None:
    """The default engine.max_paged_pages (65,536: scale_pages' largest) is served; the
    350,000 pages of the attack are TOO_LARGE before one is decoded (before, each was
    decoded and checked, then the write refused OUT_OF_BOUNDS: 0.65 s of the loop)."""
    d = daemon_factory()
    c = RawConn.to(d)
    c.hello()
    size = (1 << 16) * 16
    buf = ok(c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": size})).body
    reg = ok(c.request(Command.REG_MR, {"buffer": buf["buffer"], "access": "rw"})).body
    mr, desc = reg["mr"], reg["desc"]
    attack = list(range(350_000))
    too_large(c.request(Command.PAGED_WRITES, {
        "page_len": 16, "src": [mr, [attack, 16, 0]], "dst": [desc, [attack, 16, 0]]}),
        "350000 pages is over this daemon's cap of 65536 (engine.max_paged_pages)")
    cap = list(range(1 << 16))
    ok(c.request(Command.PAGED_WRITES, {"page_len": 16, "src": [mr, [cap, 16, 0]],
                                        "dst": [desc, [cap, 16, 0]]}))
    event = c.recv()
    assert event.flags == int(Flag.EVENT) and event.body == {"ok": True}, event
    c.close()


def test_a_gather_over_the_source_cap_is_refused_before_a_source_is_read(
        daemon_factory: DaemonFactory) -> None:
    """engine.max_scatter_dsts = 4 bounds a GATHER's sources on the wire as a SCATTER's
    destinations: five that are not even sources are TOO_LARGE (counted before one is
    decoded), four such are BAD_REQUEST (decoded: the count let them by); the
    connection and another are served.  Before, the wire's own cap (4096, BAD_REQUEST)
    was not the daemon's key, and an in-process caller had none."""
    d = daemon_factory(env={"TRANSFERD_ENGINE_MAX_SCATTER_DSTS": "4"})
    c = RawConn.to(d)
    c.hello()
    buf = ok(c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": PAGE})).body
    mr = ok(c.request(Command.REG_MR, {"buffer": buf["buffer"]})).body["mr"]
    too_large(c.request(Command.GATHER, {"mr": mr, "srcs": [["x"]] * 5}),
              "a GATHER of 5 sources is over this daemon's cap of 4 (engine.max_scatter_dsts)")
    f = c.request(Command.GATHER, {"mr": mr, "srcs": [["x"]] * 4})
    assert f.is_error and f.body["code"] == "BAD_REQUEST", f.body
    _both_served(d, c)
