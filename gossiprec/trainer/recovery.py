"""Recovery in place: wait for the agreed plan, move the state it names, build the new epoch's group.

This rank's new rank is the plan's assignment. A rank named as a receiver fetches the target step from
the plan's donors, striped exactly as the plan says (:func:`~gossiprec.trainer.transfer.fetch.fetch_state`:
bytes land in the local tensors); a rank at the target reloads its own snapshot; then the new epoch's
group is built on the TCPStore of the plan's ``store_node`` and training continues from
``target_step``. A hot spare blocks in its first recovery until a plan gives it a rank. A survivor may
apply several plans in one recovery (a newer view supersedes one that could not finish); each restore
bumps the version counters of what it writes, so the next one copies it again. After a recovery each
rank reports ``(target, idle)`` once its group is built, so the agents' stall clock starts afresh for
every rank instead of at the start of a long recovery.

**Shrink.** With no spare left and ``allow_shrink`` in the job spec, the plan drops the lost ranks'
data-parallel columns (action ``shrink``). The world size a state was last stepped in travels *with*
the state (:class:`~gossiprec.trainer.objects.JobState`), so every rank of the new world, survivor or
receiver, sees the same change and calls ``on_resize(old_world, new_world)`` before the next step. It
always starts from the state restored at the target step, so when a newer view interrupts a recovery
before its first step, the next recovery restores and calls it again. A survivor dropped by a shrink
raises :class:`Released` once it has served its receivers for ``linger`` seconds. In a sharded (mesh)
job the plan drops whole replica groups, and every rank of the new world builds its managed world, mesh
and objects again for the new size (``prepare_rank``, :mod:`gossiprec.trainer.collectives.sharded`)
before its state at the target step is loaded into them; ``on_resize`` then sees the new objects. A
rank whose state does not fit its new objects stops the job (:class:`MeshShrinkRefused`).

**Fenced or removed.** A node that cannot reach a majority of its view is fenced; one the others removed
(a minority after the partition heals, a re-provisioned host whose agent catches up) gets a plan without
it. Either way this process's state is no longer trusted: it drops its snapshots, tells the agent it
holds nothing, and waits as a spare, in the same process, for the partition to heal and a plan to give
it a rank (``gossiprec run`` keeps such a process; only one that does not answer is killed).

**Bounded.** A trainer's recovery waits at most ``recovery_timeout`` for a plan it can apply (after a
collective failed and no view change follows, or after a plan that could not finish), then raises
:class:`~gossiprec.errors.RecoveryError` with what it tried: its exit makes the agents agree on a view
without it, whose plan the others apply. A spare waits without bound.

**No replica left.** A plan with action ``checkpoint`` (some replica group has no surviving holder)
calls ``on_no_replica(NoReplica)`` on every rank of the new world: it loads the user's checkpoint into
the objects and returns its step; the ranks check with one all-reduce that they all loaded the same
step. The call comes before the new epoch's group is built, so it must load without collectives
(:class:`~gossiprec.trainer.checkpoint.DcpCheckpoints` reads each rank's own pieces). Without the
callback, and for a ``stop`` plan (no spare, no shrink), the trainer raises :class:`JobStopped`.

**Resume at start.** A run restarted after a stop (a requeued job) resumes from its newest checkpoint
with :meth:`Recovery.resume`, right after the start: every rank finds the same checkpoint (checked by
one all-reduce), loads it, and commits its step as the only snapshot, as a checkpoint plan does. A
process that came out of a recovery (a spare joining a running job) does not.

Each recovery's timeline becomes a :class:`RecoveryRecord` at its first committed step.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from gossiprec.errors import ConfigError, FencedError, GossiprecError, RecoveryError, TransferError
from gossiprec.trainer.identity import RankIdentity
from gossiprec.trainer.exits import JobFinished, JobStopped, MeshShrinkRefused, Released
from gossiprec.trainer.transfer.fetch import fetch_state
from gossiprec.trainer.collectives.groups import CollectiveAborted
from gossiprec.trainer.state.receive import LayoutMismatch, ReceiveTarget

if TYPE_CHECKING:
    from gossiprec.trainer.agent_link import AgentLink
    from gossiprec.core.election import Plan, Transfer
    from gossiprec.local.client import ControlClient
    from gossiprec.trainer.state.checks import ReplicaChecks
    from gossiprec.trainer.config import TrainerConfig
    from gossiprec.trainer.transfer.donor import DonorServer
    from gossiprec.trainer.follower import Follower
    from gossiprec.trainer.collectives.groups import EpochGroup, EpochGroups
    from gossiprec.trainer.keys import TransferKeys
    from gossiprec.trainer.objects import JobState, Stateful
    from gossiprec.trainer.peers import Peers
    from gossiprec.trainer.collectives.sharded import ShardedWorld
    from gossiprec.trainer.state.snapshots import Snapshots

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NoReplica:
    """What ``on_no_replica`` is told: no survivor holds the state of ``orphan_groups`` (replica groups,
    previous numbering), so the new world (``rank`` of ``world_size``) restarts from a checkpoint."""

    epoch: int
    rank: int
    world_size: int
    orphan_groups: tuple[tuple[int, ...], ...]
    reason: str
    objects: Mapping[str, Stateful] = field(default_factory=dict, repr=False, compare=False)
    """The registered objects to load the checkpoint into (the trainer's own ``gossiprec`` entry too)."""


@dataclass(frozen=True, slots=True)
class RecoveryRecord:
    """Timeline of one recovery on this rank (``time.monotonic()`` seconds, comparable across the
    processes of one machine) and what it moved."""

    epoch: int
    cause: str
    role: str
    """``receiver`` (fetched state), ``survivor`` (reloaded its own snapshot), ``donor`` (both
    reloaded and served) or ``checkpoint`` (loaded by ``on_no_replica``)."""
    rank: int
    world_size: int
    target_step: int
    lost_steps: int
    """Committed steps of this rank that the plan rolled back (0 means nothing committed was lost)."""
    noticed_at: float
    detected_at: float | None
    """The agent's first failure event (alert, suspect, failed) seen, if any."""
    agreed_at: float | None
    planned_at: float
    group_at: float
    state_at: float
    first_step_at: float
    bytes_received: int
    transfer_s: float
    action: str = "resume"
    """The plan's action: ``resume``, ``shrink`` or ``checkpoint``."""
    previous_world_size: int = 0
    """The world size of the state before this recovery (differs from ``world_size`` after a shrink)."""
    previous_role: str = "trainer"
    """``spare`` when this recovery gave a hot spare its first rank (its ``noticed_at`` is then when it
    started waiting, not a failure)."""
    superseded: tuple[tuple[int, int, str], ...] = ()
    """Earlier plans of this recovery that did not complete: (epoch, target step, why), in order."""
    store_node: str = ""
    """The node whose trainer hosts this epoch's store (the group's rendezvous)."""
    donors: tuple[str, ...] = ()
    """The nodes a receiver fetched its state from, one per stripe (empty for any other role)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def phases(self) -> dict[str, float]:
        """Seconds of each phase, keyed as the timeline's (:data:`~gossiprec.local.protocol.RECOVERY_PHASES`)
        and summing to :meth:`rto`. In time the state is loaded before the group is built, so ``state``
        runs from the plan and ``group`` from the state. A stamp missing or earlier than the one before
        counts as that one: its phase is 0. The recovery counts from the first evidence of the failure,
        this rank's (a collective failed, a view came) or its agent's (a failure event, e.g. a hang alert),
        and ``detect`` lasts until both have it. A spare's first rank counts from the failure's detection
        (or the plan), not from its wait. (The time from the fault itself to its first evidence, such as
        a hang's threshold, is not on this rank's clock.)"""
        start = known = self.noticed_at
        if self.detected_at is not None:
            start, known = min(start, self.detected_at), max(start, self.detected_at)
        if self.previous_role == "spare":
            start = known = max(self.noticed_at, next(t for t in (self.detected_at, self.agreed_at,
                                                                 self.planned_at) if t is not None))
        marks = {"detect": known, "agree": self.agreed_at, "plan": self.planned_at,
                 "state": self.state_at, "group": self.group_at, "first_step": self.first_step_at}
        out: dict[str, float] = {}
        last = start
        for name, at in marks.items():
            at = last if at is None else max(last, at)
            out[name] = at - last
            last = at
        return {name: out[name] for name in ("detect", "agree", "plan", "group", "state", "first_step")}

    def rto(self) -> float:
        """Seconds from the first evidence of the failure to the first step done: the sum of :meth:`phases`."""
        return sum(self.phases().values())

    def to_wire(self, digest: str) -> dict[str, Any]:
        """The ``recovered`` request's record (the agent's timeline line, less its time and node);
        ``digest``: how the check of the replicas after this recovery ended (``ok``, ``mismatch``, ``off``)."""
        phases = self.phases()
        return {"epoch": self.epoch, "cause": self.cause, "action": self.action, "role": self.role,
                "rank": self.rank, "world_size": self.world_size, "previous_world_size": self.previous_world_size,
                "target_step": self.target_step, "lost_steps": self.lost_steps,
                "rto_s": round(sum(phases.values()), 6), "phases": {k: round(v, 6) for k, v in phases.items()},
                "bytes": self.bytes_received, "transfer_s": self.transfer_s, "donors": list(self.donors),
                "digest": digest}


@dataclass(slots=True)
class _Pending:
    cause: str
    noticed_at: float
    since: float = 0.0
    """Failure events before this are older recoveries' (see :meth:`Follower.detection_since`)."""
    detected_at: float | None = None
    agreed_at: float | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    attempts: list[tuple[int, int, str]] = field(default_factory=list)


