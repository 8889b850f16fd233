"""Baseline servers and lean clients for the scaling figures (issue 12).

``python -m benchmarks.scale_baselines ack`` is the floor of a request that
carries a payload (a 1 MiB set, a 4 KiB write): an asyncio ``BufferedProtocol``
on uvloop that reads PROTOCOL.md's 24-byte header, receives the payload it
announces (into a reused ``--read`` buffer, 1 MiB by default, so a large payload
is received in calls as large as the daemon's, which reads one straight into its
tensor; the bytes are looked at by nobody), and answers a 24-byte header.  Any
number of connections; it prints the same ``transferd: listening on ...`` /
``transferd: ready`` lines as the daemon.  The floor of a 4 KiB read is
:mod:`benchmarks.baselines`' ``pingpong``.

:class:`AckClient` and :class:`PingClient` are the lean clients of those two
servers: one request outstanding per connection (closed loop), like the daemon's
clients in the same figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

from .baselines import FRAME, PING_SIZE, nodelay

READ = 1 << 20
ACK = FRAME.pack(b"TD", 0x05, 0x01, 0, 0, 0, 0)


class _AckServer(asyncio.BufferedProtocol):
    def __init__(self, read: int = READ) -> None:
        self.buf = bytearray(read)
        self.view = memoryview(self.buf)
        self.n = 0  # header bytes kept at the buffer's start
        self.skip = 0  # payload bytes still to come
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = nodelay(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.n :]

    def buffer_updated(self, nbytes: int) -> None:
        end = self.n + nbytes
        pos = 0
        while True:
            if self.skip:
                k = min(self.skip, end - pos)
                self.skip -= k
                pos += k
                if self.skip:
                    break
                assert self.transport is not None
                self.transport.write(ACK)
            if end - pos < FRAME.size:
                break
            *_, body_len, _, payload_len = FRAME.unpack_from(self.buf, pos)
            pos += FRAME.size
            self.skip = body_len + payload_len
            if not self.skip:
                assert self.transport is not None
                self.transport.write(ACK)
        left = max(0, end - pos)
        if left and pos:
            self.buf[:left] = self.buf[pos:end]  # a partial header: a few bytes
        self.n = left


class CountingClient(asyncio.Protocol):
    """Counts answer bytes; each ``want`` of them wakes the one waiter (no parsing)."""

    def __init__(self, want: int) -> None:
        self.got = 0
        self.want = want
        self.waiter: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = nodelay(transport)

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= self.want and self.waiter is not None:
            self.got -= self.want
            w, self.waiter = self.waiter, None
            w.set_result(None)


class AckClient(CountingClient):
    """Sends a header and ``payload`` per request; a 24-byte answer wakes the waiter."""

    def __init__(self, payload: bytes) -> None:
        super().__init__(FRAME.size)
        self.head = FRAME.pack(b"TD", 0x05, 0, 1, 0, 0, len(payload))
        self.payload = payload

    def request(self) -> asyncio.Future[None]:
        return self.burst(1)

    def burst(self, n: int) -> asyncio.Future[None]:
        """``n`` requests sent at once (pipelined); resolves when all ``n`` are answered."""
        assert self.transport is not None
        w = asyncio.get_running_loop().create_future()
        self.waiter = w
        self.want = n * FRAME.size
        if n == 1 and len(self.payload) <= 16 * 1024:
            self.transport.write(self.head + self.payload)
        else:
            self.transport.writelines([self.head, self.payload] * n)
        return w


class PingClient(CountingClient):
    """The ``pingpong`` server's client: 24 bytes out, ``size`` bytes back."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size
        self.req = b"\0" * PING_SIZE

    def request(self) -> asyncio.Future[None]:
        assert self.transport is not None
        w = asyncio.get_running_loop().create_future()
        self.waiter = w
        self.transport.write(self.req)
        return w


async def _serve_ack(host: str, port: int, read: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _AckServer(read), host, port, backlog=1024)
    bound = server.sockets[0].getsockname()
    print(f"transferd: listening on tcp://{bound[0]}:{bound[1]}", flush=True)
    print("transferd: ready", flush=True)
    await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scale_baselines")
    ap.add_argument("kind", choices=["ack"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--read", type=int, default=READ, help="receive buffer per connection")
    a = ap.parse_args(argv)
    import uvloop

    uvloop.run(_serve_ack(a.host, a.port, max(4096, a.read)))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main(sys.argv[1:])
