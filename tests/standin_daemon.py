"""A daemon with one stand-in "device" (TESTS ONLY): ``python -m tests.standin_daemon ARGS``.

It runs ``rpc-server ARGS`` after registering the device kind ``standin``:
memory with no host view, reached only through a :class:`StandinStream` and
pinned-like host staging, exactly as CUDA memory is reached through its
group's stream and staging.  So the daemon's device path (handlers ->
rpc_server.device_io -> transferd.memory.staging) runs end to end over real
sockets on a machine without a GPU.  ``standin:0`` is never offered by the
product: only this test entry point registers it.

Environment: ``STANDIN_CHUNK`` / ``STANDIN_CHUNKS`` (staging), ``STANDIN_DELAY_S``
(a slow device), ``STANDIN_LIMIT_MIB``, ``STANDIN_HOLD_FILE`` (the stream is held
while that file exists: a test holds the device of another process).
"""

from __future__ import annotations

import os
from typing import Any

from tests.standin_stream import StandinDeviceMemory, StandinStream
from transferd import config as cfgmod
from transferd.memory import DeviceSpec, Memory, register_kind
from transferd.memory.staging import DeviceIO, StagingPool
from transferd.memory.streams import EventWaiter
from transferd.protocol.errors import NotFound, OutOfBounds

STREAM = StandinStream("standin:0", delay_s=float(os.environ.get("STANDIN_DELAY_S", "0")),
                       hold_path=os.environ.get("STANDIN_HOLD_FILE") or None)
POOL = StagingPool(int(os.environ.get("STANDIN_CHUNK", str(256 * 1024))),
                   int(os.environ.get("STANDIN_CHUNKS", "4")), name="staging of standin:0")
IO = DeviceIO(STREAM, EventWaiter(STREAM), POOL)


class StandinMemory(Memory):
    kind = "standin"

    def __init__(self, device: str, size: int) -> None:
        super().__init__(device, size)
        self._mem: StandinDeviceMemory | None = StandinDeviceMemory(size)
        self.io = IO

    @classmethod
    def create(cls, device: str, size: int) -> StandinMemory:
        if device != "standin:0":
            raise NotFound(f"no device {device!r}")
        return cls(device, size)

    @property
    def host_view(self) -> memoryview | None:
        return None

    @property
    def address(self) -> int:
        return self._mem.ptr if self._mem is not None and self.size else 0

    def check(self, offset: int, size: int) -> int:
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


def main() -> None:
    register_kind("standin", StandinMemory)
    limit = int(os.environ.get("STANDIN_LIMIT_MIB", "256")) << 20
    devices = cfgmod.Config.devices

    def with_standin(self: cfgmod.Config) -> list[DeviceSpec]:
        return [*devices(self), DeviceSpec("standin:0", limit, None, 256)]

    cfgmod.Config.devices = with_standin  # type: ignore[method-assign]
    from rpc_server.cli import main as rpc_main

    rpc_main()


if __name__ == "__main__":
    main()
