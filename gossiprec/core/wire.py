"""Wire format: versioned msgpack, one slotted dataclass per message type, strict validation on decode.

A datagram is a *compound packet*: ``[PROTOCOL_VERSION, [msg, msg, ...]]`` where each ``msg`` is
``[type_id, field1, field2, ...]`` in the dataclass's field order. Encoding never fails for messages the
core built; decoding treats every byte as hostile: it checks the size before parsing, refuses unknown
versions and types, and validates each field's type and range (strings by UTF-8 length, integers by
range, lists by length). Anything wrong raises :class:`~gossiprec.errors.DecodeError` with a short
``reason`` that the caller counts; nothing else escapes :func:`decode_packet`. Larger messages (push-pull
state, agreement payloads) travel on the reliable stream with the same encoding and a larger size limit.

What this module holds: the protocol's version, limits and codes, every message type, and the packet
framing. How a message becomes a row and is validated back (the field validators, the registry that
:func:`~gossiprec.core.codec.message` fills, the generated decoders and their cache) is
:mod:`gossiprec.core.codec`'s; one registry serves every type, so one decoder serves every packet.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import msgpack

from gossiprec.core.codec import (  # ``X as X``: re-exported, so every protocol name comes from here
    DECODERS, MAX_U64 as MAX_U64, ROWS, Message as Message, blob, blobs, boolean, message, optional, record, seq,
    sint, text, uint, value_class as value_class,
)
from gossiprec.errors import DecodeError

PROTOCOL_VERSION = 14
"""Packets of another version are refused: 5 signs progress records (:class:`Progress`, push-pull rows), 6
signs state reports and plan digests (:class:`StateClaim`, :class:`PlanConfirm`: one per member, where a key
book is set), 7 signs the bootstrap (candidate rows with their keys, the seeds' answers, a decision's
proof: :class:`BootHello` ... :class:`BootDecided`), 8 relays signed claims, confirms and votes in bundles
(:class:`ClaimBundle`, :class:`ConfirmBundle`, :class:`VoteBundle`: many members' signatures of one payload),
9 carries the launched mesh in the bootstrap's hello (:class:`BootHello` ``shards``), 10 carries each rank's
mean wait inside its collectives (:class:`Progress`, :class:`Ack` and push-pull rows ``wait_ms``: the straggler
check, :mod:`gossiprec.core.stragglers`), 11 answers a bootstrap hello with only the rows the asker lacks
(:class:`BootKnown` ``start``; :class:`BootHello` ``known`` counts the rows had from that seed), 12 carries a
view's group epoch in its wire form (catch-up's views and ``config_id``: a view that left every group as it was),
13 lets a member without the plan ask another for the signed claims it lacks (:class:`ClaimsAsk`), 14 elects
no holder from a report of step 0 with no bytes once another has trained (the same wire: the plans differ)."""
MAX_NAME = 128
MAX_ADDR = 300
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

# Field validators with the protocol's limits.
U64 = uint()
U32 = uint(2**32 - 1)
NAME = text(MAX_NAME)
ADDR = text(MAX_ADDR, allow_empty=True)
STATUS = uint(len(STATUS_NAMES) - 1)
PHASE = uint(len(PHASES) - 1)
ROLE = uint(len(ROLES) - 1)
STEP = sint(-1, 2**62)
MILLIS = uint(2**31 - 1)
SIG = blob(64)  # a member's signature (gossiprec.core.auth); empty where the cluster runs without them
KEY = blob(64)

# ``cached=True``: Alive, Suspect, Dead, Progress and Alert are broadcasts, which every member receives many
# times over; other types are unique per packet (sequence numbers) or large.


# --- SWIM messages -------------------------------------------------------------------------------
@message(1, U64, NAME, NAME, ADDR)
@value_class
class Ping(Message):
    seq: int
    target: str
    src: str
    src_addr: str


@message(2, U64, NAME, ADDR, NAME, ADDR, boolean)
@value_class
class IndirectPing(Message):
    seq: int
    target: str
    target_addr: str
    src: str
    src_addr: str
    nack: bool


@message(3, U64, NAME, U64, STEP, PHASE, MILLIS, MILLIS, U32, MILLIS)
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
    wait_ms: int = 0  # as Progress.wait_ms


@message(4, U64, NAME)
@value_class
class Nack(Message):
    seq: int
    src: str


@message(5, NAME, ADDR, U64, ROLE, SIG, cached=True)
@value_class
class Alive(Message):
    name: str
    addr: str
    incarnation: int
    role: int
    sig: bytes = b""  # by ``name`` itself (the only member that raises its incarnation)


@message(6, NAME, U64, NAME, SIG, cached=True)
@value_class
class Suspect(Message):
    name: str
    incarnation: int
    src: str
    sig: bytes = b""  # by the accuser ``src``


@message(7, NAME, U64, NAME, SIG, cached=True)
@value_class
class Dead(Message):
    """``src == name`` means a graceful leave, which counts only when ``sig`` is the member's own."""

    name: str
    incarnation: int
    src: str
    sig: bytes = b""


