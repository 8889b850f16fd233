"""Two secrets during a rotation, sans-IO: the client handshake and the peer handshake.

Each end holds a Keyring (the secret it proves, and the one it still accepts); the
other end may hold either secret, or both.  Live daemons: test_secret_rotation.py.
"""

from __future__ import annotations

import pytest

from tests.unit.test_connection import handshake, server
from tests.unit.test_peer_handshake import A, B, pump
from transferd.protocol.connection import ClientConnection, ConnState
from transferd.protocol.errors import TransferdError, Unauthorized
from transferd.protocol.keyring import Keyring
from transferd.protocol.peer_handshake import PeerHandshake, Ready, Role

OLD, NEW, OTHER = b"old secret", b"new secret", b"a third secret"


def test_keyring_accepts_current_then_previous_and_nothing_else() -> None:
    k = Keyring(NEW, OLD)
    assert k.accepted == (NEW, OLD) and bool(k)
    assert k.match(NEW + b"!", lambda s: s + b"!") == NEW
    assert k.match(OLD + b"!", lambda s: s + b"!") == OLD
    assert k.match(OTHER, lambda s: s) is None
    assert k.match("not bytes", lambda s: s) is None
    # Same as the current, or beside none: no second secret.
    assert Keyring(NEW, NEW).previous == b"" and Keyring(b"", OLD).accepted == ()
    assert not Keyring() and Keyring.of(None) == Keyring() and Keyring.of(NEW) == Keyring(NEW)


@pytest.mark.parametrize("client_secret", [OLD, NEW])
def test_a_server_in_a_rotation_serves_clients_with_either_secret(client_secret: bytes) -> None:
    c = ClientConnection(secret=client_secret)
    s = server(secret=NEW, previous_secret=OLD)
    ce, se = handshake(c, s)
    assert c.state is s.state is ConnState.READY, (ce, se)
    assert c.server_hello["proof"] != c.server_hello["previous_proof"]


def test_a_server_in_a_rotation_refuses_a_third_secret() -> None:
    c = ClientConnection(secret=OTHER)
    ce, _ = handshake(c, server(secret=NEW, previous_secret=OLD))
    assert isinstance(ce[0].error, Unauthorized)
    assert c.data_to_send() == b""  # no mac derived from it goes out


def test_a_server_without_a_rotation_sends_one_proof() -> None:
    c = ClientConnection(secret=NEW)
    handshake(c, server(secret=NEW))
    assert "previous_proof" not in c.server_hello


def test_a_reload_between_hello_and_auth_changes_the_next_handshake_only() -> None:
    """The secret swapped mid-handshake: this one finishes under what its HELLO proved."""
    c = ClientConnection(secret=OLD)
    s = server(secret=OLD)
    c.start()
    s.receive_data(c.data_to_send())
    s.settings.secret = NEW  # what ServerContext.set_secret does on SIGHUP
    c.receive_data(s.data_to_send())
    s.receive_data(c.data_to_send())
    assert s.state is ConnState.READY
    c2 = ClientConnection(secret=OLD)
    handshake(c2, server(secret=NEW))
    assert c2.state is ConnState.CLOSING


def _peers(ini_secret: bytes | Keyring, res_secret: bytes | Keyring
           ) -> tuple[PeerHandshake, PeerHandshake]:
    ini = PeerHandshake(Role.INITIATOR, A, 0, ini_secret, 0.0,
                        expect=(B.node, B.group, B.addrs[0]))
    res = PeerHandshake(Role.RESPONDER, B, 0, res_secret, 0.0)
    ini.start()
    pump(ini, res)  # HELLO
    pump(res, ini)  # its reply (proofs)
    pump(ini, res)  # AUTH
    pump(res, ini)  # AUTH reply
    return ini, res


@pytest.mark.parametrize(("ini", "res"), [
    (Keyring(NEW, OLD), OLD),   # the initiator rotated first
    (Keyring(NEW, OLD), NEW),
    (OLD, Keyring(NEW, OLD)),   # the responder rotated first
    (NEW, Keyring(NEW, OLD)),
    (Keyring(NEW, OLD), Keyring(NEW, OLD)),
])
def test_peers_link_while_one_or_both_are_in_a_rotation(ini: bytes | Keyring,
                                                        res: bytes | Keyring) -> None:
    i, r = _peers(ini, res)
    assert i.done and r.done
    assert any(isinstance(e, Ready) for e in i.events())


@pytest.mark.parametrize(("ini", "res"), [
    (Keyring(NEW, OLD), OTHER),
    (OTHER, Keyring(NEW, OLD)),
    (OLD, NEW),  # the rotation is over: the old secret alone no longer links
])
def test_peers_without_a_common_secret_do_not_link(ini: bytes | Keyring,
                                                   res: bytes | Keyring) -> None:
    with pytest.raises(TransferdError) as info:
        _peers(ini, res)
    assert isinstance(info.value, Unauthorized), info.value
