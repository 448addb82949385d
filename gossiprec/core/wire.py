"""Wire format: versioned msgpack, one slotted dataclass per message type, strict validation on decode.

A datagram is a *compound packet*: ``[PROTOCOL_VERSION, [msg, msg, ...]]`` where each ``msg`` is
``[type_id, field1, field2, ...]`` in the dataclass's field order. Encoding never fails for messages the
core built; decoding treats every byte as hostile: it checks the size before parsing, refuses unknown
versions and types, and validates each field's type and range (strings by UTF-8 length, integers by
range, lists by length). Anything wrong raises :class:`~gossiprec.errors.DecodeError` with a short
``reason`` that the caller counts; nothing else escapes :func:`decode_packet`. Larger messages (push-pull
state, agreement payloads) travel on the reliable stream with the same encoding and a larger size limit.
Message types are registered with :func:`message` (later modules add their own types to the same
registry, so one decoder serves all of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, Callable, ClassVar, Iterable, Sequence, TypeVar, dataclass_transform

import msgpack

from gossiprec.errors import DecodeError

PROTOCOL_VERSION = 6
"""Packets of another version are refused: 5 signs progress records (:class:`Progress`, push-pull rows), 6
signs state reports and plan digests (:class:`StateClaim`, :class:`PlanConfirm`: one per member, where a key
book is set)."""
MAX_NAME = 128
MAX_ADDR = 300
MAX_U64 = 2**64 - 1
MAX_INCARNATION = 2**62
"""Incarnations above this are refused: a refutation adds one, and must still encode."""
MAX_MEMBERS = 100_000

# Member status on the wire.
ALIVE, SUSPECT, DEAD, LEFT = 0, 1, 2, 3
STATUS_NAMES = ("alive", "suspect", "dead", "left")

# Training phase on the wire. Order matters to hang detection (a rank stalled at a smaller (step, phase)
# than the others is behind them): "waiting" (a rank whose collective waits on its peers, so it is
# alive) comes after "communicate" and "optimizer", which leaves a rank frozen in either behind it.
PHASES = ("idle", "compute", "communicate", "optimizer", "checkpoint", "recovering", "waiting")
ROLES = ("trainer", "spare")

Validator = Callable[[Any], Any]


# --- field validators -----------------------------------------------------------------------------
def _uint(limit: int = MAX_U64) -> Validator:
    def check(v: Any) -> int:
        if type(v) is not int or v < 0 or v > limit:
            raise DecodeError("bad_field", f"expected integer 0..{limit}, got {type(v).__name__}")
        return v

    check.inline = f"type({{v}}) is not int or {{v}} < 0 or {{v}} > {limit}"  # type: ignore[attr-defined]
    return check


def _sint(lo: int, hi: int) -> Validator:
    def check(v: Any) -> int:
        if type(v) is not int or v < lo or v > hi:
            raise DecodeError("bad_field", f"expected integer {lo}..{hi}")
        return v

    check.inline = f"type({{v}}) is not int or {{v}} < {lo} or {{v}} > {hi}"  # type: ignore[attr-defined]
    return check


def _text(max_bytes: int, allow_empty: bool = False) -> Validator:
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


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise DecodeError("bad_field", "expected boolean")
    return v


_bool.inline = "type({v}) is not bool"  # type: ignore[attr-defined]


def _real(lo: float, hi: float) -> Validator:
    def check(v: Any) -> float:
        if type(v) not in (int, float) or not math.isfinite(v) or v < lo or v > hi:
            raise DecodeError("bad_field", f"expected number {lo}..{hi}")
        return float(v)

    return check


def _blob(max_bytes: int) -> Validator:
    def check(v: Any) -> bytes:
        if type(v) is not bytes or len(v) > max_bytes:
            raise DecodeError("bad_field", f"expected bytes of at most {max_bytes}")
        return v

    check.inline = f"type({{v}}) is not bytes or len({{v}}) > {max_bytes}"  # type: ignore[attr-defined]
    return check


def _seq(item: Validator, max_len: int) -> Validator:
    def check(v: Any) -> tuple[Any, ...]:
        if type(v) is not list or len(v) > max_len:
            raise DecodeError("bad_field", f"expected list of at most {max_len}")
        return tuple(item(x) for x in v)

    return check


def _record(*items: Validator) -> Validator:
    n = len(items)

    def check(v: Any) -> tuple[Any, ...]:
        if type(v) is not list or len(v) != n:
            raise DecodeError("bad_field", f"expected record of {n} fields")
        return tuple(f(x) for f, x in zip(items, v))

    return check


def _optional(inner: Validator) -> Validator:
    def check(v: Any) -> Any:
        return None if v is None else inner(v)

    return check


U64 = _uint()
U32 = _uint(2**32 - 1)
NAME = _text(MAX_NAME)
ADDR = _text(MAX_ADDR, allow_empty=True)
STATUS = _uint(len(STATUS_NAMES) - 1)
PHASE = _uint(len(PHASES) - 1)
ROLE = _uint(len(ROLES) - 1)
STEP = _sint(-1, 2**62)
MILLIS = _uint(2**31 - 1)
SIG = _blob(64)  # a member's signature (gossiprec.core.auth); empty where the cluster runs without them
KEY = _blob(64)

_REGISTRY: dict[int, tuple[type, tuple[Validator, ...]]] = {}
_DECODERS: dict[int, Callable[[list[Any]], Any]] = {}

_CACHE: dict[tuple[Any, ...], Any] = {}
"""Decoded gossip messages by field values (see :func:`_cached_decoder`); shared by every machine in the
process, cleared whenever it reaches :data:`CACHE_MAX` entries."""
CACHE_MAX = 1 << 16
_CACHED_TYPES = frozenset((5, 6, 7, 8, 20))
"""Alive, Suspect, Dead, Progress, Alert: broadcasts, which every member receives many times over (the
same bytes, piggybacked on many packets). Other types are unique per packet (sequence numbers) or large."""


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


def message(type_id: int, *validators: Validator) -> Callable[[type], type]:
    """Class decorator: register a slotted dataclass as wire message ``type_id`` with field validators."""

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
            _ROWS[cls] = lambda msg: [type_id, getter(msg)]
        else:
            _ROWS[cls] = lambda msg: [type_id, *getter(msg)]
        _REGISTRY[type_id] = (cls, tuple(validators))
        decoder = _compile_decoder(cls, tuple(validators))
        if type_id in _CACHED_TYPES:
            decoder = _cached_decoder(decoder, tuple(validators))
        _DECODERS[type_id] = decoder
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


_ROWS: dict[type, Callable[[Any], list[Any]]] = {}
"""Per message class: msg -> [TYPE, *fields] (a C attrgetter; msgpack writes nested tuples as arrays)."""


def _to_list(msg: Any) -> list[Any]:
    return _ROWS[type(msg)](msg)


# --- SWIM messages -------------------------------------------------------------------------------
@message(1, U64, NAME, NAME, ADDR)
@value_class
class Ping(Message):
    seq: int
    target: str
    src: str
    src_addr: str


@message(2, U64, NAME, ADDR, NAME, ADDR, _bool)
@value_class
class IndirectPing(Message):
    seq: int
    target: str
    target_addr: str
    src: str
    src_addr: str
    nack: bool


@message(3, U64, NAME, U64, STEP, PHASE, MILLIS, MILLIS, U32)
@value_class
class Ack(Message):
    """Answer to a ping; carries the acker's incarnation and training progress."""

    seq: int
    src: str
    incarnation: int
    step: int
    phase: int
    step_ms: int
    stall_ms: int = 0
    """Milliseconds its position (step, coll, phase) had been current when sent: observers date a stall by
    the trainer's own report. Only acks carry it (an observer probes a rank it is about to judge), so
    gossiped Progress records stay byte-identical as they spread and decode from a cache."""
    coll: int = 0  # as Progress.coll


