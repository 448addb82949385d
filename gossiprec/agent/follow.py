"""The follower of ``gossiprec events`` (the command is in :mod:`gossiprec.agent.ops`): the local agent's
events as they happen, one line each (like ``serf monitor``).

Theory of operation
-------------------
:func:`follow` connects to the agent's control socket, sends ``follow`` (a lossy subscription, see
:mod:`gossiprec.local.protocol`) and yields one *record* per event frame: a flat, JSON-ready dict with
stable keys ``v`` (1), ``time`` (unix seconds when the agent published it), ``node`` (the agent),
``kind`` (see :data:`KINDS`), ``event`` (the core's class name) and the event's own fields, less its
machine-clock ``at``. A plan's ``plan`` is its readable form (:meth:`~gossiprec.core.election.Plan.to_dict`).
A ``view`` record carries ``causes``: for each member it removed, the last thing this agent heard of
it (an alert's reason such as ``hung`` or ``unreachable``, ``failed, declared dead by n0``, ``left``,
else ``suspected by n0``; ``unknown`` if nothing).
A ``gap`` record (``dropped``) stands for events the agent dropped because this reader fell behind.

:func:`words` says a record in one line for people; ``--json`` prints the records themselves. An event
kind this version does not know is printed with its fields, so a newer agent's events still show.
Ctrl-C ends the command with 0; an agent that goes away ends it with 1 and says so; an agent older than
``follow`` answers ``unknown_op``, which becomes "agent too old".
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any, Iterator, Mapping

from gossiprec.core.election import Plan
from gossiprec.errors import DecodeError
from gossiprec.local.client import ControlClient
from gossiprec.local.protocol import ControlError

RECORD_VERSION = 1
KINDS: dict[str, str] = {
    "ViewInstalled": "view", "PlanReady": "plan", "MemberFailed": "failed", "MemberLeft": "left",
    "MemberSuspected": "suspect", "MemberAlive": "alive", "MemberJoined": "joined", "SelfRefuted": "refuted",
    "ProbeResult": "probe", "AlertRaised": "alert", "Fenced": "fenced", "Unfenced": "unfenced",
    "Straggler": "straggler", "PlanMismatch": "plan_mismatch", "JobFinished": "finished",
    "BootProgress": "bootstrap", "BootMismatch": "boot_mismatch", "ViewZeroAgreed": "view_zero",
    "JobSpecMismatch": "spec_mismatch", "AgentLeaving": "leaving", "Gap": "gap",
}
"""Record kind of each event class; a hang report is an ``alert`` whose reason is ``hung``. Another
class becomes its name in snake case."""


class AgentTooOld(ControlError):
    """The agent does not know the ``follow`` request."""


def kind_of(event: str) -> str:
    return KINDS.get(event) or re.sub(r"(?<!^)(?=[A-Z])", "_", event).lower()


class Follower:
    """Turns event frames into records, remembering why members went (for the next view's ``causes``)."""

    def __init__(self, node: str | None) -> None:
        self.node = node
        self.causes: dict[str, str] = {}

    def record(self, frame: Mapping[str, Any]) -> dict[str, Any]:
        event = str(frame.get("event", "Event"))
        rec: dict[str, Any] = {"v": RECORD_VERSION, "time": frame.get("time"), "node": self.node,
                               "kind": kind_of(event), "event": event}
        rec.update((k, v) for k, v in frame.items() if k not in ("event", "time", "at"))
        if event == "PlanReady" and isinstance(frame.get("plan"), (list, dict)):
            try:
                rec["plan"] = Plan.from_wire(frame["plan"]).to_dict()
            except (DecodeError, TypeError, ValueError, KeyError):
                pass  # keep the wire form: a plan of another version still shows
        name = frame.get("name") if event != "AlertRaised" else frame.get("subject")
        if isinstance(name, str):
            if event == "MemberFailed":
                self.causes[name] = f"failed, declared dead by {frame.get('by')}"
            elif event == "MemberLeft":
                self.causes.setdefault(name, "left")
            elif event == "MemberSuspected":
                self.causes.setdefault(name, f"suspected by {frame.get('by')}")
            elif event == "AlertRaised":
                self.causes[name] = str(frame.get("reason"))
            elif event in ("MemberAlive", "MemberJoined"):
                self.causes.pop(name, None)
        if event == "ViewInstalled":
            removed = frame.get("removed") or []
            rec["causes"] = {n: self.causes.pop(n, "unknown") for n in removed if isinstance(n, str)}
        return rec


def follow(path: str, *, timeout: float = 5.0, queue: int | None = None,
           probes: bool = False) -> Iterator[dict[str, Any]]:
    """Records of the agent at ``path`` as they happen, until it goes away (:class:`ControlError`
    ``disconnected``). :class:`AgentTooOld` if it does not know ``follow``."""
    with ControlClient(path, timeout=timeout) as client:
        args: dict[str, Any] = {"probes": probes}
        if queue is not None:
            args["queue"] = queue
        try:
            client.request("follow", **args)
        except ControlError as exc:
            if exc.code == "unknown_op":
                raise AgentTooOld("agent_too_old", f"the agent at {path} is too old for `gossiprec events` "
                                                   "(it does not know the follow request); upgrade it to "
                                                   "this gossiprec version") from None
            raise
        f = Follower(client.node)
        while True:
            frame = client.next_event(timeout=None)
            if frame is not None:
                yield f.record(frame)


# --- words ------------------------------------------------------------------------------------------
def _names(v: Any) -> str:
    return ", ".join(map(str, v)) if v else "none"


def _plan_words(p: Mapping[str, Any]) -> str:
    out = f"epoch {p.get('epoch')}: {p.get('action')} ({p.get('reason')}), world size {p.get('world_size')}"
    repl = p.get("replacements") or {}
    if repl:
        out += "; " + ", ".join(f"rank {r} -> {n}" for r, n in sorted(repl.items(), key=lambda kv: str(kv[0])))
    transfers = p.get("transfers") or []
    if transfers:
        out += "; transfers: " + ", ".join(
            f"{t.get('donor_node')} -> {t.get('receiver_node')} (rank {t.get('receiver_rank')}, "
            f"{t.get('length')} B at step {t.get('step')})" for t in transfers if isinstance(t, Mapping))
    if p.get("target_step") is not None:
        out += f"; target step {p.get('target_step')}"
    return out


_TEMPLATES = {
    "MemberFailed": "{name} failed (declared dead by {by})",
    "MemberSuspected": "{name} suspected by {by}",
    "MemberLeft": "{name} left",
    "MemberAlive": "{name} alive again (incarnation {incarnation})",
    "MemberJoined": "{name} joined at {addr} as {role}",
    "Fenced": "this agent fenced at epoch {epoch}: {reason}",
    "Unfenced": "this agent unfenced at epoch {epoch}",
    "JobFinished": "job finished at step {step} (epoch {epoch}, said first by {source})",
    "Gap": "{dropped} events dropped: this reader fell behind the agent",
}
"""The events whose line is their fields in a sentence (a field missing reads None)."""


class _Missing(dict[str, Any]):
    def __missing__(self, key: str) -> None:
        return None


def _fields(rec: Mapping[str, Any]) -> str:
    skip = {"v", "time", "node", "kind", "event"}
    return " ".join(f"{k}={v}" for k, v in rec.items() if k not in skip)


def words(rec: Mapping[str, Any]) -> str:
    """One line for people: time (UTC), kind, the essentials."""
    t = rec.get("time")
    stamp = (datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M:%S.%f")[:-3]
             if isinstance(t, (int, float)) else "--:--:--.---")
    k, r, ev = rec.get("kind"), rec, rec.get("event")
    if ev == "ViewInstalled":
        causes = r.get("causes") or {}
        gone = ", ".join(f"{n} ({c})" for n, c in causes.items()) if causes else _names(r.get("removed"))
        text = (f"epoch {r.get('epoch')}: {len(r.get('members') or [])} members; removed {gone}; "
                f"joined {_names(r.get('joined'))}" + ("; STOPPED: " + str(r["stopped"]) if r.get("stopped") else ""))
    elif ev == "PlanReady" and isinstance(r.get("plan"), Mapping):
        text = _plan_words(r["plan"])
    elif ev in _TEMPLATES:
        text = _TEMPLATES[ev].format_map(_Missing(r))
    elif ev == "AlertRaised":
        what = "hang report" if r.get("reason") == "hung" else "alert"
        text = f"{what}: {r.get('subject')} {r.get('reason')}"
    elif ev == "Straggler":
        text = f"{r.get('node')} straggles: " + _fields({k: v for k, v in r.items() if k != "node"})
    elif ev == "BootProgress":
        text = f"{r.get('known')} of {r.get('expected')} agents found ({_names(r.get('names'))})"
    elif ev == "ViewZeroAgreed":
        text = f"view 0 agreed: {_names(r.get('members'))}" + (
            "" if r.get("member") else "; this agent joins as a spare")
    elif ev == "AgentLeaving":
        text = f"the agent is leaving: {r.get('reason')}" + (" (failure)" if r.get("failed") else "")
    else:
        text = _fields(r)
    return f"{stamp} {str(k):<10} {text}"
