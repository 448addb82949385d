"""The election: one pure function from an agreed view to a recovery plan.

Theory of operation
-------------------
After the agents agree on a new view (epoch + members), every survivor calls :func:`elect` with the
same inputs and must get the same :class:`Plan`; each publishes :meth:`Plan.digest` and a mismatch is
an invariant violation. So :func:`elect` reads no clock, no randomness and no global state, and never
depends on the order of its inputs: every collection is sorted before it is walked.

Steps, in order (ranks are *old* ranks until step 3, *new* ranks in the plan):

1. **Lost ranks.** A rank is lost when its previous holder is not a trainer of the new view. The other
   ranks are *survivors*; they keep their node.
2. **Replacements.** With at least as many spares as lost ranks, every lost rank gets a spare. The
   matching is topology-aware and exact per tier: first as many same-host pairs as possible, then
   same-rack, then any, where host/rack are those of the lost rank's previous holder (from
   ``previous_members``; unknown placement only matches in the last tier). Inside a tier and a
   locality bucket, lost ranks in ascending order take spares in ascending node-id order. Since a host
   sits in one rack, the buckets are disjoint complete bipartite graphs, so zipping each bucket is a
   maximum matching for that tier.
3. **Shrink.** With too few spares: if ``topology.allow_shrink`` is false, the plan is ``stop``.
   Otherwise whole data-parallel columns (see :mod:`gossiprec.core.topology`) are dropped so that all
   replica groups keep the same size: columns holding lost ranks are *saved* (their lost ranks get
   spares) greedily by fewest lost ranks first, ties by column index, which saves as many columns as
   the spares allow; the other columns with losses are dropped. A group left below
   ``min_replicas`` means ``stop``. Kept ranks are renumbered densely in ascending order (this keeps the
   grid layout ``rank = dp_index * tp_pp + shard``); survivors of dropped columns are *released*
   (they leave the trainer set but may still donate state during this recovery).
4. **Target step.** A holder is a survivor (kept or released) with a usable report (once some holder
   reports a step above 0, a report of step 0 with no bytes is not one: it holds nothing). It can serve its
   ``committed_step`` and, when it reports one, its ``inflight_step`` (a step whose state is complete
   locally but not yet committed globally). The job resumes at ONE global step, because shards of
   different groups must come from the same step and replicas in a group must be bit-identical. So the
   target is the largest step that every replica group can serve: ``max(intersection over groups of
   (union over its holders of servable steps))``. Whenever each group still holds every step between
   the global minimum and its own newest (lockstep training: survivors at most one step apart), this
   is "min over groups of the newest step the group holds"; unlike that formula it never picks a step
   some group cannot serve (state never rolls back). A holder not at the target (behind, or ahead
   with no copy of it) receives the target state like a replacement does. A group without any holder,
   or an empty intersection, makes the plan ``checkpoint``: the user's checkpoint-load callback
   restores the job; assignment and shrink still apply.
5. **Transfers.** Per replica group, the *donors* are the group's holders that can serve it and report
   the group's size ``B``, the most common ``state_bytes`` among those holders (ties to the smaller
   size): replicas are bit-identical, so a holder at the target with another size is suspect and
   receives too, and stripes from several donors always fit together. The *receivers* are the group's
   new-world ranks that are not donors: replacement spares, survivors behind or ahead of the target,
   survivors without a usable report. With fewer donors than receivers, donor ``i`` serves receivers
   ``i, i+d, i+2d, ...`` (every donor busy, loads differ by at most one). With at least as many donors,
   donors are dealt round-robin to receivers, so each serves one receiver and a receiver's transfer is
   striped over up to ``max_stripes`` donors (and at most ``state_bytes // min_stripe_bytes``, at least
   1). Stripe ``j`` of ``k`` covers ``[B*j//k, B*(j+1)//k)``, which tiles ``[0, B)`` exactly.
6. **Store node.** The rendezvous store of the new epoch runs on a trainer of the new world, chosen by
   rendezvous (highest-random-weight) hashing: ``sha256(msgpack(["gossiprec.store/1", epoch, node]))``
   is highest, skipping ``previous_store`` unless it is the only trainer. No fixed machine, spread over
   epochs, and computable by everyone.

Ranks, assignment and transfers in a :class:`Plan` use the NEW numbering, except ``rank_remap`` keys
and ``orphan_groups``, which use the previous epoch's numbering. ``Transfer.donor_rank`` is None for a
released donor (it has no new rank).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from gossiprec.core.topology import JobTopology, Member, is_int
from gossiprec.errors import ConfigError, DecodeError, ProtocolError

Action = Literal["resume", "shrink", "checkpoint", "stop"]

PLAN_FORMAT = "gossiprec.plan/1"
"""First element of the canonical plan encoding; bump it when the encoding or the rules change."""
STORE_SALT = "gossiprec.store/1"
DEFAULT_MAX_STRIPES = 4
DEFAULT_MIN_STRIPE_BYTES = 1 << 20
"""No stripe below 1 MiB: a rule of thumb (not measured) that a smaller stripe is not worth its own
connection."""


@dataclass(frozen=True, slots=True)
class StateReport:
    """What a survivor holds: state exactly "after step ``committed_step``" (>= 0), optionally a
    complete but uncommitted newer state ``inflight_step`` (> committed_step), and ``state_bytes``,
    the size of its serialised state (identical across replicas of one group at one step)."""

    node: str
    rank: int | None
    committed_step: int
    inflight_step: int | None
    state_bytes: int

    def __post_init__(self) -> None:
        if not is_int(self.committed_step) or self.committed_step < 0:
            raise ConfigError(
                f"report from {self.node!r}: committed_step must be an int >= 0, "
                f"got {self.committed_step!r}"
            )
        if self.inflight_step is not None and (
            not is_int(self.inflight_step) or self.inflight_step <= self.committed_step
        ):
            raise ConfigError(
                f"report from {self.node!r}: inflight_step must be None or an int above "
                f"committed_step={self.committed_step}, got {self.inflight_step!r}"
            )
        if not is_int(self.state_bytes) or self.state_bytes < 0:
            raise ConfigError(
                f"report from {self.node!r}: state_bytes must be an int >= 0, got {self.state_bytes!r}"
            )
        if self.rank is not None and (not is_int(self.rank) or self.rank < 0):
            raise ConfigError(f"report from {self.node!r}: rank must be None or an int >= 0")

    def servable(self) -> tuple[int, ...]:
        """The steps this holder can hand out, ascending."""
        if self.inflight_step is None:
            return (self.committed_step,)
        return (self.committed_step, self.inflight_step)


@dataclass(frozen=True, slots=True)
class Transfer:
    """Copy bytes ``[offset, offset+length)`` of the donor's state at ``step`` to the receiver."""

    receiver_rank: int
    receiver_node: str
    donor_rank: int | None
    donor_node: str
    offset: int
    length: int
    step: int

    def encode(self) -> list[Any]:
        return [
            self.receiver_rank,
            self.receiver_node,
            self.donor_rank,
            self.donor_node,
            self.offset,
            self.length,
            self.step,
        ]


