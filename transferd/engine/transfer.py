"""A transfer in flight (the type lives in the leaf module :mod:`transferd.parts`)."""

from transferd.parts import Transfer

__all__ = ["Transfer"]
