"""transferd's client library: ``Client`` (asyncio) and ``SyncClient`` (blocking)."""

from transferd.discovery.records import Change, Peer
from transferd.protocol.errors import *  # noqa: F403 - typed errors are part of the API
from transferd.protocol.messages import Tensor
from transferd.protocol.values import MrDesc, NetAddr, Pages, ScatterDst

from .client import Client, RemoteBuffer
from .engine import Completion, MrHandle, PeerGroup
from .leases import Lease
from .names import NameInfo, Published, SyncWatch, Watch
from .shared import SharedBuffer
from .switches import Switches
from .sync import SyncClient
from .watchers import UvmWatcher

__all__ = [
    "Change", "Client", "Completion", "Lease", "MrDesc", "MrHandle", "NameInfo", "NetAddr",
    "Pages", "Peer", "PeerGroup", "Published", "RemoteBuffer", "ScatterDst", "SharedBuffer",
    "Switches", "SyncClient", "SyncWatch", "Tensor", "UvmWatcher", "Watch",
]
