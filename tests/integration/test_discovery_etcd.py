"""Discovery against a real etcd (tests/etcd_server.py): daemons as subprocesses.

Three daemons publish, look up and watch through one etcd; a SIGKILLed one
leaves peers() and lookup within its lease TTL; etcd stopped and restarted
under load fails no transfer and every daemon registers again; etcd with auth
and TLS; a name published by a connection that closes is gone everywhere; a
forged record in etcd cannot redirect a write.  Skipped, saying why, where
etcd-server or the etcd extra is missing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from client import Client, MrDesc, NetAddr, NotFound
from tests.etcd_server import EtcdServer
from tests.helpers import DaemonProcess, RawConn, async_test, digest, pattern, scrape
from tests.integration.engine_cluster import start_many
from transferd.protocol.constants import Command, Flag

TTL = 3


def disc_env(etcd: EtcdServer, ttl: int = TTL, **extra: str) -> dict[str, str]:
    env = {"TRANSFERD_DISCOVERY_URL": etcd.url, "TRANSFERD_DISCOVERY_TTL_S": str(ttl),
           "TRANSFERD_DISCOVERY_TIMEOUT_S": "0.8", "TRANSFERD_DISCOVERY_RETRY_MAX_S": "0.5"}
    env.update({f"TRANSFERD_DISCOVERY_{k.upper()}": v for k, v in extra.items()})
    return env


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path) as server:
        yield server


def daemons(n: int, env: dict[str, str]) -> list[DaemonProcess]:
    return start_many([{"env": env} for _ in range(n)])


def stop_all(ds: list[DaemonProcess]) -> None:
    for d in ds:
        d.stop()


async def until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Poll ``check`` until true; the seconds it took (AssertionError after ``timeout``)."""
    t0 = time.monotonic()
    while True:
        if await check():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)


async def peer_names(c: Client) -> set[str]:
    return {p.name for p in await c.peers()}


async def gone(c: Client, name: str) -> bool:
    try:
        await c.lookup(name)
    except NotFound:
        return True
    return False


def test_three_daemons_publish_lookup_watch(etcd: EtcdServer) -> None:
    ds = daemons(3, disc_env(etcd))
    try:
        _three(ds)
    finally:
        stop_all(ds)


@async_test(timeout=60)
async def _three(ds: list[DaemonProcess]) -> None:
    a, b, c = [await Client.connect(d.url) for d in ds]
    try:
        assert "names" in a.features
        nodes = {p.name: p for p in await a.peers()}
        await until(lambda: _has(a, 3), 10, "three peers in a's view")
        me = [p for p in await a.peers() if p.local]
        assert len(me) == 1 and me[0].addr == await a.main_address()
        assert me[0].version[:2] == (1, 2) and me[0].urls == (ds[0].url,)
        for cl in (b, c):
            # Every daemon sees the same three, each with its NetAddr and rails.
            await until(lambda cl=cl: _has(cl, 3), 10, "three peers")
        nodes = {p.name: p for p in await c.peers()}
        assert {p.addr for p in nodes.values()} == {await x.main_address() for x in (a, b, c)}
        assert all(p.rails and "engine" in p.capabilities["features"] for p in nodes.values())

        async with c.watch("kv/") as changes:
            size = 1 << 20
            buf = await a.alloc_buffer(size)
            _, desc = await a.reg_mr(buf)
            done = await a.publish("kv/a", desc)
            assert done.synced and done.owner == "connection"
            # Read straight after the publish on another daemon: found (the store has it).
            found = await b.lookup("kv/a")
            assert found == desc
            ch = await changes.next(5)
            assert (ch.op, ch.name, ch.value) == ("put", "kv/a", desc)
            assert ch.node == nodes_of(nodes, await a.main_address())
            # The looked-up MrDesc is usable: b writes into a's region, bytes checked.
            src = await b.alloc_buffer(size)
            data = pattern(size, 22)
            await b.set_tensor(src.tensor(), data)
            mr, _ = await b.reg_mr(src)
            w = await b.submit_single_write(size, None, (mr, 0), (found, 0))
            await asyncio.wait_for(w, 20)
            assert digest(await a.get_tensor(buf.tensor())) == digest(data)
            # A name that exists elsewhere cannot be taken over from another daemon.
            with pytest.raises(Exception, match="published through node"):
                await b.publish("kv/a", b"mine")
            assert await c.lookup("kv/a") == desc
            await a.unpublish("kv/a")
            ch = await changes.next(5)
            assert (ch.op, ch.name) == ("delete", "kv/a")
            await until(lambda: gone(b, "kv/a"), 5, "kv/a gone on b")
        listing = await b.names("")
        assert "kv/a" not in [n.name for n in listing]
    finally:
        for x in (a, b, c):
            await x.close()


