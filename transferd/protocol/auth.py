"""Authentication (PROTOCOL.md, "Authentication"): the hmac-sha256 proofs, the token method.

Pure functions: no I/O, no clock.  The secret is bytes (a file's contents with
leading and trailing whitespace removed); the ``token`` method sends the same
secret as a string.
"""

from __future__ import annotations

import hashlib
import hmac
import os

HMAC_SHA256 = "hmac-sha256"
TOKEN = "token"
METHODS = (HMAC_SHA256, TOKEN)

NONCE_SIZE = 32
MAC_SIZE = 32
SERVER_LABEL = b"transferd-server-v1"
CLIENT_LABEL = b"transferd-client-v1"

# Until a connection is authenticated: HELLO and AUTH only, each with at most
# this much body and no payload (answered from the header alone otherwise).
PRE_AUTH_MAX_BODY = 4096


def secret_from_text(text: str | bytes) -> bytes:
    """The secret a file or variable holds: its contents, outer whitespace removed."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    return raw.strip()


def fresh_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)


def server_proof(secret: bytes, nonce: bytes, challenge: bytes) -> bytes:
    """HMAC-SHA256(secret, "transferd-server-v1" + nonce + challenge)."""
    return hmac.new(secret, SERVER_LABEL + nonce + challenge, hashlib.sha256).digest()


def client_mac(secret: bytes, challenge: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256(secret, "transferd-client-v1" + challenge + nonce)."""
    return hmac.new(secret, CLIENT_LABEL + challenge + nonce, hashlib.sha256).digest()


def same(a: bytes, b: bytes) -> bool:
    """Constant-time comparison."""
    return hmac.compare_digest(a, b)
