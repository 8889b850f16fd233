"""The wire protocol, sans-IO: bytes in, frames out; no sockets, no asyncio."""

from .constants import (
    COMMAND_MINOR,
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_PAYLOAD,
    HEADER_SIZE,
    MAGIC,
    PROTO_MAJOR,
    PROTO_MINOR,
    PROTO_PATCH,
    Command,
    ErrorCode,
    Flag,
    command_name,
)
from .errors import *  # noqa: F403 - the hierarchy is part of this package's API
from .errors import TransferdError, error_from_body
from .frames import (
    DISCARD,
    HEADER,
    Frame,
    FrameDecoder,
    decode_header,
    encode_frame,
    encode_header,
    pack_body,
)
from .messages import Tensor, tensor_from_wire

__all__ = [
    "COMMAND_MINOR",
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_PAYLOAD",
    "DISCARD",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "PROTO_MAJOR",
    "PROTO_MINOR",
    "PROTO_PATCH",
    "Command",
    "ErrorCode",
    "Flag",
    "Frame",
    "FrameDecoder",
    "Tensor",
    "TransferdError",
    "command_name",
    "decode_header",
    "encode_frame",
    "encode_header",
    "error_from_body",
    "pack_body",
    "tensor_from_wire",
]
