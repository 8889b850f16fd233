"""The TCP Domain: a rail is one TCP connection per peer link (:mod:`.domain`)."""

from .domain import CONNECT_TIMEOUT, MAX_HANDSHAKING, TcpDomain, listen, tune_link

__all__ = ["CONNECT_TIMEOUT", "MAX_HANDSHAKING", "TcpDomain", "listen", "tune_link"]
