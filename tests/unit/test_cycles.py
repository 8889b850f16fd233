"""What a closed connection, a WATCH, a refused request leave to the cyclic collector.

A long-lived daemon's objects sit in the collector's oldest generation: an object left
in a reference cycle is memory held until the next full pass, and a longer pass holding
the loop (every client waits). docs/probes/cycles.py measured, before stop 37: 30 objects
per closed tcp connection (the session, its sans-IO connection and its decoder held one
another's methods; the pre-auth ticket's owner was the session), 35 per unix and
seqpacket connection (our SocketTransport kept its protocol after connection_lost), 49
per tls connection (uvloop's TLS transport keeps the session's buffer_updated; the TLS
handshake's ticket named it back), 8 per WATCH (its subscription's deliver was the
stream's method), 34 per refused request (the error kept on the frame had a traceback
whose frames held the frame). The Python client library, in the caller's process: 72
to 77 objects per Client connected and closed (its parts held it and it them, its
connection held its methods, the decoder's sink was a method of the machine that holds
the decoder, and on Python 3.11 asyncio's tcp transport a method of itself), 163 per
SyncClient that saw a call fail (the error's traceback held the frame that held the
future that held the error). Each test here fails with those and finds nothing now
(``gc.collect()`` with the collector off meanwhile, as
tests/integration/test_attacks_cyclic_garbage.py does for expectations).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import mmap
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from fuzzing.harness import InProcessDaemon
from tests.helpers import RawConn, async_test, run
from transferd.discovery.directory import Directory
from transferd.discovery.records import Change
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import NotFound, TransferdError
from transferd.protocol.frames import Frame

TLS = shutil.which("openssl") is not None


@contextlib.contextmanager
def no_cycles(what: str, only: str = "") -> Iterator[None]:
    """The block leaves nothing in a reference cycle (the collector off meanwhile; what
    it would have found is named by type on failure); with ``only``, nothing of the
    modules whose names start with it."""
    gc.collect()
    gc.garbage.clear()
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.disable()
    try:
        yield
        gc.collect()
        kinds = collections.Counter(
            f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
            if type(o).__module__.startswith(only))
        found = sum(kinds.values())
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert found == 0, f"{what} left {found} objects in cycles: {kinds.most_common(12)}"


class _Daemon(InProcessDaemon):
    """InProcessDaemon with a unix, a seqpacket and (with openssl) a tls listener too."""

    def __init__(self, where: str) -> None:
        more: dict[str, Any] = {"server.unix_socket": f"{where}/s.sock",
                                "server.listen": [f"seqpacket://{where}/q.sock"]}
        if TLS:
            cert, key = f"{where}/cert.pem", f"{where}/key.pem"
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                 "ec_paramgen_curve:P-256", "-nodes", "-keyout", key, "-out", cert, "-days",
                 "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                check=True, capture_output=True, timeout=30)
            more.update({"server.tls_cert": cert, "server.tls_key": key})
            more["server.listen"].append("tls://127.0.0.1:0")
        super().__init__(more)

    def sessions(self) -> int:
        async def count() -> int:
            for _ in range(5):  # what the closes scheduled runs first
                await asyncio.sleep(0)
            return len(self._frontend.ctx.sessions)

        return self.call(count)

    def until_sessions(self, n: int) -> None:
        deadline = time.monotonic() + 10
        while self.sessions() > n:
            assert time.monotonic() < deadline, "the daemon did not see the close"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def daemon() -> Iterator[_Daemon]:
    where = tempfile.mkdtemp(prefix="td-cycles-")
    try:
        with _Daemon(where) as d:
            yield d
    finally:
        shutil.rmtree(where, ignore_errors=True)


def connect(d: _Daemon, kind: str = "tcp") -> RawConn:
    c = RawConn.at(d.urls[kind], cafile=d.config.server.tls_cert)
    assert not c.hello().is_error
    return c


def answer(c: RawConn, cmd: int, body: dict[str, Any], payload: bytes = b"") -> Frame:
    """The reply to a request (EVENTs before it are dropped)."""
    seq = c.send(cmd, body, payload)
    while True:
        f = c.recv()
        if f.seq == seq and not f.flags & int(Flag.EVENT):
            return f


def ok(c: RawConn, cmd: int, body: dict[str, Any], payload: bytes = b"") -> dict[str, Any]:
    f = answer(c, cmd, body, payload)
    assert not f.is_error, f.body
    return f.body


@pytest.mark.parametrize("kind", ["tcp", "unix", "seqpacket",
                                  pytest.param("tls", marks=pytest.mark.skipif(
                                      not TLS, reason="needs the openssl CLI"))])
def test_a_closed_connection_leaves_no_cycle(daemon: _Daemon, kind: str) -> None:
    """HELLO then close: before, 30 objects in cycles per tcp connection, 35 per unix and
    seqpacket one, 49 per tls one."""
    connect(daemon, kind).close()  # warm (what is made once is not counted)
    daemon.until_sessions(0)
    with no_cycles(f"a closed {kind} connection"):
        for _ in range(5):
            connect(daemon, kind).close()
        daemon.until_sessions(0)


def test_a_connection_that_used_everything_leaves_no_cycle(daemon: _Daemon) -> None:
    """A buffer set and read, a WATCH, a lease, an expectation left waiting, a UVM
    watcher that fired: all of it ends with the connection, nothing in a cycle."""

    def one(i: int) -> None:
        c = connect(daemon)
        buf = ok(c, Command.ALLOC_BUFFER, {"device": "cpu", "size": 4096})["buffer"]
        ok(c, Command.SET_TENSOR, {"tensor": [buf, 0, 4096]}, b"\x01" * 4096)
        ok(c, Command.GET_TENSOR, {"tensor": [buf, 0, 4096]})
        ok(c, Command.WATCH, {"prefix": "cycles/"})
        ok(c, Command.LEASE, {"lease": f"cycles-{i}", "ttl_ms": 60_000})
        c.send(Command.EXPECT_IMM_COUNT, {"imm": 5, "count": 1, "timeout_ms": 60_000},
               flags=int(Flag.NO_REPLY))
        seq = c.send(Command.ALLOC_UVM_WATCHER, {})
        w = c.recv()
        assert w.seq == seq and not w.is_error, w.body
        fd = os.open(w.body["path"], os.O_RDWR)
        with contextlib.closing(mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED)) as m:
            os.close(fd)
            m[w.body["offset"]: w.body["offset"] + 8] = (5).to_bytes(8, "little")
            while not ((f := c.recv()).seq == seq and f.flags & int(Flag.EVENT)):
                pass
        ok(c, Command.SYNCHRONIZE, {})
        c.close()

    one(0)
    daemon.until_sessions(0)
    with no_cycles("a closed connection that used everything"):
        for i in range(1, 6):
            one(i)
        daemon.until_sessions(0)
    c = connect(daemon)
    for i in range(6):
        ok(c, Command.END_LEASE, {"lease": f"cycles-{i}", "join": True})
    c.close()


def test_watches_leave_no_cycle(daemon: _Daemon) -> None:
    """WATCH, its changes, CANCEL: before, 8 objects in cycles per WATCH (9 with changes
    sent)."""
    c = connect(daemon)
    try:
        def one() -> None:
            seq = c.send(Command.WATCH, {"prefix": "cyw/"})
            assert not c.recv().is_error
            ok(c, Command.PUBLISH, {"name": "cyw/a", "kind": "bytes", "value": b"v"})
            ok(c, Command.UNPUBLISH, {"name": "cyw/a"})
            ok(c, Command.CANCEL, {"seq": seq})
            ok(c, Command.SYNCHRONIZE, {})

        one()
        with no_cycles("a WATCH"):
            for _ in range(5):
                one()
    finally:
        c.close()


def test_refused_requests_leave_no_cycle(daemon: _Daemon) -> None:
    """A request refused before its handler (an unknown command, a SET whose payload has
    nowhere to go) or by it: before, a refusal kept on its frame held a traceback whose
    frames held the frame (34 objects for these)."""
    c = connect(daemon)
    try:
        def one() -> None:
            assert answer(c, 0x7E, {}).is_error
            assert answer(c, Command.SET_TENSOR, {"tensor": [99_999, 0, 64]},
                          b"\0" * 64).is_error
            assert answer(c, Command.FREE_BUFFER, {"buffer": 99_999}).is_error
            assert answer(c, Command.ALLOC_BUFFER, {"device": "cpu", "size": "x"}).is_error

        one()
        with no_cycles("a refused request"):
            for _ in range(5):
                one()
    finally:
        c.close()


def test_an_ended_subscription_leaves_no_cycle() -> None:
    """In memory: a subscriber that holds its subscription and whose method is its
    deliver (a WATCH's stream) is freed by reference counting once it is unsubscribed,
    or its owner is gone."""
    d = Directory("n")

    class Stream:
        def __init__(self, owner: object) -> None:
            self.got: list[Change] = []
            self.sub = d.subscribe("p/", owner, self.push)

        def push(self, change: Change, new: bool) -> None:
            self.got.append(change)

    with no_cycles("an ended subscription"):
        for _ in range(10):
            d.unsubscribe(Stream("a").sub)
        owner = object()
        for _ in range(10):
            Stream(owner)
        d.owner_gone(owner)
        assert d.watches == 0


def test_untraced_drops_every_traceback_of_the_chain() -> None:
    from transferd.protocol.errors import untraced

    def raised() -> NotFound:
        try:
            try:
                {}["x"]
            except KeyError as exc:
                raise NotFound("no x") from exc
        except NotFound as exc:
            return exc
        raise AssertionError

    e = raised()
    assert e.__traceback__ is not None and e.__cause__ is not None
    assert e.__cause__.__traceback__ is not None
    assert untraced(e) is e
    assert e.__traceback__ is None and e.__cause__.__traceback__ is None
    assert e.message == "no x" and isinstance(e.__cause__, KeyError)


@async_test(timeout=30)
async def test_a_lost_message_transport_leaves_no_cycle() -> None:
    """rdma://'s MessageTransport (over a seqpacket pair, as the verbs tests run it): the
    protocol, the carrier's callbacks and the reader's deliver named it back."""
    from tests.unit.test_verbs_msgtransport import Recorder, pair

    loop = asyncio.get_running_loop()

    async def one() -> None:
        rx = Recorder()
        t, carrier, other = pair(loop, rx)
        other.close()
        await asyncio.wait_for(rx.lost, 5)
        for _ in range(3):
            await asyncio.sleep(0)
        assert t.is_closing()
        del t, carrier, other, rx

    await one()
    with no_cycles("a lost MessageTransport"):
        for _ in range(5):
            await one()


# -- the client library (client/, in the caller's process) ------------------------------


async def use_client(c: Any) -> None:
    """What an application does with a connection: ALLOC, SET, GET, a batch flushed, a
    WATCH, a request refused (NotFound raised and caught), FREE_BUFFER."""
    buf = await c.alloc_buffer(4096)
    await c.set_tensor(buf.tensor(), b"\x01" * 4096)
    assert bytes(await c.get_tensor(buf.tensor(0, 16))) == b"\x01" * 16
    c.set_tensor_async(buf.tensor(0, 64), b"\x02" * 64)
    got = c.get_tensor_async(buf.tensor(0, 64))
    await c.flush()
    assert bytes(await got) == b"\x02" * 64
    async with c.watch("cyc/"):
        pass
    with pytest.raises(NotFound):
        await c.free_buffer(99_999)
    await c.free_buffer(buf)


@pytest.mark.parametrize(("kind", "loop"), [
    ("tcp", "asyncio"), ("tcp", "uvloop"), ("unix", "asyncio"), ("unix", "uvloop"),
    # (asyncio's TLS on Python 3.11: its socket transport's own cycle, out of reach)
    pytest.param("tls", "uvloop", marks=pytest.mark.skipif(not TLS,
                                                           reason="needs the openssl CLI"))])
def test_a_closed_client_leaves_no_cycle(daemon: _Daemon, kind: str, loop: str) -> None:
    """Client.connect, requests, close: before, 72 to 77 objects in cycles per client (its
    parts held the Client and it them; its Connection held the Client's methods and its
    ClientConnection's decoder the machine's sink; asyncio's tcp transport, on Python
    3.11, its own read method; a TLS transport the Connection's buffer_updated)."""
    from client import Client

    tls = {"tls_ca": daemon.config.server.tls_cert} if kind == "tls" else {}

    async def one() -> None:
        c = await Client.connect(daemon.urls[kind], **tls)
        try:
            await use_client(c)
        finally:
            await c.close()

    async def main() -> None:
        await one()  # warm
        daemon.until_sessions(0)
        with no_cycles(f"a closed {kind} Client on {loop}"):
            for _ in range(3):
                await one()
            daemon.until_sessions(0)

    run(main(), timeout=60, loop=loop)


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_a_closed_sync_client_leaves_no_cycle(daemon: _Daemon, kind: str) -> None:
    """SyncClient: its loop thread, its calls, a call that failed (NotFound), close:
    before, 163 objects per client (the failed call's traceback held the frame that held
    its future, which held the error; and with it the Client's own)."""
    from client import SyncClient

    def one() -> None:
        c = SyncClient.connect(daemon.urls[kind])
        try:
            buf = c.alloc_buffer(4096)
            c.set_tensor(buf.tensor(), b"\x01" * 4096)
            got = c.get_tensor_async(buf.tensor(0, 64))
            c.flush()
            assert bytes(got.result(10)) == b"\x01" * 64
            with c.watch("cyc/"):
                pass
            with pytest.raises(NotFound):
                c.free_buffer(99_999)
            c.free_buffer(buf)
        finally:
            c.close()

    one()
    daemon.until_sessions(0)
    with no_cycles(f"a closed {kind} SyncClient"):
        for _ in range(3):
            one()
        daemon.until_sessions(0)


@async_test(timeout=60, loop="asyncio")
async def test_a_closed_inproc_client_leaves_none_of_the_clients_objects_in_a_cycle(
) -> None:
    """Client.connect("inproc://"), close: before, the InprocClient and its parts (43
    objects) were left in a cycle. (The node's own objects still are: the engine, its
    domain group and port, the metrics registry's collectors, as a daemon's, which makes
    them once; docs/security.md.)"""
    from client import Client

    overrides = {"engine.peer_port": 0, "engine.host_rails": "127.0.0.1",
                 "metrics.enabled": False, "memory.host_limit_mib": 64}

    async def one() -> None:
        c = await Client.connect("inproc://", overrides=overrides)
        await c.close()

    await one()
    with no_cycles("a closed inproc client", only="client."):
        for _ in range(3):
            await one()


@async_test(timeout=30, loop="asyncio")
async def test_a_closed_clients_parts_still_answer_as_closed() -> None:
    """After close its parts hold the client weakly: a call through one fails as a call
    on a closed client does (ConnectionLost), while the client is referred to and once it
    is gone."""
    import weakref

    from client import Client
    from transferd.protocol.errors import ConnectionLost

    c = Client("tcp://127.0.0.1:1")
    c._detach_parts()  # (what close() does last)
    with pytest.raises(TransferdError, match="not connected"):
        await c.engine.main_address()  # the client's own answer, through the part
    leases, engine = c.leases, c.engine
    gone = weakref.ref(c)
    del c
    assert gone() is None  # nothing but the caller held it
    with pytest.raises(ConnectionLost):
        await engine.main_address()
    with pytest.raises(ConnectionLost):
        await leases.alloc(64)
