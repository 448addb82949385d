"""What the agent reports about itself and its members: the ``status`` and ``members`` replies.

Both are plain dicts (msgpack- and JSON-able) built from the machine's tables and the agent's own
counters at the moment of the request; the control socket, ``gossiprec status`` / ``members`` and
the metrics collector all read these and nothing else. Numeric codes of the wire (statuses, roles,
phases) are turned into their names here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sized

from gossiprec import __version__
from gossiprec.core.bootstrap import Booting
from gossiprec.core.bootwords import boot_state
from gossiprec.core.stragglers import behind_of
from gossiprec.core.wire import PHASES, ROLES, STATUS_NAMES
from gossiprec.local.protocol import ViewBrief

if TYPE_CHECKING:
    from gossiprec.agent.settings import AgentSettings
    from gossiprec.agent.transport import Transport
    from gossiprec.core.config import Config
    from gossiprec.core.machine import Machine
    from gossiprec.core.records import MemberInfo
    from gossiprec.local.server import ControlServer


class StatusSource(Protocol):
    """What the reports read of an agent (:class:`~gossiprec.agent.pump.Agent` is one), read-only."""

    @property
    def machine(self) -> Machine | None: ...
    @property
    def name(self) -> str: ...
    @property
    def addr(self) -> str: ...
    @property
    def config(self) -> Config: ...
    @property
    def settings(self) -> AgentSettings: ...
    @property
    def incarnation(self) -> int: ...
    @property
    def my_progress(self) -> tuple[int, int, int]: ...
    @property
    def wait_ms(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def leaving(self) -> bool: ...
    @property
    def leave_reason(self) -> str | None: ...
    @property
    def started_at(self) -> float: ...
    @property
    def layout(self) -> object: ...
    @property
    def trainer_state(self) -> Mapping[str, Any] | None: ...
    @property
    def progress_page_path(self) -> str | None: ...
    @property
    def counters(self) -> Mapping[str, int]: ...
    @property
    def transport(self) -> Transport | None: ...
    @property
    def control(self) -> ControlServer | None: ...
    @property
    def hub(self) -> Sized: ...
    def live_count(self) -> int: ...


def status_name(status: Any) -> Any:
    return STATUS_NAMES[status] if type(status) is int and 0 <= status < len(STATUS_NAMES) else status


def role_name(role: Any) -> Any:
    return ROLES[role] if type(role) is int and 0 <= role < len(ROLES) else role


def member_rows(agent: StatusSource, now: float) -> list[dict[str, Any]]:
    """One row per known member: address, status, role and the progress last heard (this node's own
    is the trainer's as of now), with its trainer's wait inside collectives (``wait_ms``) and how long
    the other training ranks wait for it (``behind_ms``: the median of their waits minus its own, see
    :mod:`gossiprec.core.stragglers`; None where it does not train or was not heard)."""
    m = agent.machine
    if m is None:
        return []
    rows: list[dict[str, Any]] = []
    for rec in m.members():
        row: dict[str, Any] = {
            "name": rec.name, "addr": rec.addr, "incarnation": rec.incarnation,
            "status": status_name(rec.status), "role": role_name(rec.role),
            "self": rec.name == agent.name,
        }
        if rec.name == agent.name:
            step, phase, step_ms = agent.my_progress
            row.update(step=step, phase=PHASES[phase], step_ms=step_ms, progress_age_s=0.0, wait_ms=agent.wait_ms)
        else:
            p = m.progress(rec.name)
            if p is not None:
                row.update(step=p.step, phase=PHASES[p.phase] if 0 <= p.phase < len(PHASES) else p.phase,
                           step_ms=p.step_ms, progress_age_s=round(now - p.seen_at, 6), wait_ms=p.wait_ms)
            else:
                row.update(step=-1, phase=None, step_ms=0, progress_age_s=None, wait_ms=0)
        rows.append(row)
    training = {r["name"]: r["wait_ms"] for r in rows if r["role"] == "trainer" and r["step"] >= 0
                and r["status"] in ("alive", "suspect") and r["phase"] != "recovering"}
    behind = behind_of(training)
    for r in rows:
        r["behind_ms"] = behind.get(r["name"]) if len(training) > 1 else None
    return rows


def _unheard_count(machine: Machine, members: list[MemberInfo]) -> int:
    """Members not heard from yet during the startup grace: their silence is not judged until they
    are (or until the grace ends), so a crash of one is seen only then."""
    return sum(1 for rec in members if not machine.has_heard(rec.name))


def agent_status(agent: StatusSource, now: float) -> dict[str, Any]:
    """The ``status`` reply: identity, settings, life cycle, trainer state, every counter, the view."""
    m = agent.machine
    s = agent.settings
    members = m.members() if m is not None else []
    return {
        "node": agent.name, "addr": agent.addr, "cluster": agent.config.cluster,
        "version": __version__, "incarnation": m.incarnation if m is not None else agent.incarnation,
        "role": s.role, "rank": s.rank, "profile": s.profile, "secure": not s.insecure,
        "health": m.health() if m is not None else None,
        "live": agent.live_count(), "known": len(members),
        "unheard": _unheard_count(m, members) if m is not None else 0,
        "state": agent.state, "leaving": agent.leaving, "leave_reason": agent.leave_reason,
        "uptime_s": round(now - agent.started_at, 3) if agent.started_at else 0.0,
        "layout_registered": agent.layout is not None,
        "trainer_state": agent.trainer_state,
        "progress_page": agent.progress_page_path,
        "wait_ms": agent.wait_ms,
        "behind": m.behind() if m is not None else {},
        "machine": dict(m.counters) if m is not None else {},
        "agent": dict(agent.counters),
        "transport": agent.transport.stats() if agent.transport is not None else {},
        "control": dict(agent.control.counters) if agent.control is not None else {},
        "subscribers": len(agent.hub),
        "bootstrap": bootstrap_status(m),
        **view_status(m),
    }


def bootstrap_status(machine: Machine | None) -> dict[str, Any] | None:
    """While view 0 is not decided (an agent started without a job spec): what it waits for, in words
    too (``text``); else None."""
    if isinstance(machine, Booting) and machine.boot.decided is None:
        return boot_state(machine.boot).to_dict()
    return None


def view_status(machine: Machine | None) -> dict[str, Any]:
    """The agreed view and plan (just ``view: None`` before this member is admitted to one)."""
    view = machine.view if machine is not None else None
    if machine is None or view is None:
        return {"view": None}
    plan = machine.plan
    return {
        "view": ViewBrief.from_view(view).to_wire(),
        "fenced": machine.fenced or None,
        "plan": plan.to_dict() if plan is not None else None,
        "plan_wire": plan.to_wire() if plan is not None else None,
    }
