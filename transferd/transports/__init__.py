"""How frames travel: one registry of transports by URL scheme, for server and client.

``listen(url, factory, options)`` opens a listener, ``connect(url, factory,
options)`` a connection; both look the URL's scheme up in :data:`REGISTRY`.
Built in (PROTOCOL.md, "Transports"):

| scheme | carrier | kind | descriptors |
|---|---|---|---|
| ``tcp://HOST:PORT`` | the loop's TCP transport, TCP_NODELAY | stream | no |
| ``tls://HOST:PORT`` | the loop's TCP transport with the standard ``ssl`` | stream | no |
| ``unix:///PATH`` | :class:`~.sockets.SocketTransport` over SOCK_STREAM | stream | yes |
| ``seqpacket:///PATH`` | :class:`~.sockets.SocketTransport` over SOCK_SEQPACKET | message | yes |
| ``rdma://HOST:PORT`` | :mod:`~.rdma`: an RC queue pair, set up over TCP | message | no |

rdma registers its :class:`TransportKind` under its scheme
with :func:`register`.  A protocol can ask its transport what it is:
``get_extra_info("transferd_message")`` is true on a message transport (write
whole frames with ``transport.write_frame(head, payload, payload_len)``), and
``get_extra_info("transferd_fds")`` is true where ``send_fds`` /
``take_fds`` carry file descriptors (SCM_RIGHTS).
"""

from __future__ import annotations

from .base import (
    Endpoint,
    Listener,
    TransportKind,
    TransportOptions,
    connect,
    get,
    listen,
    parse,
    register,
    schemes,
)
from .builtin import register_builtins
from .continuation import HELLO_MESSAGE, MIN_MAX_MESSAGE
from .sockets import SocketTransport

register_builtins()

# rdma:// (RC SEND/RECV through pyverbs): pyverbs is imported only when one is opened.
from .rdma import RdmaKind  # noqa: E402

register(RdmaKind())

__all__ = [
    "HELLO_MESSAGE",
    "MIN_MAX_MESSAGE",
    "Endpoint",
    "Listener",
    "SocketTransport",
    "TransportKind",
    "TransportOptions",
    "connect",
    "get",
    "listen",
    "parse",
    "register",
    "schemes",
]
