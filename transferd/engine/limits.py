"""Engine limits shared by the daemon's front end and the engine."""

from transferd.parts import MAX_MESSAGE

# Messages that arrive before any receive is posted wait here, this many at most.
BACKLOG = 1024

__all__ = ["BACKLOG", "MAX_MESSAGE"]
