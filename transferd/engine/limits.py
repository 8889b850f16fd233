"""Engine limits shared by the daemon's front end and the engine."""

from transferd.parts import MAX_MESSAGE

# Messages that arrive before any receive is posted wait here, this many at most.
BACKLOG = 1024
# ...and this many bytes at most, all of them together (1024 messages of up to
# MAX_MESSAGE each would be 1 GiB outside any memory limit).
BACKLOG_BYTES = 64 << 20

__all__ = ["BACKLOG", "BACKLOG_BYTES", "MAX_MESSAGE"]
