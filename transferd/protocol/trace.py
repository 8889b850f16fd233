"""W3C trace context (``traceparent``) as a value: checked text, and 26 bytes on the wire.

A request may carry a ``traceparent`` (https://www.w3.org/TR/trace-context/):
``VERSION-TRACEID-PARENTID-FLAGS``, 2, 32, 16 and 2 lowercase hex digits.  The
daemon keeps it with the transfer, puts it in the peer frames (the WRITE's
extension block, :mod:`.peer_ext`) and in every log record about the transfer.
Version ``ff`` is forbidden, an all-zero trace or parent id is invalid; a later
version's extra fields (after a ``-``) are allowed and dropped, as the spec says.
"""

from __future__ import annotations

import re

from .errors import BadRequest

# version u8, trace id 16 bytes, parent id 8 bytes, flags u8.
WIRE_LEN = 26
_RE = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\Z")
_ZERO_TRACE = "0" * 32
_ZERO_PARENT = "0" * 16


def parse(text: object) -> bytes:
    """The 26 wire bytes of a ``traceparent``; BadRequest (naming what is wrong) else."""
    if not isinstance(text, str) or len(text) > 512:
        raise BadRequest("field 'traceparent' must be a W3C traceparent string "
                         "(00-<32 hex>-<16 hex>-<2 hex>)")
    m = _RE.match(text.strip())
    if m is None:
        raise BadRequest(f"traceparent {text[:80]!r} is not VERSION-TRACEID-PARENTID-FLAGS "
                         "(2, 32, 16, 2 lowercase hex digits)")
    version, trace, parent, flags, rest = m.groups()
    if version == "ff":
        raise BadRequest("traceparent version ff is forbidden")
    if version == "00" and rest:
        raise BadRequest("a version 00 traceparent has exactly four fields")
    if trace == _ZERO_TRACE or parent == _ZERO_PARENT:
        raise BadRequest("traceparent: an all-zero trace id or parent id is invalid")
    return bytes.fromhex(version + trace + parent + flags)


def format(raw: bytes | bytearray | memoryview) -> str:
    """The text form of 26 wire bytes (BadRequest if they are not a valid one)."""
    raw = bytes(raw)
    if len(raw) != WIRE_LEN:
        raise BadRequest(f"a trace id on the wire is {WIRE_LEN} bytes, not {len(raw)}")
    h = raw.hex()
    text = f"{h[0:2]}-{h[2:34]}-{h[34:50]}-{h[50:52]}"
    parse(text)
    return text


def trace_id(raw: bytes | None) -> str:
    """The 32-hex trace id of 26 wire bytes ("" for none): what logs and inflight show."""
    return raw[1:17].hex() if raw else ""


__all__ = ["WIRE_LEN", "format", "parse", "trace_id"]
