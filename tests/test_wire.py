"""Tests of the wire codec (:mod:`gossiprec.core.wire`, :mod:`gossiprec.core.codec`) and the broadcast queue
(:mod:`gossiprec.core.broadcast`).

Decoding treats every byte as hostile, so the bulk of this file is refusals: a table of hand-built bad
packets, each with the ``DecodeError.reason`` it must produce, then Hypothesis properties over random
bytes, mutated valid packets and structurally valid msgpack full of wrong values. The validity check of
decoded messages (:func:`assert_fields_valid`) restates the field limits independently of the codec.
"""

from __future__ import annotations

from typing import Any, Callable

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossiprec.core import codec, wire
from gossiprec.core.broadcast import BroadcastQueue
from gossiprec.core.wire import (
    MAX_ADDR, MAX_MEMBERS, MAX_NAME, MAX_U64, PACKET_OVERHEAD, PHASES, PROTOCOL_VERSION, ROLES,
    STATUS_NAMES, Ack, Alive, Dead, IndirectPing, Message, Nack, Ping, Progress, PushPull, Suspect,
    decode_packet, encode_message, encode_packet, encode_parts,
)
from gossiprec.errors import DecodeError, GossiprecError

MTU = 1400
BIG = 64 * 1024 * 1024
ROW = ("n1", "10.0.0.1:7946", 3, 1, 0, 2, 17, 1, 250, 3, 12, bytes(64), bytes(64))

SAMPLES: list[Message] = [
    Ping(1, "n2", "n1", "10.0.0.1:7946"),
    IndirectPing(MAX_U64, "n3", "10.0.0.3:7946", "n1", "", True),
    Ack(7, "n2", 4, -1, 0, 0),
    Ack(8, "n2", MAX_U64, 2**62, len(PHASES) - 1, 2**31 - 1),
    Nack(0, "n4"),
    Alive("\u00e9" * 64, "x" * MAX_ADDR, 1, len(ROLES) - 1),
    Suspect("n5", 2, "n1"),
    Dead("n6", 9, "n6"),
    Progress("n7", 1, 12, 1000, 2, 431),
    Progress("n7", 1, 13, 1000, 2, 431, 2**32 - 1),
    Progress("n7", 1, 14, 1000, 2, 431, 3, 0, bytes(64)),
    Progress("n7", 1, 15, 1000, 2, 431, 3, 2**31 - 1, bytes(64)),
    Ack(9, "n2", 4, 17, 1, 30, 1234),
    Ack(10, "n2", 4, 17, 1, 30, 1234, 57),
    Ack(11, "n2", 4, 17, 1, 30, 1234, 57, 2**31 - 1),
    PushPull("n1", "10.0.0.1:7946", True, False, (ROW, ("n2", "", 1, 3, 1, 0, -1, 0, 0, 0, 0, b"", b""))),
    PushPull("n1", "a", False, True, ()),
]


def body(*items: Any) -> bytes:
    """A raw packet with arbitrary contents (for building bad ones)."""
    return msgpack.packb(list(items), use_bin_type=True)


def packet(*msgs: list) -> bytes:
    return body(PROTOCOL_VERSION, list(msgs))


def refused(data: bytes, max_size: int = MTU) -> str:
    with pytest.raises(DecodeError) as info:
        decode_packet(data, max_size)
    assert isinstance(info.value, GossiprecError)
    return info.value.reason


# --- independent restatement of the field limits --------------------------------------------------
def _is_int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _is_text(v: Any, limit: int, empty: bool) -> bool:
    return type(v) is str and (empty or v != "") and len(v.encode("utf-8")) <= limit


def _name(v: Any) -> bool:
    return _is_text(v, MAX_NAME, False)


def _addr(v: Any) -> bool:
    return _is_text(v, MAX_ADDR, True)


def _u64(v: Any) -> bool:
    return _is_int(v, 0, MAX_U64)


def _row(v: Any) -> bool:
    return (type(v) is tuple and len(v) == 13 and _name(v[0]) and _addr(v[1]) and _u64(v[2])
            and _is_int(v[3], 0, len(STATUS_NAMES) - 1) and _is_int(v[4], 0, len(ROLES) - 1)
            and _u64(v[5]) and _is_int(v[6], -1, 2**62) and _is_int(v[7], 0, len(PHASES) - 1)
            and _is_int(v[8], 0, 2**31 - 1) and _is_int(v[9], 0, 2**32 - 1) and _is_int(v[10], 0, 2**31 - 1)
            and all(type(sig) is bytes and len(sig) <= 64 for sig in v[11:]))  # Alive's, Progress's


