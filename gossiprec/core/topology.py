"""Who may hold which rank, and which ranks hold identical state.

Theory of operation
-------------------
Two records describe a job to the election (:mod:`gossiprec.core.election`):

* :class:`Member` is one agent of an agreed view: a unique ``node`` id, its ``role`` (``"trainer"``
  holding ``rank``, or ``"spare"`` waiting with ``rank=None``) and where it runs (``host``, ``rack``),
  which the election uses to pick a nearby spare.
* :class:`JobTopology` says which ranks are data-parallel replicas of each other. Each *replica group*
  lists the ranks that hold bit-identical state (same tensor/pipeline coordinates, different
  data-parallel index). Plain DDP over ``n`` ranks is one group ``(0..n-1)``; a ``dp x tp_pp`` grid laid
  out as ``rank = dp_index * tp_pp + shard`` has ``tp_pp`` groups ``(shard, shard + tp_pp, ...)``.

Groups are stored in canonical form (each group sorted, groups sorted by their smallest rank), so two
topologies built from the same groups in any order compare and hash equal. The *column* of a rank is its
index inside its canonical group; for a grid, column ``d`` is exactly data-parallel index ``d``, i.e. the
ranks ``d*tp_pp .. d*tp_pp + tp_pp - 1``. Shrinking drops whole columns so that every group keeps the
same size.

Everything here is pure data; invalid input raises :class:`~gossiprec.errors.ConfigError`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from gossiprec.errors import ConfigError

Role = Literal["trainer", "spare"]
TRAINER: Role = "trainer"
SPARE: Role = "spare"


def is_int(value: object) -> bool:
    """True for a real ``int`` (``bool`` is rejected: ``True`` is not a rank)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class Member:
    """One agent of an agreed view.

    ``node``: unique, non-empty node id. ``role``: ``"trainer"`` (then ``rank`` is an int >= 0) or
    ``"spare"`` (then ``rank`` is None). ``host`` / ``rack``: placement labels, compared for equality
    only (a host is taken to sit in one rack; the election keys locality by ``(rack, host)``).
    """

    node: str
    role: Role
    rank: int | None
    host: str
    rack: str

    def __post_init__(self) -> None:
        if not isinstance(self.node, str) or not self.node:
            raise ConfigError(f"member node id must be a non-empty string, got {self.node!r}")
        if self.role == TRAINER:
            if not is_int(self.rank) or self.rank < 0:  # type: ignore[operator]
                raise ConfigError(
                    f"trainer {self.node!r} needs an integer rank >= 0, got {self.rank!r}"
                )
        elif self.role == SPARE:
            if self.rank is not None:
                raise ConfigError(
                    f"spare {self.node!r} must have rank=None, got {self.rank!r}: "
                    "only trainers hold ranks"
                )
        else:
            raise ConfigError(
                f"member {self.node!r} has role {self.role!r}; use 'trainer' or 'spare'"
            )
        if not isinstance(self.host, str) or not isinstance(self.rack, str):
            raise ConfigError(f"member {self.node!r}: host and rack must be strings")

    @property
    def is_trainer(self) -> bool:
        return self.role == TRAINER

    @property
    def locality(self) -> tuple[str, str]:
        """``(rack, host)``: the key the election uses for same-host matching."""
        return (self.rack, self.host)


