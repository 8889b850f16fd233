"""A lying server against the real client library (raw asyncio server on loopback): what
it says in HELLO and the frames it sends unasked must end in a typed error or be
dropped, and nothing the client keeps grows with how much the server sends."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from client import Client
from tests.helpers import lying_server, run
from transferd.protocol.constants import Command, ErrorCode, Flag
from transferd.protocol.errors import TransferdError
from transferd.protocol.frames import Frame, FrameDecoder, encode_frame

_EVENT_ERROR = int(Flag.EVENT | Flag.ERROR)
_REPLY_ERROR = int(Flag.REPLY | Flag.ERROR)


def _server(hello: dict[str, Any], flood: bytes = b"") -> Any:
    """Answers HELLO with ``hello`` (then writes ``flood``), every other request with an
    empty reply."""
    def empty(f: Frame, writer: asyncio.StreamWriter) -> None:
        if not f.no_reply:
            writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq, {}))

    return lying_server(empty, hello=lambda w: w.write(flood), hello_body=hello)


_HELLO = {"major": 1, "minor": 2, "patch": 0, "server": "liar", "features": [],
          "max_body": 1 << 22, "max_payload": 1 << 30}


@pytest.mark.parametrize("kind", ["event", "reply"])
def test_unasked_error_frames_from_a_server_are_kept_bounded(kind: str) -> None:
    # 20,000 error EVENTs (or error replies) for seqs this client never sent: each is a
    # one-way failure the client reports at its next flush point, but what it keeps of
    # them must not grow with what a server sends.
    n = 20_000
    flags = _EVENT_ERROR if kind == "event" else _REPLY_ERROR
    flood = b"".join(encode_frame(int(Command.SINGLE_WRITE), flags, 1000 + i, {
        "code": ErrorCode.NOT_FOUND.value, "message": "no such write"}) for i in range(n))

    async def main() -> None:
        async with _server(_HELLO, flood) as url:
            c = await Client.connect(url, timeout=10)
            try:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while c.conn.stats.bytes_in < len(flood) and loop.time() < deadline:
                    await asyncio.sleep(0.02)
                assert c.conn.stats.bytes_in >= len(flood)
                assert len(c.conn.failed) <= 1024, len(c.conn.failed)
                with pytest.raises(TransferdError) as info:
                    c._raise_failures()
                assert info.value.code is ErrorCode.NOT_FOUND
                # The count of what was dropped is still told.
                assert any(f"{n - 1} more" in note
                           for note in getattr(info.value, "__notes__", [])), info.value
                assert not c.conn.failed
            finally:
                with contextlib.suppress(Exception):
                    await c.close()

    run(main(), timeout=30)


@pytest.mark.parametrize("features", [5, "abc", [1, 2], {"a": 1}, None])
def test_a_hello_reply_with_features_not_a_list_of_names_is_bad_frame(features: Any) -> None:
    hello = dict(_HELLO, features=features)

    async def main() -> None:
        async with _server(hello) as url:
            with pytest.raises(TransferdError) as info:
                c = await Client.connect(url, timeout=5)
                await c.close()
            assert info.value.code is ErrorCode.BAD_FRAME, info.value

    run(main(), timeout=20)



def _names_server(rows: Any, more: bool = True) -> Any:
    """Answers HELLO as a names-serving minor-2 server, every NAMES with ``rows``."""
    def lie(f: Frame, writer: asyncio.StreamWriter) -> None:
        if f.cmd == int(Command.NAMES):
            writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq,
                                      {"names": rows, "more": more}))
        elif not f.no_reply:
            writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq, {}))

    return lying_server(lie, hello_body=dict(_HELLO, features=["engine", "names"]))


@pytest.mark.parametrize("rows", [
    [{"name": "a"}],  # the same page again and again, "more" each time
    [{"name": "b"}, {"name": "a"}],  # a page not in order (its last is not past 'after')
    [5], [{"kind": "x"}], "abc", [{"name": "a", "size": "big"}],  # not rows at all
])
def test_a_names_listing_that_does_not_move_on_is_bad_frame_not_a_loop(rows: Any) -> None:
    # Client.names pages with 'after' = the last name seen until 'more' is false: a server
    # that sent the same page with more=true kept it asking (and its list growing) forever.
    async def main() -> None:
        async with _names_server(rows) as url:
            c = await Client.connect(url, timeout=5)
            try:
                with pytest.raises(TransferdError) as info:
                    await asyncio.wait_for(c.names(), 10)
                assert info.value.code is ErrorCode.BAD_FRAME, info.value
                assert c.conn.stats.commands.get("NAMES", 0) <= 2, c.conn.stats.commands
            finally:
                with contextlib.suppress(Exception):
                    await c.close()

    run(main(), timeout=30)


def _answering(reply: dict[str, Any]) -> Any:
    """Answers HELLO (engine and names served), every other request with ``reply``."""
    def lie(f: Frame, writer: asyncio.StreamWriter) -> None:
        if not f.no_reply:
            writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq, reply))

    return lying_server(lie, hello_body=dict(_HELLO, features=["engine", "names"]))


@pytest.mark.parametrize("reply", [
    {},  # nothing of what the reply must hold
    {"buffer": "x", "size": None, "mr": [1], "desc": 5, "devices": 7, "addr": 1,
     "group": "g", "value": 1.5, "watcher": None},  # all of it, of the wrong types
])
def test_a_reply_missing_or_mistyping_its_fields_is_a_typed_error(reply: dict[str, Any]) -> None:
    # A reply is read field by field (r.body["buffer"], int(...)): a server that left one
    # out or sent another type made the call raise a bare KeyError / TypeError / ValueError.
    async def main() -> None:
        async with _answering(reply) as url:
            c = await Client.connect(url, timeout=5)
            try:
                calls = {
                    "get_devices": lambda: c.get_devices(),
                    "alloc_buffer": lambda: c.alloc_buffer(4096),
                    "main_address": lambda: c.main_address(),
                    "imm_count": lambda: c.imm_count(1),
                    "alloc_uvm_watcher": lambda: c.alloc_uvm_watcher(lambda o, n: None),
                }
                for name, call in calls.items():
                    with pytest.raises(TransferdError) as info:
                        await asyncio.wait_for(call(), 10)
                    assert info.value.code in (ErrorCode.BAD_FRAME, ErrorCode.BAD_REQUEST), \
                        (name, info.value)
            finally:
                with contextlib.suppress(Exception):
                    await c.close()

    run(main(), timeout=60)


@pytest.mark.parametrize("value", [1 << 40, 1 << 20, "abc", 1.5, {"a": 1}, [1, 2]])
def test_a_name_value_that_is_not_bytes_is_a_typed_error_never_an_allocation(
        value: Any) -> None:
    # decode_value did bytes(data): a LOOKUP reply (or a WATCH change) whose value was
    # the integer 2**40 asked for a TiB of zeros (1 << 20: a MiB, made of nothing), and a
    # str or a float raised a bare TypeError (in a WATCH EVENT, out of the protocol's
    # buffer_updated: the connection closed).
    change = {"op": "put", "name": "a", "node": "n", "kind": "bytes", "value": value}

    async def main() -> None:
        reply = {"kind": "bytes", "value": value, "watch": 0, "names": 0, "node": "n"}
        async with _answering(reply) as url:
            c = await Client.connect(url, timeout=5)
            try:
                with pytest.raises(TransferdError) as info:
                    await asyncio.wait_for(c.lookup("a"), 10)
                assert info.value.code is ErrorCode.BAD_REQUEST, info.value
                # The same value in a WATCH EVENT: dropped (logged), the connection goes on.
                from transferd.protocol.frames import Frame
                frame = Frame(int(Command.WATCH), int(Flag.EVENT), 99, change)
                watch = c.names_part.watch("a")
                c.names_part.watches[99] = watch
                assert c.names_part.on_event(frame) is True
                assert c.conn.lost is None
            finally:
                with contextlib.suppress(Exception):
                    await c.close()

    run(main(), timeout=30)


@pytest.mark.parametrize("peers", [
    [5], "ab", [{"node": "x"}], [{"node": [1]}], [{"version": 3}], [{"version": ["a"]}],
    [{"capabilities": [1]}], [{"rails": 7}],
])
def test_a_peers_reply_that_is_not_peer_records_is_bad_frame(peers: Any) -> None:
    async def main() -> None:
        async with _answering({"peers": peers, "discovery": 5}) as url:
            c = await Client.connect(url, timeout=5)
            try:
                with pytest.raises(TransferdError) as info:
                    await asyncio.wait_for(c.names_part.peers(), 10)
                assert info.value.code is ErrorCode.BAD_FRAME, info.value
                with pytest.raises(TransferdError) as info:
                    await asyncio.wait_for(c.names_part.discovery_status(), 10)
                assert info.value.code is ErrorCode.BAD_FRAME, info.value
            finally:
                with contextlib.suppress(Exception):
                    await c.close()

    run(main(), timeout=30)


@pytest.mark.parametrize("max_message", [1, 1 << 40])
def test_a_hello_reply_refused_after_ready_closes_the_connection(max_message: int) -> None:
    # A max_message outside 64 KiB-64 MiB is BAD_FRAME, but it was judged after the
    # handshake's close-on-failure: Client.connect raised and the socket stayed open, with
    # nobody holding it to close it.
    async def main() -> None:
        closed = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            dec = FrameDecoder()
            while data := await reader.read(65536):
                for f in dec.feed(data):
                    if f.cmd == int(Command.HELLO):
                        writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq,
                                                  dict(_HELLO, max_message=max_message)))
                await writer.drain()
            closed.set()
            writer.close()

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"tcp://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        try:
            with pytest.raises(TransferdError) as info:
                await Client.connect(url, timeout=5)
            assert info.value.code is ErrorCode.BAD_FRAME, info.value
            await asyncio.wait_for(closed.wait(), 5)
        finally:
            srv.close()

    run(main(), timeout=30)


def test_a_watch_fed_more_changes_than_it_may_hold_ends_over_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # What waits in a Watch is one change per name: bounded by the names under the prefix
    # on an honest daemon, but a server streaming ever new names grew it without end while
    # the caller did not read.  Past Watch.max_pending it ends (OVER_LIMIT: watch again)
    # and a CANCEL goes to the server, as the daemon ends a watch its connection lags on.
    from client.names import Watch
    monkeypatch.setattr(Watch, "max_pending", 1000, raising=False)
    cancels: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = FrameDecoder()
        while data := await reader.read(65536):
            for f in dec.feed(data):
                if f.cmd == int(Command.HELLO):
                    body: dict[str, Any] = dict(_HELLO, features=["engine", "names"])
                elif f.cmd == int(Command.WATCH):
                    writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq,
                                              {"watch": f.seq, "names": 0, "node": "n"}))
                    writer.write(b"".join(encode_frame(f.cmd, int(Flag.EVENT), f.seq, {
                        "op": "put", "name": f"n{i}", "node": "n", "kind": "bytes",
                        "value": b"v"}) for i in range(5000)))
                    await writer.drain()
                    continue
                else:
                    if f.cmd == int(Command.CANCEL):
                        cancels.append(f.body["seq"])
                    body = {}
                writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq, body))
                await writer.drain()
        writer.close()

    async def main() -> None:
        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"tcp://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        try:
            c = await Client.connect(url, timeout=5)
            try:
                w = await c.names_part.watch("").start()
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while w._error is None and loop.time() < deadline:
                    await asyncio.sleep(0.02)
                assert len(w._pending) <= 1000, len(w._pending)
                with pytest.raises(TransferdError) as info:
                    await asyncio.wait_for(w.__anext__(), 5)
                assert info.value.code is ErrorCode.TOO_LARGE, info.value
                deadline = loop.time() + 5
                while not cancels and loop.time() < deadline:
                    await asyncio.sleep(0.02)
                assert cancels == [w.seq], cancels
            finally:
                with contextlib.suppress(Exception):
                    await c.close()
        finally:
            srv.close()

    run(main(), timeout=30)


@pytest.mark.parametrize("lie", ["silent", "dribble", "impostor"])
def test_a_handshake_that_fails_ends_within_connect_timeout(lie: str) -> None:
    """A server that accepts and then says nothing (or dribbles its HELLO reply a byte at
    a time, or proves nothing when a secret is held) and keeps its socket open: the
    handshake fails (Timeout; Unauthorized), and the failed connection was closed with
    close()'s 5 s linger for the server to finish what it was sent, so
    Client.connect(connect_timeout=1) took 6 s.  Nothing a failed handshake sent needs
    an answer: it is closed at once, and the handshake's future, failed later by the
    close, is not left for asyncio to report as never retrieved."""
    reported: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx))
        hello = encode_frame(int(Command.HELLO), int(Flag.REPLY), 1,
                             dict(_HELLO, server="x" * 20_000))

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                await reader.read(65536)
                if lie == "impostor":
                    writer.write(hello)  # no auth, no proof
                elif lie == "dribble":
                    for i in range(len(hello)):
                        writer.write(hello[i:i + 1])
                        await asyncio.sleep(0.05)
                await asyncio.sleep(30)

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"tcp://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        try:
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(TransferdError) as info:
                await Client.connect(url, connect_timeout=1, token="a-secret" * 4 if
                                     lie == "impostor" else None)
            took = asyncio.get_running_loop().time() - t0
            assert info.value.code in (ErrorCode.TIMEOUT, ErrorCode.UNAUTHORIZED), info.value
            assert took < 2.5, f"connect took {took:.1f} s with connect_timeout=1"
        finally:
            srv.close()
        await asyncio.sleep(0.1)
        import gc

        gc.collect()
        await asyncio.sleep(0)

    run(main(), timeout=30, loop="asyncio")
    assert not [c for c in reported if "never retrieved" in str(c.get("message"))], reported


def test_a_tls_server_that_never_answers_the_tls_handshake_says_timed_out() -> None:
    """A listener that takes the TCP connection and never speaks TLS: connect fails at
    connect_timeout with PEER_UNREACHABLE, and the reason said why (it ended in ': ',
    a TimeoutError having no text)."""
    async def main() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                await asyncio.sleep(30)

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"tls://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        try:
            with pytest.raises(TransferdError) as info:
                await Client.connect(url, connect_timeout=0.5)
            assert info.value.code is ErrorCode.PEER_UNREACHABLE, info.value
            assert info.value.message == f"cannot connect to {url}: timed out", info.value
        finally:
            srv.close()

    run(main(), timeout=30, loop="asyncio")
