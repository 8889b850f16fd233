"""A server that does not know the secret, met by a client that holds one (issue 16, item 4).

Before: a client with a secret took any HELLO reply that omitted ``auth`` (or listed it
without a challenge and proof) as "no authentication needed", went on, and sent the
impostor its requests and its tensor bytes.  Now the client refuses it (UNAUTHORIZED
naming the address) before anything else goes out, and never sends the token over plain
tcp://.  The impostor here is a real socket server speaking the wire protocol; a real
daemon with the secret is accepted by the same client.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from client import Client
from tests.conftest import DaemonFactory
from tests.helpers import async_test, digest, pattern
from transferd.protocol.constants import PROTO_MAJOR, Command, Flag
from transferd.protocol.errors import BadRequest, Unauthorized
from transferd.protocol.frames import Frame, FrameDecoder, encode_frame

SECRET = "impostor-test-secret"
GOOD_REPLY = {"major": PROTO_MAJOR, "minor": 2, "patch": 0, "server": "impostor",
              "features": [], "max_body": 1 << 22, "max_payload": 1 << 34}


@dataclass
class Impostor:
    """Answers every HELLO with ``reply`` (and any other request with an empty reply),
    and records every frame it is sent after the HELLO."""

    reply: dict[str, Any]
    sock: socket.socket = field(default_factory=socket.socket)
    after_hello: list[Frame] = field(default_factory=list)
    hellos: list[Frame] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(10)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        conn.settimeout(2)
        dec = FrameDecoder()
        with conn:
            try:
                while True:
                    data = conn.recv(1 << 16)
                    if not data:
                        return
                    for f in dec.feed(data):
                        if f.cmd == Command.HELLO and not self.hellos:
                            self.hellos.append(f)
                            conn.sendall(encode_frame(Command.HELLO, Flag.REPLY, f.seq,
                                                      self.reply))
                        else:
                            self.after_hello.append(f)
                            conn.sendall(encode_frame(f.cmd, Flag.REPLY, f.seq))
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        self._thread.join(5)


@pytest.fixture
def impostor(request: pytest.FixtureRequest) -> Iterator[Impostor]:
    imp = Impostor(request.param)
    yield imp
    imp.close()


@pytest.mark.parametrize("impostor", [
    GOOD_REPLY,  # omits auth: "nothing is required here"
    {**GOOD_REPLY, "auth": ["hmac-sha256"]},  # lists it, no challenge, no proof
    {**GOOD_REPLY, "auth": ["hmac-sha256"], "challenge": b"c" * 32},  # no proof
    {**GOOD_REPLY, "auth": ["hmac-sha256", "token"]},
], indirect=True, ids=["no-auth", "auth-without-challenge", "challenge-without-proof",
                       "both-methods-no-proof"])
@async_test()
async def test_a_client_with_a_secret_refuses_a_server_that_proves_nothing(
    impostor: Impostor,
) -> None:
    with pytest.raises(Unauthorized) as err:
        c = await Client.connect(impostor.url, token=SECRET, connect_timeout=5)
        # Before: connected; its writes and their tensor bytes went to the impostor.
        buf = await c.alloc_buffer(4096)
        await c.set_tensor(buf.tensor(), pattern(4096, 1))
        await c.close()
    assert impostor.url in str(err.value)
    # The HELLO went out (it carries a fresh nonce, nothing derived from the secret);
    # nothing after it did: no AUTH, no request, no tensor byte.
    assert len(impostor.hellos) == 1 and "token" not in impostor.hellos[0].body
    assert impostor.after_hello == []


@pytest.mark.parametrize("impostor", [{**GOOD_REPLY, "auth": ["token"]}], indirect=True)
@async_test()
async def test_the_token_never_crosses_plain_tcp(impostor: Impostor) -> None:
    with pytest.raises(BadRequest, match="token method would send the secret in clear"):
        await Client.connect(impostor.url, token=SECRET, auth="token", connect_timeout=5)
    # Not even the HELLO went out.
    assert impostor.hellos == [] and impostor.after_hello == []


@async_test()
async def test_a_daemon_that_knows_the_secret_is_accepted_and_one_without_is_not(
    daemon_factory: DaemonFactory, tmp_path: Path,
) -> None:
    tok = tmp_path / "token"
    tok.write_text(SECRET)
    tok.chmod(0o600)
    where = tmp_path / "s"
    where.mkdir()
    d = daemon_factory(["--token-file", str(tok), "--unix", f"{where}/u.sock"])
    async with await Client.connect(d.url, token=SECRET) as c:
        buf = await c.alloc_buffer(4096)
        data = pattern(4096, 2)
        await c.set_tensor(buf.tensor(), data)
        assert digest(await c.get_tensor(buf.tensor())) == digest(data)
    # The token method where the transport keeps it private, and the daemon lists it.
    async with await Client.connect(d.unix_url or "", token=SECRET, auth="token") as c:
        assert c.minor == 2
    plain = daemon_factory()
    with pytest.raises(Unauthorized, match=plain.url):
        await Client.connect(plain.url, token=SECRET)