@dataclass(frozen=True, slots=True)
class JobTopology:
    """Which ranks hold identical state, and whether the data-parallel size may shrink.

    ``world_size``: number of ranks, >= 1. ``replica_groups``: every rank in ``range(world_size)`` in
    exactly one non-empty group (normalised to canonical order on construction). ``allow_shrink``: when
    spares run out, drop whole data-parallel columns instead of stopping (needs equal-size groups).
    ``min_replicas``: the smallest group size a shrink may leave, 1 <= min_replicas <= group size.
    """

    world_size: int
    replica_groups: tuple[tuple[int, ...], ...]
    allow_shrink: bool
    min_replicas: int = 1

    def __post_init__(self) -> None:
        if not is_int(self.world_size) or self.world_size < 1:
            raise ConfigError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        groups = _canonical_groups(self.replica_groups)
        object.__setattr__(self, "replica_groups", groups)
        seen: set[int] = set()
        for group in groups:
            if not group:
                raise ConfigError("replica groups must be non-empty; remove the empty group")
            for rank in group:
                if not is_int(rank) or not 0 <= rank < self.world_size:
                    raise ConfigError(
                        f"rank {rank!r} in replica groups is outside range(0, {self.world_size})"
                    )
                if rank in seen:
                    raise ConfigError(f"rank {rank} appears in more than one replica group")
                seen.add(rank)
        missing = sorted(set(range(self.world_size)) - seen)
        if missing:
            raise ConfigError(
                f"ranks {missing} are in no replica group; every rank needs exactly one "
                "(a rank with no replica is a group of its own)"
            )
        if not isinstance(self.allow_shrink, bool):
            raise ConfigError(f"allow_shrink must be a bool, got {self.allow_shrink!r}")
        sizes = sorted({len(g) for g in groups})
        if not is_int(self.min_replicas) or self.min_replicas < 1:
            raise ConfigError(f"min_replicas must be an integer >= 1, got {self.min_replicas!r}")
        if self.min_replicas > sizes[0]:
            raise ConfigError(
                f"min_replicas={self.min_replicas} exceeds the smallest replica group "
                f"({sizes[0]} ranks); lower min_replicas or add replicas"
            )
        if self.allow_shrink and len(sizes) > 1:
            raise ConfigError(
                f"allow_shrink needs replica groups of equal size, got sizes {sizes}: shrinking drops "
                "whole data-parallel columns; disable shrinking or fix the groups"
            )

    # -- constructors -------------------------------------------------------------------------------

    @classmethod
    def ddp(cls, n: int, *, allow_shrink: bool = False, min_replicas: int = 1) -> JobTopology:
        """Plain data parallelism: ``n`` ranks, one replica group ``(0, ..., n-1)``."""
        if not is_int(n) or n < 1:
            raise ConfigError(f"ddp needs n >= 1 ranks, got {n!r}")
        return cls(n, (tuple(range(n)),), allow_shrink, min_replicas)

    @classmethod
    def grid(
        cls, dp: int, tp_pp: int, *, allow_shrink: bool = False, min_replicas: int = 1
    ) -> JobTopology:
        """``dp`` data-parallel replicas of a ``tp_pp``-way sharded model (HSDP, TP x DP, PP x DP).

        Ranks are laid out as ``rank = dp_index * tp_pp + shard``; group ``shard`` holds
        ``(shard, tp_pp + shard, ..., (dp-1)*tp_pp + shard)``.
        """
        if not is_int(dp) or dp < 1 or not is_int(tp_pp) or tp_pp < 1:
            raise ConfigError(f"grid needs dp >= 1 and tp_pp >= 1, got dp={dp!r}, tp_pp={tp_pp!r}")
        groups = tuple(tuple(d * tp_pp + s for d in range(dp)) for s in range(tp_pp))
        return cls(dp * tp_pp, groups, allow_shrink, min_replicas)

    # -- queries ------------------------------------------------------------------------------------

    def group_index(self) -> dict[int, int]:
        """rank -> index of its replica group in :attr:`replica_groups`."""
        return {r: gi for gi, group in enumerate(self.replica_groups) for r in group}

    def column_index(self) -> dict[int, int]:
        """rank -> its column (position inside its canonical group; the DP index for a grid)."""
        return {r: ci for group in self.replica_groups for ci, r in enumerate(group)}

    def without_columns(self, dropped: Iterable[int]) -> tuple[dict[int, int], JobTopology]:
        """Drop whole columns; return (old rank -> new rank for kept ranks, the shrunk topology).

        New ranks are the kept ranks renumbered densely in ascending order, which keeps the grid
        layout ``rank = dp_index * tp_pp + shard``. Raises ConfigError when nothing would be left or
        a group would fall below ``min_replicas`` (the election checks this first and stops instead).
        """
        drop = set(dropped)
        column = self.column_index()
        kept = [r for r in range(self.world_size) if column[r] not in drop]
        if not kept:
            raise ConfigError("dropping these columns leaves no rank at all")
        remap = {old: new for new, old in enumerate(kept)}
        groups = tuple(tuple(remap[r] for r in g if r in remap) for g in self.replica_groups)
        return remap, JobTopology(len(kept), groups, self.allow_shrink, self.min_replicas)


def _canonical_groups(groups: object) -> tuple[tuple[int, ...], ...]:
    """Each group sorted ascending, groups sorted by their first rank (empty groups first)."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
        raise ConfigError(f"replica_groups must be a sequence of rank sequences, got {groups!r}")
    out: list[tuple[int, ...]] = []
    for group in groups:
        if isinstance(group, (str, bytes)) or not isinstance(group, Iterable):
            raise ConfigError(f"replica group must be a sequence of ranks, got {group!r}")
        members = tuple(group)
        if not all(is_int(r) for r in members):
            raise ConfigError(f"replica group {members!r} must contain integer ranks only")
        out.append(tuple(sorted(members)))
    out.sort(key=lambda g: (len(g) > 0, g[0] if g else -1))
    return tuple(out)
