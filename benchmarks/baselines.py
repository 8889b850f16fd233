"""Baseline servers: what the daemon is measured against, on the same machine.

Run as ``python -m benchmarks.baselines KIND``; each prints the same
``transferd: listening on tcp://HOST:PORT`` and ``transferd: ready`` lines as
the daemon, so :class:`benchmarks.harness.ServerProcess` starts either.

``pingpong`` (the latency floor): an asyncio ``Protocol`` on uvloop that answers
every 24-byte request with a fixed ``--size``-byte reply.  No framing beyond
the fixed sizes, no parsing, no allocation per request: the least any asyncio
server on uvloop can do for one round trip of that shape.

``bulk`` (the throughput baseline): plain blocking sockets.  A request is one
opcode byte and a little-endian u64 length:

- ``S n``: receive n bytes with ``recv_into`` into a preallocated buffer, then
  answer one byte (so the sender can time the whole transfer);
- ``G n``: ``sendall`` the first n bytes of that buffer;
- ``C 0``: answer the CRC-32 of the last n bytes received (u64), to verify.

``bare`` (a reference, not a target): the same GET_TENSOR frames as the daemon
(24-byte header, msgpack body ``{"tensor": [buffer, offset, size]}``, reply
header and payload), handled by an asyncio ``BufferedProtocol`` on uvloop with
nothing else: no validation, no buffer table, no metrics, no queue.  What the
wire format itself costs in Python, so a latency figure can say how much of
the daemon's distance from the floor is its own layers.

The client halves live with the benchmarks that use them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
import sys
import zlib

PING_SIZE = 24
BULK_REQ = struct.Struct("<cQ")
FRAME = struct.Struct("<2sBBIIIQ")  # PROTOCOL.md's header


def nodelay(transport: asyncio.BaseTransport) -> asyncio.Transport:
    """A stream transport, with Nagle off on its socket (every exchange here is a round trip)."""
    transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return transport  # type: ignore[return-value]


def _ready(host: str, port: int) -> None:
    print(f"transferd: listening on tcp://{host}:{port}", flush=True)
    print("transferd: ready", flush=True)


class _Pong(asyncio.Protocol):
    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.pending = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = nodelay(transport)

    def data_received(self, data: bytes) -> None:
        self.pending += len(data)
        n, self.pending = divmod(self.pending, PING_SIZE)
        if n and self.transport is not None:
            self.transport.write(self.reply * n if n > 1 else self.reply)


async def _serve_pingpong(host: str, port: int, size: int) -> None:
    reply = bytes(range(256)) * (size // 256) + bytes(size % 256)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Pong(reply), host, port)
    bound = server.sockets[0].getsockname()
    _ready(bound[0], bound[1])
    await server.serve_forever()


class BareFrames(asyncio.BufferedProtocol):
    """Either end of the ``bare`` pair: frames read into one 64 KiB buffer, ``n`` bytes
    of it filled so far."""

    def __init__(self) -> None:
        self.buf = bytearray(1 << 16)
        self.view = memoryview(self.buf)
        self.n = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = nodelay(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.n :]


class _BareServer(BareFrames):
    def __init__(self, memory: memoryview) -> None:
        super().__init__()
        self.memory = memory

    def buffer_updated(self, nbytes: int) -> None:
        import msgpack

        self.n += nbytes
        pos = 0
        while self.n - pos >= FRAME.size:
            _, cmd, _, seq, body_len, _, _ = FRAME.unpack_from(self.buf, pos)
            end = pos + FRAME.size + body_len
            if self.n < end:
                break
            _, offset, size = msgpack.unpackb(self.view[pos + FRAME.size : end])["tensor"]
            assert self.transport is not None
            reply = FRAME.pack(b"TD", cmd, 0x01, seq, 0, 0, size)
            self.transport.write(b"".join((reply, self.memory[offset : offset + size])))
            pos = end
        if pos:
            self.buf[: self.n - pos] = self.buf[pos : self.n]
            self.n -= pos


async def _serve_bare(host: str, port: int, size: int) -> None:
    memory = memoryview(bytearray(size))
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _BareServer(memory), host, port)
    bound = server.sockets[0].getsockname()
    _ready(bound[0], bound[1])
    await server.serve_forever()


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("peer closed mid-transfer")
        got += k


def _serve_bulk(host: str, port: int, size: int) -> None:
    buf = bytearray(size)
    view = memoryview(buf)
    last = 0
    hdr = bytearray(BULK_REQ.size)
    with socket.create_server((host, port)) as srv:
        _ready(*srv.getsockname()[:2])
        while True:
            conn, _ = srv.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                try:
                    while True:
                        _recv_exact(conn, memoryview(hdr))
                        op, n = BULK_REQ.unpack(hdr)
                        if op == b"S":
                            _recv_exact(conn, view[:n])
                            last = n
                            conn.sendall(b"k")
                        elif op == b"G":
                            conn.sendall(view[:n])
                        elif op == b"C":
                            conn.sendall(struct.pack("<Q", zlib.crc32(view[:last])))
                        else:
                            break
                except ConnectionError:
                    pass


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.baselines")
    ap.add_argument("kind", choices=["pingpong", "bare", "bulk"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--size", type=int, default=4096, help="reply size / bulk buffer size")
    a = ap.parse_args(argv)
    if a.kind == "pingpong":
        import uvloop

        uvloop.run(_serve_pingpong(a.host, a.port, a.size))
    elif a.kind == "bare":
        import uvloop

        uvloop.run(_serve_bare(a.host, a.port, a.size))
    else:
        _serve_bulk(a.host, a.port, a.size)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main(sys.argv[1:])