@message(8, NAME, U64, U64, STEP, PHASE, MILLIS, U32, MILLIS, SIG, cached=True)
@value_class
class Progress(Message):
    """A member's training progress; ``version`` grows with every update by its owner. ``coll``: the
    collectives its trainer entered in ``step``, on every group (the hang check compares them).
    ``wait_ms``: the mean milliseconds per step its trainer waited inside its collectives, over its last
    few steps (the straggler check compares them: the rank the others wait for waits least)."""

    name: str
    incarnation: int
    version: int
    step: int
    phase: int
    step_ms: int
    coll: int = 0
    wait_ms: int = 0
    sig: bytes = b""  # by ``name`` itself (relayed copies carry it: only the owner speaks for its progress)


MEMBER_RECORD = record(NAME, ADDR, U64, STATUS, ROLE, U64, STEP, PHASE, MILLIS, U32, MILLIS, SIG, SIG)


@message(9, NAME, ADDR, boolean, boolean, seq(MEMBER_RECORD, MAX_MEMBERS))
@value_class
class PushPull(Message):
    """Anti-entropy: full state. ``members`` rows are (name, addr, incarnation, status, role, progress_version,
    step, phase, step_ms, coll, wait_ms, the member's own signature of its Alive at that incarnation, the member's
    own signature of its :class:`Progress` at that incarnation and version)."""

    src: str
    src_addr: str
    join: bool
    reply: bool
    members: tuple[Any, ...]


# --- packets -------------------------------------------------------------------------------------
_packer = msgpack.Packer(use_bin_type=True)
_pack: Callable[[Any], bytes] = _packer.pack  # (msgpack has no type hints)


def encode_message(msg: Message) -> bytes:
    """One message as a standalone msgpack body (used for sizing and for streams)."""
    return _pack(ROWS[type(msg)](msg))


