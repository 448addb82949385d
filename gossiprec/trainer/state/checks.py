"""Replica checks: every replica of a shard must hold the same state; compare them, and the live tensors.

The ranks of each replica group compare a digest of their state (:mod:`gossiprec.trainer.state.digest`) at
the first all-reduce of gradients after the start, after the first step, after every recovery and
every ``verify_every`` steps; a mismatch raises :class:`~gossiprec.trainer.state.digest.ReplicaMismatch`.

After a recovery with background snapshots, the state compared is that of the recovery's first commit
(step ``target + 1``): a thread hashes that commit's snapshot, a copy, while step ``target + 2``
computes, and the comparison runs at step ``target + 2``'s all-reduce of gradients, before its optimizer
step, so the first step after a recovery runs as fast as any other. A rank whose state came out of the
recovery different (restored or received wrong) trains its first step from that state: its gradients are
averaged like everyone's, so the difference is still in the parameters, optimizer state, buffers, RNG or
data position it commits, and the comparison finds it one step later. (A difference the first step
wipes out, such as a buffer a forward pass recomputes or a last bit a moment's decay rounds away, is
not reported: the replicas are identical at the step compared.)
Without background snapshots the live state is hashed at the recovery and compared at the first
all-reduce of gradients, as at the start. A job that finishes right after a recovery's first step
compares in ``finish()``.

The commits that are checked (the first step's, every ``verify_every``-th) are copied and
checksummed in place, and the next all-reduce hashes the live parameters and optimizer state again:
a write torch does not track (``.data``) between the two raises :class:`~gossiprec.errors.RecoveryError`,
since the background copies of later commits would silently miss such writes.
"""

from __future__ import annotations

import logging
import zlib
from typing import TYPE_CHECKING, Any, Callable, Mapping

from gossiprec.errors import GossiprecError, RecoveryError
from gossiprec.trainer.state.digest import (
    PendingDigest, ReplicaMismatch, SnapshotDigest, StateDigest, describe, differing_groups, digest_of_snapshot,
    gmac32, rows_tensor,
)
from gossiprec.trainer.state.header import tensor_bytes, walk_objects
from gossiprec.trainer.state.snapshots import Snapshots, late_tensors

if TYPE_CHECKING:
    import torch

    from gossiprec.trainer.state.capture import StateSnapshot
    from gossiprec.trainer.objects import Stateful

log = logging.getLogger(__name__)

Collective = Callable[["torch.Tensor", str], bool]
"""``(tensor, op) -> False`` when the all-reduce was interrupted (and recovery ran)."""