@message(4, U64, NAME)
@value_class
class Nack(Message):
    seq: int
    src: str


@message(5, NAME, ADDR, U64, ROLE, SIG)
@value_class
class Alive(Message):
    name: str
    addr: str
    incarnation: int
    role: int
    sig: bytes = b""  # by ``name`` itself (the only member that raises its incarnation)


@message(6, NAME, U64, NAME, SIG)
@value_class
class Suspect(Message):
    name: str
    incarnation: int
    src: str
    sig: bytes = b""  # by the accuser ``src``


@message(7, NAME, U64, NAME, SIG)
@value_class
class Dead(Message):
    """``src == name`` means a graceful leave, which counts only when ``sig`` is the member's own."""

    name: str
    incarnation: int
    src: str
    sig: bytes = b""


@message(8, NAME, U64, U64, STEP, PHASE, MILLIS, U32, SIG)
@value_class
class Progress(Message):
    """A member's training progress; ``version`` grows with every update by its owner. ``coll``: the
    collectives its trainer entered in ``step``, on every group (the hang check compares them)."""

    name: str
    incarnation: int
    version: int
    step: int
    phase: int
    step_ms: int
    coll: int = 0
    sig: bytes = b""  # by ``name`` itself (relayed copies carry it: only the owner speaks for its progress)


