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

What polling costs.  Watched words are kept per array they live in (a
connection's page, a buffer): one poll of an array reads its watched words
one by one (a few) or in one numpy gather and memcmp (more), so a page of
512 watchers costs little more than one.  Each array has its own pace: every
``poll_s`` (50 us) while its words change and for ``HOLD_POLLS`` polls after,
then a sleep that doubles with each quiet poll until it joins the quiet
arrays, which are all polled together every ``idle_poll_s`` (10 ms by
default, ``engine.watcher_idle_poll_ms``).  So an idle daemon's watchers wake
it about 100 times a second whatever their number, the first change after a
quiet spell is seen within ``idle_poll_s``, and a client that keeps its own
word moving makes the thread poll its array fast, not everybody's.  However
many arrays are watched, the thread sleeps at least as long as its last poll
of the busy ones took in CPU time, and the quiet ones are polled no more
often than ``IDLE_DUTY`` times their cost (up to ``MAX_IDLE_SLEEP_S``), so it
never holds more than half of a core, or a fiftieth when idle, and the GIL
with it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import re
import secrets
import stat
import tempfile
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from transferd.protocol.errors import BadRequest, NotFound, OutOfBounds, OutOfMemory

log = logging.getLogger("transferd.watchers")

WORD = 8
PAGE_BYTES = 4096
WORDS_PER_PAGE = PAGE_BYTES // WORD
# Watchers of one daemon, all connections together, and of one connection, unless
# configured (engine.max_watchers, engine.max_watchers_per_connection).
MAX_WATCHERS = 4096
MAX_PER_OWNER = 64
# The watcher thread sleeps this long between polls while words change.  It never
# spins: a Python loop that does not sleep holds the GIL for the whole switch
# interval (5 ms) and starves the daemon's own loop, which must send the EVENT.
POLL_S = 50e-6
# Quiet polls at POLL_S before the sleep starts doubling (a change every few ms,
# such as a layer's, is still seen within POLL_S), and the longest sleep once quiet.
HOLD_POLLS = 40
IDLE_POLL_S = 10e-3
# When idle, sleep at least this many times as long as the last poll took (its CPU
# time), but never longer than MAX_IDLE_SLEEP_S.
IDLE_DUTY = 49
MAX_IDLE_SLEEP_S = 0.1
# How often owners are checked for having gone away.
SWEEP_S = 0.5

Change = Callable[[int, int], None]


def shm_dir() -> Path:
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


_PAGE = re.compile(r"transferd-watch-(\d+)-[0-9a-f]{16}")
# Directory -> the lock this process holds there while it has pages in it.
_CLAIMS: dict[Path, int] = {}
_CLAIMS_LOCK = threading.Lock()


def _lock_path(d: Path, pid: int) -> Path:
    return d / f"transferd-watch-{pid}.lock"


def claim(d: Path) -> None:
    """Before this process's first page in ``d``: hold its lock there (the sign that its
    pages are in use) and remove the pages of processes that died without removing
    theirs (SIGKILL, the OOM killer: ``atexit`` never ran).  A page is stale when its
    process's lock can be taken (it works across PID namespaces sharing ``d``), or,
    without a lock file, when no process has its PID; pages of this PID are stale
    before this process made any (a PID used again)."""
    with _CLAIMS_LOCK:
        if d in _CLAIMS:
            return
        me = os.getpid()
        fd = _own_lock(d, me)
        mine_stale = False
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                mine_stale = True
            except OSError:  # a live process of this PID in another PID namespace holds it
                pass
        _CLAIMS[d] = fd
        try:
            names = os.listdir(d)
        except OSError:
            return
        by_pid: dict[int, list[str]] = {}
        for name in names:
            m = _PAGE.fullmatch(name)
            if m:
                by_pid.setdefault(int(m.group(1)), []).append(name)
        uid = os.geteuid()
        for pid, pages in by_pid.items():
            if (pid == me and mine_stale) or (pid != me and _dead(d, pid)):
                for name in pages:
                    with contextlib.suppress(OSError):
                        if os.lstat(d / name).st_uid == uid:
                            os.unlink(d / name)
                if pid != me:
                    with contextlib.suppress(OSError):
                        os.unlink(_lock_path(d, pid))
        if any(by_pid.values()):
            log.debug("watcher pages of processes gone removed from %s", d)


def _mine(fd: int) -> bool:
    """Whether ``fd`` is a regular file of this process's user: a lock can be trusted to
    say anything about pages of this user only then. /dev/shm is every user's (sticky):
    another user can plant a file under any PID's lock name and flock it or not at will."""
    st = os.fstat(fd)
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _own_lock(d: Path, me: int) -> int:
    """This process's lock file in ``d``, open; -1 when its name is taken by something
    that is not this user's regular file (a symlink, another user's file: a squatter,
    who could otherwise deny every word page, or free this process's lock at will and
    have the next daemon remove its live pages). The pages are then made without a lock:
    other daemons leave them alone (:func:`_dead`), so only a SIGKILL's clean-up is lost."""
    path = _lock_path(d, me)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        why = exc.strerror or str(exc)
    else:
        if _mine(fd):
            return fd
        os.close(fd)
        why = "another user's file"
    log.warning("watcher pages: %s is not this daemon's (%s): its word pages are made "
                "without that lock (if this daemon is killed, remove its pages from %s by "
                "hand); who else can write to %s?", path, why, d, d)
    return -1


def _dead(d: Path, pid: int) -> bool:
    """Whether the process that made pages as ``pid`` is gone (see :func:`claim`)."""
    try:
        fd = os.open(_lock_path(d, pid), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    except OSError:
        return False
    try:
        if not _mine(fd):
            return False  # a squatter's file says nothing of this user's pages: keep them
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its process is alive
    finally:
        os.close(fd)
    return True


class WordPage:
    """One page of shared words in a file of its own, mode 0600, removed on close (or,
    when its process was killed, by the next process that makes one: :func:`claim`)."""

    _live: weakref.WeakSet[WordPage] = weakref.WeakSet()

    def __init__(self, directory: Path | None = None) -> None:
        d = directory or shm_dir()
        claim(d)
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
        with _CLAIMS_LOCK:
            for d, fd in _CLAIMS.items():
                if fd < 0:
                    continue  # the name was a squatter's (_own_lock): not ours to remove
                with contextlib.suppress(OSError):
                    os.unlink(_lock_path(d, os.getpid()))
                os.close(fd)
            _CLAIMS.clear()


atexit.register(WordPage.close_all)


def buffer_words(view: memoryview, offset: int) -> tuple[np.ndarray, int]:
    """A buffer's host view as 64-bit words, and the index of the word at ``offset``
    (8-byte aligned and inside the buffer)."""
    if offset < 0 or offset + WORD > len(view):
        raise OutOfBounds(f"a watcher word at {offset} is outside a buffer of {len(view)} bytes")
    arr = np.frombuffer(view, dtype=np.uint8)
    if (arr.ctypes.data + offset) % WORD:
        raise BadRequest(f"a watcher word must be 8-byte aligned (offset {offset} is not)")
    head = (-arr.ctypes.data) % WORD  # 0: buffers are page aligned
    words = arr[head : head + (len(arr) - head) // WORD * WORD].view(np.uint64)
    return words, (offset - head) // WORD


@dataclass(eq=False)
class Watcher:
    id: int
    owner: Hashable
    index: int  # of its word in its segment's array
    callback: Change = field(repr=False)
    last: int = 0
    keep: Any = field(repr=False, default=None)  # what keeps the word's memory alive
    # True: the callback hands the change on, and delivered() says when it
    # arrived; False: the change is delivered when the callback returns.
    handoff: bool = False
    in_flight: bool = False
    changes: int = 0
    segment: _Segment | None = field(repr=False, default=None)
    # True once the word's memory is let go of (its buffer freed): the watcher then
    # ends at the next sweep, so that its views no longer hold that memory.
    gone: Callable[[], bool] | None = field(repr=False, default=None)

    def read(self) -> int:
        assert self.segment is not None
        return int(self.segment.words[self.index])

    def delivered(self) -> None:
        """The consumer has the last change: the next one may be sent."""
        self.in_flight = False


class _Segment:
    """The watched words of one array (a page, a buffer), read in one gather per poll.

    ``state`` (the watchers, their indexes, the values last seen) is replaced whole,
    under the table's lock, when a watcher comes or goes; the polling thread reads it
    once per poll.  ``quiet``, ``sleep`` and ``due`` are the thread's own: how many
    polls found nothing, the pace of this array, and when it is polled next."""

    def __init__(self, key: Hashable, words: np.ndarray, poll_s: float) -> None:
        self.key = key
        self.words = words
        # The same words for scalar reads (54 ns each, against a gather's microsecond).
        self.scalars = words.data.cast("B").cast("Q")
        self.state: tuple[tuple[Watcher, ...], np.ndarray, np.ndarray] = (
            (), np.empty(0, dtype=np.intp), np.empty(0, dtype=np.uint64))
        self.dropped = False
        self.polls = 0
        self.quiet = 0
        self.sleep = poll_s
        self.due = 0.0

    @property
    def watchers(self) -> tuple[Watcher, ...]:
        return self.state[0]

    def rebuild(self, watchers: tuple[Watcher, ...]) -> None:
        self.state = (watchers, np.array([w.index for w in watchers], dtype=np.intp),
                      np.array([w.last for w in watchers], dtype=np.uint64))

    def poll(self) -> int:
        """Hand every watcher whose word moved its change; how many moved."""
        self.polls += 1
        watchers, index, last = self.state
        if len(watchers) <= SCALAR_READS:
            scalars, moved = self.scalars, 0
            for i, w in enumerate(watchers):
                v = scalars[w.index]
                if v != w.last:
                    moved += 1
                    _fire(w, v, last, i)
            return moved
        now = self.words.take(index)
        if now.tobytes() == last.tobytes():  # the common case: nothing moved, one memcmp
            return 0
        changed = np.flatnonzero(now != last).tolist()
        for i in changed:
            _fire(watchers[i], int(now[i]), last, i)
        return len(changed)


def _ended(old: int, new: int) -> None:
    """The callback of a watcher taken out (the polling thread may still hold it)."""


# Segments of at most this many watchers read their words one by one.
SCALAR_READS = 8


def _fire(w: Watcher, v: int, last: np.ndarray, i: int) -> None:
    """``w``'s word reads ``v``: hand the change on, unless one is still in flight."""
    if w.in_flight:
        return  # merged into the next change, once this one arrived
    old, w.last = w.last, v
    last[i] = v
    w.in_flight = True
    w.changes += 1
    try:
        w.callback(old, v)
    except Exception:
        w.handoff = False
        log.exception("watcher %d callback failed", w.id)
    if not w.handoff:
        w.in_flight = False


class Watchers:
    """Every watcher of one daemon and the thread that polls them."""

    def __init__(self, poll_s: float = POLL_S,
                 alive: Callable[[Hashable], bool] | None = None, *,
                 idle_poll_s: float = IDLE_POLL_S, max_watchers: int = MAX_WATCHERS,
                 max_per_owner: int = MAX_PER_OWNER,
                 ended: Callable[[list[Watcher]], None] | None = None) -> None:
        self.poll_s = poll_s
        # Told (from any thread, no lock held) of the watchers taken out: what was
        # armed on them (service/armed.py) is dropped.
        self._ended = ended
        self.idle_poll_s = max(poll_s, idle_poll_s)
        self.max_watchers = max_watchers
        self.max_per_owner = max_per_owner
        self._alive = alive or (lambda owner: True)
        self._ids = itertools.count(1)
        self._by_id: dict[int, Watcher] = {}
        self._per_owner: Counter[Hashable] = Counter()
        self._segments: dict[Hashable, _Segment] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._snapshot: tuple[_Segment, ...] = ()
        # Arrays with a new watcher, for the thread to poll at full pace (the lock held).
        self._fresh: list[_Segment] = []
        self.polls = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def check_room(self, owner: Hashable) -> None:
        """OutOfMemory when ``owner`` (or the daemon) may watch no more words."""
        if len(self._by_id) >= self.max_watchers:
            raise OutOfMemory(f"this daemon watches at most {self.max_watchers} words "
                              "(engine.max_watchers)")
        if self._per_owner[owner] >= self.max_per_owner:
            raise OutOfMemory(f"at most {self.max_per_owner} watchers per connection "
                              "(engine.max_watchers_per_connection)")

    def add(self, owner: Hashable, key: Hashable, words: np.ndarray, index: int,
            callback: Change, keep: Any = None, *, handoff: bool = False,
            gone: Callable[[], bool] | None = None) -> Watcher:
        """Watch ``words[index]`` for ``owner``.  ``key`` names the array: words of one
        key are read together (the first ``words`` given for a key is the one read).
        ``gone()`` true: the memory was let go of, the watcher ends within SWEEP_S."""
        with self._lock:
            self.check_room(owner)
            seg = self._segments.get(key)
            if seg is None:
                seg = self._segments[key] = _Segment(key, words, self.poll_s)
            w = Watcher(next(self._ids), owner, index, callback, int(seg.words[index]), keep,
                        handoff, segment=seg, gone=gone)
            self._by_id[w.id] = w
            self._per_owner[owner] += 1
            seg.rebuild((*seg.watchers, w))
            self._snapshot = tuple(self._segments.values())
            self._fresh.append(seg)  # the new word may be about to move
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
            w = self._by_id.get(watcher_id)
            if w is None:
                raise NotFound(f"no watcher {watcher_id}")
            self._forget([w])
        self._tell_ended([w])
        return w

    def owner_closed(self, owner: Hashable) -> list[Watcher]:
        with self._lock:
            gone = [w for w in self._by_id.values() if w.owner is owner]
            self._forget(gone)
        self._tell_ended(gone)
        return gone

    def _tell_ended(self, gone: list[Watcher]) -> None:
        if gone and self._ended is not None:
            try:
                self._ended(gone)
            except Exception:
                log.exception("watchers' end hook failed")

    def _forget(self, gone: list[Watcher]) -> None:
        """Take ``gone`` out (the lock held): their segments are rebuilt, or dropped."""
        touched: set[_Segment] = set()
        for w in gone:
            # A callback usually refers back to its watcher (a cycle only the collector
            # would break, at its leisure): cut it, so the memory the watcher's views
            # hold (a freed buffer's) is let go of now.
            w.callback = _ended
            del self._by_id[w.id]
            self._per_owner[w.owner] -= 1
            if self._per_owner[w.owner] <= 0:
                del self._per_owner[w.owner]
            if w.segment is not None:
                touched.add(w.segment)
        ids = {w.id for w in gone}
        for seg in touched:
            seg.rebuild(tuple(w for w in seg.watchers if w.id not in ids))
            if not seg.watchers:
                seg.dropped = True
                del self._segments[seg.key]
        self._snapshot = tuple(self._segments.values())

    # -- the thread -----------------------------------------------------------------

    def _main(self) -> None:
        # Arrays whose words moved lately, each at its own pace (50 us, doubling once
        # quiet), and the quiet rest, polled together every idle_poll_s: one hot word
        # makes the thread poll its own array fast, not every array of the daemon.
        hot: list[_Segment] = []
        cold: list[_Segment] = []
        next_cold = next_sweep = time.monotonic()
        paced = self.idle_poll_s > self.poll_s
        fresh: list[_Segment] = []
        seg: _Segment | None = None
        while True:
            with self._lock:
                while not self._by_id and not self._stop:
                    # Nothing to watch: sleep until a watcher is added, burn nothing,
                    # and hold no array (a freed buffer's memory goes with its last view).
                    hot.clear()
                    cold.clear()
                    fresh, seg = [], None
                    self._wake.wait()
                if self._stop:
                    self._thread = None
                    return
                fresh, self._fresh = self._fresh, []
            self.polls += 1
            # This thread's CPU time, not the clock's: a poll that waited for the GIL
            # or for a CPU did not cost what it took.
            started = time.thread_time()
            now = time.monotonic()
            for seg in fresh:
                seg.quiet, seg.sleep, seg.due = 0, self.poll_s, now
                if seg in cold:
                    cold.remove(seg)
                if seg not in hot:
                    hot.append(seg)
            for seg in list(hot):
                if seg.dropped:
                    hot.remove(seg)
                elif seg.due <= now:
                    if seg.poll():
                        seg.quiet, seg.sleep = 0, self.poll_s
                    else:
                        seg.quiet += 1
                        if seg.quiet > HOLD_POLLS:
                            seg.sleep = min(self.idle_poll_s, seg.sleep * 2)
                    if paced and seg.sleep >= self.idle_poll_s:
                        hot.remove(seg)  # quiet long enough: polled with the rest
                        cold.append(seg)
                    else:
                        seg.due = now + seg.sleep
            hot_spent = time.thread_time() - started
            if now >= next_cold:
                for seg in list(cold):
                    if seg.dropped:
                        cold.remove(seg)
                    elif seg.poll():
                        cold.remove(seg)
                        seg.quiet, seg.sleep, seg.due = 0, self.poll_s, now + self.poll_s
                        hot.append(seg)
                # However many arrays: the quiet ones cost 1/IDLE_DUTY of a core at most.
                cold_spent = time.thread_time() - started - hot_spent
                next_cold = now + min(max(self.idle_poll_s, cold_spent * IDLE_DUTY),
                                      MAX_IDLE_SLEEP_S)
            if now >= next_sweep:
                next_sweep = now + SWEEP_S
                self._sweep(hot + cold)
            dues = [seg.due for seg in hot] + ([next_cold] if cold else [])
            wait = (min(dues) if dues else now + self.idle_poll_s) - time.monotonic()
            if hot:
                time.sleep(max(wait, hot_spent))  # never more than half a core either
            elif wait > 0:
                # Only quiet arrays.  A watcher added meanwhile waits for this sleep
                # (its baseline was read when it was made, so no change is missed);
                # Condition.wait would cut it short but costs twice a sleep's wakeup.
                time.sleep(wait)

    def _sweep(self, segments: list[_Segment]) -> None:
        ended = [w for seg in segments for w in seg.watchers if w.gone is not None and w.gone()]
        if ended:
            with self._lock:
                ended = [w for w in ended if w.id in self._by_id]
                self._forget(ended)
            self._tell_ended(ended)
        owners = {w.owner for seg in segments for w in seg.watchers}
        for owner in owners:
            if not self._alive(owner):
                for w in self.owner_closed(owner):
                    if isinstance(w.keep, WordPage):
                        w.keep.close()

    def collect(self) -> Iterator[Metric]:
        """Prometheus (registered by the RPC front end): how many, and what they cost."""
        yield GaugeMetricFamily("transferd_watchers", "UVM watchers held now, all "
                                "connections together (engine.max_watchers).",
                                value=len(self._by_id))
        yield CounterMetricFamily("transferd_watcher_polls", "Polls of every watched word "
                                  "by the watcher thread: about 20,000 a second while words "
                                  "change, 1000 / engine.watcher_idle_poll_ms once they "
                                  "stop.", value=self.polls)

    def describe(self) -> list[Metric]:
        return []

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._by_id.clear()
            self._per_owner.clear()
            self._segments.clear()
            self._snapshot = ()
            self._wake.notify()
            t = self._thread
        if t is not None:
            t.join(5)
