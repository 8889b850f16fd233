"""Owners as ALLOC_BUFFER and PUBLISH name them, and what goes when a connection closes.

The owners themselves (the daemon, a connection, a lease) and what happens when
one goes are the node's (transferd/service/owners.py, :meth:`Service.closed`):
this module reads them from a request's body and hands a closed connection over.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from transferd.service.owners import owner_name

if TYPE_CHECKING:
    from .session import Session

__all__ = ["owner_for", "owner_name", "session_closed"]


def owner_for(session: Session, body: dict[str, Any], default: str) -> Hashable | None:
    """The owner a request asks for: ``owner`` and/or ``lease``, else ``default``."""
    return session.ctx.service.owner_for(session.caller, body.get("owner"), body.get("lease"),
                                         default)


def session_closed(session: Session) -> None:
    """The connection is gone: free what it owned; leases it made stay theirs."""
    session.landings.close()  # staged SETs that never reached their handler
    session.ctx.service.closed(session.caller)
