"""Message codec: slotted dataclasses to msgpack-ready rows and back, every field validated.

What it holds: the field validators (integers by range, text by UTF-8 length, bytes and lists by length,
fixed records, optional values), the registry that :func:`message` fills (type id -> class and
validators), each type's row builder (``msg -> [TYPE, *fields]``) and its generated straight-line
decoder, and the decode cache of broadcasts. A validator raises :class:`~gossiprec.errors.DecodeError`
on any value it refuses; a decoder calls them all. Nothing here knows the protocol's messages, its
version or the bytes: :mod:`gossiprec.core.wire` declares the messages with these pieces and frames
them into packets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, Callable, ClassVar, TypeVar, dataclass_transform

from gossiprec.errors import DecodeError

MAX_U64 = 2**64 - 1

Validator = Callable[[Any], Any]


# --- field validators -----------------------------------------------------------------------------
def uint(limit: int = MAX_U64) -> Validator:
    def check(v: Any) -> int:
        if type(v) is not int or v < 0 or v > limit:
            raise DecodeError("bad_field", f"expected integer 0..{limit}, got {type(v).__name__}")
        return v

    check.inline = f"type({{v}}) is not int or {{v}} < 0 or {{v}} > {limit}"  # type: ignore[attr-defined]
    return check


def sint(lo: int, hi: int) -> Validator:
    def check(v: Any) -> int:
        if type(v) is not int or v < lo or v > hi:
            raise DecodeError("bad_field", f"expected integer {lo}..{hi}")
        return v

    check.inline = f"type({{v}}) is not int or {{v}} < {lo} or {{v}} > {hi}"  # type: ignore[attr-defined]
    return check


def text(max_bytes: int, allow_empty: bool = False) -> Validator:
    def check(v: Any) -> str:
        if type(v) is not str:
            raise DecodeError("bad_field", f"expected text, got {type(v).__name__}")
        if len(v) > max_bytes or len(v.encode("utf-8", "surrogatepass")) > max_bytes:
            raise DecodeError("bad_field", f"text longer than {max_bytes} bytes")
        if not v and not allow_empty:
            raise DecodeError("bad_field", "empty text")
        return v

    # Fast path for short ASCII-sized text; anything longer than max_bytes/4 chars takes the full check.
    empty = "" if allow_empty else " or not {v}"
    check.inline = (f"type({{v}}) is not str or len({{v}}) > {max_bytes // 4}{empty}")  # type: ignore[attr-defined]
    return check


def boolean(v: Any) -> bool:
    if type(v) is not bool:
        raise DecodeError("bad_field", "expected boolean")
    return v


boolean.inline = "type({v}) is not bool"  # type: ignore[attr-defined]


def real(lo: float, hi: float) -> Validator:
    def check(v: Any) -> float:
        if type(v) not in (int, float) or not math.isfinite(v) or v < lo or v > hi:
            raise DecodeError("bad_field", f"expected number {lo}..{hi}")
        return float(v)

    return check


def blob(max_bytes: int) -> Validator:
    def check(v: Any) -> bytes:
        if type(v) is not bytes or len(v) > max_bytes:
            raise DecodeError("bad_field", f"expected bytes of at most {max_bytes}")
        return v

    check.inline = f"type({{v}}) is not bytes or len({{v}}) > {max_bytes}"  # type: ignore[attr-defined]
    return check


def seq(item: Validator, max_len: int) -> Validator:
    def check(v: Any) -> tuple[Any, ...]:
        if type(v) is not list or len(v) > max_len:
            raise DecodeError("bad_field", f"expected list of at most {max_len}")
        return tuple(item(x) for x in v)

    return check


def blobs(max_bytes: int, max_len: int) -> Validator:
    """A list of at most ``max_len`` byte strings of at most ``max_bytes`` each (``seq(blob(...))``, in one
    pass: signatures, many per message)."""

    def check(v: Any) -> tuple[bytes, ...]:
        if type(v) is not list or len(v) > max_len:
            raise DecodeError("bad_field", f"expected list of at most {max_len}")
        for x in v:
            if type(x) is not bytes or len(x) > max_bytes:
                raise DecodeError("bad_field", f"expected bytes of at most {max_bytes}")
        return tuple(v)

    return check


def record(*items: Validator) -> Validator:
    n = len(items)

    def check(v: Any) -> tuple[Any, ...]:
        if type(v) is not list or len(v) != n:
            raise DecodeError("bad_field", f"expected record of {n} fields")
        return tuple(f(x) for f, x in zip(items, v))

    return check


def optional(inner: Validator) -> Validator:
    def check(v: Any) -> Any:
        return None if v is None else inner(v)

    return check


# --- the registry ---------------------------------------------------------------------------------
_REGISTRY: dict[int, tuple[type, tuple[Validator, ...]]] = {}

DECODERS: dict[int, Callable[[list[Any]], Any]] = {}
"""Per type id: its decoder, ``[TYPE, *fields] -> msg`` (raises DecodeError); filled by :func:`message`."""
ROWS: dict[type, Callable[[Any], list[Any]]] = {}
"""Per message class: msg -> [TYPE, *fields] (a C attrgetter; msgpack writes nested tuples as arrays)."""

_CACHE: dict[tuple[Any, ...], Any] = {}
"""Decoded gossip messages by field values (see :func:`_cached_decoder`); shared by every machine in the
process, cleared whenever it reaches :data:`CACHE_MAX` entries."""
CACHE_MAX = 1 << 16


def _compile_decoder(cls: type, validators: tuple[Validator, ...]) -> Callable[[list[Any]], Any]:
    """Generate a straight-line decoder for one message type.

    Simple fields are checked inline (``check.inline`` is a condition that is true for a *suspect* value);
    a suspect value, or a field without an inline form, goes through the full validator, which raises
    DecodeError or returns the value. Behaviour equals calling every validator; only faster.
    """
    n = len(validators)
    lines = ["def decode(item):", f"    if len(item) != {n + 1}:",
             f"        raise DecodeError('bad_message', '{cls.__name__} needs {n} fields')"]
    env: dict[str, Any] = {"DecodeError": DecodeError, "cls": cls}
    args = []
    for i, check in enumerate(validators, start=1):
        var = f"f{i}"
        env[f"c{i}"] = check
        lines.append(f"    {var} = item[{i}]")
        cond = getattr(check, "inline", None)
        if cond is None:
            lines.append(f"    {var} = c{i}({var})")
        else:
            lines.append(f"    if {cond.format(v=var)}:")
            lines.append(f"        {var} = c{i}({var})")
        args.append(var)
    lines.append(f"    return cls({', '.join(args)})")
    exec("\n".join(lines), env)  # noqa: S102 - generated from our own field specs, no outside input
    return env["decode"]  # type: ignore[no-any-return]


def _cached_decoder(decode: Callable[[list[Any]], Any],
                    validators: tuple[Validator, ...]) -> Callable[[list[Any]], Any]:
    """Wrap ``decode`` with a lookup in :data:`_CACHE`, keyed by the tuple of the item's values.

    Equal tuples can still differ in type (``1 == 1.0 == True``), so a hit counts only when every field
    that must be an integer (or a boolean) has exactly that type; the other field kinds (text) compare
    equal only to values of their own type. Anything else, and every miss, goes through ``decode``, which
    validates in full; only messages it accepted are stored. The result equals ``decode(item)`` for every
    input (decoded messages are immutable, so sharing one object is safe).
    """
    checks = []
    for i, check in enumerate(validators, start=1):
        cond = getattr(check, "inline", None)
        if cond is None or not cond.startswith("type({v}) is not "):
            raise TypeError("only messages whose every field has an inline check can be cached")
        kind = cond.split()[3]
        if kind in ("int", "bool"):
            checks.append(f"type(item[{i}]) is {kind}")
    hit = " and ".join(checks) or "True"
    src = f"""
