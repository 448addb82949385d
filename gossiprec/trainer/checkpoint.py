"""Checkpoints with ``torch.distributed.checkpoint`` (DCP) for what recovery in place cannot cover.

A recovery streams a lost rank's state from a surviving replica. Two cases have none: a plan with
action ``checkpoint`` (every holder of some shard died at once), and a job that stopped in good order
(exit 75, no spare left) and is started again by its scheduler. :class:`DcpCheckpoints` covers both::

    ck = DcpCheckpoints("/shared/ckpt/job1", every=50, keep=2)
    rt = ResilientTrainer(None, config, mesh=MESH, build=build, on_no_replica=ck.on_no_replica)
    rt.start()
    ck.resume(rt)                        # a restarted run goes on after its newest complete checkpoint
    while rt.step < steps:
        with rt.training_step() as s:
            ...
        ck.maybe_save(rt)                # every 50 committed steps

**What is saved.** ``rt.objects`` (model, optimizer, LR scheduler, data position, RNG, the trainer's own
``gossiprec`` entry), each object's ``state_dict()``: an FSDP2 or tensor-parallel module's values are
DTensors, which DCP writes as the pieces each rank holds, one copy per piece (the replicas of a shard
write it once; a replicated placement must hold the same values on its ranks, as DCP assumes). A value
that is not a DTensor (a norm left out of a TP plan, the RNG, the data position) DCP writes once for
every rank that holds it under the same name; so before a mesh save one all-reduce of a crc of these
values finds whether any differ between ranks (a generator seeded per shard), and only then are they
named (an all-gather) and written per rank, under ``gossiprec_per_rank.<rank>``, each rank reading its
own back. An optimizer's state is keyed by parameter index, as ``Optimizer.state_dict()`` keys it: a
checkpoint is read back by the same program. In a mesh job every rank saves, coordinated by DCP over
torch's default group (the trainer's managed ``gossiprec`` group: DCP gathers the ranks' plans, scatters
the global plan, and gathers the write results before its coordinator, rank 0, writes the ``.metadata``
file; before that gather, the ranks wait for each other's files on the file system, not in a collective,
whose wait the group's ``timeout`` bounds). In a data-parallel job without a mesh every rank holds the
whole state: rank 0 saves it alone, without collectives.

**Complete.** Step ``K`` is written into ``.tmp-step-K`` (the name a torn write keeps), then rank 0 lists
every file with its size in a marker, ``.gossiprec-complete``, and renames the directory to ``step-K``;
the other ranks wait for that (one broadcast) before they go on. The marker is written after DCP's
metadata, and DCP's metadata after every rank's files are written and synced (its coordinator writes it
only once all write results are gathered), so a marker vouches for every file. :meth:`DcpCheckpoints.latest`
takes only directories named ``step-K`` whose marker is there and whose every listed file has its size:
a temporary directory, a missing marker, a missing or short file is skipped, and the previous complete
checkpoint is the newest. Rank 0 keeps the newest ``keep`` complete ones and removes the older ones and
abandoned temporary directories (marker first, so a removal cut short is never taken for complete).

**Loading** reads each rank's own pieces without collectives (DCP's ``no_dist``): the recovery calls
``on_no_replica`` before the new epoch's groups exist, and every rank finds the files on the shared file
system. The recovery then checks with one all-reduce that every rank loaded the same step; a restarted
run's :meth:`~DcpCheckpoints.resume` checks that they found the same one before loading
(:meth:`ResilientTrainer.resume_from <gossiprec.trainer.loop.ResilientTrainer.resume_from>`). What is lost:
the steps committed after the checkpoint, which are trained again.

Importing this module does not import torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import warnings
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from gossiprec.errors import ConfigError, GossiprecError
from gossiprec.trainer.exits import JobStopped

if TYPE_CHECKING:
    from gossiprec.trainer.loop import ResilientTrainer
    from gossiprec.trainer.objects import Stateful
    from gossiprec.trainer.recovery import NoReplica

log = logging.getLogger(__name__)

MARKER = ".gossiprec-complete"
"""The file that makes a step's directory complete: the step and every file of it with its size."""
PER_RANK = "gossiprec_per_rank"
"""The entry of a mesh checkpoint that holds, under each rank's number, the values (not DTensors) that
differ between ranks: DCP would otherwise keep one rank's copy for all."""
_FINAL = re.compile(r"^step-(\d+)$")
_TEMP = re.compile(r"^\.tmp-step-(\d+)$")


