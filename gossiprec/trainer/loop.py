"""The training-loop wrapper: report, all-reduce interruptibly, commit, and recover in place.

:class:`ResilientTrainer` sits in an ordinary data-parallel loop with a handful of calls::

    rt = ResilientTrainer(training_state(model, opt, data=pos))
    rt.start()                                # trainer: build the epoch group; spare: wait for a rank
    rt.overlap_gradients(model.parameters())  # optional: all-reduce in buckets during backward
    while rt.step < steps:
        s = rt.begin_step()                   # the step being computed (committed step + 1)
        opt.zero_grad(); loss_of(model, batch(rt.rank, s)).backward()
        if not rt.allreduce_gradients(model.parameters()):
            continue                          # a recovery happened: redo from rt.step
        opt.step()
        rt.commit()                           # step s is committed on this rank
    rt.finish()

**Commit point.** Step ``s`` is committed on a rank when its optimizer step has finished and
:meth:`~ResilientTrainer.commit` has captured the registered objects (:mod:`gossiprec.trainer.state.snapshots`);
before that, a failure rolls this rank back to ``s - 1`` (RNG and data position included). Commits and phase changes
reach the agent through its progress page (:mod:`gossiprec.local.progress`) or the control socket.

**Interruption.** A newer view or a fence (:mod:`gossiprec.trainer.follower`) aborts the current group, so a waiting
collective raises within a poll slice, and the trainer recovers in place (:mod:`gossiprec.trainer.recovery`); replicas
are compared along the way (:mod:`gossiprec.trainer.state.checks`). Redone steps start clean: after a recovery every
gradient of the registered objects is dropped, and the redone step's first collective refuses one it did not produce
(:mod:`gossiprec.trainer.redo`).

**Hooks.** ``on_phase(step, phase)`` is called at every phase boundary of a step (``compute``, ``communicate`` with
the collective in flight, ``optimizer``, ``committed``) and, during a recovery, ``serve`` (a receiver asked this donor
for state; from a donor thread) and ``fetch`` (a chunk arrived; from a receiving thread): for tracing and fault
injection, not for long work.

**Hangs.** A stuck rank stays in its collective; the agents find it by its position (step, collectives entered in the
step, phase) stalled behind the others' and agree on a view without it (a rank whose collective waits on peers reports
``waiting``). Its launcher kills it once its node is out of the view; one that wakes first drops its state and waits
as a spare (:mod:`gossiprec.trainer.recovery`).

**Sharded jobs.** Given ``mesh=MeshSpec(...)`` and ``build=lambda mesh: objects`` instead of the objects,
:meth:`~ResilientTrainer.start` makes the ``gossiprec`` backend torch's default group once the rank is known, builds
the ``DeviceMesh`` (:attr:`~ResilientTrainer.mesh`) and then the objects with ``build(mesh)`` (a spare when a plan
gives it a rank; a shrink's survivors again, smaller), and every epoch gives all of the mesh's groups that epoch's
backend (:mod:`gossiprec.trainer.collectives.sharded`). The state is each rank's local shard; its donor is the same
coordinate in another replica. The step runs inside :meth:`~ResilientTrainer.training_step`, which recovers from a
collective interrupted anywhere in it::

    rt = ResilientTrainer(None, config, mesh=MeshSpec((2, 2), ("dp", "tp")), build=make_objects)
    rt.start()
    while rt.step < steps:
        with rt.training_step() as s:         # commits at the end; on a failure, recovers and skips
            loss_of(model, batch(rt.mesh, s)).backward(); opt.step(); opt.zero_grad()

**The end.** :meth:`~ResilientTrainer.finish` tells the agents that training is over; spares still waiting in
:meth:`~ResilientTrainer.start` raise :class:`~gossiprec.trainer.exits.JobFinished`. :meth:`~ResilientTrainer.leave`
ends a process that is not needed, released or stopped in good order, with the codes of
:mod:`gossiprec.trainer.exits`."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, NoReturn, TypeVar

from gossiprec.errors import ConfigError, GossiprecError, RecoveryError
from gossiprec.local.client import ControlClient
from gossiprec.local.protocol import ControlError
from gossiprec.trainer.state.checks import ReplicaChecks
from gossiprec.trainer.collectives.buckets import allreduce_flat
from gossiprec.trainer.config import TrainerConfig
from gossiprec.trainer.transfer.donor import DonorServer
from gossiprec.trainer.agent_link import AgentLink
from gossiprec.trainer.identity import IdentityField, RankIdentity
from gossiprec.trainer.exits import JobStopped, TrainingEnded, exit_code
from gossiprec.trainer.follower import Follower
from gossiprec.trainer.gate import OptimizerGate
from gossiprec.trainer.collectives.groups import (
    CollectiveAborted, EpochGroups, check_nccl_environment, start_store_server)
from gossiprec.trainer.keys import TransferKeys
from gossiprec.trainer.objects import JOB_ENTRY, JobState, Stateful, check_objects
from gossiprec.trainer.peers import Peers
from gossiprec.trainer.state.receive import held_by, materialize_optimizers
from gossiprec.trainer.redo import RedoGuard, clear_gradients
from gossiprec.trainer.recovery import NoReplica, RecoveryRecord, Recovery, prepare_donation, replica_groups_of
from gossiprec.trainer.settings import CONTROL_TIMEOUT, TrainerSettings
from gossiprec.trainer.waits import WaitMeter
from gossiprec.trainer.collectives.sharded import MeshSpec, ShardedWorld, check_sharded_args
from gossiprec.trainer.state.snapshots import Snapshots
from gossiprec.trainer.steps import StepResult

if TYPE_CHECKING:
    import torch

    from gossiprec.trainer.collectives.buckets import GradientBuckets
    from gossiprec.trainer.state.capture import StateSnapshot
    from gossiprec.trainer.collectives.groups import PendingCollective

log = logging.getLogger(__name__)
_T = TypeVar("_T")

class ResilientTrainer:
    """Wraps one rank's training loop; see the module docstring for the calls and their contract.

    ``objects``: name -> Stateful, the complete replica state (model, optimizer, data position, RNG); it must be
    identical on every replica at a given step (rank-specific choices, such as which shard of data a rank reads,
    are computed from :attr:`rank`, not stored). ``config``: the tunables
    (:class:`~gossiprec.trainer.config.TrainerConfig`). ``control``: a connected client of the agent, ``key``: the
    32-byte key (or the :class:`~gossiprec.trainer.keys.TransferKeys`) state transfers and stores are
    authenticated with; either one not given comes from ``settings`` (default :meth:`TrainerSettings.from_env()
    <gossiprec.trainer.settings.TrainerSettings.from_env>`: the keyring ``gossiprec run`` names, followed as it
    rotates). ``on_recovered(record)``: called after each recovery's first step; ``on_resize(old_world,
    new_world)``: the world size changed (shrink; a mesh job's :attr:`objects` and :attr:`mesh` are new ones by
    then); ``on_no_replica(NoReplica) -> step``: load the user's checkpoint into the objects (see
    :mod:`gossiprec.trainer.recovery`); ``on_phase(step, phase)``: tracing / fault-injection hook (see the module
    docstring); ``on_drop(why)``: this process dropped its state to wait as a spare (fenced, removed).

    ``mesh`` and ``build(mesh) -> objects``: a sharded job (see the module docstring); ``objects`` is then None.

    What the loop reads: :attr:`step` (the last committed step), :attr:`rank` and :attr:`world_size` (-1 and 0 on a
    spare), :attr:`epoch` (the view the rank's groups belong to), :attr:`role` (``trainer`` or ``spare``),
    :attr:`objects` (the registered state; in a sharded job what ``build(mesh)`` returned) and :attr:`mesh` (a
    sharded job's ``DeviceMesh``, once built; a spare's ``build(mesh)`` runs on the recovery path, between the
    plan and the state transfer, and its time is part of the recovery record's). :attr:`records`: the
    :class:`RecoveryRecord` of each recovery.
    """

    epoch: IdentityField[int] = IdentityField()
    rank: IdentityField[int] = IdentityField()
    world_size: IdentityField[int] = IdentityField()
    role: IdentityField[str] = IdentityField()
    step: IdentityField[int] = IdentityField()
    """The last committed step (0: the initial state)."""

    def __init__(self, objects: Mapping[str, Stateful] | None, config: TrainerConfig | None = None, *,
                 settings: TrainerSettings | None = None, control: ControlClient | None = None,
                 key: bytes | TransferKeys | None = None,
                 on_recovered: Callable[[RecoveryRecord], None] | None = None,
                 on_resize: Callable[[int, int], None] | None = None,
                 on_no_replica: Callable[[NoReplica], int] | None = None,
                 on_phase: Callable[[int, str], None] | None = None,
                 on_drop: Callable[[str], None] | None = None, mesh: MeshSpec | None = None,
                 build: Callable[[Any], Mapping[str, Stateful]] | None = None) -> None:
        config = TrainerConfig() if config is None else config
        if not isinstance(config, TrainerConfig):
            raise ConfigError(f"config must be a TrainerConfig, got {type(config).__name__}")
        self.sharded: ShardedWorld | None = None
        if mesh is not None or build is not None:
            mesh = check_sharded_args(mesh, build, objects, config.backend)
            assert build is not None
            self.sharded = ShardedWorld(mesh, build, timeout=config.timeout, poll_interval=config.poll_interval,
                                        slow_after=config.wait_report_after, on_slow=self._on_slow,
                                        on_resume=lambda: self._link.resumed(), on_issue=self._entered)
        else:
            check_objects(objects, config)
        if config.backend == "nccl":
            check_nccl_environment()  # now, not as a silent failure inside the first group's build
        self.config = config
        self._job = JobState()
        self.objects: dict[str, Stateful] = {**(objects or {}), JOB_ENTRY: self._job}
        self.on_recovered = on_recovered
        self.on_resize = on_resize
        self.on_no_replica = on_no_replica
        self.on_phase = on_phase
        if settings is None and (control is None or key is None):
            settings = TrainerSettings.from_env()  # the edge: only when the caller passed neither
        (settings or TrainerSettings()).configure_logging()  # under `gossiprec run`: logs in the agent's format
        if control is None:
            assert settings is not None
            control = settings.connect(timeout=CONTROL_TIMEOUT)
        self.control = control
        self.node: str = str(control.node)
        if key is None:
            assert settings is not None
            key = settings.transfer_keys()
        self.keys: TransferKeys = key if isinstance(key, TransferKeys) else TransferKeys.fixed(key)
        self._identity = RankIdentity()
        self.records: list[RecoveryRecord] = []
        self.interruptions = 0  # times the loop left a step (or its start) for a recovery, a spare's wait aside
        self.groups: EpochGroups | None = None
        self.mesh: Any = None
        """The ``DeviceMesh`` of a sharded job (None otherwise, and on a spare until it takes a rank)."""
        self._step_t0 = time.monotonic()
        self._last_commit_at: float | None = None
        self._waits = WaitMeter()
        self._trains = lambda: self.role == "trainer" and self.rank >= 0  # (not a spare)
        self._check_all_reduce = lambda tensor, op: self._collective(tensor, op, hook=False)  # the digest check's
        self._donor: DonorServer | None = None
        self._buckets: GradientBuckets | None = None
        self._closed = threading.Event()
        self._left = ""
        """Why this process left the training (a recovery that ended it), if it did: it then finishes nothing."""
        copies = config.snapshot_copies if config.snapshot_copies is not None else 1
        self._snaps = Snapshots(self.objects, background=config.background_snapshot, copies=copies)
        self._snaps.hold_live = self.sharded is not None and copies == 1
        self._redo = RedoGuard()
        self._snaps.on_restored = lambda step, nbytes: self._announce(step, nbytes)
        self._checks = ReplicaChecks(self.objects, self._snaps, enabled=config.verify_replicas,
                                     every=config.verify_every, exclude=config.verify_exclude,
                                     device=config.device)
        self._peers = Peers(control, self.node, store_offset=config.store_offset,
                            donor_offset=config.donor_offset, timeout=config.timeout)
        # a failed socket only marks the agent lost: the loop's next look at the follower recovers
        self._link = AgentLink(control, on_lost=lambda why: setattr(self._follower, "lost", why))
        self._follower = Follower(control.path, self._closed, abort=self._abort, abort_older=self._abort_older,
                                  on_plan=lambda plan: prepare_donation(plan, self.node, self._donor, self._snaps),
                                  see_group=self._link.see_group)
        self._gate = OptimizerGate(self, snapshots=self._snaps, follower=self._follower, announce=self._announce,
                                   report=self._link.report, interrupted=self._interrupted,
                                   poll=lambda epoch: self._follower.poll_status(self.control, epoch),
                                   recovery_timeout=config.recovery_timeout)
        held_by(self.objects, self._trains)  # (a trainer's own call of materialize_optimizer_state warns)
        self._recovery = Recovery(self, job=self._job, follower=self._follower, snaps=self._snaps,
                                  checks=self._checks, peers=self._peers, closed=self._closed,
                                  link=self._link, commit=self._commit_snapshot, announce=self._announce,
                                  on_drop=on_drop)

    @property
    def identity(self) -> RankIdentity:
        """Who this rank is now (epoch, rank, world size, role, last committed step)."""
        return self._identity

    def install(self, identity: RankIdentity) -> None:
        """Make ``identity`` this rank's: the one place it changes (the start, commits, recoveries)."""
        self._identity = identity

    @property
    def snapshots(self) -> Snapshots:
        """The committed snapshots kept for recovery (the trainer owns them; read them, do not replace them)."""
        return self._snaps

    @property
    def step_ms(self) -> int:
        """The last step time reported to the agent (ms): the period between the last two commits."""
        return self._link.step_ms

    @property
    def snapshot_bytes(self) -> int:
        """Host memory the snapshots kept for recovery hold now (bytes; live tensors held are not counted)."""
        return self._snaps.host_bytes()

    @property
    def key(self) -> bytes:
        """The key this trainer signs its state transfers with now (the keyring's primary)."""
        return self.keys.primary()

    # ------------------------------------------------------------------ set-up
    def start(self) -> ResilientTrainer:
        """Open the store and donor servers, follow the agent's events, and join the job.

        A trainer of group epoch 0 (view 0, or a later view that only let spares join or leave) builds the
        epoch-0 group on rank 0's store: the job's start barrier, which waits up to ``start_timeout`` for every
        rank, then raises a RecoveryError naming the ranks that never came; it commits step 0. A process whose
        agent is not admitted yet (a spare joining a running job, a re-provisioned host whose agent still
        catches up) waits for it; a spare then blocks until a plan gives it a rank and the state has arrived.
        """
        config = self.config
        status = self.control.status()
        if status.get("secure") and not self.keys.keyed:
            raise ConfigError(
                "the cluster is keyed (its agent seals its traffic with a keyring) but this trainer has no "
                "keyring, so its state transfers would be signed with a key anyone can compute: start it with "
                "`gossiprec run` (it passes the keyring's path in GOSSIPREC_KEYRING), or pass key=")
        self._link.open_page(status)
        deadline = time.monotonic() + config.start_timeout
        view, me = self._link.admitted(status, deadline, start_timeout=config.start_timeout)
        ranks = sum(map(len, view.replica_groups)) or view.world_size  # the job's world (trainers gone included)
        self._peers.refresh()
        host, my_port = self._peers.agent_of(self.node)
        bind = config.bind_host or host
        self._peers.store_server, _ = start_store_server(bind, my_port + config.store_offset, timeout=config.timeout)
        self._donor = DonorServer(self._serve, self.keys, bind, my_port + config.donor_offset).start()
        self._follower.newest_group = view.group_epoch
        self._follower.start()
        self.install(self.identity.but(role=me.role))
        if view.stopped:
            raise JobStopped(f"the job stopped in view {view.epoch} ({view.stopped})")
        if self.sharded is not None:
            self.sharded.spec.check_view(view.world_size, view.replica_groups)
            self.sharded.host, self.sharded.keys = bind, self.keys  # its groups bind and seal as the trainer's
        if self.role == "trainer" and view.group_epoch == 0 and me.rank is not None:
            self.prepare_rank(me.rank, ranks)
            self.install(self.identity.but(rank=me.rank, world_size=view.world_size, epoch=0))
            self._checks.groups = replica_groups_of(view.replica_groups, self.world_size)
            self._job.world_size = self.world_size
            self._commit_snapshot(0)
            rank0 = view.node_of_rank(0)
            assert rank0 is not None  # view 0 gives ranks 0..world-1 (checked where it is made)
            self.groups = EpochGroups(None, backend=config.backend, timeout=config.timeout,
                                      poll_interval=config.poll_interval, host=bind, keys=self.keys)
            try:
                # the start barrier: rank 0's trainer may not listen yet (a slow import), so connect in the
                # build, which a newer view cancels (this agent caught up to a job that went on without it)
                self.groups.build(0, self.rank, self.world_size, timeout=config.start_timeout,
                                  connect=lambda: self._peers.store_for(rank0, connect_timeout=config.start_timeout),
                                  cancelled=lambda: self._follower.superseded(0))
                self.configure_epoch(0)
            except CollectiveAborted as exc:
                if exc.reason == "timeout":
                    who = ", ".join(f"{r} ({view.node_of_rank(r)})" for r in exc.missing) or "unknown"
                    raise RecoveryError(f"the job did not start: ranks {who} did not join the first group within "
                                        f"{config.start_timeout:.0f} s (start_timeout); is their `gossiprec run` up, "
                                        f"and did their trainer reach ResilientTrainer.start()? ({exc})") from exc
                self._recover(f"epoch 0 group failed: {exc}")
            else:
                self._checks.expect("at the start", 0, overlap=False)  # the loop may still load a checkpoint
                self._link.wait_for_spares(view, config.wait_for_spares, lambda: self._follower.trouble(self.epoch))
        else:  # no group yet: it still applies its group's plan (a spare promoted before it came up, say)
            self.install(self.identity.but(epoch=view.group_epoch - 1))
            self.groups = EpochGroups(self._peers.store_server, backend=config.backend, timeout=config.timeout,
                                      poll_interval=config.poll_interval, host=bind, keys=self.keys)
            if self.role == "trainer" and me.rank is not None:  # a view changed before its start: a plan may
                self.prepare_rank(me.rank, ranks)  # resume from its initial state (sharded: built as at epoch 0; and
                self._commit_snapshot(0)  # no spare's lr-0 step: Adam would count it)
            elif self.sharded is not None:  # a sharded spare builds its objects when a plan gives it a rank
                self.sharded.warm()
            else:
                materialize_optimizers(self.objects)
                self._snaps.warm_pool()
            self._link.report(0, "idle")
            self._recover("spare waiting for a rank", spare=True)
        return self

    # ------------------------------------------------------------------ the loop's calls
    def begin_step(self) -> int:
        """Start computing step ``self.step + 1`` (recovering first if the agent asked); returns it."""
        if self._follower.trouble(self.epoch):
            self._recover("view change")
        while True:
            self._step_t0 = time.monotonic()
            self._link.restart_count()  # (a step redone after a recovery starts its count again)
            self._link.report(self.step + 1, "compute")
            try:
                self._gate.begin_step()
                break
            except Exception as exc:
                if not self._interrupted(exc):
                    raise
                self._recover(f"interrupted in step {self.step + 1}'s commit barrier")
        self._snaps.copier.release()  # the last commit's small copies, on the thread, while this step computes
        if self._redo.armed:
            self._redo.start()  # (after the commit barrier: the loop's own collectives are checked)
        self._hook(self.step + 1, "compute")
        return self.step + 1

    def overlap_gradients(self, params: Iterable[torch.Tensor], *, exact: bool = False,
                          bucket_mb: float = 25.0) -> None:
        """All-reduce the gradients of ``params`` in buckets while backward produces them
        (:mod:`gossiprec.trainer.collectives.buckets`); ``allreduce_gradients`` then waits for them. Call once,
        before the first backward; ``exact`` must be what ``allreduce_gradients`` is called with.
        Gradients are taken when backward produces them: accumulate over several backward passes, or
        change ``.grad`` before ``allreduce_gradients()``, only without this."""
        from gossiprec.trainer.collectives.buckets import GradientBuckets

        if self._buckets is not None:
            self._buckets.remove()
        self._buckets = GradientBuckets(params, issue=self._issue_bucket, exact=exact,
                                        rank_world=lambda: (self.rank, self.world_size),
                                        bucket_bytes=max(1, int(bucket_mb * 1024 * 1024)),
                                        on_issue=self._bucket_issued)

    def allreduce_gradients(self, params: Iterable[torch.Tensor], *, exact: bool = False) -> bool:
        """Average the gradients of ``params`` over the group (one flat all-reduce, or the buckets of
        :meth:`overlap_gradients`, issued during backward).

        Returns False when the collective was interrupted: recovery has already run and the loop
        must start the step again (``continue``). A parameter without a gradient counts as zero.
        ``exact``: reduce in rank order (each rank's gradients travel in their own row of a ``world_size`` x n
        buffer, then rows are added 0, 1, 2, ...): the result no longer depends on the collective's algorithm,
        so it is reproducible bit for bit (:func:`~gossiprec.trainer.collectives.buckets.rank_ordered_mean`),
        at ``world_size`` times the bytes.
        """
        plist = [p for p in params if p.requires_grad]
        self._link.report(self.step + 1, "communicate")
        if self._buckets is not None:
            if exact != self._buckets.exact:
                raise ConfigError(f"allreduce_gradients(exact={exact}) but overlap_gradients(exact="
                                  f"{self._buckets.exact}): pass the same to both")
            if not self._wait_buckets(plist):
                return False
            return self._after_allreduce(plist)
        if not allreduce_flat(plist, self.allreduce, self.rank, self.world_size, exact=exact):
            return False
        return self._after_allreduce(plist)

    def _after_allreduce(self, plist: list[torch.Tensor]) -> bool:
        self._snaps.settle()  # the optimizer step comes next: the last commit's copies must be done
        if self._snaps.background:
            self._snaps.update_late(plist)
        if self._checks.pending and not self._checks.run(self._check_all_reduce, self.rank, self.world_size):
            return False
        self._link.report(self.step + 1, "optimizer")
        self._hook(self.step + 1, "optimizer")
        return True

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> bool:
        """All-reduce ``tensor`` in place on the current group; False (after recovering) if interrupted."""
        return self._collective(tensor, op, hook=True)

    @contextlib.contextmanager
    def training_step(self) -> Iterator[int]:
        """One step, written as the user's own code (forward, backward, optimizer, any collectives)::

            with rt.training_step() as s:
                ...

        Begins step ``s`` (:meth:`begin_step`) and commits it when the block ends. When a collective
        inside fails or is interrupted by a view change
        (:class:`~gossiprec.trainer.collectives.groups.CollectiveAborted`, or any error raised while this
        epoch's groups are aborted), the trainer recovers and the block's
        exception is swallowed: the loop goes on from :attr:`step`, the last committed step.
        """
        while True:  # the replicas' comparison runs first; a recovery during it begins the step again
            step = self.begin_step()
            if not self._checks.pending or self._checks.run(self._check_all_reduce, self.rank, self.world_size):
                break
        try:
            yield step
            self._gate.before_optimizer()  # (a step without an optimizer step)
        except Exception as exc:
            if not self._interrupted(exc):
                raise
            if self._gate.rolled(step):  # its optimizer stepped on the plan's word: the plan counts on it
                self._commit_snapshot(step)
            self._recover(f"interrupted in step {step}: {exc}")
            return
        self.commit()

    def resume_from(self, find: Callable[[], int | None], load: Callable[[Mapping[str, Stateful], int], None]
                    ) -> int | None:
        """After :meth:`start` in a restarted run: the ranks agree on ``find()`` (the newest checkpoint's
        step or None), then ``load(objects, step)``; see :meth:`~gossiprec.trainer.recovery.Recovery.resume`."""
        return self._recovery.resume(find, load)

    def run_step(self, closure: Callable[[int], _T]) -> StepResult[_T]:
        """``with training_step() as s: value = closure(s)``: the step, whether it committed (False: it was
        interrupted and the trainer recovered; the loop goes on from :attr:`step`) and what ``closure``
        returned (its loss, say; None when it did not finish)."""
        value: _T | None = None
        with self.training_step() as step:
            value = closure(step)
        committed = self.step == step  # (a step rolled forward after its interruption committed too)
        return StepResult(step, committed, value if committed else None)

    def _interrupted(self, exc: BaseException) -> bool:
        """Whether ``exc`` comes from a failed or aborted collective of this epoch (wrapped or not)."""
        if isinstance(exc, CollectiveAborted):
            return True
        sharded = self.sharded
        return (sharded is not None and sharded.aborted()) or self._follower.trouble(self.epoch)

    def commit(self) -> int:
        """Step ``self.step + 1`` is done (optimizer stepped): capture it; returns the new step.

        The step time reported to the agent (what hang detection scales with) is the period between
        two commits, so it includes data loading and anything else the loop does between steps.
        """
        step = self.step + 1
        if self._redo.armed:
            self._redo.disarm()  # (a redone step without a collective)
        self._link.finishing(step)  # before the commit reads the follower (see gossiprec.local.progress)
        self._commit_snapshot(step, verify=self._checks.checks_commit(step))
        now = time.monotonic()
        if self._last_commit_at is not None:
            self._link.step_ms = int((now - self._last_commit_at) * 1000)
        self._link.wait_ms = self._waits.commit(self.groups.current if self.groups is not None else None,
                                                counted=self._last_commit_at is not None)
        self._last_commit_at = now
        record = self._recovery.first_step()
        if record is not None:
            self.records.append(record)
            if self.on_recovered is not None:
                self.on_recovered(record)
        self._hook(step, "committed")
        return step

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Wrap long work between two steps, such as saving a checkpoint (on one rank or on all)::

            with rt.checkpointing():
                torch.save({k: o.state_dict() for k, o in rt.objects.items()}, path)

        The agents judge a rank in phase ``checkpoint`` hung only after ``checkpoint_timeout`` (600 s by
        default, ``[protocol]``), not max(1 s, 3 x step time). A view change meanwhile waits for the next step.
        """
        self._link.report(self.step, "checkpoint")
        self._hook(self.step, "checkpoint")
        try:
            yield
        finally:
            self._link.report(self.step, "idle")

    def finish(self, barrier: bool = True, exit_code: int | None = None) -> None:
        """End of training: a comparison a recovery deferred, a last barrier (errors ignored), tell the agents
        the job is done (unused spares then leave: their :meth:`start` raises
        :class:`~gossiprec.trainer.exits.JobFinished`), stop following the agent. ``exit_code``: end the
        process with ``os._exit`` (no teardown: a retired group hung in the graveyard would block in its destructor)."""
        self._link.report(self.step, "idle")
        if barrier and self.groups is not None and self.groups.current is not None:
            group, timeout = self.groups.current, self.config.finish_timeout
            if self.role == "trainer":
                self._checks.run_at_finish(group, timeout, self.rank, self.world_size)
            try:
                group.barrier(timeout=timeout)
            except GossiprecError:
                pass
        if self.role == "trainer" and self.rank >= 0 and not self._left:
            try:
                self.control.finished(self.step)
            except ControlError as exc:
                log.warning("could not tell the agent that training finished: %s", exc)
        self.close()
        if exit_code is not None:
            os._exit(exit_code)
        if self.sharded is not None and self.sharded.hung:
            log.warning("%d collective(s) are left pending on aborted backends: end this process with "
                        "os._exit (finish(exit_code=0)), or interpreter teardown may block in gloo's destructor",
                        self.sharded.hung)

    def leave(self, outcome: BaseException) -> NoReturn:
        """End this process after ``outcome``, one of the trainer's ends that are not crashes
        (a :class:`~gossiprec.trainer.exits.TrainingEnded`: ``JobFinished``, ``Released``, ``JobStopped``):
        say why on stderr, stop serving and following the agent, and exit with its code
        (:func:`gossiprec.trainer.exits.exit_code`: 0, 0, 75) without interpreter teardown (see
        :meth:`finish`). Anything else is raised again."""
        if not isinstance(outcome, TrainingEnded):
            raise outcome
        code = exit_code(outcome)
        print(f"gossiprec: node {self.node}: {type(outcome).__name__}: {outcome} (exit {code})", file=sys.stderr,
              flush=True)
        self.close()
        os._exit(code)

    def close(self) -> None:
        """Stop following the agent and serving state (copies in flight are waited for)."""
        self._recovery.flush_record()  # (a recovery whose deferred comparison never ran)
        self._snaps.close()
        self._closed.set()
        if self._donor is not None:
            self._donor.close(timeout=0.5)
        self._link.close()

    # ------------------------------------------------------------------ what the calls share
    def _collective(self, tensor: torch.Tensor, op: str, hook: bool) -> bool:
        if self._follower.trouble(self.epoch):
            self._recover("view change")
            return False
        assert self.groups is not None and self.groups.current is not None
        try:
            self._entered()
            pending = self.groups.current.allreduce(tensor, op, async_op=True)
            assert pending is not None
            self._snaps.copier.run_held()  # copies the thread has not begun, while the collective is on the wire
            step = self.step + 1
            if hook:
                self._hook(step, "communicate")  # the collective is in flight
            pending.wait(slow_after=self.config.wait_report_after, on_slow=self._link.on_slow(step))
            self._link.resumed()
            return True
        except CollectiveAborted as exc:
            self._recover(f"{exc.reason}: {exc}")
            return False

    def _issue_bucket(self, tensor: torch.Tensor, op: str) -> object:
        """Start one bucket's all-reduce (from a gradient hook); None when a view change is known."""
        if self._follower.trouble(self.epoch):
            return None
        assert self.groups is not None and self.groups.current is not None
        self._entered(guard=False)
        return self.groups.current.allreduce(tensor, op, async_op=True)

    def _bucket_issued(self) -> None:
        """The first bucket of a step is on the wire (from a gradient hook, inside backward)."""
        self._link.report(self.step + 1, "communicate")
        self._hook(self.step + 1, "communicate")

    def _wait_buckets(self, plist: list[torch.Tensor]) -> bool:
        """Wait for the gradient buckets (recovering, and False, when interrupted)."""
        assert self._buckets is not None
        step = self.step + 1
        first = [True]

        def wait(pending: PendingCollective) -> None:
            if first[0]:
                first[0] = False
                self._snaps.copier.run_held()  # copies the thread has not begun, while the buckets are on the wire
            pending.wait(slow_after=self.config.wait_report_after, on_slow=self._link.on_slow(step))
            self._link.resumed()

        try:
            if self._buckets.finish(plist, wait):
                return True
            self._recover("view change")
        except CollectiveAborted as exc:
            self._recover(f"{exc.reason}: {exc}")
        return False

    def _recover(self, cause: str, spare: bool = False) -> None:
        self._last_commit_at = None  # a recovery is not a step: keep it out of the step time
        self.interruptions += not spare
        self._gate.abandon()
        if self.sharded is not None and self.sharded.built:
            self.sharded.reset_modules(self.objects)  # before the state is restored (the barrier is dropped too)
        try:
            self._recovery.recover(cause, spare)
        except GossiprecError as exc:
            self._left = f"{type(exc).__name__}: {exc}"  # released, stopped, fenced...: it finishes nothing
            raise
        clear_gradients(self.objects)  # the interrupted step's, partial: the redone one starts from none
        self._redo.arm(self.objects)

    def _commit_snapshot(self, step: int, verify: bool = False) -> None:
        """Capture the objects as step ``step`` and tell the agent. ``verify``: copy everything now with
        checksums, and compare the state across replicas (and with the live tensors) at the next
        all-reduce of gradients."""
        # a view known (after commit()'s link.finishing, every view the agent reported for: gossiprec.local.progress)
        # means a recovery before any optimizer step: one copy keeps the previous step too, which the plan may name
        snap = self._snaps.commit(step, checksum=verify, keep_previous=self._follower.trouble(self.epoch))
        (self._checks.committed if verify else self._checks.commit_taken)(step, snap)  # (unchecked: a deferred check's)
        self.install(self.identity.but(step=step))
        self._gate.committed(step)
        older = self._snaps.kept_previous()
        if older is not None:  # both servable: the election picks the newest every replica group holds
            self._announce(older, snap.header.total_nbytes, inflight=step)
        else:
            self._announce(step, snap.header.total_nbytes)

    def _announce(self, step: int, nbytes: int, inflight: int | None = None) -> None:
        """Tell the agent what this rank could serve: committed ``step`` (and ``inflight``, a newer step
        held too), ``nbytes`` of it (0: nothing)."""
        port = self._donor.port if self._donor else None
        committed = step
        if inflight is None and self.sharded is not None and nbytes and step > 0 and step - 1 in self._snaps.steps():
            # The shards of one step come from every replica group, and a failure inside a step can leave
            # one group a commit ahead of another: offer the step before too (it is still held), so the
            # election finds a step every group can serve instead of none.
            committed, inflight = step - 1, step
        self._link.set_state(committed, inflight, nbytes, port)

    def _serve(self, epoch: int, step: int) -> StateSnapshot | None:
        self._hook(step, "serve")
        self._gate.wait_rolled(step, self.config.timeout)
        return self._snaps.at(step)

    def _abort(self, reason: str) -> None:
        if self.groups is not None:
            self.groups.abort(reason=reason)
        if self.sharded is not None:
            self.sharded.abort(reason)

    def _abort_older(self, epoch: int, reason: str) -> None:
        self._recovery.abort_older_than(epoch, reason)
        if self.sharded is not None:
            self.sharded.abort(reason, epoch=epoch - 1)

    def _on_slow(self) -> None:
        """A managed collective waits on peers: say so (the agents tell this rank from a frozen one)."""
        (self._link.on_slow(self.step + 1) or (lambda: None))()

    def _entered(self, guard: bool = True) -> None:
        """A collective is entered (on any group): the position the agents compare moves on (on the page
        only). ``guard``: check a redone step's first collective (not from a gradient hook: no raising
        into backward)."""
        if guard and self._redo.watching:
            self._redo.check()
        # sharded: any collective may be the step's last before a silent commit, so from the first one the rank
        # reads as communicating: its agent then holds a new view's state report until the commit (or recovery)
        self._link.entered(communicating=self.sharded is not None)

    # ------------------------------------------------------------------ sharded jobs (called by the recovery too)
    def prepare_rank(self, rank: int, world_size: int) -> bool:
        """A sharded job: build the mesh and the objects for ``rank`` of ``world_size`` (a spare when it takes
        a rank); a survivor of a shrink builds them again on the smaller mesh (True: its state is loaded next)."""
        sharded = self.sharded
        if sharded is None or sharded.built and (rank, world_size) == (sharded.rank, sharded.world_size):
            return False
        rebuilt = sharded.built
        objects = sharded.build(rank, world_size)  # (MeshShrinkRefused for a move along a sharded dimension)
        check_objects(objects, self.config)
        if self.role == "spare" or rebuilt:  # (before the gate's hooks: this step at lr 0 is no training step)
            materialize_optimizers(objects)  # the state then lands in optimizer state on the new mesh
        self._gate.hook(objects)
        held_by(objects, self._trains)
        self.mesh = sharded.mesh
        self.objects.clear()  # the same dict: the snapshots, checks and recovery hold it
        self.objects.update({**objects, JOB_ENTRY: self._job})
        if rebuilt:
            self._snaps.objects_replaced()
        return rebuilt

    def configure_epoch(self, epoch: int) -> None:
        """A sharded job: give every group of the mesh ``epoch``'s backend, on the epoch's store."""
        if self.sharded is not None and self.groups is not None:  # (a sharded job has its groups by now)
            self.sharded.configure(epoch, self.groups.shared_store(), lambda: self._follower.superseded(epoch))

    def _hook(self, step: int, phase: str) -> None:
        if self.on_phase is not None:
            self.on_phase(step, phase)
