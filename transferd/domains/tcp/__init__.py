"""The TCP Domain: a rail is one TCP connection per peer link (:mod:`.domain`)."""

from ..strangers import MAX_HANDSHAKING, MAX_PER_SOURCE
from .domain import CONNECT_TIMEOUT, TcpDomain, listen, tune_link

__all__ = ["CONNECT_TIMEOUT", "MAX_HANDSHAKING", "MAX_PER_SOURCE", "TcpDomain", "listen",
           "tune_link"]