FIELD_OK: dict[str, Callable[[Any], bool]] = {
    "seq": _u64, "incarnation": _u64, "version": _u64,
    "target": _name, "src": _name, "name": _name,
    "src_addr": _addr, "target_addr": _addr, "addr": _addr,
    "nack": lambda v: type(v) is bool, "join": lambda v: type(v) is bool, "reply": lambda v: type(v) is bool,
    "step": lambda v: _is_int(v, -1, 2**62), "phase": lambda v: _is_int(v, 0, len(PHASES) - 1),
    "step_ms": lambda v: _is_int(v, 0, 2**31 - 1), "stall_ms": lambda v: _is_int(v, 0, 2**31 - 1),
    "coll": lambda v: _is_int(v, 0, 2**32 - 1), "wait_ms": lambda v: _is_int(v, 0, 2**31 - 1),
    "role": lambda v: _is_int(v, 0, len(ROLES) - 1),
    "members": lambda v: type(v) is tuple and len(v) <= MAX_MEMBERS and all(_row(r) for r in v),
    "sig": lambda v: type(v) is bytes and len(v) <= 64,
}
CORE_TYPES = (Ping, IndirectPing, Ack, Nack, Alive, Suspect, Dead, Progress, PushPull)


def assert_fields_valid(msg: Message) -> None:
    """Core types: checked against the limits restated above. Types other modules register: must be
    registered, and every field must pass its registered validator unchanged."""
    if type(msg) in CORE_TYPES:
        for name in msg.FIELDS:
            assert FIELD_OK[name](getattr(msg, name)), (type(msg).__name__, name, getattr(msg, name))
        return
    cls, validators = codec._REGISTRY[msg.TYPE]
    assert type(msg) is cls
    for name, check in zip(msg.FIELDS, validators):
        value = getattr(msg, name)
        wire_value = msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False)
        assert check(wire_value) == value, (cls.__name__, name)


# --- round trips ----------------------------------------------------------------------------------
def test_every_core_message_type_has_a_sample_and_a_unique_id() -> None:
    core = {cls for cls, _ in codec._REGISTRY.values() if cls in CORE_TYPES}
    assert core == set(CORE_TYPES) == {type(m) for m in SAMPLES}
    assert len({cls.TYPE for cls in CORE_TYPES}) == len(CORE_TYPES)
    for type_id, (cls, validators) in codec._REGISTRY.items():
        assert cls.TYPE == type_id
        assert cls.FIELDS == tuple(cls.__dataclass_fields__)  # type: ignore[attr-defined]
        assert len(validators) == len(cls.FIELDS)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_single(msg: Message) -> None:
    data = encode_packet([msg])
    assert decode_packet(data, BIG) == [msg]
    assert decode_packet(encode_parts([encode_message(msg)]), BIG) == [msg]
    assert_fields_valid(msg)


# Every registered type, including those other modules add: a sample built from the first candidate
# value each field's own validator accepts (its normalised output, e.g. lists become tuples).
CANDIDATES: list[Any] = [1, "n1", b"\x01" * 32, b"\x01", True, [], [0] * 6, None,
                         ["n1", "a:1", "h", 0, False, b"", b""]]


def _generic_sample(cls: type, validators: tuple) -> Message:
    values = []
    for check in validators:
        for cand in CANDIDATES:
            try:
                values.append(check(cand))
                break
            except DecodeError:
                continue
        else:
            raise AssertionError(f"{cls.__name__}: no candidate value fits a field; extend CANDIDATES")
    return cls(*values)  # type: ignore[no-any-return]


@pytest.mark.parametrize("type_id", sorted(codec._REGISTRY))
def test_round_trip_every_registered_type(type_id: int) -> None:
    cls, validators = codec._REGISTRY[type_id]
    msg = _generic_sample(cls, validators)
    assert decode_packet(encode_packet([msg]), BIG) == [msg]
    assert decode_packet(encode_packet([msg, *SAMPLES[:2], msg]), BIG) == [msg, *SAMPLES[:2], msg]
    # wrong field count is refused for every type
    raw = [type_id, *[getattr(msg, f) for f in cls.FIELDS]]
    assert refused(packet(raw[:-1]), BIG) == "bad_message"
    assert refused(packet([*raw, 0]), BIG) == "bad_message"


