"""The queue pair set-up messages of the verbs Domain: byte forms and their checks."""

from __future__ import annotations

import dataclasses

import pytest

from transferd.protocol.errors import BadRequest
from transferd.rdma.exchange import (
    MAGIC,
    QpInfo,
    RailSetup,
    check_pair,
    path_mtu,
)

GID = bytes.fromhex("fe800000000000000202c9fffe000001")


def qp(qpn: int = 0x1234, mtu: int = 5, lid: int = 0, gid: bytes = GID) -> QpInfo:
    return QpInfo(qpn, 0xABCDE, lid, 1, gid, 3, mtu)


def setup(rail: int = 0, rails: int = 2, **kw: object) -> RailSetup:
    fields = dict(node=0xDEADBEEF_0000_0001, group=0, rail=rail, rails=rails,
                  send_qp=qp(0x10), write_qp=qp(0x11), recv_depth=256, write_depth=1024,
                  recv_len=65536, max_msg=1 << 30)
    fields.update(kw)
    return RailSetup(**fields)  # type: ignore[arg-type]


def test_round_trip() -> None:
    s = setup()
    raw = s.to_bytes()
    assert raw.startswith(MAGIC)
    assert RailSetup.from_bytes(raw) == s
    assert QpInfo.from_bytes(s.send_qp.to_bytes()) == s.send_qp


def test_the_read_depth_travels_and_a_version_1_peer_is_refused() -> None:
    """Version 2 carries the READs each end serves at once (its max_dest_rd_atomic), so
    the other keeps its max_rd_atomic within it; a version-1 set-up (no such field:
    0 in its pad byte) is refused with the reason, never read as depth 0."""
    s = setup(read_depth=8)
    raw = bytearray(s.to_bytes())
    assert RailSetup.from_bytes(bytes(raw)).read_depth == 8
    raw[4] = 1
    raw[7] = 0
    with pytest.raises(BadRequest, match="version 1"):
        RailSetup.from_bytes(bytes(raw))


def test_gid_text_matches_pyverbs_form() -> None:
    text = qp().gid_text
    assert text == "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    assert QpInfo.gid_from_text(text) == GID
    for bad in ("fe80::1", "zz80:0000:0000:0000:0202:c9ff:fe00:0001"):
        with pytest.raises(BadRequest):
            QpInfo.gid_from_text(bad)


@pytest.mark.parametrize("cut", [0, 1, 30, -1])
def test_truncated_or_padded_is_refused(cut: int) -> None:
    raw = setup().to_bytes()
    with pytest.raises(BadRequest):
        RailSetup.from_bytes(raw[:cut] if cut >= 0 else raw + b"\0")


def test_bad_magic_and_version() -> None:
    raw = bytearray(setup().to_bytes())
    with pytest.raises(BadRequest, match="magic"):
        RailSetup.from_bytes(b"XXXX" + bytes(raw[4:]))
    raw[4] = 9
    with pytest.raises(BadRequest, match="version 9"):
        RailSetup.from_bytes(bytes(raw))


@pytest.mark.parametrize("change", [
    {"qpn": 0}, {"qpn": 1 << 24}, {"psn": 1 << 24}, {"lid": 1 << 16}, {"port": 0},
    {"gid": b"\0" * 15}, {"mtu": 0}, {"mtu": 6}, {"gid_index": 256},
])
def test_qp_fields_are_range_checked(change: dict[str, object]) -> None:
    with pytest.raises(BadRequest):
        dataclasses.replace(qp(), **change)  # type: ignore[arg-type]


@pytest.mark.parametrize("change", [
    {"rail": 2}, {"rails": 5}, {"recv_depth": 0}, {"write_depth": 1 << 16},
    {"recv_len": 1}, {"max_msg": 100}, {"read_depth": 0}, {"read_depth": 256},
])
def test_setup_fields_are_range_checked(change: dict[str, object]) -> None:
    with pytest.raises(BadRequest):
        setup(**change)


def test_every_qp_field_in_the_wire_form_is_checked_on_the_way_in() -> None:
    # A QPN of 0 smuggled into valid bytes is refused when read.
    raw = bytearray(setup().to_bytes())
    head = len(raw) - 2 * len(qp().to_bytes())
    raw[head : head + 4] = b"\0\0\0\0"
    with pytest.raises(BadRequest, match="queue pair number"):
        RailSetup.from_bytes(bytes(raw))


def test_path_mtu_is_the_smaller() -> None:
    assert path_mtu(qp(mtu=5), qp(mtu=3)) == 3


def test_check_pair() -> None:
    check_pair(setup(), setup())
    with pytest.raises(BadRequest, match="rail count mismatch"):
        check_pair(setup(), setup(rails=3))
    with pytest.raises(BadRequest, match="rail 1"):
        check_pair(setup(0), setup(1))
    with pytest.raises(BadRequest, match="neither a LID nor a GID"):
        check_pair(setup(), setup(write_qp=qp(gid=b"\0" * 16)))
    check_pair(setup(), setup(write_qp=qp(gid=b"\0" * 16, lid=7)))  # InfiniBand: a LID


def test_channel_setup_round_trip_and_checks() -> None:
    from transferd.rdma.exchange import ChannelSetup

    c = ChannelSetup(qp(), 32, 256 * 1024)
    raw = c.to_bytes()
    assert len(raw) == ChannelSetup.SIZE and ChannelSetup.from_bytes(raw) == c
    with pytest.raises(BadRequest, match="magic"):
        ChannelSetup.from_bytes(b"HTTP" + raw[4:])
    with pytest.raises(BadRequest, match="bytes"):
        ChannelSetup.from_bytes(raw[:-1])
    for depth, slot in ((0, 65536), (32, 100), (32, 1 << 30)):
        with pytest.raises(BadRequest):
            ChannelSetup(qp(), depth, slot)


def test_a_verbs_region_descriptor_round_trips_with_one_nic_rkey_per_rail() -> None:
    """An MrDesc of a verbs group: the region's address and each NIC's own 32-bit rkey
    (from ibv_reg_mr), paired with that rail's address; the byte form carries them all."""
    from transferd.protocol.values import MrDesc, NetAddr

    rails = (("198.18.0.1", 7001), ("198.18.1.1", 7002))
    addr = NetAddr(0xDEADBEEF, 0, rails)
    desc = MrDesc(0x7F00_1234_0000, [(addr.rail(i), k) for i, k in
                                     enumerate((0x0001_2345, 0xFFFF_FFFF))], 1 << 30)
    back = MrDesc.from_bytes(desc.to_bytes())
    assert back == desc and [k for _, k in back.rkeys] == [0x0001_2345, 0xFFFF_FFFF]
    assert [a.rails for a, _ in back.rkeys] == [addr.rail(0).rails, addr.rail(1).rails]
    assert back.node == (0xDEADBEEF, 0) and back.size == 1 << 30
