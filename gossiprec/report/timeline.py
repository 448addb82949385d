"""Reading the timeline files an agent writes (JSON lines, format ``"v": 1``).

Theory of operation
-------------------
Each line is one JSON object with ``v`` (1), ``kind``, ``time`` (unix wall seconds) and ``node`` (the
agent's name). Two kinds are read: ``recovery`` (one per recovery per rank: its plan, its phases in
seconds, the bytes it received and from whom, the replica digest check) and ``steps`` (a sample of a
rank's step and mean step time every few seconds). Lines of another kind are skipped, so that a newer
agent may add kinds without breaking an older ``report``; a line of another format version is an error.

A bad line is a :class:`TimelineError` that names the file and the line number and what is wrong with
it. One exception: the last line of a file that does not end in a newline and is not valid JSON is the
write an agent killed mid-line left behind; it is dropped and counted (:attr:`Timeline.truncated`).

Several files (one per agent) are merged into one timeline ordered by ``time`` (a stable sort: lines
with one stamp keep their file order).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from gossiprec.errors import GossiprecError

FORMAT_VERSION = 1
PHASES = ("detect", "agree", "plan", "group", "state", "first_step")
"""A recovery's phases, in order; they sum to its ``rto_s``."""
ACTIONS = ("resume", "shrink", "checkpoint", "stop")
ROLES = ("receiver", "survivor", "donor", "checkpoint")
DIGESTS = ("ok", "mismatch", "off")


class TimelineError(GossiprecError):
    """A timeline file is missing, unreadable or holds a line that is not a valid record."""


@dataclass(frozen=True, slots=True)
class Recovery:
    """One ``recovery`` line: one rank's view of one recovery."""

    time: float
    node: str
    epoch: int
    cause: str
    action: str
    role: str
    rank: int
    world_size: int
    previous_world_size: int
    target_step: int
    lost_steps: int
    rto_s: float
    phases: tuple[tuple[str, float], ...]
    """(phase, seconds) in :data:`PHASES` order."""
    bytes: int
    transfer_s: float
    donors: tuple[str, ...]
    digest: str
    source: str = ""
    """``file:line`` it came from (for messages)."""


@dataclass(frozen=True, slots=True)
class StepSample:
    """One ``steps`` line: a rank's progress at ``time``."""

    time: float
    node: str
    rank: int
    step: int
    step_s: float
    behind_ms: float


@dataclass(slots=True)
class Timeline:
    """What a set of files holds, merged by time."""

    recoveries: list[Recovery] = field(default_factory=list)
    steps: list[StepSample] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    lines: int = 0
    """Records read (blank lines not counted)."""
    skipped: int = 0
    """Lines of a kind this reader does not know."""
    truncated: int = 0
    """Files whose last line was cut short (dropped)."""


class _BadLine(Exception):
    """What is wrong with one line (becomes a TimelineError naming file and line)."""