def test_sample_messages_are_slotted_values() -> None:
    """Messages are values: slotted (no per-instance dict, no stray attributes), equal and hashed by
    their fields. (Not frozen dataclasses, which cost 5x to build; see :class:`Message`.)"""
    for msg in SAMPLES:
        assert not hasattr(msg, "__dict__")
        with pytest.raises(AttributeError):
            msg.not_a_field = None  # type: ignore[attr-defined]
        twin = decode_packet(encode_packet([msg]), BIG)[0]
        assert twin == msg and twin is not msg
        try:
            assert hash(twin) == hash(msg)
        except TypeError:  # a list-valued field: unhashable, like a frozen dataclass holding a list
            pass


def test_compound_packet_keeps_order_and_types() -> None:
    data = encode_packet(SAMPLES)
    out = decode_packet(data, BIG)
    assert out == SAMPLES
    assert [type(m) for m in out] == [type(m) for m in SAMPLES]


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 255, 300])
def test_encode_parts_matches_encode_packet_for_any_count(n: int) -> None:
    msgs = [Nack(i, f"n{i}") if i % 2 else Suspect(f"n{i}", i, "x") for i in range(n)]
    parts = [encode_message(m) for m in msgs]
    data = encode_parts(parts)
    assert data == encode_packet(msgs)
    assert decode_packet(data, BIG) == msgs
    assert len(data) - sum(len(p) for p in parts) <= PACKET_OVERHEAD


def test_encode_parts_accepts_a_generator_and_empty_is_refused_on_decode() -> None:
    msgs = [Nack(i, "a") for i in range(20)]
    assert decode_packet(encode_parts(encode_message(m) for m in msgs), BIG) == msgs
    assert refused(encode_parts([])) == "malformed"


def test_max_size_boundary_is_inclusive() -> None:
    data = encode_packet([SAMPLES[0]])
    assert decode_packet(data, len(data)) == [SAMPLES[0]]
    assert refused(data, len(data) - 1) == "oversized"


def test_oversized_is_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("msgpack was asked to parse an oversized packet")

    data = encode_packet([SAMPLES[-2]]) + b"\x00" * MTU
    monkeypatch.setattr(wire.msgpack, "unpackb", boom)
    assert refused(data, MTU) == "oversized"
    assert refused(b"\xff" * (MTU + 1), MTU) == "oversized"


# --- refusals -------------------------------------------------------------------------------------
GOOD_PING = [1, 1, "n2", "n1", "a"]
E = "\u00e9"  # 2 UTF-8 bytes
EURO = "\u20ac"  # 3 UTF-8 bytes
SMILE = "\U0001F600"  # 4 UTF-8 bytes

