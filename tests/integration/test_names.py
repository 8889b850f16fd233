"""Names on one daemon, the embedded default (discovery.url empty): real daemons, real sockets.

Publish, lookup and watch across connections; owners (connection, daemon, lease) and
what goes with them; an MrDesc's name with its region; a watcher that stops reading
costs one change per name; CANCEL of a watch; bounds exceeded by one; a minor-1
server; SyncClient; the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import subprocess
import sys
from collections.abc import Iterator

import pytest

from client import BadRequest, Client, MrDesc, NetAddr, NotFound, SyncClient, UnknownCommand
from client.names import Watch
from tests.helpers import DaemonProcess, RawConn, async_test, rss, start_daemon
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import TooLarge


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = start_daemon(env={"TRANSFERD_DISCOVERY_MAX_NAMES_PER_OWNER": "8",
                          "TRANSFERD_DISCOVERY_NODE_NAME": "node-a"})
    try:
        yield d
    finally:
        d.stop()


@async_test()
async def test_publish_lookup_watch_across_connections(daemon: DaemonProcess) -> None:
    a = await Client.connect(daemon.url)
    b = await Client.connect(daemon.url)
    try:
        addr = await a.main_address()
        p = await a.publish("t1/addr", addr)
        assert (p.owner, p.node, p.synced) == ("connection", "node-a", True)
        assert await b.lookup("t1/addr") == addr
        async with b.watch("t1/") as changes:
            assert changes.count == 1
            first = await changes.next(5)
            assert (first.op, first.name, first.value) == ("put", "t1/addr", addr)
            await a.publish("t1/raw", b"\x00\x01", ttl=0.2)
            ch = await changes.next(5)
            assert (ch.op, ch.value) == ("put", b"\x00\x01")
            ch = await changes.next(5)  # the ttl ran out
            assert (ch.op, ch.name) == ("delete", "t1/raw")
            await a.publish("other/x", b"not under t1/")
            await a.unpublish("t1/addr")
            ch = await changes.next(5)
            assert (ch.op, ch.name, ch.value) == ("delete", "t1/addr", addr)
        with pytest.raises(NotFound):
            await b.lookup("t1/addr")
        peers = await b.peers()
        assert len(peers) == 1 and peers[0].local and peers[0].addr == addr
        assert peers[0].name == "node-a" and peers[0].urls == (daemon.url,)
        assert (await b.discovery_status())["backend"] == "embedded"
    finally:
        await a.close()
        await b.close()


@async_test()
async def test_owners_connection_daemon_and_lease(daemon: DaemonProcess) -> None:
    a = await Client.connect(daemon.url)
    b = await Client.connect(daemon.url)
    try:
        await a.publish("t2/conn", b"c")
        await a.publish("t2/daemon", b"d", owner="daemon")
        async with a.lease("t2-lease", ttl=30) as lease:
            await a.publish("t2/lease", b"l", lease=lease.name)
            # A connection's name is that connection's: not another's to take or remove.
            with pytest.raises(BadRequest, match="another owner"):
                await b.publish("t2/conn", b"mine")
            with pytest.raises(BadRequest, match="another connection"):
                await b.unpublish("t2/conn")
            await a.close()
            await asyncio.sleep(0.2)
            assert {n.name for n in await b.names("t2/")} == {"t2/daemon", "t2/lease"}
            a = await Client.connect(daemon.url)
            with pytest.raises(BadRequest, match="has not joined"):  # the lease's holders'
                await a.unpublish("t2/lease")
            await a.end_lease("t2-lease", join=True)
            lease.detach()
        assert [n.name for n in await b.names("t2/")] == ["t2/daemon"]
        await b.unpublish("t2/daemon")  # the daemon's: whoever knows the name
        assert await b.names("t2/") == []
    finally:
        await a.close()
        await b.close()


@async_test()
async def test_an_mrdescs_name_goes_with_its_region(daemon: DaemonProcess) -> None:
    a = await Client.connect(daemon.url)
    b = await Client.connect(daemon.url)
    try:
        buf = await a.alloc_buffer(4096)
        mr, desc = await a.reg_mr(buf)
        await a.publish("t3/dereg", desc)
        assert await b.lookup("t3/dereg") == desc
        async with b.watch("t3/", initial=False) as changes:
            await a.dereg_mr(mr)
            ch = await changes.next(5)
            assert (ch.op, ch.name, ch.value) == ("delete", "t3/dereg", desc)
            _, desc2 = await a.reg_mr(buf)
            await a.publish("t3/free", desc2, owner="daemon")
            await changes.next(5)
            await a.free_buffer(buf)
            assert (await changes.next(5)).op == "delete"
        # An MrDesc that names no region here (another daemon's, or forged) is refused.
        forged = MrDesc(desc.ptr, [(NetAddr(12345, 0, [("127.0.0.1", 9)]), 1)], 64)
        with pytest.raises(BadRequest, match="holds its region"):
            await a.publish("t3/forged", forged)
        addr = await a.main_address()
        gone = MrDesc(desc.ptr, [(addr, desc.rkeys[0][1])], desc.size)
        with pytest.raises(NotFound, match="no registered region"):
            await a.publish("t3/gone", gone)
    finally:
        await a.close()
        await b.close()


def test_a_watcher_that_does_not_read_costs_one_change_per_name(
        daemon: DaemonProcess) -> None:
    with RawConn.to(daemon) as raw:
        raw.hello()
        raw.send(Command.WATCH, {"prefix": "t4/"}, seq=7)
        r = raw.recv()
        assert r.flags & Flag.REPLY and not r.is_error, r.body
        value = b"v" * 4000
        n = 3000

        async def flood() -> None:
            c = await Client.connect(daemon.url)
            try:
                for i in range(n):  # 12 MB of changes on 4 names: far over the socket buffers
                    await c.publish(f"t4/{i % 4}", value[:-8] + i.to_bytes(8, "big"))
                # The daemon kept serving this publisher throughout.
                assert len(await c.names("t4/")) == 4
            finally:
                await c.close()

        asyncio.run(asyncio.wait_for(flood(), 60))
        got: dict[str, int] = {}
        events = 0
        raw.sock.settimeout(2)
        try:
            while True:
                f = raw.recv()
                assert f.cmd == Command.WATCH and f.flags & Flag.EVENT
                events += 1
                got[f.body["name"]] = int.from_bytes(f.body["value"][-8:], "big")
                if got == {f"t4/{k}": n - 4 + k for k in range(4)}:
                    break
        except TimeoutError:
            pass
        # Every name's last state arrived; far fewer than 400 changes did (the rest merged),
        # and then the connection is closed, which takes the names with it.
        assert got == {f"t4/{k}": n - 4 + k for k in range(4)}, got
        assert events < n, events


def test_cancel_ends_a_watch_and_a_one_way_watch_is_refused(daemon: DaemonProcess) -> None:
    with RawConn.to(daemon) as raw:
        raw.hello()
        r = raw.request(Command.WATCH, {"prefix": "t5/", "initial": False})
        seq = r.seq
        raw.send(Command.CANCEL, {"seq": seq})
        ev = raw.recv()  # the watch's own end comes first, with its seq ...
        assert ev.seq == seq and ev.flags & Flag.EVENT and ev.body["code"] == "CANCELLED"
        rep = raw.recv()  # ... then CANCEL's reply
        assert rep.body == {"seq": seq, "cancelled": True}
        again = raw.request(Command.CANCEL, {"seq": seq})
        assert again.body["code"] == "NOT_FOUND"
        raw.send(Command.WATCH, {"prefix": "t5/"}, flags=Flag.NO_REPLY, seq=50)
        f = raw.recv()
        while f.seq != 50:
            f = raw.recv()
        assert f.is_error and f.body["code"] == "BAD_REQUEST"
        for bad in ({"prefix": 5}, {"prefix": "a\nb"}, {"prefix": "", "initial": "yes"}):
            e = raw.request(Command.WATCH, bad)
            assert e.is_error and e.body["code"] == "BAD_REQUEST", e.body
        for body in ({"name": "x", "kind": "bytes"}, {"name": "x", "kind": "pi", "value": b""},
                     {"name": "", "kind": "bytes", "value": b""},
                     {"name": "x", "kind": "net_addr", "value": b"\x92"},
                     {"name": "x", "kind": "bytes", "value": b"", "ttl_ms": 0},
                     {"name": "x", "kind": "bytes", "value": b"", "owner": "nobody"}):
            e = raw.request(Command.PUBLISH, body)
            assert e.is_error and e.body["code"] == "BAD_REQUEST", (body, e.body)
        e = raw.request(Command.PUBLISH, {"name": "x", "kind": "bytes", "value": b"x" * 4097})
        assert e.body["code"] == "TOO_LARGE" and "max_value_bytes" in e.body["message"]
        ok = raw.request(Command.LOOKUP, {"name": "nope"})
        assert ok.body["code"] == "NOT_FOUND"


@async_test()
async def test_one_name_over_the_owners_bound_is_too_large(daemon: DaemonProcess) -> None:
    c = await Client.connect(daemon.url)
    try:
        for i in range(8):
            await c.publish(f"t6/{i}", b"")
        with pytest.raises(TooLarge, match="max_names_per_owner"):
            await c.publish("t6/8", b"")
        await c.publish("t6/0", b"replaced")  # not one more
        assert await c.lookup("t6/0") == b"replaced"
    finally:
        await c.close()


def test_a_minor_1_server_serves_no_names() -> None:
    with DaemonProcess(["--protocol-minor", "1"]).start().wait_ready() as d:
        async def go() -> None:
            c = await Client.connect(d.url)
            try:
                with pytest.raises(UnknownCommand, match="serves no names"):
                    await c.publish("x", b"")
                with pytest.raises(UnknownCommand):
                    c.watch("")
            finally:
                await c.close()

        asyncio.run(go())
        with RawConn.to(d) as raw:
            raw.hello(minor=1)
            e = raw.request(Command.LOOKUP, {"name": "x"})
            assert e.body["code"] == "UNKNOWN_COMMAND"


def test_sync_client_names_and_watch(daemon: DaemonProcess) -> None:
    with SyncClient.connect(daemon.url) as a, SyncClient.connect(daemon.url) as b:
        a.publish("t7/x", b"1")
        assert b.lookup("t7/x") == b"1"
        with b.watch("t7/") as changes:
            assert next(changes).name == "t7/x"
            a.unpublish("t7/x")
            assert changes.next(5).op == "delete"
        assert isinstance(b._client.watch("t7/"), Watch)


def test_the_command_line_lists_peers_and_names(daemon: DaemonProcess) -> None:
    c = SyncClient.connect(daemon.url)
    try:
        c.publish("t8/kv/0", b"abc")
        c.publish("t8/kv/1", c.main_address())

        def cli(*args: str) -> str:
            r = subprocess.run([sys.executable, "-m", "transferd.cli", *args],
                               capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            return r.stdout

        out = cli("names", daemon.url, "t8/")
        assert "t8/kv/0" in out and "bytes" in out and "net_addr" in out
        assert "2 name(s) under 't8/'" in out and "embedded" in out
        rows = json.loads(cli("names", daemon.url, "t8/kv/1", "--json"))["names"]
        assert rows == [{"name": "t8/kv/1", "kind": "net_addr", "size": rows[0]["size"],
                         "node": "node-a"}]
        out = cli("peers", daemon.url)
        assert "* node-a" in out and "1 node(s)" in out
        j = json.loads(cli("peers", daemon.url, "--json"))
        assert j["peers"][0]["urls"] == [daemon.url]
        assert j["discovery"]["backend"] == "embedded"
    finally:
        c.close()


MiB = 1 << 20


def test_a_watcher_that_does_not_read_while_names_come_and_go_costs_nothing(
        daemon: DaemonProcess) -> None:
    # Unique names published and unpublished at once: the directory never holds more
    # than one, and neither may what waits for a watcher that stopped reading.
    with RawConn.to(daemon) as watcher, RawConn.to(daemon) as raw:
        watcher.hello()
        watcher.send(Command.WATCH, {"prefix": "t9/"}, seq=7)
        assert not watcher.recv().is_error
        raw.hello()
        before = rss(daemon)
        value, n = b"v" * 4000, 10000
        for i in range(n):  # 40 MB of values, pipelined
            raw.send(Command.PUBLISH, {"name": f"t9/{i}", "kind": "bytes", "value": value},
                     flags=Flag.NO_REPLY)
            raw.send(Command.UNPUBLISH, {"name": f"t9/{i}"}, flags=Flag.NO_REPLY)
        assert raw.request(Command.NAMES, {"prefix": "t9/"}).body["names"] == []
        grew = rss(daemon) - before
        assert grew < 16 * MiB, f"{grew / MiB:.0f} MiB for a watcher's backlog"
        # What reaches the watcher still tells the truth: each name it was told of
        # is then told gone, and far fewer than the 20,000 changes come.
        shown: set[str] = set()
        events = 0
        watcher.sock.settimeout(1)
        with contextlib.suppress(TimeoutError):
            while True:
                f = watcher.recv()
                events += 1
                (shown.add if f.body["op"] == "put" else shown.discard)(f.body["name"])
        assert shown == set() and events < n, events


@async_test()
async def test_a_client_watch_not_read_while_names_come_and_go_holds_nothing(
        daemon: DaemonProcess) -> None:
    # The client library reads every EVENT as it comes: what waits for a caller that
    # does not take them is the client's to bound, as the daemon's is.
    c = await Client.connect(daemon.url)
    try:
        async with c.watch("t15/") as changes:
            with RawConn.to(daemon) as raw:
                raw.hello()
                for i in range(10000):
                    raw.send(Command.PUBLISH, {"name": f"t15/{i}", "kind": "bytes",
                                               "value": b"v" * 1000}, flags=Flag.NO_REPLY)
                    raw.send(Command.UNPUBLISH, {"name": f"t15/{i}"}, flags=Flag.NO_REPLY)
                raw.request(Command.PUBLISH, {"name": "t15/~end", "kind": "bytes",
                                              "value": b"", "owner": "daemon"})
                await asyncio.sleep(0.5)  # the EVENTs are in before anything is taken
            got = []
            while not got or got[-1].name != "t15/~end":
                got.append(await changes.next(10))
            assert len(got) == 1, (len(got), got[:3])
        await c.unpublish("t15/~end")
    finally:
        await c.close()


def test_republishing_an_mrdescs_name_costs_nothing_per_publish(daemon: DaemonProcess) -> None:
    c = SyncClient.connect(daemon.url)
    try:
        buf = c.alloc_buffer(4096)
        _, desc = c.reg_mr(buf)
        with RawConn.to(daemon) as raw:
            raw.hello()
            before = rss(daemon)
            for _ in range(25000):  # the same name, the same region, again and again
                raw.send(Command.PUBLISH, {"name": "t10/kv", "kind": "mr_desc",
                                           "value": desc.to_bytes(), "owner": "daemon"},
                         flags=Flag.NO_REPLY)
            assert not raw.request(Command.LOOKUP, {"name": "t10/kv"}).is_error
            grew = rss(daemon) - before
            assert grew < 3 * MiB, f"{grew / MiB:.1f} MiB for one name published 25,000 times"
            c.free_buffer(buf)  # and the name still goes with the region
            assert raw.request(Command.LOOKUP, {"name": "t10/kv"}).body["code"] == "NOT_FOUND"
    finally:
        c.close()


def test_names_with_control_format_or_separator_characters_are_refused(
        daemon: DaemonProcess) -> None:
    with RawConn.to(daemon) as raw:
        raw.hello()
        for name in ("a\x85b", "a\u2028b", "a\u2029b", "t11/\u202egnp.exe", "\ufeffkv",
                     "a\u200bb", "a\x9bb"):
            e = raw.request(Command.PUBLISH, {"name": name, "kind": "bytes", "value": b""})
            assert e.body.get("code") == "BAD_REQUEST", (name, e.body)
            w = raw.request(Command.WATCH, {"prefix": name})
            assert w.body.get("code") == "BAD_REQUEST", (name, w.body)
        for name in ("t11/é", "t11/日本", "t11/a b", "t11/\U0001f600"):
            ok = raw.request(Command.PUBLISH, {"name": name, "kind": "bytes", "value": b""})
            assert not ok.is_error, (name, ok.body)


@async_test()
async def test_a_ttl_that_no_ttl_can_be_is_a_typed_error(daemon: DaemonProcess) -> None:
    c = await Client.connect(daemon.url)
    try:
        for ttl in (-1, 0, 0.0, math.nan, math.inf, -math.inf, 5e6, "10", True):
            with pytest.raises(BadRequest, match="ttl"):
                await c.publish("t12/x", b"", ttl=ttl)  # type: ignore[arg-type]
        assert await c.names("t12/") == []
        await c.publish("t12/x", b"", ttl=0.0001)  # under a millisecond: the shortest
    finally:
        await c.close()


@async_test()
async def test_a_watch_left_by_break_ends_on_the_daemon(daemon: DaemonProcess) -> None:
    c = await Client.connect(daemon.url)
    try:
        await c.publish("t13/x", b"1")
        for _ in range(100):  # more than discovery.max_watches_per_connection (64)
            async for ch in c.watch("t13/"):
                assert ch.name == "t13/x"
                break

        async def watches() -> int:
            return int((await c.discovery_status())["watches"])

        for _ in range(100):
            if await watches() == 0:
                break
            await asyncio.sleep(0.02)
        assert await watches() == 0
        # A watch kept by its caller is not ended behind its back.
        w = c.watch("t13/")
        assert (await w.next(5)).name == "t13/x"
        gc.collect()
        await c.publish("t13/y", b"2")
        assert (await w.next(5)).name == "t13/y"
        await w.close()
    finally:
        await c.close()


def test_a_watch_needs_a_seq_of_its_own(daemon: DaemonProcess) -> None:
    with RawConn.to(daemon) as raw:
        raw.hello()
        raw.send(Command.WATCH, {"prefix": "t14/", "initial": False}, seq=5)
        assert not raw.recv().is_error
        raw.send(Command.WATCH, {"prefix": "t14/", "initial": False}, seq=5)
        e = raw.recv()
        assert e.seq == 5 and e.body["code"] == "BAD_REQUEST" and "seq" in e.body["message"]
        raw.send(Command.CANCEL, {"seq": 5}, seq=6)
        assert raw.recv().body["code"] == "CANCELLED"
        assert raw.recv().body == {"seq": 5, "cancelled": True}
        st = raw.request(Command.PEERS, {}).body["discovery"]
        assert st["watches"] == 0, st