class DcpCheckpoints:
    """The checkpoints of one job in ``directory`` (shared by every rank): one ``step-K`` directory per
    saved step ``K``; see the module docstring. ``every``: :meth:`maybe_save` saves each ``every``-th
    committed step (0: never); ``keep``: how many complete checkpoints to keep."""

    def __init__(self, directory: str | os.PathLike[str], *, every: int = 0, keep: int = 2) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ConfigError(f"every must be an int >= 0 (0: maybe_save never saves), got {every!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1 (complete checkpoints kept), got {keep!r}")
        self.directory = Path(directory)
        self.every = every
        self.keep = keep

    # ------------------------------------------------------------------ what is there
    def path(self, step: int) -> Path:
        """The directory of step ``step``'s checkpoint (complete or not)."""
        return self.directory / f"step-{step:08d}"

    def steps(self) -> list[int]:
        """The steps of every complete checkpoint, oldest first."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        found = sorted(int(m.group(1)) for m in map(_FINAL.match, names) if m)
        return [s for s in found if self.complete(s)]

    def latest(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def complete(self, step: int) -> bool:
        """Whether step ``step``'s checkpoint is complete: its directory has its final name, its marker
        names this step, and every file the marker lists is there with its size."""
        path = self.path(step)
        try:
            marker = json.loads((path / MARKER).read_text())
            if int(marker["step"]) != step or not marker["files"]:
                return False
            return all((path / name).stat().st_size == int(size) for name, size in marker["files"].items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False

    # ------------------------------------------------------------------ saving
    def maybe_save(self, rt: ResilientTrainer) -> int | None:
        """:meth:`save` when the last committed step is a multiple of ``every``, was trained by this epoch's
        ranks and is not saved yet (call it after every step, or before every step, on every rank);
        returns the step saved, else None.

        A step reached by a recovery (the plan's target, before the recovery's first step has committed)
        is not saved: a spare that took its rank in that recovery comes out of it into its next step,
        not into this call, and a save is a collective every rank must enter."""
        step = rt.step
        if not self.every or step <= 0 or step % self.every:
            return None
        if rt.epoch and not (rt.records and rt.records[-1].epoch == rt.epoch):
            return None  # (every recovery's record comes at its first committed step, in its epoch)
        if self.complete(step):
            return None
        return self.save(rt)

    def save(self, rt: ResilientTrainer) -> int | None:
        """Save ``rt.objects`` as the checkpoint of ``rt.step``, between two steps, on every rank of the job
        (each rank writes its pieces; in a data-parallel job without a mesh rank 0 writes the whole
        state). Runs inside ``rt.checkpointing()`` (the agents then give the save ``checkpoint_timeout``).
        Returns the step once its checkpoint is complete; None when a failure interrupted the save (the
        next step recovers; the torn directory is never loaded)."""
        from gossiprec.trainer.collectives.groups import CollectiveAborted

        if rt.role != "trainer" or rt.rank < 0:
            raise ConfigError("save a checkpoint from a rank, after start() (a spare holds no state to save)")
        step = rt.step
        with rt.checkpointing():
            try:
                if rt.sharded is not None:
                    ok = self._save_mesh(rt, step)
                elif rt.rank == 0:
                    ok = self._write(rt.objects, step, dist=False)
                else:
                    ok = True  # rank 0 writes the replicated state alone
            except Exception as exc:
                if not isinstance(exc, CollectiveAborted) and not (rt.sharded is not None and rt.sharded.aborted()):
                    raise
                log.warning("the checkpoint of step %d was interrupted (%s); the next step recovers", step, exc)
                return None
        if not ok:
            raise GossiprecError(f"rank 0 could not complete the checkpoint of step {step} in {self.directory} "
                                 "(see its log)")
        return step

    def _save_mesh(self, rt: ResilientTrainer, step: int) -> bool:
        import torch
        import torch.distributed as dist

        sharded = rt.sharded
        assert sharded is not None
        ok = self._write(rt.objects, step, dist=True, device=sharded.spec.device,
                         written=(rt.epoch, rt.rank, rt.world_size, sharded.aborted))
        # Every rank leaves once rank 0 has renamed the directory: after save() returns, on any rank,
        # latest() finds the step everywhere (a recovery that reads it cannot race the rename).
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=sharded.spec.device)
        dist.broadcast(flag, src=0)
        return bool(int(flag.cpu()[0]))

    def _write(self, objects: Mapping[str, Stateful], step: int, *, dist: bool, device: str = "cpu",
               written: tuple[int, int, int, Callable[[], bool]] | None = None) -> bool:
        """DCP-save ``objects`` into the step's temporary directory (``dist``: every rank, over torch's
        default group; else this process alone); the coordinator (rank 0) then completes it. Returns
        whether this rank's part succeeded (the coordinator's: the checkpoint is complete).
        ``written``: (epoch, rank, world size, aborted): wait for every rank's files on the file system
        (:func:`_files_written`) before DCP's next collective."""
        import torch.distributed as tdist
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        temp = self.directory / f".tmp-step-{step:08d}"
        temp.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {name: obj.state_dict() for name, obj in objects.items()}
        if dist:
            state = _split_per_rank(state, device)
        with warnings.catch_warnings():  # DCP warns that it saves "in a single process": meant without a mesh
            warnings.simplefilter("ignore", UserWarning)
            metadata = dcp_save(state, storage_writer=_writer(FileSystemWriter, temp, written), no_dist=not dist)
        if dist and tdist.get_rank() != 0:
            return True
        try:
            self._complete(temp, step, metadata)
        except OSError as exc:
            log.error("could not complete the checkpoint of step %d in %s: %s", step, self.directory, exc)
            return False
        return True

    def _complete(self, temp: Path, step: int, metadata: Any) -> None:
        """Rank 0, once DCP's metadata is written: the marker, the rename, and the old ones removed."""
        files = sorted({info.relative_path for info in metadata.storage_data.values()} | {".metadata"})
        sizes = {name: (temp / name).stat().st_size for name in files}
        _write_synced(temp / MARKER, json.dumps({"step": step, "files": sizes}))
        final = self.path(step)
        if final.exists():  # an older, torn or superseded save of the same step
            _remove(final)
        os.rename(temp, final)
        _sync_dir(self.directory)
        log.info("checkpoint of step %d complete in %s", step, final)
        self._prune(step)

    def _prune(self, newest: int | None) -> None:
        """Rank 0: remove the complete checkpoints older than the newest ``keep`` and every temporary
        directory (no save is under way: the one of ``newest`` was just renamed)."""
        keep = set(self.steps()[-self.keep:]) | ({newest} if newest is not None else set())
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            m = _FINAL.match(name) or _TEMP.match(name)
            if m is None or (_FINAL.match(name) and int(m.group(1)) in keep):
                continue
            try:
                _remove(self.directory / name)
            except OSError as exc:
                log.warning("could not remove the old checkpoint %s: %s", name, exc)

    # ------------------------------------------------------------------ loading
    def load(self, objects: Mapping[str, Stateful], step: int) -> None:
        """Load step ``step``'s checkpoint into ``objects`` (every rank reads its own pieces; no
        collective). An optimizer that has not stepped yet (a run restarted at step 0) first gets its state
        made by a step at learning rate 0, its step hooks held back."""
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        path = self.path(step)
        if not self.complete(step):
            raise GossiprecError(f"the checkpoint of step {step} in {self.directory} is not complete")
        stored = FileSystemReader(path).read_metadata().state_dict_metadata
        for name, obj in objects.items():
            _optimizer_template(name, obj, stored)
        state: dict[str, Any] = {name: obj.state_dict() for name, obj in objects.items()}
        for name, obj in objects.items():
            _drop_unsaved(name, obj, state[name], stored)
        state, moved = _template_per_rank(state, stored)
        with warnings.catch_warnings():  # DCP warns that it loads "in a single process": meant here
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(state, storage_reader=FileSystemReader(path), no_dist=True)
        own: dict[str, Any] = next(iter(state.pop(PER_RANK, {}).values()), {})
        for name, (parent, key) in moved.items():
            parent[key] = own[name]
        for name, obj in objects.items():
            obj.load_state_dict(state[name])
        log.info("loaded the checkpoint of step %d from %s", step, path)

    def on_no_replica(self, info: NoReplica) -> int:
        """For ``ResilientTrainer(on_no_replica=...)``: load the newest complete checkpoint into the
        objects (on every rank of the new world) and return its step; :class:`JobStopped` when there is none."""
        step = self.latest()
        if step is None:
            raise JobStopped(f"no replica of some state is left ({info.reason}) and {self.directory} holds no "
                             "complete checkpoint: restart the job from its start")
        self.load(info.objects, step)
        if info.rank == 0:
            self._prune(None)  # saves torn by the failure (no save is under way: the groups are being rebuilt)
        return step

    def resume(self, rt: ResilientTrainer) -> int | None:
        """Right after ``rt.start()``: a restarted run (a job requeued after exit 75) goes on from the newest
        complete checkpoint, every rank at once; returns its step (training goes on at the next one),
        or None when there is none, or when this process's state came from a recovery (a spare that
        took its rank in a running job: see :meth:`ResilientTrainer.resume_from
        <gossiprec.trainer.loop.ResilientTrainer.resume_from>`)."""
        step = rt.resume_from(self.latest, self.load)
        if rt.rank == 0 and rt.step == (step or 0):
            # saves cut short by the stop: gone before this run's first save (no rank can begin one
            # before rank 0 has trained a step), so that none of their files passes for this run's
            self._prune(None)
        return step