REFUSALS: list[tuple[str, bytes, str]] = [
    ("empty", b"", "truncated"),
    ("truncated", encode_packet([SAMPLES[0]])[:-1], "malformed"),
    ("trailing-bytes", encode_packet([SAMPLES[0]]) + b"\x00", "malformed"),
    ("reserved-byte", b"\xc1", "malformed"),
    ("ext-type", msgpack.packb([1, [msgpack.ExtType(5, b"xx")]]), "malformed"),
    ("int-map-key", packet([1, 1, {1: 2}, "n1", "a"]), "malformed"),
    ("deep-nesting", b"\x91" * 5000 + b"\xc0", "malformed"),
    ("not-a-list", msgpack.packb({"v": 1}), "malformed"),
    ("scalar", msgpack.packb(1), "malformed"),
    ("one-element", body(PROTOCOL_VERSION), "malformed"),
    ("three-elements", body(PROTOCOL_VERSION, [GOOD_PING], 0), "malformed"),
    ("version-next", body(PROTOCOL_VERSION + 1, [GOOD_PING]), "bad_version"),
    ("version-1", body(1, [GOOD_PING]), "bad_version"),  # before stall_ms: refused, not misread
    ("version-3", body(3, [GOOD_PING]), "bad_version"),  # before coll: refused, not misread
    ("version-0", body(0, [GOOD_PING]), "bad_version"),
    ("version-true", body(True, [GOOD_PING]), "bad_version"),
    ("version-float", body(float(PROTOCOL_VERSION), [GOOD_PING]), "bad_version"),
    ("version-str", body("1", [GOOD_PING]), "bad_version"),
    ("no-messages", body(PROTOCOL_VERSION, []), "malformed"),
    ("body-not-list", body(PROTOCOL_VERSION, "ping"), "malformed"),
    ("body-map", body(PROTOCOL_VERSION, {"a": 1}), "malformed"),
    ("msg-not-list", packet(5), "bad_message"),
    ("msg-empty", packet([]), "bad_message"),
    ("msg-map", packet({"t": 1}), "bad_message"),
    ("unknown-type-99", packet([99, 1, 2]), "unknown_type"),
    ("unknown-type-0", packet([0]), "unknown_type"),
    ("unknown-type-neg", packet([-1, 1]), "unknown_type"),
    ("type-id-str", packet(["1", 1, "n2", "n1", "a"]), "unknown_type"),
    ("type-id-bool", packet([True, 1, "n2", "n1", "a"]), "unknown_type"),
    ("type-id-float", packet([1.0, 1, "n2", "n1", "a"]), "unknown_type"),
    ("type-id-huge", packet([2**64 - 1, 1]), "unknown_type"),
    ("too-few-fields", packet([1, 1, "n2", "n1"]), "bad_message"),
    ("too-many-fields", packet([1, 1, "n2", "n1", "a", "extra"]), "bad_message"),
    ("type-only", packet([3]), "bad_message"),
    ("seq-str", packet([1, "1", "n2", "n1", "a"]), "bad_field"),
    ("seq-float", packet([1, 1.0, "n2", "n1", "a"]), "bad_field"),
    ("seq-bool", packet([1, True, "n2", "n1", "a"]), "bad_field"),
    ("seq-negative", packet([1, -1, "n2", "n1", "a"]), "bad_field"),
    ("seq-nil", packet([1, None, "n2", "n1", "a"]), "bad_field"),
    ("name-bytes", packet([1, 1, b"n2", "n1", "a"]), "bad_field"),
    ("name-int", packet([1, 1, 2, "n1", "a"]), "bad_field"),
    ("name-empty", packet([1, 1, "", "n1", "a"]), "bad_field"),
    ("name-list", packet([1, 1, ["n2"], "n1", "a"]), "bad_field"),
    ("name-129-ascii", packet([1, 1, "a" * 129, "n1", "a"]), "bad_field"),
    ("name-65-chars-130-bytes", packet([1, 1, E * 65, "n1", "a"]), "bad_field"),
    ("name-43-chars-129-bytes", packet([1, 1, EURO * 43, "n1", "a"]), "bad_field"),
    ("name-33-chars-132-bytes", packet([1, 1, SMILE * 33, "n1", "a"]), "bad_field"),
    ("name-mixed-129-bytes", packet([1, 1, "a" * 125 + SMILE, "n1", "a"]), "bad_field"),
    ("addr-301", packet([1, 1, "n2", "n1", "x" * 301]), "bad_field"),
    ("addr-101-chars-303-bytes", packet([1, 1, "n2", "n1", EURO * 101]), "bad_field"),
    ("nack-int", packet([2, 1, "t", "a", "s", "b", 1]), "bad_field"),
    ("nack-nil", packet([2, 1, "t", "a", "s", "b", None]), "bad_field"),
    ("ack-step-minus-2", packet([3, 1, "n", 1, -2, 0, 0, 0, 0, 0]), "bad_field"),
    ("ack-step-too-big", packet([3, 1, "n", 1, 2**62 + 1, 0, 0, 0, 0, 0]), "bad_field"),
    ("ack-phase-6", packet([3, 1, "n", 1, 0, len(PHASES), 0, 0, 0, 0]), "bad_field"),
    ("ack-phase-negative", packet([3, 1, "n", 1, 0, -1, 0, 0, 0, 0]), "bad_field"),
    ("ack-step-ms-2^31", packet([3, 1, "n", 1, 0, 0, 2**31, 0, 0, 0]), "bad_field"),
    ("ack-step-ms-negative", packet([3, 1, "n", 1, 0, 0, -5, 0, 0, 0]), "bad_field"),
    ("ack-step-ms-float", packet([3, 1, "n", 1, 0, 0, 5.0, 0, 0, 0]), "bad_field"),
    ("ack-stall-ms-2^31", packet([3, 1, "n", 1, 0, 0, 5, 2**31, 0, 0]), "bad_field"),
    ("ack-stall-ms-negative", packet([3, 1, "n", 1, 0, 0, 5, -1, 0, 0]), "bad_field"),
    ("ack-without-stall-ms", packet([3, 1, "n", 1, 0, 0, 5]), "bad_message"),
    ("ack-without-coll", packet([3, 1, "n", 1, 0, 0, 5, 0]), "bad_message"),
    ("ack-coll-negative", packet([3, 1, "n", 1, 0, 0, 5, 0, -1, 0]), "bad_field"),
    ("ack-coll-2^32", packet([3, 1, "n", 1, 0, 0, 5, 0, 2**32, 0]), "bad_field"),
    ("ack-coll-float", packet([3, 1, "n", 1, 0, 0, 5, 0, 1.0, 0]), "bad_field"),
    ("ack-without-wait-ms", packet([3, 1, "n", 1, 0, 0, 5, 0, 0]), "bad_message"),
    ("ack-wait-ms-2^31", packet([3, 1, "n", 1, 0, 0, 5, 0, 0, 2**31]), "bad_field"),
    ("ack-wait-ms-negative", packet([3, 1, "n", 1, 0, 0, 5, 0, 0, -1]), "bad_field"),
    ("alive-role-2", packet([5, "n", "a", 1, len(ROLES), b""]), "bad_field"),
    ("suspect-inc-negative", packet([6, "n", -1, "s", b""]), "bad_field"),
    ("dead-inc-str", packet([7, "n", "1", "s", b""]), "bad_field"),
    ("dead-sig-long", packet([7, "n", 1, "s", b"x" * 65]), "bad_field"),
    ("progress-version-nil", packet([8, "n", 1, None, 0, 0, 0, 0, 0, b""]), "bad_field"),
    ("progress-without-coll", packet([8, "n", 1, 1, 0, 0, 0]), "bad_message"),
    ("progress-without-sig", packet([8, "n", 1, 1, 0, 0, 0, 0, 0]), "bad_message"),
    ("progress-without-wait-ms", packet([8, "n", 1, 1, 0, 0, 0, 0, b""]), "bad_message"),
    ("progress-wait-ms-2^31", packet([8, "n", 1, 1, 0, 0, 0, 0, 2**31, b""]), "bad_field"),
    ("progress-coll-2^32", packet([8, "n", 1, 1, 0, 0, 0, 2**32, 0, b""]), "bad_field"),
    ("progress-coll-nil", packet([8, "n", 1, 1, 0, 0, 0, None, 0, b""]), "bad_field"),
    ("progress-sig-long", packet([8, "n", 1, 1, 0, 0, 0, 0, 0, b"x" * 65]), "bad_field"),
    ("progress-sig-str", packet([8, "n", 1, 1, 0, 0, 0, 0, 0, "sig"]), "bad_field"),
    ("pushpull-members-map", packet([9, "s", "", False, False, {"n1": 1}]), "bad_field"),
    ("pushpull-members-str", packet([9, "s", "", False, False, "n1"]), "bad_field"),
    ("pushpull-row-short", packet([9, "s", "", False, False, [list(ROW[:9])]]), "bad_field"),
    ("pushpull-row-coll-negative", packet([9, "s", "", False, False, [[*ROW[:9], -1]]]), "bad_field"),
    ("pushpull-row-long", packet([9, "s", "", False, False, [[*ROW, 0]]]), "bad_field"),
    ("pushpull-row-without-progress-sig", packet([9, "s", "", False, False, [list(ROW[:-1])]]), "bad_field"),
    ("pushpull-row-progress-sig-long", packet([9, "s", "", False, False, [[*ROW[:-1], b"x" * 65]]]),
     "bad_field"),
    ("pushpull-row-str", packet([9, "s", "", False, False, ["row"]]), "bad_field"),
    ("pushpull-row-status-4", packet([9, "s", "", False, False, [[*ROW[:3], 4, *ROW[4:]]]]), "bad_field"),
    ("pushpull-row-nested-name", packet([9, "s", "", False, False, [[[["n1"]], *ROW[1:]]]]), "bad_field"),
    ("pushpull-2nd-row-bad", packet([9, "s", "", False, False, [list(ROW), [*ROW[:8], -1, 0]]]), "bad_field"),
    ("pushpull-join-int", packet([9, "s", "", 0, False, []]), "bad_field"),
    ("good-then-bad", packet(GOOD_PING, [1, 1, "", "n1", "a"]), "bad_field"),
    ("good-then-unknown", packet(GOOD_PING, [99]), "unknown_type"),
]


