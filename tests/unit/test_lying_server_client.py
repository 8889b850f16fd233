"""A lying server against the real client library (raw asyncio server on loopback): what
it says in HELLO and the frames it sends unasked must end in a typed error or be
dropped, and nothing the client keeps grows with how much the server sends."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from client import Client
from tests.helpers import run
from transferd.protocol.constants import Command, ErrorCode, Flag
from transferd.protocol.errors import TransferdError
from transferd.protocol.frames import FrameDecoder, encode_frame

_EVENT_ERROR = int(Flag.EVENT | Flag.ERROR)
_REPLY_ERROR = int(Flag.REPLY | Flag.ERROR)


@contextlib.asynccontextmanager
async def _server(hello: dict[str, Any], flood: bytes = b"") -> Any:
    """Answers HELLO with ``hello`` (then writes ``flood``), every other request with an
    empty reply."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = FrameDecoder()
        while data := await reader.read(65536):
            for f in dec.feed(data):
                if f.cmd == int(Command.HELLO):
                    writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq, hello))
                    writer.write(flood)
                elif not f.no_reply:
                    writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq, {}))
                await writer.drain()
        writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"tcp://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    finally:
        srv.close()


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