MEMBER_RECORD = _record(NAME, ADDR, U64, STATUS, ROLE, U64, STEP, PHASE, MILLIS, U32, SIG, SIG)


@message(9, NAME, ADDR, _bool, _bool, _seq(MEMBER_RECORD, MAX_MEMBERS))
@value_class
class PushPull(Message):
    """Anti-entropy: full state. ``members`` rows are (name, addr, incarnation, status, role, progress_version,
    step, phase, step_ms, coll, the member's own signature of its Alive at that incarnation, the member's
    own signature of its :class:`Progress` at that incarnation and version)."""

    src: str
    src_addr: str
    join: bool
    reply: bool
    members: tuple[Any, ...]


# --- codec ---------------------------------------------------------------------------------------
_packer = msgpack.Packer(use_bin_type=True)
_pack: Callable[[Any], bytes] = _packer.pack  # (msgpack has no type hints)


def encode_message(msg: Message) -> bytes:
    """One message as a standalone msgpack body (used for sizing and for streams)."""
    return _pack(_ROWS[type(msg)](msg))


def encode_packet(msgs: Sequence[Message]) -> bytes:
    """A compound packet of already-chosen messages."""
    return _pack([PROTOCOL_VERSION, [_to_list(m) for m in msgs]])


_HEADS = tuple(bytes((0x92, PROTOCOL_VERSION, 0x90 | n)) for n in range(16))
"""Packet heads for 0..15 messages (a fixarray)."""


def encode_parts(parts: Iterable[bytes]) -> bytes:
    """A compound packet from pre-encoded message bodies (see :func:`encode_message`)."""
    if type(parts) is not list:
        parts = list(parts)
    n = len(parts)
    if n < 16:
        head = _HEADS[n]
    else:
        head = bytes((0x92, PROTOCOL_VERSION, 0xDC)) + n.to_bytes(2, "big")
    return head + b"".join(parts)


PACKET_OVERHEAD = 5
"""Bytes a compound packet adds around its message bodies (upper bound)."""


def _decode_one(item: Any) -> Message:
    if type(item) is not list or not item:
        raise DecodeError("bad_message", "message is not a non-empty list")
    decoder = _DECODERS.get(item[0]) if type(item[0]) is int else None
    if decoder is None:
        raise DecodeError("unknown_type", repr(item[0])[:20])
    return decoder(item)  # type: ignore[no-any-return]