@pytest.mark.parametrize("data, reason", [(d, r) for _, d, r in REFUSALS], ids=[i for i, _, _ in REFUSALS])
def test_refusal(data: bytes, reason: str) -> None:
    assert refused(data, BIG) == reason


def test_oversized_reason_and_message() -> None:
    with pytest.raises(DecodeError) as info:
        decode_packet(b"\x00" * (MTU + 1), MTU)
    assert info.value.reason == "oversized"
    assert str(MTU + 1) in str(info.value)


def test_too_many_members_is_refused() -> None:
    rows = [[]] * (MAX_MEMBERS + 1)
    assert refused(packet([9, "s", "", False, False, rows]), BIG) == "bad_field"
    # more array items than msgpack itself is allowed to build: refused by the parser
    assert refused(packet([9, "s", "", False, False, [0] * (MAX_MEMBERS + 17)]), BIG) == "malformed"


@pytest.mark.parametrize("name", ["a" * 128, E * 64, EURO * 42 + "ab", SMILE * 32, "a" * 124 + SMILE])
def test_names_of_exactly_128_bytes_are_accepted(name: str) -> None:
    assert len(name.encode()) == 128
    msg = Suspect(name, 1, name)
    assert decode_packet(encode_packet([msg]), MTU) == [msg]


