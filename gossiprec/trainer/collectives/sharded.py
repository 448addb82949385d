"""Sharded jobs: the device mesh a :class:`~gossiprec.trainer.loop.ResilientTrainer` builds, and what follows from it.

A :class:`MeshSpec` names the mesh's shape and dimensions and which dimension(s) replicate the state
(``dp`` for dp x tp, ``replicate`` for HSDP). From it alone come the agents' job topology
(:meth:`MeshSpec.topology`: the ranks along the replicate dimension hold the same shard, each line one
replica group, derived by :class:`~gossiprec.core.mesh.MeshShape` exactly as the launchers' ``--mesh`` is)
and the job spec's ``[job]`` lines (:meth:`MeshSpec.job_toml`), so it is never typed twice;
:meth:`MeshSpec.check_view` refuses a launched job whose replica groups say otherwise, in one line naming
both shapes.

:class:`ShardedWorld` is the trainer's side once the rank is known: it makes the ``gossiprec`` backend
torch's default group (:func:`~gossiprec.trainer.collectives.managed.init_managed_world`), builds the
``DeviceMesh`` and calls the user's ``build(mesh)`` for the objects (once per process, and again after a
shrink), in the same order in every process (the managed groups' store keys depend on it); then each epoch's
:meth:`ShardedWorld.configure` gives every group of the mesh that epoch's backend, and
:meth:`ShardedWorld.abort` makes every collective blocked anywhere (forward, backward, optimizer, user
code) raise :class:`~gossiprec.trainer.collectives.groups.CollectiveAborted`.

A replacement takes the lost rank's coordinate, so the mesh keeps its shape across recoveries. A plan
that shrinks the job (``allow_shrink``, no spare left: whole replica groups dropped) makes every
survivor build its world again (:meth:`ShardedWorld.build` for the new rank and world size): the old
managed world is retired (its groups aborted, kept referenced), a new one of the new size becomes torch's
default group, the ``DeviceMesh`` is made again with the same names and the replicate dimension as many
rows smaller (:meth:`MeshSpec.resized`), and ``build(mesh)`` is called again for new objects, into which
the recovery then loads the rank's state. Every other coordinate of a survivor stays what it was (the
election's renumbering keeps it), so its local shards keep their shapes; a shrink that would move a
rank along a sharded dimension, or a mesh with several replicate dimensions, is refused
(:class:`~gossiprec.trainer.exits.MeshShrinkRefused`).

Importing this module does not import torch; :class:`ShardedWorld` does when it builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from gossiprec.core.mesh import MeshShape, describe_groups, describe_topology
from gossiprec.errors import ConfigError
from gossiprec.trainer.exits import MeshShrinkRefused

if TYPE_CHECKING:
    from gossiprec.core.topology import JobTopology
    from gossiprec.trainer.keys import TransferKeys
    from gossiprec.trainer.collectives.managed import ManagedWorld
    from gossiprec.trainer.objects import Stateful


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """A device mesh: ``shape`` (ranks per dimension), ``names`` (one per dimension) and ``replicate``,
    the dimension(s) along which ranks hold the same shard (default: the first dimension).
    ``device``: the mesh's device type: ``cpu`` (gloo) or ``cuda`` (NCCL, on the current CUDA device:
    call ``torch.cuda.set_device`` before ``start()``; with ``TrainerConfig(backend="nccl")``)."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    replicate: str | tuple[str, ...] = ""
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or not self.shape or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.shape):
            raise ConfigError(f"mesh shape must be a non-empty tuple of ints >= 1, got {self.shape!r}")
        if not isinstance(self.names, tuple) or len(self.names) != len(self.shape) or len(set(self.names)) != len(
                self.names) or not all(isinstance(n, str) and n for n in self.names):
            raise ConfigError(f"mesh names must be {len(self.shape)} distinct non-empty strings (one per "
                              f"dimension of {self.shape}), got {self.names!r}")
        rep = self.replicated
        if not rep or any(r not in self.names for r in rep):
            raise ConfigError(f"replicate must name mesh dimension(s) among {self.names}, got {self.replicate!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"mesh device {self.device!r}: a managed mesh is on 'cpu' (gloo) or 'cuda' (nccl)")

    @property
    def backend(self) -> str:
        """The groups' backend: ``nccl`` for a ``cuda`` mesh, else ``gloo``."""
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def replicated(self) -> tuple[str, ...]:
        """The replicate dimension(s)."""
        if not self.replicate:
            return self.names[:1]
        return (self.replicate,) if isinstance(self.replicate, str) else tuple(self.replicate)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def shape_of(self) -> MeshShape:
        """The mesh's pure shape (:class:`~gossiprec.core.mesh.MeshShape`): what a launcher's ``--mesh`` names."""
        return MeshShape(self.names, self.shape, self.replicated)

    def topology(self, *, allow_shrink: bool = False, min_replicas: int = 1) -> JobTopology:
        """The agents' job topology: one replica group per line of the mesh along the replicate dimension(s)
        (:meth:`~gossiprec.core.mesh.MeshShape.topology`, as the launchers derive it from ``--mesh``)."""
        return self.shape_of.topology(allow_shrink=allow_shrink, min_replicas=min_replicas)

    def job_toml(self, *, allow_shrink: bool = False, min_replicas: int = 1) -> str:
        """The job spec's ``[job]`` table for this mesh (the spec's grid must equal :meth:`topology`)."""
        return self.shape_of.job_toml(allow_shrink=allow_shrink, min_replicas=min_replicas)

    def resized(self, world_size: int) -> MeshSpec:
        """This mesh over ``world_size`` ranks: the replicate dimension as many rows smaller (or larger) as
        replica groups were dropped, every other dimension as it is. :class:`MeshShrinkRefused` where no
        such mesh exists (several replicate dimensions, or a size the other dimensions do not divide)."""
        if world_size == self.world_size:
            return self
        rep = self.replicated
        rest = self.world_size // math.prod(self.shape[self.names.index(r)] for r in rep)
        if len(rep) != 1 or world_size < 1 or world_size % rest:
            raise MeshShrinkRefused(
                f"a plan resizes the {self.shape_of.text} mesh ({self.world_size} ranks) to {world_size} ranks, "
                f"which no mesh with the same {', '.join(n for n in self.names if n not in rep) or 'other'} "
                f"dimension(s) and one replicate dimension holds (replicate: {', '.join(rep)}): keep "
                "allow_shrink = false for this mesh and give it spares, or restart it from a checkpoint")
        i = self.names.index(rep[0])
        shape = self.shape[:i] + (world_size // rest,) + self.shape[i + 1:]
        return MeshSpec(shape, self.names, self.replicate, self.device)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinate on this mesh (ranks laid out row-major, as ``init_device_mesh`` does)."""
        out = []
        for size in reversed(self.shape):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def check_view(self, world_size: int, replica_groups: Sequence[Sequence[int]]) -> None:
        """Refuse (ConfigError, one line naming both) a job whose launched topology is not this mesh's (or
        this mesh shrunk along its replicate dimension: a spare joining a job that shrank)."""
        if world_size < self.world_size:
            try:
                self.resized(world_size).check_view(world_size, replica_groups)
                return
            except (ConfigError, MeshShrinkRefused):
                pass  # refused below, naming the launched mesh
        want = self.topology().replica_groups
        got = tuple(sorted(tuple(sorted(int(r) for r in g)) for g in replica_groups)) or (tuple(range(world_size)),)
        if world_size != self.world_size or got != want:
            shape = self.shape_of
            if shape.grid() is None:
                fix = "no --mesh or job spec grid expresses this mesh: put its replicate dimension first"
            else:
                table = ", ".join(shape.job_toml().splitlines()[1:])
                fix = (f"launch it with --mesh {shape.text} (gossiprec spec/run --mesh, torchrun --rdzv-conf "
                       f"'mesh={shape.text.replace(',', ';')}', GOSSIPREC_MESH) or a job spec whose [job] table is "
                       f"MeshSpec.job_toml()'s ({table})")
            raise ConfigError(
                f"the launched mesh is {describe_topology(world_size, got)} but this trainer's MeshSpec is "
                f"{shape.text} ({self.world_size} ranks, replica groups {describe_groups(shape.topology())}): the "
                f"job's topology is not the mesh's; {fix}, or change the MeshSpec")


def check_sharded_args(mesh: object, build: object, objects: object, backend: str) -> MeshSpec:
    """The trainer's ``mesh``, once its arguments make a sharded job: ``mesh`` a :class:`MeshSpec`, a
    ``build``, no ``objects``, and the mesh's ``backend``; ConfigError otherwise."""
    if not isinstance(mesh, MeshSpec) or build is None or objects is not None:
        raise ConfigError("a sharded job passes mesh=MeshSpec(...) and build=callable(mesh) -> objects, and "
                          "objects=None (the objects are built once the mesh exists)")
    if backend != mesh.backend:
        raise ConfigError(f"a mesh on {mesh.device!r} runs on {mesh.backend}: pass TrainerConfig(backend="
                          f"{mesh.backend!r}) for MeshSpec(device={mesh.device!r})")
    return mesh


class ShardedWorld:
    """This process's managed world, mesh and objects (see the module docstring). Made by the trainer."""

    def __init__(self, spec: MeshSpec, build: Callable[[Any], Mapping[str, Stateful]], *, timeout: float,
                 poll_interval: float, slow_after: float | None, on_slow: Callable[[], None] | None,
                 on_resume: Callable[[], None] | None = None, on_issue: Callable[[], None] | None = None) -> None:
        self.spec = spec
        self.build_objects = build
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.slow_after = slow_after
        self.on_slow = on_slow
        self.on_resume = on_resume
        self.on_issue = on_issue
        """Called as a collective is entered, and when a slow one completes (see ManagedWorld)."""
        self.world: ManagedWorld | None = None
        self.mesh: Any = None
        self.rank = -1
        self.shape = spec
        """The mesh built now: ``spec``, or ``spec`` resized by a shrink (:meth:`MeshSpec.resized`)."""
        self.retired: list[tuple[Any, Any]] = []
        """(world, mesh) of every world a shrink retired (kept, as
        :func:`~gossiprec.trainer.collectives.managed.retire_managed_world` keeps the world)."""
        self._one: Any = None
        self._barrier: Any = None
        """The commit barrier's tensor and pending work (see :meth:`issue_barrier`)."""
        self.host: str | None = None
        """The address every group's gloo connections bind to (the trainer's: its agent's), set before
        :meth:`build`; None binds torch's default device (the host name's address)."""
        self.keys: TransferKeys | None = None
        """The cluster's keys, which seal every value the groups put in the epoch's store (set before
        :meth:`build`)."""

    @property
    def built(self) -> bool:
        return self.mesh is not None

    def warm(self) -> None:
        """Import torch's mesh, DTensor, tensor-parallel and FSDP2 modules now (a spare, while it waits):
        seconds that would otherwise fall between the plan and the state transfer (dynamo too: the
        first ``distribute_tensor`` imports it)."""
        import torch._dynamo  # noqa: F401
        import torch.distributed.device_mesh  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.tensor  # noqa: F401
        import torch.distributed.tensor.parallel  # noqa: F401

    @property
    def world_size(self) -> int:
        """The ranks of the mesh built now."""
        return self.shape.world_size

    def build(self, rank: int, world_size: int | None = None) -> dict[str, Stateful]:
        """Make the managed default group for ``rank`` of ``world_size`` (default: the spec's), the mesh,
        and the user's objects. Built already (a survivor of a shrink): retire the old world and build them
        again on the resized mesh (see the module docstring); the old objects are the caller's to drop."""
        world_size = self.spec.world_size if world_size is None else world_size
        shape = self.spec.resized(world_size)
        if self.built:
            self._retire(rank, shape)
        from torch.distributed.device_mesh import init_device_mesh

        from gossiprec.trainer.collectives.managed import init_managed_world

        self.world = init_managed_world(rank, shape.world_size, timeout=self.timeout,
                                        poll_interval=self.poll_interval, slow_after=self.slow_after,
                                        on_slow=self.on_slow, host=self.host, keys=self.keys,
                                        backend=self.spec.backend)
        self.world.on_resume, self.world.on_issue = self.on_resume, self.on_issue
        self.rank, self.shape = rank, shape
        self.mesh = init_device_mesh(shape.device, shape.shape, mesh_dim_names=shape.names)
        objects = self.build_objects(self.mesh)
        if not isinstance(objects, Mapping) or not objects:
            raise ConfigError(f"build(mesh) must return the objects of the training state (name -> Stateful), "
                              f"got {type(objects).__name__}")
        return dict(objects)

    def _retire(self, rank: int, shape: MeshSpec) -> None:
        """Before building again as ``rank`` of ``shape``: refuse a move along a sharded dimension (the
        local shards would be another coordinate's), then retire the world built now."""
        from gossiprec.trainer.collectives.managed import retire_managed_world

        if shape.world_size == self.world_size:
            raise MeshShrinkRefused(f"this process built the {self.shape.shape_of.text} mesh as rank {self.rank}; a "
                                    f"plan now gives it rank {rank} of the same mesh: a mesh job keeps every rank's "
                                    "coordinate")
        rep = self.spec.names.index(self.spec.replicated[0])
        was, now = self.shape.coordinate(self.rank), shape.coordinate(rank)
        if was[:rep] + was[rep + 1:] != now[:rep] + now[rep + 1:]:
            raise MeshShrinkRefused(
                f"a plan makes rank {self.rank} at {dict(zip(self.spec.names, was))} of the {self.shape.shape_of.text} "
                f"mesh rank {rank} at {dict(zip(shape.names, now))} of the {shape.shape_of.text} mesh: a shrink "
                "may only drop replica groups, and this rank's local shards belong to its old coordinate")
        self.drop_barrier()
        retire_managed_world(f"the {self.shape.shape_of.text} mesh is retired: the job shrinks to "
                             f"{shape.shape_of.text}")
        self.retired.append((self.world, self.mesh))
        self.world, self.mesh = None, None

    def configure(self, epoch: int, store: Any, cancelled: Callable[[], str]) -> float:
        """Every managed group's backend for ``epoch`` (seconds it took)."""
        assert self.world is not None
        return self.world.configure(epoch, store, cancelled=cancelled)

    def abort(self, reason: str, epoch: int | None = None) -> None:
        """Interrupt the collectives of the current epoch (``epoch``: of that epoch and older ones)."""
        if self.world is not None:
            self.world.abort(reason, epoch=epoch)

    def aborted(self) -> bool:
        """Whether the current epoch's groups were aborted (a collective anywhere then raised or will)."""
        world = self.world
        return world is not None and bool(world.abort_reason)

    def issue_barrier(self) -> None:
        """Issue the commit barrier: a one-element all-reduce over every rank of the mesh, on the epoch's
        default group, waited by :meth:`settle_barrier` (before the step's optimizer: the step computes
        meanwhile). Raises as any collective of an aborted epoch does."""
        import torch
        import torch.distributed as dist

        if self._one is None:
            self._one = torch.zeros(1, device=self.spec.device)  # (NCCL reduces CUDA tensors only)
        self._barrier = dist.all_reduce(self._one, async_op=True)

    def settle_barrier(self) -> bool:
        """Wait for the commit barrier issued this step; True once every rank has entered it, False if
        none is pending. Raises :class:`~gossiprec.trainer.collectives.groups.CollectiveAborted` when a view change
        interrupts it."""
        work, self._barrier = self._barrier, None
        if work is None:
            return False
        work.wait()
        return True

    def drop_barrier(self) -> None:
        """A recovery begins: the barrier issued in the interrupted epoch is not waited for."""
        self._barrier = None

    def reset_modules(self, objects: Mapping[str, Any]) -> int:
        """After an interrupted step: put every FSDP2 root module among ``objects`` back to its idle,
        resharded state (torch's ``reset_iter_state``), or the next forward would skip an all-gather that
        the replacement does (a collective mismatch). Work still pending on the aborted backend is
        dropped, not waited for (it never completes), and so is the commit barrier. Returns the modules reset."""
        self.drop_barrier()
        from gossiprec.trainer.collectives.managed import ManagedWork

        done = 0
        for obj in objects.values():
            reset = getattr(obj, "reset_iter_state", None)
            if reset is None:
                continue
            root = obj._get_fsdp_state() if hasattr(obj, "_get_fsdp_state") else None
            if root is not None and not hasattr(getattr(root, "_comm_ctx", None), "all_gather_state"):
                continue  # never ran a forward (a spare that just took its rank): idle already, nothing to reset
            for module in obj.modules():
                state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
                for group in getattr(state, "_fsdp_param_groups", ()) if state is not None else ():
                    result = group._all_gather_result
                    if result is not None and isinstance(result.all_gather_work, ManagedWork):
                        group._all_gather_result = None
            reset()
            done += 1
        return done

    @property
    def hung(self) -> int:
        """Collectives left pending on an aborted backend (a retired world's too): leave the process with
        ``os._exit``."""
        worlds = [w for w, _ in self.retired] + ([self.world] if self.world is not None else [])
        return sum(w.hung for w in worlds)
