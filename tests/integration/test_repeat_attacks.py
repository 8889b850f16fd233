"""Attacks on a repeated batch (wave 5): a batch that repeats its command's last one is
decoded and checked once, then its check reused; every repeat must still get exactly
the answer a first sending of it gets."""

from __future__ import annotations

from tests.helpers import DaemonProcess, RawConn
from transferd.protocol.constants import Command, ErrorCode, Flag


def test_a_repeated_batch_with_an_empty_tensor_in_a_freed_buffer_is_not_found(
        daemon: DaemonProcess) -> None:
    # A zero-size tensor adds no bytes to a run, but its buffer must still exist (and
    # hold its offset): sent first after the free it is NOT_FOUND, so on a repeat too.
    with RawConn.to(daemon) as raw:
        raw.hello()
        for mixed in (True, False):
            a = raw.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 64}).body["buffer"]
            b = raw.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 64}).body["buffer"]
            batch = {"tensors": [[a, 8, 0], [b, 0, 16]] if mixed else [[a, 8, 0]]}
            n = 16 if mixed else 0
            for cmd, payload in ((Command.SET_TENSORS, bytes(n)), (Command.GET_TENSORS, b"")):
                for _ in range(2):
                    f = raw.request(cmd, batch, payload=payload)
                    assert f.flags == Flag.REPLY, f.body
            assert raw.request(Command.FREE_BUFFER, {"buffer": a}).flags == Flag.REPLY
            for cmd, payload in ((Command.SET_TENSORS, bytes(n)), (Command.GET_TENSORS, b"")):
                for _ in range(2):
                    f = raw.request(cmd, batch, payload=payload)
                    assert f.body.get("code") == ErrorCode.NOT_FOUND, (mixed, cmd, f.flags, f.body)