def test_addr_may_be_empty_and_up_to_300_bytes() -> None:
    for addr in ("", "x" * 300, EURO * 100):
        msg = Alive("n", addr, 1, 0)
        assert decode_packet(encode_packet([msg]), MTU) == [msg]


def test_integer_boundaries_are_accepted() -> None:
    for msg in (Ack(0, "n", 0, -1, 0, 0), Ack(MAX_U64, "n", MAX_U64, 2**62, 5, 2**31 - 1, 2**31 - 1, 2**32 - 1),
                Progress("n", 0, 0, -1, 0, 0, 0), Progress("n", MAX_U64, MAX_U64, 2**62, 5, 2**31 - 1, 2**32 - 1)):
        assert decode_packet(encode_packet([msg]), MTU) == [msg]


# --- hypothesis: hostile input never raises anything but DecodeError ------------------------------
names = st.text(min_size=1, max_size=32) | st.sampled_from(["a" * 128, E * 64, "n1", "n2"])
addrs = st.text(max_size=40)
u64 = st.integers(0, MAX_U64) | st.sampled_from([0, 1, MAX_U64])
steps = st.integers(-1, 2**62)
phases = st.integers(0, len(PHASES) - 1)
millis = st.integers(0, 2**31 - 1)
sigs = st.binary(max_size=64)
colls = st.integers(0, 2**32 - 1)
rows = st.tuples(names, addrs, u64, st.integers(0, 3), st.integers(0, 1), u64, steps, phases, millis, colls,
                 millis, sigs, sigs)
messages = st.one_of(
    st.builds(Ping, u64, names, names, addrs),
    st.builds(IndirectPing, u64, names, addrs, names, addrs, st.booleans()),
    st.builds(Ack, u64, names, u64, steps, phases, millis, millis, colls, millis),
    st.builds(Nack, u64, names),
    st.builds(Alive, names, addrs, u64, st.integers(0, 1), sigs),
    st.builds(Suspect, names, u64, names, sigs),
    st.builds(Dead, names, u64, names, st.binary(max_size=64)),
    st.builds(Progress, names, u64, u64, steps, phases, millis, colls, millis, sigs),
    st.builds(PushPull, names, addrs, st.booleans(), st.booleans(), st.lists(rows, max_size=4).map(tuple)),
)
HYP = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def decode_or_refuse(data: bytes, max_size: int = MTU) -> list[Message] | None:
    """Decode; a DecodeError (with a reason) is fine, anything else propagates and fails the test."""
    try:
        out = decode_packet(data, max_size)
    except DecodeError as exc:
        assert isinstance(exc.reason, str) and exc.reason
        return None
    assert out, "a decoded packet holds at least one message"
    for msg in out:
        assert_fields_valid(msg)
    assert decode_packet(encode_packet(out), BIG) == out
    return out


@settings(max_examples=200, **HYP)
@given(st.lists(messages, min_size=1, max_size=6))
def test_property_round_trip(msgs: list[Message]) -> None:
    for m in msgs:
        assert_fields_valid(m)
    assert decode_packet(encode_packet(msgs), BIG) == msgs
    assert decode_packet(encode_parts(encode_message(m) for m in msgs), BIG) == msgs


@settings(max_examples=1200, **HYP)
@given(st.binary(max_size=2 * MTU))
def test_property_random_bytes_only_decode_error(data: bytes) -> None:
    decode_or_refuse(data)


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
)


