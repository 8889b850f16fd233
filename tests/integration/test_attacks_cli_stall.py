"""The command line against a server that answers HELLO and then stops answering,
keeping its socket open (a daemon SIGSTOPped mid-reply, or anything that speaks the
wire format): every command ends within its ``--timeout``, says what was not answered,
and does not blame the handshake."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.helpers import served_on_thread
from tests.integration.test_operator_cli import cli
from transferd.exits import Exit


@contextmanager
def stalling_daemon(half: bool) -> Iterator[str]:
    """HELLO answered (engine and names served); every other request gets the first
    30 bytes of a reply (``half``) or nothing; the socket stays open until the test
    ends (on a thread of its own)."""
    from transferd.protocol.constants import Command, Flag
    from transferd.protocol.frames import FrameDecoder, encode_frame

    hello = {"major": 1, "minor": 2, "patch": 0, "server": "staller",
             "features": ["engine", "names"], "max_body": 1 << 22, "max_payload": 1 << 30}
    held: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        dec = FrameDecoder()
        while data := await reader.read(65536):
            try:
                frames = dec.feed(data)
            except Exception:  # (the CLI's HTTP probe of a port that is not transferd)
                return
            for f in frames:
                if f.cmd == int(Command.HELLO):
                    writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq, hello))
                elif half:
                    writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq,
                                              {"pad": "x" * 200})[:30])
        # EOF from the client: the socket is kept open all the same.

    with served_on_thread(serve) as url:
        yield url


@pytest.mark.parametrize("command", [["stats", "--once"], ["ping"], ["inflight"],
                                     ["buffers"], ["peers"], ["names"]])
def test_a_server_that_stalls_after_hello_ends_every_command_within_its_timeout(
        command: list[str]) -> None:
    # Before: inflight and buffers asked with no timer and waited as long as the server
    # kept its socket (for ever); stats, ping, peers and names ended at --timeout, then
    # close() waited its 5 s linger for a server that never closes (6 s for 1); and the
    # timeout was told as "no HELLO reply within 1 s" though HELLO had been answered.
    with stalling_daemon(half=command[0] in ("inflight", "stats", "peers")) as url:
        t0 = time.monotonic()
        r = cli(*command, url, "--timeout", "0.5", timeout=20)
        took = time.monotonic() - t0
    assert r.returncode == Exit.FAILURE, r.stdout + r.stderr
    assert took < 3.0, f"{command[0]} took {took:.1f} s with --timeout 0.5"
    assert "stopped answering" in r.stderr and "no HELLO reply" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
