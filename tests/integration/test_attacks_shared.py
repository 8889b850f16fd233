"""A shared buffer whose client dies while a peer's write is landing in it, on a live daemon.

The client's connection owns the buffer, so its death frees it like FREE_BUFFER:
the write already admitted finishes (its initiator is told it landed), no later
write lands (NOT_FOUND), and the memfd's pages, the mapping and the charge are
gone once the write let go, even from a mapping the client kept (issue 16.10).
Another client is served throughout.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from pathlib import Path

from client import Client
from tests.conftest import DaemonFactory
from tests.helpers import async_test, pattern, wait_until
from tests.integration.test_accounting_engine import HandPeer
from tests.integration.test_shared_buffers import _devices, _local_daemon, _memfds, _url
from transferd.protocol.constants import PROTO_MAJOR, Command
from transferd.protocol.frames import Frame, FrameDecoder, encode_frame
from transferd.protocol.peer import PeerCommand

MiB = 1 << 20


@async_test(timeout=60)
async def test_a_client_dies_while_a_peer_writes_into_its_shared_buffer(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    d = _local_daemon(daemon_factory, tmp_path)
    size, half = 16 * MiB, 8 * MiB
    data = pattern(size, 23)

    def shm_free() -> int:
        return int(next(x for x in _devices(d) if x["name"] == "shm")["free"])

    total = shm_free()
    async with await Client.connect(d.url) as other:
        c = await Client.connect(_url(tmp_path, "unix"))
        buf = await c.alloc_shared(size)
        _, desc = await c.reg_mr(buf)
        peer = await asyncio.to_thread(HandPeer, desc.rkeys[0][0])
        try:
            peer.write_header(1, desc, 0, size)
            await asyncio.to_thread(peer.sock.sendall, data[:half])
            view = buf.view
            assert wait_until(lambda: bytes(view[:64]) == data[:64], 10), "never landed"
            await c.close()  # the owner is gone, its write half-landed
            await asyncio.sleep(0.2)
            assert shm_free() < total  # held by the write still landing
            assert await other.get_devices()  # others are served meanwhile
            await asyncio.to_thread(peer.sock.sendall, data[half:])
            ack = await asyncio.to_thread(peer.recv)
            assert ack.cmd == PeerCommand.ACK and ack.body.get("ok") is True, ack.body
            # Once the write let go the daemon releases the pages: the mapping this
            # client kept reads zeros (the pages are not alive on its account).
            zeros = hashlib.sha256(bytes(size)).digest()
            assert wait_until(lambda: hashlib.sha256(view).digest() == zeros, 10)
            peer.write_header(2, desc, 0, 4096)
            await asyncio.to_thread(peer.sock.sendall, b"\xff" * 4096)
            nack = await asyncio.to_thread(peer.recv)
            assert nack.body.get("code") == "NOT_FOUND", nack.body
            assert bytes(view[:4096]) == bytes(4096)  # nothing of the refused write
        finally:
            peer.sock.close()
        assert wait_until(lambda: shm_free() == total, 10)
        assert wait_until(lambda: _memfds(d) == 0, 10)
        buf2 = await other.alloc_buffer(4096)
        await other.free_buffer(buf2)
    assert d.alive()


class FdKeeper:
    """A hostile local client: allocates shared buffers over a raw Unix socket and keeps
    each memfd descriptor the daemon sends (the client library would map and close it)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))
        self.decoder = FrameDecoder()
        self.frames: list[Frame] = []
        self.fds: list[int] = []
        self.seq = 0
        self.request(Command.HELLO, {"major": PROTO_MAJOR, "minor": 2, "client": "keeper"})

    def request(self, cmd: int, body: dict[str, object]) -> Frame:
        self.seq += 1
        self.sock.sendall(encode_frame(cmd, 0, self.seq, body))
        while not self.frames:
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
            assert data, "the daemon closed the connection"
            self.fds += fds
            self.frames += self.decoder.feed(data)
        f = self.frames.pop(0)
        assert not f.is_error, f.body
        return f

    def close(self) -> None:
        self.sock.close()


def _blocks(fds: list[int]) -> int:
    """Bytes of pages the memfds behind ``fds`` hold now."""
    return sum(os.fstat(fd).st_blocks * 512 for fd in fds)


def test_a_client_that_keeps_the_descriptor_keeps_no_pages(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """Issue 16.10: with shm_limit_mib = 64, eight 30 MiB shared buffers the daemon filled,
    each freed with its connection (and one by FREE_BUFFER) while the client kept the
    descriptor: 240 MiB of pages stayed alive, outside the limit and on the daemon's
    cgroup.  Now the daemon punches each memfd out when it frees the buffer."""
    d = _local_daemon(daemon_factory, tmp_path, env={"TRANSFERD_MEMORY_SHM_LIMIT_MIB": "64"})
    size = 30 * MiB
    kept: list[int] = []
    try:
        for i in range(8):
            k = FdKeeper(tmp_path / "d.sock")
            buf = k.request(Command.ALLOC_BUFFER, {"device": "shm", "size": size}).body
            k.request(Command.BUFFER_CLEAR, {"buffer": buf["buffer"], "value": 0x5A})
            (fd,) = k.fds
            assert _blocks([fd]) >= size  # the daemon touched every page
            if i == 0:
                k.request(Command.FREE_BUFFER, {"buffer": buf["buffer"]})
            k.close()
            kept.append(fd)
            assert wait_until(lambda: _shm_free(d) == 64 * MiB, 10)
        assert wait_until(lambda: _blocks(kept) == 0, 10), f"{_blocks(kept) / MiB} MiB alive"
        assert os.pread(kept[0], 4096, 0) == bytes(4096)
        # What the client writes through its descriptor now is its own page, on its
        # own cgroup: the daemon's limit does not move, and the seals still hold.
        os.pwrite(kept[1], b"\x01" * 4096, 0)
        assert _blocks([kept[1]]) == 4096 and _shm_free(d) == 64 * MiB
        try:
            os.ftruncate(kept[1], 1 << 30)
            raise AssertionError("a sealed memfd grew")
        except PermissionError:
            pass
    finally:
        for fd in kept:
            os.close(fd)
    assert d.alive()


def _shm_free(d: object) -> int:
    return int(next(x for x in _devices(d) if x["name"] == "shm")["free"])  # type: ignore[arg-type]
