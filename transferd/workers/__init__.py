"""Workers: a pinned thread with its own event loop per domain group."""

from .worker import Worker

__all__ = ["Worker"]
