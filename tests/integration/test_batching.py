"""The client's queue against a real daemon: one GET_TENSORS and one SET_TENSORS per
step, the A/B switches, old servers, ordering, ``out=``, and batches split at limits."""

from __future__ import annotations

from typing import Any

import pytest

from client import Client
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, async_test, digest, pattern, run
from transferd.protocol.errors import NotFound

BATCHES = [1, 8, 32, 128]
TENSOR = 4096
STEPS = 3
COUNTED = ("SET_TENSOR", "GET_TENSOR", "SET_TENSORS", "GET_TENSORS")


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in COUNTED}


async def run_steps(c: Client, n: int, steps: int = STEPS) -> dict[str, Any]:
    """``steps`` steps of n set_tensor_async + n get_tensor_async + flush.

    Checks every read by checksum; returns per-step server and client command
    deltas and the digests read.
    """
    buf = await c.alloc_buffer(2 * n * TENSOR)
    server_deltas, client_deltas, digests = [], [], []
    for step in range(steps):
        s0 = (await c.server_stats())["commands"]
        c0 = c.stats()["commands"]
        data = [pattern(TENSOR, 1000 * step + i) for i in range(n)]
        # Write the first half of the buffer; read back what was just written
        # and, interleaved, the second half (written by the step before).
        futs = []
        for i in range(n):
            c.set_tensor_async(buf.tensor(i * TENSOR, TENSOR), data[i])
        for i in range(n):
            futs.append(c.get_tensor_async(buf.tensor(i * TENSOR, TENSOR)))
            futs.append(c.get_tensor_async(buf.tensor((n + i) * TENSOR, TENSOR)))
        await c.flush()
        c1 = c.stats()["commands"]
        s1 = (await c.server_stats())["commands"]
        got = [f.result() for f in futs]
        assert [digest(g) for g in got[0::2]] == [digest(d) for d in data]
        if step:
            assert [digest(g) for g in got[1::2]] == digests[-1]
        else:
            assert all(g == bytes(TENSOR) for g in got[1::2])
        # Carry this step's data over to the second half for the next step.
        await c.copy_tensor(buf.tensor(0, n * TENSOR), buf.tensor(n * TENSOR, n * TENSOR))
        digests.append([digest(d) for d in data])
        server_deltas.append(_delta(s1, s0))
        client_deltas.append(_delta(c1, c0))
    await c.free_buffer(buf)
    return {"server": server_deltas, "client": client_deltas, "digests": digests}


@pytest.mark.parametrize("n", BATCHES)
@async_test()
async def test_one_get_tensors_and_one_set_tensors_per_step(
    url: str, n: int
) -> None:
    async with await Client.connect(url) as c:
        r = await run_steps(c, n)
    one_each = {"SET_TENSOR": 0, "GET_TENSOR": 0, "SET_TENSORS": 1, "GET_TENSORS": 1}
    assert r["server"] == [one_each] * STEPS
    assert r["client"] == [one_each] * STEPS


@async_test()
async def test_steps_over_the_same_tensors_read_what_each_step_wrote(url: str) -> None:
    # A decode loop: the same Tensor objects every step (the client sends its packed
    # batch again, the daemon reuses its check), new bytes every step; then one tensor
    # swapped, one dropped, and the buffer freed under the same list.
    n = 16
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(2 * n * 64)
        ts = [buf.tensor(i * 64, 64) for i in range(n)]
        for step in range(6):
            if step == 3:
                ts[5] = buf.tensor((n + 5) * 64, 64)  # another row, same length
            if step == 4:
                ts = ts[:-1]
            data = [pattern(64, 100 * step + i) for i in range(len(ts))]
            for t, d in zip(ts, data, strict=True):
                c.set_tensor_async(t, d)
            futs = [c.get_tensor_async(t) for t in ts]
            await c.flush()
            assert [digest(f.result()) for f in futs] == [digest(d) for d in data], step
            cmds = c.stats()["commands"]
            assert cmds["SET_TENSORS"] == cmds["GET_TENSORS"] == step + 1
        await c.free_buffer(buf)
        futs = [c.get_tensor_async(t) for t in ts]
        with pytest.raises(NotFound):
            await c.flush()
        assert all(isinstance(f.exception(), NotFound) for f in futs)


