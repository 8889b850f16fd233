"""The completion channel's file descriptor, with whatever pyverbs the system has.

The completion-queue loop waits on that descriptor (readable when an armed completion
queue has a new entry) instead of polling.  pyverbs exposes it as ``CompChannel.fd``
from rdma-core v57 on; pyverbs 44 (Debian 12's) has no such attribute.  There, the
descriptor is found as the one ``[infinibandevent]`` anonymous inode (what the kernel's
uverbs names both completion-channel and async-event files) that appeared in
``/proc/self/fd`` while the channel was created.  Every place of this process that opens
such files (a device context: its async-event file; a completion channel) does so under
:data:`EVENT_FILES_LOCK`, so exactly one new one is ours; when that cannot be told (not
one new descriptor, no /proc) the answer is None and the loop polls on a timer.

No pyverbs call waits on a thread instead: pyverbs (44 to 64) calls
``ibv_get_cq_event`` without releasing the GIL, so a thread blocked in it would stop
every other thread of the daemon.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

EVENT_LINK = "anon_inode:[infinibandevent]"
FD_DIR = "/proc/self/fd"
# Held while this process creates a file of EVENT_LINK's kind (device contexts,
# completion channels), so the one that appears in a window is the one made there.
EVENT_FILES_LOCK = threading.Lock()


def fds_of_kind(link: str = EVENT_LINK, fd_dir: str = FD_DIR) -> set[int] | None:
    """The descriptors of this process whose /proc link reads ``link``; None without
    /proc."""
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    out = set()
    for name in names:
        try:
            if os.readlink(os.path.join(fd_dir, name)) == link:
                out.add(int(name))
        except (OSError, ValueError):
            continue  # closed meanwhile (the listing's own descriptor, say)
    return out


@dataclass(frozen=True)
class Opened(Generic[T]):
    channel: T
    fd: int | None  # None: no descriptor to wait on (poll on a timer)
    how: str  # in words, for logs and `transferd devices`


def open_channel(make: Callable[[], T], link: str = EVENT_LINK,
                 fd_dir: str = FD_DIR) -> Opened[T]:
    """``make()`` (a pyverbs CompChannel) and its descriptor."""
    with EVENT_FILES_LOCK:
        before = fds_of_kind(link, fd_dir)
        channel = make()
        after = fds_of_kind(link, fd_dir)
    fd = getattr(channel, "fd", None)  # pyverbs >= 57
    if fd is not None:
        return Opened(channel, int(fd), "CompChannel.fd (pyverbs >= 57)")
    if before is None or after is None:
        return Opened(channel, None, f"no {fd_dir} to find the channel's descriptor in: "
                                     "polling every millisecond")
    new = after - before
    if len(new) != 1:
        return Opened(channel, None, f"{len(new)} new {link} descriptors appeared with "
                                     "the channel: polling every millisecond")
    return Opened(channel, new.pop(), f"found in {fd_dir} (pyverbs before 57 does "
                                      "not expose CompChannel.fd)")


def expected_wakeup(channel_cls: type, fd_dir: str = FD_DIR) -> str:
    """How the completion-queue loop will wait with this pyverbs, before any channel is
    made (for ``transferd devices``)."""
    if hasattr(channel_cls, "fd"):
        return "waits on the completion channel's descriptor (CompChannel.fd, pyverbs >= 57)"
    if fds_of_kind(EVENT_LINK, fd_dir) is None:
        return (f"polls every millisecond (pyverbs before 57 has no CompChannel.fd, and "
                f"there is no {fd_dir} to find it in)")
    return ("waits on the completion channel's descriptor, found in /proc/self/fd "
            "(pyverbs before 57 has no CompChannel.fd)")