def decode_packet(data: bytes, max_size: int) -> list[Message]:
    """Decode a compound packet. Raises DecodeError (never anything else) on any defect."""
    if len(data) > max_size:
        raise DecodeError("oversized", f"{len(data)} > {max_size} bytes")
    if not data:
        raise DecodeError("truncated", "empty packet")
    try:
        obj = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True,
            max_str_len=max_size, max_bin_len=max_size,
            max_array_len=MAX_MEMBERS + 16, max_map_len=1024, max_ext_len=0,
        )
    except DecodeError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            UnicodeDecodeError, OverflowError, RecursionError, MemoryError) as exc:
        raise DecodeError("malformed", type(exc).__name__) from None
    except Exception as exc:  # msgpack raises assorted types on hostile input
        raise DecodeError("malformed", type(exc).__name__) from None
    if type(obj) is not list or len(obj) != 2:
        raise DecodeError("malformed", "packet is not [version, messages]")
    if obj[0] != PROTOCOL_VERSION or type(obj[0]) is not int:
        raise DecodeError("bad_version", repr(obj[0])[:20])
    body = obj[1]
    if type(body) is not list or not body:
        raise DecodeError("malformed", "no messages")
    # _decode_one, inlined (the hot path of every receive)
    decoders = _DECODERS
    out = []
    for item in body:
        if type(item) is not list or not item:
            raise DecodeError("bad_message", "message is not a non-empty list")
        tid = item[0]
        decoder = decoders.get(tid) if type(tid) is int else None
        if decoder is None:
            raise DecodeError("unknown_type", repr(tid)[:20])
        out.append(decoder(item))
    return out