@dataclass(frozen=True, slots=True)
class Plan:
    """The recovery plan of one epoch; every survivor computes the same one.

    ``action``: ``resume`` (same world size), ``shrink`` (fewer data-parallel replicas), ``checkpoint``
    (some state is gone: load the user's checkpoint into the new world) or ``stop``. ``assignment`` and
    ``replacements`` are sorted ``(new rank, node)`` pairs; ``replica_groups`` is the new world's
    topology; ``rank_remap`` sorted ``(old rank, new rank)`` pairs of kept ranks (identity unless
    shrinking; empty for ``stop``); ``released`` the survivors dropped by a shrink; ``orphan_groups``
    the replica groups (old numbering) without any holder; ``store_node`` the host of this epoch's
    rendezvous store (None for ``stop``).
    """

    epoch: int
    action: Action
    reason: str
    world_size: int
    replica_groups: tuple[tuple[int, ...], ...]
    assignment: tuple[tuple[int, str], ...]
    replacements: tuple[tuple[int, str], ...]
    transfers: tuple[Transfer, ...]
    target_step: int | None
    rank_remap: tuple[tuple[int, int], ...]
    released: tuple[str, ...]
    orphan_groups: tuple[tuple[int, ...], ...]
    store_node: str | None

    def to_wire(self) -> list[Any]:
        """The plan as it crosses a process boundary (the trainer's events and status): :meth:`canonical`;
        :meth:`from_wire` reads it back, checking every field."""
        return self.canonical()

    @classmethod
    def from_wire(cls, obj: Any) -> Plan:
        """The plan :meth:`to_wire` encoded; :class:`~gossiprec.errors.DecodeError` for anything else
        (another format tag included: a peer of another version)."""
        if type(obj) is not list or len(obj) != 14:
            raise DecodeError("bad_plan", f"a plan is a list of 14 fields, got {type(obj).__name__}")
        if obj[0] != PLAN_FORMAT:
            raise DecodeError("bad_plan", f"plan format {str(obj[0])[:40]!r}, this process reads {PLAN_FORMAT!r}")
        (_, epoch, action, reason, world, groups, assignment, replacements, transfers, target, remap, released,
         orphans, store) = obj
        try:
            plan = cls(
                epoch=_int(epoch, "epoch"), action=_action(action), reason=_str(reason, "reason"),
                world_size=_int(world, "world_size"), replica_groups=_groups(groups, "replica_groups"),
                assignment=_pairs(assignment, "assignment", str),
                replacements=_pairs(replacements, "replacements", str),
                transfers=tuple(_transfer(t) for t in _list(transfers, "transfers")),
                target_step=None if target is None else _int(target, "target_step"),
                rank_remap=_pairs(remap, "rank_remap", int),
                released=tuple(_str(n, "released") for n in _list(released, "released")),
                orphan_groups=_groups(orphans, "orphan_groups"),
                store_node=None if store is None else _str(store, "store_node"))
        except (TypeError, ValueError) as exc:
            raise DecodeError("bad_plan", str(exc)) from None
        return plan

    def canonical(self) -> list[Any]:
        """The plan as a msgpack-ready list, fields in declaration order after a format tag.

        Encoding: one msgpack array ``[PLAN_FORMAT, epoch, action, reason, world_size, replica_groups,
        assignment, replacements, transfers, target_step, rank_remap, released, orphan_groups,
        store_node]``; tuples and pairs are arrays, strings UTF-8 ``str``, integers in msgpack's
        shortest form, None is nil, each transfer ``[receiver_rank, receiver_node, donor_rank,
        donor_node, offset, length, step]``. All sequences are already in sorted order.
        """
        return [
            PLAN_FORMAT,
            self.epoch,
            self.action,
            self.reason,
            self.world_size,
            [list(g) for g in self.replica_groups],
            [list(p) for p in self.assignment],
            [list(p) for p in self.replacements],
            [t.encode() for t in self.transfers],
            self.target_step,
            [list(p) for p in self.rank_remap],
            list(self.released),
            [list(g) for g in self.orphan_groups],
            self.store_node,
        ]

    def canonical_bytes(self) -> bytes:
        out = msgpack.packb(self.canonical(), use_bin_type=True)
        assert isinstance(out, bytes)
        return out

    def digest(self) -> str:
        """Hex sha256 of :meth:`canonical_bytes`; equal plans have equal digests on every node."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view for people (logs, ``gossiprec status``; rank keys become strings). Programs
        read :meth:`to_wire`."""
        return {
            "epoch": self.epoch,
            "action": self.action,
            "reason": self.reason,
            "world_size": self.world_size,
            "replica_groups": [list(g) for g in self.replica_groups],
            "assignment": {str(r): n for r, n in self.assignment},
            "replacements": {str(r): n for r, n in self.replacements},
            "transfers": [
                {
                    "receiver_rank": t.receiver_rank,
                    "receiver_node": t.receiver_node,
                    "donor_rank": t.donor_rank,
                    "donor_node": t.donor_node,
                    "offset": t.offset,
                    "length": t.length,
                    "step": t.step,
                }
                for t in self.transfers
            ],
            "target_step": self.target_step,
            "rank_remap": {str(o): n for o, n in self.rank_remap},
            "released": list(self.released),
            "orphan_groups": [list(g) for g in self.orphan_groups],
            "store_node": self.store_node,
            "digest": self.digest(),
        }

    def rank_of(self, node: str) -> int | None:
        """The node's rank in the new world, or None when it is not a trainer."""
        for rank, holder in self.assignment:
            if holder == node:
                return rank
        return None

    def next_topology(self, previous: JobTopology) -> JobTopology:
        """The topology of the new world (same shrink policy as ``previous``)."""
        if self.action == "stop":
            raise ProtocolError(f"plan of epoch {self.epoch} stops the job; there is no next topology")
        return JobTopology(
            self.world_size, self.replica_groups, previous.allow_shrink, previous.min_replicas
        )


