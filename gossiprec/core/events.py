"""Every event the protocol core emits: what happened, as data, for the pumps and their observers.

A machine never calls back: its pump takes these with ``take_events()`` and hands them on (the agent to
its log, metrics, launcher and trainer; the simulator to its figures and invariant checkers). Each is a
frozen, slotted dataclass under :class:`CoreEvent`, stamped ``at`` with the machine time it happened.

Membership (:mod:`gossiprec.core.membership`): a member joined, was suspected, refuted, failed or left;
this node refuted an accusation; one probe's outcome. Agreement (:mod:`gossiprec.core.node`): a view
installed, a plan ready, fenced and unfenced, an alert raised, a straggler seen, a plan digest that
differs from ours, the job finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gossiprec.core.election import Plan


@dataclass(frozen=True, slots=True)
class CoreEvent:
    """Base of every core event (carries nothing: each event names its own fields, ``at`` last)."""


# --- membership ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MemberJoined(CoreEvent):
    name: str
    addr: str
    incarnation: int
    role: str
    at: float


@dataclass(frozen=True, slots=True)
class MemberSuspected(CoreEvent):
    name: str
    incarnation: int
    by: str
    at: float


@dataclass(frozen=True, slots=True)
class MemberAlive(CoreEvent):
    """A suspect refuted, or a dead/left member came back with a newer incarnation."""

    name: str
    incarnation: int
    at: float


@dataclass(frozen=True, slots=True)
class MemberFailed(CoreEvent):
    name: str
    incarnation: int
    by: str
    at: float


@dataclass(frozen=True, slots=True)
class MemberLeft(CoreEvent):
    name: str
    incarnation: int
    at: float


@dataclass(frozen=True, slots=True)
class SelfRefuted(CoreEvent):
    """This node was suspected or declared dead and raised its incarnation."""

    incarnation: int
    accuser: str
    at: float


@dataclass(frozen=True, slots=True)
class ProbeResult(CoreEvent):
    """Outcome of one of this node's probes (the agreement layer's observers listen to these)."""

    target: str
    ok: bool
    at: float


MemberEvent = (
    MemberJoined | MemberSuspected | MemberAlive | MemberFailed | MemberLeft | SelfRefuted | ProbeResult
)
"""What :meth:`Membership.take_events <gossiprec.core.membership.Membership.take_events>` returns."""


# --- agreement ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ViewInstalled(CoreEvent):
    epoch: int
    config_id: str
    members: tuple[str, ...]
    removed: tuple[str, ...]
    joined: tuple[str, ...]
    fast: bool
    decided_here: bool
    at: float
    stopped: str = ""
    group_epoch: int = -1
    """The view's group epoch (see :attr:`View.group_epoch <gossiprec.core.view.View.group_epoch>`): a view
    whose group epoch is older than its epoch left every trainer's group as it was. -1: ``epoch``."""

    def __post_init__(self) -> None:
        if self.group_epoch < 0:
            object.__setattr__(self, "group_epoch", self.epoch)


@dataclass(frozen=True, slots=True)
class PlanReady(CoreEvent):
    epoch: int
    digest: str
    plan: Plan
    at: float


@dataclass(frozen=True, slots=True)
class JobFinished(CoreEvent):
    """The job's trainers finished training at ``step`` (``source`` said so first)."""

    epoch: int
    step: int
    source: str
    at: float


@dataclass(frozen=True, slots=True)
class Fenced(CoreEvent):
    epoch: int
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class Unfenced(CoreEvent):
    epoch: int
    at: float


@dataclass(frozen=True, slots=True)
class AlertRaised(CoreEvent):
    subject: str
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class Straggler(CoreEvent):
    """A straggler episode of ``node`` began: the other ranks wait ``behind_ms`` per step for it (see
    :mod:`gossiprec.core.stragglers`); ``step``: its step then."""

    node: str
    behind_ms: int
    step: int
    at: float


@dataclass(frozen=True, slots=True)
class PlanMismatch(CoreEvent):
    epoch: int
    mine: str
    theirs: str
    at: float


# --- bootstrap (gossiprec.core.bootstrap) -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BootProgress(CoreEvent):
    """View 0 is not decided yet: the candidates this agent knows (of ``expected``)."""

    known: int
    expected: int
    names: tuple[str, ...]
    at: float


@dataclass(frozen=True, slots=True)
class BootMismatch(CoreEvent):
    """A candidate was started for another job size, or another mesh (``shards``: its replica groups),
    than this agent: it is not counted."""

    name: str
    addr: str
    expected: int
    spares: int
    our_expected: int
    our_spares: int
    at: float
    shards: int = 1
    our_shards: int = 1


@dataclass(frozen=True, slots=True)
class ViewZeroAgreed(CoreEvent):
    """View 0 was decided by a quorum of the seeds: its members in rank order (spares last), and
    whether this agent is one of them (else it joins as a spare)."""

    members: tuple[str, ...]
    member: bool
    at: float


@dataclass(frozen=True, slots=True)
class JobSpecMismatch(CoreEvent):
    """A member of view 0 holds another view 0 (its agents read another job spec): this node fences
    and takes no part in agreement, so that the two can never decide side by side. ``only_ours``,
    ``only_theirs`` and ``differ`` (same name, other address, role or rank) are empty until its view
    0 arrived."""

    peer: str
    ours: str
    theirs: str
    only_ours: tuple[str, ...]
    only_theirs: tuple[str, ...]
    differ: tuple[str, ...]
    at: float
