"""The examples of the core protocol: HELLO, buffers and tensors, and the errors."""

from __future__ import annotations

import msgpack

from capture.live import CLIENT_NAME, HELLO_BODY, TOKEN, Capture, Daemons
from capture.registry import (
    _quiet,
    _with_buffer,
    closing_example,
    example,
    hello_example,
    request_example,
    session,
)
from transferd.protocol import Command, Flag, auth, encode_frame

hello_example("HELLO", "HELLO to a minor-2 server")
hello_example("HELLO_MINOR1", "HELLO to `rpc-server --protocol-minor 1`", daemon="minor1")
hello_example(
    "HELLO_TOKEN",
    f"HELLO with a token (secret `{TOKEN}` in server.token_file; token method offered on tcp)",
    daemon="token", token=TOKEN,
)
# The client's nonce is fixed here so the example reads the same each time; the
# server's challenge (and so its proof and the client's mac) is fresh per run.
AUTH_NONCE = bytes(range(32))


@example("HELLO_AUTH", volatile=True)
def ex_hello_auth(ds: Daemons) -> Capture:
    title = (f"hmac-sha256: HELLO with a nonce, the challenge and the server's proof, then AUTH "
             f"(secret `{TOKEN}`)")
    with session(ds["token"], title, hello=False) as (c, cap):
        c.send(Command.HELLO, 1, {**HELLO_BODY, "auth": auth.HMAC_SHA256, "nonce": AUTH_NONCE})
        reply = msgpack.unpackb(c.recv()[24:])
        mac = auth.client_mac(TOKEN.encode(), reply["challenge"], AUTH_NONCE)
        c.send(Command.AUTH, 2, {"mac": mac})
        c.recv()
    return cap


request_example(
    "GET_DEVICES", "GET_DEVICES (empty body both ways but for the list)", Command.GET_DEVICES
)
request_example(
    "ALLOC_BUFFER",
    "ALLOC_BUFFER of 64 bytes on cpu",
    Command.ALLOC_BUFFER,
    {"device": "cpu", "size": 64},
)
request_example("FREE_BUFFER", "FREE_BUFFER", Command.FREE_BUFFER, lambda b: {"buffer": b})
request_example(
    "BUFFER_CLEAR",
    "BUFFER_CLEAR to 0xAB",
    Command.BUFFER_CLEAR,
    lambda b: {"buffer": b, "value": 0xAB},
)
request_example(
    "SET_TENSOR",
    "SET_TENSOR of 8 bytes at offset 0, with a reply",
    Command.SET_TENSOR,
    lambda b: {"tensor": [b, 0, 8]},
    b"01234567",
)
request_example(
    "SET_TENSOR_NO_REPLY",
    "SET_TENSOR with NO_REPLY: nothing comes back",
    Command.SET_TENSOR,
    lambda b: {"tensor": [b, 0, 4]},
    b"abcd",
    flags=Flag.NO_REPLY,
    reply=False,
    note="No frame comes back.",
)


@example("GET_TENSOR")
def ex_get(ds: Daemons) -> Capture:
    with session(ds["main"], "GET_TENSOR of 8 bytes") as (c, cap):
        b = _with_buffer(c)
        _quiet(c, Command.SET_TENSOR, 3, {"tensor": [b, 0, 8]}, b"01234567")
        c.send(Command.GET_TENSOR, 4, {"tensor": [b, 0, 8]})
        c.recv()
    return cap


request_example(
    "COPY_TENSOR",
    "COPY_TENSOR of 8 bytes within one buffer",
    Command.COPY_TENSOR,
    lambda b: {"src": [b, 0, 8], "dst": [b, 8, 8]},
)
request_example("SYNCHRONIZE", "SYNCHRONIZE", Command.SYNCHRONIZE)
request_example("STATS", "STATS on a fresh daemon that has seen one HELLO", Command.STATS)
request_example(
    "SET_TENSORS",
    "SET_TENSORS of two 4-byte tensors, NO_REPLY (as the client's flush sends it)",
    Command.SET_TENSORS,
    lambda b: {"tensors": [[b, 0, 4], [b, 16, 4]]},
    b"AAAABBBB",
    flags=Flag.NO_REPLY,
    reply=False,
    note="No frame comes back; without NO_REPLY the reply is an empty REPLY frame.",
)