# -- reading a plan back (from another process) ------------------------------------------------------

_MAX_WIRE = 1 << 62


def _list(v: Any, what: str) -> list[Any]:
    if type(v) is not list:
        raise ValueError(f"{what} must be a list")
    return v


def _int(v: Any, what: str) -> int:
    if type(v) is not int or not 0 <= v <= _MAX_WIRE:
        raise ValueError(f"{what} must be an integer 0..2**62, got {str(v)[:30]}")
    return v


def _str(v: Any, what: str) -> str:
    if type(v) is not str or len(v) > 4096:
        raise ValueError(f"{what} must be a string of at most 4096 characters")
    return v


def _action(v: Any) -> Action:
    if v not in ("resume", "shrink", "checkpoint", "stop"):
        raise ValueError(f"unknown plan action {str(v)[:30]!r}")
    return v  # type: ignore[no-any-return]


def _groups(v: Any, what: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(_int(r, what) for r in _list(g, what)) for g in _list(v, what))


def _pairs(v: Any, what: str, second: type) -> tuple[tuple[int, Any], ...]:
    out = []
    for p in _list(v, what):
        if type(p) is not list or len(p) != 2:
            raise ValueError(f"{what} must be a list of pairs")
        out.append((_int(p[0], what), _str(p[1], what) if second is str else _int(p[1], what)))
    return tuple(out)


