"""The control protocol between the agent and the training process: framing, messages, error codes.

Frames in both directions are a 4-byte big-endian length followed by one msgpack map. A connection
starts with a handshake::

    -> {"op": "hello", "version": 3}
    <- {"ok": true, "version": 3, "node": NAME, "max_frame": BYTES}

then requests, each optionally carrying an ``"id"`` (int or string) echoed in its reply, and
``"noreply": true`` to skip the reply on success (errors are always answered)::

    {"op": "report", "step": 12, "phase": "compute", "step_ms": 840}   -> machine.set_progress
    {"op": "state", "committed_step": 12, "inflight_step": None,
     "state_bytes": N, "transfer_port": P}                              -> machine.set_state
    {"op": "finished", "step": 100}                                     -> machine.finish
    {"op": "recovered", "record": {...}}                                -> the agent's recovery log
    {"op": "checked", "ok": true}                                       -> a replica check's result
    {"op": "members"}                                                   -> {"members": [...]}
    {"op": "status"}                                                    -> {"status": {...}}
    {"op": "subscribe"} / {"op": "unsubscribe"}                         -> event stream on/off
    {"op": "follow", "queue": 1000, "probes": false}                    -> lossy event stream on
    {"op": "register_layout", "layout": {...}} / {"op": "get_layout"}   -> opaque dict kept by the agent
    {"op": "ping"}                                                      -> {"pong": true}

Replies are ``{"ok": true, "id": ID, ...}`` or ``{"ok": false, "id": ID, "error": CODE, "message": TEXT}``.
A subscribed connection also receives every event of the protocol machine as
``{"event": ClassName, field: value, ...}`` (:func:`event_to_dict`; a plan in its wire form,
:meth:`~gossiprec.core.election.Plan.to_wire`), interleaved with replies; replies never carry an
``"event"`` key. :func:`decode_event` reads such a frame back as the core's event object, every
field checked against the event class's own annotations: the trainer matches on those classes, so
the two sides share one definition. A peer of another version is refused at the handshake.
``follow`` (``gossiprec events``) is ``subscribe`` for people: each event frame also carries ``"time"``
(unix seconds when the agent published it), probe outcomes are left out unless ``probes``, and a reader
that falls ``queue`` events behind is never disconnected for it: the events that do not fit are dropped
and one ``{"event": "Gap", "dropped": N, "at": T, "time": T}`` takes their place. An agent older than
``follow`` answers ``unknown_op`` (the op is new, the version is not).

``recovered`` carries one finished recovery of the trainer (:data:`RECOVERY_FIELDS`, checked by
:func:`recovered_args`): the fields of a ``recovery`` line of the agent's timeline file
(:mod:`gossiprec.agent.recoveries`), which the agent completes with the time and its name. ``checked``
says how one comparison of the replicas' digests ended (``ok`` false: a mismatch).

Error codes: ``bad_frame`` (a length of 0 or above the limit), ``bad_msgpack``, ``bad_request`` (not a
map with a string ``op``), ``bad_handshake``, ``unsupported_version``, ``unknown_op``, ``timeout``,
``overflow`` (a subscriber read too slowly) and ``shutdown`` end the connection (:data:`DISCONNECTING`);
``bad_args`` (a bad value for a known op, checked by the ``*_args`` functions here) is answered and
the connection stays. The clients add ``unavailable``, ``disconnected`` and ``bad_reply``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import msgpack

from gossiprec.core import events as core_events
from gossiprec.core.election import Plan
from gossiprec.core.wire import PHASES
from gossiprec.errors import DecodeError, ProtocolError

if TYPE_CHECKING:
    from gossiprec.core.view import View

CONTROL_VERSION = 3
MAX_REQUEST_FRAME = 1024 * 1024
"""Largest frame a client may send the agent (bytes)."""
MAX_REPLY_FRAME = 64 * 1024 * 1024
"""Largest frame a client accepts from the agent (a member list of 100,000 nodes fits)."""
DISCONNECTING = frozenset({"bad_frame", "bad_msgpack", "bad_request", "bad_handshake",
                           "unsupported_version", "unknown_op", "timeout", "overflow", "shutdown"})
"""Error codes after which the server closes the connection."""
LENGTH_PREFIX = 4
"""Bytes of the big-endian length before each frame's body."""