def encode_packet(msgs: Sequence[Message]) -> bytes:
    """A compound packet of already-chosen messages."""
    return _pack([PROTOCOL_VERSION, [ROWS[type(m)](m) for m in msgs]])


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
    decoder = DECODERS.get(item[0]) if type(item[0]) is int else None
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
    decoders = DECODERS
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
EPOCH = uint(2**62)
CFG = text(32)
DIGEST = blob(32)
CHANGE = record(NAME, uint(1), ADDR, text(MAX_NAME, allow_empty=True), text(MAX_NAME, allow_empty=True))
CHANGES = seq(CHANGE, MAX_MEMBERS)
BITMAP = blob(MAX_MEMBERS // 8 + 1)

# Alert reasons
UNREACHABLE, HUNG, DEPARTED, JOINING, RESTARTED, IMPLAUSIBLE, STRAGGLER = 0, 1, 2, 3, 4, 5, 6
ALERT_REASONS = ("unreachable", "hung", "departed", "joining", "restarted", "implausible", "straggler")


@message(20, EPOCH, CFG, NAME, NAME, uint(1), uint(len(ALERT_REASONS) - 1), boolean, ADDR,
         text(MAX_NAME, allow_empty=True),
         text(MAX_NAME, allow_empty=True), U64, SIG, cached=True)
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


@message(24, EPOCH, CFG, uint(2**31), NAME, SIG)
@value_class
class Prepare(Message):
    epoch: int
    config: str
    round: int
    coordinator: str
    sig: bytes = b""


@message(25, EPOCH, CFG, uint(2**31), NAME, NAME, uint(2**31), text(MAX_NAME, allow_empty=True),
         optional(DIGEST), optional(CHANGES), SIG)
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


@message(26, EPOCH, CFG, uint(2**31), NAME, DIGEST, CHANGES, SIG)
@value_class
class Accept(Message):
    epoch: int
    config: str
    round: int
    coordinator: str
    digest: bytes
    changes: tuple[Any, ...]
    sig: bytes = b""


@message(27, EPOCH, CFG, uint(2**31), NAME, DIGEST, NAME, SIG)
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
class Vote(Message):  # one member's signed fast-round vote (instead of bitmaps, where the cluster signs;
    # relayed in a VoteBundle)
    epoch: int
    config: str
    digest: bytes
    voter: str
    sig: bytes = b""


@message(28, EPOCH, text(32, allow_empty=True), NAME, ADDR)
@value_class
class ViewRequest(Message):
    """Catch-up: ``src`` holds view (``epoch``, ``config``) (``config`` empty: none yet) and asks for news."""

    epoch: int
    config: str
    src: str
    src_addr: str


def _any_view(v: Any) -> Any:
    # Structure checked by View.from_wire; here only that it is a list of bounded size.
    if type(v) is not list or len(v) != 7:
        raise DecodeError("bad_field", "view must be a 7-element list")
    return v


@message(29, _any_view, text(MAX_NAME, allow_empty=True), SIG)
@value_class
class ViewState(Message):
    view: list[Any]
    src: str = ""
    sig: bytes = b""


MAX_DELTA_STEPS = 16
"""Longest chain of view changes a :class:`ViewDelta` carries (a member further behind gets the full view)."""


@message(33, EPOCH, CFG, seq(record(CFG, CHANGES), MAX_DELTA_STEPS), text(MAX_NAME, allow_empty=True), SIG)
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


@message(30, NAME, ADDR, text(MAX_NAME, allow_empty=True), text(MAX_NAME, allow_empty=True), EPOCH)
@value_class
class JoinRequest(Message):
    node: str
    addr: str
    host: str
    rack: str
    epoch: int


@message(35, NAME, ADDR, U64, EPOCH, text(32, allow_empty=True), SIG)
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


@message(31, EPOCH, CFG, STEP, optional(STEP), uint(2**62), BITMAP)
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


@message(38, EPOCH, CFG, NAME, STEP, optional(STEP), uint(2**62), SIG)
@value_class
class StateClaim(Message):
    """``node``'s own state report for the plan of ``epoch``, signed by it: with a key book, what a
    :class:`Report` bitmap carries for one member (as :class:`Vote` for :class:`Votes`); its author sends it
    so, relays gather claims of one value in a :class:`ClaimBundle`."""

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
    :class:`PlanDigest` bitmap carries for one member; relayed in a :class:`ConfirmBundle`."""

    epoch: int
    config: str
    node: str
    digest: bytes
    sig: bytes = b""


# --- signed bundles: many members' own signatures of one payload (gossiprec.core.bundles) ------------
BUNDLE_MAX = 16
"""Most members one bundle carries; a sender's chunk is smaller where its MTU needs it."""
FIRST = uint(MAX_MEMBERS)
BUNDLE_BITS = blob(BUNDLE_MAX // 8)
BUNDLE_SIGS = blobs(64, BUNDLE_MAX)  # as SIG, each


@message(47, EPOCH, CFG, STEP, optional(STEP), uint(2**62), FIRST, BUNDLE_BITS, BUNDLE_SIGS)
@value_class
class ClaimBundle(Message):
    """:class:`StateClaim` s of one value, relayed together: bit ``j`` of ``bitmap`` names the view's
    member ``first + j`` (sorted order), whose signature of its own claim is the next of ``sigs``."""

    epoch: int
    config: str
    committed_step: int
    inflight_step: int | None
    state_bytes: int
    first: int
    bitmap: bytes
    sigs: tuple[bytes, ...]


@message(48, EPOCH, CFG, DIGEST, FIRST, BUNDLE_BITS, BUNDLE_SIGS)
@value_class
class ConfirmBundle(Message):
    """:class:`PlanConfirm` s of one digest, relayed together (bits and signatures as :class:`ClaimBundle`)."""

    epoch: int
    config: str
    digest: bytes
    first: int
    bitmap: bytes
    sigs: tuple[bytes, ...]


@message(49, EPOCH, CFG, DIGEST, FIRST, BUNDLE_BITS, BUNDLE_SIGS)
@value_class
class VoteBundle(Message):
    """Signed :class:`Vote` s for one proposal, relayed together (bits and signatures as :class:`ClaimBundle`)."""

    epoch: int
    config: str
    digest: bytes
    first: int
    bitmap: bytes
    sigs: tuple[bytes, ...]


@message(52, EPOCH, CFG, NAME, BITMAP, SIG)
@value_class
class ClaimsAsk(Message):
    """``src``, still without the plan of ``epoch``, asks for the signed state claims it lacks: bit ``i`` of
    ``have`` (over the view's sorted members) is set for each member whose claim it holds. The answer is
    :class:`ClaimBundle` s of the claims the asked member holds and the asker does not. Signed by ``src``
    (the answer goes to it: a key holder cannot point every member's answers at another)."""

    epoch: int
    config: str
    src: str
    have: bytes
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
# A candidate: (name, addr, host, local index, spare by flag, its public key, its own signature of the
# row's other fields). ``key`` and ``sig`` are empty where agents run unsigned.
CANDIDATE = record(NAME, ADDR, text(MAX_NAME, allow_empty=True), uint(2**31), boolean, KEY, SIG)
CANDIDATES = seq(CANDIDATE, MAX_MEMBERS)
ROUND = uint(2**31)
SIZE = uint(MAX_MEMBERS)
SIGNER = text(MAX_NAME, allow_empty=True)
# One signed accepted of a decision's proof: (the seed address it accepted as, the acceptor's row, its sig).
PROOF = seq(record(ADDR, CANDIDATE, SIG), MAX_MEMBERS)


@message(40, CANDIDATE, SIZE, SIZE, SIZE, ADDR, SIZE, SIG)
@value_class
class BootHello(Message):
    """A candidate for view 0 to a seed: who it is, the job size it was started for (``expected``
    members, ``spares`` of them spares), how many rows of this seed's list it has had from it (its
    answers, :class:`BootKnown`, in order), ``to``, the seed address it was
    sent to (the seed signs its answer as that seed), and ``shards``, the replica groups of the mesh it
    was started with (1: plain DDP; the replicate dimension comes first, so the count fixes the groups)."""

    candidate: tuple[Any, ...]
    expected: int
    spares: int
    known: int
    to: str = ""
    shards: int = 1
    sig: bytes = b""  # by the candidate (the key its row names)


@message(41, ADDR, SIGNER, CANDIDATES, SIZE, SIG)
@value_class
class BootKnown(Message):
    """A seed's answer to a hello: the candidates it knows, in the order it learnt them, from ``start``
    on (the hello's ``known``: what the asker already had from this seed), so that a candidate asking
    again gets only what is new; ``seed``: the seed address it answers as, ``signer``: its own
    candidate name."""

    seed: str
    signer: str
    candidates: tuple[Any, ...]
    start: int = 0
    sig: bytes = b""  # by ``signer``


@message(42, ROUND, NAME, ADDR, ADDR, SIG)
@value_class
class BootPrepare(Message):
    """Paxos phase 1 for view 0: ballot (``round``, ``proposer``); ``to`` is the seed address it was sent
    to (the acceptor's identity in the proposer's quorum), ``reply_to`` the proposer's address."""

    round: int
    proposer: str
    to: str
    reply_to: str
    sig: bytes = b""  # by ``proposer`` (signing, a seed)


@message(43, ADDR, boolean, ROUND, NAME, ROUND, text(MAX_NAME, allow_empty=True), CANDIDATES, CANDIDATES, SIGNER,
         SIG)
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
    signer: str = ""  # the acceptor's candidate name
    sig: bytes = b""  # by ``signer``


@message(44, ROUND, NAME, ADDR, ADDR, CANDIDATES, SIG)
@value_class
class BootAccept(Message):
    """Paxos phase 2 for view 0: accept ``value`` (the candidates of view 0) at ballot (round, proposer)."""

    round: int
    proposer: str
    to: str
    reply_to: str
    value: tuple[Any, ...]
    sig: bytes = b""  # by ``proposer``: no one else puts a value in its ballot


@message(45, ADDR, boolean, ROUND, NAME, DIGEST, SIGNER, SIG)
@value_class
class BootAccepted(Message):
    """An acceptor's answer to an accept: ``ok`` at that ballot for the value of ``digest``, else the
    higher ballot it promised."""

    acceptor: str
    ok: bool
    round: int
    proposer: str
    digest: bytes = b""
    signer: str = ""  # the acceptor's candidate name
    sig: bytes = b""  # by ``signer``: a decision's proof carries it


@message(46, CANDIDATES, ROUND, text(MAX_NAME, allow_empty=True), PROOF)
@value_class
class BootDecided(Message):
    """View 0's candidates, decided at ballot (round, proposer); ``proof``: a majority of the seeds'
    signed accepteds of it (empty where agents run unsigned)."""

    value: tuple[Any, ...]
    round: int = 0
    proposer: str = ""
    proof: tuple[Any, ...] = ()


# --- operator queries from another host (gossiprec.agent.remote, gossiprec.agent.remote_client) ----------
OPS_WHAT = ("members", "status")
"""What an :class:`OpsQuery` asks for, by its code on the wire."""
OPS_PAGE_MAX = 1024 * 1024
"""Largest ``data`` of one :class:`OpsPage` (the agent pages below this and its stream limit)."""


@message(50, uint(len(OPS_WHAT) - 1), U64, ADDR)
@value_class
class OpsQuery(Message):
    """An operator's ``members`` / ``status`` query (``what``: an index of :data:`OPS_WHAT`) sent as one
    sealed datagram by a key holder; ``req`` names the answer, ``reply_to`` is where the querier listens:
    the agent answers only when it is the datagram's own source address."""

    what: int
    req: int
    reply_to: str


@message(51, U64, U32, boolean, blob(OPS_PAGE_MAX))
@value_class
class OpsPage(Message):
    """One page of the answer to query ``req``, sent on the reliable stream: ``data`` pages ``index``
    0, 1, ... concatenate to one msgpack map (``last`` marks the final page)."""

    req: int
    index: int
    last: bool
    data: bytes
