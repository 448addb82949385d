"""A sharded job's gate before each optimizer step: what keeps a step every shard holds servable.

A failure inside a sharded step can leave one replica group a commit ahead of another: rank 3 of a
dp x tp job dies after its tensor-parallel all-reduce of backward, before its data-parallel one; ranks
0 and 2 (the other shard) finish their all-reduce and step their optimizer, rank 1 cannot. Shard tp1
then exists only at ``s - 1``, so the job resumes at ``s - 1``, and ranks 0 and 2 must still hold it.
How, depends on the snapshot copies (:mod:`gossiprec.trainer.state.snapshots`):

- **one copy** (``hold_live``): each commit holds its step as the live tensors beside the copy of the
  one before. The *commit barrier*, a one-element all-reduce over every rank issued at the start of the
  next step, is waited here; once it completes every rank has committed the live step, which is
  copied over the older one (:meth:`Snapshots.harden`) before the optimizer moves the tensors.
- **no copy** (snapshot-free): a commit is the live tensors until the next optimizer step. No rank may
  step its optimizer before every rank is ready to: the *ready barrier*, the same all-reduce issued and
  waited here, when all of this rank's collectives of the step are done. Past it, every rank of the job
  has its complete gradients. So when a failure interrupts it, this rank still holds ``s - 1`` (live,
  unchanged) and can make ``s`` by itself (run its optimizer step on its complete gradients): it
  reports both, and waits for the plan. Either some rank was not ready (still in an earlier
  collective: it holds only ``s - 1``, so no rank passed the barrier and the plan resumes at ``s - 1``)
  or every survivor reached the barrier or passed it (a rank past it commits ``s``; its agent holds the
  report until then): the plan resumes at ``s`` wherever every replica group can make it, and this rank
  *rolls forward*: its optimizer step runs, the step's code goes on and commits ``s``, and the
  recovery follows at the next step. A donor asked for ``s`` meanwhile waits for that commit
  (:meth:`OptimizerGate.wait_rolled`).

The rest of a rolled-forward step runs with the epoch's groups aborted: a collective there (logging a
loss, say) raises, and the step is committed anyway once every optimizer has stepped; if the step
raised between two optimizers' steps this rank's state is torn and it leaves (RecoveryError), so that
the agents replace it. The ready barrier is not hidden behind compute: about one all-reduce of latency
per step (the price of keeping no copy).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from gossiprec.errors import RecoveryError

if TYPE_CHECKING:
    from gossiprec.trainer.collectives.sharded import ShardedWorld
    from gossiprec.trainer.follower import Follower
    from gossiprec.trainer.state.snapshots import Snapshots

log = logging.getLogger(__name__)


class GatedRank(Protocol):
    """What the gate reads of its rank, as each recovery leaves it."""

    @property
    def sharded(self) -> ShardedWorld | None: ...
    @property
    def role(self) -> str: ...
    @property
    def node(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def step(self) -> int: ...


class OptimizerGate:
    """The optimizer gate of ``rank``; see the module docstring. ``snapshots``: the rank's committed
    snapshots; ``follower``: what its agent said; ``announce(step, nbytes, inflight)`` and
    ``report(step, phase)`` tell the agent; ``interrupted(exc)``: whether ``exc`` comes from an interrupted
    collective of this epoch; ``poll(epoch)`` asks the agent's status; ``recovery_timeout``: how long a
    roll-forward waits for the plan."""

    def __init__(self, rank: GatedRank, *, snapshots: Snapshots, follower: Follower,
                 announce: Callable[[int, int, int | None], None], report: Callable[[int, str], None],
                 interrupted: Callable[[BaseException], bool], poll: Callable[[int], object],
                 recovery_timeout: float) -> None:
        self._me = rank
        self._snaps = snapshots
        self._follower = follower
        self._announce = announce
        self._report = report
        self._interrupted = interrupted
        self._poll = poll
        self._recovery_timeout = recovery_timeout
        self._passed: tuple[int, int] = (-1, -1)
        """(epoch, step) whose ready barrier this rank passed or decided on (once per step, whatever the
        number of optimizers)."""
        self._cond = threading.Condition()
        self._rolling: int | None = None
        """The step this rank rolls forward to, until it commits it (or gives up)."""
        self._stepped = 0
        """Optimizer steps run in the step rolled forward."""
        self.optimizers = 0
        """The optimizers whose steps the gate hooks (set as the objects are built)."""

    def hook(self, objects: Mapping[str, Any]) -> None:
        """Put the gate before (and count after) every optimizer step among ``objects``, the objects built
        now (a shrink's new objects replace the old ones, whose optimizers never step again)."""
        hooked = [o for o in objects.values() if hasattr(o, "register_step_pre_hook")]
        for opt in hooked:
            opt.register_step_pre_hook(lambda *_: self.before_optimizer())
            opt.register_step_post_hook(lambda *_: self.after_optimizer())
        self.optimizers = len(hooked)

    def begin_step(self) -> None:
        """A step begins: with one copy, issue its commit barrier (every rank, every step; waited by
        :meth:`before_optimizer`). Raises as any collective of an aborted epoch does."""
        sharded = self._me.sharded
        if sharded is not None and self._snaps.hold_live:
            sharded.issue_barrier()

    def before_optimizer(self) -> None:
        """Every optimizer's step pre-hook (and the end of a step that ran none)."""
        me = self._me
        sharded = me.sharded
        if sharded is None or me.role != "trainer":  # (a spare's optimizer step at lr 0 makes its state)
            return
        snaps = self._snaps
        if snaps.copies:
            if sharded.settle_barrier() and (hard := snaps.harden()) is not None:
                self._announce(hard, snaps.held[-1].header.total_nbytes, None)
            return
        step = me.step + 1
        if self._passed == (me.epoch, step):
            return
        self._passed = (me.epoch, step)
        try:
            sharded.issue_barrier()
            sharded.settle_barrier()
        except Exception as exc:
            if not self._interrupted(exc) or not self._roll_forward(step):
                raise
            return
        self._report(step, "optimizer")  # past it: this rank commits the step (its agent holds the report)

    def _roll_forward(self, step: int) -> bool:
        """The ready barrier of ``step`` was interrupted: offer ``step`` too, and whether the plan resumes
        there with this rank keeping its place (then its optimizer step runs)."""
        me = self._me
        held = self._snaps.held
        if not held or held[-1].step != step - 1 or not held[-1].valid():
            return False
        nbytes = held[-1].header.total_nbytes
        self._announce(step - 1, nbytes, step)  # before the phase: the agent reports both at once
        self._report(step, "recovering")
        epoch = me.epoch
        plan = self._follower.plan_after(epoch, time.monotonic() + self._recovery_timeout,
                                         poll=lambda: self._poll(epoch))
        keeps = (plan is not None and plan.action == "resume" and plan.target_step == step
                 and plan.rank_of(me.node) == me.rank and not any(x.receiver_node == me.node for x in plan.transfers))
        if not keeps:
            self._announce(step - 1, nbytes, None)
            return False
        assert plan is not None
        log.info("the plan of epoch %d resumes at step %d, whose gradients this rank holds: it steps its "
                 "optimizer and commits the step before it recovers", plan.epoch, step)
        with self._cond:
            self._rolling, self._stepped = step, 0
        self._report(step, "optimizer")
        return True

    def after_optimizer(self) -> None:
        """Every optimizer's step post-hook."""
        if self._rolling is not None:
            self._stepped += 1

    def rolled(self, step: int) -> bool:
        """The step raised after the ready barrier of ``step`` was rolled forward: whether the optimizers
        all stepped (commit it, the plan counts on it); RecoveryError if only some did."""
        if self._rolling != step:
            return False
        if self._stepped < self.optimizers:
            self.abandon()
            raise RecoveryError(
                f"step {step} was rolled forward after a failure, but it raised after {self._stepped} of "
                f"{self.optimizers} optimizer steps: this rank's state mixes two steps; it leaves so that the "
                "agents give its rank to a spare (with snapshot_copies=0 run no collective between optimizer steps)")
        return True

    def committed(self, step: int) -> None:
        if self._rolling is None:  # (every commit calls this: no lock unless a roll-forward is on)
            return
        with self._cond:
            if self._rolling is not None and self._rolling <= step:
                self._rolling = None
                self._cond.notify_all()

    def abandon(self) -> None:
        with self._cond:
            self._rolling = None
            self._cond.notify_all()

    def wait_rolled(self, step: int, timeout: float) -> None:
        """A donor thread asked for ``step``: if this rank is rolling forward to it, wait for its commit."""
        with self._cond:
            self._cond.wait_for(lambda: self._rolling != step, timeout)
