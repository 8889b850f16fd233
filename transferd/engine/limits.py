"""Engine limits shared by the daemon's front end and the engine."""

from transferd.parts import MAX_MESSAGE

# (Messages waiting for a receive are bounded by engine.recv_waiting_max and
# charged to the host memory limit: see transferd/engine/receives.py.)

__all__ = ["MAX_MESSAGE"]
