"""Shared-memory buffers (device "shm"): what every connection gets, and the refusals."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from client import Client, SharedBuffer
from tests.conftest import DaemonFactory
from tests.helpers import REPO, DaemonProcess, RawConn, async_test, digest, pattern, wait_until
from transferd.memory import charge_of
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import BadRequest, NotFound, OutOfBounds, OutOfMemory
from transferd.protocol.messages import Tensor

MiB = 1 << 20


@async_test()
async def test_shm_over_tcp_is_a_clear_bad_request(daemon: DaemonProcess) -> None:
    async with await Client.connect(daemon.url) as c:
        before = {d["name"]: d["free"] for d in await c.get_devices()}
        with pytest.raises(BadRequest, match=r"unix:// or seqpacket://"):
            await c.alloc_buffer(4096, device="shm")
        after = {d["name"]: d["free"] for d in await c.get_devices()}
        assert after == before  # nothing was allocated, nothing is charged
        assert before["shm"] > 0 and before["shm"] % 4096 == 0


def test_shm_device_is_listed_with_its_own_limit(daemon: DaemonProcess) -> None:
    c = RawConn.to(daemon)
    c.hello()
    devices = {d["name"]: d for d in c.request(Command.GET_DEVICES).body["devices"]}
    assert devices["shm"]["total"] == 1024 * MiB  # memory.shm_limit_mib
    assert devices["shm"]["max_size"] == 1024 * MiB - charge_of(0) + 4096
    f = c.request(Command.ALLOC_BUFFER, {"device": "shm", "size": 1})
    assert f.is_error and f.body["code"] == "BAD_REQUEST"
    c.send(Command.ALLOC_BUFFER, {"device": "shm", "size": 1}, flags=Flag.NO_REPLY)
    ev = c.recv()  # a one-way refusal is still told, as an EVENT
    assert ev.is_error and ev.body["code"] == "BAD_REQUEST"


# -- end to end over the descriptor-passing transports --------------------------------

SCHEMES = ["unix", "seqpacket"]
CHILD = """
import asyncio, sys
from client import Client

