"""Replies over TLS, handed to the SSL layer a chunk at a time as the connection drains.

The SSL layer encrypts whatever it is given at once, into memory of its own: a
GET reply written whole to a TLS transport costs a copy the size of the reply
(up to ``server.max_reply``) for as long as the client does not read it, and a
client that pipelines GETs and never reads got one such copy per reply the
daemon wrote before its write buffer reported full (32 MiB for two 16 MiB
replies, measured).  :class:`ChunkedOutput` keeps the frames' views (header,
body, payload: no copy) in a queue and writes at most :data:`TLS_CHUNK` bytes
while the transport's buffer is below its high mark (set to :data:`TLS_CHUNK`);
the session pumps it again when the transport drains (``resume_writing``) and stops reading the
connection while anything is queued, so one slow TLS reader holds at most about
two chunks of ciphertext (one in the SSL layer, one in the socket's transport)
besides the buffer memory its reply refers to (held by Refs, released once the
last byte went to the SSL layer).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Sequence

from transferd.memory import Ref, release_all

# The most plaintext handed to the SSL layer at once.
TLS_CHUNK = 256 * 1024


class ChunkedOutput:
    def __init__(self, transport: asyncio.Transport, chunk: int = TLS_CHUNK) -> None:
        self.transport = transport
        self.chunk = chunk
        # The SSL transport pauses its protocol once its buffer (plaintext waiting plus
        # ciphertext not yet given to the socket's transport) reaches the high mark, and
        # resumes it at the low one.  pump() writes while the buffer is below the high
        # mark, so the write that stops it is the one that paused the protocol: a
        # resume_writing (and the next pump) always follows.  (With uvloop's default
        # 512 KiB mark and a stop at one chunk, the pause never came: a stall.)
        transport.set_write_buffer_limits(high=chunk, low=chunk // 4)
        self._high = chunk
        self._queue: deque[memoryview] = deque()
        self._hold: list[Ref] = []

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    def send(self, views: Iterable[bytes | memoryview], hold: Sequence[Ref] = ()) -> bool:
        """Queue one frame's pieces after what is queued; write what fits now.

        True while something is still queued (the caller stops reading until a
        later :meth:`pump` returns False).
        """
        for v in views:
            m = v if type(v) is memoryview else memoryview(v)
            if m.ndim != 1 or m.itemsize != 1:
                m = m.cast("B")
            if len(m):
                self._queue.append(m)
        self._hold.extend(hold)
        return self.pump()

    def pump(self) -> bool:
        """Write chunks while the transport's buffer is below one chunk; True if more wait."""
        t = self.transport
        q = self._queue
        while q and not t.is_closing() and t.get_write_buffer_size() < self._high:
            budget = self.chunk
            pieces: list[memoryview] = []
            while q and budget:
                v = q[0]
                if len(v) <= budget:
                    pieces.append(q.popleft())
                    budget -= len(v)
                else:
                    pieces.append(v[:budget])
                    q[0] = v[budget:]
                    budget = 0
            t.writelines(pieces)  # encrypted (copied) by the SSL layer now
        if q and t.is_closing():
            self.close()
        if not q:
            # Every byte is in the SSL layer's own memory: the buffers may go.
            hold, self._hold = self._hold, []
            release_all(hold)
            return False
        return True

    def close(self) -> None:
        """The connection is gone: drop what is queued, let go of its memory."""
        self._queue.clear()
        hold, self._hold = self._hold, []
        release_all(hold)
