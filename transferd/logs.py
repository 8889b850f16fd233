"""The daemon's log: text or JSON lines on stderr, and a flood guard.

``configure(level, fmt)`` installs one handler on the root logger.  Under
journald (``JOURNAL_STREAM`` names stderr's device and inode, as systemd sets it)
every line starts with its syslog priority, ``<N>`` (journald strips it and files
the line at that priority, so ``journalctl -p err`` finds the errors), and the
text lines carry no timestamp of their own (the journal has one).  Its
:class:`RateLimit` filter lets through at most ``burst`` records of the same
kind (logger, level, message template) per ``window_s``; the next one let
through after a window where some were dropped says how many were.  Nothing a
client or a peer does can then flood the journal, and nothing is dropped
silently.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import unicodedata
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Under journald: the journal stamps each line itself.
JOURNAL_FORMAT = "%(levelname)s %(name)s: %(message)s"
# syslog priorities (sd-daemon(3)): a record's level, rounded down to the nearest.
PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
              (logging.INFO, 6), (logging.DEBUG, 7))
# Attributes every LogRecord has; anything else was passed with extra= and is a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the extra= fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json_line(json.dumps(out, ensure_ascii=False))


def json_line(text: str) -> str:
    """A JSON text with every hostile character (HOSTILE, below) that JSON lets through
    as it is written as its ``\\uXXXX`` escape instead: the same JSON to a parser, but
    a C1 control (U+009B is a terminal's CSI), a bidi override or a line separator in
    a peer's or a client's words no longer reaches whoever reads the journal with
    ``journalctl`` or ``tail``.  (``json.dumps`` escapes C0 controls itself; outside
    strings a JSON text holds none of these.)"""
    if text.isprintable():  # the fast path: printable holds none of them
        return text
    return "".join(_json_escaped(ch) for ch in text)


def _json_escaped(ch: str) -> str:
    if unicodedata.category(ch) not in HOSTILE:
        return ch
    o = ord(ch)
    if o < 0x10000:
        return f"\\u{o:04x}"
    o -= 0x10000  # (past the BMP, JSON writes a surrogate pair)
    return f"\\u{0xD800 | (o >> 10):04x}\\u{0xDC00 | (o & 0x3FF):04x}"


def priority(levelno: int) -> int:
    """The syslog priority of a logging level (CRITICAL 2 ... DEBUG 7)."""
    for level, prio in PRIORITIES:
        if levelno >= level:
            return prio
    return 7


class JournalPrefix(logging.Formatter):
    """Wraps a formatter: ``<N>`` before every line of the record (a traceback's lines
    too, which journald would otherwise file at the default priority)."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        tag = f"<{priority(record.levelno)}>"
        return tag + self.inner.format(record).replace("\n", "\n" + tag)


def under_journald(stream: Any = None, environ: Any = None) -> bool:
    """Whether ``stream`` (stderr) is the journal's: JOURNAL_STREAM is its ``dev:inode``
    (systemd.exec(5)); a stream redirected elsewhere keeps plain lines."""
    env = os.environ if environ is None else environ
    dev, _, ino = (env.get("JOURNAL_STREAM") or "").partition(":")
    try:
        st = os.fstat((stream or sys.stderr).fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError, AttributeError):
        return False


def fatal(text: str) -> None:
    """A line on stderr that ends the process (cannot start, configuration error): at
    priority err under journald, so ``journalctl -p err`` finds why it stopped."""
    if under_journald(sys.stderr):  # every line: journald files each on its own
        text = "<3>" + text.replace("\n", "\n<3>")
    print(text, file=sys.stderr, flush=True)


# The characters a line of text never passes on as they are (the categories a published
# name may not hold, transferd/discovery/names.py): C0 and C1 controls (a line break
# starts a line of the writer's choosing; ESC, CSI: a terminal runs them), format
# characters (bidi overrides reorder the rest of a line), line and paragraph
# separators, surrogates.
HOSTILE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def escaped_char(ch: str) -> str:
    """``ch`` as it is, or a hostile one (above) as Python writes it in a repr."""
    if unicodedata.category(ch) not in HOSTILE:
        return ch
    o = ord(ch)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def one_line(text: str) -> str:
    """``text`` with every hostile character escaped, line breaks and tabs included:
    what a log line says is one line, whatever text of a peer's or a client's it holds."""
    if text.isprintable():  # the fast path: printable holds none of them
        return text
    return "".join(_BREAKS.get(ch) or escaped_char(ch) for ch in text)


_BREAKS = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


class TextFormatter(logging.Formatter):
    """The text format, with a record's trace id (``trace_fields``) after its message,
    so that ``grep TRACEID`` finds every line about a traced transfer.  The message is
    one line (:func:`one_line`): a peer's refusal, a client's field, an etcd record's
    text may hold line breaks and escapes, and written as they came they made lines of
    the journal of their sender's choosing (``...refused the handshake: no\\n2026-...
    ERROR transferd: FORGED``); a traceback after it keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        record.message = one_line(message)
        try:
            return super().formatMessage(record)
        finally:
            record.message = message

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        tid = getattr(record, "trace_id", None)
        return f"{text} [trace {tid}]" if tid else text


class RateLimit(logging.Filter):
    """At most ``burst`` records per kind per ``window_s``; counts what it drops."""

    MAX_KINDS = 4096  # a bound on the table: kinds are message templates, few in practice

    def __init__(self, burst: int = 20, window_s: float = 10.0) -> None:
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        self._lock = threading.Lock()
        # kind -> [window start, passed in window, dropped in window]
        self._kinds: dict[tuple[str, int, str], list[float]] = {}
        self.dropped_total = 0

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        with self._lock:
            st = self._kinds.get(kind)
            if st is None:
                if len(self._kinds) >= self.MAX_KINDS:
                    self._kinds.clear()
                st = self._kinds[kind] = [now, 0, 0]
            if now - st[0] >= self.window_s:
                dropped = int(st[2])
                st[:] = [now, 0, 0]
                if dropped:
                    record.suppressed = dropped
                    record.msg = f"{record.msg} [{dropped} more like this suppressed]"
            if st[1] >= self.burst:
                st[2] += 1
                self.dropped_total += 1
                return False
            st[1] += 1
            return True


def configure(level: str, fmt: str = "text", *, burst: int = 20, window_s: float = 10.0
              ) -> logging.Handler:
    """Send the root logger's records to stderr at ``level`` (any case) as ``fmt``."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_transferd", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._transferd = True  # type: ignore[attr-defined]
    journal = under_journald(sys.stderr)
    inner = JsonFormatter() if fmt == "json" else TextFormatter(
        JOURNAL_FORMAT if journal else TEXT_FORMAT)
    handler.setFormatter(JournalPrefix(inner) if journal else inner)
    handler.addFilter(RateLimit(burst, window_s))
    root.addHandler(handler)
    set_level(level)
    return handler


def set_level(level: str) -> None:
    logging.getLogger().setLevel(getattr(logging, level.upper()))


def hostport(addr: Any) -> str:
    """``host:port`` for a socket address tuple (``[v6]:port``), else ``str(addr)``."""
    if isinstance(addr, (tuple, list)) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(addr) if addr else "?"


# -- errors sent to clients ------------------------------------------------------------------

session_log = logging.getLogger("transferd.session")


def log_client_error(peer: str, exc: Any, cmd: int, seq: int | None) -> None:
    """An error reply or event sent to a client, at INFO, once per error:
    ``client HOST:PORT: CODE on COMMAND seq N: message``."""
    from transferd.protocol.constants import Command

    try:
        name = Command(cmd).name
    except ValueError:
        name = f"0x{cmd:02x}"
    code = exc.code.value
    # (No seq where the frame's header never got that far: not "seq None".)
    where = name if seq is None else f"{name} seq {seq}"
    session_log.info("client %s: %s on %s: %s", peer, code, where, exc.message,
                     extra={"client": peer, "code": code, "command": name, "seq": seq})


# -- the peer plane's warnings: one helper, so every line names the peer the same way ---------

peer_log = logging.getLogger("transferd.peer")


def trace_fields(trace: bytes | None) -> dict[str, str]:
    """A log record's ``extra`` for a transfer's trace id (26 wire bytes; {} for none):
    JSON logs get ``trace_id``, text logs show it after the message."""
    return {"trace_id": trace[1:17].hex()} if trace else {}


def peer_warning(event: str, node: int | None, rail: int, addr: Any, error: Any,
                 trace: bytes | None = None) -> None:
    """Log a peer-plane failure at WARNING: ``event: node N rail R (host:port): error``.

    ``event`` is one of a small fixed set ("peer link broken", "peer link cut",
    "transfer timed out", "peer write refused", "peer message refused"), so the rate
    limit groups them.
    JSON logs get ``peer_node``, ``rail``, ``peer_addr`` and ``code`` as fields, and
    ``trace_id`` when the transfer carried one (``trace``: its 26 wire bytes).
    """
    node_text = f"{node:016x}" if node is not None else "?"
    code = getattr(getattr(error, "code", None), "value", None)
    message = getattr(error, "message", None) or str(error)
    peer_log.warning(
        "%s: node %s rail %d (%s): %s%s", event, node_text, rail, hostport(addr),
        f"{code}: " if code else "", message,
        extra={"peer_node": node_text, "rail": rail, "peer_addr": hostport(addr),
               "code": code or "", **trace_fields(trace)},
    )


if __name__ == "__main__":  # pragma: no cover - a manual look at both formats
    configure("debug", sys.argv[1] if len(sys.argv) > 1 else "text")
    logging.getLogger("transferd.demo").info("hello %s", "world", extra={"peer": "1.2.3.4:5"})
