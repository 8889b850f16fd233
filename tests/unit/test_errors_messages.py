"""Typed errors round trip through their wire body; body-field validation."""

from __future__ import annotations

from typing import Any

import pytest

from transferd.protocol import errors as E
from transferd.protocol.constants import COMMAND_MINOR, Command, ErrorCode, command_name
from transferd.protocol.errors import BadRequest, TransferdError, error_from_body
from transferd.protocol.messages import (
    U64_MAX,
    Tensor,
    bytes_field,
    field,
    str_field,
    tensor_field,
    tensor_from_wire,
    tensors_field,
    uint_field,
)

FATAL = {
    ErrorCode.BAD_FRAME,
    ErrorCode.TOO_LARGE,
    ErrorCode.NO_HELLO,
    ErrorCode.VERSION_MISMATCH,
    ErrorCode.UNAUTHORIZED,
}

# PROTOCOL.md's list, spelled out here so a rename in the code is caught.
DOCUMENTED_CODES = [
    "BAD_FRAME",
    "TOO_LARGE",
    "NO_HELLO",
    "VERSION_MISMATCH",
    "UNAUTHORIZED",
    "UNKNOWN_COMMAND",
    "BAD_REQUEST",
    "NOT_FOUND",
    "OUT_OF_BOUNDS",
    "OUT_OF_MEMORY",
    "PEER_UNREACHABLE",
    "TIMEOUT",
    "CANCELLED",
    "INTERNAL",
]


def test_error_codes_are_exactly_the_documented_ones() -> None:
    assert [c.value for c in ErrorCode] == DOCUMENTED_CODES


def _classes() -> dict[str, type[TransferdError]]:
    out: dict[str, type[TransferdError]] = {}
    for obj in vars(E).values():
        if (
            isinstance(obj, type)
            and issubclass(obj, TransferdError)
            and obj.__name__ not in ("TransferdError", "ProtocolError", "ConnectionLost",
                                     "OverLimit",  # TOO_LARGE that keeps the connection
                                     "IntegrityError", "PeerAnswered")  # refinements
                                                                       # of PEER_UNREACHABLE
        ):
            out[obj.code.value] = obj
    return out


@pytest.mark.parametrize("code", list(ErrorCode), ids=str)
def test_every_code_round_trips(code: ErrorCode) -> None:
    cls = _classes()[code.value]
    exc = cls("something went wrong", seq=41)
    body = exc.to_body()
    assert body == {"code": code.value, "message": "something went wrong"}
    assert set(body) == {"code", "message"}
    back = error_from_body(body, seq=41)
    assert type(back) is cls
    assert back.code == code
    assert back.message == "something went wrong"
    assert back.seq == 41
    assert back.fatal == (code in FATAL)
    assert code.value in str(back) and "seq 41" in str(back)


def test_default_message_is_the_code() -> None:
    exc = E.OutOfBounds()
    assert exc.message == "OUT_OF_BOUNDS"
    assert exc.to_body() == {"code": "OUT_OF_BOUNDS", "message": "OUT_OF_BOUNDS"}
    assert "seq" not in str(exc)


def test_unknown_code_becomes_internal_and_keeps_the_code() -> None:
    back = error_from_body({"code": "FLUX_CAPACITOR", "message": "boom"})
    assert type(back) is E.Internal
    assert "FLUX_CAPACITOR" in back.message and "boom" in back.message


def test_missing_fields_become_internal() -> None:
    back = error_from_body({})
    assert type(back) is E.Internal


def test_connection_lost_is_a_cancelled_error() -> None:
    exc = E.ConnectionLost("gone")
    assert exc.code == ErrorCode.CANCELLED and isinstance(exc, TransferdError)


def test_command_table() -> None:
    assert command_name(0x10) == "GET_TENSORS"
    assert command_name(0x11) == "SET_TENSORS"
    assert command_name(0x1F) == "0x1F"
    minor1 = {
        "HELLO": 0x00, "GET_DEVICES": 0x01, "ALLOC_BUFFER": 0x02, "FREE_BUFFER": 0x03,
        "BUFFER_CLEAR": 0x04, "SET_TENSOR": 0x05, "GET_TENSOR": 0x06, "COPY_TENSOR": 0x07,
        "SYNCHRONIZE": 0x08, "STATS": 0x09,
    }
    for name, value in minor1.items():
        assert Command[name] == value and COMMAND_MINOR[Command[name]] == 1
    assert Command.GET_TENSORS == 0x10 and COMMAND_MINOR[Command.GET_TENSORS] == 2
    assert Command.SET_TENSORS == 0x11 and COMMAND_MINOR[Command.SET_TENSORS] == 2
    for c in Command:
        if 0x20 <= c <= 0x3F:
            assert COMMAND_MINOR[c] == 2


# -- field validation ---------------------------------------------------------------------


def test_uint_field_accepts_the_u64_range() -> None:
    assert uint_field({"n": 0}, "n") == 0
    assert uint_field({"n": U64_MAX}, "n") == U64_MAX
    assert uint_field({"v": 255}, "v", 255) == 255


@pytest.mark.parametrize(
    "value",
    [True, False, -1, U64_MAX + 1, 1.0, "3", None, [1], b"\x01"],
    ids=["true", "false", "neg", "u64+1", "float", "str", "nil", "list", "bytes"],
)
def test_uint_field_rejects(value: Any) -> None:
    with pytest.raises(BadRequest) as info:
        uint_field({"size": value}, "size")
    assert "'size'" in str(info.value)