def mutate(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, pos, val in ops:
        i = pos % (len(buf) + 1)
        if op == "insert":
            buf.insert(i, val)
        elif not buf:
            continue
        elif op == "truncate":
            del buf[i:]
        else:
            i = pos % len(buf)
            if op == "flip":
                buf[i] ^= val
            elif op == "set":
                buf[i] = val
            else:
                del buf[i]
    return bytes(buf)


@settings(max_examples=1000, **HYP)
@given(st.lists(messages, min_size=1, max_size=4), st.lists(mutation, min_size=1, max_size=4))
def test_property_mutated_packets_decode_to_valid_messages_or_refuse(msgs: list[Message], ops) -> None:  # type: ignore[no-untyped-def]
    decode_or_refuse(mutate(encode_packet(msgs), ops))


scalars = (st.none() | st.booleans() | st.integers(-(2**63), MAX_U64) | st.floats(allow_nan=True)
           | st.text(max_size=140) | st.binary(max_size=40)
           | st.sampled_from([-1, -2, 2**31, 2**62 + 1, MAX_U64, "", "a" * 129, E * 65, 1.0, 0.5]))
garbage = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=10) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
TYPE_IDS = st.sampled_from(sorted(codec._REGISTRY))
REGISTERED_SAMPLES = [_generic_sample(cls, v) for cls, v in codec._REGISTRY.values()]


@st.composite
def damaged_raw_message(draw: st.DrawFn) -> list:
    """A message as its wire list, with a few fields (or the type id) replaced by garbage, or a garbage
    field list under a registered or unknown type id."""
    how = draw(st.sampled_from(["fields", "fields", "type", "all"]))
    if how == "all":
        tid = draw(TYPE_IDS | st.sampled_from([0, 10, 19, 99, 255, 2**32]))
        return [tid, *draw(st.lists(garbage, max_size=10))]
    msg = draw(messages | st.sampled_from(REGISTERED_SAMPLES))
    raw = [msg.TYPE, *[getattr(msg, f) for f in msg.FIELDS]]
    if how == "type":
        raw[0] = draw(TYPE_IDS)  # the right number of fields, maybe for the wrong type
    else:
        for _ in range(draw(st.integers(1, 2))):
            raw[draw(st.integers(1, len(raw) - 1))] = draw(garbage)
    return raw


@settings(max_examples=600, **HYP)
@given(damaged_raw_message(), st.booleans())
def test_property_wellformed_msgpack_with_wrong_values(raw: list, lead_good: bool) -> None:
    items = ([GOOD_PING] if lead_good else []) + [raw]
    out = decode_or_refuse(packet(*items), BIG)
    if out is not None:
        assert len(out) == len(items)


# --- broadcast queue ------------------------------------------------------------------------------
def _s(name: str, inc: int = 1) -> Suspect:
    return Suspect(name, inc, "accuser")


def _decoded(parts: list[bytes]) -> list[Message]:
    return decode_packet(encode_parts(parts), BIG) if parts else []


def test_queue_replaces_by_key() -> None:
    q = BroadcastQueue()
    q.queue("a", _s("a", 1))
    q.queue("b", _s("b", 1))
    q.queue("a", Alive("a", "addr", 2, 0))
    assert len(q) == 2
    assert q.pending("a") == Alive("a", "addr", 2, 0)
    assert q.pending("zz") is None
    assert _decoded(q.take(MTU, 10)) == [Alive("a", "addr", 2, 0), _s("b", 1)]


def test_replacement_resets_transmit_count() -> None:
    q = BroadcastQueue()
    q.queue("a", _s("a", 1))
    q.take(MTU, 3)
    q.take(MTU, 3)
    q.queue("a", _s("a", 2))
    for _ in range(3):
        assert _decoded(q.take(MTU, 3)) == [_s("a", 2)]
    assert len(q) == 0


@pytest.mark.parametrize("limit", [1, 2, 3, 9])
def test_transmit_limit_drops_after_exactly_limit_sends(limit: int) -> None:
    q = BroadcastQueue()
    q.queue("a", _s("a"))
    sent = 0
    for _ in range(limit + 3):
        sent += len(q.take(MTU, limit))
    assert sent == limit
    assert len(q) == 0 and q.pending("a") is None
    assert q.take(MTU, limit) == []


def test_order_fewest_transmits_first_then_newest() -> None:
    q = BroadcastQueue()
    for name in ("a", "b", "c"):
        q.queue(name, _s(name))
    assert [m.name for m in _decoded(q.take(MTU, 10))] == ["c", "b", "a"]  # type: ignore[attr-defined]
    q.queue("d", _s("d"))
    q.queue("e", _s("e"))
    # d, e never sent: first, newest first; then the once-sent ones, newest first.
    assert [m.name for m in _decoded(q.take(MTU, 10))] == ["e", "d", "c", "b", "a"]  # type: ignore[attr-defined]
    q.queue("b", _s("b", 2))  # replaced: count back to 0
    assert [m.name for m in _decoded(q.take(MTU, 10))] == ["b", "e", "d", "c", "a"]  # type: ignore[attr-defined]


