"""transferd's client library: ``Client`` (asyncio) and ``SyncClient`` (blocking)."""

from transferd.protocol.errors import *  # noqa: F403 - typed errors are part of the API
from transferd.protocol.messages import Tensor

from .client import Client, RemoteBuffer, Switches
from .sync import SyncClient

__all__ = ["Client", "RemoteBuffer", "Switches", "SyncClient", "Tensor"]