class ControlError(ProtocolError):
    """A control request failed. ``code`` is machine-readable, the message says what to do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# --- encoding ---------------------------------------------------------------------------------------
def encode_frame(obj: Mapping[str, Any]) -> bytes:
    """Length prefix + msgpack map."""
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(LENGTH_PREFIX, "big") + body


def frame_length(head: bytes | bytearray) -> int:
    """The body length a frame's prefix announces."""
    return int.from_bytes(head[:LENGTH_PREFIX], "big")


def decode_body(body: bytes) -> Any:
    """msgpack -> Python; raises ControlError("bad_msgpack") on any defect."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception as exc:  # msgpack raises assorted types on hostile input
        raise ControlError("bad_msgpack", f"frame is not valid msgpack ({type(exc).__name__})") from None


def to_plain(value: Any) -> Any:
    """Any event field -> msgpack-able data (dataclasses become maps, tuples lists, enums names)."""
    if value is None or isinstance(value, (bool, str, bytes)):
        return value
    if isinstance(value, int):
        return value if -2**63 <= value < 2**64 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        return value.name
    to_wire = getattr(value, "to_wire", None)
    if callable(to_wire) and not isinstance(value, type):
        return to_wire()  # a value with a wire form of its own (a Plan): that is the contract
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {(k if isinstance(k, (str, int)) else str(k)): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [to_plain(v) for v in items]
    return str(value)


def event_to_dict(event: Any) -> dict[str, Any]:
    """``{"event": ClassName, field: value, ...}`` for any machine event (dataclass or mapping)."""
    if isinstance(event, Mapping):
        out = {str(k): to_plain(v) for k, v in event.items()}
        out.setdefault("event", "Event")
        return out
    body = to_plain(event)
    if not isinstance(body, dict):
        body = {"value": body}
    return {"event": type(event).__name__, **body}


@dataclass(frozen=True, slots=True)
class MemberBrief:
    """One member of a view as a trainer needs it."""

    node: str
    role: str
    rank: int | None


@dataclass(frozen=True, slots=True)
class ViewBrief:
    """The agreed view as the ``status`` reply carries it (``view``), read back by :meth:`from_wire`."""

    epoch: int
    config_id: str
    members: tuple[MemberBrief, ...]
    replica_groups: tuple[tuple[int, ...], ...]
    stopped: str
    group_epoch: int
    """See :attr:`View.group_epoch <gossiprec.core.view.View.group_epoch>`: what the trainer's group follows."""

    @classmethod
    def from_view(cls, view: View) -> ViewBrief:
        return cls(view.epoch, view.config_id, tuple(MemberBrief(m.node, m.role, m.rank) for m in view.members),
                   tuple(tuple(g) for g in view.topology.replica_groups), view.stopped, view.group_epoch)

    def to_wire(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "config_id": self.config_id,
                "members": [{"node": m.node, "role": m.role, "rank": m.rank} for m in self.members],
                "replica_groups": [list(g) for g in self.replica_groups], "stopped": self.stopped,
                "group_epoch": self.group_epoch}

    @classmethod
    def from_wire(cls, obj: Any) -> ViewBrief:
        """:class:`~gossiprec.errors.DecodeError` for anything but what :meth:`to_wire` writes."""
        try:
            if not isinstance(obj, dict):
                raise TypeError("a view is a map")
            members = tuple(MemberBrief(_typed(m["node"], str), _typed(m["role"], str), _typed(m["rank"], int | None))
                            for m in obj["members"])
            groups = tuple(tuple(_typed(r, int) for r in g) for g in obj["replica_groups"])
            return cls(_typed(obj["epoch"], int), _typed(obj["config_id"], str), members, groups,
                       _typed(obj["stopped"], str), _typed(obj["group_epoch"], int))
        except (KeyError, TypeError, ValueError) as exc:
            raise DecodeError("bad_view", f"the status reply's view: {exc!r}") from None

    def member(self, node: str) -> MemberBrief | None:
        return next((m for m in self.members if m.node == node), None)

    @property
    def world_size(self) -> int:
        return sum(1 for m in self.members if m.role == "trainer")

    def node_of_rank(self, rank: int) -> str | None:
        return next((m.node for m in self.members if m.role == "trainer" and m.rank == rank), None)


EVENT_TYPES: dict[str, type[core_events.CoreEvent]] = {
    cls.__name__: cls for cls in vars(core_events).values()
    if isinstance(cls, type) and issubclass(cls, core_events.CoreEvent) and cls is not core_events.CoreEvent
}
"""The core's events by class name: what :func:`decode_event` reads back."""
_FIELDS: dict[type, list[tuple[str, Any, bool]]] = {}


