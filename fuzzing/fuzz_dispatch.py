"""Fuzz target: command dispatch, every handler, over a real socket to a real Session.

A daemon's BufferTable, engine and RPC front end run in this process
(:class:`fuzzing.harness.InProcessDaemon`, started once); each input is what a client
sends after its HELLO (the harness says HELLO, then sends the input, then a STATS
probe), or, for an input that starts with a HELLO header, the whole connection.  Every
frame back is a reply or an event, no error is INTERNAL, the probe is answered unless a
fatal error (or, before the handshake is done, any error) closed the connection, and
nothing is logged at ERROR.
Seeds: the requests of docs/protocol.md's captures, with and without their HELLO."""

from __future__ import annotations

import atexit

from fuzzing.driver import instrumented, run

with instrumented():
    # Imported here, not when the harness starts its daemon: atheris adds coverage to
    # the modules imported inside this block (the session, every handler, the engine).
    import rpc_server.server  # noqa: F401
    import transferd.daemon
    import transferd.engine  # noqa: F401
    from fuzzing.harness import InProcessDaemon

_daemon: InProcessDaemon | None = None


def daemon() -> InProcessDaemon:
    global _daemon
    if _daemon is None:
        _daemon = InProcessDaemon().__enter__()
        atexit.register(close)
    return _daemon


def close() -> None:
    """Stop the in-process daemon (a caller that runs inputs itself, like the suite)."""
    global _daemon
    if _daemon is not None:
        d, _daemon = _daemon, None
        d.__exit__()


def test_one_input(raw: bytes) -> None:
    d = daemon()
    # An input that starts with a HELLO header is a whole connection, handshake and all
    # (the session's pre-auth path); any other is what follows the harness's HELLO.
    ex = d.exchange(raw, timeout=30.0, greet=not raw.startswith(b"TD\x00"))
    try:
        ex.check()
        errors = d.take_errors()
        assert not errors, errors
    finally:
        d.reset()
    assert d.alive(), "the daemon no longer serves a fresh client"


def main() -> None:
    run(test_one_input)


if __name__ == "__main__":
    main()