def _writer(base: Any, temp: Path, written: tuple[int, int, int, Callable[[], bool]] | None) -> Any:
    """DCP's file system writer for ``temp``; with ``written``, one that waits after writing this rank's
    files until every rank has written its own (:func:`_files_written`)."""
    if written is None:
        return base(temp)
    epoch, rank, world, aborted = written

    class Writer(base):  # type: ignore[misc]
        def write_data(self, plan: Any, planner: Any) -> Any:
            done = super().write_data(plan, planner)
            done.wait()
            _files_written(temp, epoch, rank, world, aborted)
            return done

    return Writer(temp)


def _files_written(temp: Path, epoch: int, rank: int, world: int, aborted: Callable[[], bool]) -> None:
    """This rank's files are written: say so on the file system and wait until every rank has. DCP's
    next collective gathers the ranks' write results, and a collective waits at most the group's
    ``timeout`` (30 s by default): the ranks that write faster would wait there for the slowest, and a
    large checkpoint on a slow file system could outlast it. Here they wait without a limit while
    their phase is ``checkpoint`` (the agents allow it ``checkpoint_timeout``); a failure meanwhile
    aborts the epoch (``aborted()``) and the save is interrupted. The epoch in the files' names keeps
    those of a save cut short in an earlier epoch from counting."""
    from gossiprec.trainer.collectives.groups import CollectiveAborted

    (temp / f".written-e{epoch}-{rank}").touch()
    want = {f".written-e{epoch}-{r}" for r in range(world)}
    while not want <= set(os.listdir(temp)):
        if aborted():
            raise CollectiveAborted(f"a checkpoint save was interrupted while rank {rank} waited for the others' "
                                    "files", epoch=epoch, op="checkpoint", reason="aborted")
        time.sleep(0.02)


