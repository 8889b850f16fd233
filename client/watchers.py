"""The client half of UVM watchers: ``alloc_uvm_watcher(callback)``.

The daemon watches a 64-bit word and sends an EVENT for every change it
sees; ``callback(old, new)`` runs on the client's event loop (SyncClient:
its loop thread).  The word is in a shared page on the daemon's host (or in a
daemon buffer); on that host this process can reach it too:

- ``w.word()``: a one-element numpy uint64 view of the word, mapped here;
  ``w.set(v)`` / ``w.bump()`` store into it (the host-side producer);
- ``w.device_pointer()``: the page pinned and mapped for the current CUDA
  device (``cudaHostRegister`` with ``cudaHostRegisterMapped``), the word's
  address for a kernel (also one captured in a CUDA graph), which writes it
  with a volatile store followed by ``__threadfence_system()``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transferd.protocol.constants import Command
from transferd.protocol.errors import BadRequest
from transferd.protocol.frames import Frame

from .replies import reply_uint

if TYPE_CHECKING:
    import numpy as np

    from transferd.protocol.values import MrDesc, Pages

    from .buffers import RemoteBuffer
    from .calls import Calls
    from .engine import Completion, EngineEvents, MrHandle

Change = Callable[[int, int], None]

# The bump a kernel does (``cupy.RawKernel(BUMP_KERNEL, "transferd_bump")``,
# arguments: the word's device pointer and the value, both uint64): a
# volatile store, then a fence so the host sees it before later writes.
BUMP_KERNEL = r"""
extern "C" __global__ void transferd_bump(unsigned long long addr, unsigned long long value) {
    *(volatile unsigned long long *)addr = value;
    __threadfence_system();
}
"""

# cudaHostRegisterPortable | cudaHostRegisterMapped (not exported by every CuPy).
_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02


class UvmWatcher:
    """A watcher of this client's daemon (see the module's doc)."""

    def __init__(self, body: dict[str, Any], seq: int, callback: Change) -> None:
        self.id = int(body["watcher"])
        self.seq = seq
        self.value = int(body.get("value", 0))
        self.path: str | None = body.get("path")
        self.offset = int(body.get("offset", 0))
        self.page_size = int(body.get("page_size", 0))
        self.callback = callback
        self.changes = 0
        self._map: mmap.mmap | None = None
        self._words: np.ndarray | None = None
        self._registered: int | None = None

    def _event(self, frame: Frame) -> None:
        b = frame.body
        old, new = int(b.get("old", 0)), int(b.get("new", 0))
        self.value = new
        self.changes += 1
        self.callback(old, new)

    # -- reaching the word from this process -------------------------------------------

    def word(self) -> np.ndarray:
        """The word, mapped into this process (only on the daemon's host)."""
        if self._words is None:
            import numpy as np

            if not self.path:
                raise BadRequest("this watcher's word is in a daemon buffer, not a shared page")
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                size = os.fstat(fd).st_size
                if size < self.offset + 8:
                    raise BadRequest(f"{self.path} holds {size} bytes, not the word")
                self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            self._words = np.frombuffer(self._map, dtype=np.uint64)
        i = self.offset // 8
        return self._words[i : i + 1]

    def set(self, value: int) -> None:
        """Store ``value`` into the word (one aligned 8-byte store)."""
        self.word()[0] = value

    def bump(self, n: int = 1) -> int:
        """Add ``n`` (this process must be the word's only writer); returns the new value."""
        w = self.word()
        v = (int(w[0]) + n) & 0xFFFFFFFFFFFFFFFF
        w[0] = v
        return v

    def device_pointer(self) -> int:
        """The word's address for a kernel of the current CUDA device (needs CuPy)."""
        import numpy as np
        from cupy.cuda import runtime

        words = self.word()
        if self._registered is None:
            base = int(np.frombuffer(self._map, dtype=np.uint8).ctypes.data)  # type: ignore[arg-type]
            runtime.hostRegister(base, len(self._map), _HOST_REGISTER_PORTABLE_MAPPED)  # type: ignore[arg-type]
            self._registered = base
        host = int(words.ctypes.data)
        return int(runtime.pointerGetAttributes(host).devicePointer)

    def close(self) -> None:
        """Unmap the word here (the daemon's watcher ends with the connection)."""
        if self._registered is not None:
            with contextlib.suppress(Exception):
                from cupy.cuda import runtime

                runtime.hostUnregister(self._registered)
            self._registered = None
        self._words = None
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None

    def __repr__(self) -> str:
        return f"<UvmWatcher {self.id} value={self.value} changes={self.changes}>"


class Watchers:
    """``alloc_uvm_watcher`` of a Client: its EVENTs are routed by ``events``."""

    def __init__(self, client: Calls, events: EngineEvents) -> None:
        self._client = client
        self._events = events

    async def alloc_uvm_watcher(
        self, callback: Change, *, buffer: RemoteBuffer | int | None = None, offset: int = 0,
    ) -> UvmWatcher:
        """A word the daemon watches; ``callback(old, new)`` on every change it sees.

        Without ``buffer`` the word is in a shared page (``UvmWatcher.word()``,
        ``device_pointer()``); with one it is the 8-byte aligned word at
        ``offset`` of that daemon buffer.
        """
        client = self._client
        body: dict[str, Any] = {}
        if buffer is not None:
            body = {"buffer": getattr(buffer, "id", buffer), "offset": offset}
        if client._queued() or client.conn.failed:
            await client.flush()  # a flush point, like every synchronous call
        conn = client.conn
        fut = conn.request(Command.ALLOC_UVM_WATCHER, body, timeout=client.timeout)
        seq = conn.last_seq
        box: list[UvmWatcher] = []
        early: list[Frame] = []

        def route(frame: Frame) -> None:
            # The reply is sent before any EVENT; kept in order regardless.
            if box:
                box[0]._event(frame)
            else:
                early.append(frame)

        self._events.watchers[seq] = route
        try:
            reply = await fut
            reply_uint(reply, "watcher")  # (a lying server's reply: BAD_FRAME)
            reply_uint(reply, "value", 0)
        except BaseException:
            self._events.watchers.pop(seq, None)
            raise
        w = UvmWatcher(reply.body, seq, callback)
        box.append(w)
        for f in early:
            w._event(f)
        return w

    async def arm_paged_writes(
        self, watcher: UvmWatcher | int, value: int, page_len: int, imm: int | None,
        src: tuple[MrHandle, Pages], dst: tuple[MrDesc, Pages], *,
        timeout: float | None = None, verify: bool | None = None,
        traceparent: str | None = None,
    ) -> Completion:
        """ARM_PAGED_WRITES: the daemon submits this paged write itself once ``watcher``'s
        word reads ``value`` or more (at once if it does already), with no round trip
        through this client.  Checked whole now: a bad one raises here, as the same
        PAGED_WRITES would fail.  Returns its Completion (the write's end; ``cancel()``
        drops it while armed); it fails with NotFound when the watcher ends first.
        ``timeout`` counts from the fire."""
        from .engine import Completion, _ms, _tag, registered

        client = self._client
        body: dict[str, Any] = {"watcher": getattr(watcher, "id", watcher), "value": value,
                                "page_len": page_len, "imm": imm,
                                "src": [src[0].id, src[1].to_wire()],
                                "dst": [dst[0].to_wire(), dst[1].to_wire()]}
        _tag(body, verify, traceparent)
        if timeout is not None:
            body["timeout_ms"] = _ms(timeout)
        if client._queued() or client.conn.failed:
            await client.flush()
        conn = client.conn
        fut = conn.request(Command.ARM_PAGED_WRITES, body, timeout=client.timeout)
        seq = conn.last_seq
        c = Completion(Command.ARM_PAGED_WRITES.name)
        c._origin = (client, seq)
        # Before the reply: a word already at the value fires at once.
        self._events.waiting[seq] = c
        await registered(fut, c, self._events, seq)
        return c
