"""A server that lies about a batch reply's size (wave 5 attack): the client's reads of
small rows are received whole and cut (client/queue.py Reads), and what it cuts must be
exactly what it asked for, or the connection is broken, as for rows received in place."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from client import Client
from tests.helpers import lying_server, run
from transferd.protocol.constants import Command, ErrorCode, Flag
from transferd.protocol.errors import TransferdError
from transferd.protocol.frames import Frame, encode_header


@pytest.mark.parametrize("rows, size, wrong", [
    (8, 64, -1), (8, 64, 1), (8, 64, -64),  # a small reply (GATHER_SMALL)
    (64, 4096, -1), (64, 4096, 4096),  # 256 KiB of 4 KiB rows (GATHER_ROW, GATHER_MAX)
    (8, 64, -512), (64, 4096, -(64 << 12)),  # no payload at all
    (4, 65536, -1),  # rows received in place: the decoder's own check (passed on main)
])
def test_a_batch_reply_of_another_size_than_asked_is_bad_frame(rows: int, size: int,
                                                              wrong: int) -> None:
    def lie(f: Frame, writer: asyncio.StreamWriter) -> None:
        if f.cmd == int(Command.GET_TENSORS):
            n = sum(t[2] for t in f.body["tensors"]) + wrong
            writer.write(encode_header(f.cmd, int(Flag.REPLY), f.seq, 0, n) + bytes(n))

    async def main() -> None:
        async with lying_server(lie) as url:
            await _reads(url)

    async def _reads(url: str) -> None:
        c = await Client.connect(url)
        try:
            futs = [c.get_tensor_async((1, i * size, size)) for i in range(rows)]
            try:
                await c.flush()
            except TransferdError as exc:
                assert exc.code is ErrorCode.BAD_FRAME, exc
            else:  # a well-formed frame, only its payload missing: each read says so
                assert rows * size + wrong == 0
            for f in futs:  # no read is resolved with bytes it did not ask for
                assert f.done() and (f.cancelled() or f.exception() is not None), f
                if not f.cancelled():
                    assert f.exception().code is ErrorCode.BAD_FRAME  # type: ignore[union-attr]
        finally:
            with contextlib.suppress(Exception):
                await c.close()

    run(main(), timeout=20)


@pytest.mark.parametrize("wrong", [1, -1, -16, 1 << 20])
def test_a_get_tensor_reply_of_another_size_than_asked_is_bad_frame(wrong: int) -> None:
    # GET_TENSOR without out= collects its reply: the size collected is the tensor's
    # (the client's own), never one only the server vouches for (up to the client's
    # max_payload, 16 GiB, it was allocated as announced).
    def lie(f: Frame, writer: asyncio.StreamWriter) -> None:
        if f.cmd == int(Command.GET_TENSOR):
            n = f.body["tensor"][2] + wrong
            writer.write(encode_header(f.cmd, int(Flag.REPLY), f.seq, 0, n)
                         + bytes(min(n, 1 << 16)))

    async def main() -> None:
        async with lying_server(lie) as url:
            c = await Client.connect(url)
            try:
                with pytest.raises(TransferdError) as info:
                    await c.get_tensor((1, 0, 16))
                assert info.value.code is ErrorCode.BAD_FRAME, info.value
            finally:
                with contextlib.suppress(Exception):
                    await c.close()

    run(main(), timeout=20)
