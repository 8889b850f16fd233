"""The secrets one end of a handshake holds: the one it proves, and one it still accepts.

A rotation replaces a shared secret on every daemon and client of a fleet, one
after another, so for a while some hold the new secret and some the old.  A
:class:`Keyring` is what a daemon holds meanwhile: ``current`` (proved to the
other end, and accepted) and ``previous`` (accepted too, and proved alongside:
the proof that end checks is the one made with the secret it holds).  Empty
``previous``: no rotation in progress.  A value type with no I/O: the daemon
swaps the whole keyring when a reload reads new files, and every handshake
keeps the keyring it started with.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keyring:
    current: bytes = b""
    previous: bytes = b""

    def __post_init__(self) -> None:
        if self.previous and (not self.current or self.previous == self.current):
            # Nothing to accept besides the current one: no second proof to send.
            object.__setattr__(self, "previous", b"")

    @classmethod
    def of(cls, secret: bytes | Keyring | None) -> Keyring:
        """A keyring for ``secret`` (bytes: that one alone; None or b"": none)."""
        if isinstance(secret, Keyring):
            return secret
        return cls(secret or b"")

    def __bool__(self) -> bool:
        return bool(self.current)

    @property
    def accepted(self) -> tuple[bytes, ...]:
        """The secrets a proof from the other end may be made with, current first."""
        if not self.current:
            return ()
        return (self.current, self.previous) if self.previous else (self.current,)

    def match(self, got: object, expected: Callable[[bytes], bytes]) -> bytes | None:
        """The accepted secret ``s`` with ``expected(s) == got``, else None.

        Every accepted secret is compared, each in constant time, so the time
        taken says nothing about which one (if any) matched.
        """
        if type(got) is not bytes:
            return None
        found: bytes | None = None
        for secret in self.accepted:
            if hmac.compare_digest(got, expected(secret)) and found is None:
                found = secret
        return found