def decode_cached(item):
    try:
        key = tuple(item)
        msg = cache_get(key)
    except TypeError:  # an unhashable value (a list): not a valid message of this type
        return decode(item)
    if msg is not None and {hit}:
        return msg
    msg = decode(item)
    if len(cache) >= limit:
        cache.clear()
    cache[key] = msg
    return msg
"""
    env: dict[str, Any] = {"decode": decode, "cache": _CACHE, "cache_get": _CACHE.get, "limit": CACHE_MAX}
    exec(src, env)  # noqa: S102 - generated from our own field specs, no outside input
    return env["decode_cached"]  # type: ignore[no-any-return]


def message(type_id: int, *validators: Validator, cached: bool = False) -> Callable[[type], type]:
    """Class decorator: register a slotted dataclass as wire message ``type_id`` with field validators.

    ``cached``: decoded through the shared cache (:func:`_cached_decoder`), for broadcasts that every
    member receives many times over (the same bytes, piggybacked on many packets); not for types that
    are unique per packet (sequence numbers) or large."""

    def register(cls: type) -> type:
        names = [f.name for f in fields(cls)]
        if len(names) != len(validators):
            raise TypeError(f"{cls.__name__}: {len(names)} fields but {len(validators)} validators")
        if type_id in _REGISTRY:
            raise TypeError(f"message type {type_id} registered twice")
        cls.TYPE = type_id  # type: ignore[attr-defined]
        cls.FIELDS = tuple(names)  # type: ignore[attr-defined]
        getter = attrgetter(*names)
        if len(names) == 1:
            ROWS[cls] = lambda msg: [type_id, getter(msg)]
        else:
            ROWS[cls] = lambda msg: [type_id, *getter(msg)]
        _REGISTRY[type_id] = (cls, tuple(validators))
        decoder = _compile_decoder(cls, tuple(validators))
        if cached:
            decoder = _cached_decoder(decoder, tuple(validators))
        DECODERS[type_id] = decoder
        return cls

    return register


_T = TypeVar("_T")


@dataclass_transform(eq_default=True)
def value_class(cls: type[_T]) -> type[_T]:
    """Per-packet records (every wire message, ``Send``): slotted, equal and hashed by value, not frozen."""
    return dataclass(slots=True, unsafe_hash=True)(cls)


class Message:
    """Marker base: every wire message is a slotted dataclass registered with :func:`message`.

    Messages are values: never assign to a field (decoded gossip records are cached and shared by every
    receiver in a process). They are not ``frozen`` dataclasses only for speed: a frozen dataclass
    sets each field through ``object.__setattr__``, several times slower to build, and the simulator
    builds millions of them. Equality and hashing are still by value (``unsafe_hash``)."""

    TYPE: ClassVar[int]
    FIELDS: ClassVar[tuple[str, ...]]
    __slots__ = ()