class ReplicaChecks:
    """The checks due at the next all-reduce of gradients, and whether a commit is checked.

    ``enabled`` and ``every`` are the config's ``verify_replicas`` and ``verify_every``; :attr:`groups`
    are the current replica groups (lists of ranks), set by whoever installs a view.
    """

    def __init__(self, objects: Mapping[str, Stateful], snaps: Snapshots, *, enabled: bool, every: int,
                 exclude: tuple[str, ...] = (), device: str = "cpu") -> None:
        self.objects = objects
        self.enabled = enabled
        self.every = every
        self.exclude = exclude
        """Entry-name prefixes left out of the comparisons (see ``TrainerConfig.verify_exclude``)."""
        self.device = device
        """Where the comparison's tensors live: the backend's device (NCCL takes CUDA tensors only)."""
        self.groups: tuple[tuple[int, ...], ...] = ()
        self._snaps = snaps
        self._due: tuple[str, PendingDigest | SnapshotDigest | StateDigest] | None = None
        """A cross-replica comparison due at the next all-reduce of gradients: (when, digest)."""
        self._deferred: str | None = None
        """A recovery's comparison that takes the next commit's snapshot (see :meth:`expect`): its ``when``."""
        self.awaiting = False
        """The comparison :meth:`expect` asked for has not ended yet."""
        self._took_commit = False
        """The comparison due is one a recovery deferred to its first commit."""
        self.on_result: Callable[[bool], None] | None = None
        """Told how each comparison across replicas ended (False: a mismatch, before it raises)."""
        self.last_ok: bool | None = None
        """True once the comparison :meth:`expect` asked for passed (None until then, and when disabled)."""
        self._live: StateSnapshot | None = None
        """A checksummed commit whose parameters and optimizer state must still equal the live ones at
        the next all-reduce of gradients (catches writes torch does not see, e.g. through ``.data``)."""

    @property
    def recovery_due(self) -> bool:
        """The comparison due is the one a recovery deferred to its first commit (see :meth:`expect`)."""
        return self._took_commit and self._due is not None

    @property
    def pending(self) -> bool:
        """Whether the next all-reduce of gradients has checks to run."""
        return self._due is not None or self._live is not None

    def checks_commit(self, step: int) -> bool:
        """Whether the commit of ``step`` is copied with checksums and compared (the first, every
        ``every``-th)."""
        return self.enabled and (step == 1 or bool(self.every) and step % self.every == 0)

    def committed(self, step: int, snap: StateSnapshot) -> None:
        """``snap``, a checksummed commit of ``step``, is compared across replicas (and, when later
        commits copy in the background, with the live tensors) at the next all-reduce of gradients."""
        when = f"after step {step}"
        if self._deferred is not None:  # (this comparison is also the one a recovery deferred to this commit)
            when, self._deferred = f"{self._deferred}, as its first step {step} committed it", None
            self._took_commit = True
        self._due = (when, digest_of_snapshot(snap).without(self.exclude))
        self._live = snap if self._snaps.background else None

    def commit_taken(self, step: int, snap: StateSnapshot) -> None:
        """An unchecked commit of ``step``: when a recovery deferred its comparison, ``snap`` is the state
        compared, at the next all-reduce of gradients (hashed meanwhile, on a thread)."""
        when, self._deferred = self._deferred, None
        if when is None:
            return
        when = f"{when}, as its first step {step} committed it"
        self._took_commit = True
        if snap.live:  # views of the live tensors (one copy held live): hash those before the optimizer step
            self._due = (when, PendingDigest(self.objects, step, late=self._late_tensors(), hasher=gmac32))
        else:
            self._due = (when, SnapshotDigest(snap, lambda: self._snaps.copier.wait(take=False)))

    def expect(self, when: str, step: int, *, overlap: bool, defer: bool = False) -> None:
        """Compare the live state (as of now, at ``step``) across replica groups at the next all-reduce
        of gradients. ``overlap``: the tensors only the optimizer step changes are hashed on a thread
        meanwhile (only sound where the loop promises not to write them before that all-reduce).
        ``defer`` (background snapshots, after a recovery): compare the state of the next commit instead,
        at the all-reduce after it (see the module docstring)."""
        self._live = None
        self.last_ok = None
        self._deferred = None
        self._took_commit = False
        self.awaiting = self.enabled
        if not self.enabled:
            self._due = None
            return
        if defer:
            self._due, self._deferred = None, when
            return
        late: frozenset[int] = self._late_tensors() if overlap else frozenset()
        self._due = (when, PendingDigest(self.objects, step, late=late))

    def _late_tensors(self) -> frozenset[int]:
        import torch

        params = [p for o in self.objects.values() if isinstance(o, torch.optim.Optimizer)
                  for g in o.param_groups for p in g["params"]]
        return late_tensors(self.objects, params)

    def run_at_finish(self, group: Any, timeout: float, rank: int, world_size: int) -> None:
        """The job ends right after a recovery's first step: the comparison that recovery deferred runs
        now, on ``group`` (a mismatch raises; a failed collective is only logged: the job is ending)."""
        if not self.recovery_due:
            return
        try:
            self.run(lambda t, op: group.allreduce(t, op, timeout=timeout) is None, rank, world_size)
        except ReplicaMismatch:
            raise
        except GossiprecError as exc:
            log.warning("the replicas' comparison at the end failed: %s", exc)

    def run(self, collective: Collective, rank: int, world_size: int) -> bool:
        """Run the checks due at this all-reduce; False when a collective was interrupted (recovered)."""
        live, self._live = self._live, None
        if live is not None:
            self._check_live(live)
        check = self._due
        if check is None:
            return True
        when, digest = check
        result = digest if isinstance(digest, StateDigest) else digest.result().without(self.exclude)
        rows = rows_tensor(result.summary(), rank, world_size, self.device)
        if not collective(rows, "sum"):
            return False
        rows = rows.cpu()
        differ = differing_groups(rows, self.groups)
        if differ:
            self.awaiting = self._took_commit = False
        if differ and self.on_result is not None:
            self.on_result(False)
        if differ:
            layouts = [g for g in differ if len({tuple(rows[r, :2].tolist()) for r in g}) > 1]
            if layouts:
                raise ReplicaMismatch(
                    f"replicas hold differently shaped state at step {result.step} ({when}): ranks of "
                    f"replica group(s) {[list(g) for g in layouts]} hold "
                    f"{sorted({int(rows[r, 0]) for g in layouts for r in g})} "
                    "entries or differently named ones; every replica must register the same objects",
                    step=result.step, entries=(), ranks=tuple(r for g in layouts for r in g))
            # every rank sends the same width (the widest entry list; a gloo collective of mismatched
            # sizes ends the process), padded with zeros
            width = int(rows[:, 0].max())
            full = rows_tensor(tuple(result.values) + (0,) * (width - len(result.values)), rank, world_size,
                               self.device)
            if not collective(full, "sum"):
                return False
            raise describe(result, full.cpu(), differ, when, layouts=[int(x) for x in rows[:, 1]])
        self._due = None
        self.last_ok = True
        self.awaiting = self._took_commit = False
        if self.on_result is not None:
            self.on_result(True)
        return True

    def _check_live(self, snap: StateSnapshot) -> None:
        """The parameters and optimizer state must still hold the bytes ``snap`` checksummed at commit."""
        _, found = walk_objects(self.objects)
        late = self._snaps.late
        changed = [spec.name for spec, (name, t) in zip(snap.header.tensors, found, strict=False)
                   if spec.name == name and t.data_ptr() in late and t.is_cpu and t.is_contiguous()
                   and zlib.crc32(tensor_bytes(t)) != spec.crc32]
        if changed:
            self._snaps.disable_background()
            raise RecoveryError(
                f"{len(changed)} tensor(s) changed between commit() of step {snap.step} and the next "
                f"allreduce_gradients() without torch seeing it ({', '.join(changed[:3])}): a write through "
                ".data or another alias of the memory. With background_snapshot=True only the optimizer "
                "step may change parameters and optimizer state; move such writes after "
                "allreduce_gradients() or pass TrainerConfig(background_snapshot=False) to ResilientTrainer")