def decode_event(frame: Mapping[str, Any]) -> core_events.CoreEvent | None:
    """The core event an event frame (:func:`event_to_dict`) carries; None for an event that is not the
    core's (the agent's own). :class:`~gossiprec.errors.DecodeError` when a field is missing or of
    another type than the event class declares."""
    name = frame.get("event")
    cls = EVENT_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        return None
    fields = _FIELDS.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls, localns={"Plan": Plan})  # events name Plan for type checkers only
        fields = _FIELDS[cls] = [(f.name, hints[f.name], f.default is not dataclasses.MISSING)
                                 for f in dataclasses.fields(cls)]
    args: dict[str, Any] = {}
    for field, hint, optional in fields:
        if field not in frame:
            if optional:
                continue
            raise DecodeError("bad_event", f"{name} without its {field}")
        try:
            args[field] = _typed(frame[field], hint)
        except (TypeError, ValueError) as exc:
            raise DecodeError("bad_event", f"{name}.{field}: {exc}") from None
    return cls(**args)


def _typed(value: Any, hint: Any) -> Any:
    """``value`` (msgpack-decoded) as the annotated type ``hint``, or TypeError/ValueError."""
    if hint is Plan:
        return Plan.from_wire(value)
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        return _typed(value, next(o for o in options if o is not type(None)))
    if origin is tuple:
        if type(value) not in (list, tuple):
            raise TypeError(f"expected a list, got {type(value).__name__}")
        item = typing.get_args(hint)[0]
        return tuple(_typed(v, item) for v in value)
    if hint is float and type(value) in (int, float):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise TypeError(f"expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")


# --- checks -----------------------------------------------------------------------------------------
def check_request(req: Any) -> tuple[str, Any]:
    """A decoded request -> (op, id); ControlError("bad_request") if it is not a request."""
    if not isinstance(req, dict) or not isinstance(req.get("op"), str):
        raise ControlError("bad_request", "a request is a map with a string \"op\"")
    rid = req.get("id")
    if rid is not None and not isinstance(rid, (int, str)):
        raise ControlError("bad_request", "\"id\" must be an integer or a string")
    return req["op"], rid


def check_reply(frame: Any) -> dict[str, Any]:
    """A decoded frame from the agent; ControlError("bad_reply") if it is not a map."""
    if not isinstance(frame, dict):
        raise ControlError("bad_reply", "the agent sent something that is not a map")
    return frame


def state_problem(committed_step: Any, inflight_step: Any, state_bytes: Any, transfer_port: Any) -> str | None:
    """What is wrong with a trainer's state (the ``state`` message, or the progress page), or None."""
    if type(committed_step) is not int or not 0 <= committed_step <= 2**62:
        return f"committed_step must be an integer 0..2**62, got {committed_step!r}"
    if inflight_step is not None and (type(inflight_step) is not int or not committed_step < inflight_step <= 2**62):
        return f"inflight_step must be null or an integer above committed_step {committed_step}, got {inflight_step!r}"
    if type(state_bytes) is not int or not 0 <= state_bytes <= 2**62:
        return f"state_bytes must be an integer 0..2**62, got {state_bytes!r}"
    if transfer_port is not None and (type(transfer_port) is not int or not 0 < transfer_port < 65536):
        return f"transfer_port must be null or a TCP port 1..65535, got {transfer_port!r}"
    return None


def _int_arg(req: Mapping[str, Any], name: str, lo: int, hi: int) -> int:
    v = req.get(name)
    if type(v) is not int or not lo <= v <= hi:
        raise ControlError("bad_args", f"{name} must be an integer {lo}..{hi}, got {v!r}")
    return v


def report_args(req: Mapping[str, Any]) -> tuple[int, int, int]:
    """``report`` -> (step, phase index, step_ms); ControlError("bad_args") for a bad value."""
    step = _int_arg(req, "step", -1, 2**62)
    phase = req.get("phase", "compute")
    if isinstance(phase, str) and phase in PHASES:
        phase_i = PHASES.index(phase)
    elif type(phase) is int and 0 <= phase < len(PHASES):
        phase_i = phase
    else:
        raise ControlError("bad_args", f"phase must be one of {', '.join(PHASES)} (or its index), "
                                       f"got {phase!r}")
    step_ms = req.get("step_ms", 0)
    if type(step_ms) is float and math.isfinite(step_ms):
        step_ms = int(round(step_ms))
    if type(step_ms) is not int or not 0 <= step_ms <= 2**31 - 1:
        raise ControlError("bad_args", f"step_ms must be a number of milliseconds 0..2**31-1, got "
                                       f"{step_ms!r}")
    return step, phase_i, step_ms


