"""Views: the numbered, agreed membership of the job, and how one view becomes the next.

What it decides: the content of view ``e + 1`` from view ``e`` and an agreed change set, identically on
every agent. A view is ``(epoch, members, topology)``; each member has a node id, an address, a role
(``trainer`` holding a rank, or ``spare``), a host and a rack. ``config_id`` is a hash of all of it; every
agreement message carries epoch and config id, so messages about another view never mix with ours.

Transition (pure): survivors keep their place; removed members vanish; joiners enter as spares; then
the election's rank assignment (:func:`gossiprec.core.election.elect`, steps 1 to 3, which depend on
the view alone, not on state reports) decides which spare takes each lost rank, or how the job shrinks.
The resulting view therefore already says who holds which rank. The transfer part of the plan (donors,
target step) needs the survivors' state reports and is computed afterwards from the same inputs, kept
in :attr:`View.basis`.

Group epochs: a view that leaves every trainer's group as it is (a spare joined, or a spare that holds
nothing any plan may still need left; same assignment, same topology) keeps the previous view's
:attr:`View.group_epoch`, its store host and its basis. The trainers' groups, store prefixes and plans
are numbered by group epoch, so such a view interrupts no step; a view that changes a group starts a new
group epoch (its own epoch). Like the rest of the view it is a pure function of the agreed chain.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import msgpack

from gossiprec.core.election import Plan, StateReport, elect
from gossiprec.core.topology import SPARE, TRAINER, JobTopology, Member
from gossiprec.core.wire import MAX_MEMBERS
from gossiprec.errors import ConfigError, ProtocolError

REMOVE, JOIN = 0, 1
MAX_EPOCH = 2**62


def _check_world(ws: object) -> None:
    """A world size from the network: an int within 1..MAX_MEMBERS, checked before any topology is built
    from it (a peer must not choose how much memory ``range(world_size)`` takes)."""
    if type(ws) is not int or not 1 <= ws <= MAX_MEMBERS:
        raise ValueError(f"world size must be an integer 1..{MAX_MEMBERS}, got {str(ws)[:30]}")


@dataclass(frozen=True, slots=True)
class ViewMember:
    node: str
    addr: str
    role: str
    rank: int | None
    host: str = ""
    rack: str = ""

    def as_member(self) -> Member:
        return Member(self.node, self.role, self.rank, self.host, self.rack)  # type: ignore[arg-type]

    def row(self) -> list[Any]:
        return [self.node, self.addr, self.role, self.rank, self.host, self.rack]


@dataclass(frozen=True, slots=True)
class Change:
    """One element of an agreed change set: remove a member, or admit a joiner (as a spare)."""

    node: str
    kind: int  # REMOVE or JOIN
    addr: str = ""
    host: str = ""
    rack: str = ""

    def row(self) -> list[Any]:
        return [self.node, self.kind, self.addr, self.host, self.rack]


def changes_digest(epoch: int, config_id: str, changes: Iterable[Change]) -> bytes:
    """16-byte id of a proposal (what the votes are for)."""
    rows = sorted(c.row() for c in changes)
    return hashlib.sha256(msgpack.packb(["gossiprec.prop/1", epoch, config_id, rows])).digest()[:16]


@dataclass(frozen=True, slots=True)
class Basis:
    """What the plan of a view is computed from, besides the state reports."""

    transitional: tuple[Member, ...]
    previous_assignment: tuple[tuple[int, str], ...]
    previous_topology: JobTopology
    previous_members: tuple[Member, ...]
    previous_store: str | None


@dataclass(frozen=True, slots=True)
class View:
    epoch: int
    members: tuple[ViewMember, ...]  # sorted by node
    topology: JobTopology
    store_node: str | None = None
    basis: Basis | None = None
    stopped: str = ""
    """Non-empty when the election says the job must stop (no spare, shrink not allowed)."""
    group_epoch: int = -1
    """The epoch of the newest view that changed a trainer's group (this one's unless it left every group
    as it was, see the module docstring); the trainers' groups and plans go by it. -1: ``epoch``."""

    config_id: str = field(default="", compare=False)
    """Hash of epoch, members, topology, stop reason and group epoch (16 hex digits); computed on construction."""
    _pos: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    _nodes: tuple[str, ...] = field(default=(), compare=False, repr=False)
    _holders: frozenset[str] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.group_epoch < 0:
            object.__setattr__(self, "group_epoch", self.epoch)
        body = msgpack.packb([
            "gossiprec.view/2", self.epoch, [m.row() for m in self.members],
            self.topology.world_size, [list(g) for g in self.topology.replica_groups], self.stopped,
            self.group_epoch,
        ])
        object.__setattr__(self, "config_id", hashlib.sha256(body).hexdigest()[:16])
        object.__setattr__(self, "_pos", {m.node: i for i, m in enumerate(self.members)})
        object.__setattr__(self, "_nodes", tuple(m.node for m in self.members))

    @property
    def nodes(self) -> tuple[str, ...]:
        return self._nodes

    def index(self, node: str) -> int | None:
        """Position of ``node`` in the sorted member list (its bit in vote bitmaps)."""
        return self._pos.get(node)

    def member(self, node: str) -> ViewMember | None:
        i = self.index(node)
        return None if i is None else self.members[i]

    def __contains__(self, node: object) -> bool:
        return isinstance(node, str) and self.index(node) is not None

    def __len__(self) -> int:
        return len(self.members)

    def majority(self) -> int:
        """Classic quorum: more than half of this view."""
        return len(self.members) // 2 + 1

    def fast_quorum(self) -> int:
        """Fast Paxos quorum, as Rapid: N - floor((N - 1) / 4); with a majority classic quorum every
        two fast quorums and one classic quorum intersect."""
        n = len(self.members)
        return n - (n - 1) // 4

    def assignment(self) -> dict[int, str]:
        return {m.rank: m.node for m in self.members if m.role == TRAINER and m.rank is not None}

    def trainers(self) -> list[ViewMember]:
        return [m for m in self.members if m.role == TRAINER]

    # ------------------------------------------------------------------ construction
    @classmethod
    def initial(cls, members: Iterable[ViewMember], topology: JobTopology) -> "View":
        ms = tuple(sorted(members, key=lambda m: m.node))
        if len({m.node for m in ms}) != len(ms):
            raise ConfigError("view 0 lists a node twice")
        ranks = sorted(m.rank for m in ms if m.role == TRAINER and m.rank is not None)
        if ranks != list(range(topology.world_size)):
            raise ConfigError(f"view 0 must give ranks 0..{topology.world_size - 1} to trainers, got {ranks}")
        trainers = [m.node for m in ms if m.role == TRAINER]
        store = min(trainers) if trainers else None
        return cls(0, ms, topology, store)

    def next(self, changes: Iterable[Change]) -> "View":
        """View ``epoch + 1`` after ``changes`` (deterministic)."""
        changes = sorted(changes, key=lambda c: (c.node, c.kind))
        removed = {c.node for c in changes if c.kind == REMOVE}
        joins = {c.node: c for c in changes if c.kind == JOIN and c.node not in removed}
        kept = [m for m in self.members if m.node not in removed]
        for node, c in sorted(joins.items()):
            if self.index(node) is None:
                kept.append(ViewMember(node, c.addr, SPARE, None, c.host, c.rack))
        kept.sort(key=lambda m: m.node)
        epoch = self.epoch + 1
        if self.stopped:
            # the job already stopped (no replica left for some shard): membership still changes, but
            # there is no assignment to recover from; the next view stays stopped, for the same reason
            return View(epoch, tuple(kept), self.topology, None, None, self.stopped)
        transitional = tuple(m.as_member() for m in kept)
        prev_assignment = self.assignment()
        plan = elect(epoch, transitional, prev_assignment, {}, self.topology,
                     previous_members={m.node: m.as_member() for m in self.members},
                     previous_store=self.store_node, min_stripe_bytes=1)
        basis = Basis(transitional, tuple(sorted(prev_assignment.items())), self.topology,
                      tuple(m.as_member() for m in self.members), self.store_node)
        if plan.action == "stop":
            return View(epoch, tuple(kept), self.topology, None, basis, plan.reason or "stop")
        assigned = dict(plan.assignment)
        rank_of = {node: rank for rank, node in assigned.items()}
        members = []
        for m in kept:
            rank = rank_of.get(m.node)
            role = TRAINER if rank is not None else SPARE
            members.append(ViewMember(m.node, m.addr, role, rank, m.host, m.rack))
        topology = plan.next_topology(self.topology)
        if self._keeps_groups(members, topology, removed):
            # every trainer's group stays: its epoch, store host and plan basis with it (an unfinished plan of
            # the group's view is still the one every trainer of that group applies)
            return View(epoch, tuple(members), topology, self.store_node, self.basis, group_epoch=self.group_epoch)
        return View(epoch, tuple(members), topology, plan.store_node, basis)

    def _keeps_groups(self, members: list[ViewMember], topology: JobTopology, removed: set[str]) -> bool:
        """Whether the next view, of ``members``, leaves every trainer's group as it is: the same ranks on
        the same nodes, the same topology, and no member removed that the group view's plan may still read
        (a holder of that plan: a donor, or a survivor a shrink released, see :meth:`holders`)."""
        if topology != self.topology:
            return False
        if {m.rank: m.node for m in members if m.role == TRAINER and m.rank is not None} != self.assignment():
            return False
        held = () if self.basis is None else self.basis.previous_assignment
        return not removed & {node for _, node in held}

    # ------------------------------------------------------------------ plan
    def plan(self, reports: Mapping[str, StateReport]) -> Plan:
        """The full recovery plan of this view (needs every holder's state report)."""
        if self.basis is None:
            raise ProtocolError("view 0 has no recovery plan")
        b = self.basis
        return elect(self.epoch, b.transitional, dict(b.previous_assignment), reports, b.previous_topology,
                     previous_members={m.node: m for m in b.previous_members},
                     previous_store=b.previous_store, min_stripe_bytes=1)

    def holders(self) -> list[str]:
        """Nodes whose state report the plan needs: survivors that held a rank in the previous view."""
        return sorted(self._holder_set())

    def is_holder(self, node: str) -> bool:
        return node in self._holder_set()

    def _holder_set(self) -> frozenset[str]:
        if self._holders is None:
            pos = self._pos
            held = () if self.basis is None else self.basis.previous_assignment
            object.__setattr__(self, "_holders", frozenset(node for _, node in held if node in pos))
        return self._holders  # type: ignore[return-value]

    # ------------------------------------------------------------------ wire form
    def to_wire(self) -> list[Any]:
        t = self.topology
        b = self.basis
        basis = None
        if b is not None:
            basis = [
                [[m.node, m.role, m.rank, m.host, m.rack] for m in b.transitional],
                [list(p) for p in b.previous_assignment],
                [b.previous_topology.world_size, [list(g) for g in b.previous_topology.replica_groups]],
                [[m.node, m.role, m.rank, m.host, m.rack] for m in b.previous_members],
                b.previous_store,
            ]
        return [self.epoch, [m.row() for m in self.members],
                [t.world_size, [list(g) for g in t.replica_groups], t.allow_shrink, t.min_replicas],
                self.store_node, basis, self.stopped, self.group_epoch]

    @classmethod
    def from_wire(cls, obj: list[Any]) -> "View":
        try:
            epoch, rows, topo, store, basis, stopped, group_epoch = obj
            # Cheap bounds first: a hostile view must not make us build a huge topology (world sizes are
            # checked against the member count before any range() is materialised).
            if type(epoch) is not int or not 0 <= epoch <= MAX_EPOCH:
                raise ValueError(f"epoch must be an integer 0..2**62, got {str(epoch)[:30]}")
            if type(group_epoch) is not int or not 0 <= group_epoch <= epoch:
                raise ValueError(f"group epoch must be an integer 0..epoch, got {str(group_epoch)[:30]}")
            if type(rows) not in (list, tuple) or len(rows) > MAX_MEMBERS:
                raise ValueError("members must be a list of at most MAX_MEMBERS rows")
            ws, groups, allow_shrink, min_rep = topo
            _check_world(ws)
            if basis is not None:
                _check_world(basis[2][0])
            topology = JobTopology(ws, tuple(tuple(g) for g in groups), allow_shrink, min_rep)
            members = tuple(ViewMember(*r) for r in rows)
            b = None
            if basis is not None:
                trans, prev_a, prev_t, prev_m, prev_store = basis
                b = Basis(
                    tuple(Member(*r) for r in trans), tuple((int(r), str(n)) for r, n in prev_a),
                    JobTopology(prev_t[0], tuple(tuple(g) for g in prev_t[1]), allow_shrink, min_rep),
                    tuple(Member(*r) for r in prev_m), prev_store,
                )
            view = cls(int(epoch), members, topology, store, b, str(stopped), group_epoch)
            for m in members:
                if not isinstance(m.addr, str) or not isinstance(m.host, str) or not isinstance(m.rack, str):
                    raise ValueError(f"member {m.node!r} has non-text fields")
                member = m.as_member()  # validates role and rank
                if member.rank is not None and member.rank >= topology.world_size:
                    raise ValueError(f"member {m.node!r} has rank {member.rank} outside the world")
            if len({m.node for m in members}) != len(members):
                raise ValueError("a node is listed twice")
            ranks = sorted(m.rank for m in members if m.role == TRAINER and m.rank is not None)
            if not stopped and ranks != list(range(topology.world_size)):
                raise ValueError(f"trainer ranks must be exactly 0..{topology.world_size - 1}")
        except (TypeError, ValueError, IndexError, KeyError, OverflowError, ConfigError) as exc:
            raise ProtocolError(f"malformed view: {exc}") from None
        if list(view.members) != sorted(view.members, key=lambda m: m.node):
            raise ProtocolError("malformed view: members not sorted")
        return view

