"""Text of a peer's, in the daemon's journal: one line, whatever it holds.

A daemon dials whatever address a client's NetAddr or MrDesc names for a new peer.
What listens there need prove nothing to refuse the handshake: its HELLO reply with
ERROR carries a message of its choosing, and that message ended up, as it came, in the
daemon's ``peer link broken`` WARNING.  A message with line breaks wrote lines of the
listener's choosing into the journal (``2026-... ERROR transferd: FORGED``), an ESC
sequence ran on the terminal of whoever read it.  Now every text log line's message
is one line: line breaks, ESC, bidi and separator characters written escaped
(``\\n``, ``\\x1b``, ``\\u2028``); a traceback after a message keeps its own lines.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import threading
from collections.abc import Iterator

import pytest

from client import MrDesc, NetAddr
from tests.helpers import DaemonProcess, async_test, wait_until
from tests.integration.engine_cluster import RAILS, WAIT, engine_env, nodes, start_many
from tests.integration.test_engine_reads import region
from transferd.domains.rails import rail_bytes
from transferd.protocol.constants import Flag
from transferd.protocol.errors import TransferdError
from transferd.protocol.frames import FrameDecoder, encode_frame

# Lines of the daemon's own log, as the listener would like them read.
FORGED = ("no\n2026-01-01 00:00:00,000 ERROR transferd: FORGED line\r\n<3>ERROR "
          "transferd: FORGED too\x1b[2K\u2028\u202eFORGED\x9b2Jlast")


class Refuser:
    """Two listeners (a node's two rails) that answer every HELLO with an ERROR reply
    whose message is FORGED, and prove nothing."""

    def __init__(self) -> None:
        self.listeners = []
        self.refused = 0
        self._stop = threading.Event()
        for _ in range(2):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(8)
            s.settimeout(0.2)
            self.listeners.append(s)
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def desc(self) -> MrDesc:
        node = secrets.randbits(62) + 1
        return MrDesc(0x10000, [(NetAddr(node, 0, (rail_bytes(*s.getsockname()),)), 0x1234)
                                for s in self.listeners], 1 << 16)

    def _serve(self, lst: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = lst.accept()
            except (TimeoutError, OSError):
                continue
            with sock, contextlib.suppress(OSError):
                sock.settimeout(5)
                decoder, frames = FrameDecoder(), []
                while not frames:
                    data = sock.recv(65536)
                    if not data:
                        break
                    frames = decoder.feed(data)
                if frames:
                    hello = frames[0]
                    sock.sendall(encode_frame(hello.cmd, Flag.REPLY | Flag.ERROR, hello.seq,
                                              {"code": "BAD_REQUEST", "message": FORGED}))
                    self.refused += 1
                    sock.recv(1)

    def close(self) -> None:
        self._stop.set()
        for s in self.listeners:
            s.close()


@pytest.fixture(params=["text", "json"])
def reader(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    env = engine_env(RAILS["a"])
    env["TRANSFERD_LOG_FORMAT"] = request.param
    (d,) = start_many([{"env": env}])
    yield d
    d.stop()


@async_test(timeout=60)
async def test_a_peers_refusal_text_is_one_line_of_the_log(reader: DaemonProcess) -> None:
    """The refusal fails the read (the client gets the peer's words as they were said),
    and the daemon's journal holds them escaped in its one WARNING line: no line of the
    log starts with what the listener wrote, no ESC or separator reaches it; the daemon
    serves on."""
    liar = Refuser()
    try:
        async with nodes(reader) as (a,):
            dst = await region(a, 1 << 16, seed=3)
            r = await a.client.submit_single_read(4096, (dst.mr, 0), (liar.desc(), 0))
            with pytest.raises(TransferdError, match="refused the handshake") as got:
                await r.wait(WAIT)
            assert "FORGED line" in got.value.message  # the client hears what was said
            assert wait_until(lambda: "FORGED too" in reader.stderr, 5), reader.output()
            err = reader.stderr
            lines = err.splitlines()
            assert not [ln for ln in lines if "FORGED" in ln and "peer link broken" not in ln
                        ], err[-2000:]
            assert not {"\x1b", "\u2028", "\u202e", "\x9b"} & set(err)
            assert "no\\n2026-01-01 00:00:00,000 ERROR transferd: FORGED line\\r\\n<3>" in err
            if reader.env.get("TRANSFERD_LOG_FORMAT") == "json":
                # The same escapes, JSON's own: a parser reads the words as they were said.
                assert "\\u001b[2K\\u2028\\u202eFORGED\\u009b2Jlast" in err
                said = [r["msg"] for r in map(json.loads, lines) if "FORGED" in r["msg"]]
                assert said and FORGED in said[0], said
            else:
                assert "\\x1b[2K\\u2028\\u202eFORGED\\x9b2Jlast" in err
            # The daemon serves on.
            other = await a.client.alloc_buffer(4096)
            await a.client.set_tensor(other.tensor(), b"\x5a" * 4096)
            assert bytes(await a.client.get_tensor(other.tensor())) == b"\x5a" * 4096
    finally:
        liar.close()
    assert "Traceback" not in reader.stderr, reader.output()
