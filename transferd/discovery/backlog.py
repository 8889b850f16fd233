"""What a watcher has not been told yet: one change per name, and nothing for a name
that came and went unseen.

Shared by the daemon (what waits while a watcher's connection is full) and the
client library (what waits for a caller that has not taken it): a leaf, as
:mod:`.records` is.  A name's latest change replaces the one waiting, in the
place of the first (so a name that keeps changing still gets its turn), and a
put the watcher has not seen (``new``: the name was absent for it) followed by
a delete of that name leaves nothing.  So what waits is the names that differ
from what the watcher was last told: the names visible now, and those it was
told of and that went since, however fast names come and go.
"""

from __future__ import annotations

from .records import Change, Op


class Backlog:
    def __init__(self) -> None:
        self._changes: dict[str, Change] = {}
        # The waiting names the watcher has not seen (absent for it before this put).
        self._new: set[str] = set()

    def add(self, change: Change, new: bool) -> None:
        name = change.name
        if name in self._changes:
            if change.op is Op.DELETE and name in self._new:
                del self._changes[name]  # came and went unseen: nothing to tell
                self._new.discard(name)
            else:
                self._changes[name] = change
            return
        self._changes[name] = change
        if new:
            self._new.add(name)

    def take(self) -> tuple[Change, bool]:
        """The oldest waiting change, and whether it is a put the watcher has not seen."""
        name = next(iter(self._changes))
        new = name in self._new
        self._new.discard(name)
        return self._changes.pop(name), new

    def clear(self) -> None:
        self._changes.clear()
        self._new.clear()

    def __len__(self) -> int:
        return len(self._changes)
