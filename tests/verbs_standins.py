"""Stand-ins for a NIC's completion queue and channel, for the tests and benchmarks of
the completion-queue loop without a device: completions recorded by the caller, and a
real eventfd as the channel's descriptor (readable once per armed completion, as the
kernel's completion channel is).  Shaped as pyverbs 44's CompChannel and CQ as
:class:`transferd.rdma.cqloop.CqPoller` uses them (no ``fd`` attribute)."""

from __future__ import annotations

import os
from collections import deque

from transferd.rdma.completions import Completion


class Channel:
    """pyverbs 44's CompChannel as the loop sees it: get_cq_event, and no ``fd``."""

    def __init__(self) -> None:
        self.efd = os.eventfd(0, os.EFD_NONBLOCK)

    def get_cq_event(self, cq: object) -> None:
        os.eventfd_read(self.efd)  # EAGAIN (BlockingIOError) when there is none

    def close(self) -> None:
        os.close(self.efd)


class RecordedCq:
    """Completions recorded by the test; an event on the channel for the first one
    after req_notify, as ibv_req_notify_cq arms the CQ for one event."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.pending: deque[Completion] = deque()
        self.armed = False
        self.acked = 0

    def poll(self, n: int) -> tuple[int, list[Completion]]:
        out = [self.pending.popleft() for _ in range(min(n, len(self.pending)))]
        return len(out), out

    def req_notify(self) -> None:
        self.armed = True

    def ack_events(self, n: int) -> None:
        self.acked += n

    def complete(self, c: Completion) -> None:
        self.pending.append(c)
        if self.armed:
            self.armed = False
            os.eventfd_write(self.channel.efd, 1)
