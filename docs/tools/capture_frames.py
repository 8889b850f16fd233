#!/usr/bin/env python3
"""Regenerate the example frames in docs/protocol.md from a live daemon.

Every example is real traffic: requests are built with
``transferd.protocol.encode_frame`` and sent over a plain TCP socket to a
daemon this script starts (``rpc_server.cli -p 0``, forked from an
interpreter that has imported it once: see :class:`Zygote`), and replies are
the exact bytes the daemon sent back.  Nothing is typed by hand.

    python docs/tools/capture_frames.py            # print every example
    python docs/tools/capture_frames.py --write    # rewrite the blocks in docs/protocol.md
    python docs/tools/capture_frames.py --check    # exit 1 if docs/protocol.md is stale

In docs/protocol.md each example lives between ``<!-- capture:NAME -->`` and
``<!-- /capture -->``; ``--write`` replaces what is between the markers.

The transfer-engine examples talk to two daemons (A on 127.0.0.1, B on
127.0.0.2) and carry values that differ on every run: node ids, rkeys, ports
and addresses.  For those (``@example(..., volatile=True)``) ``--check``
parses the frames back out of the document, checks that each block is
consistent with its own bytes, and compares it with a fresh capture after
renaming every such value to a placeholder in order of first appearance (so
"the rkey REG_MR returned is the one SINGLE_WRITE used" is still checked);
``--write`` leaves such a block alone unless it differs beyond those values.
Examples are captured in parallel (``-j``), each with daemons of its own.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The examples register themselves when imported: the core protocol's first, then the engine's.
import capture.core
import capture.engine
import capture.leases
import capture.names  # noqa: F401
from capture import DOC
from capture.blocks import BLOCK, parse, render, rewrite, same, signature
from capture.live import Zygote
from capture.registry import EXAMPLES, VOLATILE, capture_all

# What tests/unit/test_docs.py reads off this module.
__all__ = ["BLOCK", "EXAMPLES", "VOLATILE", "main", "parse", "render", "same", "signature"]


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["--zygote"]:
        Zygote.serve(args_in[1])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite docs/protocol.md in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/protocol.md is stale")
    ap.add_argument(
        "-j", "--jobs", type=int, default=max(4, os.cpu_count() or 1),
        help="examples captured at once (default: max(4, CPUs))",
    )
    ap.add_argument("names", nargs="*", help="only these examples (default: all)")
    args = ap.parse_args(argv)
    names = args.names or list(EXAMPLES)
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        ap.error(f"unknown example(s): {', '.join(unknown)}; have {', '.join(EXAMPLES)}")
    captures = capture_all(names, args.jobs)
    if not (args.write or args.check):
        for n in names:
            print(f"<!-- capture:{n} -->\n{render(captures[n])}\n<!-- /capture -->\n")
        return 0
    text = DOC.read_text()
    in_doc = {m.group(2) for m in BLOCK.finditer(text)}
    missing = [n for n in EXAMPLES if n not in in_doc]
    new = rewrite(text, captures)
    if args.check:
        if new != text or missing:
            if missing:
                print(f"docs/protocol.md lacks blocks for: {', '.join(missing)}", file=sys.stderr)
            if new != text:
                print(
                    "docs/protocol.md is stale: run docs/tools/capture_frames.py --write",
                    file=sys.stderr,
                )
            return 1
        print(f"docs/protocol.md: {len(in_doc)} captured frames are current")
        return 0
    DOC.write_text(new)
    print(f"docs/protocol.md: rewrote {len(in_doc)} blocks")
    if missing:
        print(
            f"not in docs/protocol.md (add a block for each): {', '.join(missing)}", file=sys.stderr
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