def test_uint_field_limit() -> None:
    with pytest.raises(BadRequest, match="'value'"):
        uint_field({"value": 256}, "value", 255)


def test_missing_field_is_named() -> None:
    with pytest.raises(BadRequest, match="'buffer'"):
        uint_field({}, "buffer")
    with pytest.raises(BadRequest, match="'tensor'"):
        field({}, "tensor")


def test_str_field() -> None:
    assert str_field({"device": "cpu"}, "device") == "cpu"
    assert str_field({}, "device", "cpu") == "cpu"
    with pytest.raises(BadRequest, match="'device'"):
        str_field({"device": 1}, "device")
    with pytest.raises(BadRequest, match="'device'"):
        str_field({"device": b"cpu"}, "device")
    with pytest.raises(BadRequest, match="'device'"):
        str_field({}, "device")


def test_bytes_field() -> None:
    assert bytes_field({"b": b"\x00\x01"}, "b") == b"\x00\x01"
    with pytest.raises(BadRequest, match="'b'"):
        bytes_field({"b": "text"}, "b")


def test_tensor_from_wire() -> None:
    assert tensor_from_wire([1, 2, 3]) == Tensor(1, 2, 3)
    assert tensor_from_wire((1, 2, 3)) == Tensor(1, 2, 3)
    assert tensor_field({"src": [4, 0, 8]}, "src") == Tensor(4, 0, 8)


@pytest.mark.parametrize(
    "value",
    [
        [1, 2],
        [1, 2, 3, 4],
        [],
        "1,2,3",
        {"buffer": 1, "offset": 0, "size": 3},
        None,
        7,
        [1, -2, 3],
        [1, 2, -3],
        [True, 0, 1],
        [1, False, 1],
        [1, 0, 1.5],
        [1, 0, "3"],
        [1, 0, U64_MAX + 1],
    ],
)
def test_tensor_shapes_rejected(value: Any) -> None:
    with pytest.raises(BadRequest) as info:
        tensor_field({"dst": value}, "dst")
    assert "dst" in str(info.value)


def test_tensors_field() -> None:
    assert tensors_field({"tensors": [[1, 0, 2], [1, 2, 2]]}) == [Tensor(1, 0, 2), Tensor(1, 2, 2)]
    assert tensors_field({"tensors": []}) == []
    with pytest.raises(BadRequest, match="'tensors'"):
        tensors_field({"tensors": (1, 0, 2)})
    with pytest.raises(BadRequest, match="'tensors'"):
        tensors_field({"tensors": {"a": 1}})
    with pytest.raises(BadRequest, match=r"tensors\[1\]"):
        tensors_field({"tensors": [[1, 0, 2], [1, 0]]})
    with pytest.raises(BadRequest, match=r"tensors\[0\]\[2\]"):
        tensors_field({"tensors": [[1, 0, True]]})
    with pytest.raises(BadRequest, match="'tensors'"):
        tensors_field({})


# -- the table of codes (issue 18.5): filled by defining a class -----------------------------


def test_every_registered_class_goes_both_ways() -> None:
    assert {code for code, _ in E.BY_CODE} == {c.value for c in ErrorCode}
    for (code, fatal), cls in E.BY_CODE.items():
        assert cls.code.value == code and cls.fatal is fatal, cls
        body = cls("both ways", seq=7).to_body()
        assert body == {"code": code, "message": "both ways"}
        back = error_from_body(body, seq=7, fatal=fatal)
        assert type(back) is cls and back.seq == 7 and back.message == "both ways"
        # Nothing said about fatality: the code's fatal class where it has one.
        plain = type(error_from_body(body))
        assert plain is (E.BY_CODE.get((code, True)) or cls)


def test_every_class_with_a_code_of_its_own_is_in_the_table() -> None:
    for obj in vars(E).values():
        if (isinstance(obj, type) and issubclass(obj, TransferdError)
                and obj is not TransferdError and "code" in vars(obj)):
            registered = E.BY_CODE.get((obj.code.value, obj.fatal)) is obj
            assert registered is (obj is not E.ConnectionLost), obj


def test_over_limit_is_caught_as_over_limit_where_the_connection_goes_on() -> None:
    body = E.OverLimit("a batch of 70,000 tensors").to_body()
    assert body["code"] == "TOO_LARGE"
    try:
        raise error_from_body(body, fatal=False)
    except E.OverLimit as exc:
        assert not exc.fatal and isinstance(exc, E.TooLarge)
    assert type(error_from_body(body, fatal=True)) is E.TooLarge


def test_defining_a_class_registers_it_and_a_second_one_for_a_code_is_refused() -> None:
    class Flaky(E.TransferdError):
        code = ErrorCode.PEER_UNREACHABLE
        fatal = True

    try:
        assert E.BY_CODE[("PEER_UNREACHABLE", True)] is Flaky
        assert type(error_from_body({"code": "PEER_UNREACHABLE"}, fatal=True)) is Flaky
        with pytest.raises(TypeError, match="already Flaky"):
            class Again(E.TransferdError):
                code = ErrorCode.PEER_UNREACHABLE
                fatal = True
    finally:
        del E.BY_CODE[("PEER_UNREACHABLE", True)]
    # A subclass without a code of its own refines its base, it has no wire identity.
    class Detail(E.NotFound):
        pass

    assert E.BY_CODE[("NOT_FOUND", False)] is E.NotFound
    assert isinstance(Detail(), E.NotFound)