def _transfer(v: Any) -> Transfer:
    if type(v) is not list or len(v) != 7:
        raise ValueError("a transfer is a list of 7 fields")
    recv_rank, recv_node, donor_rank, donor_node, offset, length, step = v
    return Transfer(_int(recv_rank, "receiver_rank"), _str(recv_node, "receiver_node"),
                    None if donor_rank is None else _int(donor_rank, "donor_rank"), _str(donor_node, "donor_node"),
                    _int(offset, "offset"), _int(length, "length"), _int(step, "step"))


# -- the election -----------------------------------------------------------------------------------


def elect(
    view_epoch: int,
    members: Iterable[Member],
    previous_assignment: Mapping[int, str],
    reports: Mapping[str, StateReport],
    topology: JobTopology,
    *,
    previous_members: Mapping[str, Member] | None = None,
    previous_store: str | None = None,
    max_stripes: int = DEFAULT_MAX_STRIPES,
    min_stripe_bytes: int = DEFAULT_MIN_STRIPE_BYTES,
) -> Plan:
    """Compute the recovery plan for the view ``(view_epoch, members)``; see the module docstring.

    ``previous_assignment``: rank -> node before this view, covering ``range(topology.world_size)``.
    ``reports``: node -> its :class:`StateReport`; a report is ignored unless it is keyed by its own
    node and names the rank that node held. ``previous_members``: node -> Member of the previous view,
    for the placement of lost holders. Raises :class:`ProtocolError` when the inputs contradict each
    other (a bug in the caller, not a fault to recover from).
    """
    if not is_int(view_epoch) or view_epoch < 0:
        raise ProtocolError(f"view_epoch must be an int >= 0, got {view_epoch!r}")
    if not is_int(max_stripes) or max_stripes < 1:
        raise ConfigError(f"max_stripes must be an int >= 1, got {max_stripes!r}")
    if not is_int(min_stripe_bytes) or min_stripe_bytes < 1:
        raise ConfigError(f"min_stripe_bytes must be an int >= 1, got {min_stripe_bytes!r}")
    view = _index_view(members)
    prev = _check_assignment(previous_assignment, topology, view)
    placement = {} if previous_members is None else dict(previous_members)

    survivors = sorted(r for r, node in prev.items() if node in view and view[node].is_trainer)
    lost = sorted(set(prev) - set(survivors))
    spares = sorted(node for node, m in view.items() if not m.is_trainer)

    # -- steps 2 and 3: who fills which rank ------------------------------------------------------
    dropped: list[int] = []
    to_replace = lost
    if len(spares) < len(lost):
        gone = _shards_lost(topology, lost)
        if gone:  # what is really missing: no spare could be given this state
            return _stop(
                view_epoch,
                f"stop: {gone}: no surviving replica holds that state (ranks {lost} lost, {len(spares)} "
                "spare(s) in the view); resume from a checkpoint (on_no_replica), and run more replicas "
                "per shard, each on another host",
            )
        if not topology.allow_shrink:
            return _stop(
                view_epoch,
                f"stop: ranks {lost} lost but the view has {len(spares)} spare(s) and shrinking is "
                "disabled (allow_shrink=False); start more spares or allow shrinking",
            )
        column = topology.column_index()
        to_replace, dropped = _choose_columns(lost, len(spares), column)
        group_size = len(topology.replica_groups[0])
        left = group_size - len(dropped)
        if left < topology.min_replicas:
            return _stop(
                view_epoch,
                f"stop: ranks {lost} lost with {len(spares)} spare(s); shrinking would drop "
                f"data-parallel columns {dropped} and leave {left} replica(s) per group, below "
                f"min_replicas={topology.min_replicas}; start more spares or lower min_replicas",
            )
    matched = _match_spares(to_replace, spares, prev, placement, view)

    if dropped:
        remap, new_topology = topology.without_columns(dropped)
    else:
        remap, new_topology = {r: r for r in prev}, topology
    holder_of = {r: matched[r][0] if r in matched else prev[r] for r in remap}
    assignment = tuple(sorted((remap[r], node) for r, node in holder_of.items()))
    replacements = tuple(sorted((remap[r], spare) for r, (spare, _) in matched.items()))
    released = tuple(sorted(prev[r] for r in survivors if r not in remap))
    store = _store_node(view_epoch, [node for _, node in assignment], previous_store)

    # -- step 4: target step ------------------------------------------------------------------------
    usable = {
        r: reports[prev[r]]
        for r in survivors
        if prev[r] in reports and reports[prev[r]].node == prev[r] and reports[prev[r]].rank == r
    }
    ignored = len(survivors) - len(usable)
    if any(rep.committed_step > 0 or rep.inflight_step is not None for rep in usable.values()):
        # once a holder has trained, a report of step 0 with no bytes holds nothing (a spare given a rank
        # that never received its state, a trainer that dropped it): the job's initial state only while
        # every holder is still at step 0 (ranks that never committed, say after a view change at start-up)
        usable = {r: rep for r, rep in usable.items() if rep.committed_step > 0 or rep.state_bytes > 0}
    groups = topology.replica_groups
    servable_by_group = [
        sorted({s for r in g if r in usable for s in usable[r].servable()}) for g in groups
    ]
    orphans = tuple(g for g, steps in zip(groups, servable_by_group) if not steps)
    common = set(servable_by_group[0]).intersection(*servable_by_group[1:])

    summary = _summary(lost, matched, remap, dropped, released, ignored, len(spares))
    transfers: list[Transfer] = []
    target: int | None = None
    if orphans or not common:
        action: Action = "checkpoint"
        if orphans:
            why = f"replica group(s) {list(orphans)} have no surviving holder with a usable report"
        else:
            why = "no step that every replica group can serve (" + "; ".join(
                f"group {g}: steps {s}" for g, s in zip(groups, servable_by_group)
            ) + ")"
        reason = f"checkpoint: {why}; load the last checkpoint into the new world; {summary}"
    else:
        target = max(common)
        # -- step 5: transfers ----------------------------------------------------------------------
        receivers_total = 0
        for group in groups:
            at_target = [r for r in group if r in usable and target in usable[r].servable()]
            sizes = Counter(usable[r].state_bytes for r in at_target)  # non-empty: target is common
            size = min(sizes, key=lambda b: (-sizes[b], b))
            donors = [r for r in at_target if usable[r].state_bytes == size]
            donor_set = set(donors)
            receivers = [(remap[r], holder_of[r]) for r in group if r in remap and r not in donor_set]
            receivers_total += len(receivers)
            transfers += _spread(
                receivers,
                [(remap.get(r), prev[r]) for r in donors],
                size,
                target,
                max_stripes,
                min_stripe_bytes,
            )
        transfers.sort(key=lambda t: (t.receiver_rank, t.offset))
        action = "shrink" if dropped else "resume"
        head = (
            f"shrink {topology.world_size} -> {new_topology.world_size} ranks at step {target}"
            if dropped
            else f"resume at step {target}"
        )
        reason = (
            f"{head}: {summary}; {receivers_total} rank(s) receive state in "
            f"{len(transfers)} transfer(s)"
        )
    return Plan(
        epoch=view_epoch,
        action=action,
        reason=reason,
        world_size=new_topology.world_size,
        replica_groups=new_topology.replica_groups,
        assignment=assignment,
        replacements=replacements,
        transfers=tuple(transfers),
        target_step=target,
        rank_remap=tuple(sorted(remap.items())),
        released=released,
        orphan_groups=orphans,
        store_node=store,
    )