def _get(obj: dict[str, Any], key: str, check: Callable[[Any], bool], what: str) -> Any:
    if key not in obj:
        raise _BadLine(f"missing field {key!r}")
    value = obj[key]
    if not check(value):
        raise _BadLine(f"field {key!r} must be {what}, got {value!r}")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _is_nonneg_int(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _is_nonneg_num(v: Any) -> bool:
    return _is_num(v) and v >= 0


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _one_of(values: Sequence[str]) -> Callable[[Any], bool]:
    return lambda v: v in values


def _recovery(obj: dict[str, Any], time: float, node: str, source: str) -> Recovery:
    raw = _get(obj, "phases", lambda v: isinstance(v, dict), "an object of phase seconds")
    phases = []
    for name in PHASES:
        phases.append((name, float(_get(raw, name, _is_nonneg_num, "a number of seconds >= 0"))))
    extra = sorted(set(raw) - set(PHASES))
    if extra:
        raise _BadLine(f"unknown phase(s) {', '.join(map(repr, extra))} (known: {', '.join(PHASES)})")
    donors = _get(obj, "donors", lambda v: isinstance(v, list) and all(isinstance(d, str) for d in v),
                  "a list of agent names")
    return Recovery(
        time=time, node=node,
        epoch=_get(obj, "epoch", _is_int, "an integer"),
        cause=_get(obj, "cause", _is_str, "a string"),
        action=_get(obj, "action", _one_of(ACTIONS), " | ".join(ACTIONS)),
        role=_get(obj, "role", _one_of(ROLES), " | ".join(ROLES)),
        rank=_get(obj, "rank", _is_int, "an integer"),
        world_size=_get(obj, "world_size", _is_nonneg_int, "an integer >= 0"),
        previous_world_size=_get(obj, "previous_world_size", _is_nonneg_int, "an integer >= 0"),
        target_step=_get(obj, "target_step", _is_int, "an integer"),
        lost_steps=_get(obj, "lost_steps", _is_nonneg_int, "an integer >= 0"),
        rto_s=float(_get(obj, "rto_s", _is_nonneg_num, "a number of seconds >= 0")),
        phases=tuple(phases),
        bytes=_get(obj, "bytes", _is_nonneg_int, "an integer >= 0"),
        transfer_s=float(_get(obj, "transfer_s", _is_nonneg_num, "a number of seconds >= 0")),
        donors=tuple(donors),
        digest=_get(obj, "digest", _one_of(DIGESTS), " | ".join(DIGESTS)),
        source=source,
    )


def _steps(obj: dict[str, Any], time: float, node: str) -> StepSample:
    return StepSample(
        time=time, node=node,
        rank=_get(obj, "rank", _is_int, "an integer"),
        step=_get(obj, "step", _is_int, "an integer"),
        step_s=float(_get(obj, "step_s", _is_nonneg_num, "a number of seconds >= 0")),
        behind_ms=float(_get(obj, "behind_ms", _is_num, "a number of milliseconds")),
    )


def parse_line(text: str, source: str = "") -> Recovery | StepSample | None:
    """One line as a record; None for a blank line or a kind this reader does not know.
    Raises :class:`_BadLine` (private: :func:`read_timeline` names the file and line)."""
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise _BadLine(f"not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise _BadLine("not a JSON object")
    v = _get(obj, "v", _is_int, "an integer")
    if v != FORMAT_VERSION:
        raise _BadLine(f"format version {v}; this gossiprec reads version {FORMAT_VERSION}")
    kind = _get(obj, "kind", _is_str, "a string")
    time = float(_get(obj, "time", _is_num, "a number (unix seconds)"))
    node = _get(obj, "node", _is_str, "a string (the agent's name)")
    if kind == "recovery":
        return _recovery(obj, time, node, source)
    if kind == "steps":
        return _steps(obj, time, node)
    return None


def read_timeline(path: str | Path, into: Timeline | None = None) -> Timeline:
    """The records of one file (appended to ``into`` when given, unsorted)."""
    out = Timeline() if into is None else into
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise TimelineError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise TimelineError(f"{name}: a directory, not a timeline file") from None
    except OSError as exc:
        raise TimelineError(f"{name}: cannot read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = data.count(b"\n", 0, exc.start) + 1
        raise TimelineError(f"{name}:{at}: not UTF-8 text (is this a timeline file?)") from None
    lines = text.split("\n")
    cut_short = not text.endswith("\n")  # the last element is a partial line (or "" for an empty file)
    out.files.append(name)
    for n, line in enumerate(lines, 1):
        last = n == len(lines)
        if last and not line:
            break
        try:
            rec = parse_line(line, f"{name}:{n}")
        except _BadLine as exc:
            if last and cut_short and str(exc).startswith("not JSON"):
                out.truncated += 1  # an agent killed mid-write: the line is lost, the file is fine
                break
            raise TimelineError(f"{name}:{n}: {exc}") from None
        if rec is None:
            if line.strip():
                out.lines += 1
                out.skipped += 1
            continue
        out.lines += 1
        if isinstance(rec, Recovery):
            out.recoveries.append(rec)
        else:
            out.steps.append(rec)
    return out


def read_timelines(paths: Iterable[str | Path]) -> Timeline:
    """The records of several files, merged by time."""
    out = Timeline()
    for path in paths:
        read_timeline(path, out)
    out.recoveries.sort(key=lambda r: r.time)
    out.steps.sort(key=lambda s: s.time)
    return out
