"""Memory the daemon owns: buffers, and (engine) registered regions."""

from .buffers import PAGE, Buffer, BufferTable

__all__ = ["PAGE", "Buffer", "BufferTable"]
