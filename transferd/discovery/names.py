"""The rules a name and a prefix follow, and the directory's bounds.

A name is 1 to :data:`MAX_NAME` bytes of UTF-8 without control, format or
line-separator characters (Unicode categories Cc, Cf, Zl, Zp, Cs: C0 and C1
controls, DEL, NEL, bidi overrides, zero-width and BOM characters, U+2028 and
U+2029), so it can be a key in etcd, a line in ``transferd names`` and a log
field as it is, and reads as what it is; a prefix is the same, or empty (every
name).  Everything a directory
holds is bounded by :class:`Limits` (``[discovery]`` keys).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

from transferd.protocol.errors import BadRequest

MAX_NAME = 256


def check_text(text: Any, what: str, most: int = MAX_NAME, empty: bool = True) -> str:
    """``text`` if it is a string of at most ``most`` bytes that holds none of the refused
    characters; BadRequest otherwise.  Names follow it, and so does every string of a node
    record another daemon wrote (its rails, URLs, server), so that what PEERS serves is
    as safe to print as a name."""
    if not isinstance(text, str):
        raise BadRequest(f"field {what!r} must be a string")
    if not text and not empty:
        raise BadRequest(f"field {what!r} must not be empty")
    n = len(text.encode())
    if n > most:
        raise BadRequest(f"{what} of {n} bytes is over {most}")
    if not text.isprintable():  # fast path: printable is none of the refused but Zs
        for ch in text:
            cat = unicodedata.category(ch)
            if cat in _REFUSED:
                raise BadRequest(f"{what} {text!r} holds a {_REFUSED[cat]} character "
                                 f"(U+{ord(ch):04X})")
    return text


# The categories a name may not hold (those a log line or a listing escapes,
# transferd.logs.HOSTILE), and what to call them in a message.
_REFUSED = {"Cc": "control", "Cf": "format (invisible)", "Zl": "line separator",
            "Zp": "paragraph separator", "Cs": "surrogate"}


def check_name(name: Any) -> str:
    return check_text(name, "name", empty=False)


def check_prefix(prefix: Any) -> str:
    return check_text(prefix, "prefix")


@dataclass(frozen=True)
class Limits:
    """What one daemon's directory holds at most (docs/configuration.md, [discovery])."""

    # Names published through this daemon, all owners together; per owner.
    max_names: int = 16384
    max_names_per_owner: int = 1024
    # A value's bytes (an MrDesc of 4 rails is about 200).
    max_value_bytes: int = 4096
    # Names of the whole cluster this daemon mirrors, and node records.
    max_cluster_names: int = 65536
    max_nodes: int = 1024
    # WATCH subscriptions per connection and per daemon.
    max_watches_per_connection: int = 64
    max_watches: int = 1024
    # NAMES replies list at most this many names.
    max_listing: int = 10000
