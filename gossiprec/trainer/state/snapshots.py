"""Commit handling: the snapshots of the registered objects kept for recovery, and when copies are made.

Step ``s`` is committed on a rank when its optimizer step has finished and ``commit()`` has captured
the objects into a snapshot (a copy, into a reused buffer). The bulk of that copy, the parameters
handed to ``allreduce_gradients`` and the optimizer's state (the *late* tensors), is made by the
:class:`~gossiprec.trainer.state.copier.Copier` while step ``s + 1`` computes: only the optimizer step
changes those tensors, and the next all-reduce of gradients waits for the copy (:meth:`Snapshots.settle`)
before it returns. Each source's in-place version counter is checked then, so a loop that changes
parameters between ``commit()`` and ``allreduce_gradients()`` gets a clear error instead of a torn
snapshot. Everything else (buffers a forward pass updates, RNG, data position) is copied inside
``commit()``. Tensors on a GPU go to pinned host buffers on a side stream that waits for the optimizer
step's kernels (:class:`~gossiprec.trainer.state.capture.DeferredCopies`).

How many host copies are kept (``copies``, :attr:`TrainerConfig.snapshot_copies
<gossiprec.trainer.config.TrainerConfig.snapshot_copies>`):

* **2** (double): the last two snapshots, because the agent's state report of a new view can lag one
  commit behind the trainer, or a second plan may name a step the first one rolled back; a donor serves
  whichever step the plan names. 2x the state in host memory.
* **1** (single, the default): one snapshot, overwritten in place by each commit. While its late copies run (step
  ``s + 1``'s compute), it is marked incomplete; a donor or a reload asking for step ``s`` waits for the
  copies (:meth:`at` settles first), so the last committed step is always servable, and step ``s - 1``
  is gone. A commit made while a newer view is already known (:meth:`commit` with ``keep_previous``) does
  not overwrite the snapshot: it holds step ``s`` as a view of the live tensors (no optimizer step runs
  before the recovery), so both ``s - 1`` (copy) and ``s`` (live) stay servable for the plan, and the
  trainer reports both (committed ``s - 1``, in flight ``s``). A reload of ``s - 1`` overwrites the live
  ``s``, and the agent is told at once (:attr:`Snapshots.on_restored`). 1x.
* **1 in a sharded job** (``hold_live``): each commit holds its step ``s`` as a view of the live tensors
  beside the copy of ``s - 1`` (both servable: a failure inside a step can leave one replica group a
  commit behind another, and the job then resumes at the older step). At the start of step ``s + 1``,
  once every rank has committed ``s`` (the trainer's commit barrier, waited before the step's optimizer
  step), :meth:`harden` copies ``s`` over ``s - 1``, before the optimizer changes the tensors. 1x.
* **0** (snapshot-free): no copy of parameters and optimizer state; a commit's snapshot *is* the live
  tensors (:attr:`~gossiprec.trainer.state.capture.StateSnapshot.live`), valid until the next optimizer step
  modifies them. Only the small rest (buffers, RNG, data position) is copied, so a step interrupted
  before its optimizer step is undone exactly; a step whose optimizer step ran must be rolled forward
  (every survivor commits it, which the agents' report hold waits for). In a sharded job no rank steps
  its optimizer before every rank is ready to (:mod:`gossiprec.trainer.gate`).

Donor threads read the snapshots too, so the list is guarded by a lock, and only the owner thread (the
training loop's) takes finished copies and checks them.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

from gossiprec.errors import ConfigError, RecoveryError
from gossiprec.trainer.state.capture import StateSnapshot, capture_deferred
from gossiprec.trainer.state.copier import Copier
from gossiprec.trainer.state.receive import restore_state

if TYPE_CHECKING:
    import torch

    from gossiprec.trainer.objects import Stateful

BACKGROUND_MIN_BYTES = 8 * 1024 * 1024
"""Host-to-host late copies below this size are *held* by a commit and handed to the copier's thread by
the next ``begin_step``: waking the thread costs more than such a copy, and from ``begin_step`` that cost
falls in the step's compute instead of between two steps. Larger copies, and copies from a GPU, go to
the thread at once."""


class Snapshots:
    """The committed snapshots of ``objects`` and the background copies of the last one.

    ``background``: defer the late tensors' copies (see the module docstring); it turns itself off
    after a torn snapshot or a write torch did not see, so that the loop's next commits copy everything.
    """

    def __init__(self, objects: Mapping[str, Stateful], *, background: bool, copies: int = 2) -> None:
        if copies not in (0, 1, 2):
            raise ConfigError(f"snapshot copies must be 0, 1 or 2, got {copies!r}")
        self.objects = objects
        self.copies = copies
        self.background = background and copies > 0
        self.copier = Copier()
        self.hold_live = False
        """One copy, a sharded job: every commit holds its step live beside the previous copy, until
        :meth:`harden` (see the module docstring)."""
        self.late: frozenset[int] = frozenset()
        """``data_ptr()`` of the tensors only the optimizer step changes (see :meth:`update_late`)."""
        self.unchanged: frozenset[int] = frozenset()
        """The late tensors as of the last recovery's start: a reload may skip those whose version
        counter did not move since the snapshot (fetches and reloads bump what they write)."""
        self._late_for: tuple[Any, ...] = ()
        """The key :attr:`late` was computed for (see :meth:`update_late`)."""
        self._optimizers: list[Any] | None = None
        self._held: list[StateSnapshot] = []
        self._pool: list[StateSnapshot] = []
        """Snapshot buffers nothing refers to (a spare's, allocated while it waits): reused by commits."""
        self._lock = threading.Lock()
        self._owner = threading.get_ident()
        """The thread that runs the loop (the only one that checks and takes finished copies)."""
        self._served: tuple[StateSnapshot, StateSnapshot] | None = None
        """A live snapshot and what donors serve of it (its device tensors staged in host memory)."""
        self.on_restored: Callable[[int, int], None] | None = None
        """Called with (step, bytes) after a restore that overwrote a live snapshot of another step, so
        that the agent no longer reports that step as held."""
        self._job_step = 0
        """The step of the snapshot the last deferred copies belong to."""

    @property
    def held(self) -> tuple[StateSnapshot, ...]:
        """The committed snapshots, oldest first (at most two)."""
        with self._lock:
            return tuple(self._held)

    def host_bytes(self) -> int:
        """Host memory kept for recovery: the snapshots' own buffers and the warm pool, in bytes."""
        with self._lock:
            return sum(s.host_bytes() for s in [*self._held, *self._pool])

    def commit(self, step: int, *, checksum: bool = False, keep_previous: bool = False) -> StateSnapshot:
        """Capture the objects as step ``step``, into the older snapshot's buffers (see the module
        docstring for each number of copies).

        The late tensors are left to the copier (held or submitted, see :data:`BACKGROUND_MIN_BYTES`),
        unless ``checksum``: then everything is copied here, with checksums. ``keep_previous``: a newer
        view is known, so the recovery comes before any optimizer step: with one copy, keep it and hold
        this step as a view of the live tensors.
        """
        self.settle()
        if self.copies == 0 or (self.copies == 1 and (keep_previous or self.hold_live) and self._held
                                and not self._held[-1].live):
            snap, _ = capture_deferred(self.objects, step=step, copy=True, checksum=checksum, view=self._live_set())
            with self._lock:
                self._held = [snap] if self.copies == 0 else [self._held[-1], snap]
                self._served = None
            return snap
        with self._lock:
            copied = [s for s in self._held if not s.live]
        if len(copied) >= self.copies:
            reuse: StateSnapshot | None = copied[0]
        else:
            reuse = self._pool.pop() if self._pool else None
        snap, deferred = capture_deferred(self.objects, step=step, copy=True, checksum=checksum, reuse=reuse,
                                          defer=() if checksum else self.late)
        with self._lock:
            self._held = [*copied[-1:], snap] if self.copies == 2 else [snap]
            self._served = None
        if deferred.pairs:
            self._job_step = step
            if deferred.ready or deferred.nbytes >= BACKGROUND_MIN_BYTES:
                self.copier.submit(deferred)
            else:
                self.copier.hold(deferred)  # to the thread at the next begin_step (see BACKGROUND_MIN_BYTES)
        return snap

    def settle(self, main: bool = True) -> None:
        """Wait for the last commit's background copies; refuse a snapshot whose sources changed.

        ``main``: the owner thread, which takes the finished copies and checks them."""
        done = self.copier.wait(take=main)
        if done is None or not main:
            return
        changed = done.modified()
        if changed:
            with self._lock:
                self._held = self._held[:-1]  # torn: holds parts of two steps (with one copy: nothing left)
            self.disable_background()
            raise RecoveryError(
                f"{len(changed)} tensor(s) of the step-{self._job_step} snapshot were modified in place before "
                f"the optimizer step ({', '.join(changed[:3])}): with background_snapshot=True only the "
                "optimizer step, after allreduce_gradients(), may change parameters and optimizer state; "
                "pass TrainerConfig(background_snapshot=False) to ResilientTrainer")

    def at(self, step: int) -> StateSnapshot | None:
        """The settled snapshot of ``step``, if held (from any thread: donors ask too)."""
        self.settle(main=threading.get_ident() == self._owner)
        with self._lock:
            snap = next((s for s in reversed(self._held) if s.step == step and s.valid()), None)
            if snap is None or not snap.live:
                return snap
            if self._served is None or self._served[0] is not snap:
                self._served = (snap, snap.served())  # one host copy of live device tensors per snapshot
            return self._served[1]

    def kept_previous(self) -> int | None:
        """With one copy, after a commit that kept the previous step (``keep_previous``): that step."""
        with self._lock:
            if self.copies == 1 and len(self._held) == 2 and self._held[-1].live and self._held[0].valid():
                return self._held[0].step
        return None

    def harden(self) -> int | None:
        """One copy, after a commit that held its step live (``hold_live`` or ``keep_previous``): copy that
        step over the previous one, into its buffers, and keep only it; returns the step (None: nothing
        held live). Call it only when no plan can name the previous step any more (a sharded job: every
        rank committed the live one). A live step whose tensors changed since its commit (anything but the
        optimizer step wrote a parameter or optimizer state between two steps) raises
        :class:`RecoveryError`: the snapshot would mix two steps."""
        with self._lock:
            if self.copies != 1 or len(self._held) != 2 or not self._held[-1].live:
                return None
            old, live = self._held
            if not live.valid():
                self._held = [old]
                self._served = None
                raise RecoveryError(
                    f"parameters or optimizer state of the step-{live.step} commit were modified in place "
                    "before the next step began: with one snapshot copy a sharded job holds its last commit "
                    "as the live tensors until then; change them only in the optimizer step, or pass "
                    "TrainerConfig(snapshot_copies=2)")
            self._held = [live]  # (a donor asking now is served the live tensors, not a half-copied buffer)
            self._served = None
        import torch

        same = [s.name for s in old.header.tensors] == [s.name for s in live.header.tensors]
        tensors = list(live.tensors)
        with torch.no_grad():
            for i in live.live:
                src = live.tensors[i]
                dst = old.tensors[i] if same else None
                if dst is None or dst.dtype != src.dtype or dst.shape != src.shape or dst.device.type != "cpu":
                    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
                tensors[i] = dst.copy_(src)
        hard = StateSnapshot(live.header, tuple(tensors), live.sources, ())
        with self._lock:
            self._held = [hard]
            self._served = None
        return hard.step

    def restore(self, snap: StateSnapshot) -> int:
        """Reload ``snap`` (held here) into the objects; returns the bytes copied. A snapshot of live
        tensors stays valid: loading the objects' state dicts copies each of those tensors onto itself,
        which moves its version counter, so the record is taken again."""
        held_live = [h.step for h in self.held if h.live and h.step != snap.step]
        if snap.live:
            # under the lock: a donor thread asking meanwhile must wait, not find the counters moved
            with self._lock:
                copied = restore_state(self.objects, snap, unchanged=self.unchanged)
                versions = dict(zip(snap.live, snap.live_versions(), strict=True))
                again = replace(snap, sources=tuple((p, versions.get(i, v)) for i, (p, v) in enumerate(snap.sources)))
                self._held = [again if h is snap or h.step == snap.step and h.live else h for h in self._held]
                self._served = None
        else:
            copied = restore_state(self.objects, snap, unchanged=self.unchanged)
            with self._lock:  # a live step the reload overwrote is gone (and harden must not find it)
                self._held = [h for h in self._held if not h.live or h.valid()]
                self._served = None
        if held_live and self.on_restored is not None:
            self.on_restored(snap.step, snap.header.total_nbytes)  # the live step is gone: say so
        return copied

    def steps(self) -> list[int]:
        """The steps held (and still valid)."""
        with self._lock:
            return [s.step for s in self._held if s.valid()]

    def disable_background(self) -> None:
        """Copy everything inside the commits from now on (live views are kept with no copies)."""
        self.background = False
        if self.copies:
            self.late = frozenset()

    def _live_set(self) -> frozenset[int]:
        """What a commit may hold as live views: every optimizer's parameters and state (rebuilt when
        an optimizer's state appears or is reloaded, or a recovery cleared :attr:`late`)."""
        import torch

        if self._optimizers is None:
            self._optimizers = [o for o in self.objects.values() if isinstance(o, torch.optim.Optimizer)]
        key = ("live", tuple((id(o.state), len(o.state)) for o in self._optimizers))
        if self.copies and self.late:
            return self.late  # one copy, a view commit: what the last all-reduce of gradients named
        if not self.late or key != self._late_for:
            self.late, self._late_for = late_tensors(self.objects, [], optimizer_params=True), key
        return self.late

    def update_late(self, params: list[torch.Tensor]) -> None:
        """Set :attr:`late` for ``params``; on the training step's path, so it is rebuilt only when a
        cheap key moves (other parameters, optimizer state created or reloaded) or a recovery cleared it."""
        if self._optimizers is None:
            import torch

            self._optimizers = [o for o in self.objects.values() if isinstance(o, torch.optim.Optimizer)]
        key = (len(params), id(params[0]) if params else 0, id(params[-1]) if params else 0,
               tuple((id(o.state), len(o.state)) for o in self._optimizers))
        if not self.late or key != self._late_for:
            self.late, self._late_for = late_tensors(self.objects, params), key

    def begin_recovery(self) -> None:
        """A recovery starts (the copies settled): fetches and reloads may move tensors, so the next
        commit copies everything; a reload may skip the late tensors torch saw unchanged."""
        self.unchanged = self.late
        self.late = frozenset()

    def objects_replaced(self) -> None:
        """The objects were built again (a mesh job's shrink): forget what was derived from the old ones
        (their optimizers, the late and unchanged tensors), so that the next restore copies everything
        into the new tensors and the next commit captures them all."""
        self._optimizers = None
        self.late = self.unchanged = frozenset()
        self._late_for = ()

    def drop_all(self) -> None:
        """Forget every snapshot (a checkpoint replaced the job's state); their buffers are reused."""
        with self._lock:
            self._pool, self._held = [s for s in self._held if not s.live], []

    def warm_pool(self) -> None:
        """Map the memory of the future snapshots now (a hot spare, while it waits): its first commits
        after taking a rank then copy into warm buffers instead of page-faulting on the critical path."""
        self._pool = [capture_deferred(self.objects, step=0, checksum=False)[0] for _ in range(self.copies)]

    def close(self) -> None:
        """Wait for copies in flight (their error, if any, is dropped)."""
        try:
            self.copier.wait(take=threading.get_ident() == self._owner)
        except RecoveryError:
            pass


def late_tensors(objects: Mapping[str, Stateful], params: list[torch.Tensor], *,
                 optimizer_params: bool = False) -> frozenset[int]:
    """``data_ptr()`` of ``params`` and of every optimizer state tensor among ``objects`` (and, with
    ``optimizer_params``, of every optimizer's parameters); of a DTensor, its local shard's (what a
    capture holds of it)."""
    import torch

    def ptr(t: torch.Tensor) -> int:
        local = getattr(t, "_local_tensor", None)
        return (local if isinstance(local, torch.Tensor) else t).data_ptr()

    ptrs = {ptr(p) for p in params}
    for obj in objects.values():
        if isinstance(obj, torch.optim.Optimizer):
            if optimizer_params:
                ptrs.update(ptr(p) for g in obj.param_groups for p in g["params"])
            for st in obj.state.values():
                ptrs.update(ptr(v) for v in st.values()
                            if isinstance(v, torch.Tensor) and (v.is_cpu or v.is_cuda))
    return frozenset(ptrs)
