"""UVM watchers: 64-bit words that a GPU kernel (or another process) bumps.

The article's ``alloc_uvm_watcher(cb)``: a word in memory that both the host
and a device reach, which a kernel writes (also from inside a CUDA graph),
and a watcher thread polls; ``cb(old, new)`` runs when it changed.  Here the
word lives in a page of shared host memory (:class:`WordPage`, a file in
``/dev/shm``) so that it is reachable from three sides at once:

- the daemon's watcher thread reads it (an aligned 8-byte load is atomic on
  every platform this runs on);
- a local client maps the same page, and pins and maps it for its GPU with
  ``cudaHostRegister(..., cudaHostRegisterMapped)``: its kernels then write
  the word through the device pointer of that mapping (``client.watchers``);
- any process of the same user can bump it with a plain store.

A word may also be one inside a daemon buffer (:func:`buffer_word`): then a
SET_TENSOR, a peer's engine write or a device mapping of that buffer moves it.

One thread polls every watcher of the daemon (the article's dedicated
polling thread) and runs only while some exist.  A watcher reports each
change it sees as ``(old, new)``: two bumps between polls are one change,
so a consumer acts on the range ``old+1 .. new`` (see
``examples/layer_watcher.py``).  Only one notification per watcher is in
flight at a time; changes seen meanwhile are merged into the next one, so a
slow consumer costs memory for nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import mmap
import os
import secrets
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from transferd.protocol.errors import BadRequest, NotFound, OutOfBounds, OutOfMemory

log = logging.getLogger("transferd.watchers")

WORD = 8
PAGE_BYTES = 4096
WORDS_PER_PAGE = PAGE_BYTES // WORD
# Watchers of one daemon, all connections together, and of one owner.
MAX_WATCHERS = 4096
MAX_PER_OWNER = WORDS_PER_PAGE
# The watcher thread sleeps this long between polls.  It never spins: a
# Python loop that does not sleep holds the GIL for the whole switch interval
# (5 ms) and starves the daemon's own loop, which must send the EVENT.
POLL_S = 50e-6
# How often owners are checked for having gone away.
SWEEP_S = 0.5

Change = Callable[[int, int], None]


def shm_dir() -> Path:
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


class WordPage:
    """One page of shared words in a file of its own, mode 0600, removed on close."""

    _live: weakref.WeakSet[WordPage] = weakref.WeakSet()

    def __init__(self, directory: Path | None = None) -> None:
        d = directory or shm_dir()
        self.path = d / f"transferd-watch-{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, PAGE_BYTES)
            self._mem = mmap.mmap(fd, PAGE_BYTES, flags=mmap.MAP_SHARED)
        except OSError:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.words = np.frombuffer(self._mem, dtype=np.uint64)
        self._used = 0
        self.closed = False
        WordPage._live.add(self)

    def take(self) -> int:
        """The offset of an unused word; OutOfMemory when the page is full."""
        if self._used >= WORDS_PER_PAGE:
            raise OutOfMemory(f"at most {WORDS_PER_PAGE} watchers per connection")
        off = self._used * WORD
        self._used += 1
        return off

    def word(self, offset: int) -> np.ndarray:
        return self.words[offset // WORD : offset // WORD + 1]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        # The mapping goes with the last numpy view of it (a watcher may still hold one).

    @classmethod
    def close_all(cls) -> None:
        for page in list(cls._live):
            page.close()


atexit.register(WordPage.close_all)


def buffer_word(view: memoryview, offset: int) -> np.ndarray:
    """The word at ``offset`` of a buffer's host view: 8-byte aligned and inside it."""
    if offset < 0 or offset + WORD > len(view):
        raise OutOfBounds(f"a watcher word at {offset} is outside a buffer of {len(view)} bytes")
    arr = np.frombuffer(view, dtype=np.uint8)
    if (arr.ctypes.data + offset) % WORD:
        raise BadRequest(f"a watcher word must be 8-byte aligned (offset {offset} is not)")
    return arr[offset : offset + WORD].view(np.uint64)