# --- agreement messages (views, alerts, votes, Paxos fallback, reports) ---------------------------
EPOCH = _uint(2**62)
CFG = _text(32)
DIGEST = _blob(32)
CHANGE = _record(NAME, _uint(1), ADDR, _text(MAX_NAME, allow_empty=True), _text(MAX_NAME, allow_empty=True))
CHANGES = _seq(CHANGE, MAX_MEMBERS)
BITMAP = _blob(MAX_MEMBERS // 8 + 1)

# Alert reasons
UNREACHABLE, HUNG, DEPARTED, JOINING, RESTARTED, IMPLAUSIBLE = 0, 1, 2, 3, 4, 5
ALERT_REASONS = ("unreachable", "hung", "departed", "joining", "restarted", "implausible")


@message(20, EPOCH, CFG, NAME, NAME, _uint(1), _uint(len(ALERT_REASONS) - 1), _bool, ADDR,
         _text(MAX_NAME, allow_empty=True),
         _text(MAX_NAME, allow_empty=True), U64, SIG)
@value_class
class Alert(Message):
    """Observer's judgement about a subject (kind REMOVE=0 / JOIN=1); ``retract`` withdraws it; ``seq``
    orders the observer's alerts in the view (an older copy, late or echoed, is no news)."""

    epoch: int
    config: str
    observer: str
    subject: str
    kind: int
    reason: int
    retract: bool
    addr: str
    host: str
    rack: str
    seq: int = 0
    sig: bytes = b""


@message(21, EPOCH, CFG, DIGEST, CHANGES)
@value_class
class Proposal(Message):
    epoch: int
    config: str
    digest: bytes
    changes: tuple[Any, ...]


@message(22, EPOCH, CFG, DIGEST, BITMAP)
@value_class
class Votes(Message):
    """Fast-round votes for one proposal, as a bitmap over the view's sorted members (merged by OR)."""

    epoch: int
    config: str
    digest: bytes
    bitmap: bytes


@message(23, EPOCH, CFG, DIGEST, CHANGES)
@value_class
class Decided(Message):
    epoch: int
    config: str
    digest: bytes
    changes: tuple[Any, ...]


@message(24, EPOCH, CFG, _uint(2**31), NAME, SIG)
@value_class
class Prepare(Message):
    epoch: int
    config: str
    round: int
    coordinator: str
    sig: bytes = b""


@message(25, EPOCH, CFG, _uint(2**31), NAME, NAME, _uint(2**31), _text(MAX_NAME, allow_empty=True),
         _optional(DIGEST), _optional(CHANGES), SIG)
@value_class
class Promise(Message):
    epoch: int
    config: str
    round: int
    coordinator: str
    acceptor: str
    vround: int
    vcoordinator: str
    vdigest: bytes | None
    vchanges: tuple[Any, ...] | None
    sig: bytes = b""


@message(26, EPOCH, CFG, _uint(2**31), NAME, DIGEST, CHANGES, SIG)
@value_class
class Accept(Message):
    epoch: int
    config: str
    round: int
    coordinator: str
    digest: bytes
    changes: tuple[Any, ...]
    sig: bytes = b""


@message(27, EPOCH, CFG, _uint(2**31), NAME, DIGEST, NAME, SIG)
@value_class
class Accepted(Message):
    epoch: int
    config: str
    round: int
    coordinator: str
    digest: bytes
    acceptor: str
    sig: bytes = b""


@message(37, EPOCH, CFG, DIGEST, NAME, SIG)
@value_class
class Vote(Message):  # one member's signed fast-round vote (instead of bitmaps, where the cluster signs)
    epoch: int
    config: str
    digest: bytes
    voter: str
    sig: bytes = b""


@message(28, EPOCH, _text(32, allow_empty=True), NAME, ADDR)
@value_class
class ViewRequest(Message):
    """Catch-up: ``src`` holds view (``epoch``, ``config``) (``config`` empty: none yet) and asks for news."""

    epoch: int
    config: str
    src: str
    src_addr: str


def _any_view(v: Any) -> Any:
    # Structure checked by View.from_wire; here only that it is a list of bounded size.
    if type(v) is not list or len(v) != 6:
        raise DecodeError("bad_field", "view must be a 6-element list")
    return v


@message(29, _any_view, _text(MAX_NAME, allow_empty=True), SIG)
@value_class
class ViewState(Message):
    view: list[Any]
    src: str = ""
    sig: bytes = b""


MAX_DELTA_STEPS = 16
"""Longest chain of view changes a :class:`ViewDelta` carries (a member further behind gets the full view)."""


@message(33, EPOCH, CFG, _seq(_record(CFG, CHANGES), MAX_DELTA_STEPS), _text(MAX_NAME, allow_empty=True), SIG)
@value_class
class ViewDelta(Message):
    """Catch-up for a member that holds view (``epoch``, ``config``): the change sets that lead from it to
    the sender's view, each with the config id it must produce. O(changes) instead of the O(N) full
    :class:`ViewState`; the receiver recomputes every step (the transition is a pure function) and
    refuses the delta when a config id differs."""

    epoch: int
    config: str
    steps: tuple[Any, ...]
    src: str = ""
    sig: bytes = b""


@message(30, NAME, ADDR, _text(MAX_NAME, allow_empty=True), _text(MAX_NAME, allow_empty=True), EPOCH)
@value_class
class JoinRequest(Message):
    node: str
    addr: str
    host: str
    rack: str
    epoch: int


@message(35, NAME, ADDR, U64, EPOCH, _text(32, allow_empty=True), SIG)
@value_class
class Hello(Message):
    """A new process of ``node`` (started at ``incarnation``) holds view (``epoch``, ``config``), which lists
    it: to its observers, for a while after it starts. An observer that had answers from an older process
    alerts (``restarted``); a member holding a later view sends its news back."""

    node: str
    addr: str
    incarnation: int
    epoch: int
    config: str
    sig: bytes = b""  # by ``node``: required where its key is pinned (else its new key is not yet bound)


@message(31, EPOCH, CFG, STEP, _optional(STEP), _uint(2**62), BITMAP)
@value_class
class Report(Message):
    """State reports for the plan of ``epoch``, aggregated: every holder whose bit is set in ``bitmap``
    (over the view's sorted members) reports exactly these values. Merged by OR, like votes."""

    epoch: int
    config: str
    committed_step: int
    inflight_step: int | None
    state_bytes: int
    bitmap: bytes


@message(38, EPOCH, CFG, NAME, STEP, _optional(STEP), _uint(2**62), SIG)
@value_class
class StateClaim(Message):
    """``node``'s own state report for the plan of ``epoch``, signed by it: with a key book, what a
    :class:`Report` bitmap carries for one member, one message each (as :class:`Vote` for :class:`Votes`)."""

    epoch: int
    config: str
    node: str
    committed_step: int
    inflight_step: int | None
    state_bytes: int
    sig: bytes = b""


@message(32, EPOCH, CFG, DIGEST, BITMAP)
@value_class
class PlanDigest(Message):
    """Members (bitmap) that computed the plan with this digest for ``epoch``."""

    epoch: int
    config: str
    digest: bytes
    bitmap: bytes


@message(39, EPOCH, CFG, NAME, DIGEST, SIG)
@value_class
class PlanConfirm(Message):
    """``node`` computed the plan with this digest for ``epoch``, signed by it: with a key book, what a
    :class:`PlanDigest` bitmap carries for one member, one message each."""

    epoch: int
    config: str
    node: str
    digest: bytes
    sig: bytes = b""


@message(34, EPOCH, STEP, NAME, SIG)
@value_class
class JobDone(Message):
    """The job's trainers finished training at ``step`` (sent by ``src``, a trainer of view ``epoch``):
    spares are no longer needed, and departures from here on are the job's end, not failures."""

    epoch: int
    step: int
    src: str
    sig: bytes = b""


@message(36, NAME, KEY)
@value_class
class KeyClaim(Message):
    """``node`` signs with ``key`` (bound on first use, see :mod:`gossiprec.core.auth`)."""

    node: str
    key: bytes


# --- bootstrap: view 0 agreed without a job spec (gossiprec.core.bootstrap) ---------------------------
# a candidate: (name, addr, host, local index, spare by flag)
CANDIDATE = _record(NAME, ADDR, _text(MAX_NAME, allow_empty=True), _uint(2**31), _bool)
CANDIDATES = _seq(CANDIDATE, MAX_MEMBERS)
ROUND = _uint(2**31)
SIZE = _uint(MAX_MEMBERS)


@message(40, CANDIDATE, SIZE, SIZE, SIZE)
@value_class
class BootHello(Message):
    """A candidate for view 0 to a seed: who it is, the job size it was started for (``expected``
    members, ``spares`` of them spares) and how many candidates it knows."""

    candidate: tuple[Any, ...]
    expected: int
    spares: int
    known: int


@message(41, CANDIDATES)
@value_class
class BootKnown(Message):
    """A seed's answer to a hello: every candidate it knows."""

    candidates: tuple[Any, ...]


@message(42, ROUND, NAME, ADDR, ADDR)
@value_class
class BootPrepare(Message):
    """Paxos phase 1 for view 0: ballot (``round``, ``proposer``); ``to`` is the seed address it was sent
    to (the acceptor's identity in the proposer's quorum), ``reply_to`` the proposer's address."""

    round: int
    proposer: str
    to: str
    reply_to: str


@message(43, ADDR, _bool, ROUND, NAME, ROUND, _text(MAX_NAME, allow_empty=True), CANDIDATES, CANDIDATES)
@value_class
class BootPromise(Message):
    """An acceptor's answer to a prepare: ``ok`` with the ballot promised (else the higher ballot it
    holds), the value it accepted last (empty: none) and every candidate it knows."""

    acceptor: str
    ok: bool
    round: int
    proposer: str
    accepted_round: int
    accepted_proposer: str
    accepted: tuple[Any, ...]
    known: tuple[Any, ...]


@message(44, ROUND, NAME, ADDR, ADDR, CANDIDATES)
@value_class
class BootAccept(Message):
    """Paxos phase 2 for view 0: accept ``value`` (the candidates of view 0) at ballot (round, proposer)."""

    round: int
    proposer: str
    to: str
    reply_to: str
    value: tuple[Any, ...]


@message(45, ADDR, _bool, ROUND, NAME)
@value_class
class BootAccepted(Message):
    """An acceptor's answer to an accept: ``ok`` at that ballot, else the higher ballot it promised."""

    acceptor: str
    ok: bool
    round: int
    proposer: str


@message(46, CANDIDATES)
@value_class
class BootDecided(Message):
    """View 0's candidates, decided by a quorum of the seeds."""

    value: tuple[Any, ...]