async def main():
    c = await Client.connect(sys.argv[1])
    buf = await c.alloc_shared(int(sys.argv[2]))
    buf.array[:] = 7  # every page touched, in the shared pages
    await c.reg_mr(buf)
    print(buf.id, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def _local_daemon(daemon_factory: DaemonFactory, tmp: Path, *args: str,
                  env: dict[str, str | None] | None = None) -> DaemonProcess:
    return daemon_factory(["--unix", str(tmp / "d.sock"),
                           "--listen", f"seqpacket://{tmp / 'd.seq'}", *args], env=env)


def _url(tmp: Path, scheme: str) -> str:
    return f"unix://{tmp / 'd.sock'}" if scheme == "unix" else f"seqpacket://{tmp / 'd.seq'}"


def _memfds(d: DaemonProcess) -> int:
    """Mappings and descriptors of shared buffers the daemon has now."""
    assert d.proc is not None
    pid = d.proc.pid
    with open(f"/proc/{pid}/maps") as f:
        maps = sum("memfd:transferd-" in line for line in f)
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            fds += "memfd:transferd-" in os.readlink(f"/proc/{pid}/fd/{fd}")
    return maps + fds


@pytest.mark.parametrize("scheme", SCHEMES)
@async_test()
async def test_set_and_get_on_a_shared_buffer_move_no_payload(
    daemon_factory: DaemonFactory, tmp_path: Path, scheme: str
) -> None:
    d = _local_daemon(daemon_factory, tmp_path)
    size = 4 * MiB
    async with await Client.connect(_url(tmp_path, scheme)) as c, \
            await Client.connect(d.url) as tcp:
        buf = await c.alloc_shared(size)
        assert isinstance(buf, SharedBuffer) and buf.size == size
        assert buf.array.shape == (size,) and not buf.array.any()  # zero filled
        before_client = c.stats()["bytes_out"] + c.stats()["bytes_in"]
        before_server = await tcp.server_stats()
        data = pattern(size, 3)
        await c.set_tensor(buf.tensor(), data)
        c.set_tensor_async(buf.tensor(0, 4096), pattern(4096, 4))
        got = await c.get_tensor(buf.tensor(4096, size - 4096))
        fut = c.get_tensor_async(buf.tensor(0, 4096))
        await c.synchronize()
        assert digest(got) == digest(data[4096:]) and fut.result() == pattern(4096, 4)
        out = bytearray(100)
        assert await c.get_tensor(buf.tensor(10, 100), out=out) is out
        after = await tcp.server_stats()
        for cmd in ("SET_TENSOR", "SET_TENSORS", "GET_TENSOR", "GET_TENSORS"):
            assert after["commands"][cmd] == before_server["commands"][cmd], cmd
        moved = c.stats()["bytes_out"] + c.stats()["bytes_in"] - before_client
        assert moved < 1024, moved  # the SYNCHRONIZE, no payload
        # The daemon's mapping is the same memory: a TCP client reads the bytes over the wire.
        expect = pattern(4096, 4) + data[4096:]
        assert digest(await tcp.get_tensor(buf.tensor())) == digest(expect)
        await tcp.set_tensor(buf.tensor(0, 8), b"ABCDEFGH")
        assert bytes(buf.view[:8]) == b"ABCDEFGH"
        with pytest.raises(OutOfBounds):  # checked as the daemon checks it
            await c.set_tensor(Tensor(buf.id, size - 4, 8), b"x" * 8)
        with pytest.raises(OutOfBounds):
            await c.get_tensor(Tensor(buf.id, size, 1))
        await c.free_buffer(buf)
    assert wait_until(lambda: _memfds(d) == 0)


@pytest.mark.parametrize("scheme", SCHEMES)
@async_test()
async def test_shared_sizes_zero_the_limit_and_one_more(
    daemon_factory: DaemonFactory, tmp_path: Path, scheme: str
) -> None:
    d = _local_daemon(daemon_factory, tmp_path, "-m", "16")
    async with await Client.connect(_url(tmp_path, scheme)) as c, \
            await Client.connect(d.url) as tcp:
        shm = next(x for x in await tcp.get_devices() if x["name"] == "shm")
        zero = await c.alloc_shared(0)
        assert zero.size == 0 and zero.view.nbytes == 0
        assert await c.get_tensor(zero.tensor()) == b""
        await c.free_buffer(zero)
        with pytest.raises(OutOfMemory):
            await c.alloc_shared(shm["max_size"] + 1)
        assert shm["max_size"] == shm["total"] - shm["per_buffer"]
    assert _memfds(d) == 0


@async_test()
async def test_shared_limit_is_its_own(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    d = _local_daemon(daemon_factory, tmp_path, "-m", "8",
                      env={"TRANSFERD_MEMORY_SHM_LIMIT_MIB": "4"})
    async with await Client.connect(_url(tmp_path, "unix")) as c:
        devs = {x["name"]: x for x in await c.get_devices()}
        assert devs["shm"]["total"] == 4 * MiB and devs["cpu"]["total"] == 8 * MiB
        big = await c.alloc_shared(devs["shm"]["max_size"])  # all of it
        with pytest.raises(OutOfMemory):
            await c.alloc_shared(0)
        host = await c.alloc_buffer(4 * MiB)  # the host limit is untouched
        big.array[-1] = 1
        await c.free_buffer(big)
        await c.free_buffer(host)
        devs = {x["name"]: x for x in await c.get_devices()}
        assert devs["shm"]["free"] == 4 * MiB and devs["cpu"]["free"] == 8 * MiB
    assert d.alive()


@async_test(timeout=60)
async def test_a_remote_daemon_writes_straight_into_a_shared_buffer(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    writer = daemon_factory()
    d = _local_daemon(daemon_factory, tmp_path)
    size, imm = 32 * MiB, 0x5EED
    data = pattern(size, 11)
    async with await Client.connect(_url(tmp_path, "unix")) as c, \
            await Client.connect(writer.url) as w:
        buf = await c.alloc_shared(size)
        _, desc = await c.reg_mr(buf)
        arrived = await c.expect_imm_count(imm, 1, wait=False)
        src = await w.alloc_buffer(size)
        await w.set_tensor(src.tensor(), data)
        src_mr, _ = await w.reg_mr(src)
        await (await w.submit_single_write(size, imm, (src_mr, 0), (desc, 0))).wait(20)
        await arrived.wait(20)
        # In the client's memory, no GET: the daemon wrote into the pages it maps.
        assert hashlib.sha256(buf.view).hexdigest() == hashlib.sha256(data).hexdigest()
        await c.free_buffer(buf)
    assert wait_until(lambda: _memfds(d) == 0)


@async_test(timeout=60)
async def test_a_client_that_dies_leaves_nothing_behind(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    d = _local_daemon(daemon_factory, tmp_path)
    size = 16 * MiB
    async with await Client.connect(d.url) as tcp:
        def shm_free() -> int:
            return int(next(x for x in _devices(d) if x["name"] == "shm")["free"])

        total = shm_free()
        child = subprocess.Popen([sys.executable, "-c", CHILD, _url(tmp_path, "unix"),
                                  str(size)], stdout=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert child.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 20)
            buffer_id = int(line)
            assert shm_free() == total - charge_of(size)
            assert _memfds(d) >= 1  # the daemon's mapping of it
            assert (await tcp.get_tensor((buffer_id, size - 1, 1))) == b"\x07"
            child.kill()  # mapped, registered, and gone without a word
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
        assert wait_until(lambda: shm_free() == total, timeout=10)
        assert wait_until(lambda: _memfds(d) == 0, timeout=10)
        with pytest.raises(NotFound):
            await tcp.get_tensor((buffer_id, 0, 1))
    assert d.alive()


def _devices(d: DaemonProcess) -> list[dict[str, Any]]:
    c = RawConn.to(d)
    try:
        c.hello()
        return list(c.request(Command.GET_DEVICES).body["devices"])
    finally:
        c.sock.close()


@async_test(timeout=60)
async def test_an_alloc_behind_an_unread_reply_gets_its_own_descriptor(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """ALLOC_BUFFER of shm sent behind a 32 MiB GET the client does not read yet (the
    daemon stops reading meanwhile): when the reply finally comes, the memfd with it is
    the buffer's, though the daemon closes its own copy once sent and the client opened
    other descriptors in the meantime."""
    import array
    import mmap
    import socket

    from transferd.protocol.frames import FrameDecoder, encode_frame

    d = _local_daemon(daemon_factory, tmp_path)
    size = 32 * MiB
    async with await Client.connect(d.url) as tcp:
        big = await tcp.alloc_buffer(size)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(tmp_path / "d.sock"))
        s.settimeout(10)
        dec = FrameDecoder(max_payload=1 << 30)
        frames_in: list[Any] = []
        fds: list[int] = []

        def pump() -> None:
            data, anc, _, _ = s.recvmsg(1 << 20, socket.CMSG_SPACE(4 * 4))
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(raw[: len(raw) - len(raw) % 4])
                    fds.extend(a)
            if not data:
                raise ConnectionError("daemon closed")
            frames_in.extend(dec.feed(data))

        s.sendall(encode_frame(Command.HELLO, 0, 1, {"major": 1, "minor": 2, "client": "raw"}))
        while not frames_in:
            await asyncio.to_thread(pump)
        frames_in.clear()
        s.sendall(encode_frame(Command.GET_TENSOR, 0, 2, {"tensor": [big.id, 0, size]}))
        s.sendall(encode_frame(Command.ALLOC_BUFFER, 0, 3, {"device": "shm", "size": 8192}))
        await asyncio.sleep(0.3)  # the daemon has both replies queued behind our silence
        # Descriptors opened meanwhile may take the number a closed memfd had.
        decoys = [os.open("/dev/null", os.O_RDONLY) for _ in range(8)]
        try:
            while len([f for f in frames_in if f.seq == 3]) == 0:
                await asyncio.to_thread(pump)
            (reply,) = [f for f in frames_in if f.seq == 3]
            assert not reply.is_error and reply.body["fds"] == 1 and len(fds) == 1, reply.body
            m = mmap.mmap(fds[0], reply.body["map_size"], flags=mmap.MAP_SHARED)
            os.close(fds[0])
            await tcp.set_tensor((reply.body["buffer"], 100, 5), b"hello")
            assert m[100:105] == b"hello"  # the daemon's buffer, not some other file
            m.close()
        finally:
            for fd in decoys:
                os.close(fd)
            s.close()
    assert d.alive()
