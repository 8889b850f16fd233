"""Credit flow control of an rdma:// channel: a message is sent only into a receive the
far side has posted, and it says when it reposted one.

On RC a SEND's completion only says the message landed in one of the receiver's posted
receives, not that the receiver has posted another: a sender that reuses its right to
send at completion outruns a receiver that stopped taking messages (a protocol paused
for back-pressure), and its SENDs meet no receive and are retried (RNR) without end.
So each end counts **credits**: the receives the other end has posted for it and it has
not used (at first the depth the other end announced in its ChannelSetup).  Every
message uses one; every message carries, as its immediate (SEND_WITH_IMM), how many of
its own receives this end reposted since it last said so.  The last credit is kept for a
message that only returns credits (zero bytes, the immediate alone), sent once half the
receives were reposted unreported, so two ends that only receive each other's credit
returns never both run dry.

A sender out of credits waits with its messages queued (its carrier's write buffer
gives the protocol back-pressure) for at most ``stall_s``; then the channel fails with
Timeout: a bounded wait and a typed failure, never RNR retries forever.  Credits the far
side claims beyond the receives it announced are a protocol violation (BadFrame).

Sans-IO: the channel (``channel.py``) feeds it and asks it; time is passed in.
"""

from __future__ import annotations

import enum

from transferd.protocol.errors import BadFrame, BadRequest, Timeout

CREDIT_STALL_S = 30.0  # a peer that reposts nothing for this long is failed


class FlowState(enum.Enum):
    OPEN = "open"  # credits to send with (or nothing waiting)
    STALLED = "stalled"  # messages wait for the far side to repost
    FAILED = "failed"  # stalled past the bound, or the far side lied


class Credits:
    def __init__(self, peer_receives: int, own_receives: int, *,
                 stall_s: float = CREDIT_STALL_S) -> None:
        if peer_receives < 2:
            raise BadRequest(f"rdma://: the peer posts {peer_receives} receive(s); credit "
                             "flow control needs at least 2")
        self.peer_receives = peer_receives
        self.credits = peer_receives  # the far side's receives ours to use
        self.owed = 0  # our receives reposted and not yet reported
        # A credit-only message once this many reposts are unreported.
        self.batch = max(1, own_receives // 2)
        self.stall_s = stall_s
        self.state = FlowState.OPEN
        self.stalled_since: float | None = None
        self.credit_messages = 0

    # -- sending --------------------------------------------------------------------

    def can_send(self) -> bool:
        """A message may go now (one credit stays for a credit return)."""
        return self.state is not FlowState.FAILED and self.credits >= 2

    def send(self) -> int:
        """A message goes: its immediate (the reposts it reports)."""
        assert self.can_send()
        return self._take()

    def credit_due(self) -> bool:
        """A credit-only message should go now."""
        return (self.state is not FlowState.FAILED and self.owed >= self.batch
                and self.credits >= 1)

    def send_credits(self) -> int:
        assert self.credit_due()
        self.credit_messages += 1
        return self._take()

    def _take(self) -> int:
        self.credits -= 1
        imm, self.owed = self.owed, 0
        return imm

    # -- receiving ------------------------------------------------------------------

    def returned(self, n: int) -> None:
        """A message from the far side reported ``n`` reposts."""
        if n < 0 or self.credits + n > self.peer_receives:
            self.state = FlowState.FAILED
            raise BadFrame(f"rdma://: the peer returned {n} credits with {self.credits} "
                           f"unused of its {self.peer_receives} receives")
        self.credits += n
        if self.state is FlowState.STALLED and self.credits >= 2:
            self.state = FlowState.OPEN
            self.stalled_since = None

    def reposted(self, n: int = 1) -> None:
        """We reposted ``n`` receives (their messages were taken)."""
        self.owed += n

    # -- waiting --------------------------------------------------------------------

    def waiting(self, now: float) -> None:
        """Messages are queued and none can go: the stall starts (if it had not)."""
        if self.state is FlowState.OPEN and not self.can_send():
            self.state = FlowState.STALLED
            self.stalled_since = now

    def check(self, now: float) -> Timeout | None:
        """The failure, once stalled for longer than the bound."""
        if (self.state is FlowState.STALLED and self.stalled_since is not None
                and now - self.stalled_since >= self.stall_s):
            self.state = FlowState.FAILED
            return Timeout(f"rdma://: the peer reposted none of its {self.peer_receives} "
                           f"receives for {self.stall_s:g} s while messages waited to go "
                           "(it stopped reading)")
        return None
