"""The training-loop wrapper: report, all-reduce interruptibly, commit, and recover in place.

Theory of operation
-------------------
:class:`ResilientTrainer` sits in an ordinary data-parallel loop with a handful of calls::

    rt = ResilientTrainer(training_state(model, opt, data=pos))
    rt.start()                                # trainer: build the epoch group; spare: wait for a rank
    while rt.step < steps:
        s = rt.begin_step()                   # the step being computed (committed step + 1)
        opt.zero_grad(); loss_of(model, batch(rt.rank, s)).backward()
        if not rt.allreduce_gradients(model.parameters()):
            continue                          # a recovery happened: redo from rt.step
        opt.step()
        rt.commit()                           # step s is committed on this rank
    rt.finish()

**Commit point.** Step ``s`` is committed on a rank when its optimizer step has finished and
:meth:`commit` has captured the registered objects into a snapshot (a copy, into a reused buffer).
The bulk of that copy, the parameters handed to :meth:`allreduce_gradients` and the optimizer's state,
runs on a background thread while step ``s + 1`` computes: only the optimizer step changes those
tensors, and :meth:`allreduce_gradients` waits for the copy before it returns (below
:data:`BACKGROUND_MIN_BYTES` the thread is woken by the next :meth:`begin_step`, not by :meth:`commit`,
and if the loop reaches the all-reduce before the thread has started, the main thread makes the copy
in the collective's shadow). Tensors on a GPU go to
pinned host buffers on a side stream that waits for the optimizer step's kernels, so the DMA runs
beside the next step's kernels (see :class:`~gossiprec.trainer.capture.DeferredCopies`). Each source's in-place
version counter is checked then, so a loop that changes parameters between :meth:`commit` and
:meth:`allreduce_gradients` gets a clear error instead of a torn snapshot (``background_snapshot=False``
copies everything inside :meth:`commit`). Everything else (buffers a forward pass updates, RNG, data
position) is copied inside :meth:`commit`.
Before that, a failure rolls this rank back to ``s - 1`` (its live objects are reloaded from the
snapshot, so RNG and data position consumed by the interrupted step are undone). The last *two*
snapshots are kept, because the agent's state report of a new view can lag one commit behind the
trainer; a donor serves whichever step the plan names. Every commit tells the agent its state
(committed step, payload size) and every phase change its progress (step, phase, step time), by
writing them into the agent's progress page (:mod:`gossiprec.local.progress`: shared memory, a few
microseconds, no system call; the agent reads it when it handles a packet or a timer). Where the
agent has no page, they go as non-blocking ``state`` and ``report`` messages on the control socket.

**Interruption.** A thread reads the agent's event stream. A ``ViewInstalled`` for a newer epoch, or
``Fenced``, aborts the current group (:class:`~gossiprec.trainer.groups.EpochGroups`): a waiting
all-reduce raises within a poll slice; a collective that fails by itself (gloo sees the dead peer)
raises too. Either way the trainer enters :meth:`_recover`.

**Recovery**, driven by the agreed plan (the newest ``PlanReady``; ``status`` is polled as a
fallback): this rank's new rank is the plan's assignment. A rank named as a receiver fetches the
target step from the plan's donors, striped exactly as the plan says (:func:`fetch_state`, bytes
land in the local tensors); a rank at the target reloads its own snapshot; then the new epoch's group
is built on the TCPStore of the plan's ``store_node`` and training continues from ``target_step``.
A hot spare (role ``spare`` in view 0) builds model and optimizer before :meth:`start`, which
allocates the optimizer's state (:func:`materialize_optimizer_state`) and blocks until a plan gives it
a rank. A survivor may apply several plans in one recovery (a newer view supersedes one that could not
finish); each restore bumps the version counters of what it writes, so the next one copies it again.

**Replica checks.** Every replica of a shard must hold the same state. The ranks of each replica
group compare a digest of it (:mod:`gossiprec.trainer.digest`) at the first all-reduce of gradients
after the start, after the first step, after every recovery and every ``verify_every`` steps; a
mismatch raises :class:`~gossiprec.trainer.digest.ReplicaMismatch`. The first step's commit (and every
``verify_every``-th) is copied and checksummed in place, and the next all-reduce hashes the live
parameters and optimizer state again: a write torch does not track (``.data``) between the two
raises :class:`~gossiprec.errors.RecoveryError`.

**The end.** :meth:`finish` tells the agents that training is over; spares still waiting in
:meth:`start` raise :class:`JobFinished`, and a view that stops the job (no spare, no shrink) makes
every rank raise :class:`JobStopped`.

**Addresses.** Every trainer process hosts a TCPStore server and a :class:`DonorServer` from the
start, on fixed offsets from its agent's port (``agent port + store_offset`` and ``+ donor_offset``,
default 1 and 2), so the host and port of any member's store and donor follow from the view's member
address; no address needs to be gossiped and the store of a new epoch is already listening. The view
0 store is rank 0's.

**Keys.** State is authenticated with the primary key of ``GOSSIPREC_KEYRING`` (the cluster's
keyring); without one (``--insecure`` clusters) a key derived from the cluster name is used, which
protects against accidents, not attackers.

**Shrink.** With no spare left and ``allow_shrink`` in the job spec, the plan drops the lost ranks'
data-parallel columns (action ``shrink``): survivors get their new ranks and the world shrinks.
The world size a state was last stepped in travels *with* the state (a ``gossiprec`` entry the
trainer adds to the objects), so every rank of the new world, survivor or receiver, sees the same
change and calls ``on_resize(old_world, new_world)`` before the next step: that is where the user
rescales what depends on the world size (learning rate, per-rank batch); it must be deterministic.
It always starts from the state restored at the target step (pre-resize), so when a newer view
interrupts a recovery before its first step, the next recovery restores and calls it again.
A survivor dropped by a shrink raises :class:`Released` (leave the job, exit 0).

**No replica left.** A plan with action ``checkpoint`` (some replica group has no surviving holder)
calls ``on_no_replica(NoReplica)`` on every rank of the new world: it loads the user's checkpoint
into the objects and returns its step. The ranks check that they all loaded the same step (one
all-reduce) and go on from there. Without the callback, and for a ``stop`` plan (no spare, no
shrink), the trainer raises :class:`JobStopped`.

**Hooks.** ``on_phase(step, phase)`` is called at every phase boundary of a step (``compute``,
``communicate`` with the collective in flight, ``optimizer``, ``committed``) and, during a
recovery, ``serve`` (a receiver asked this donor for state; from a donor thread) and ``fetch`` (a
chunk arrived; from a receiving thread): for tracing and fault injection, not for long work.

**Hangs.** A stopped or stuck trainer stays in its collective forever; the survivors leave theirs
when the agents agree on a view without it (its agent reports the stalled step; see
:mod:`gossiprec.core.node`). The hung process itself must be killed by its launcher once its node
is out of the view (``gossiprec run`` does), so that a later SIGCONT cannot bring stale state back;
if it wakes first, its own trainer raises :class:`~gossiprec.errors.FencedError`.

The agents find the hung rank by its (step, phase) stalled behind the others'. A rank frozen
*inside* the all-reduce reported ``communicate`` just like the peers waiting for it, and one frozen
just after its own part completed reported ``optimizer``, ahead of them. So a rank whose collective
is still pending ``wait_report_after`` seconds in reports phase ``waiting`` (it is alive and waits
on peers; only when the wire protocol's PHASES lists that phase, after ``communicate`` and
``optimizer``), which leaves the frozen rank behind in both cases. After a recovery each rank
reports ``(target, idle)`` once its group is built, so the agents' stall clock starts afresh for
every rank instead of at the start of a long recovery.

Limits: released ranks of a shrink leave after ``linger`` seconds of serving; the step time the
agents judge hangs by is the commit-to-commit period (``step_ms`` in reports).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from gossiprec.core.wire import PHASES
from gossiprec.errors import ConfigError, FencedError, GossiprecError, RecoveryError, TransferError
from gossiprec.local.control import ControlClient, ControlError
from gossiprec.local.progress import ProgressPage
from gossiprec.trainer.config import TrainerConfig
from gossiprec.trainer.settings import TrainerSettings
from gossiprec.trainer.capture import DeferredCopies, StateSnapshot, capture_deferred
from gossiprec.trainer.digest import (
    PendingDigest, ReplicaMismatch, StateDigest, describe, differing_groups, digest_of_snapshot, rows_tensor,
)
from gossiprec.trainer.groups import CollectiveAborted, EpochGroups, connect_store, start_store_server
from gossiprec.trainer.header import tensor_bytes
from gossiprec.trainer.objects import Stateful
from gossiprec.trainer.receive import LayoutMismatch, ReceiveTarget, materialize_optimizer_state, restore_state
from gossiprec.trainer.rng import RNGState
from gossiprec.trainer.donor import DonorServer
from gossiprec.trainer.fetch import fetch_state

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FAILURE_EVENTS = frozenset({"MemberFailed", "MemberLeft", "AlertRaised", "MemberSuspected"})
CONTROL_TIMEOUT = 30.0
"""Seconds a trainer waits for its agent's reply to a request (the state and report messages of every
step are not requests: they never wait). Generous: when a whole job starts at once on few cores, an
agent may take many seconds to answer its first request; a dead agent closes the socket, which fails
at once."""
_PHASE_INDEX = {name: i for i, name in enumerate(PHASES)}
BACKGROUND_MIN_BYTES = 8 * 1024 * 1024
"""A commit's parameter and optimizer-state copies below this size (host to host) are *held* by
:meth:`commit` and handed to the background thread by the next :meth:`begin_step`: waking the thread
costs more than such a copy (a 1 MB state on 2 cores: ~0.3 ms of wake-up and GIL hand-over against
~0.1 ms of copying), and from ``begin_step`` that cost falls in the step's compute instead of between
two steps. Whoever needs the copies before the thread has begun them makes them itself: normally the
main thread in the next all-reduce, after it has launched the collective and before it waits for it
(a loop without ``begin_step``), or a donor thread (:meth:`_Copier.run_held`). Larger copies, and
copies from a GPU, go to the thread at once (the DMA runs beside the next step's kernels).

Measured (``gossiprec bench baseline --overhead-only``, 2 ranks, 100 ms steps, 1 MB state, three
runs each way in the same hour): 1.12-1.38 % of the step with the copies made in the all-reduce's
shadow (they took ~0.3 ms there, on cold caches with both cores busy with the collective), 0.31-0.70 %
with the thread woken by ``begin_step`` (together with the RNG read from the generators' structs)."""
WAITING = "waiting"
"""The phase a rank reports while its collective waits on peers (used when the wire protocol has it)."""
JOB_ENTRY = "gossiprec"
"""Name of the entry the trainer adds to the registered objects (the world size of the state)."""


class Released(RecoveryError):
    """A shrink dropped this rank from the world: leave the job (exit 0); the others go on without it."""


class JobStopped(RecoveryError):
    """The agreed plan stops the job (no spare and no shrink allowed, or no replica of some state and no
    ``on_no_replica`` callback): restart it from a checkpoint, with more spares or ``allow_shrink``."""


class JobFinished(GossiprecError):
    """The job's trainers finished training while this process was a spare: nothing left to do (exit 0)."""


@dataclass(frozen=True, slots=True)
class NoReplica:
    """What ``on_no_replica`` is told: no survivor holds the state of ``orphan_groups`` (replica groups,
    previous numbering), so the new world (``rank`` of ``world_size``) restarts from a checkpoint."""

    epoch: int
    rank: int
    world_size: int
    orphan_groups: tuple[tuple[int, ...], ...]
    reason: str


class _JobState:
    """The world size the registered state was last stepped in (a Stateful carried with the state)."""

    def __init__(self) -> None:
        self.world_size = 0

    def state_dict(self) -> dict[str, int]:
        return {"world_size": self.world_size}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.world_size = int(sd["world_size"])


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Pending:
    cause: str
    noticed_at: float
    detected_at: float | None = None
    agreed_at: float | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    attempts: list[tuple[int, int, str]] = field(default_factory=list)


def _has_data_position(objects: Mapping[str, Stateful]) -> bool:
    """Whether any object is something other than a model, optimizer, LR scheduler or RNG state."""
    import torch

    plain = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, RNGState)
    return any(not isinstance(o, plain) for o in objects.values())


def rank_ordered_mean(rows: list[torch.Tensor]) -> torch.Tensor:
    """``(((rows[0] + rows[1]) + rows[2]) + ...) / len(rows)``: the reduction of ``exact`` gradients,
    reproducible in one process (e.g. a failure-free reference run)."""
    total = rows[0].clone()
    for r in rows[1:]:
        total.add_(r)
    return total.div_(len(rows))


def _groups_of(groups: Any, world: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups (lists of ranks) from the agent, or one group of every rank when it sent none."""
    if not groups:
        return (tuple(range(world)),)
    return tuple(tuple(int(r) for r in g) for g in groups)


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class _Copier:
    """Finishes a commit's deferred tensor copies while the next step runs: on one daemon thread, or,
    for a held job, in the first thread that asks for it.

    :meth:`submit` hands one :class:`DeferredCopies` to the thread; :meth:`hold` keeps it until
    :meth:`release` hands it to the thread (the previous job must have been waited for, either way).
    Until the thread has begun a held or released job, the first caller of :meth:`run_held` or
    :meth:`wait` makes it instead; :meth:`wait` blocks until the job is done and returns it (None when
    nothing was pending). Thread-safe: the main thread and donor threads may wait at the same time.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._job: DeferredCopies | None = None
        self._running = False
        """A job was submitted or held and is not done yet."""
        self._waits_for: str | None = None
        """A job nobody has begun: "thread" (submitted: for the thread), "caller" (held: for a caller, until
        :meth:`release`) or "released" (for the thread, unless a caller takes it first); else None."""
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, job: DeferredCopies) -> None:
        self._put(job, "thread")

    def hold(self, job: DeferredCopies) -> None:
        """Keep ``job`` until :meth:`release`, or for the first caller of :meth:`run_held` or :meth:`wait`."""
        self._put(job, "caller")

    def release(self) -> None:
        """Hand a held job to the thread (nothing if none is held); a caller may still take it first."""
        with self._cv:
            if self._waits_for == "caller":
                self._waits_for = "released"
                self._wake_thread()

    def _put(self, job: DeferredCopies, waits_for: str) -> None:
        with self._cv:
            assert self._job is None and not self._running, "wait() for the previous copies first"
            self._job, self._running, self._waits_for, self._error = job, True, waits_for, None
            if waits_for == "thread":
                self._wake_thread()

    def _wake_thread(self) -> None:
        """Start the thread or wake it (under ``_cv``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gossiprec-snapshot", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def run_held(self) -> None:
        """Make a held or released job's copies in this thread now, unless the thread has begun them.

        Submitted jobs (large, or from a GPU, whose ``run`` ends in a stream synchronisation) are left
        to the thread: a caller that needs them waits in :meth:`wait`."""
        with self._cv:
            if self._waits_for not in ("caller", "released"):
                return
            self._waits_for = None
            job = self._job
        assert job is not None
        self._run(job)

    def wait(self, take: bool = True) -> DeferredCopies | None:
        """Block until the copies are done; ``take`` hands the job over (else it stays for the owner)."""
        self.run_held()
        with self._cv:
            while self._running:
                self._cv.wait()
            job, error = self._job, self._error
            if take:
                self._job = self._error = None  # reported once, to the owner
            if error is not None:
                raise RecoveryError(f"snapshot copy failed: {error}") from error
            return job

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._waits_for not in ("thread", "released"):
                    self._cv.wait()
                self._waits_for = None
                job = self._job
            assert job is not None
            self._run(job)

    def _run(self, job: DeferredCopies) -> None:
        error: BaseException | None = None
        try:
            job.run()
        except BaseException as exc:  # reported to whoever waits
            error = exc
        with self._cv:
            if error is not None:
                self._error = error
            self._running = False
            self._cv.notify_all()
        if error is not None and not isinstance(error, Exception) and threading.current_thread() is not self._thread:
            raise error  # a KeyboardInterrupt in a caller's run_held() stays one


class ResilientTrainer:
    """Wraps one rank's training loop; see the module docstring for the calls and their contract.

    ``objects``: name -> Stateful, the complete replica state (model, optimizer, data position, RNG);
    it must be identical on every replica at a given step (rank-specific choices, such as which
    shard of data a rank reads, are computed from :attr:`rank`, not stored). ``control``: a
    connected client (default ``ControlClient.from_env()``). ``timeout``: seconds for group
    construction and a collective. ``poll_interval``: abort reaction time of a waiting collective.
    ``wait_report_after``: seconds a collective may wait before this rank reports itself
    ``waiting`` (see the module docstring). ``on_recovered(record)``: called after each recovery's
    first step. ``on_resize(old_world,
    new_world)``: the world size changed (shrink); ``on_no_replica(NoReplica) -> step``: load the
    user's checkpoint into the objects; ``on_phase(step, phase)``: tracing / fault-injection hook
    (see the module docstring for all three). ``background_snapshot``: copy the parameters and
    optimizer state of a commit while the next step computes (see the module docstring); False copies
    everything inside :meth:`commit`. ``verify_replicas``: compare a digest of the state across each
    replica group at the start, after the first step, after every recovery and every ``verify_every``
    steps (0: never periodically); a mismatch raises :class:`~gossiprec.trainer.digest.ReplicaMismatch`.
    ``stateless_data``: the loop registers no data position because every batch is a function of
    (:attr:`step`, :attr:`rank`); without it, objects with no data position are refused.
    """

    def __init__(self, objects: Mapping[str, Stateful], config: TrainerConfig | None = None, *,
                 settings: TrainerSettings | None = None, control: ControlClient | None = None,
                 key: bytes | None = None,
                 on_recovered: Callable[[RecoveryRecord], None] | None = None,
                 on_resize: Callable[[int, int], None] | None = None,
                 on_no_replica: Callable[[NoReplica], int] | None = None,
                 on_phase: Callable[[int, str], None] | None = None) -> None:
        config = TrainerConfig() if config is None else config
        if not isinstance(config, TrainerConfig):
            raise ConfigError(f"config must be a TrainerConfig, got {type(config).__name__}")
        if not objects:
            raise ConfigError("ResilientTrainer needs the objects that make up the training state")
        if JOB_ENTRY in objects:
            raise ConfigError(f"the object name {JOB_ENTRY!r} is reserved for the trainer's own state; "
                              "rename that object")
        if not config.stateless_data and not _has_data_position(objects):
            raise ConfigError(
                f"no data position among the objects {sorted(objects)}: a spare that takes a rank would read "
                "its data from the start, training silently on other batches than the rank it replaces. "
                "Register the position (training_state(model, opt, data=position), any object with "
                "state_dict/load_state_dict), or pass TrainerConfig(stateless_data=True) if every batch is a "
                "function of rt.step and rt.rank")
        self.config = config
        self.verify_replicas = config.verify_replicas
        self.verify_every = config.verify_every
        self._check: tuple[str, PendingDigest | StateDigest] | None = None
        """A cross-replica comparison due at the next all-reduce of gradients: (when, digest)."""
        self._verify_live: StateSnapshot | None = None
        """A checksummed commit whose parameters and optimizer state must still equal the live ones at
        the next all-reduce of gradients (catches writes torch does not see, e.g. through ``.data``)."""
        self._replica_groups: tuple[tuple[int, ...], ...] = ()
        self._job = _JobState()
        self.objects: dict[str, Stateful] = {**objects, JOB_ENTRY: self._job}
        self.on_resize = on_resize
        self.on_no_replica = on_no_replica
        self.on_phase = on_phase
        self.wait_report_after = config.wait_report_after
        self.background_snapshot = config.background_snapshot
        self._copier = _Copier()
        self._late: frozenset[int] = frozenset()
        """``data_ptr()`` of the tensors only the optimizer step changes (see :meth:`_commit_snapshot`)."""
        self._late_for: tuple[Any, ...] = ()
        """The key :attr:`_late` was computed for (see :meth:`_update_late`)."""
        self._optimizers: list[Any] | None = None
        self._unchanged: frozenset[int] = frozenset()
        self._pool: list[StateSnapshot] = []
        """Snapshot buffers nothing refers to (a spare's, allocated while it waits): reused by commits."""
        self._owner = threading.get_ident()
        """The thread that runs the loop (the only one that checks and takes finished snapshot copies)."""
        if settings is None and (control is None or key is None):
            settings = TrainerSettings.from_env()  # the edge: only when the caller passed neither
        if control is None:
            assert settings is not None
            control = settings.connect(timeout=CONTROL_TIMEOUT)
        self.control = control
        self._control_path = control.path
        self.node: str = str(control.node)
        if key is None:
            assert settings is not None
            key = settings.transfer_key()
        self.key = key
        self.backend = config.backend
        self.timeout = config.timeout
        self.poll_interval = config.poll_interval
        self.store_offset = config.store_offset
        self.donor_offset = config.donor_offset
        self.bind_host = config.bind_host
        self.linger = config.linger
        self.on_recovered = on_recovered
        self.rank: int = -1
        self.world_size: int = 0
        self.epoch: int = -1
        self.step: int = 0
        """The last committed step (0: the initial state)."""
        self.role = "trainer"
        self.records: list[RecoveryRecord] = []
        self.groups: EpochGroups | None = None
        self._snapshots: list[StateSnapshot] = []
        self._lock = threading.Condition()
        self._plans: dict[int, dict[str, Any]] = {}
        self._newest_view = -1
        self._fenced = ""
        self._agent_lost = ""
        self._stopped = ""
        """Why the agreed view stopped the job (no spare, no shrink), if it did."""
        self._finished: int | None = None
        """The step at which the job's trainers finished, once the agent heard of it."""
        self._pending: _Pending | None = None
        self._failure_events: list[float] = []
        self._last_view_at: float | None = None
        self._building_epoch: int | None = None
        self._last_recovered_at = 0.0
        self._record_open: _Pending | None = None
        self._step_t0 = time.monotonic()
        self._step_ms = 0
        self._last_commit_at: float | None = None
        self._page: ProgressPage | None = None
        """The agent's progress page (:mod:`gossiprec.local.progress`): reports and state go there, without
        a system call or a wake-up of the agent; None: they go through the control socket."""
        self._stores: dict[tuple[str, int], Any] = {}
        self._store_server: Any = None
        self._donor: DonorServer | None = None
        self._events: threading.Thread | None = None
        self._closed = threading.Event()
        self._addrs: dict[str, str] = {}

    # ------------------------------------------------------------------ set-up
    def start(self) -> ResilientTrainer:
        """Open the store and donor servers, follow the agent's events, and join the job.

        A trainer of view 0 builds the epoch-0 group (rank 0's store) and commits step 0, the
        initial state. A spare blocks until a plan gives it a rank and the state has arrived.
        """
        status = self.control.status()
        if status.get("progress_page"):
            try:
                self._page = page = ProgressPage.open(str(status["progress_page"]))
                # the agent hears of this process's death from the kernel, before its memory is torn down
                log.debug("exit bell %s", "armed" if page.arm_bell() else "not armed (not the main thread, "
                          "another trainer in this process holds it, or no robust mutexes here)")
            except ConfigError as exc:
                log.warning("progress goes through the control socket: %s", exc)
        view = status.get("view")
        if not view:
            raise ConfigError("the agent has no view: start it with a job spec (`--job job.toml`)")
        me = next((m for m in view["members"] if m["node"] == self.node), None)
        if me is None:
            raise ConfigError(f"node {self.node} is not in view {view['epoch']}; check the job spec")
        self._refresh_addrs()
        my_host, my_port = _host_port(self._addrs[self.node])
        self._store_server, _ = start_store_server(self.bind_host, my_port + self.store_offset,
                                                   timeout=self.timeout)
        self._donor = DonorServer(self._serve, self.key, self.bind_host, my_port + self.donor_offset).start()
        self._newest_view = int(view["epoch"])
        self._events = threading.Thread(target=self._follow_events, name="gossiprec-events", daemon=True)
        self._events.start()
        self.role = str(me["role"])
        if view.get("stopped"):
            raise JobStopped(f"the job stopped in view {view['epoch']} ({view['stopped']})")
        if self.role == "trainer" and int(view["epoch"]) == 0:
            self.rank, self.world_size, self.epoch = int(me["rank"]), self._world_of(view), 0
            self._replica_groups = _groups_of(view.get("replica_groups"), self.world_size)
            self._job.world_size = self.world_size
            self._commit_snapshot(0)
            rank0 = next(m["node"] for m in view["members"] if m["role"] == "trainer" and m["rank"] == 0)
            self.groups = EpochGroups(self._store_for(rank0), backend=self.backend, timeout=self.timeout,
                                      poll_interval=self.poll_interval)
            try:
                self.groups.build(0, self.rank, self.world_size)
                self._expect_replicas("at the start", 0)
            except CollectiveAborted as exc:
                self._recover(f"epoch 0 group failed: {exc}")
        else:
            # No group yet: the plan of the current view is still to be applied by this process. A spare
            # whose trainer comes up after the view that promoted it (a slow start on a loaded machine)
            # must take that plan, not wait for a newer one while the survivors wait for it.
            self.epoch = int(view["epoch"]) - 1
            self.groups = EpochGroups(self._store_server, backend=self.backend, timeout=self.timeout,
                                      poll_interval=self.poll_interval)
            self._materialize_optimizers()
            # a hot spare maps the memory of its two future snapshots now: its first commits after
            # taking a rank then copy into warm buffers instead of page-faulting on the critical path
            self._pool = [capture_deferred(self.objects, step=0, checksum=False)[0] for _ in range(2)]
            self._report(0, "idle")
            self._recover("spare waiting for a rank", spare=True)
        return self

    def _materialize_optimizers(self) -> None:
        """A spare allocates its optimizers' state now (torch makes it at the first step), so that state
        arrives in memory already mapped; a receiver without it still gets it (see ReceiveTarget)."""
        import torch

        for name, obj in self.objects.items():
            if isinstance(obj, torch.optim.Optimizer):
                try:
                    materialize_optimizer_state(obj)
                except Exception as exc:  # the optimizer's own step: any error; the state then arrives anyway
                    log.debug("could not allocate the state of optimizer %r in advance: %s", name, exc)

    @staticmethod
    def _world_of(view: Mapping[str, Any]) -> int:
        return sum(1 for m in view["members"] if m["role"] == "trainer")

    def _refresh_addrs(self) -> None:
        self._addrs.update({m["name"]: m["addr"] for m in self.control.members()})

    def _store_for(self, node: str) -> Any:
        if node == self.node:
            return self._store_server
        if node not in self._addrs:
            self._refresh_addrs()
        host, port = _host_port(self._addrs[node])
        key = (host, port + self.store_offset)
        if key not in self._stores:
            self._stores[key] = connect_store(host, port + self.store_offset, timeout=self.timeout)
        return self._stores[key]

    # ------------------------------------------------------------------ the loop's calls
    def begin_step(self) -> int:
        """Start computing step ``self.step + 1`` (recovering first if the agent asked); returns it."""
        if self._trouble():
            self._recover("view change")
        self._step_t0 = time.monotonic()
        self._report(self.step + 1, "compute")
        self._copier.release()  # the last commit's small copies, on the thread, while this step computes
        self._hook(self.step + 1, "compute")
        return self.step + 1

    def allreduce_gradients(self, params: Iterable[torch.Tensor], *, exact: bool = False) -> bool:
        """Average the gradients of ``params`` over the group (one flat all-reduce).

        Returns False when the collective was interrupted: recovery has already run and the loop
        must start the step again (``continue``). A parameter without a gradient counts as zero.
        ``exact``: reduce in rank order (each rank's gradients travel in their own row of a
        ``world_size`` x n buffer, then rows are added 0, 1, 2, ...): the result no longer depends on
        the collective's algorithm, so it is reproducible bit for bit (see :func:`rank_ordered_mean`),
        at ``world_size`` times the bytes.
        """
        import torch

        plist = [p for p in params if p.requires_grad]
        self._report(self.step + 1, "communicate")
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in plist]
        flat = torch.cat([g.reshape(-1) for g in grads])  # a fresh buffer: an aborted one may be written later
        if exact:
            rows = flat.new_zeros((self.world_size, flat.numel()))
            rows[self.rank] = flat
            if not self.allreduce(rows, "sum"):
                return False
            flat = rank_ordered_mean(list(rows.unbind(0)))
        elif not self.allreduce(flat, "avg"):
            return False
        offset = 0
        for p, g in zip(plist, grads, strict=True):
            n = g.numel()
            chunk = flat[offset:offset + n].view_as(g)
            if p.grad is None:
                p.grad = chunk.clone()
            else:
                p.grad.copy_(chunk)
            offset += n
        self._settle_snapshot()  # the optimizer step comes next: the last commit's copies must be done
        if self.background_snapshot:
            self._update_late(plist)
        if (self._check is not None or self._verify_live is not None) and not self._run_checks():
            return False
        self._report(self.step + 1, "optimizer")
        self._hook(self.step + 1, "optimizer")
        return True

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> bool:
        """All-reduce ``tensor`` in place on the current group; False (after recovering) if interrupted."""
        return self._collective(tensor, op, hook=True)

    def _collective(self, tensor: torch.Tensor, op: str, hook: bool) -> bool:
        if self._trouble():
            self._recover("view change")
            return False
        assert self.groups is not None and self.groups.current is not None
        try:
            pending = self.groups.current.allreduce(tensor, op, async_op=True)
            assert pending is not None
            self._copier.run_held()  # copies the thread has not begun, while the collective is on the wire
            step = self.step + 1
            if hook:
                self._hook(step, "communicate")  # the collective is in flight
            on_slow = (lambda: self._report(step, WAITING)) if WAITING in PHASES else None
            pending.wait(slow_after=self.wait_report_after, on_slow=on_slow)
            return True
        except CollectiveAborted as exc:
            self._recover(f"{exc.reason}: {exc}")
            return False

    def commit(self) -> int:
        """Step ``self.step + 1`` is done (optimizer stepped): capture it; returns the new step.

        The step time reported to the agent (what hang detection scales with) is the period between
        two commits, so it includes data loading and anything else the loop does between steps.
        """
        step = self.step + 1
        verify = self.verify_replicas and (step == 1 or bool(self.verify_every) and step % self.verify_every == 0)
        self._commit_snapshot(step, verify=verify)
        now = time.monotonic()
        if self._last_commit_at is not None:
            self._step_ms = int((now - self._last_commit_at) * 1000)
        self._last_commit_at = now
        if self._record_open is not None:
            self._close_record()
        self._hook(step, "committed")
        return step

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Wrap long work between two steps, such as saving a checkpoint (on one rank or on all)::

            with rt.checkpointing():
                torch.save({k: o.state_dict() for k, o in rt.objects.items()}, path)

        The agents see this rank in phase ``checkpoint`` and judge it hung only after
        ``checkpoint_timeout`` (600 s by default, in the ``[protocol]`` table), not after the step-time
        threshold: without this, the ranks waiting for it in the next all-reduce would have it evicted
        as hung after max(1 s, 3 x step time). A view change during the save is handled at the next step.
        """
        self._report(self.step, "checkpoint")
        self._hook(self.step, "checkpoint")
        try:
            yield
        finally:
            self._report(self.step, "idle")

    def finish(self, barrier: bool = True, exit_code: int | None = None) -> None:
        """End of training: a last barrier (errors ignored), tell the agents the job is done (unused
        spares then leave: their :meth:`start` raises :class:`JobFinished`), stop following the agent.

        ``exit_code``: end the process with ``os._exit`` (no interpreter teardown): a retired group
        hung in the graveyard would block ~30 s in its destructor otherwise.
        """
        self._report(self.step, "idle")
        if barrier and self.groups is not None and self.groups.current is not None:
            try:
                self.groups.current.barrier(timeout=min(self.timeout, 10.0))
            except GossiprecError:
                pass
        if self.rank >= 0:
            try:
                self.control.finished(self.step)
            except ControlError as exc:
                log.warning("could not tell the agent that training finished: %s", exc)
        self.close()
        if exit_code is not None:
            os._exit(exit_code)

    def close(self) -> None:
        try:
            self._copier.wait(take=threading.get_ident() == self._owner)
        except RecoveryError:
            pass
        self._closed.set()
        if self._donor is not None:
            self._donor.close(timeout=0.5)
        page, self._page = self._page, None
        if page is not None:
            page.close()

    # ------------------------------------------------------------------ commit and serve
    def _commit_snapshot(self, step: int, verify: bool = False) -> None:
        """Capture the objects as step ``step``, into the older snapshot's buffers.

        The tensors in :attr:`_late` (parameters handed to :meth:`allreduce_gradients` and optimizer
        state: only ``optimizer.step()`` changes them) are copied by a background thread, which the next
        :meth:`allreduce_gradients` waits for before it returns, i.e. before the next optimizer step.
        Everything else (buffers a forward pass updates, RNG, data position) is copied here.
        ``verify``: copy everything here with checksums, and compare the state across replicas (and
        with the live tensors, see :attr:`_verify_live`) at the next all-reduce of gradients.
        """
        self._settle_snapshot()
        if len(self._snapshots) >= 2:
            reuse: StateSnapshot | None = self._snapshots[0]
        else:
            reuse = self._pool.pop() if self._pool else None
        snap, deferred = capture_deferred(self.objects, step=step, copy=True, checksum=verify, reuse=reuse,
                                          defer=() if verify else self._late)
        if verify:
            self._check = (f"after step {step}", digest_of_snapshot(snap))
            self._verify_live = snap if self.background_snapshot else None
        with self._lock:
            self._snapshots = [*self._snapshots[-1:], snap]
        if deferred.pairs:
            if deferred.ready or deferred.nbytes >= BACKGROUND_MIN_BYTES:
                self._copier.submit(deferred)
            else:
                self._copier.hold(deferred)  # to the thread at the next begin_step (see BACKGROUND_MIN_BYTES)
        self.step = step
        port = self._donor.port if self._donor else None
        page = self._page
        if page is not None:
            page.set_state(step, None, snap.header.total_nbytes, port)
            return
        try:
            self.control.set_state(step, None, snap.header.total_nbytes, port, wait=False)
        except ControlError as exc:
            self._agent_lost = str(exc)

    # ------------------------------------------------------------------ replica checks
    def _expect_replicas(self, when: str, step: int) -> None:
        """Compare the live state (as of now, at ``step``) across replica groups at the next all-reduce
        of gradients; the tensors only the optimizer step changes are hashed on a thread meanwhile."""
        self._verify_live = None
        if not self.verify_replicas:
            self._check = None
            return
        import torch

        params = [p for o in self.objects.values() if isinstance(o, torch.optim.Optimizer)
                  for g in o.param_groups for p in g["params"]]
        self._check = (when, PendingDigest(self.objects, step, late=self._late_tensors(params)))

    def _run_checks(self) -> bool:
        """Run the checks due at this all-reduce; False when a collective was interrupted (recovered)."""
        live, self._verify_live = self._verify_live, None
        if live is not None:
            self._check_live(live)
        check = self._check
        if check is None:
            return True
        when, digest = check
        result = digest.result() if isinstance(digest, PendingDigest) else digest
        rows = rows_tensor(result.summary(), self.rank, self.world_size)
        if not self._collective(rows, "sum", hook=False):
            return False
        differ = differing_groups(rows, self._replica_groups)
        if differ:
            layouts = [g for g in differ if len({tuple(rows[r, :2].tolist()) for r in g}) > 1]
            if layouts:
                raise ReplicaMismatch(
                    f"replicas hold differently shaped state at step {result.step} ({when}): ranks of "
                    f"replica group(s) {[list(g) for g in layouts]} hold {sorted({int(rows[r, 0]) for g in layouts for r in g})} "
                    "entries or differently named ones; every replica must register the same objects",
                    step=result.step, entries=(), ranks=tuple(r for g in layouts for r in g))
            full = rows_tensor(result.values, self.rank, self.world_size)
            if not self._collective(full, "sum", hook=False):
                return False
            raise describe(result, full, differ, when)
        self._check = None
        return True

    def _check_live(self, snap: StateSnapshot) -> None:
        """The parameters and optimizer state must still hold the bytes ``snap`` checksummed at commit."""
        import zlib

        from gossiprec.trainer.header import walk_objects

        _, found = walk_objects(self.objects)
        late = self._late
        changed = [spec.name for spec, (name, t) in zip(snap.header.tensors, found, strict=False)
                   if spec.name == name and t.data_ptr() in late and t.is_cpu and t.is_contiguous()
                   and zlib.crc32(tensor_bytes(t)) != spec.crc32]
        if changed:
            self._late = frozenset()
            self.background_snapshot = False
            raise RecoveryError(
                f"{len(changed)} tensor(s) changed between commit() of step {snap.step} and the next "
                f"allreduce_gradients() without torch seeing it ({', '.join(changed[:3])}): a write through "
                ".data or another alias of the memory. With background_snapshot=True only the optimizer "
                "step may change parameters and optimizer state; move such writes after "
                "allreduce_gradients() or pass TrainerConfig(background_snapshot=False) to ResilientTrainer")

    def _snapshot_at(self, step: int) -> StateSnapshot | None:
        self._settle_snapshot(main=threading.get_ident() == self._owner)
        with self._lock:
            return next((s for s in self._snapshots if s.step == step), None)

    def _settle_snapshot(self, main: bool = True) -> None:
        """Wait for the last commit's background copies; refuse a snapshot whose sources changed."""
        done = self._copier.wait(take=main)
        if done is None or not main:
            return
        changed = done.modified()
        if changed:
            with self._lock:
                self._snapshots = self._snapshots[:-1]  # torn: holds parts of two steps
            self._late = frozenset()
            self.background_snapshot = False
            raise RecoveryError(
                f"{len(changed)} tensor(s) of the step-{self.step} snapshot were modified in place before "
                f"the optimizer step ({', '.join(changed[:3])}): with background_snapshot=True only the "
                "optimizer step, after allreduce_gradients(), may change parameters and optimizer state; "
                "pass TrainerConfig(background_snapshot=False) to ResilientTrainer")

    def _update_late(self, params: list[torch.Tensor]) -> None:
        """Set :attr:`_late` for ``params``; on the training step's path, so it is rebuilt only when a
        cheap key moves (other parameters, optimizer state created or reloaded) or a recovery cleared it."""
        if self._optimizers is None:
            import torch

            self._optimizers = [o for o in self.objects.values() if isinstance(o, torch.optim.Optimizer)]
        key = (len(params), id(params[0]) if params else 0, id(params[-1]) if params else 0,
               tuple((id(o.state), len(o.state)) for o in self._optimizers))
        if not self._late or key != self._late_for:
            self._late, self._late_for = self._late_tensors(params), key

    def _late_tensors(self, params: list[torch.Tensor]) -> frozenset[int]:
        """``data_ptr()`` of ``params`` and of every optimizer state tensor among the objects."""
        import torch

        ptrs = {p.data_ptr() for p in params}
        for obj in self.objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                for st in obj.state.values():
                    ptrs.update(v.data_ptr() for v in st.values()
                                if isinstance(v, torch.Tensor) and (v.is_cpu or v.is_cuda))
        return frozenset(ptrs)

    def _serve(self, epoch: int, step: int) -> StateSnapshot | None:
        self._hook(step, "serve")
        return self._snapshot_at(step)

    def _hook(self, step: int, phase: str) -> None:
        if self.on_phase is not None:
            self.on_phase(step, phase)

    def _report(self, step: int, phase: str) -> None:
        page = self._page
        if page is not None:
            page.report(step, _PHASE_INDEX[phase], self._step_ms)
            return
        try:
            self.control.report(step, phase, self._step_ms, wait=False)
        except ControlError as exc:
            self._agent_lost = str(exc)

    # ------------------------------------------------------------------ agent events
    def _follow_events(self) -> None:
        try:
            client = ControlClient(self._control_path, timeout=CONTROL_TIMEOUT)
            client.subscribe()
        except ControlError as exc:
            self._set_lost(f"cannot follow the agent's events: {exc}")
            return
        with client:
            while not self._closed.is_set():
                try:
                    ev = client.next_event(timeout=0.2)
                except ControlError as exc:
                    if not self._closed.is_set():
                        self._set_lost(f"agent connection lost: {exc}")
                    return
                if ev is not None:
                    self._on_event(ev)

    def _set_lost(self, why: str) -> None:
        with self._lock:
            self._agent_lost = why
            self._lock.notify_all()
        if self.groups is not None:
            self.groups.abort(reason=why)

    def _on_event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        now = time.monotonic()
        if kind in FAILURE_EVENTS:
            at = float(ev["at"]) if isinstance(ev.get("at"), (int, float)) else now
            with self._lock:
                self._failure_events = [*self._failure_events[-63:], at]
            return
        if kind == "ViewInstalled":
            epoch = int(ev["epoch"])
            with self._lock:
                if epoch > self._newest_view:
                    self._newest_view = epoch
                    self._last_view_at = float(ev.get("at", now))
                if ev.get("stopped"):
                    self._stopped = str(ev["stopped"])
                self._lock.notify_all()
            self._abort_older_than(epoch, f"view {epoch} installed")
        elif kind == "PlanReady":
            plan = ev.get("plan")
            if isinstance(plan, dict):
                with self._lock:
                    plan = dict(plan, planned_at=float(ev.get("at", now)))
                    self._plans[int(plan["epoch"])] = plan
                    self._newest_view = max(self._newest_view, int(plan["epoch"]))
                    self._lock.notify_all()
                self._prepare_donation(plan)
        elif kind == "JobFinished":
            with self._lock:
                self._finished = int(ev.get("step", -1))
                self._lock.notify_all()
        elif kind == "Fenced":
            with self._lock:
                self._fenced = str(ev.get("reason", "fenced"))
                self._lock.notify_all()
            if self.groups is not None:
                self.groups.abort(reason=f"fenced: {self._fenced}")

    def _prepare_donation(self, plan: dict[str, Any]) -> None:
        """When ``plan`` names this rank a donor, tag its stripes in the background right away: the
        GMAC pass (~20 ms per 100 MB here) then overlaps the receivers' connecting, not their transfer."""
        donor = self._donor
        ranges = [(int(t["offset"]), int(t["offset"]) + int(t["length"])) for t in plan.get("transfers") or ()
                  if t.get("donor_node") == self.node]
        if donor is None or not ranges or plan.get("action") not in ("resume", "shrink"):
            return
        target = int(plan["target_step"])

        def seal() -> None:
            try:
                self._copier.wait(take=False)  # the snapshot may still be being copied
                with self._lock:
                    snap = next((s for s in self._snapshots if s.step == target), None)
                if snap is not None:
                    donor.prepare(snap, ranges)
            except GossiprecError as exc:
                log.debug("preparing the donation of step %d failed: %s", target, exc)

        threading.Thread(target=seal, name="gossiprec-prepare", daemon=True).start()

    def _abort_older_than(self, epoch: int, reason: str) -> None:
        """Abort the current group and a group being built, when they belong to an epoch < ``epoch``."""
        if self.groups is None:
            return
        for e in {self.epoch, self._building_epoch}:
            if e is not None and e < epoch:
                self.groups.abort(epoch=e, reason=reason)

    def _superseded(self, epoch: int) -> str:
        """Why the group of ``epoch`` must not be built any more ("" if it may)."""
        if self._newest_view > epoch:
            return f"view {self._newest_view} supersedes the plan of epoch {epoch}"
        return self._fenced or self._agent_lost

    def _trouble(self) -> bool:
        return self._newest_view > self.epoch or bool(self._fenced) or bool(self._agent_lost)

    # ------------------------------------------------------------------ recovery
    def _wait_plan(self, spare: bool) -> dict[str, Any]:
        """The plan of the newest epoch this rank knows of (waits; polls status as a fallback)."""
        next_poll = time.monotonic()
        while True:
            with self._lock:
                if self._agent_lost:
                    raise RecoveryError(f"lost the local agent ({self._agent_lost}); this trainer stops")
                if self._fenced:
                    raise FencedError(f"this node was fenced ({self._fenced}): it is on the minority side "
                                      "or was removed; the trainer must stop")
                if self._finished is not None:
                    raise JobFinished(f"the job finished at step {self._finished}; this {self.role} is no "
                                      "longer needed")
                if self._stopped:
                    raise JobStopped(f"the agreed view stops the job ({self._stopped}); restart it from your "
                                     "checkpoint with more spares, or set allow_shrink = true in the job spec")
                newest = max(self._plans, default=-1)
                if newest > self.epoch and newest >= self._newest_view:
                    return self._plans[newest]
                self._lock.wait(0.05 if not spare else 0.2)
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + (0.1 if not spare else 0.5)
                try:
                    st = self.control.status()
                except ControlError as exc:
                    self._set_lost(str(exc))
                    continue
                plan = st.get("plan")
                view = st.get("view") or {}
                with self._lock:
                    self._newest_view = max(self._newest_view, int(view.get("epoch", -1)))
                    if view.get("stopped") and int(view.get("epoch", -1)) > self.epoch:
                        self._stopped = str(view["stopped"])
                    if plan and int(plan["epoch"]) not in self._plans:
                        assignment = plan.get("assignment", {})
                        plan = dict(plan, assignment=[[int(r), n] for r, n in assignment.items()],
                                    planned_at=time.monotonic())
                        self._plans[int(plan["epoch"])] = plan

    def _recover(self, cause: str, spare: bool = False) -> None:
        """Wait for the plan, move state, rebuild the group; loops until one plan succeeds."""
        pending = self._pending or self._record_open or _Pending(cause, time.monotonic())
        if pending is self._record_open:  # the last recovery's first step never completed: still that one
            pending.attempts.append((self.epoch, self.step, f"superseded before its first step ({cause})"))
            self._record_open = None
        self._pending = pending
        self._settle_snapshot()  # before anything (a fetch, a checkpoint load) writes into the live tensors
        # parameters and optimizer state only the optimizer step changes: a reload may skip those whose
        # version counter did not move since the snapshot (fetches and reloads bump what they write)
        self._unchanged = self._late
        self._late = frozenset()  # fetches and reloads may move tensors: the next commit copies all
        self._last_commit_at = None  # a recovery is not a step: keep it out of the step time
        self._report(self.step, "recovering")
        while True:
            plan = self._wait_plan(spare)
            with self._lock:
                seen = [t for t in self._failure_events if t > self._last_recovered_at]
                pending.detected_at = min(seen) if seen else None
                pending.agreed_at = self._last_view_at
            try:
                if self._apply_plan(plan, pending):
                    return
            except (FencedError, Released, JobStopped, JobFinished):
                raise
            except LayoutMismatch as exc:
                # no later plan can fix this process's objects: leave, so that the agents replace it
                raise LayoutMismatch(f"this process cannot take part in the recovery of epoch {plan['epoch']}: "
                                     f"{exc}; it exits so that the others go on with another spare") from exc
            except (CollectiveAborted, GossiprecError, OSError) as exc:
                # Snapshots are copies, so a failed fetch spoils only the live tensors: whatever this
                # rank committed can still be reloaded or served under the next plan.
                log.warning("recovery with the plan of epoch %s failed (%s); waiting for the next plan",
                            plan["epoch"], exc)
                pending.attempts.append((int(plan["epoch"]), int(pending.fields.get("target_step", -1)),
                                         f"{type(exc).__name__}: {exc}"[:300]))
                self.epoch = max(self.epoch, int(plan["epoch"]))
                continue

    def _apply_plan(self, plan: dict[str, Any], pending: _Pending) -> bool:
        epoch = int(plan["epoch"])
        action = str(plan["action"])
        if action == "stop":
            raise JobStopped(f"the plan of epoch {epoch} stops the job ({plan.get('reason')}); restart it "
                             "from your checkpoint with more spares, or set allow_shrink = true in the job spec")
        assignment = {int(r): str(n) for r, n in plan["assignment"]}
        my_rank = next((r for r, n in assignment.items() if n == self.node), None)
        world = int(plan["world_size"])
        transfers = plan.get("transfers") or []
        if my_rank is None:
            if any(t["donor_node"] == self.node for t in transfers):
                self._closed.wait(self.linger)  # released: serve the receivers for a while
            self.epoch = epoch
            if self.role == "spare":
                self._last_recovered_at = time.monotonic()  # failures so far were handled without us
                return False  # still a spare: wait for a later plan
            raise Released(f"this rank was released by the plan of epoch {epoch} ({plan.get('reason')}); "
                           "leave the job (exit 0): the others go on without it")
        if action == "checkpoint" and self.on_no_replica is None:
            raise JobStopped(f"the plan of epoch {epoch} finds no surviving replica of some state "
                             f"({plan.get('reason')}); pass on_no_replica= to ResilientTrainer to load your "
                             "checkpoint in place, or restart the job from it")
        pending.fields.update(rank=my_rank, world_size=world, action=action, previous_role=self.role,
                              planned_at=float(plan.get("planned_at", time.monotonic())))
        mine = sorted((t for t in transfers if t["receiver_node"] == self.node), key=lambda t: int(t["offset"]))
        nbytes, xfer_s = 0, 0.0
        if action == "checkpoint":
            assert self.on_no_replica is not None
            before = self.step
            self._job.world_size = 0  # unknown unless the checkpoint holds the trainer's own entry
            orphans = tuple(tuple(int(r) for r in g) for g in plan.get("orphan_groups") or ())
            target = int(self.on_no_replica(NoReplica(epoch, my_rank, world, orphans, str(plan.get("reason")))))
            if not self._job.world_size:
                self._job.world_size = world  # the checkpoint did not say: no resize
            pending.fields.update(role="checkpoint", target_step=target,
                                  lost_steps=max(0, before - target) if self.role == "trainer" else 0)
            with self._lock:
                self._pool, self._snapshots = self._snapshots, []  # the job's state is the checkpoint's now
            self._commit_snapshot(target)
        else:
            target = int(plan["target_step"])
            pending.fields.update(target_step=target,
                                  lost_steps=max(0, self.step - target) if self.role == "trainer" else 0)
            self._report(target, "recovering")
            if mine:
                pending.fields["role"] = "receiver"
                stats = self._fetch(mine, target, epoch)
                nbytes, xfer_s = stats.nbytes, stats.seconds
                self._commit_snapshot(target)  # complete and authenticated: this rank can donate it now
            else:
                snap = self._snapshot_at(target)
                if snap is None:
                    raise RecoveryError(f"the plan of epoch {epoch} resumes at step {target} from this rank, "
                                        f"but it holds steps {[s.step for s in self._snapshots]}")
                copied = restore_state(self.objects, snap, unchanged=self._unchanged)
                log.debug("reloaded step %d: %d of %d bytes copied", target, copied, snap.header.total_nbytes)
                donor = any(t["donor_node"] == self.node for t in transfers)
                pending.fields["role"] = "donor" if donor else "survivor"
        pending.fields.update(state_at=time.monotonic(), bytes_received=nbytes, transfer_s=xfer_s)
        assert self.groups is not None
        self._building_epoch = epoch
        try:
            group = self.groups.build(epoch, my_rank, world, store=self._store_for(str(plan["store_node"])),
                                      cancelled=lambda: self._superseded(epoch))
        finally:
            self._building_epoch = None
        if action == "checkpoint":
            self._check_same_step(group, target)
        # A new (step, phase) restarts the agents' stall clock for this rank: every rank sat at
        # (target, recovering) during the recovery, and the first to start the next step would
        # otherwise make the others look hung at once (their value unchanged for the whole recovery).
        self._report(target, "idle")
        pending.fields["group_at"] = time.monotonic()
        self.epoch, self.rank, self.world_size, self.role = epoch, my_rank, world, "trainer"
        self.step = target
        if not mine and action != "checkpoint":
            try:
                snap = self._snapshot_at(target)
                self.control.set_state(target, None, snap.header.total_nbytes if snap else 0, None, wait=False)
            except ControlError:
                pass
        old_world = self._job.world_size
        pending.fields["previous_world_size"] = old_world
        if old_world and old_world != world and self.on_resize is not None:
            self.on_resize(old_world, world)
        self._job.world_size = world
        self._replica_groups = _groups_of(plan.get("replica_groups"), world)
        self._expect_replicas(f"after the recovery into epoch {epoch}", target)
        self._record_open, self._pending = pending, None
        self._last_recovered_at = time.monotonic()
        log.info("recovered into epoch %d as rank %d/%d at step %d (%s, %s)", epoch, my_rank, world, target,
                 action, pending.fields["role"])
        return True

    def _fetch(self, mine: list[dict[str, Any]], target: int, epoch: int) -> Any:
        """Fetch the state at ``target`` from this rank's donors, striped as the plan says."""
        self._refresh_addrs()
        donors = []
        for t in mine:
            host, port = _host_port(self._addrs[t["donor_node"]])
            donors.append((host, port + self.donor_offset))
        stripes = [(int(t["offset"]), int(t["offset"]) + int(t["length"])) for t in mine]
        target_objects = ReceiveTarget(self.objects)
        kwargs: dict[str, Any] = {"step": target, "epoch": epoch, "timeout": max(self.timeout, 60.0),
                                  "stall_timeout": min(self.timeout, 5.0)}
        if self.on_phase is not None:
            kwargs["on_progress"] = lambda _donor, _got: self._hook(target, "fetch")
        try:
            return fetch_state(donors, self.key, target_objects, stripes=stripes, **kwargs)
        except TransferError as exc:
            if len(donors) == 1 or isinstance(exc, LayoutMismatch):
                raise
            # donors disagree (replicas not identical) or one failed: try each alone; a dead donor
            # also makes the agents agree on a new view, whose plan supersedes this one
            log.warning("striped fetch failed (%s); fetching from one donor", exc)
            return self._fetch_from_any(donors, target_objects, kwargs, exc)

    def _check_same_step(self, group: Any, step: int) -> None:
        """After a checkpoint load: every rank must have restored the same step (one all-reduce)."""
        import torch

        t = torch.tensor([step, -step], dtype=torch.int64)
        group.allreduce(t, "max")
        lo, hi = -int(t[1]), int(t[0])
        if lo != hi:
            raise JobStopped(f"the ranks restored different checkpoint steps ({lo} to {hi}): on_no_replica "
                             "must load the same checkpoint on every rank (shared storage)")

    def _fetch_from_any(self, donors: list[tuple[str, int]], target: ReceiveTarget, kwargs: dict[str, Any],
                        first: TransferError) -> Any:
        last: TransferError = first
        for donor in dict.fromkeys(donors):
            if self._newest_view > int(kwargs["epoch"]):
                break  # a newer view: its plan decides
            try:
                return fetch_state([donor], self.key, target, **kwargs)
            except TransferError as exc:
                last = exc
        raise last

    def _close_record(self) -> None:
        p = self._record_open
        assert p is not None
        self._record_open = None
        f = p.fields
        rec = RecoveryRecord(epoch=self.epoch, cause=p.cause, role=f["role"], rank=f["rank"],
                             world_size=f["world_size"], target_step=f["target_step"], lost_steps=f["lost_steps"],
                             noticed_at=p.noticed_at, detected_at=p.detected_at, agreed_at=p.agreed_at,
                             planned_at=f["planned_at"], group_at=f["group_at"], state_at=f["state_at"],
                             first_step_at=time.monotonic(), bytes_received=f["bytes_received"],
                             transfer_s=f["transfer_s"], action=f.get("action", "resume"),
                             previous_world_size=f.get("previous_world_size", 0),
                             previous_role=f.get("previous_role", "trainer"), superseded=tuple(p.attempts))
        self.records.append(rec)
        if self.on_recovered is not None:
            self.on_recovered(rec)
