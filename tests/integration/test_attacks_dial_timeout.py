"""A peer whose rail takes no new connection (its accept queue full: the SYN goes
unanswered): the dial times out, and the transfer's error said why with nothing (the
TimeoutError has no text: ``rail 0: cannot connect to 127.0.0.1:PORT: ``).  Now it
says ``timed out``, as the client library's connect and the operator commands do."""

from __future__ import annotations

import contextlib
import secrets
import socket

from client import MrDesc, NetAddr
from tests.conftest import DaemonFactory
from tests.helpers import RawConn
from tests.integration.engine_cluster import engine_env
from transferd.domains.rails import rail_bytes
from transferd.protocol.constants import Command


def test_a_dial_that_times_out_says_timed_out(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(env=engine_env(["127.0.0.1"], rail_timeout_s=1))
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    fillers = []
    try:
        for _ in range(4):  # the accept queue full: later SYNs are dropped
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(full.getsockname())
            fillers.append(s)
        c = RawConn.to(d, timeout=30)
        c.hello()
        buf = c.request(Command.ALLOC_BUFFER, {"size": 4096}).body["buffer"]
        mr = c.request(Command.REG_MR, {"buffer": buf}).body["mr"]
        addr = NetAddr(secrets.randbits(62) + 1, 0, (rail_bytes(*full.getsockname()),))
        desc = MrDesc(0x10000, [(addr, 0x1234)], 4096)
        f = c.request(Command.SINGLE_WRITE, {"len": 16, "imm": None, "src": [mr, 0],
                                             "dst": [desc.to_wire(), 0]})
        if not f.is_error:
            f = c.recv()  # its EVENT
        assert f.is_error and f.body["code"] == "PEER_UNREACHABLE", f
        port = full.getsockname()[1]
        assert f.body["message"].endswith(f"cannot connect to 127.0.0.1:{port}: timed out"), f
    finally:
        for s in fillers:
            s.close()
        full.close()
