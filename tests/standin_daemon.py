"""A daemon with one stand-in "device" (TESTS ONLY): ``python -m tests.standin_daemon ARGS``.

It runs ``rpc-server ARGS`` after registering the device kind ``standin``:
memory with no host view, reached only through its staging path (a
:class:`StandinStream` and pinned-like host staging), exactly as CUDA memory
is reached through its group's stream and staging, and made by a
:class:`~transferd.memory.MemorySource` the daemon's buffer table holds, as a
GPU's group makes its memory.  So the daemon's device path (handlers ->
rpc_server.device_io -> transferd.memory.staging) runs end to end over real
sockets on a machine without a GPU.  ``standin:0`` is never offered by the
product: only this test entry point registers it.

Environment: ``STANDIN_DEVICES`` (how many: ``standin:0`` and on, each a group of its
own with its own stream and staging, as a host's GPUs are; default 1),
``STANDIN_CHUNK`` / ``STANDIN_CHUNKS`` (staging of each), ``STANDIN_DELAY_S``
(a slow device), ``STANDIN_LIMIT_MIB``, ``STANDIN_HOLD_FILE`` (the stream is held
while that file exists: a test holds the device of another process),
``STANDIN_FAULT_FILE`` (every copy fails while that file exists: a broken device).
The stream is strict: a copy from or into host memory that is not its pinned
staging is refused, as a GPU would have run it synchronously on the caller.
"""

from __future__ import annotations

import os
from typing import Any

from tests.standin_stream import StandinDeviceMemory, StandinStream
from transferd import config as cfgmod
from transferd.memory import DeviceSpec, Memory, MemorySource, register_kind
from transferd.memory.staging import DeviceIO, StagingPool
from transferd.memory.streams import EventWaiter
from transferd.protocol.errors import NotFound, OutOfBounds


class StandinMemory(Memory):
    kind = "standin"

    def __init__(self, device: str, size: int, io: DeviceIO) -> None:
        super().__init__(device, size)
        self._mem: StandinDeviceMemory | None = StandinDeviceMemory(size)
        self._io = io

    @classmethod
    def create(cls, device: str, size: int) -> StandinMemory:
        raise NotFound(f"{device} memory is made by its group")

    @property
    def host_view(self) -> memoryview | None:
        return None

    @property
    def staging(self) -> DeviceIO | None:
        return self._io if self._mem is not None else None

    @property
    def address(self) -> int:
        return self._mem.ptr if self._mem is not None and self.size else 0

    def device_address(self, offset: int, size: int) -> int:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise OutOfBounds(f"[{offset}, {offset + size}) is outside {self.size} bytes")
        if self._mem is None:
            raise NotFound("freed")
        return self._mem.ptr + offset

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self) -> bool:
        self._mem = None
        self._report_gone()
        return True


class StandinGroup(MemorySource):
    """The stand-in device's group: its stream, event waiter and staging."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.stream = StandinStream(
            self.name, delay_s=float(os.environ.get("STANDIN_DELAY_S", "0")),
            hold_path=os.environ.get("STANDIN_HOLD_FILE") or None,
            fault_path=os.environ.get("STANDIN_FAULT_FILE") or None, strict=True)
        pool = self.stream.pin(StagingPool(int(os.environ.get("STANDIN_CHUNK", str(256 * 1024))),
                                           int(os.environ.get("STANDIN_CHUNKS", "4")),
                                           name=f"staging of {self.name}"))
        self.io = DeviceIO(self.stream, EventWaiter(self.stream), pool)

    @property
    def name(self) -> str:
        return f"standin:{self.index}"

    def create(self, size: int) -> StandinMemory:
        return StandinMemory(self.name, size, self.io)


def main() -> None:
    register_kind("standin", StandinMemory)
    limit = int(os.environ.get("STANDIN_LIMIT_MIB", "256")) << 20
    devices = cfgmod.Config.devices
    groups = [StandinGroup(i) for i in range(int(os.environ.get("STANDIN_DEVICES", "1")))]

    def with_standin(self: cfgmod.Config) -> list[DeviceSpec]:
        return [*devices(self), *(DeviceSpec(g.name, limit, None, 256, g) for g in groups)]

    cfgmod.Config.devices = with_standin  # type: ignore[method-assign]
    from rpc_server.cli import main as rpc_main

    rpc_main()


if __name__ == "__main__":
    main()
