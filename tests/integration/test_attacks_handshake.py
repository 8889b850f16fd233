"""Handshake attacks on the client port that no other test tries, against a live daemon.

Each is refused (or, for the exact limit, accepted) as PROTOCOL.md says, the
daemon's resident memory stays flat, and an honest client is served during and
after: a HELLO of exactly 4096 bytes of body; bodies within 4096 bytes that are
valid-looking msgpack but nest 4000 deep or announce 2^32 elements; AUTH before
HELLO; a HELLO sent one byte at a time (slowloris) against the handshake
timeout; one source over its cap (its oldest connection gives way) while another source
still gets in.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from client import SyncClient
from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, digest, pattern, rss
from transferd.protocol import auth
from transferd.protocol.constants import PROTO_MAJOR, Command, ErrorCode, Flag
from transferd.protocol.frames import FrameDecoder, encode_frame, encode_header

MiB = 1 << 20
SECRET = "handshake-attacks-secret"


def still_works(c: SyncClient, seed: int) -> None:
    buf = c.alloc_buffer(16 * 1024)
    data = pattern(16 * 1024, seed)
    c.set_tensor(buf.tensor(), data)
    assert digest(c.get_tensor(buf.tensor())) == digest(data)
    c.free_buffer(buf)


@pytest.fixture
def secured(daemon_factory: DaemonFactory, tmp_path: Path) -> Iterator[DaemonProcess]:
    tok = tmp_path / "token"
    tok.write_text(SECRET)
    tok.chmod(0o600)
    yield daemon_factory(["--token-file", str(tok)], env={
        "TRANSFERD_SERVER_HANDSHAKE_TIMEOUT_S": "1",
        "TRANSFERD_SERVER_MAX_HANDSHAKES_PER_SOURCE": "8",
    })


def _hello_of(size: int) -> bytes:
    """An hmac-sha256 HELLO whose body is exactly ``size`` bytes (padded with a field)."""
    body = {"major": PROTO_MAJOR, "minor": 2, "client": "pad", "auth": auth.HMAC_SHA256,
            "nonce": os.urandom(auth.NONCE_SIZE), "pad": ""}
    fixed = len(msgpack.packb(body, use_bin_type=True))
    # "pad" grows from fixstr (1 header byte) to str8 (2) and str16 (3).
    for extra in (0, 1, 2):
        body["pad"] = "x" * (size - fixed - extra)
        raw = msgpack.packb(body, use_bin_type=True)
        if len(raw) == size:
            return encode_header(Command.HELLO, 0, 1, size, 0) + raw
    raise AssertionError(size)


def test_bodies_at_the_limit_and_msgpack_bombs(secured: DaemonProcess) -> None:
    with SyncClient(secured.url, token=SECRET) as good:
        still_works(good, 1)
        before = rss(secured)
        # Exactly 4096 bytes of body: read and answered (the limit is inclusive).
        with RawConn.to(secured) as raw:
            raw.send_raw(_hello_of(auth.PRE_AUTH_MAX_BODY))
            f = raw.recv()
            assert f.flags == Flag.REPLY and len(f.body["challenge"]) == 32
        bombs = {
            "4000 deep": b"\x81\xa1a" + b"\x91" * 4000 + b"\x90",
            "2^32 elements": b"\x81\xa1a\xdd\xff\xff\xff\xff" + b"\x90" * 100,
            "2^32 bytes": b"\x81\xa1a\xc6\xff\xff\xff\xff" + b"x" * 100,
            "truncated": b"\x81\xa1a\xdc\x0f\xa0" + b"\x90" * 100,
        }
        for name, body in bombs.items():
            assert len(body) <= auth.PRE_AUTH_MAX_BODY
            with RawConn.to(secured) as raw:
                raw.send_raw(encode_header(Command.HELLO, 0, 9, len(body), 0) + body)
                f = raw.recv()
                assert f.seq == 9 and f.body["code"] == ErrorCode.BAD_FRAME, (name, f.body)
                assert raw.closed_by_peer(), name
        # 4000 empty lists in 4 KiB decode fine; the HELLO they pad is still judged.
        lists = b"\x82\xa1a\xdc" + (4000).to_bytes(2, "big") + b"\x90" * 4000 + b"\xa5major\x01"
        with RawConn.to(secured) as raw:
            raw.send_raw(encode_header(Command.HELLO, 0, 3, len(lists), 0) + lists)
            assert raw.recv().body["code"] == ErrorCode.BAD_REQUEST  # no minor
            assert raw.closed_by_peer()
        # A malformed HELLO closes (protocol.md, HELLO); a second one where AUTH is due too.
        for body in ({"major": "1", "minor": 2}, {"minor": 2}, {"major": 1, "minor": -1},
                     {"major": 1, "minor": 2, "client": 5}):
            with RawConn.to(secured) as raw:
                f = raw.request(Command.HELLO, body)
                assert f.body["code"] == ErrorCode.BAD_REQUEST, (body, f.body)
                assert raw.closed_by_peer(), body
        with RawConn.to(secured) as raw:
            raw.send_raw(_hello_of(100))
            assert not raw.recv().is_error
            raw.send_raw(_hello_of(100))
            assert raw.recv().body["code"] == ErrorCode.UNAUTHORIZED
            assert raw.closed_by_peer()
        # AUTH before HELLO: NO_HELLO, from the header.
        with RawConn.to(secured) as raw:
            raw.send(Command.AUTH, {"mac": b"\0" * 32}, seq=4)
            f = raw.recv()
            assert f.seq == 4 and f.body["code"] == ErrorCode.NO_HELLO
            assert raw.closed_by_peer()
        assert rss(secured) - before < 2 * MiB
        still_works(good, 2)


def test_a_hello_one_byte_at_a_time_is_cut_off_at_the_timeout(secured: DaemonProcess) -> None:
    hello = encode_frame(Command.HELLO, 0, 1, {"major": PROTO_MAJOR, "minor": 2, "client": "slow",
                                               "auth": auth.HMAC_SHA256, "nonce": bytes(32)})
    with SyncClient(secured.url, token=SECRET) as good, RawConn.to(secured) as raw:
        t0 = time.monotonic()
        closed_at = None
        # A byte every 50 ms: the 1 s deadline runs from the connection, not the last byte.
        for i in range(len(hello) - 1):
            try:
                raw.send_raw(hello[i:i + 1])
            except OSError:
                closed_at = time.monotonic() - t0
                break
            time.sleep(0.05)
            if i % 5 == 0:
                still_works(good, i)
        if closed_at is None:
            assert raw.closed_by_peer(2)
            closed_at = time.monotonic() - t0
        assert 0.9 <= closed_at < 2.5, closed_at
        assert f"within {1:g} s" in secured.stderr or "did not arrive" in secured.stderr


def _can_bind(host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError:
            return False
    return True


@pytest.mark.skipif(not _can_bind("127.0.0.2"), reason="needs the loopback address 127.0.0.2")
def test_one_source_over_its_cap_leaves_another_source_in(secured: DaemonProcess) -> None:
    addr = secured.host_port
    idle = [socket.create_connection(addr, timeout=5) for _ in range(8)]
    try:
        time.sleep(0.2)  # all 8 accepted: 127.0.0.1 is at its cap
        with socket.create_connection(addr, timeout=5) as extra:
            # One more from 127.0.0.1 is not refused: the oldest of the 8 gives way (a
            # TIMEOUT frame naming the cap, then the close), and the newcomer is held.
            idle[0].settimeout(0.5)
            dec = FrameDecoder()
            (gone,) = dec.feed(idle[0].recv(65536))
            assert gone.body["code"] == ErrorCode.TIMEOUT and "cap per source" in \
                gone.body["message"]
            assert idle[0].recv(100) == b""
            extra.settimeout(0.2)
            with pytest.raises(TimeoutError):
                extra.recv(100)
        # 127.0.0.2 has its own count: it gets in and works.
        other = socket.socket()
        other.bind(("127.0.0.2", 0))
        other.settimeout(5)
        other.connect(addr)
        with other:
            nonce = auth.fresh_nonce()
            other.sendall(encode_frame(Command.HELLO, 0, 1, {
                "major": PROTO_MAJOR, "minor": 2, "client": "other-source",
                "auth": auth.HMAC_SHA256, "nonce": nonce}))
            dec = FrameDecoder()
            (f,) = dec.feed(other.recv(65536))
            assert f.flags == Flag.REPLY
            other.sendall(encode_frame(Command.AUTH, 0, 2, {
                "mac": auth.client_mac(SECRET.encode(), f.body["challenge"], nonce)}))
            (a,) = dec.feed(other.recv(65536))
            assert a.cmd == Command.AUTH and not a.is_error
            other.sendall(encode_frame(Command.SYNCHRONIZE, 0, 3))
            (s,) = dec.feed(other.recv(65536))
            assert s.seq == 3 and not s.is_error
    finally:
        for s in idle:
            s.close()
    assert "(the cap per source)" in secured.stderr
