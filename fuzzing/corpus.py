"""The seed corpus: the captured frames of docs/protocol.md, one directory per target.

Every example in docs/protocol.md (between ``<!-- capture:NAME -->`` markers) is real
traffic with a daemon, shown as hex.  This reads them back with the same parser
``docs/tools/capture_frames.py --check`` uses, checks that each frame decodes with the
project's decoder, and writes what each target takes:

=====================  ==============================================================
``decoder``            every frame alone, and each connection's frames as one stream
                       (a few requests are hostile on purpose: they show a refusal)
``server_connection``  what a client sent on one connection (HELLO first)
``client_connection``  what a server sent on one connection
``dispatch``           what a client sent after its HELLO (the harness says HELLO), and
                       the whole connection, HELLO and AUTH included
``peer_handshake``     a role byte (0 initiator, 1 responder) and the peer-plane frames
                       the other end sent
``peer_headers``       an end byte (0 inbound, 1 outbound) and the data-phase frames
                       the other end sent on one peer link (WRITE, SEND; ACK)
=====================  ==============================================================

    python -m fuzzing.corpus [--out .fuzz/corpus]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import defaultdict
from pathlib import Path

from transferd.protocol.constants import Command
from transferd.protocol.errors import TransferdError
from transferd.protocol.frames import HEADER, FrameDecoder
from transferd.protocol.peer import PeerCommand
from transferd.protocol.peer_wire import frame_size

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "protocol.md"
TARGETS = ("decoder", "server_connection", "client_connection", "dispatch",
           "peer_handshake", "peer_headers")
PEER = {int(c) for c in PeerCommand}
# The first byte of a data-phase frame (no 24-byte header: peer_wire).
DATA = {bytes([int(c)]) for c in (PeerCommand.WRITE, PeerCommand.ACK, PeerCommand.SEND)}


def _parse_blocks(text: str) -> list[tuple[str, object]]:
    sys.path.insert(0, str(REPO / "docs" / "tools"))
    try:
        from capture.blocks import BLOCK, parse
    finally:
        sys.path.pop(0)
    return [(m.group(2), parse(m.group(3).strip("\n"))) for m in BLOCK.finditer(text)]


def seeds(doc: Path = DOC) -> dict[str, dict[str, bytes]]:
    """target -> {file name: input}; raises ValueError naming a frame that does not decode."""
    out: dict[str, dict[str, bytes]] = defaultdict(dict)
    for name, cap in _parse_blocks(doc.read_text()):
        # One connection per (who, to whom): "client -> daemon A" and "... B" are two.
        conns: dict[str, list[tuple[bool, bytes]]] = defaultdict(list)
        data: dict[str, list[tuple[bool, bytes]]] = defaultdict(list)
        for i, w in enumerate(cap.wire):  # type: ignore[attr-defined]
            raw = bytes(w.raw)
            if raw[:2] != b"TD" and raw[:1] in DATA:  # the peer plane's data phase
                frame_size(raw)  # raises BAD_FRAME for what is not one of its frames
                data[w.server].append((w.sent, raw))
                continue
            _magic, cmd, _f, seq, _body_len, _r, _payload_len = HEADER.unpack_from(raw)
            try:
                frames = FrameDecoder(max_body=1 << 24, max_payload=1 << 34).feed(raw)
                ok = len(frames) == 1 and frames[0].seq == seq
            except TransferdError:
                # Some examples show a hostile request and its refusal; what a daemon
                # sent back must always decode.
                ok = w.sent
            if not ok:
                raise ValueError(f"{name}: frame {i} (cmd 0x{cmd:02x}) does not decode")
            out["decoder"][f"{name}-{i}"] = raw
            conns[w.server].append((w.sent, raw))
        for who, wires in data.items():
            tag = f"{name}-{who.replace(' ', '_')}"
            out["peer_headers"][f"{tag}-inbound"] = b"\x00" + b"".join(
                r for s, r in wires if s)
            out["peer_headers"][f"{tag}-outbound"] = b"\x01" + b"".join(
                r for s, r in wires if not s)
        for who, wires in conns.items():
            tag = f"{name}-{who.replace(' ', '_')}"
            sent = b"".join(r for s, r in wires if s)
            got = b"".join(r for s, r in wires if not s)
            out["decoder"][f"{tag}-stream"] = sent
            peer = [r for _s, r in wires if HEADER.unpack_from(r)[1] in PEER]
            if peer:
                out["peer_handshake"][f"{tag}-responder"] = b"\x01" + b"".join(
                    r for s, r in wires if s and HEADER.unpack_from(r)[1] in PEER)
                out["peer_handshake"][f"{tag}-initiator"] = b"\x00" + b"".join(
                    r for s, r in wires if not s and HEADER.unpack_from(r)[1] in PEER)
                continue
            out["server_connection"][tag] = sent
            out["client_connection"][tag] = got
            first = HEADER.unpack_from(sent)[1] if sent else None
            out["dispatch"][f"{tag}-whole"] = sent  # the handshake included
            if first == Command.HELLO:
                hello_len = HEADER.size + HEADER.unpack_from(sent)[4]
                out["dispatch"][tag] = sent[hello_len:]
    return {t: dict(out[t]) for t in TARGETS}


def write(root: Path, doc: Path = DOC) -> dict[str, int]:
    """Write the seeds under ``root/<target>/``; the count per target."""
    counts = {}
    for target, files in seeds(doc).items():
        d = root / target
        d.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            tag = hashlib.sha1(data).hexdigest()[:8]
            (d / f"seed-{name}-{tag}").write_bytes(data)
        counts[target] = len(files)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / ".fuzz" / "corpus"),
                    help="where the per-target directories go (default .fuzz/corpus)")
    args = ap.parse_args(argv)
    counts = write(Path(args.out))
    for t, n in counts.items():
        print(f"{t:18} {n:4} seed(s)")
    if not all(counts.values()):
        print("some target has no seed: docs/protocol.md lost its captures?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
