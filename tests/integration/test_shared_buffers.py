"""Shared-memory buffers (device "shm"): what every connection gets, and the refusals."""

from __future__ import annotations

import pytest

from client import Client
from tests.helpers import DaemonProcess, RawConn, async_test
from transferd.memory import charge_of
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import BadRequest

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
