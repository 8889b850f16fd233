"""Leases attacked on a live daemon (issue 16.8): a name another client made, a client that
reconnects to take every slot, lease names read off STATS, names one byte too long."""

from __future__ import annotations

import asyncio
import hashlib
import socket
from typing import Any

import msgpack
import pytest

from client import Client
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, async_test, pattern
from transferd.protocol.constants import Command, ErrorCode, Flag
from transferd.protocol.errors import BadRequest, NotFound, TooLarge

# Another loopback address: a second source on the same host (all of 127/8 is loopback).
OTHER_SOURCE = "127.0.0.5"


def _sha(data: Any) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


@async_test(timeout=60)
async def test_a_name_another_client_made_is_refused_unless_it_joins(
        daemon: DaemonProcess) -> None:
    """Before: the second ``client.lease(name)`` joined silently and, ending with its block,
    freed the first client's buffer.  Now it is refused, and so are renewing, ending and
    allocating into that lease; with ``join=True`` it shares it on purpose."""
    data = pattern(1 << 16, 7)
    async with await Client.connect(daemon.url) as a, await Client.connect(daemon.url) as b:
        async with a.lease("job-1", ttl=30) as la:
            buf = await la.alloc_buffer(len(data))
            await a.set_tensor(buf.tensor(), data)
            with pytest.raises(BadRequest, match="join"):
                async with b.lease("job-1", ttl=30):
                    pass
            for act in (lambda: b.renew_lease("job-1", 30), lambda: b.end_lease("job-1"),
                        lambda: b.alloc_buffer(4096, lease="job-1")):
                with pytest.raises(BadRequest, match="join"):
                    await act()
            assert _sha(await a.get_tensor(buf.tensor())) == _sha(data)  # untouched
            # Asked for: b shares it, renews it, and (end=False) leaves it to a.
            async with b.lease("job-1", ttl=30, join=True, end=False) as lb:
                assert not lb.created
                await b.alloc_buffer(4096, lease="job-1")
            assert _sha(await a.get_tensor(buf.tensor())) == _sha(data)
        with pytest.raises(NotFound):  # a's block ended it, b's buffer with it
            await a.get_tensor(buf.tensor(0, 1))
        # A lying "join" is refused; the connection goes on.
        with pytest.raises(BadRequest, match="'join' must be a boolean"):
            await b.conn.request(Command.LEASE, {"lease": "x", "ttl_ms": 1000, "join": 1})
        assert await b.get_devices()


def _raw_from(source: str, d: DaemonProcess) -> RawConn:
    """A raw connection to ``d`` from the local address ``source``."""
    raw = RawConn.__new__(RawConn)
    raw.sock = socket.create_connection(d.host_port, timeout=10, source_address=(source, 0))
    raw.decoder = RawConn(*d.host_port).decoder
    raw.frames, raw.seq = [], 0
    return raw


@async_test(timeout=90)
async def test_a_client_that_reconnects_cannot_take_every_lease(
        daemon_factory: DaemonFactory) -> None:
    """Before: 16 connections of 64 leases each, each closed after its 64, held all 1,024
    of the daemon's slots and no one else got a lease.  Now one source has at most
    ``memory.max_leases_per_source`` (256) alive, closed connections' included, and a
    client from another source is served; once the hog's leases expire it may make more."""
    d = daemon_factory()
    held, refused = 0, None
    for i in range(20):
        async with await Client.connect(d.url) as hog:
            try:
                for j in range(64):
                    await hog.renew_lease(f"hog-{i}-{j}", 2.0)
                    held += 1
            except TooLarge as exc:
                refused = exc
                break
    assert refused is not None and "max_leases_per_source" in str(refused), refused
    assert held == 256
    victim = _raw_from(OTHER_SOURCE, d)
    try:
        victim.hello()
        r = victim.request(Command.LEASE, {"lease": "victim", "ttl_ms": 30000})
        assert r.flags == Flag.REPLY and r.body["created"] is True, r.body
    finally:
        victim.close()
    await asyncio.sleep(2.5)  # the hog's leases were not renewed: they expired
    async with await Client.connect(d.url) as hog:
        assert await hog.renew_lease("hog-again", 2.0) is True
    assert d.alive()


@async_test(timeout=60)
async def test_stats_shows_lease_names_only_to_their_holders(daemon: DaemonProcess) -> None:
    """The name is the capability to join and end a lease: STATS {buffers: true} used to
    list every lease's name to every client."""
    async with (await Client.connect(daemon.url) as a, await Client.connect(daemon.url) as b,
                a.lease("secret-lease-name-4f1c", ttl=30) as la):
        buf = await la.alloc_buffer(4096)

        async def listing(c: Client) -> tuple[dict[str, Any], bytes]:
            body = dict((await c.conn.request(Command.STATS, {"buffers": True})).body)
            return next(x for x in body["buffers"] if x["id"] == buf.id), msgpack.packb(body)

        mine, _ = await listing(a)
        assert mine["owner"] == "lease:secret-lease-name-4f1c"
        theirs, raw = await listing(b)
        assert theirs["owner"] == "lease" and b"secret-lease-name-4f1c" not in raw
        await b.renew_lease("secret-lease-name-4f1c", 30, join=True)
        joined, _ = await listing(b)
        assert joined["owner"] == "lease:secret-lease-name-4f1c"


def test_a_lease_name_one_byte_too_long(daemon: DaemonProcess) -> None:
    """128 bytes of UTF-8 is the most (a multi-byte name counted in bytes, not characters);
    one more is BAD_REQUEST, nothing is made, and the connection goes on."""
    with RawConn.to(daemon) as raw:
        raw.hello()
        for name, ok in (("€" * 42 + "ab", True), ("€" * 43, False), ("x" * 129, False),
                         ("y" * 128, True)):
            r = raw.request(Command.LEASE, {"lease": name, "ttl_ms": 1000})
            assert bool(r.flags & Flag.ERROR) is not ok, (len(name.encode()), r.body)
            if not ok:
                assert r.body["code"] == ErrorCode.BAD_REQUEST.name and "over 128" in \
                    r.body["message"]
            else:
                raw.request(Command.END_LEASE, {"lease": name})
        assert raw.request(Command.STATS).flags == Flag.REPLY