def test_byte_budget_is_respected_and_small_items_fill_the_rest() -> None:
    q = BroadcastQueue()
    big = Alive("big", "x" * 200, 1, 0)
    q.queue("s1", _s("s1"))
    q.queue("big", big)  # newest: first candidate
    small = len(encode_message(_s("s1")))
    size_big = len(encode_message(big))
    assert size_big > 2 * small
    # Budget too small for the big one but enough for the small one: the small one goes alone.
    out = q.take(size_big - 1, 10)
    assert _decoded(out) == [_s("s1")]
    assert sum(map(len, out)) <= size_big - 1
    # The big one was not counted as sent: it still goes out next time, first.
    assert _decoded(q.take(size_big + small, 10)) == [big, _s("s1")]


@pytest.mark.parametrize("budget", [0, -5])
def test_no_budget_sends_nothing_and_counts_nothing(budget: int) -> None:
    q = BroadcastQueue()
    q.queue("a", _s("a"))
    assert q.take(budget, 1) == []
    assert len(q) == 1


def test_budget_is_never_exceeded_random() -> None:
    import random

    rng = random.Random(5)
    q = BroadcastQueue()
    for i in range(200):
        q.queue(f"k{rng.randrange(60)}", Alive(f"k{i}", "a" * rng.randrange(0, 120), i, 0))
        budget = rng.randrange(0, 600)
        out = q.take(budget, 4)
        assert sum(map(len, out)) <= max(budget, 0)
        assert len(q) <= 60


def test_skip_key_is_not_sent_and_keeps_its_count() -> None:
    q = BroadcastQueue()
    q.queue("a", _s("a"))
    q.queue("b", _s("b"))
    assert _decoded(q.take(MTU, 1, skip="b")) == [_s("a")]
    assert len(q) == 1 and q.pending("b") == _s("b")
    q.clear()
    assert len(q) == 0


# --- the decode cache of gossip messages (a speed-up that must not change what decodes) -----------
def test_cached_decode_returns_the_same_message_and_still_refuses_lookalikes() -> None:
    msg = Suspect("n5", 2, "n1")
    first = decode_packet(encode_packet([msg]), MTU)[0]
    again = decode_packet(encode_packet([Ping(1, "n2", "n1", ""), msg]), MTU)[1]
    assert first == again == msg
    assert again is first  # served from the cache
    # equal as tuples (2 == 2.0 == True) but of the wrong type: refused exactly as without a cache
    assert refused(packet([6, "n5", 2.0, "n1", b""])) == "bad_field"
    assert refused(packet([6, "n5", True, "n1", b""])) == "bad_field"
    assert refused(packet([6, "n5", [2], "n1", b""])) == "bad_field"  # unhashable: full validation
    alert = wire.Alert(3, "cfg", "n1", "n2", 0, 0, True, "", "", "")
    assert decode_packet(encode_packet([alert]), MTU) == [alert]
    assert refused(packet([20, 3, "cfg", "n1", "n2", 0, 0, 1, "", "", "", 0, b""])) == "bad_field"  # 1 is not True


def test_decode_cache_is_bounded() -> None:
    for i in range(codec.CACHE_MAX + 10):
        decode_packet(encode_packet([Dead(f"n{i}", 1, "x")]), MTU)
    assert 0 < len(codec._CACHE) <= codec.CACHE_MAX


def test_operator_query_and_page_limits() -> None:
    """OpsQuery (50) and OpsPage (51): a ``what`` past the known queries and a page past
    OPS_PAGE_MAX are refused; the largest page round-trips."""
    assert (wire.OpsQuery.TYPE, wire.OpsPage.TYPE) == (50, 51)
    q = wire.OpsQuery(len(wire.OPS_WHAT) - 1, MAX_U64, "10.0.0.1:7946")
    assert decode_packet(encode_packet([q]), MTU) == [q]
    assert refused(packet([50, len(wire.OPS_WHAT), 1, "a:1"])) == "bad_field"
    big = wire.OpsPage(1, 2**32 - 1, True, b"x" * wire.OPS_PAGE_MAX)
    assert decode_packet(encode_packet([big]), BIG) == [big]
    assert refused(packet([51, 1, 0, True, b"x" * (wire.OPS_PAGE_MAX + 1)]), BIG) == "bad_field"
    assert refused(packet([51, 1, 0, 1, b""]), BIG) == "bad_field"  # last is a boolean