def replica_groups_of(groups: Any, world: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups (lists of ranks) from the agent, or one group of every rank when it sent none."""
    if not groups:
        return (tuple(range(world)),)
    return tuple(tuple(int(r) for r in g) for g in groups)


class Trainer(Protocol):
    """What a recovery reads and moves of its trainer (:class:`~gossiprec.trainer.loop.ResilientTrainer`'s
    public attributes)."""

    node: str
    objects: dict[str, Stateful]
    config: TrainerConfig
    keys: TransferKeys
    control: ControlClient
    groups: EpochGroups | None
    @property
    def identity(self) -> RankIdentity: ...
    @property
    def epoch(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def role(self) -> str: ...
    @property
    def step(self) -> int: ...
    on_resize: Callable[[int, int], None] | None
    on_no_replica: Callable[[NoReplica], int] | None
    on_phase: Callable[[int, str], None] | None
    sharded: ShardedWorld | None

    def install(self, identity: RankIdentity) -> None: ...

    def prepare_rank(self, rank: int, world_size: int) -> bool: ...

    def configure_epoch(self, epoch: int) -> None: ...


class Recovery:
    """Recovers ``trainer`` in place (see the module docstring), with the trainer's parts.

    ``link`` tells the agent this rank's progress and what it holds; ``commit(step)`` commits the objects as
    ``step`` (a snapshot this rank can donate, announced to the agent); ``announce(step, nbytes)`` tells
    the agent what this rank holds (0 bytes: nothing); ``closed`` is set when the trainer closes.
    """

    def __init__(self, trainer: Trainer, *, job: JobState, follower: Follower, snaps: Snapshots,
                 checks: ReplicaChecks, peers: Peers, closed: threading.Event,
                 link: AgentLink, commit: Callable[[int], None],
                 announce: Callable[[int, int], None] = lambda step, nbytes: None,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self._t = trainer
        self._job = job
        self._follower = follower
        self._snaps = snaps
        self._checks = checks
        self._peers = peers
        self._closed = closed
        self._link = link
        self._commit = commit
        self._announce = announce
        self._on_drop = on_drop
        self.dropped: list[str] = []
        """Why this process dropped its state and became a spare (fenced, removed), each time it did."""
        self._pending: _Pending | None = None
        """The recovery in progress."""
        self._record_open: _Pending | None = None
        """The last recovery, until its first step commits."""
        self._untold: RecoveryRecord | None = None
        """The last recovery's record, its first step committed, until its deferred comparison ends."""
        self._last_recovered_at = 0.0
        self.building_epoch: int | None = None
        """The epoch whose group is being built, if one is."""
        checks.on_result = self._checked

    def recover(self, cause: str, spare: bool = False) -> None:
        """Wait for the plan, move state, rebuild the group; loops until one plan succeeds."""
        t = self._t
        self.flush_record()  # (the last recovery's deferred comparison will not run now)
        pending = self._pending or self._record_open or _Pending(cause, time.monotonic(), self._last_recovered_at)
        if pending is self._record_open:  # the last recovery's first step never completed: still that one
            pending.attempts.append((t.epoch, t.step, f"superseded before its first step ({cause})"))
            self._record_open = None
        self._pending = pending
        self._snaps.settle()  # before anything (a fetch, a checkpoint load) writes into the live tensors
        self._snaps.begin_recovery()
        self._link.report(t.step, "recovering")
        deadline = time.monotonic() + t.config.recovery_timeout
        while True:
            plan = self._wait_plan(spare, deadline, pending)
            pending.detected_at, pending.agreed_at = self._follower.detection_since(pending.since)
            try:
                if self._apply_plan(plan, pending):
                    return
                deadline = time.monotonic() + t.config.recovery_timeout
            except (FencedError, Released, JobStopped, JobFinished):
                raise
            except LayoutMismatch as exc:
                # no later plan can fix this process's objects: leave, so that the agents replace it
                raise LayoutMismatch(f"this process cannot take part in the recovery of epoch {plan.epoch}: "
                                     f"{exc}; it exits so that the others go on with another spare") from exc
            except (CollectiveAborted, GossiprecError, OSError) as exc:
                # Snapshots are copies, so a failed fetch spoils only the live tensors: whatever this
                # rank committed can still be reloaded or served under the next plan.
                log.warning("recovery with the plan of epoch %s failed (%s); waiting for the next plan",
                            plan.epoch, exc)
                pending.attempts.append((plan.epoch, int(pending.fields.get("target_step", -1)),
                                         f"{type(exc).__name__}: {exc}"[:300]))
                t.install(t.identity.but(epoch=max(t.epoch, plan.epoch)))
                if plan.store_node is not None:
                    self._peers.forget(plan.store_node)  # a client of a store host that died is no use again
                deadline = time.monotonic() + t.config.recovery_timeout
                continue

    def first_step(self, digest: str | None = None) -> RecoveryRecord | None:
        """The record of the last recovery, once its first step has committed (None if none waits), told
        to the agent (its metrics and timeline file) and logged, one line. ``digest``: how the check of
        the replicas after it ended (default: ``ok`` if it ran, else ``off``); a check deferred to the
        next step (background snapshots) tells the record when it ends (:meth:`_checked`)."""
        record = self._first_step()
        if record is not None:
            if digest is None and self._checks.awaiting:
                self._untold = record  # its comparison runs at the next all-reduce of gradients (deferred)
            else:
                tell_recovery(self._link, record, digest or ("off" if self._checks.last_ok is None else "ok"))
        return record

    def flush_record(self) -> None:
        """Tell the agent of a recovery record still waiting for its comparison, which will not run
        (another recovery, the end of the job): digest ``off``."""
        record, self._untold = self._untold, None
        if record is not None:
            tell_recovery(self._link, record, "off")

    def _checked(self, ok: bool) -> None:
        """A comparison of the replicas ended: the agent counts it; a mismatch right after a recovery ends
        that recovery's record (digest ``mismatch``: its first step never commits), and a deferred one
        tells the record of the recovery it checked."""
        self._link.checked(ok)
        record, self._untold = self._untold, None
        if record is not None:
            tell_recovery(self._link, record, "ok" if ok else "mismatch")
        elif not ok:
            self.first_step("mismatch")

    def _first_step(self) -> RecoveryRecord | None:
        p = self._record_open
        if p is None:
            return None
        self._record_open = None
        f = p.fields
        if p.detected_at is None:  # the plan came by a status poll before the follower read the events
            p.detected_at, agreed = self._follower.detection_since(p.since)
            p.agreed_at = p.agreed_at if p.agreed_at is not None else agreed
        return RecoveryRecord(epoch=self._t.epoch, cause=p.cause, role=f["role"], rank=f["rank"],
                              world_size=f["world_size"], target_step=f["target_step"],
                              lost_steps=f["lost_steps"], noticed_at=p.noticed_at, detected_at=p.detected_at,
                              agreed_at=p.agreed_at, planned_at=f["planned_at"], group_at=f["group_at"],
                              state_at=f["state_at"], first_step_at=time.monotonic(),
                              bytes_received=f["bytes_received"], transfer_s=f["transfer_s"],
                              action=f.get("action", "resume"),
                              previous_world_size=f.get("previous_world_size", 0),
                              previous_role=f.get("previous_role", "trainer"), superseded=tuple(p.attempts),
                              store_node=f.get("store_node", ""), donors=tuple(f.get("donors", ())))

    def abort_older_than(self, epoch: int, reason: str) -> None:
        """Abort the current group and a group being built, when they belong to an epoch < ``epoch``."""
        groups = self._t.groups
        if groups is None:
            return
        for e in {self._t.epoch, self.building_epoch}:
            if e is not None and e < epoch:
                groups.abort(epoch=e, reason=reason)

    # ------------------------------------------------------------------ the plan
    def _wait_plan(self, spare: bool, deadline: float, pending: _Pending) -> Plan:
        """The plan of the newest epoch this rank knows of (waits; polls status as a fallback). A fence
        makes this process a spare (:meth:`become_spare`) that waits for the heal; a trainer that gets no
        plan it can apply by ``deadline`` raises RecoveryError."""
        t, f = self._t, self._follower
        next_poll = time.monotonic()
        while True:
            with f.cond:
                fenced = f.fenced
            if fenced:
                self.become_spare(f"fenced: {fenced}")
            with f.cond:
                if f.lost:
                    raise RecoveryError(f"lost the local agent ({f.lost}); this trainer stops")
                if f.finished is not None:
                    if t.role == "trainer" and t.step < f.finished:
                        raise JobStopped(f"the job finished at step {f.finished} on other ranks while this rank "
                                         f"was recovering at step {t.step}: its state is not the final one")
                    raise JobFinished(f"the job finished at step {f.finished}; this {t.role} is no "
                                      "longer needed")
                if f.stopped and not f.fenced:
                    raise JobStopped(f"the agreed view stops the job ({f.stopped}); restart it from your "
                                     "checkpoint with more spares, or set allow_shrink = true in the job spec")
                plan = f.newest_plan(t.epoch) if not f.fenced else None
                if plan is not None:
                    return plan
                if not f.fenced and t.role == "trainer" and time.monotonic() >= deadline:
                    tried = "; ".join(f"epoch {e}: {why}" for e, _, why in pending.attempts) or "none"
                    raise RecoveryError(
                        f"the recovery from {pending.cause!r} got no plan it could apply within "
                        f"{t.config.recovery_timeout:.0f} s (recovery_timeout; plans tried: {tried}); this trainer "
                        "exits so that the agents agree on a view without it")
                f.cond.wait(0.05 if not spare and not f.fenced else 0.2)
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + (0.1 if not spare and not fenced else 0.5)
                f.poll_status(t.control, t.epoch)

    def become_spare(self, why: str) -> None:
        """This process's state is no longer trusted (fenced, removed): drop it, retire the group, tell
        the agent it holds nothing, and wait as a spare from here on. Idempotent."""
        t = self._t
        if t.role == "spare" and not self._snaps.steps():
            return
        log.warning("%s: this node's state is dropped; it waits as a spare for the job to take it back", why)
        self.dropped.append(why)
        if t.groups is not None:
            t.groups.retire(why)
        self._snaps.drop_all()
        t.install(RankIdentity(epoch=t.epoch, role="spare"))
        self._job.world_size = 0
        self._link.report(0, "idle")
        self._announce(0, 0)
        if self._on_drop is not None:
            self._on_drop(why)

    def _apply_plan(self, plan: Plan, pending: _Pending) -> bool:
        """Move state and build the group as ``plan`` says; False when this process stays a spare."""
        t = self._t
        epoch, action, world = plan.epoch, plan.action, plan.world_size
        if action == "stop":
            raise JobStopped(f"the plan of epoch {epoch} stops the job ({plan.reason}); restart it "
                             "from your checkpoint with more spares, or set allow_shrink = true in the job spec")
        my_rank = plan.rank_of(t.node)
        if my_rank is None:
            if any(x.donor_node == t.node for x in plan.transfers):
                self._closed.wait(t.config.linger)  # released: serve the receivers for a while
            t.install(t.identity.but(epoch=epoch))
            if t.role == "trainer" and t.node in plan.released:
                raise Released(f"this rank was released by the plan of epoch {epoch} ({plan.reason}); "
                               "leave the job (exit 0): the others go on without it")
            if t.role == "trainer":  # removed, not released: the others replaced this rank
                self.become_spare(f"the plan of epoch {epoch} gives node {t.node} no rank")
            self._last_recovered_at = time.monotonic()  # failures so far were handled without us
            pending.since = self._last_recovered_at
            return False  # a spare: wait for a later plan
        if action == "checkpoint" and t.on_no_replica is None:
            raise JobStopped(f"the plan of epoch {epoch} finds no surviving replica of some state "
                             f"({plan.reason}); pass on_no_replica= to ResilientTrainer to load your "
                             "checkpoint in place, or restart the job from it")
        pending.fields.update(rank=my_rank, world_size=world, action=action, previous_role=t.role,
                              store_node=plan.store_node or "",
                              planned_at=self._follower.planned_at.get(epoch, time.monotonic()))
        mine = sorted((x for x in plan.transfers if x.receiver_node == t.node), key=lambda x: x.offset)
        # a sharded spare builds its mesh and objects now, before state lands in them; a survivor of a
        # shrink builds them again, on the smaller mesh, and loads its state into the new ones
        rebuilt = t.prepare_rank(my_rank, world)
        if action == "checkpoint":
            target = self._load_checkpoint(plan, my_rank, pending)
        else:
            if plan.target_step is None or plan.store_node is None:
                raise RecoveryError(f"the plan of epoch {epoch} ({action}) names no target step or store")
            target = plan.target_step
            try:
                self._move_state(plan, target, mine, pending, rebuilt)
            except LayoutMismatch as exc:
                if not rebuilt:
                    raise
                raise MeshShrinkRefused(
                    f"the plan of epoch {epoch} shrinks the mesh to {world} ranks, but this rank's local shards do "
                    f"not keep their shapes on the new mesh ({exc}): a shrink may only drop replica groups of "
                    "a mesh whose sharding does not depend on the replicate dimension; give the job spares, or "
                    "restart it from a checkpoint") from exc
        assert t.groups is not None and plan.store_node is not None
        self.building_epoch = epoch
        try:
            store_node = plan.store_node
            group = t.groups.build(epoch, my_rank, world, connect=lambda: self._peers.store_for(store_node),
                                   cancelled=lambda: self._follower.superseded(epoch))
            t.configure_epoch(epoch)  # a sharded job: every group of the mesh gets this epoch's backend
        finally:
            self.building_epoch = None
        if action == "checkpoint":
            _check_same_step(group, target, t.config.device)
        # A new (step, phase) restarts the agents' stall clock for this rank: every rank sat at
        # (target, recovering) during the recovery, and the first to start the next step would
        # otherwise make the others look hung at once (their value unchanged for the whole recovery).
        self._link.report(target, "idle")
        pending.fields["group_at"] = time.monotonic()
        t.install(RankIdentity(epoch=epoch, rank=my_rank, world_size=world, role="trainer", step=target))
        if not mine and action != "checkpoint":
            snap = self._snaps.at(target)
            self._link.tell_state(target, None, snap.header.total_nbytes if snap else 0, None)
        old_world = self._job.world_size
        pending.fields["previous_world_size"] = old_world
        if old_world and old_world != world and t.on_resize is not None:
            t.on_resize(old_world, world)
        self._job.world_size = world
        self._checks.groups = replica_groups_of(plan.replica_groups, world)
        # background snapshots: the first commit's snapshot is compared, while the step after it computes
        self._checks.expect(f"after the recovery into epoch {epoch}", target, overlap=self._snaps.background,
                            defer=self._snaps.background)
        self._record_open, self._pending = pending, None
        self._last_recovered_at = time.monotonic()
        log.info("recovered into epoch %d as rank %d/%d at step %d (%s, %s)", epoch, my_rank, world, target,
                 action, pending.fields["role"])
        return True

    def _load_checkpoint(self, plan: Plan, rank: int, pending: _Pending) -> int:
        """No replica left: the user's ``on_no_replica`` loads a checkpoint into the objects; returns its
        step, committed as this rank's only snapshot."""
        t = self._t
        assert t.on_no_replica is not None
        before = t.step
        self._job.world_size = 0  # unknown unless the checkpoint holds the trainer's own entry
        target = int(t.on_no_replica(NoReplica(plan.epoch, rank, plan.world_size, plan.orphan_groups, plan.reason,
                                               objects=t.objects)))
        if not self._job.world_size:
            self._job.world_size = plan.world_size  # the checkpoint did not say: no resize
        pending.fields.update(role="checkpoint", target_step=target,
                              lost_steps=max(0, before - target) if t.role == "trainer" else 0)
        self._snaps.drop_all()  # the job's state is the checkpoint's now
        self._commit(target)
        pending.fields.update(state_at=time.monotonic(), bytes_received=0, transfer_s=0.0)
        return target

    def resume(self, find: Callable[[], int | None], load: Callable[[Mapping[str, Stateful], int], None]) -> int | None:
        """A run restarted from its checkpoints, right after the start: every rank ``find()`` s the newest
        complete checkpoint (a step, or None), the ranks check with one all-reduce that they found the same,
        ``load(objects, step)`` loads it, and the step is committed as this rank's only snapshot (the next
        step trained is ``step + 1``). Returns the step, or None when there is no checkpoint (nothing
        changes).

        A process whose state came from a recovery that no step has committed after yet does nothing and
        returns None: a spare that took its rank in a running job (the others train on and would never
        join the all-reduce), and so, alike, every rank of a job whose view changed before its start. A
        failure during the resume recovers as any other, and the job goes on from the plan's step."""
        t = self._t
        if t.role != "trainer" or t.groups is None or t.groups.current is None:
            raise ConfigError("resume from a checkpoint after start() has returned, on a rank (not a spare)")
        if self._record_open is not None or t.step != 0:
            return None
        try:
            return self._resume_once(find, load)
        except CollectiveAborted as exc:
            self.recover(f"interrupted while resuming from a checkpoint: {exc}")
            return None

    def _resume_once(self, find: Callable[[], int | None],
                     load: Callable[[Mapping[str, Stateful], int], None]) -> int | None:
        t = self._t
        assert t.groups is not None and t.groups.current is not None
        self._snaps.settle()  # before the load writes into the live tensors
        self._snaps.begin_recovery()
        self._link.report(0, "recovering")  # (out of recovering the agents accept a jump to any step)
        found = find()
        step = _check_same_step(t.groups.current, -1 if found is None else int(found), t.config.device,
                                "resume found different checkpoints")
        if step < 0:
            self._link.report(0, "idle")
            return None
        load(t.objects, step)
        old_world = self._job.world_size
        if old_world and old_world != t.world_size and t.on_resize is not None:
            t.on_resize(old_world, t.world_size)  # a data-parallel job restarted on another number of ranks
        self._job.world_size = t.world_size
        self._snaps.drop_all()  # the job's state is the checkpoint's now
        self._commit(step)
        self._link.report(step, "idle")
        self._checks.expect(f"after resuming from the checkpoint of step {step}", step, overlap=False)
        log.info("resumed from the checkpoint of step %d", step)
        return step

    def _move_state(self, plan: Plan, target: int, mine: list[Transfer], pending: _Pending,
                    rebuilt: bool = False) -> None:
        """Get the state of ``target`` into the objects: fetched from this rank's donors (``mine``: the
        plan's transfers to this node), or reloaded from this rank's own snapshot. ``rebuilt``: the objects
        are new (a shrink built the mesh again), and the snapshots, of the old ones, give way to the target's."""
        t = self._t
        pending.fields.update(target_step=target, lost_steps=max(0, t.step - target) if t.role == "trainer" else 0)
        self._link.report(target, "recovering")
        nbytes, xfer_s = 0, 0.0
        if mine:
            pending.fields["role"] = "receiver"
            pending.fields["donors"] = [x.donor_node for x in mine]
            stats = self._fetch(mine, target, plan.epoch)
            nbytes, xfer_s = stats.nbytes, stats.seconds
            if rebuilt:
                self._snaps.drop_all()  # (of the old objects)
            self._commit(target)  # complete and authenticated: this rank can donate it now
        else:
            snap = self._snaps.at(target)
            if snap is None:
                raise RecoveryError(f"the plan of epoch {plan.epoch} resumes at step {target} from this rank, "
                                    f"but it holds steps {self._snaps.steps()}")
            copied = self._snaps.restore(snap)
            log.debug("reloaded step %d: %d of %d bytes copied", target, copied, snap.header.total_nbytes)
            if rebuilt:  # the new objects hold the target now: its snapshot is theirs, not the old ones'
                self._snaps.drop_all()
                self._commit(target)
            elif t.sharded is not None and self._snaps.steps()[-1] != target:
                # rolled back behind its newest snapshot (another replica group was a step behind, so the job
                # never committed that step): commit the target again, so that the step redone next does not
                # sit beside the abandoned one. (A data-parallel survivor keeps its newer step to serve: a
                # newer plan in the same recovery may target it.)
                self._commit(target)
            donor = any(x.donor_node == t.node for x in plan.transfers)
            pending.fields["role"] = "donor" if donor else "survivor"
            pending.fields["donors"] = []
        pending.fields.update(state_at=time.monotonic(), bytes_received=nbytes, transfer_s=xfer_s)

    # ------------------------------------------------------------------ fetching
    def _fetch(self, mine: list[Transfer], target: int, epoch: int) -> Any:
        """Fetch the state at ``target`` from this rank's donors, striped as the plan says."""
        t = self._t
        self._peers.refresh()
        donors = [self._peers.donor_of(x.donor_node) for x in mine]
        stripes: list[tuple[int, int]] | None = [(x.offset, x.offset + x.length) for x in mine]
        if not any(x.length for x in mine):
            # the plan knew no size: its reports were made before the donors' trainers started (a view
            # changed during start-up), so take the whole state, whatever its size, from one donor
            donors, stripes = donors[:1], None
        target_objects = ReceiveTarget(t.objects)
        kwargs: dict[str, Any] = {"step": target, "epoch": epoch, "timeout": t.config.fetch_timeout,
                                  "stall_timeout": t.config.stall_timeout}
        if t.on_phase is not None:
            kwargs["on_progress"] = lambda _donor, _got: self._hook(target, "fetch")
        try:
            return fetch_state(donors, t.keys.primary(), target_objects, stripes=stripes, **kwargs)
        except TransferError as exc:
            if len(donors) == 1 or isinstance(exc, LayoutMismatch):
                raise
            # donors disagree (replicas not identical) or one failed: try each alone; a dead donor
            # also makes the agents agree on a new view, whose plan supersedes this one
            log.warning("striped fetch failed (%s); fetching from one donor", exc)
            return self._fetch_from_any(donors, target_objects, kwargs, exc)

    def _fetch_from_any(self, donors: list[tuple[str, int]], target: ReceiveTarget, kwargs: dict[str, Any],
                        first: TransferError) -> Any:
        last: TransferError = first
        for donor in dict.fromkeys(donors):
            if self._follower.newest_group > int(kwargs["epoch"]):
                break  # a newer view: its plan decides
            try:
                return fetch_state([donor], self._t.keys.primary(), target, **kwargs)
            except TransferError as exc:
                last = exc
        raise last

    def _hook(self, step: int, phase: str) -> None:
        if self._t.on_phase is not None:
            self._t.on_phase(step, phase)


def tell_recovery(link: AgentLink, record: RecoveryRecord, digest: str) -> dict[str, Any]:
    """Tell the agent of a finished recovery (``recovered``) and log it, one info line; returns the record
    as sent."""
    wire = record.to_wire(digest)
    link.recovered(wire)
    phases = " ".join(f"{k}={v:.3f}" for k, v in wire["phases"].items())
    log.info("recovery into epoch %d as rank %d/%d: rto %.3f s (%s), %d step(s) lost, %s as %s", record.epoch,
             record.rank, record.world_size, wire["rto_s"], phases, record.lost_steps, record.action, record.role,
             extra={"fields": {"recovery": {k: v for k, v in wire.items() if k != "cause"}}})
    return wire


def _check_same_step(group: EpochGroup, step: int, device: str,
                     what: str = "on_no_replica restored different checkpoint steps on the ranks") -> int:
    """After a checkpoint load (or before one): every rank must hold the same step (one all-reduce);
    returns it, or raises :class:`JobStopped` naming ``what`` and the steps."""
    import torch

    t = torch.tensor([step, -step], dtype=torch.int64, device=device)
    group.allreduce(t, "max")
    t = t.cpu()
    lo, hi = -int(t[1]), int(t[0])
    if lo != hi:
        found = ", ".join("none" if s < 0 else str(s) for s in (lo, hi))
        raise JobStopped(f"{what} ({found}): every rank must read the same checkpoints (shared storage)")
    return step


def prepare_donation(plan: Plan, node: str, donor: DonorServer | None, snaps: Snapshots) -> None:
    """When ``plan`` names ``node`` a donor, tag its stripes on a thread right away: the GMAC pass then
    overlaps the receivers' connecting, not their transfer."""
    ranges = [(x.offset, x.offset + x.length) for x in plan.transfers if x.donor_node == node]
    if donor is None or not ranges or plan.action not in ("resume", "shrink") or plan.target_step is None:
        return
    target = plan.target_step

    def seal() -> None:
        try:
            snap = snaps.at(target)  # waits for the snapshot's copies (not the owner: takes nothing)
            if snap is not None:
                donor.prepare(snap, ranges)
        except GossiprecError as exc:
            log.debug("preparing the donation of step %d failed: %s", target, exc)

    threading.Thread(target=seal, name="gossiprec-prepare", daemon=True).start()