def nodes_of(nodes: dict[str, Any], addr: NetAddr) -> str:
    return next(name for name, p in nodes.items() if p.addr == addr)


async def _seen(c: Client, name: str) -> bool:
    return not await gone(c, name)


async def _has(c: Client, n: int) -> bool:
    return len(await c.peers()) >= n

def test_sigkill_leaves_peers_and_lookup_within_the_ttl(etcd: EtcdServer) -> None:
    ds = daemons(2, disc_env(etcd))
    try:
        _sigkill(ds)
    finally:
        stop_all(ds)


@async_test(timeout=60)
async def _sigkill(ds: list[DaemonProcess]) -> None:
    a = await Client.connect(ds[0].url)
    b = await Client.connect(ds[1].url)
    try:
        await until(lambda: _has(b, 2), 10, "two peers")
        await a.publish("dies/with/a", b"x", owner="daemon")

        async def seen_by_b() -> bool:  # (b's mirror follows etcd's watch: it may lag)
            try:
                return await b.lookup("dies/with/a") == b"x"
            except NotFound:
                return False

        await until(seen_by_b, 10, "a's name seen by b")
        a_name = next(p.name for p in await a.peers() if p.local)
        os.kill(ds[0].proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        ds[0].proc.wait(10)  # type: ignore[union-attr]
        took = await until(lambda: _not_in(b, a_name), TTL + 3, "a out of b's peers")
        assert await gone(b, "dies/with/a")
        # The lease did it: not before most of the TTL had run.
        assert took > TTL / 3, took
    finally:
        await b.close()
        a._conn and await a._conn.close()


async def _not_in(c: Client, name: str) -> bool:
    return name not in await peer_names(c)


def test_connection_close_takes_its_names_from_every_daemon(etcd: EtcdServer) -> None:
    ds = daemons(2, disc_env(etcd))
    try:
        _closing(ds)
    finally:
        stop_all(ds)


@async_test(timeout=40)
async def _closing(ds: list[DaemonProcess]) -> None:
    a = await Client.connect(ds[0].url)
    b = await Client.connect(ds[1].url)
    try:
        await until(lambda: _has(b, 2), 10, "two peers")
        await a.publish("conn/x", b"value")
        await a.publish("conn/kept", b"daemon's", owner="daemon")
        async with b.watch("conn/") as changes:
            seen = {(await changes.next(5)).name for _ in range(2)}
            assert seen == {"conn/x", "conn/kept"}
            await a.close()
            ch = await changes.next(5)
            assert (ch.op, ch.name, ch.value) == ("delete", "conn/x", b"value")
        assert await gone(b, "conn/x")
        assert await b.lookup("conn/kept") == b"daemon's"
    finally:
        await b.close()


def test_etcd_stopped_and_restarted_under_load_fails_no_transfer(etcd: EtcdServer) -> None:
    ds = daemons(2, disc_env(etcd))
    try:
        _restart(ds, etcd)
    finally:
        stop_all(ds)


@async_test(timeout=90)
async def _restart(ds: list[DaemonProcess], etcd: EtcdServer) -> None:
    a = await Client.connect(ds[0].url)
    b = await Client.connect(ds[1].url)
    try:
        await until(lambda: _has(a, 2), 10, "two peers")
        size = 256 << 10
        dst = await b.alloc_buffer(size * 8)
        _, desc = await b.reg_mr(dst)
        await b.publish("load/dst", desc)
        # (Published through B; A mirrors it from etcd's watch, a moment later.)
        await until(lambda: _seen(a, "load/dst"), 10, "A sees load/dst")
        found = await a.lookup("load/dst")
        src = await a.alloc_buffer(size)
        mr, _ = await a.reg_mr(src)
        stop = asyncio.Event()
        counts = {"ok": 0}

        async def load() -> None:
            i = 0
            while not stop.is_set():
                data = pattern(size, i)
                await a.set_tensor(src.tensor(), data)
                w = await a.submit_single_write(size, None, (mr, 0), (found, (i % 8) * size))
                await asyncio.wait_for(w, 20)  # any failure fails the test
                got = await b.get_tensor(dst.tensor((i % 8) * size, size))
                assert digest(got) == digest(data)
                counts["ok"] += 1
                i += 1

        task = asyncio.ensure_future(load())
        await asyncio.sleep(0.5)
        etcd.stop()
        await until(lambda: _state(a, "away"), 10, "a says etcd is away")
        status = dict((await a.conn.request(Command.STATS, {"discovery": True})).body)
        assert status["discovery"]["state"] == "away" and status["discovery"]["error"]
        assert scrape(ds[0].metrics_url)['transferd_discovery_up{backend="etcd"}'] == 0.0
        # Names and peers it knew are still served; a publish answers at once, unsynced.
        assert await a.lookup("load/dst") == desc
        assert len(await a.peers()) == 2
        t0 = time.monotonic()
        p = await a.publish("load/while-away", b"later")
        assert not p.synced and time.monotonic() - t0 < 0.5
        before = counts["ok"]
        await asyncio.sleep(1.0)
        assert counts["ok"] > before, "transfers stalled while etcd was away"
        etcd.start()
        await until(lambda: _state(a, "up"), 15, "a registered again")
        await until(lambda: _state(b, "up"), 15, "b registered again")
        await until(lambda: _has(a, 2), 10, "two peers again")
        await until(lambda: _found(b, "load/while-away"), 10, "the name published while away")
        keys = etcd.stored()
        assert any(k.endswith("/names/load/while-away") for k in keys), keys
        await asyncio.sleep(0.5)
        stop.set()
        await task
        assert counts["ok"] > before + 2
        assert scrape(ds[0].metrics_url)['transferd_discovery_up{backend="etcd"}'] == 1.0
    finally:
        for x in (a, b):
            await x.close()


async def _state(c: Client, state: str) -> bool:
    return (await c.discovery_status()).get("state") == state


async def _found(c: Client, name: str) -> bool:
    return not await gone(c, name)


async def _listed(c: Client, peer: str) -> bool:
    return peer in await peer_names(c)


def test_etcd_with_auth_and_tls(tmp_path: Path) -> None:
    with EtcdServer(tmp_path, tls=True) as etcd:
        etcd.enable_auth("td", "s3cret-pw")
        pw = tmp_path / "etcd-password"
        pw.write_text("s3cret-pw\n")
        pw.chmod(0o600)
        env = disc_env(etcd, user="td", password_file=str(pw), ca_file=etcd.certs["ca"],
                       cert_file=etcd.certs["cert"], key_file=etcd.certs["key"])
        ds = daemons(2, env)
        bad = DaemonProcess(env={**env, "TRANSFERD_DISCOVERY_PASSWORD_FILE":
                                 str(_file(tmp_path / "wrong", "nope"))}).start().wait_ready()
        try:
            _secure(ds, bad, etcd)
        finally:
            stop_all([*ds, bad])


def _file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@async_test(timeout=40)
async def _secure(ds: list[DaemonProcess], bad: DaemonProcess, etcd: EtcdServer) -> None:
    a = await Client.connect(ds[0].url)
    b = await Client.connect(ds[1].url)
    x = await Client.connect(bad.url)
    try:
        await until(lambda: _has(b, 2), 10, "two peers over TLS with auth")
        await a.publish("tls/name", b"over tls")
        assert await b.lookup("tls/name") == b"over tls"
        assert any(k.endswith("/names/tls/name") for k in etcd.stored())
        # A wrong password: the daemon serves all the same, and says why etcd is not up.
        st = await x.discovery_status()
        assert st["state"] != "up"
        await until(lambda: _error(x, "authentication failed"), 10, "the auth error reported")
        await x.publish("local/only", b"1")
        assert await x.lookup("local/only") == b"1"
        assert "tls/name" not in [n.name for n in await x.names()]
    finally:
        for c in (a, b, x):
            await c.close()


async def _error(c: Client, text: str) -> bool:
    return text in (await c.discovery_status()).get("error", "")


def test_a_forged_record_in_etcd_cannot_redirect_a_write(etcd: EtcdServer,
                                                         tmp_path: Path) -> None:
    ds = daemons(2, disc_env(etcd))
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    got: list[bytes] = []

    def serve() -> None:  # what a liar at the forged address would receive
        trap.settimeout(15)
        try:
            while True:
                conn, _ = trap.accept()
                conn.settimeout(2)
                try:
                    while chunk := conn.recv(65536):
                        got.append(chunk)
                except OSError:
                    pass
                conn.close()
        except OSError:
            return

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        _forged(ds, etcd, trap.getsockname()[1], got)
    finally:
        trap.close()
        stop_all(ds)


@async_test(timeout=60)
async def _forged(ds: list[DaemonProcess], etcd: EtcdServer, trap_port: int,
                  got: list[bytes]) -> None:
    a = await Client.connect(ds[0].url)
    b = await Client.connect(ds[1].url)
    try:
        await until(lambda: _has(a, 2), 10, "two peers")
        size = 64 << 10
        dst = await b.alloc_buffer(size)
        _, desc = await b.reg_mr(dst)
        baddr = await b.main_address()
        src = await a.alloc_buffer(size)
        await a.set_tensor(src.tensor(), pattern(size, 5))
        mr, _ = await a.reg_mr(src)
        # a has a link to b, bound to b's authenticated address.
        w = await a.submit_single_write(size, None, (mr, 0), (desc, 0))
        await asyncio.wait_for(w, 20)
        # Someone with write access to etcd puts b's node id and rkey at another address.
        fake = NetAddr(baddr.node, baddr.group, [("127.0.0.1", trap_port)])
        forged = MrDesc(desc.ptr, [(fake, desc.rkeys[0][1])], desc.size)
        record = {"v": 1, "kind": "mr_desc", "value": base64.b64encode(forged.to_bytes())
                  .decode(), "node": "liar"}
        etcd.ctl("put", "/transferd/names/kv/forged", json.dumps(record))
        node = {"v": 1, "name": "liar", "node": f"{baddr.node:016x}",
                "addr": base64.b64encode(fake.to_bytes()).decode(), "version": [1, 2, 0]}
        etcd.ctl("put", "/transferd/nodes/liar", json.dumps(node))
        await until(lambda: _found(a, "kv/forged"), 10, "the forged name mirrored")
        # The two records are two puts: the node's may reach a's watch after the name's.
        await until(lambda: _listed(a, "liar"), 10, "the liar listed as what it says")
        looked = await a.lookup("kv/forged")
        assert looked == forged
        with pytest.raises(Exception, match="is at"):
            w = await a.submit_single_write(size, None, (mr, 0), (looked, 0))
            await asyncio.wait_for(w, 20)
        await asyncio.sleep(0.5)
        assert got == [], "bytes went to the forged address"
    finally:
        for c in (a, b):
            await c.close()


def _name_record(value: Any, kind: Any = "bytes", node: Any = "elsewhere") -> bytes:
    return json.dumps({"v": 1, "kind": kind, "value": value, "node": node}).encode()


# Records nobody's daemon writes: fields of the wrong type, base64 that is not, JSON
# that is not an object or nests past Python's stack, a value that is no MrDesc.
MALFORMED = {
    "int-value": _name_record(5), "bad-base64": _name_record("abc"),
    "list-kind": _name_record("YQ==", kind=["bytes"]), "dict-node": _name_record(
        "YQ==", node={"n": 1}), "array": b"[1, 2]", "not-json": b"\xff\xfe{",
    "deep": b"[" * 100_000, "junk-mr-desc": _name_record("anVuaw==", kind="mr_desc"),
}


def test_malformed_and_oversized_records_leave_discovery_up(etcd: EtcdServer) -> None:
    for key, raw in MALFORMED.items():
        etcd.put(f"/transferd/names/bad/{key}", raw)
    etcd.put("/transferd/names/bad/ctl\x01name", _name_record("YQ=="))
    etcd.put("/transferd/nodes/garbage", b'{"addr": 5, "version": "x"}')
    # 12 values of 1.45 MB (each under etcd's request limit): 23 MB of base64, over
    # what one reply of the snapshot may hold, none of them anything a daemon wrote.
    big = _name_record(base64.b64encode(b"x" * (1088 << 10)).decode())
    for i in range(12):
        etcd.put(f"/transferd/names/big/{i}", big)
    etcd.put("/transferd/names/ok/1", _name_record(base64.b64encode(b"one").decode()))
    ds = daemons(1, disc_env(etcd))
    try:
        _malformed(ds[0], etcd)
    finally:
        stop_all(ds)


@async_test(timeout=60)
async def _malformed(d: DaemonProcess, etcd: EtcdServer) -> None:
    c = await Client.connect(d.url)
    try:
        async def up() -> bool:
            return (await c.discovery_status())["state"] == "up"

        await until(up, 15, "discovery up despite the records")
        assert await c.lookup("ok/1") == b"one"
        st = await c.discovery_status()
        assert st["ignored"] >= len(MALFORMED) + 1 + 12 and st["mirrored"] == 1, st
        assert [n.name for n in await c.names()] == ["ok/1"]
        assert [p.name for p in await c.peers() if not p.local] == []
        # The same records arriving on the watch leave it running too.
        for key, raw in MALFORMED.items():
            etcd.put(f"/transferd/names/late/{key}", raw)
        etcd.put("/transferd/names/late/big", big_record())
        etcd.put("/transferd/names/ok/2", _name_record(base64.b64encode(b"two").decode()))
        await until(lambda: _found(c, "ok/2"), 10, "a good record after the bad ones")
        assert await c.lookup("ok/2") == b"two" and await up()
        assert (await c.publish("mine", b"m")).synced
    finally:
        await c.close()


def big_record() -> bytes:
    return _name_record(base64.b64encode(b"y" * (1088 << 10)).decode())


def test_a_second_daemon_under_a_taken_node_name_stays_out(etcd: EtcdServer) -> None:
    env = disc_env(etcd, node_name="same")
    a = daemons(1, env)[0]
    try:
        _same_name(a, env, etcd)
    finally:
        a.stop()


@async_test(timeout=60)
async def _same_name(a: DaemonProcess, env: dict[str, str], etcd: EtcdServer) -> None:
    ca = await Client.connect(a.url)

    def record() -> dict[str, Any]:
        return json.loads(etcd.stored()["/transferd/nodes/same"])

    try:
        async def registered(c: Client) -> bool:
            return (await c.discovery_status())["state"] == "up"

        await until(lambda: registered(ca), 10, "a registered")
        assert (await ca.publish("a/x", b"from-a", owner="daemon")).synced
        b = daemons(1, env)[0]
        try:
            cb = await Client.connect(b.url)

            async def refused() -> bool:
                return "must be unique" in (await cb.discovery_status()).get("error", "")

            await until(refused, 10, "b refused the taken name")
            # a's record and name are left alone: b writes nothing under the name.
            assert record()["urls"] == [a.url]
            p = await cb.publish("b/y", b"from-b", owner="daemon")
            assert not p.synced
            await asyncio.sleep(0.5)
            stored = etcd.stored()
            assert "/transferd/names/b/y" not in stored
            assert json.loads(stored["/transferd/names/a/x"])["value"] == \
                base64.b64encode(b"from-a").decode()
            assert (await ca.discovery_status())["state"] == "up"
            await ca.close()
            a.stop()  # its lease revoked: the name is free, b takes it
            await until(lambda: registered(cb), 10, "b registered once a is gone")
            assert record()["urls"] == [b.url]
            await until(lambda: _in_etcd(etcd, "/transferd/names/b/y"), 5, "b's name written")
            await cb.close()
        finally:
            b.stop()
    finally:
        await ca.close()


async def _in_etcd(etcd: EtcdServer, key: str) -> bool:
    return key in etcd.stored()


def test_names_that_come_and_go_while_etcd_is_away_queue_nothing(etcd: EtcdServer) -> None:
    d = daemons(1, disc_env(etcd))[0]
    try:
        _churn_away(d, etcd)
    finally:
        d.stop()


@async_test(timeout=60)
async def _churn_away(d: DaemonProcess, etcd: EtcdServer) -> None:
    c = await Client.connect(d.url)

    async def state() -> dict[str, Any]:
        return await c.discovery_status()

    try:
        await until(lambda: _state_is(c, "up"), 10, "registered")
        assert (await c.publish("gone/while-away", b"g", owner="daemon")).synced
        etcd.stop()
        await until(lambda: _state_is(c, "away"), 10, "etcd away")
        await c.unpublish("gone/while-away")  # in etcd: its delete must wait for it
        with RawConn.to(d) as raw:
            raw.hello()
            for i in range(5000):  # request-scoped names, come and gone while away
                raw.send(Command.PUBLISH, {"name": f"req/{i}", "kind": "bytes",
                                           "value": b"v" * 200}, flags=Flag.NO_REPLY)
                raw.send(Command.UNPUBLISH, {"name": f"req/{i}"}, flags=Flag.NO_REPLY)
            assert not raw.request(Command.PUBLISH, {"name": "kept", "kind": "bytes",
                                                     "value": b"k", "owner": "daemon"}).is_error
        st = await state()
        assert st["pending"] == 2, st  # the kept name, and the delete etcd needs
        etcd.start()
        await until(lambda: _state_is(c, "up"), 15, "registered again")
        await until(lambda: _pending(c, 0), 5, "caught up")
        stored = etcd.stored()
        assert "/transferd/names/kept" in stored
        assert not [k for k in stored if k.startswith(("/transferd/names/req/",
                                                       "/transferd/names/gone/"))]
    finally:
        await c.close()


async def _state_is(c: Client, state: str) -> bool:
    return (await c.discovery_status())["state"] == state


async def _pending(c: Client, n: int) -> bool:
    return int((await c.discovery_status())["pending"]) == n
