"""A job's device mesh as the launch carries it: ``--mesh NAME=SIZE,NAME=SIZE``, and the topology it implies.

Every launcher takes the same option (``gossiprec spec --mesh``, ``gossiprec run --nnodes ... --mesh``,
torchrun's ``--rdzv-conf mesh=...``, ``GOSSIPREC_MESH``) and reads it with :func:`parse_mesh`: the
dimensions in the mesh's order, each ``NAME=SIZE``, separated by ``,`` or ``;`` (torchrun splits its
``--rdzv-conf`` at commas, so there write ``mesh=dp=2;tp=2``), the replicate (data-parallel) dimension
first: ``replicate=2,shard=4`` is HSDP over 8 ranks, ``dp=2,tp=2`` data parallelism over 2 tensor-parallel
pairs, and a single ``replicate=N`` is plain DDP over N ranks.

:class:`MeshShape` is the pure data of a mesh (names, sizes, the replicate dimension(s)), and
:meth:`MeshShape.topology` the agents' :class:`~gossiprec.core.topology.JobTopology`: ranks are laid out
row-major over the mesh (as ``torch.arange(n).reshape(shape)``, what ``init_device_mesh`` does), and each
line of the mesh along the replicate dimension(s) is one replica group. The trainer's
:class:`~gossiprec.trainer.collectives.sharded.MeshSpec` derives its topology here too, so the launched
mesh and the trainer's agree exactly when their replica groups do. :meth:`MeshShape.job_toml` is the job
spec's ``[job]`` table for the mesh.

Pure data; bad input raises :class:`~gossiprec.errors.ConfigError` saying what was expected.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Sequence

from gossiprec.core.topology import JobTopology, is_int
from gossiprec.errors import ConfigError

MESH_SYNTAX = ("NAME=SIZE[,NAME=SIZE...] (',' or ';' between dimensions), the replicate (data-parallel) "
               "dimension first, e.g. replicate=2,shard=4 or dp=2,tp=2")
"""What a ``--mesh`` value looks like (said by every refusal)."""
_DIM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=([+-]?\d+)$")


@dataclass(frozen=True, slots=True)
class MeshShape:
    """A device mesh: ``names`` and ``sizes`` (one per dimension, in the mesh's order) and ``replicate``,
    the dimension(s) along which ranks hold the same shard (empty: the first dimension)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    replicate: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.sizes, tuple) or not self.sizes or not all(
                is_int(n) and n >= 1 for n in self.sizes):
            raise ConfigError(f"mesh sizes must be a non-empty tuple of ints >= 1, got {self.sizes!r}")
        if not isinstance(self.names, tuple) or len(self.names) != len(self.sizes) or len(set(self.names)) != len(
                self.names) or not all(isinstance(n, str) and n for n in self.names):
            raise ConfigError(f"mesh names must be {len(self.sizes)} distinct non-empty strings (one per "
                              f"dimension of {self.sizes}), got {self.names!r}")
        if not self.replicate:
            object.__setattr__(self, "replicate", self.names[:1])
        if not isinstance(self.replicate, tuple) or any(r not in self.names for r in self.replicate) or len(
                set(self.replicate)) != len(self.replicate):
            raise ConfigError(f"replicate must name distinct mesh dimension(s) among {self.names}, "
                              f"got {self.replicate!r}")

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def text(self) -> str:
        """The mesh as ``--mesh`` writes it (``replicate=2,shard=2``), when the replicate dimension is
        the first and only one; else with the replicate dimension(s) named (``a=2,b=2 replicate b``)."""
        dims = ",".join(f"{n}={s}" for n, s in zip(self.names, self.sizes))
        return dims if self.replicate == self.names[:1] else f"{dims} replicate {','.join(self.replicate)}"

    def topology(self, *, allow_shrink: bool = False, min_replicas: int = 1) -> JobTopology:
        """The agents' job topology: one replica group per line of the mesh along the replicate dimension(s)."""
        rep = [self.names.index(n) for n in self.replicate]
        rest = [i for i in range(len(self.sizes)) if i not in rep]
        strides = [math.prod(self.sizes[i + 1:]) for i in range(len(self.sizes))]
        groups: list[tuple[int, ...]] = []
        for outer in itertools.product(*(range(self.sizes[i]) for i in rest)):
            base = sum(c * strides[i] for c, i in zip(outer, rest))
            groups.append(tuple(base + sum(c * strides[i] for c, i in zip(inner, rep))
                                for inner in itertools.product(*(range(self.sizes[i]) for i in rep))))
        return JobTopology(self.world_size, tuple(groups), allow_shrink, min_replicas)

    def grid(self) -> tuple[int, int] | None:
        """``(dp, tp_pp)`` of the job spec's grid whose replica groups are this mesh's, or None when no
        grid expresses them (a replicate dimension that is not the first)."""
        groups = self.topology().replica_groups
        dp = len(groups[0])
        tp_pp = len(groups)
        return (dp, tp_pp) if JobTopology.grid(dp, tp_pp).replica_groups == groups else None

    def job_toml(self, *, allow_shrink: bool = False, min_replicas: int = 1) -> str:
        """The job spec's ``[job]`` table for this mesh (ConfigError when no grid expresses it);
        ``min_replicas``, written when above 1: the fewest replica groups a shrink may leave."""
        shrink = "true" if allow_shrink else "false"
        grid = self.grid()
        if grid is None:
            raise ConfigError(f"mesh {self.text} has replica groups {describe_groups(self.topology())}, which a "
                              "job spec's grid (rank = dp_index * tp_pp + shard) cannot express: put the "
                              "replicate dimension first")
        self.topology(min_replicas=min_replicas)  # (ConfigError for a min_replicas the mesh cannot hold)
        dp, tp_pp = grid
        floor = f"min_replicas = {min_replicas}\n" if min_replicas != 1 else ""
        if tp_pp == 1:
            return f'[job]\ntopology = "ddp"\nallow_shrink = {shrink}\n{floor}'
        return f'[job]\ntopology = "grid"\ndp = {dp}\ntp_pp = {tp_pp}\nallow_shrink = {shrink}\n{floor}'


