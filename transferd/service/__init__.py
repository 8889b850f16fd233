"""What one node does for its callers: the interface the RPC server and the inproc client share.

:class:`Service` (service.py) holds one node's buffers, engine, owners, leases,
watchers and names, and has every operation a caller may ask of them;
:class:`Caller` (caller.py) is one caller (an RPC connection, an inproc client).
``rpc_server`` parses frames and calls it; ``client.inproc`` calls it in process.
"""

from .caller import Caller, CallerState
from .ops import Op, Ops
from .service import Admitted, Arrived, End, Service

__all__ = ["Admitted", "Arrived", "Caller", "CallerState", "End", "Op", "Ops", "Service"]