@dataclass(eq=False)
class Watcher:
    id: int
    owner: Hashable
    word: np.ndarray = field(repr=False)
    callback: Change = field(repr=False)
    last: int = 0
    keep: Any = field(repr=False, default=None)  # what keeps the word's memory alive
    # True: the callback hands the change on, and delivered() says when it
    # arrived; False: the change is delivered when the callback returns.
    handoff: bool = False
    in_flight: bool = False
    changes: int = 0

    def read(self) -> int:
        return int(self.word[0])

    def delivered(self) -> None:
        """The consumer has the last change: the next one may be sent."""
        self.in_flight = False


class Watchers:
    """Every watcher of one daemon and the thread that polls them."""

    def __init__(self, poll_s: float = POLL_S,
                 alive: Callable[[Hashable], bool] | None = None) -> None:
        self.poll_s = poll_s
        self._alive = alive or (lambda owner: True)
        self._ids = itertools.count(1)
        self._by_id: dict[int, Watcher] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._snapshot: tuple[Watcher, ...] = ()
        self.polls = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, owner: Hashable, word: np.ndarray, callback: Change, keep: Any = None,
            *, handoff: bool = False) -> Watcher:
        with self._lock:
            if len(self._by_id) >= MAX_WATCHERS:
                raise OutOfMemory(f"this daemon watches at most {MAX_WATCHERS} words")
            if sum(1 for w in self._by_id.values() if w.owner is owner) >= MAX_PER_OWNER:
                raise OutOfMemory(f"at most {MAX_PER_OWNER} watchers per connection")
            w = Watcher(next(self._ids), owner, word, callback, int(word[0]), keep, handoff)
            self._by_id[w.id] = w
            self._snapshot = tuple(self._by_id.values())
            if self._thread is None:
                self._stop = False
                self._thread = threading.Thread(target=self._main, name="transferd-watchers",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()
        return w

    def get(self, watcher_id: int) -> Watcher:
        try:
            return self._by_id[watcher_id]
        except KeyError:
            raise NotFound(f"no watcher {watcher_id}") from None

    def remove(self, watcher_id: int) -> Watcher:
        with self._lock:
            w = self._by_id.pop(watcher_id, None)
            if w is None:
                raise NotFound(f"no watcher {watcher_id}")
            self._snapshot = tuple(self._by_id.values())
        return w

    def owner_closed(self, owner: Hashable) -> list[Watcher]:
        with self._lock:
            gone = [w for w in self._by_id.values() if w.owner is owner]
            for w in gone:
                del self._by_id[w.id]
            self._snapshot = tuple(self._by_id.values())
        return gone

    # -- the thread -----------------------------------------------------------------

    def _main(self) -> None:
        next_sweep = time.monotonic() + SWEEP_S
        while True:
            with self._lock:
                while not self._by_id and not self._stop:
                    # Nothing to watch: sleep until a watcher is added, burn nothing.
                    self._wake.wait()
                if self._stop:
                    self._thread = None
                    return
                watchers = self._snapshot
            self.polls += 1
            for w in watchers:
                if w.in_flight:
                    continue
                try:
                    v = int(w.word[0])
                except (ValueError, TypeError):  # pragma: no cover - memory gone
                    continue
                if v != w.last:
                    old, w.last = w.last, v
                    w.in_flight = True
                    w.changes += 1
                    try:
                        w.callback(old, v)
                    except Exception:
                        w.handoff = False
                        log.exception("watcher %d callback failed", w.id)
                    if not w.handoff:
                        w.in_flight = False
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + SWEEP_S
                self._sweep(watchers)
            time.sleep(self.poll_s)

    def _sweep(self, watchers: tuple[Watcher, ...]) -> None:
        owners = {w.owner for w in watchers}
        for owner in owners:
            if not self._alive(owner):
                for w in self.owner_closed(owner):
                    if isinstance(w.keep, WordPage):
                        w.keep.close()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._by_id.clear()
            self._snapshot = ()
            self._wake.notify()
            t = self._thread
        if t is not None:
            t.join(5)
