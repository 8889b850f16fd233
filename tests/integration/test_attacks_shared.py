"""A shared buffer whose client dies while a peer's write is landing in it, on a live daemon.

The client's connection owns the buffer, so its death frees it like FREE_BUFFER:
the write already admitted finishes (its initiator is told it landed), no later
write lands (NOT_FOUND), and the memfd, the mapping and the charge are gone
once the write let go.  Another client is served throughout.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from client import Client
from tests.conftest import DaemonFactory
from tests.helpers import async_test, pattern, wait_until
from tests.integration.test_accounting_engine import HandPeer
from tests.integration.test_shared_buffers import _devices, _local_daemon, _memfds, _url
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
            # Our mapping outlives the daemon's: the admitted write landed whole.
            assert hashlib.sha256(view).digest() == hashlib.sha256(data).digest()
            peer.write_header(2, desc, 0, 4096)
            await asyncio.to_thread(peer.sock.sendall, b"\xff" * 4096)
            nack = await asyncio.to_thread(peer.recv)
            assert nack.body.get("code") == "NOT_FOUND", nack.body
            assert bytes(view[:4096]) == data[:4096]
        finally:
            peer.sock.close()
        assert wait_until(lambda: shm_free() == total, 10)
        assert wait_until(lambda: _memfds(d) == 0, 10)
        buf2 = await other.alloc_buffer(4096)
        await other.free_buffer(buf2)
    assert d.alive()