# -- helpers ----------------------------------------------------------------------------------------


def _index_view(members: Iterable[Member]) -> dict[str, Member]:
    view: dict[str, Member] = {}
    rank_holder: dict[int, str] = {}
    for m in members:
        if not isinstance(m, Member):
            raise ProtocolError(f"view members must be Member records, got {type(m).__name__}")
        if m.node in view:
            raise ProtocolError(f"node {m.node!r} appears twice in the view; views list each once")
        view[m.node] = m
        if m.rank is not None:
            other = rank_holder.setdefault(m.rank, m.node)
            if other != m.node:
                raise ProtocolError(f"rank {m.rank} held by both {other!r} and {m.node!r} in the view")
    return view


def _check_assignment(
    previous: Mapping[int, str], topology: JobTopology, view: Mapping[str, Member]
) -> dict[int, str]:
    prev = dict(previous)
    if sorted(prev) != list(range(topology.world_size)):
        raise ProtocolError(
            f"previous assignment covers ranks {sorted(prev)}, the topology needs exactly "
            f"0..{topology.world_size - 1}; pass the assignment of the previous epoch"
        )
    if len(set(prev.values())) != len(prev):
        raise ProtocolError("previous assignment gives one node several ranks")
    by_node = {node: r for r, node in prev.items()}
    for node in sorted(view):
        m = view[node]
        if m.is_trainer and by_node.get(node) != m.rank:
            raise ProtocolError(
                f"trainer {node!r} claims rank {m.rank} in the view but held "
                f"{by_node.get(node)!r} before; only a plan makes trainers"
            )
    return prev


