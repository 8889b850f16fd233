"""The blocks in docs/protocol.md: rendering a capture, reading one back, comparing them
modulo per-run values, and rewriting the doc's blocks."""

from __future__ import annotations

import re
import struct
from typing import Any

import msgpack

from capture.live import Capture, Wire
from capture.registry import EXAMPLES, VOLATILE
from transferd.protocol import HEADER, HEADER_SIZE, Flag, FrameDecoder, command_name
from transferd.protocol.peer import PeerCommand
from transferd.protocol.peer_wire import (
    ACK,
    SEND,
    WRITE,
    WRITE_HEAD,
    ack_error,
    frame_size,
    parse_write,
    write_table_len,
)

PEER_COMMANDS = {int(c) for c in PeerCommand}


def _flag_names(flags: int) -> str:
    names = [f.name for f in Flag if f and flags & f and f.name]
    return " ".join(str(n) for n in names) or "none"


def _hex_lines(label: str, data: bytes, width: int = 16) -> list[str]:
    out = []
    for i in range(0, max(len(data), 1), width):
        chunk = data[i : i + width]
        out.append(f"  {label if i == 0 else '':<8}{chunk.hex(' ')}")
    return out


def _show(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "nil", True: "true", False: "false"}[value]
    if isinstance(value, bytes):
        return "h'" + value.hex() + "'"
    if isinstance(value, dict):
        return "{" + ", ".join(f'"{k}": {_show(v)}' for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value + '"'
    return repr(value)


def _name(cmd: int) -> str:
    """A client command's name, or a peer-plane one's as ``PEER_WRITE``."""
    if cmd in PEER_COMMANDS:
        return f"PEER_{PeerCommand(cmd).name}"
    return command_name(cmd)


# The peer plane's data phase: fixed little-endian headers (transferd/protocol/peer_wire.py),
# split into their fields as (name, width).
_DATA_FIELDS = {
    WRITE: (("cmd", 1), ("flags", 1), ("npages", 2), ("part", 4), ("op", 8), ("rkey", 8),
            ("imm", 4), ("ext", 4), ("wid", 8), ("payload", 8)),
    ACK: (("cmd", 1), ("status", 1), ("mlen", 2), ("part", 4), ("op", 8)),
    SEND: (("cmd", 1), ("flags", 1), ("reserved", 2), ("part", 4), ("op", 8), ("payload", 8)),
}
_DATA_NAMES = {WRITE: "PEER_WRITE", ACK: "PEER_ACK", SEND: "PEER_SEND"}


def _is_data(raw: bytes) -> bool:
    return raw[:2] != b"TD" and raw[:1] in (bytes([WRITE]), bytes([ACK]), bytes([SEND]))


def _data_parts(raw: bytes) -> tuple[list[bytes], bytes, bytes, dict[str, Any]]:
    """A data-phase frame: its fixed header's fields, its table (span, pages), its
    payload (or an ACK's message), and what it says."""
    cmd = raw[0]
    fields, pos = [], 0
    values: dict[str, int] = {}
    for name, width in _DATA_FIELDS[cmd]:
        fields.append(raw[pos:pos + width])
        values[name] = int.from_bytes(raw[pos:pos + width], "little")
        pos += width
    shown: dict[str, Any] = {"op": values["op"], "part": values["part"]}
    if cmd == WRITE:
        head = WRITE_HEAD.unpack_from(raw)
        w = parse_write(raw, 0, head)
        end = 48 + write_table_len(head[1], head[2], head[7])
        shown["rkey"] = w.rkey
        if w.imm is not None:
            shown["imm"] = w.imm
        if w.wid is not None:
            shown["wid"] = w.wid
        if w.again:
            shown["again"] = True
        if w.span is not None:
            shown["span"] = list(w.span)
        shown["addrs"], shown["lens"] = w.addrs, w.lens
        return fields, raw[pos:end], raw[end:], shown
    if cmd == ACK:
        err = ack_error(values["status"], raw[pos:])
        shown.update({"ok": True} if err is None else err.to_body())
    return fields, b"", raw[pos:], shown


def _render_data(w: Wire, lines: list[str]) -> None:
    fields, table, rest, shown = _data_parts(w.raw)
    arrow = f"{w.me} -> {w.server}" if w.sent else f"{w.server} -> {w.me}"
    lines.append(f"{arrow}  {_DATA_NAMES[w.raw[0]]}  (data phase)  "
                 f"header={sum(map(len, fields)) + len(table)}  payload={len(rest)}")
    lines.append(f"  {'header':<8}" + " | ".join(f.hex(" ") for f in fields))
    if table:
        lines += _hex_lines("pages", table)
    lines.append(f"  {'':<8}= {_show(shown)}")
    if rest:
        lines += _hex_lines("message" if w.raw[0] == ACK else "payload", rest)
    if not w.sent:  # the daemon's bytes are one whole frame, as the project reads them
        assert frame_size(w.raw) == len(w.raw), "a data frame does not round-trip"


def render(cap: Capture) -> str:
    lines = [f"{cap.title}:", "", "```text"]
    for w in cap.wire:
        if _is_data(w.raw):
            _render_data(w, lines)
            lines.append("")
            continue
        magic, cmd, flags, seq, body_len, _reserved, payload_len = HEADER.unpack_from(w.raw)
        arrow = f"{w.me} -> {w.server}" if w.sent else f"{w.server} -> {w.me}"
        name = _name(cmd) if magic == b"TD" else f"cmd 0x{cmd:02x} (magic {magic!r})"
        lines.append(
            f"{arrow}  {name}  flags=0x{flags:02x} ({_flag_names(flags)})  seq={seq}  "
            f"body_len={body_len}  payload_len={payload_len}"
        )
        h = w.raw[:HEADER_SIZE]
        fields = (h[0:2], h[2:3], h[3:4], h[4:8], h[8:12], h[12:16], h[16:24])
        lines.append(f"  {'header':<8}" + " | ".join(f.hex(" ") for f in fields))
        body = w.raw[HEADER_SIZE : HEADER_SIZE + body_len] if magic == b"TD" else b""
        if body:
            lines += _hex_lines("body", body)
            lines.append(f"  {'':<8}= {_show(msgpack.unpackb(body, raw=False))}")
        payload = w.raw[HEADER_SIZE + body_len :] if magic == b"TD" else b""
        if payload:
            lines += _hex_lines("payload", payload)
        if not w.sent:
            # The daemon's bytes must parse with the project's own decoder.
            frames = FrameDecoder().feed(w.raw)
            assert len(frames) == 1 and frames[0].seq == seq, "reply does not round-trip"
        lines.append("")
    if cap.closed:
        lines.append("server closes the connection")
    elif lines[-1] == "":
        lines.pop()
    lines.append("```")
    if cap.note:
        lines += ["", cap.note]
    return "\n".join(lines)


# -- reading a block back, and comparing modulo per-run values ---------------------------

CLOSED_LINE = "server closes the connection"
SENDERS = ("client", "peer")  # the ends this script plays


def parse(block: str) -> Capture:
    """The capture a rendered block shows, rebuilt from its hex lines."""
    lines = block.split("\n")
    if not lines or not lines[0].endswith(":") or "```text" not in lines:
        raise ValueError("not a rendered example")
    cap = Capture(lines[0][:-1])
    start = lines.index("```text") + 1
    end = lines.index("```", start)
    rest = lines[end + 1 :]
    cap.note = "\n".join(rest[1:]) if rest else ""
    raw: list[bytearray] = []  # each frame's bytes: header, body, payload in order
    for line in lines[start:end]:
        if not line:
            continue
        if line == CLOSED_LINE:
            cap.closed = True
        elif not line.startswith("  "):
            left, right = line.split("  ")[0].split(" -> ")
            sent = left in SENDERS
            cap.wire.append(Wire(sent, b"", right if sent else left, left if sent else right))
            raw.append(bytearray())
        else:
            data = line[10:]
            if not data.startswith("= "):
                raw[-1] += bytes.fromhex(data.replace("|", " "))
    for w, r in zip(cap.wire, raw, strict=True):
        w.raw = bytes(r)
    return cap


class Canon:
    """Renames per-run values (node ids, ports, rkeys, addresses) in first-seen order."""

    HEXWORD = re.compile(r"\b(?:0x)?[0-9a-f]{8,}\b|:\d{2,5}\b")

    def __init__(self) -> None:
        self.names: dict[tuple[str, Any], str] = {}

    def name(self, kind: str, value: Any) -> str:
        key = (kind, value)
        if key not in self.names:
            n = sum(1 for k in self.names if k[0] == kind) + 1
            self.names[key] = f"<{kind}{n}>"
        return self.names[key]

    def netaddr(self, raw: bytes) -> Any:
        try:
            fmt, node, group, rails = msgpack.unpackb(raw, raw=False)
            if fmt == 1:
                return ["NetAddr", self.name("node", node), group,
                        [[h, self.name("port", p)] for h, p in rails]]
            if fmt != 2 or not all(isinstance(r, bytes) for r in rails):
                return None
            # Format 2: each rail is its Domain's address bytes (tcp: b"host:port").
            return ["NetAddr", self.name("node", node), group,
                    [self.HEXWORD.sub(lambda m: ":" + self.name("port", m.group(0)[1:]),
                                      r.decode(errors="replace")) for r in rails]]
        except Exception:
            return None

    def mrdesc(self, v: list[Any]) -> Any:
        if len(v) != 3 or not all(type(x) is int for x in v[:2]) or not isinstance(v[2], list):
            return None
        rkeys = []
        for item in v[2]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], bytes)):
                return None
            addr = self.netaddr(item[0])
            if addr is None:
                return None
            rkeys.append([addr, self.name("rkey", item[1])])
        return ["MrDesc", self.name("ptr", v[0]), v[1], rkeys]

    # The peer handshake's per-link randomness and what is computed from it.
    FRESH = ("nonce", "challenge", "proof", "mac", "token")

    def value(self, v: Any, key: str = "") -> Any:
        if isinstance(v, bytes) and key in self.FRESH:
            return self.name(key, v)
        if isinstance(v, bytes):
            addr = self.netaddr(v)
            if addr is None and key == "addrs":  # a peer's rail address ("host:port")
                return self.HEXWORD.sub("<n>", v.decode(errors="replace"))
            return v if addr is None else addr
        if isinstance(v, dict):
            return {k: self.value(x, k) for k, x in v.items()}
        if isinstance(v, list):
            desc = self.mrdesc(v)
            if desc is not None:
                return desc
            if key == "from" and len(v) == 2:
                return [self.name("node", v[0]), v[1]]
            if key == "addrs" and all(type(x) is int for x in v):
                return [self.name("addr", x) for x in v]
            if key == "span" and len(v) == 2 and all(type(x) is int for x in v):
                return [self.name("addr", v[0]), v[1]]
            return [self.value(x, key) for x in v]
        if type(v) is int and key in ("node", "rkey"):
            return self.name(key, v)
        if isinstance(v, str) and key == "message":
            return self.HEXWORD.sub("<n>", v)
        return v


