"""Our end of a peer link we dialled, sans-IO (see :mod:`.peer_link`).

It runs the handshake as initiator, then takes parts to send (WRITE and SEND frames,
each with a token of the Domain's) and gives back their completions as the peer's ACKs
come; while the link is not yet READY, or PAUSED over its send watermark, parts wait in
order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .errors import BadFrame, BadRequest, PeerUnreachable, TransferdError
from .keyring import Keyring
from .peer_handshake import PeerHandshake, PeerIdentity, Role
from .peer_link import (
    HIGH_WATER,
    LOW_WATER,
    LinkEnd,
    LinkInput,
    LinkState,
)
from .peer_wire import ACK, ACK_HEAD, MAX_ERROR_TEXT, ack_error, encode_send, encode_write


class OutboundLink(LinkEnd):
    """Our end of a link we dialled (see the module docstring).

    Parts carry a ``token`` (the Domain's: what to complete); :attr:`completions`
    collects ``(token, error or None)`` as ACKs come, and :meth:`close` hands back
    every token still owed an answer.
    """

    def __init__(self, me: PeerIdentity, rail: int, secret: bytes | Keyring | None, now: float, *,
                 expect: tuple[int, int, bytes], timeout: float,
                 admit: Callable[[PeerIdentity], None] | None = None,
                 high_water: int = HIGH_WATER, low_water: int = LOW_WATER,
                 label: str = "peer link",
                 everyone: tuple[tuple[bytes, ...], ...] | None = None,
                 random: Callable[[int], bytes] | None = None) -> None:
        kw: dict[str, Any] = {} if random is None else {"random": random}
        super().__init__(PeerHandshake(Role.INITIATOR, me, rail, secret, now, timeout=timeout,
                                       expect=expect, admit=admit, everyone=everyone, **kw))
        self.high_water, self.low_water = high_water, low_water
        # Names the link in the errors its parts fail with ("link to NODE rail R").
        self.label = label
        # Parts taken before the link was ready or while it was paused, in order.
        self._waiting: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._pending: dict[tuple[int, int], Any] = {}
        self.completions: list[tuple[Any, TransferdError | None]] = []

    @property
    def nonce(self) -> bytes:
        """The handshake's nonce (a PROBE for this link names it)."""
        return self.hs.nonce

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """Ready, with nothing waiting, in flight or unsent."""
        return (self.state is LinkState.READY and not self._pending and not self._waiting
                and not self.out.queued)

    @property
    def stalled(self) -> bool:
        """Parts wait, or bytes are queued unsent (views of their sources held)."""
        return bool(self._waiting) or self.out.queued > 0

    def connected(self, now: float) -> None:
        """The dial got through: HELLO goes out."""
        self._move(LinkInput.CONNECTED)
        self.hs.start()
        self.out.push(self.hs.data_to_send())

    def probe(self, token: bytes, now: float) -> None:
        """Without a cluster secret: the token a PROBE brought to our listener."""
        if self.state is not LinkState.HANDSHAKE:
            return
        try:
            self.hs.probe(token, now)
        except TransferdError as exc:
            self._fail(exc)
            return
        self._after_handshake_step()

    # -- parts ----------------------------------------------------------------------------

    def write(self, token: Any, op: int, part: int, rkey: int, addrs: list[int],
              lens: list[int], src: Sequence[memoryview], imm: int | None,
              span: Sequence[int] | None = None, wid: int | None = None,
              again: bool = False) -> None:
        """Send a WRITE of ``src`` (the pages' bytes, as views: never copied)."""
        if self.state is LinkState.READY:
            self._pending[(op, part)] = token
            out = self.out
            out.push(encode_write(op, part, rkey, addrs, lens, imm, span, wid, again))
            for v in src:
                out.push(v)
            if out.queued > self.high_water:
                self._move(LinkInput.HOLD)
        elif self.state is LinkState.CLOSED:
            self.completions.append((token, self._closed_error()))
        else:
            self._waiting.append((self.write, (token, op, part, rkey, addrs, lens, src, imm,
                                               span, wid, again)))

    def send(self, token: Any, op: int, part: int, message: bytes | memoryview) -> None:
        """Send a SEND (a two-sided message); completed when the peer's client has it."""
        if self.state is LinkState.READY:
            self._pending[(op, part)] = token
            self.out.push(encode_send(op, part, len(message)))
            self.out.push(message)
            if self.out.queued > self.high_water:
                self._move(LinkInput.HOLD)
        elif self.state is LinkState.CLOSED:
            self.completions.append((token, self._closed_error()))
        else:
            self._waiting.append((self.send, (token, op, part, message)))

    def forget(self, op: int, part: int) -> Any:
        """Stop waiting for the ACK of ``(op, part)`` (its transfer ended); its token."""
        return self._pending.pop((op, part), None)

    def sent(self, n: int) -> None:
        """``n`` bytes of :attr:`out` went; below the low watermark a paused link goes on."""
        self.out.sent(n)
        if self.state is LinkState.PAUSED and self.out.queued <= self.low_water:
            self._move(LinkInput.RELEASE)
            self._ready()

    def _ready(self) -> None:
        waiting = self._waiting
        while waiting and self.state is LinkState.READY:
            fn, args = waiting.popleft()
            fn(*args)

    def _error_of(self, exc: TransferdError) -> TransferdError:
        # A configuration mismatch stays a BAD_REQUEST (another rail count, say); the
        # rest is a link that could not be made or went wrong: PEER_UNREACHABLE.
        kind = BadRequest if type(exc) is BadRequest else PeerUnreachable
        return kind(f"{self.label}: {exc.message}")

    def _closed_error(self) -> TransferdError:
        """What a part given to a closed link fails with (another rail may take it)."""
        err = self.error
        if type(err) is PeerUnreachable or type(err) is BadRequest:
            return err
        return PeerUnreachable(f"{self.label} is closed{': ' + err.message if err else ''}")

    def _closing(self, error: TransferdError | None) -> None:
        self.out.clear()
        # What it held fails with the reason it closed (a transfer's own TIMEOUT, say).
        err = error or self._closed_error()
        for _, args in self._waiting:
            self.completions.append((args[0], err))
        self._waiting.clear()
        for token in self._pending.values():
            self.completions.append((token, err))
        self._pending.clear()

    # -- the peer's ACKs -------------------------------------------------------------------

    def _authenticated(self) -> None:
        # ACKs are 16 bytes (an error's message at most 4 KiB more).
        self._buf = bytearray(64 * 1024)
        self._view = memoryview(self._buf)

    def _frames(self) -> None:
        if self.state is LinkState.SETUP:
            self._setup_frames()
            return
        buf = self._buf
        assert buf is not None
        start, end = self._start, self._end
        pending, done = self._pending, self.completions
        unpack = ACK_HEAD.unpack_from
        try:
            while end - start >= 16:
                cmd, status, mlen, part, op = unpack(buf, start)
                if cmd != ACK:
                    raise BadFrame(f"peer frame 0x{cmd:02x} on a link that takes ACKs only")
                if status:
                    if mlen > MAX_ERROR_TEXT:
                        raise BadFrame(f"an ACK with a {mlen}-byte message (at most "
                                       f"{MAX_ERROR_TEXT})")
                    if end - start < 16 + mlen:
                        break
                    error = ack_error(status, buf[start + 16:start + 16 + mlen])
                    start += 16 + mlen
                elif mlen:
                    # (Read as 16 bytes, its text would be taken for the next ACKs.)
                    raise BadFrame(f"an ok ACK announcing a {mlen}-byte message")
                else:
                    error = None
                    start += 16
                token = pending.pop((op, part), None)
                if token is not None:
                    done.append((token, error))
        except TransferdError as exc:
            self._start = start
            self.close(self._error_of(exc))
            return
        self._start = start


__all__ = ["OutboundLink"]
