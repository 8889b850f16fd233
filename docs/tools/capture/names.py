"""The names examples: PUBLISH, LOOKUP, WATCH with its EVENTs, UNPUBLISH, NAMES, CANCEL."""

from __future__ import annotations

from capture.live import Capture, Daemons
from capture.registry import example, session
from transferd.protocol import Command


@example("NAMES")
def ex_names(ds: Daemons) -> Capture:
    with session(ds["names"], "PUBLISH of bytes, LOOKUP, WATCH of its prefix, NAMES, "
                 "UNPUBLISH, then CANCEL of the watch") as (c, cap):
        c.send(Command.PUBLISH, 2, {"name": "kv/prefill-3", "kind": "bytes",
                                    "value": b"ready"})
        c.recv()
        c.send(Command.LOOKUP, 3, {"name": "kv/prefill-3"})
        c.recv()
        c.send(Command.WATCH, 4, {"prefix": "kv/"})
        c.recv()
        c.recv()
        c.send(Command.NAMES, 5, {"prefix": "kv/"})
        c.recv()
        c.send(Command.UNPUBLISH, 6, {"name": "kv/prefill-3"})
        c.recv()
        c.recv()
        c.send(Command.CANCEL, 7, {"seq": 4})
        c.recv()
        c.recv()
    cap.note = (
        "The daemon runs the embedded default (`discovery.url` empty) with "
        '`discovery.node_name = "node-a"`. The name is owned by this connection (the default '
        "`discovery.default_owner`) and `synced` is true: this daemon is the store. WATCH's "
        "reply says one name was there; its put follows as an EVENT with WATCH's seq, and "
        "UNPUBLISH's delete comes as one before UNPUBLISH's reply. CANCEL of the watch's seq "
        "ends it: its EVENT|ERROR CANCELLED first, then CANCEL's reply."
    )
    return cap
