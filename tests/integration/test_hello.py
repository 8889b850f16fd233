"""HELLO and versions: what the server reports, old/new clients and servers, tokens,
transports (TCP, Unix socket), and the clients as context managers."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from client import Client, SyncClient
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, async_test, digest, pattern
from transferd.protocol.constants import (
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_PAYLOAD,
    PROTO_MAJOR,
    PROTO_MINOR,
    PROTO_PATCH,
    Command,
    ErrorCode,
    Flag,
)
from transferd.protocol.errors import (
    ConnectionLost,
    TransferdError,
    Unauthorized,
    UnknownCommand,
)


@async_test()
async def test_hello_reports_version_features_and_limits(url: str) -> None:
    async with await Client.connect(url) as c:
        assert c.version == (PROTO_MAJOR, PROTO_MINOR, PROTO_PATCH) == (1, 2, 0)
        assert c.minor == 2
        assert c.server.startswith("transferd/")
        assert {"batched_get", "batched_set"} <= set(c.features)
        assert c.max_body == DEFAULT_MAX_BODY
        assert c.max_payload == DEFAULT_MAX_PAYLOAD


def test_hello_reply_on_the_wire(daemon: DaemonProcess) -> None:
    with RawConn.to(daemon) as raw:
        f = raw.hello(minor=2)
        assert f.cmd == Command.HELLO and f.flags == Flag.REPLY and f.seq == 1
        assert f.payload_len == 0
        assert set(f.body) == {
            "major", "minor", "patch", "server", "features", "max_body", "max_payload",
            "max_tensors", "max_reply",
        }
        assert (f.body["major"], f.body["minor"], f.body["patch"]) == (1, 2, 0)
        assert isinstance(f.body["server"], str)
        assert all(isinstance(x, str) for x in f.body["features"])
        # The server reports its own minor, not a negotiated one.
    with RawConn.to(daemon) as raw:
        assert raw.hello(minor=1).body["minor"] == 2
    with RawConn.to(daemon) as raw:
        assert raw.hello(minor=99).body["minor"] == 2


def test_second_hello_is_refused_but_not_fatal(daemon: DaemonProcess) -> None:
    with RawConn.to(daemon) as raw:
        raw.hello()
        f = raw.request(Command.HELLO, {"major": 1, "minor": 2})
        assert f.is_error and f.body["code"] == ErrorCode.BAD_REQUEST
        f = raw.request(Command.SYNCHRONIZE)
        assert f.flags == Flag.REPLY


@async_test()
async def test_server_stats_names_every_command(url: str) -> None:
    async with await Client.connect(url) as c:
        s = await c.server_stats()
    names = set(s["commands"])
    for n in ("HELLO", "GET_DEVICES", "ALLOC_BUFFER", "FREE_BUFFER", "BUFFER_CLEAR", "SET_TENSOR",
              "GET_TENSOR", "COPY_TENSOR", "SYNCHRONIZE", "STATS", "GET_TENSORS", "SET_TENSORS"):
        assert n in names
    assert s["commands"]["HELLO"] >= 1 and s["commands"]["STATS"] >= 1
    assert s["bytes_in"] > 0 and s["bytes_out"] > 0


# -- old and new --------------------------------------------------------------------------


async def _round_trip(c: Client, n: int = 16, size: int = 4096, seed: int = 0) -> list[str]:
    """Queue n writes and n reads, flush, check each read, return the digests."""
    buf = await c.alloc_buffer(n * size)
    data = [pattern(size, seed + i) for i in range(n)]
    for i in range(n):
        c.set_tensor_async(buf.tensor(i * size, size), data[i])
    futs = [c.get_tensor_async(buf.tensor(i * size, size)) for i in range(n)]
    await c.flush()
    got = [digest(f.result()) for f in futs]
    assert got == [digest(d) for d in data]
    assert digest(await c.get_tensor(buf.tensor())) == digest(b"".join(data))
    await c.free_buffer(buf)
    return got


@async_test()
async def test_old_client_against_new_server(url: str) -> None:
    async with Client(url, max_minor=1) as old:
        assert old.version[1] == 2  # what the server said
        assert old.minor == 1  # what the client speaks
        before = old.stats()["commands"]
        got = await _round_trip(old)
        after = old.stats()["commands"]
    async with Client(url) as new:
        assert await _round_trip(new) == got
    sent = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert sent.get("GET_TENSORS", 0) == 0 and sent.get("SET_TENSORS", 0) == 0
    assert sent["SET_TENSOR"] == 16 and sent["GET_TENSOR"] == 16 + 1


@async_test()
async def test_new_client_against_minor_1_server(daemon_factory: DaemonFactory) -> None:
    old = daemon_factory(["--protocol-minor", "1"])
    async with await Client.connect(old.url) as c:
        assert c.version == (1, 1, 0)
        assert c.minor == 1
        assert c.features == []
        got = await _round_trip(c)
        stats = await c.server_stats()
        assert stats["commands"]["GET_TENSORS"] == 0 and stats["commands"]["SET_TENSORS"] == 0
        assert stats["commands"]["SET_TENSOR"] == 16
        # A minor-2 command sent anyway is refused, and the connection goes on.
        buf = await c.alloc_buffer(8)
        with pytest.raises(UnknownCommand):
            await c.conn.request(Command.GET_TENSORS, {"tensors": [[buf.id, 0, 8]]})
        with pytest.raises(UnknownCommand):
            # With a payload: it is read and thrown away, the stream stays in step.
            await c.conn.request(Command.SET_TENSORS, {"tensors": [[buf.id, 0, 8]]}, [b"x" * 8])
        assert await c.get_tensor(buf.tensor()) == bytearray(8)
        with pytest.raises(UnknownCommand):
            await c.conn.request(Command.MAIN_ADDRESS)
    async with await Client.connect(old.url) as c2:
        assert await _round_trip(c2) == got


def test_minor_2_command_on_minor_1_server_raw(daemon_factory: DaemonFactory) -> None:
    old = daemon_factory(["--protocol-minor", "1"])
    with RawConn.to(old) as raw:
        assert raw.hello().body["minor"] == 1
        f = raw.request(Command.GET_TENSORS, {"tensors": []})
        assert f.cmd == Command.GET_TENSORS and f.flags == Flag.REPLY | Flag.ERROR
        assert f.body["code"] == ErrorCode.UNKNOWN_COMMAND
        seq = raw.send(Command.SET_TENSORS, {"tensors": [[1, 0, 3]]}, b"abc", flags=Flag.NO_REPLY)
        f = raw.recv()
        # A one-way command's failure comes back as an EVENT with its seq.
        assert f.flags == Flag.EVENT | Flag.ERROR and f.seq == seq
        assert f.body["code"] == ErrorCode.UNKNOWN_COMMAND
        assert raw.request(Command.SYNCHRONIZE).flags == Flag.REPLY


def test_unknown_command_id(daemon: DaemonProcess) -> None:
    with RawConn.to(daemon) as raw:
        raw.hello()
        for cmd in (0x0B, 0x12, 0x1F, 0x40, 0xFF):
            f = raw.request(cmd)
            assert f.is_error and f.body["code"] == ErrorCode.UNKNOWN_COMMAND, cmd
            assert f.cmd == cmd
        # AUTH (0x0A) is known: on an authenticated connection it is a bad request.
        f = raw.request(Command.AUTH, {"mac": b"x" * 32})
        assert f.is_error and f.body["code"] == ErrorCode.BAD_REQUEST
        assert raw.request(Command.SYNCHRONIZE).flags == Flag.REPLY


def test_version_mismatch_closes(daemon: DaemonProcess) -> None:
    with RawConn.to(daemon) as raw:
        raw.send(Command.HELLO, {"major": PROTO_MAJOR + 1, "minor": 0, "client": "future"})
        f = raw.recv()
        assert f.flags == Flag.REPLY | Flag.ERROR and f.seq == 1
        assert f.body["code"] == ErrorCode.VERSION_MISMATCH
        assert raw.closed_by_peer()
    with RawConn.to(daemon) as raw:
        raw.send(Command.HELLO, {"major": 0, "minor": 9})
        assert raw.recv().body["code"] == ErrorCode.VERSION_MISMATCH
        assert raw.closed_by_peer()


# -- authentication: tests/integration/test_auth.py ------------------------------------------


# -- transports and context managers -------------------------------------------------------


def _socket_dir(tmp_path: Path) -> Path:
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    if len(str(tmp_path / "transferd.sock")) < 100:
        return tmp_path
    import tempfile

    return Path(tempfile.mkdtemp(prefix="td-"))


@async_test()
async def test_unix_socket(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    path = _socket_dir(tmp_path) / "transferd.sock"
    d = daemon_factory(["--unix", str(path)])
    assert d.unix_path == str(path)
    assert d.unix_url == f"unix://{path}"
    assert path.is_socket()
    async with await Client.connect(f"unix://{path}") as c:
        got = await _round_trip(c, n=8, size=100_000)
        buf = await c.alloc_buffer(64)
        await c.set_tensor(buf.tensor(), b"u" * 64)
        # TCP and Unix clients share the daemon's buffers.
        async with await Client.connect(d.url) as t:
            assert await t.get_tensor(buf.tensor()) == b"u" * 64
    assert len(got) == 8
    d.stop()
    assert not path.exists()  # removed at stop


@async_test()
async def test_unix_socket_replaces_a_stale_file(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    # What a daemon that died leaves: a socket file nothing accepts on. (A file that is
    # not a socket is refused, never removed: test_startup.py.)
    path = _socket_dir(tmp_path) / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))
    assert path.is_socket()
    d = daemon_factory(["--unix", str(path)])
    async with await Client.connect(d.unix_url or "") as c:
        assert c.version[0] == 1


@async_test()
async def test_client_as_async_context_manager(url: str) -> None:
    c = Client(url)
    async with c as same:
        assert same is c
        buf = await c.alloc_buffer(10)
        fut = c.get_tensor_async(buf.tensor())
        c.set_tensor_async(buf.tensor(), b"0123456789")
    # Leaving the block flushed the queue and closed the connection.
    assert fut.result() == bytearray(10)
    assert c.conn.lost is not None
    with pytest.raises(ConnectionLost):
        await c.get_devices()
    async with await Client.connect(url) as c2:
        assert await c2.get_tensor(buf.tensor()) == b"0123456789"
        await c2.free_buffer(buf)


def test_sync_client_context_manager(url: str) -> None:
    with SyncClient(url) as c:
        assert c.version == (1, 2, 0)
        assert c.get_devices()[0]["name"] == "cpu"
        buf = c.alloc_buffer(3 * 4096)
        data = pattern(3 * 4096, 5)
        c.set_tensor(buf.tensor(), data)
        assert digest(c.get_tensor(buf.tensor())) == digest(data)
        c.set_tensor_async(buf.tensor(0, 4096), b"\x07" * 4096)
        fut = c.get_tensor_async(buf.tensor(0, 8192))
        out = bytearray(4096)
        fut2 = c.get_tensor_async(buf.tensor(8192, 4096), out=out)
        c.flush()
        assert digest(fut.result(5)) == digest(b"\x07" * 4096 + data[4096:8192])
        assert fut2.result(5) is out and digest(out) == digest(data[8192:])
        c.copy_tensor(buf.tensor(0, 4096), buf.tensor(4096, 4096))
        c.synchronize()
        assert c.get_tensor(buf.tensor(4096, 4096)) == b"\x07" * 4096
        assert c.stats()["commands"]["SET_TENSORS"] == 1
        c.free_buffer(buf)
        with pytest.raises(TransferdError):
            c.get_tensor(buf.tensor())


def test_sync_client_connect_errors_are_raised(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(env={"TRANSFERD_SERVER_TOKEN": "x"})
    with pytest.raises(Unauthorized):
        SyncClient(d.url)
    with SyncClient.connect(d.url, token="x") as c:
        assert c.minor == 2


def test_environment_is_clean_for_daemons(monkeypatch: pytest.MonkeyPatch) -> None:
    # DaemonProcess drops the test process's TRANSFERD_* settings, adds its own.
    monkeypatch.setenv("TRANSFERD_SERVER_PORT", "1")
    d = DaemonProcess(env={"TRANSFERD_LOG_LEVEL": "debug", "HOME": None})
    assert "TRANSFERD_SERVER_PORT" not in d.env
    assert d.env["TRANSFERD_LOG_LEVEL"] == "debug"
    assert "HOME" not in d.env


def test_reply_frames_on_the_wire(daemon: DaemonProcess) -> None:
    """Replies echo cmd and seq; empty bodies are zero bytes; errors are {code, message}."""
    with RawConn.to(daemon) as raw:
        raw.hello()
        for seq in (0, 7, 0xFFFFFFFF):
            raw.send(Command.SYNCHRONIZE, seq=seq)
            f = raw.recv()
            assert (f.cmd, f.flags, f.seq) == (Command.SYNCHRONIZE, Flag.REPLY, seq)
            assert f.body_len == 0 and f.payload_len == 0 and f.body == {}
        f = raw.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 5})
        assert set(f.body) == {"buffer", "size"} and f.body["size"] == 5
        buf = f.body["buffer"]
        f = raw.request(Command.SET_TENSOR, {"tensor": [buf, 0, 5]}, payload=b"abcde")
        assert f.flags == Flag.REPLY and f.body_len == 0 and f.payload_len == 0
        f = raw.request(Command.GET_TENSOR, {"tensor": [buf, 1, 3]})
        assert f.body_len == 0 and f.payload_len == 3 and f.payload == b"bcd"
        f = raw.request(Command.GET_TENSORS, {"tensors": [[buf, 4, 1], [buf, 0, 2], [buf, 2, 0]]})
        assert f.cmd == Command.GET_TENSORS and f.body_len == 0 and f.payload == b"eab"
        # NO_REPLY: no answer; the next reply is the next request's.
        raw.send(Command.SET_TENSORS, {"tensors": [[buf, 0, 2]]}, b"XY", flags=Flag.NO_REPLY)
        f = raw.request(Command.GET_TENSOR, {"tensor": [buf, 0, 5]})
        assert f.payload == b"XYcde"
        f = raw.request(Command.GET_TENSOR, {"tensor": [buf, 3, 5]})
        assert (f.cmd, f.flags) == (Command.GET_TENSOR, Flag.REPLY | Flag.ERROR)
        assert set(f.body) == {"code", "message"} and f.body["code"] == "OUT_OF_BOUNDS"
        assert f.payload_len == 0
        f = raw.request(Command.FREE_BUFFER, {"buffer": buf})
        assert f.flags == Flag.REPLY and f.body_len == 0
