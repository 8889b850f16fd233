"""transferd's client library: ``Client`` (asyncio) and ``SyncClient`` (blocking)."""

from transferd.protocol.errors import *  # noqa: F403 - typed errors are part of the API
from transferd.protocol.messages import Tensor
from transferd.protocol.values import MrDesc, NetAddr, Pages, ScatterDst

from .client import Client, RemoteBuffer
from .engine import Completion, MrHandle, PeerGroup
from .leases import Lease
from .shared import SharedBuffer
from .switches import Switches
from .sync import SyncClient
from .watchers import UvmWatcher

__all__ = [
    "Client", "Completion", "Lease", "MrDesc", "MrHandle", "NetAddr", "Pages", "PeerGroup",
    "RemoteBuffer", "ScatterDst", "SharedBuffer", "Switches", "SyncClient", "Tensor", "UvmWatcher",
]
