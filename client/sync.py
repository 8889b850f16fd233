"""SyncClient: the same API, blocking, for code that has no event loop.

It runs a private event loop in a daemon thread and forwards each call to the
async :class:`Client` there.  Queued reads return ``concurrent.futures.Future``.

What CuPy keeps per thread (the current device and stream) is resolved in the
caller's thread before a call is handed over: an async copy without
``stream=`` goes on the caller's current stream of the caller's current
device, and CUDA IPC registration exports the memory from the caller's
thread (client/devices.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from transferd.protocol.errors import ConnectionLost

from .client import Client, client_class
from .devices import CudaExport, capture_stream, export_cuda
from .engine import Completion
from .names import SyncWatch
from .tracing import current_traceparent

T = TypeVar("T")


# Submits whose traceparent defaults to the caller's current span (client/tracing.py).
_TRACED = frozenset({"submit_single_write", "submit_paged_writes", "submit_scatter",
                     "submit_barrier", "submit_send", "arm_paged_writes"})


class SyncClient:
    def __init__(self, url: str, *, token: str | None = None, **kw: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="transferd-client", daemon=True
        )
        self._thread.start()
        # Set by the first close: a call after it (from any thread) is ConnectionLost.
        self._closing = False
        # Set once that close is over: a close another thread asks meanwhile returns
        # then, not while the engine (inproc://) or the connection is still open.
        self._closed = threading.Event()
        # Calls handed to the loop and not yet answered (under _lock): a call another
        # thread handed over as the loop stopped would never be answered; the close
        # ends those with ConnectionLost once the loop is closed.
        self._lock = threading.Lock()
        self._waiting: set[concurrent.futures.Future[Any]] = set()
        # inproc://: the engine runs here, on this client's loop thread.
        self._client: Client = client_class(url)(url, token=token, **kw)
        try:
            self._run(self._client.open())
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def connect(cls, url: str, token: str | None = None, **kw: Any) -> SyncClient:
        return cls(url, token=token, **kw)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            try:
                fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            except RuntimeError:  # the loop is closed: so is this client
                coro.close()
                raise ConnectionLost("this SyncClient is closed") from None
            self._waiting.add(fut)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            if self._closing:  # cut short by a close (from another thread)
                raise ConnectionLost("this SyncClient closed while the call waited") from None
            raise
        finally:
            self._waiting.discard(fut)
            # The error it raised holds this frame (its traceback), the frame held the
            # future and the future the error: a reference cycle per failed call.
            del fut

    def _call_soon(self, fn: Callable[[], T]) -> T:
        """Run a plain method on the loop thread and return its result."""

        async def call() -> T:
            return fn()

        return self._run(call())

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr
        if name in _TRACED:
            # The current OpenTelemetry span is this thread's, not the loop thread's.
            def traced(*a: Any, **k: Any) -> Any:
                if k.get("traceparent") is None:
                    k["traceparent"] = current_traceparent()
                return self._run(attr(*a, **k))
            return traced
        if asyncio.iscoroutinefunction(attr):
            return lambda *a, **k: self._run(attr(*a, **k))
        return lambda *a, **k: self._call_soon(lambda: attr(*a, **k))

    def get_tensor_async(self, t: Any, out: Any = None) -> concurrent.futures.Future[Any]:
        cf: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def queue() -> None:
            fut = self._client.get_tensor_async(t, out)
            fut.add_done_callback(lambda f: _settle(cf, f))

        self._call_soon(queue)
        return cf

    def copy_from_device(self, t: Any, src: Any, *, stream: Any = None) -> None:
        """:meth:`Client.copy_from_device` on the caller's stream (this thread's current
        one when ``stream`` is None)."""
        # (In process there is no staging to copy through: the client refuses the copy,
        # typed, and no stream needs resolving, nor CuPy importing, for that.)
        s = stream if self._client.in_process else capture_stream(stream)
        self._run(self._client.copy_from_device(t, src, stream=s))

    def copy_to_device(self, dst: Any, t: Any, *, stream: Any = None) -> None:
        """:meth:`Client.copy_to_device` on the caller's stream (as copy_from_device)."""
        s = stream if self._client.in_process else capture_stream(stream)
        self._run(self._client.copy_to_device(dst, t, stream=s))

    def register_cuda_memory(self, mem: Any, *, device: str | None = None) -> Any:
        """:meth:`Client.register_cuda_memory`, exported in the caller's thread."""
        if self._client.in_process:  # the engine is here: the array is registered as it is
            return self._run(self._client.register_cuda_memory(mem, device=device))
        export = mem if isinstance(mem, CudaExport) else export_cuda(mem)
        return self._run(self._client.register_cuda_memory(export, device=device))

    def wait(self, completion: Completion, timeout: float | None = None) -> Any:
        """Block until a submit's Completion (or an immediate count) is done.

        Returns its result or raises its typed error; ``timeout`` raises TimeoutError.
        """
        return self._run(completion.wait(timeout))

    def cancel(self, completion: Completion) -> bool:
        """CANCEL a submit or expectation; True if that is how it ended (see Completion.cancel)."""
        return self._run(completion.cancel())

    def watch(self, prefix: str = "", *, initial: bool = True) -> SyncWatch:
        """``for change in sc.watch(prefix)``, blocking; ``with`` ends it on the daemon."""
        return SyncWatch(self._run, self._call_soon(
            lambda: self._client.watch(prefix, initial=initial)))

    def close(self) -> None:
        """Close the client (once; from any thread): a call another thread is blocked in
        ends, with its Completion's error or ConnectionLost, before the loop stops."""
        with self._lock:
            first, self._closing = not self._closing, True
        if not first:
            # Another thread's close is under way: over when this returns.  (Never waited
            # for on the loop's own thread, which that close needs.)
            if threading.current_thread() is not self._thread:
                self._closed.wait()
            return
        try:
            self._run(self._close())
        finally:
            self._stop_loop()
            self._closed.set()

    async def _close(self) -> None:
        await self._client.close()
        # Other threads' calls still on the loop: what the close ended wakes (give it a
        # moment); the rest is cancelled, so that no thread waits on a stopped loop.
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me]
        if others:
            _, left = await asyncio.wait(others, timeout=0.2)
            for t in left:
                t.cancel()
            if left:
                await asyncio.wait(left, timeout=5)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        with self._lock:
            self._loop.close()
            # Handed over as the loop stopped: never to be answered (see __init__).
            for fut in list(self._waiting):
                if not fut.done() and fut.set_running_or_notify_cancel():
                    fut.set_exception(ConnectionLost("this SyncClient closed before the "
                                                     "call ran"))

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _settle(cf: concurrent.futures.Future[Any], f: asyncio.Future[Any]) -> None:
    """Carry an asyncio future's outcome, cancellation included, to a blocking caller."""
    if f.cancelled():
        cf.cancel()
        cf.set_running_or_notify_cancel()
    elif f.exception() is not None:
        cf.set_exception(f.exception())
    else:
        cf.set_result(f.result())
