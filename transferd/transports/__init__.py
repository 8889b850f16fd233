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

rdma registers its :class:`TransportKind` under its scheme with :func:`register`.
A connection's kind says what the connection is, so nobody probes the transport:
:meth:`TransportKind.carrier` gives the :class:`~.carriers.Carrier` its frames go out
through (a stream writes them back to back, a message transport one frame one message;
``carrier.fds`` is a descriptor channel where the kind carries SCM_RIGHTS, else None),
and :meth:`TransportKind.identity` who the peer counts as before it authenticates (an
IP address; on a Unix socket its uid).  The RPC session and the client connection are
made with their kind (the listener's or the URL's).
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