@example("GET_TENSORS")
def ex_gets(ds: Daemons) -> Capture:
    with session(ds["main"], "GET_TENSORS of two 4-byte tensors") as (c, cap):
        b = _with_buffer(c)
        _quiet(c, Command.SET_TENSORS, 3, {"tensors": [[b, 0, 4], [b, 16, 4]]}, b"AAAABBBB")
        c.send(Command.GET_TENSORS, 4, {"tensors": [[b, 16, 4], [b, 0, 4]]})
        c.recv()
    return cap


# -- errors -------------------------------------------------------------------------------

request_example(
    "ERR_OUT_OF_BOUNDS",
    "GET_TENSOR past the end of a 64-byte buffer: OUT_OF_BOUNDS",
    Command.GET_TENSOR,
    lambda b: {"tensor": [b, 60, 8]},
)
request_example(
    "ERR_NOT_FOUND",
    "FREE_BUFFER of a buffer that does not exist: NOT_FOUND",
    Command.FREE_BUFFER,
    {"buffer": 999},
)
request_example(
    "ERR_BAD_REQUEST",
    "ALLOC_BUFFER without its size: BAD_REQUEST",
    Command.ALLOC_BUFFER,
    {"device": "cpu"},
)
request_example(
    "ERR_OUT_OF_MEMORY",
    "ALLOC_BUFFER of 1 TiB: OUT_OF_MEMORY",
    Command.ALLOC_BUFFER,
    {"device": "cpu", "size": 1 << 40},
)


@example("ERR_NO_REPLY_EVENT")
def ex_event(ds: Daemons) -> Capture:
    with session(
        ds["main"], "A NO_REPLY SET_TENSOR that fails: an EVENT|ERROR frame with its seq"
    ) as (c, cap):
        b = _with_buffer(c)
        c.send(Command.SET_TENSOR, 3, {"tensor": [b, 62, 4]}, b"abcd", flags=Flag.NO_REPLY)
        c.recv()
        # The connection is still open and serving.
        c.send(Command.SYNCHRONIZE, 4)
        c.recv()
    cap.note = "The connection stays open: the SYNCHRONIZE after it is answered as usual."
    return cap


request_example(
    "ERR_UNKNOWN_COMMAND",
    "GET_TENSORS to a `--protocol-minor 1` server: UNKNOWN_COMMAND",
    Command.GET_TENSORS,
    {"tensors": [[1, 0, 4]]},
    daemon="minor1",
    note="The connection stays open.",
)
closing_example(
    "ERR_NO_HELLO",
    "GET_DEVICES as the first frame: NO_HELLO, then close",
    encode_frame(Command.GET_DEVICES, 0, 1),
    hello=False,
)
closing_example(
    "ERR_VERSION_MISMATCH",
    "HELLO with major 2: VERSION_MISMATCH, then close",
    encode_frame(Command.HELLO, 0, 1, {"major": 2, "minor": 0, "client": CLIENT_NAME}),
    hello=False,
)
closing_example(
    "ERR_UNAUTHORIZED",
    "HELLO without the token the server requires: UNAUTHORIZED",
    encode_frame(Command.HELLO, 0, 1, HELLO_BODY),
    daemon="token",
    hello=False,
)
closing_example(
    "ERR_BAD_FRAME",
    "A header with a bad magic: BAD_FRAME, then close",
    b"XX" + encode_frame(Command.SYNCHRONIZE, 0, 2)[2:],
)
closing_example(
    "ERR_TOO_LARGE",
    "A header announcing a 1 TiB payload: TOO_LARGE, then close",
    encode_frame(Command.SET_TENSOR, 0, 2, None, 1 << 40),
)