def _choose_columns(
    lost: list[int], spares: int, column: Mapping[int, int]
) -> tuple[list[int], list[int]]:
    """Save the columns with the fewest losses while spares last; return (ranks to fill, dropped)."""
    per_column = Counter(column[r] for r in lost)
    saved: set[int] = set()
    budget = spares
    for col in sorted(per_column, key=lambda c: (per_column[c], c)):
        if per_column[col] > budget:
            break
        saved.add(col)
        budget -= per_column[col]
    dropped = sorted(set(per_column) - saved)
    return [r for r in lost if column[r] in saved], dropped


_TIERS = ("same host", "same rack", "other placement")


def _match_spares(
    lost: list[int],
    spares: list[str],
    prev: Mapping[int, str],
    placement: Mapping[str, Member],
    view: Mapping[str, Member],
) -> dict[int, tuple[str, str]]:
    """Lost rank -> (spare node, tier name); maximum matching per tier, see the module docstring.

    The lost holder's placement comes from ``placement`` (the previous view), else from the new view
    (a holder demoted to spare); unknown placement only matches in the last tier. The caller
    guarantees ``len(spares) >= len(lost)``.
    """
    keys: tuple[Callable[[Member], tuple[str, ...]], ...] = (
        lambda m: (m.rack, m.host),
        lambda m: (m.rack,),
        lambda m: (),
    )
    free = list(spares)
    todo = list(lost)
    out: dict[int, tuple[str, str]] = {}
    for tier, key in enumerate(keys):
        buckets: dict[tuple[str, ...], list[int]] = {}
        for r in todo:
            holder = placement.get(prev[r]) or view.get(prev[r])
            if holder is not None:
                buckets.setdefault(key(holder), []).append(r)
            elif tier == len(keys) - 1:
                buckets.setdefault((), []).append(r)
        spare_buckets: dict[tuple[str, ...], list[str]] = {}
        for node in free:
            spare_buckets.setdefault(key(view[node]), []).append(node)
        for bucket in sorted(buckets):
            for r, node in zip(buckets[bucket], spare_buckets.get(bucket, [])):
                out[r] = (node, _TIERS[tier])
        todo = [r for r in todo if r not in out]
        taken = {node for node, _ in out.values()}
        free = [node for node in free if node not in taken]
    return out


