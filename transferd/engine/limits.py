"""Engine limits shared by the daemon's front end and the engine."""

# Two-sided messages are for small control messages (RPC-style); bulk data
# goes by one-sided writes.
MAX_MESSAGE = 1 << 20
# Messages that arrive before any receive is posted wait here, this many at most.
BACKLOG = 1024