def _optimizer_template(name: str, obj: Any, stored: Mapping[str, Any]) -> None:
    """Give an optimizer the state it lacks (torch creates it at the first step) so that the checkpoint has
    tensors to load into: one step at learning rate 0 with zero gradients
    (:func:`~gossiprec.trainer.state.receive.materialize_optimizer_state`, as a spare does), its step
    hooks held back (the trainer's optimizer gate, the user's own: this is no training step). The state
    it makes is overwritten by the load."""
    import torch

    from gossiprec.trainer.state.receive import allocate_state

    if not isinstance(obj, torch.optim.Optimizer):
        return
    params = [p for group in obj.param_groups for p in group["params"]]
    lacking = [i for i, p in enumerate(params) if not obj.state.get(p) and any(
        key.startswith(f"{name}.state.{i}.") for key in stored)]
    if not lacking:
        return
    from torch.optim import optimizer as module

    hooks = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
    shared = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    held = [getattr(obj, h) for h in hooks], [getattr(module, h) for h in shared]
    try:
        for h in hooks:
            setattr(obj, h, type(getattr(obj, h))())
        for h in shared:
            setattr(module, h, type(getattr(module, h))())
        allocate_state(obj)
    finally:
        for h, value in zip(hooks, held[0]):
            setattr(obj, h, value)
        for h, value in zip(shared, held[1]):
            setattr(module, h, value)