def _spread(
    receivers: list[tuple[int, str]],
    donors: list[tuple[int | None, str]],
    size: int,
    step: int,
    max_stripes: int,
    min_stripe_bytes: int,
) -> list[Transfer]:
    """Deal donors to receivers (see step 5 of the module docstring)."""
    if not receivers:
        return []
    n_recv, n_don = len(receivers), len(donors)
    per: list[list[tuple[int | None, str]]] = [[] for _ in receivers]
    if n_don >= n_recv:
        cap = max(1, min(max_stripes, size // min_stripe_bytes))
        for j, donor in enumerate(donors[: n_recv * cap]):
            per[j % n_recv].append(donor)
    else:
        for i in range(n_recv):
            per[i].append(donors[i % n_don])
    out: list[Transfer] = []
    for (rank, node), chosen in zip(receivers, per):
        k = len(chosen)
        for j, (donor_rank, donor_node) in enumerate(chosen):
            start, end = size * j // k, size * (j + 1) // k
            out.append(Transfer(rank, node, donor_rank, donor_node, start, end - start, step))
    return out


def _store_node(epoch: int, trainers: list[str], previous: str | None) -> str:
    candidates = sorted(trainers)
    if len(candidates) > 1 and previous in candidates:
        candidates.remove(previous)

    def weight(node: str) -> bytes:
        return hashlib.sha256(msgpack.packb([STORE_SALT, epoch, node], use_bin_type=True)).digest()

    return max(candidates, key=lambda n: (weight(n), n))


def _summary(
    lost: list[int],
    matched: Mapping[int, tuple[str, str]],
    remap: Mapping[int, int],
    dropped: list[int],
    released: tuple[str, ...],
    ignored: int,
    spares: int,
) -> str:
    parts = [f"ranks lost {lost}" if lost else "no rank lost"]
    if matched:
        parts.append(
            "replaced "
            + ", ".join(f"{r}->{s} ({tier})" for r, (s, tier) in sorted(matched.items()))
        )
    if dropped:
        parts.append(
            f"{spares} spare(s) for {len(lost)} loss(es): dropped data-parallel columns {dropped}"
            + (f", released {list(released)}" if released else "")
        )
    if any(o != n for o, n in remap.items()):
        parts.append("ranks renumbered")
    if ignored:
        parts.append(f"{ignored} survivor(s) without a usable report")
    return "; ".join(parts)


def _shards_lost(topology: JobTopology, lost: Sequence[int]) -> str:
    """The shards whose every holder is among ``lost``, in words ("" if none): shard ``k`` is the
    ``k``-th replica group (the ranks that hold the same state)."""
    gone = set(lost)
    orphans = [(k, list(g)) for k, g in enumerate(topology.replica_groups) if g and set(g) <= gone]
    return "; ".join(f"shard {k} lost with every holder (replica group {g})" for k, g in orphans)


def _stop(epoch: int, reason: str) -> Plan:
    return Plan(
        epoch=epoch,
        action="stop",
        reason=reason,
        world_size=0,
        replica_groups=(),
        assignment=(),
        replacements=(),
        transfers=(),
        target_step=None,
        rank_remap=(),
        released=(),
        orphan_groups=(),
        store_node=None,
    )