def signature(cap: Capture) -> Any:
    """What a capture shows, with every per-run value renamed."""
    canon = Canon()
    frames = []
    for w in cap.wire:
        if _is_data(w.raw):
            _fields, _table, rest, shown = _data_parts(w.raw)
            # The header's own bytes are what it shows; only per-run values are renamed.
            frames.append((w.sent, w.me, w.server, "data", w.raw[0], canon.value(shown),
                           b"" if w.raw[0] == ACK else rest))
            continue
        magic, cmd, flags, seq, body_len, reserved, _ = HEADER.unpack_from(w.raw)
        body = w.raw[HEADER_SIZE : HEADER_SIZE + body_len]
        decoded = msgpack.unpackb(body, raw=False) if body else None
        frames.append((w.sent, w.me, w.server, magic, cmd, flags, seq, reserved,
                       canon.value(decoded), w.raw[HEADER_SIZE + body_len :]))
    return cap.title, cap.note, cap.closed, frames


def same(block: str, fresh: Capture) -> bool:
    """Whether a volatile example's block in the doc still shows what ``fresh`` does."""
    try:
        shown = parse(block)
        # The block must agree with its own bytes (nobody edited the text by hand) ...
        if render(shown) != block:
            return False
    except (ValueError, AssertionError, IndexError, struct.error):
        return False
    # ... and show the same frames as today's daemon, per-run values aside.
    return signature(shown) == signature(fresh)


BLOCK = re.compile(r"(<!-- capture:(\w+) -->\n)(.*?)(<!-- /capture -->)", re.S)


def rewrite(text: str, captures: dict[str, Capture]) -> str:
    """The doc with every captured block brought up to date.

    A volatile example's block is kept as it is while it still shows the same
    frames (only per-run values differ), so the doc does not churn.
    """

    def sub(m: re.Match[str]) -> str:
        name = m.group(2)
        if name not in EXAMPLES:
            raise SystemExit(f"docs/protocol.md names an unknown example {name!r}")
        if name not in captures:
            return m.group(0)
        old = m.group(3)[:-1] if m.group(3).endswith("\n") else m.group(3)
        if name in VOLATILE and same(old, captures[name]):
            return m.group(0)
        return f"{m.group(1)}{render(captures[name])}\n{m.group(4)}"

    return BLOCK.sub(sub, text)
