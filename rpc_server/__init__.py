"""The server side of PROTOCOL.md: listeners, sessions, dispatch, the rpc-server CLI."""
