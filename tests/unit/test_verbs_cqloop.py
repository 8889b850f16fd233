"""The completion-queue loop's wake-up, without a device: recorded completions on a
completion queue stand-in whose channel is a real eventfd (readable once per armed
completion, as the kernel's completion channel is), and the descriptor search of
:mod:`transferd.rdma.chanfd` over this process's real /proc/self/fd.

Over a real NIC (pyverbs' CompChannel) this runs in tests/rdma (``make rdma-check``)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from transferd.rdma.chanfd import Opened, fds_of_kind, open_channel
from transferd.rdma.completions import Completion, WrKind, wr_id
from transferd.rdma.constants import WcOpcode, WcStatus
from transferd.rdma.cqloop import CqPoller

from ..verbs_standins import Channel, RecordedCq

pytestmark = pytest.mark.skipif(not hasattr(os, "eventfd"), reason="needs os.eventfd (Linux)")

EVENTFD = "anon_inode:[eventfd]"


def recv(slot: int) -> Completion:
    return Completion(wr_id(WrKind.RECV, slot), WcStatus.SUCCESS, WcOpcode.RECV, 5, 64)


def test_an_idle_queue_is_not_polled_and_a_completion_wakes_the_loop() -> None:
    loop = asyncio.new_event_loop()
    channel = Channel()
    cq = RecordedCq(channel)
    cq.req_notify()  # as Nic does when it creates the queue
    got: list[Completion] = []
    opened = open_channel(lambda: channel, link=EVENTFD)
    assert opened.fd is None or opened.fd == channel.efd  # made before: not "new"
    poller = CqPoller(loop, cq, channel, got.append, fd=channel.efd)
    try:
        cpu0 = time.thread_time()
        loop.run_until_complete(asyncio.sleep(0.5))  # idle
        idle_cpu = time.thread_time() - cpu0
        # Idle: no ibv_poll_cq at all (the timer path, all pyverbs 44 had: a burst of
        # 200 us of polling every millisecond, about 20% of a core per NIC).
        assert poller.polls == 0, f"{poller.polls} polls while idle"
        print(f"idle: {idle_cpu * 1e3:.2f} ms of CPU in 0.5 s "
              f"({idle_cpu / 0.5 * 100:.2f}% of a core)")

        first, second = recv(1), recv(2)
        t0 = time.monotonic()
        loop.call_later(0.05, cq.complete, first)
        loop.run_until_complete(asyncio.sleep(0.1))
        assert got == [first] and cq.acked == 1
        assert cq.armed  # re-armed after the drain: the next one raises an event again
        loop.call_soon(cq.complete, second)
        loop.run_until_complete(asyncio.sleep(0.05))
        assert got == [first, second] and cq.acked == 2
        assert time.monotonic() - t0 < 5
        # A kick (work posted) busy-polls for BUSY_POLL_S, then arms and goes quiet.
        polls = poller.polls
        poller.kick()
        loop.run_until_complete(asyncio.sleep(0.3))
        assert poller.polls > polls and cq.armed
        settled = poller.polls
        loop.run_until_complete(asyncio.sleep(0.2))
        assert poller.polls == settled
    finally:
        poller.close()
        channel.close()
        loop.close()


def test_without_a_descriptor_the_loop_still_polls_on_its_timer() -> None:
    loop = asyncio.new_event_loop()
    channel = Channel()
    cq = RecordedCq(channel)
    got: list[Completion] = []
    poller = CqPoller(loop, cq, channel, got.append, fd=None)
    try:
        cq.pending.append(recv(3))  # no event: only the timer finds it
        loop.run_until_complete(asyncio.sleep(0.05))
        assert got == [recv(3)]
    finally:
        poller.close()
        channel.close()
        loop.close()


class Made:
    """What make() returned, holding the descriptor it opened (a CompChannel's)."""

    def __init__(self, *fds: int) -> None:
        self.fds = fds

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def test_the_channels_descriptor_is_the_one_new_file_of_its_kind() -> None:
    # The kernel's [infinibandevent] files need a device; an eventfd is another
    # anonymous inode, found by the same search in the real /proc/self/fd.
    older = os.eventfd(0)
    try:
        before = fds_of_kind(EVENTFD)
        assert before is not None and older in before
        opened: Opened[Made] = open_channel(lambda: Made(os.eventfd(0)), link=EVENTFD)
        assert opened.fd == opened.channel.fds[0] and "found in" in opened.how
        opened.channel.close()

        two = open_channel(lambda: Made(os.eventfd(0), os.eventfd(0)), link=EVENTFD)
        assert two.fd is None and "2 new" in two.how  # cannot tell: the timer
        two.channel.close()

        class Newer:  # pyverbs >= 57: CompChannel.fd
            fd = older

        assert open_channel(Newer, link=EVENTFD).fd == older
        assert open_channel(Newer, link=EVENTFD, fd_dir="/nonexistent").fd == older
        none = open_channel(lambda: Made(), link=EVENTFD, fd_dir="/nonexistent")
        assert none.fd is None and "no /nonexistent" in none.how
    finally:
        os.close(older)


def test_devices_can_say_how_the_loop_will_wait_before_any_channel_exists() -> None:
    from transferd.rdma.chanfd import expected_wakeup

    class Pyverbs44:  # no fd attribute
        pass

    class Pyverbs57:
        fd = property(lambda self: 3)

    assert "CompChannel.fd, pyverbs >= 57" in expected_wakeup(Pyverbs57)
    assert "found in /proc/self/fd" in expected_wakeup(Pyverbs44)
    assert "polls every millisecond" in expected_wakeup(Pyverbs44, fd_dir="/nonexistent")