def parse_mesh(text: str, trainers: int | None = None, *, where: str = "--mesh") -> MeshShape:
    """The mesh a launcher's ``--mesh`` value names (see the module docstring); ``trainers``: the job's
    trainer count, which the sizes must multiply to. ConfigError, naming ``where``, otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{where} is empty: expected {MESH_SYNTAX}")
    names: list[str] = []
    sizes: list[int] = []
    for item in re.split(r"[,;]", text.strip()):
        m = _DIM.match(item.strip())
        if m is None:
            raise ConfigError(f"{where} {text!r}: {item.strip()!r} is not NAME=SIZE; expected {MESH_SYNTAX}")
        name, size = m.group(1), int(m.group(2))
        if size < 1:
            raise ConfigError(f"{where} {text!r}: dimension {name!r} has size {size}; every size must be an "
                              "integer >= 1")
        if name in names:
            raise ConfigError(f"{where} {text!r} names the dimension {name!r} twice; each dimension once")
        names.append(name)
        sizes.append(size)
    mesh = MeshShape(tuple(names), tuple(sizes))
    if trainers is not None and mesh.world_size != trainers:
        product = " x ".join(map(str, sizes))
        raise ConfigError(f"{where} {text!r} makes {mesh.world_size} ranks ({product}) but the job has "
                          f"{trainers} trainer{'s' if trainers != 1 else ''} (slots minus spares): the sizes must "
                          "multiply to the trainer count")
    return mesh


def describe_groups(topology: JobTopology) -> str:
    """``[[0, 2], [1, 3]]``: the replica groups as a message shows them."""
    return str([list(g) for g in topology.replica_groups])


def describe_topology(world_size: int, replica_groups: Sequence[Sequence[int]]) -> str:
    """A launched job's topology in words, as the mesh that makes it: ``replicate=2,shard=2 (replica groups
    [[0, 2], [1, 3]])`` for a grid, ``replicate=4 (plain DDP, replica groups [[0, 1, 2, 3]])`` for one group."""
    groups = tuple(sorted(tuple(sorted(int(r) for r in g)) for g in replica_groups)) or (tuple(range(world_size)),)
    shown = str([list(g) for g in groups])
    sizes = {len(g) for g in groups}
    if len(sizes) == 1 and world_size == len(groups) * len(groups[0]):
        dp, tp_pp = len(groups[0]), len(groups)
        if tp_pp == 1:
            return f"replicate={dp} (plain DDP, replica groups {shown})"
        if JobTopology.grid(dp, tp_pp).replica_groups == groups:
            return f"replicate={dp},shard={tp_pp} (replica groups {shown})"
    return f"{world_size} ranks in replica groups {shown}"