@pytest.mark.parametrize("n", BATCHES)
@async_test()
async def test_switches_send_one_command_per_tensor(
    url: str, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    async with await Client.connect(url) as batched:
        expect = await run_steps(batched, n)
    monkeypatch.setenv("TRANSFERD_NO_BATCHED_GET", "1")
    monkeypatch.setenv("TRANSFERD_NO_BATCHED_SET", "1")
    async with await Client.connect(url) as c:
        assert not c.switches.batched_get and not c.switches.batched_set
        r = await run_steps(c, n)
    per_tensor = {"SET_TENSOR": n, "GET_TENSOR": 2 * n, "SET_TENSORS": 0, "GET_TENSORS": 0}
    assert r["server"] == [per_tensor] * STEPS
    assert r["client"] == [per_tensor] * STEPS
    assert r["digests"] == expect["digests"]  # byte-identical results


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        (
            {"TRANSFERD_NO_BATCHED_GET": "1"},
            {"SET_TENSOR": 0, "GET_TENSOR": 16, "SET_TENSORS": 1, "GET_TENSORS": 0},
        ),
        (
            {"TRANSFERD_NO_BATCHED_SET": "yes"},
            {"SET_TENSOR": 8, "GET_TENSOR": 0, "SET_TENSORS": 0, "GET_TENSORS": 1},
        ),
        (
            {"TRANSFERD_NO_BATCHED_GET": "0", "TRANSFERD_NO_BATCHED_SET": ""},
            {"SET_TENSOR": 0, "GET_TENSOR": 0, "SET_TENSORS": 1, "GET_TENSORS": 1},
        ),
    ],
    ids=["no-batched-get", "no-batched-set", "switches-off"],
)
@async_test()
async def test_each_switch_alone(
    url: str, monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
    expect: dict[str, int],
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    async with await Client.connect(url) as c:
        r = await run_steps(c, 8, steps=1)
    assert r["server"] == [expect]


@pytest.mark.parametrize("n", BATCHES)
@async_test()
async def test_minor_1_server_gets_one_command_per_tensor(
    url: str, daemon_factory: DaemonFactory, n: int
) -> None:
    old = daemon_factory(["--protocol-minor", "1"])
    async with await Client.connect(url) as c:
        expect = await run_steps(c, n)
    async with await Client.connect(old.url) as c:
        assert c.minor == 1
        r = await run_steps(c, n)
    per_tensor = {"SET_TENSOR": n, "GET_TENSOR": 2 * n, "SET_TENSORS": 0, "GET_TENSORS": 0}
    assert r["server"] == [per_tensor] * STEPS
    assert r["digests"] == expect["digests"]


@async_test()
async def test_switches_are_read_at_connect(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with await Client.connect(url) as c:
        monkeypatch.setenv("TRANSFERD_NO_BATCHED_GET", "1")
        r = await run_steps(c, 4, steps=1)  # connected before: still batched
    assert r["server"][0]["GET_TENSORS"] == 1


# -- ordering -------------------------------------------------------------------------------


@async_test()
async def test_read_sees_writes_queued_before_it_and_not_after(url: str) -> None:
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(64)
        await c.set_tensor(buf.tensor(), b"0" * 64)
        c.set_tensor_async(buf.tensor(0, 16), b"A" * 16)
        r1 = c.get_tensor_async(buf.tensor(0, 32))  # sees A
        c.set_tensor_async(buf.tensor(8, 16), b"B" * 16)  # overlaps r1: after it
        r2 = c.get_tensor_async(buf.tensor(0, 32))  # sees A and B
        c.set_tensor_async(buf.tensor(32, 8), b"C" * 8)  # overlaps nothing read before
        r3 = c.get_tensor_async(buf.tensor(24, 16))
        c.set_tensor_async(buf.tensor(0, 64), b"D" * 64)  # overlaps r1-r3
        before = c.stats()["commands"]
        await c.flush()
        after = c.stats()["commands"]
        assert r1.result() == b"A" * 16 + b"0" * 16
        assert r2.result() == b"A" * 8 + b"B" * 16 + b"0" * 8
        assert r3.result() == b"0" * 8 + b"C" * 8
        assert await c.get_tensor(buf.tensor()) == b"D" * 64
        d = _delta(after, before)
        # Three segments: (A | r1), (B, C | r2, r3), (D | -).
        assert d == {"SET_TENSOR": 0, "GET_TENSOR": 0, "SET_TENSORS": 3, "GET_TENSORS": 2}
        await c.free_buffer(buf)


@async_test()
async def test_queued_ops_hold_the_tensor_and_data_by_value(url: str) -> None:
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(16)
        data = bytearray(b"x" * 16)
        c.set_tensor_async(buf.tensor(), data)
        data[:] = b"y" * 16  # changing the source after queueing changes nothing
        fut = c.get_tensor_async(buf.tensor())
        await c.flush()
        assert fut.result() == b"x" * 16
        # copy=False: the caller promises to leave it alone, and what is sent is
        # whatever the memory holds at the flush.
        c.set_tensor_async(buf.tensor(), data, copy=False)
        await c.synchronize()
        assert await c.get_tensor(buf.tensor()) == b"y" * 16
        await c.free_buffer(buf)


@async_test()
async def test_synchronous_calls_are_flush_points(url: str) -> None:
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(8)
        c.set_tensor_async(buf.tensor(), b"12345678")
        fut = c.get_tensor_async(buf.tensor())
        assert await c.get_tensor(buf.tensor()) == b"12345678"
        assert fut.done() and fut.result() == b"12345678"
        c.set_tensor_async(buf.tensor(), b"abcdefgh")
        await c.get_devices()  # any synchronous call
        other = await Client.connect(url)
        try:
            assert await other.get_tensor(buf.tensor()) == b"abcdefgh"
        finally:
            await other.close()
        c.set_tensor_async(buf.tensor(), b"ABCDEFGH")
        await c.synchronize()
        async with await Client.connect(url) as other2:
            assert await other2.get_tensor(buf.tensor()) == b"ABCDEFGH"
        await c.free_buffer(buf)


@async_test()
async def test_get_tensor_async_out_fills_the_callers_buffer(url: str) -> None:
    import numpy as np

    async with await Client.connect(url) as c:
        n, size = 8, 100_000  # above the decoder's direct-receive threshold
        buf = await c.alloc_buffer(n * size)
        data = pattern(n * size, 77)
        await c.set_tensor(buf.tensor(), data)
        big = bytearray(n * size)
        view = memoryview(big)
        outs = [view[i * size : (i + 1) * size] for i in range(n)]
        futs = [c.get_tensor_async(buf.tensor(i * size, size), out=outs[i]) for i in range(n)]
        arr = np.zeros(size, dtype=np.uint8)
        fa = c.get_tensor_async(buf.tensor(0, size), out=arr)
        small = bytearray(3)
        fs = c.get_tensor_async(buf.tensor(5, 3), out=small)
        await c.flush()
        assert digest(big) == digest(data)
        for f, out in zip(futs, outs, strict=True):
            assert f.result() is out  # resolves to the caller's buffer, no copy
        assert fa.result() is arr and digest(arr) == digest(data[:size])
        assert fs.result() is small and small == data[5:8]
        # Wrong sizes and read-only buffers are refused when queued.
        from transferd.protocol.errors import BadRequest

        with pytest.raises(BadRequest):
            c.get_tensor_async(buf.tensor(0, 4), out=bytearray(5))
        with pytest.raises(BadRequest):
            c.get_tensor_async(buf.tensor(0, 4), out=b"read")
        await c.free_buffer(buf)


@async_test()
async def test_a_batch_mixing_out_plain_and_zero_byte_reads_resolves_each_to_its_own(
    url: str,
) -> None:
    """Reads with out= and without, and zero-byte reads of both kinds, in one batch: each
    future resolves to the caller's buffer (out=) or to new bytes of its tensor, a
    zero-byte one too, whether the reply is gathered whole (small) or received into the
    reads' memory (large), and when the whole batch is zero bytes (no payload at all)."""
    async with await Client.connect(url) as c:
        for size in (16, 40_000):  # a reply under and over the client's gather threshold
            buf = await c.alloc_buffer(4 * size)
            data = pattern(4 * size, size & 0xFF)
            await c.set_tensor(buf.tensor(), data)
            mine = bytearray(size)
            empty_out = bytearray(0)
            fa = c.get_tensor_async(buf.tensor(0, size))
            fb = c.get_tensor_async(buf.tensor(size, size), out=mine)
            fz = c.get_tensor_async(buf.tensor(2 * size, 0))
            fzo = c.get_tensor_async(buf.tensor(2 * size, 0), out=empty_out)
            fc = c.get_tensor_async(buf.tensor(3 * size, size))
            await c.flush()
            assert bytes(fa.result()) == data[:size]
            assert fb.result() is mine and mine == data[size : 2 * size]
            assert bytes(fz.result()) == b"" and fz.result() is not fzo.result()
            assert fzo.result() is empty_out
            assert bytes(fc.result()) == data[3 * size :]
            await c.free_buffer(buf)
        buf = await c.alloc_buffer(64)
        empty_out = bytearray(0)
        f1 = c.get_tensor_async(buf.tensor(8, 0), out=empty_out)
        f2 = c.get_tensor_async(buf.tensor(16, 0))
        await c.flush()  # a GET_TENSORS whose reply has no payload
        assert f1.result() is empty_out and bytes(f2.result()) == b""
        await c.free_buffer(buf)


# -- limits -----------------------------------------------------------------------------------


async def _set_then_get(c: Client, n: int, size: int) -> dict[str, int]:
    """n set_tensor_async of ``size`` bytes, then n get_tensor_async of them, one flush.

    Checks every read by checksum; returns the client's command deltas.
    """
    buf = await c.alloc_buffer(n * size)
    data = [pattern(size, i) for i in range(n)]
    before = c.stats()["commands"]
    for i in range(n):
        c.set_tensor_async(buf.tensor(i * size, size), data[i])
    futs = [c.get_tensor_async(buf.tensor(i * size, size)) for i in range(n)]
    await c.flush()
    delta = _delta(c.stats()["commands"], before)
    assert [digest(f.result()) for f in futs] == [digest(x) for x in data]
    await c.free_buffer(buf)
    return delta


@async_test()
async def test_batches_split_at_max_body(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(env={"TRANSFERD_SERVER_MAX_BODY": "2048"})
    async with await Client.connect(d.url) as c:
        assert c.max_body == 2048
        delta = await _set_then_get(c, 300, 16)  # ~9 KiB of tensor list: several commands
        assert delta["SET_TENSOR"] == delta["GET_TENSOR"] == 0
        assert 2 <= delta["SET_TENSORS"] == delta["GET_TENSORS"] <= 10
        # The server never saw a body over its limit (it would have closed us).
        await c.synchronize()


@async_test()
async def test_batches_split_at_max_payload(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(env={"TRANSFERD_SERVER_MAX_PAYLOAD": "10000"})
    async with await Client.connect(d.url) as c:
        assert c.max_payload == 10000
        delta = await _set_then_get(c, 64, 1000)
        assert delta["SET_TENSORS"] == delta["GET_TENSORS"] == 7  # 10 + ... + 4 tensors


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_client_runs_on_either_event_loop(url: str, loop: str) -> None:
    async def body() -> dict[str, Any]:
        async with await Client.connect(url) as c:
            return await run_steps(c, 32, steps=2)

    r = run(body(), timeout=30, loop=loop)
    one_each = {"SET_TENSOR": 0, "GET_TENSOR": 0, "SET_TENSORS": 1, "GET_TENSORS": 1}
    assert r["server"] == [one_each] * 2


@async_test(timeout=60)
async def test_pipelined_read_then_write_of_a_large_tensor(url: str) -> None:
    """The read's reply is still being sent when the write that follows it arrives:
    the read must carry the old bytes, the write must land after it."""
    size = 32 << 20
    old, new = pattern(size, 61), pattern(size, 62)
    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(size)
        for _ in range(2):
            await c.set_tensor(buf.tensor(), old)
            fut = c.get_tensor_async(buf.tensor())
            c.set_tensor_async(buf.tensor(), new)  # overlaps: sent after the read
            await c.flush()
            assert digest(fut.result()) == digest(old)
            assert digest(await c.get_tensor(buf.tensor())) == digest(new)
        await c.free_buffer(buf)


def test_pipelined_get_then_set_on_the_wire(daemon: DaemonProcess) -> None:
    import threading

    from tests.helpers import RawConn
    from transferd.protocol.constants import Command

    size = 32 << 20
    old, new = pattern(size, 63), pattern(size, 64)
    with RawConn.to(daemon, timeout=30) as raw:
        raw.hello()
        buf = raw.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": size}).body["buffer"]
        raw.request(Command.SET_TENSOR, {"tensor": [buf, 0, size]}, old)
        get_seq = raw.send(Command.GET_TENSOR, {"tensor": [buf, 0, size]})
        # Send the overwrite while nobody reads the GET reply yet.
        sender = threading.Thread(
            target=raw.send, args=(Command.SET_TENSOR, {"tensor": [buf, 0, size]}, new)
        )
        sender.start()
        sender.join(0.3)
        f = raw.recv()
        sender.join(30)
        assert not sender.is_alive()
        assert f.seq == get_seq and f.payload is not None
        assert digest(f.payload) == digest(old)
        assert raw.recv().flags == 0x01  # the SET's reply
        f = raw.request(Command.GET_TENSOR, {"tensor": [buf, 0, size]})
        assert f.payload is not None and digest(f.payload) == digest(new)
        raw.request(Command.FREE_BUFFER, {"buffer": buf})


@async_test()
async def test_futures_made_ahead_are_bounded_and_each_read_gets_its_own(url: str) -> None:
    from client.client import SPARE_FUTURES

    async with await Client.connect(url) as c:
        buf = await c.alloc_buffer(4 * (SPARE_FUTURES + 50))
        ts = [buf.tensor(4 * i, 4) for i in range(SPARE_FUTURES + 50)]
        for t in ts:
            c.set_tensor_async(t, pattern(4, t.offset))
        futs = [c.get_tensor_async(t) for t in ts]
        await c.flush()
        assert len(c._spare) == SPARE_FUTURES  # made while the reply was awaited: bounded
        assert [f.result() for f in futs] == [pattern(4, t.offset) for t in ts]
        # The next step's reads take them: each its own, pending, resolved by its reply;
        # one cancelled by its caller leaves the others be.
        futs = [c.get_tensor_async(t) for t in ts[:10]]
        assert len({id(f) for f in futs}) == 10 and not any(f.done() for f in futs)
        assert len(c._spare) == SPARE_FUTURES - 10
        futs[3].cancel()
        await c.flush()
        assert futs[3].cancelled()
        assert [f.result() for i, f in enumerate(futs) if i != 3] == \
            [pattern(4, t.offset) for i, t in enumerate(ts[:10]) if i != 3]
        assert len(c._spare) == SPARE_FUTURES - 10  # more than this flush's 10 reads: kept