def _drop_unsaved(name: str, obj: Any, state: Any, stored: Mapping[str, Any]) -> None:
    """Leave out of an optimizer's state dict the parameters the checkpoint holds no state for (never
    stepped when it was saved): the load would refuse them as missing."""
    import torch

    if not isinstance(obj, torch.optim.Optimizer):
        return
    for index in list(state["state"]):
        if not any(key.startswith(f"{name}.state.{index}.") for key in stored):
            del state["state"][index]


def _leaves(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any, Any, Any]]:
    """Every leaf of nested mappings: (dotted name, as DCP names it; parent mapping; key; value)."""
    for key, value in list(tree.items()):
        here = (*path, str(key))
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, here)
        else:
            yield ".".join(here), tree, key, value


def _crc(value: Any) -> int:
    """A crc32 of a value that is not a DTensor (of its ``repr`` when not a tensor: two equal values whose
    reprs differ only cost a copy per rank); -1 for a DTensor (DCP writes each rank's own piece)."""
    import torch
    from torch.distributed.tensor import DTensor

    from gossiprec.trainer.state.header import tensor_bytes

    if isinstance(value, DTensor):
        return -1
    if isinstance(value, torch.Tensor):
        return zlib.crc32(tensor_bytes(value.detach().cpu().contiguous()))
    return zlib.crc32(repr(value).encode())


def _split_per_rank(state: dict[str, Any], device: str) -> dict[str, Any]:
    """A mesh save (every rank, collective): ``state`` with the values that are not DTensors and differ
    between ranks moved under ``PER_RANK/<rank>`` (DCP keeps one copy of a key that several ranks
    write: a generator seeded per shard would come back the same everywhere). One
    all-reduce says whether any differ (the usual case: none, and ``state`` is returned as it is); only
    then an all-gather of every rank's crcs names them."""
    import torch
    import torch.distributed as dist

    crcs = {name: _crc(value) for name, _, _, value in _leaves(state)}
    crcs = {name: c for name, c in crcs.items() if c >= 0}
    mine = zlib.crc32(json.dumps(sorted(crcs.items())).encode())
    both = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    both = both.cpu()
    if int(both[0]) == -int(both[1]):
        return state
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, crcs)
    differ = {n for n in set().union(*everyone) if len({ranks.get(n) for ranks in everyone}) > 1}
    state = _structure(state)  # (the objects' state dicts share their inner dicts with the live state)
    own: dict[str, Any] = {}
    for name, parent, key, value in _leaves(state):
        if name in differ:
            own[name] = value
            del parent[key]
    state[PER_RANK] = {str(dist.get_rank()): own}
    log.info("checkpoint: %d value(s) that differ between ranks are saved per rank: %s", len(own),
             ", ".join(sorted(own)[:5]))
    return state


def _template_per_rank(state: dict[str, Any], stored: Mapping[str, Any]
                       ) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """The load's template ``state`` with the values this rank's checkpoint holds per rank
    (:func:`_split_per_rank`) moved under ``PER_RANK``, and where each goes back to after the load."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    prefix = f"{PER_RANK}.{rank}."
    mine = [key[len(prefix):] for key in stored if key.startswith(prefix)]
    if not mine:
        return state, {}
    state = _structure(state)
    moved: dict[str, tuple[Any, Any]] = {}
    own: dict[str, Any] = {}
    for name, parent, key, value in _leaves(state):
        if any(m == name or m.startswith(name + ".") for m in mine):
            own[name], moved[name] = value, (parent, key)
            del parent[key]
    state[PER_RANK] = {str(rank): own}
    return state, moved


def _structure(tree: Any) -> Any:
    """A copy of nested mappings (the leaves themselves shared), to move leaves in without touching the
    objects' own dicts."""
    if isinstance(tree, Mapping):
        return {key: _structure(value) for key, value in tree.items()}
    return tree


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (where the file system allows opening a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Remove a checkpoint directory, its marker first (a removal cut short is never complete)."""
    try:
        (path / MARKER).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(path)
