"""Workers: the loop each domain group runs on (the daemon's, or a pinned thread's)."""

from .slots import Slots
from .worker import KINDS, LoopWorker, ThreadWorker, Worker, make_worker

__all__ = ["KINDS", "LoopWorker", "Slots", "ThreadWorker", "Worker", "make_worker"]
