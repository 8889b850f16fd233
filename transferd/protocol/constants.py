"""Protocol numbers from PROTOCOL.md: versions, frame flags, commands, limits."""

from __future__ import annotations

import enum

PROTO_MAJOR = 1
PROTO_MINOR = 2
PROTO_PATCH = 0

MAGIC = b"TD"
HEADER_SIZE = 24

# What a server announces unless configured otherwise.  Bodies are small maps
# (a GET_TENSORS of thousands of tensors still fits); payloads carry bulk data.
DEFAULT_MAX_BODY = 4 * 1024 * 1024
DEFAULT_MAX_PAYLOAD = 1 << 34  # 16 GiB

# What a client accepts from a server before it has seen HELLO: the HELLO
# reply itself is small, so anything bigger is garbage.
HELLO_MAX_BODY = 64 * 1024


class Flag(enum.IntFlag):
    NONE = 0
    REPLY = 0x01
    ERROR = 0x02
    EVENT = 0x04
    NO_REPLY = 0x08


KNOWN_FLAGS = Flag.REPLY | Flag.ERROR | Flag.EVENT | Flag.NO_REPLY


class Command(enum.IntEnum):
    HELLO = 0x00
    GET_DEVICES = 0x01
    ALLOC_BUFFER = 0x02
    FREE_BUFFER = 0x03
    BUFFER_CLEAR = 0x04
    SET_TENSOR = 0x05
    GET_TENSOR = 0x06
    COPY_TENSOR = 0x07
    SYNCHRONIZE = 0x08
    STATS = 0x09
    AUTH = 0x0A
    GET_TENSORS = 0x10
    SET_TENSORS = 0x11
    # Transfer engine, minor 2 (documented in docs/protocol.md).
    MAIN_ADDRESS = 0x20
    REG_MR = 0x21
    DEREG_MR = 0x22
    SINGLE_WRITE = 0x23
    PAGED_WRITES = 0x24
    EXPECT_IMM_COUNT = 0x25
    ADD_PEER_GROUP = 0x26
    SCATTER = 0x27
    BARRIER = 0x28
    SEND = 0x29
    SUBMIT_RECVS = 0x2A
    ALLOC_UVM_WATCHER = 0x2B
    IMM_COUNT = 0x2C
    # Owners and deadlines (docs/protocol.md): served with or without the engine.
    LEASE = 0x2D
    END_LEASE = 0x2E
    CANCEL = 0x2F
    # Names (discovery, docs/protocol.md): served with or without the engine; HELLO
    # lists "names".
    PUBLISH = 0x30
    LOOKUP = 0x31
    UNPUBLISH = 0x32
    WATCH = 0x33
    PEERS = 0x34
    NAMES = 0x35
    # One-sided reads (docs/protocol.md): HELLO lists "read".
    SINGLE_READ = 0x36
    PAGED_READS = 0x37
    GATHER = 0x38
    # A paged write armed on a UVM watcher, fired by the daemon (docs/protocol.md): HELLO
    # lists "armed_writes".
    ARM_PAGED_WRITES = 0x39
    EVENT = 0x3F


ENGINE_RANGE = range(0x20, 0x40)

# The minor in which each command first appeared.
COMMAND_MINOR: dict[Command, int] = {c: (2 if c >= Command.GET_TENSORS else 1) for c in Command}


def command_name(cmd: int) -> str:
    """The command's name as PROTOCOL.md spells it, or ``0xNN`` when unknown."""
    try:
        return Command(cmd).name
    except ValueError:
        return f"0x{cmd:02X}"


# Rails of one domain group, the most a peer address or an MrDesc lists (one rkey per
# rail): the peer handshake, NetAddr and MrDesc refuse more before reading any.
MAX_RAILS = 16


class ErrorCode(enum.StrEnum):
    BAD_FRAME = "BAD_FRAME"
    TOO_LARGE = "TOO_LARGE"
    NO_HELLO = "NO_HELLO"
    VERSION_MISMATCH = "VERSION_MISMATCH"
    UNAUTHORIZED = "UNAUTHORIZED"
    UNKNOWN_COMMAND = "UNKNOWN_COMMAND"
    BAD_REQUEST = "BAD_REQUEST"
    NOT_FOUND = "NOT_FOUND"
    OUT_OF_BOUNDS = "OUT_OF_BOUNDS"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    PEER_UNREACHABLE = "PEER_UNREACHABLE"
    TIMEOUT = "TIMEOUT"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