def state_args(req: Mapping[str, Any]) -> tuple[int, int | None, int, int | None]:
    """``state`` -> (committed_step, inflight_step, state_bytes, transfer_port)."""
    args = (req.get("committed_step"), req.get("inflight_step"), req.get("state_bytes"), req.get("transfer_port"))
    problem = state_problem(*args)
    if problem is not None:
        raise ControlError("bad_args", problem)
    return args  # type: ignore[return-value]  # checked by state_problem


def finished_args(req: Mapping[str, Any]) -> int:
    """``finished`` -> the step training ended at."""
    return _int_arg(req, "step", 0, 2**62)


FOLLOW_QUEUE = (16, 100_000, 1000)
"""Bounds and default of ``follow``'s ``queue`` (events a follower may fall behind before drops)."""


def follow_args(req: Mapping[str, Any]) -> tuple[int, bool]:
    """``follow`` -> (queue, probes)."""
    lo, hi, default = FOLLOW_QUEUE
    queue = _int_arg(req, "queue", lo, hi) if "queue" in req else default
    probes = req.get("probes", False)
    if type(probes) is not bool:
        raise ControlError("bad_args", f"probes must be true or false, got {probes!r}")
    return queue, probes


def layout_args(req: Mapping[str, Any]) -> dict[Any, Any]:
    """``register_layout`` -> the layout map."""
    layout = req.get("layout")
    if not isinstance(layout, dict):
        raise ControlError("bad_args", "layout must be a map")
    return layout


RECOVERY_ACTIONS = ("resume", "shrink", "checkpoint", "stop")
RECOVERY_ROLES = ("receiver", "survivor", "donor", "checkpoint")
RECOVERY_PHASES = ("detect", "agree", "plan", "group", "state", "first_step")
"""The phases of a recovery's time, in the order of the timeline's ``phases`` object."""
DIGEST_RESULTS = ("ok", "mismatch", "off")
RECOVERY_FIELDS: dict[str, Any] = {
    "epoch": int, "cause": str, "action": RECOVERY_ACTIONS, "role": RECOVERY_ROLES, "rank": int,
    "world_size": int, "previous_world_size": int, "target_step": int, "lost_steps": int, "rto_s": float,
    "phases": dict, "bytes": int, "transfer_s": float, "donors": list, "digest": DIGEST_RESULTS,
}
"""A ``recovered`` record's fields: a type, or the strings the field may be."""
MAX_CAUSE = 1000
"""Characters of a recovery's cause kept (a longer one is cut)."""


def recovered_args(req: Mapping[str, Any]) -> dict[str, Any]:
    """``recovered`` -> the record, its fields in :data:`RECOVERY_FIELDS` order and checked (a number
    of seconds finite and not negative, an int not negative, the phases all there)."""
    rec = req.get("record")
    if not isinstance(rec, dict):
        raise ControlError("bad_args", "record must be a map")
    out: dict[str, Any] = {}
    for name, kind in RECOVERY_FIELDS.items():
        v: Any = rec.get(name)
        if isinstance(kind, tuple):
            ok = v in kind
        elif kind is float:
            ok = type(v) in (int, float) and math.isfinite(v) and v >= 0
            v = float(v) if ok else v
        elif kind is int:
            ok = type(v) is int and 0 <= v <= 2**62
        elif kind is str:
            ok = isinstance(v, str)
            v = v[:MAX_CAUSE] if ok else v
        elif kind is list:
            ok = isinstance(v, list) and len(v) <= 4096 and all(isinstance(d, str) and len(d) <= 256 for d in v)
        else:  # the phases
            ok = (isinstance(v, dict) and set(v) == set(RECOVERY_PHASES)
                  and all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in v.values()))
            v = {p: float(v[p]) for p in RECOVERY_PHASES} if ok else v
        if not ok:
            want = " | ".join(kind) if isinstance(kind, tuple) else (
                f"the phases {', '.join(RECOVERY_PHASES)} in seconds" if kind is dict else kind.__name__)
            raise ControlError("bad_args", f"record.{name} must be {want}, got {v!r}"[:300])
        out[name] = v
    return out


def checked_args(req: Mapping[str, Any]) -> bool:
    """``checked`` -> whether the replicas matched."""
    ok = req.get("ok")
    if type(ok) is not bool:
        raise ControlError("bad_args", f"ok must be true or false, got {ok!r}")
    return ok
