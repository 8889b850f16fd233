"""Buffers as the client names them: on the daemon, by id."""

from __future__ import annotations

from dataclasses import dataclass

from transferd.protocol.errors import OutOfBounds
from transferd.protocol.messages import Tensor


@dataclass(frozen=True)
class RemoteBuffer:
    """A buffer on the daemon, named by id."""

    id: int
    size: int
    device: str = "cpu"

    def tensor(self, offset: int = 0, size: int | None = None) -> Tensor:
        if size is None:
            size = self.size - offset
        if offset < 0 or size < 0 or offset + size > self.size:
            raise OutOfBounds(
                f"[{offset}, {offset + size}) is outside buffer {self.id} of {self.size} bytes"
            )
        return Tensor(self.id, offset, size)
