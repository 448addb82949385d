"""Tests of :mod:`gossiprec.core.view`: the agreed membership and its deterministic transition.

A view is pure data, so everything here is table-driven: construction and its validation, the config id
(what every agreement message is stamped with), the wire round trip, the transition ``View.next`` (spare
promotion, shrink, stop, joins), the quorum sizes, and that the plan a view computes is exactly the
election's.
"""

from __future__ import annotations

import msgpack
import pytest

from gossiprec.core.election import StateReport, elect
from gossiprec.core.topology import SPARE, TRAINER, JobTopology
from gossiprec.core.view import JOIN, REMOVE, Change, View, ViewMember, changes_digest
from gossiprec.errors import ConfigError, GossiprecError, ProtocolError


# -- builders ---------------------------------------------------------------------------------------


def trainer(node: str, rank: int, host: str = "", rack: str = "") -> ViewMember:
    return ViewMember(node, f"addr-{node}", TRAINER, rank, host or f"h-{node}", rack or "r0")


def spare(node: str, host: str = "", rack: str = "") -> ViewMember:
    return ViewMember(node, f"addr-{node}", SPARE, None, host or f"h-{node}", rack or "r0")


def job(world: int, spares: int = 0, *, allow_shrink: bool = False) -> View:
    """Trainers t0..t{world-1} holding ranks 0..world-1 (plain DDP), spares s0.. ."""
    members = [trainer(f"t{r}", r) for r in range(world)] + [spare(f"s{i}") for i in range(spares)]
    return View.initial(members, JobTopology.ddp(world, allow_shrink=allow_shrink))


def remove(*nodes: str) -> list[Change]:
    return [Change(n, REMOVE) for n in nodes]


# -- View.initial -----------------------------------------------------------------------------------


def test_initial_sorts_members_and_picks_the_smallest_trainer_as_store() -> None:
    members = [trainer("t2", 0), spare("a-spare"), trainer("t1", 1)]
    v = View.initial(members, JobTopology.ddp(2))
    assert v.epoch == 0
    assert v.nodes == ("a-spare", "t1", "t2")
    assert v.store_node == "t1"  # smallest *trainer*, not the smallest node
    assert v.assignment() == {0: "t2", 1: "t1"}
    assert [m.node for m in v.trainers()] == ["t1", "t2"]
    assert v.basis is None and v.stopped == ""


@pytest.mark.parametrize(
    "ranks",
    [
        [0, 1, 3],  # hole
        [0, 1],  # too few
        [0, 1, 2, 3],  # too many
        [1, 2, 3],  # not starting at 0
        [0, 0, 1],  # duplicate rank
    ],
)
def test_initial_requires_ranks_0_to_w_minus_1(ranks: list[int]) -> None:
    members = [trainer(f"t{i}", r) for i, r in enumerate(ranks)]
    with pytest.raises(ConfigError, match="ranks 0..2"):
        View.initial(members, JobTopology.ddp(3))


def test_initial_refuses_a_node_listed_twice() -> None:
    members = [trainer("t0", 0), trainer("t1", 1), spare("t1")]
    with pytest.raises(ConfigError, match="twice"):
        View.initial(members, JobTopology.ddp(2))


def test_initial_errors_share_the_root_exception() -> None:
    with pytest.raises(GossiprecError):
        View.initial([trainer("t0", 1)], JobTopology.ddp(1))


# -- config id --------------------------------------------------------------------------------------


def test_config_id_is_stable_and_independent_of_member_order() -> None:
    a = job(4, 2)
    members = list(reversed(a.members))
    b = View.initial(members, JobTopology.ddp(4))
    assert a.config_id == b.config_id
    assert len(a.config_id) == 16 and int(a.config_id, 16) >= 0
    assert job(4, 2).config_id == a.config_id  # recomputed from scratch: same id


@pytest.mark.parametrize(
    "mutate",
    [
        lambda ms: ms[:-1],  # a member fewer
        lambda ms: ms + [spare("s9")],  # a member more
        lambda ms: [ViewMember(m.node, m.addr + "x", m.role, m.rank, m.host, m.rack) for m in ms],  # address
        lambda ms: [ViewMember(m.node, m.addr, m.role, m.rank, m.host, "r7") for m in ms],  # rack
    ],
)
def test_config_id_changes_with_members(mutate) -> None:  # type: ignore[no-untyped-def]
    base = job(3, 2)
    members = list(base.members)
    other = View(0, tuple(sorted(mutate(members), key=lambda m: m.node)), base.topology, base.store_node)
    assert other.config_id != base.config_id


def test_config_id_changes_with_epoch_topology_and_stop_reason() -> None:
    base = job(3, 1)
    ids = {
        base.config_id,
        View(1, base.members, base.topology, base.store_node).config_id,
        View(0, base.members, JobTopology(3, ((0,), (1,), (2,)), False), base.store_node).config_id,
        View(0, base.members, base.topology, base.store_node, stopped="stop: no spare").config_id,
    }
    assert len(ids) == 4


def test_changes_digest_ignores_order_but_not_content_epoch_or_config() -> None:
    v = job(3, 1)
    cs = [Change("t1", REMOVE), Change("j", JOIN, "addr-j")]
    d = changes_digest(0, v.config_id, cs)
    assert len(d) == 16
    assert changes_digest(0, v.config_id, list(reversed(cs))) == d
    assert changes_digest(1, v.config_id, cs) != d
    assert changes_digest(0, "0" * 16, cs) != d
    assert changes_digest(0, v.config_id, cs[:1]) != d
    assert changes_digest(0, v.config_id, [Change("j", JOIN, "addr-other")]) != changes_digest(
        0, v.config_id, [Change("j", JOIN, "addr-j")])


# -- wire form --------------------------------------------------------------------------------------


def _round_trip(v: View) -> View:
    # through real msgpack, as on the wire (tuples become lists)
    obj = msgpack.unpackb(msgpack.packb(v.to_wire(), use_bin_type=True), raw=False)
    return View.from_wire(obj)


def test_wire_round_trip_of_view_0() -> None:
    v = job(4, 2)
    w = _round_trip(v)
    assert w == v
    assert w.config_id == v.config_id
    assert w.basis is None


def test_wire_round_trip_of_a_later_view_keeps_basis_and_plan() -> None:
    v1 = job(4, 2).next(remove("t1"))
    v2 = v1.next(remove("t3"))
    for v in (v1, v2):
        w = _round_trip(v)
        assert w == v
        assert w.config_id == v.config_id
        assert w.basis == v.basis
        assert w.holders() == v.holders()
        assert v.basis is not None
        rank_of = {node: r for r, node in v.basis.previous_assignment}
        reports = {n: StateReport(n, rank_of[n], 5, None, 100) for n in v.holders()}
        assert w.plan(reports).digest() == v.plan(reports).digest()


def test_wire_round_trip_of_a_stopped_view() -> None:
    v = job(2, 0).next(remove("t0"))
    assert v.stopped
    assert _round_trip(v) == v


@pytest.mark.parametrize(
    "obj",
    [
        None,
        7,
        "abcdef",  # six characters unpack, then fail
        [],
        [0, [], [1, [[0]], False, 1], None, None],  # five fields
        [0, [], [1, [[0]], False, 1], None, None, "", "extra"],
        [0, [["t0", "a", "trainer", 0, "h", "r"]], [0, [], False, 1], None, None, ""],  # world 0
        [0, [["t0", "a", "trainer", 0, "h", "r"]], [1, [[0]], "yes", 1], None, None, ""],  # bool field
        [0, [["t0", "a", "trainer"]], [1, [[0]], False, 1], None, None, ""],  # short row
        [0, [["t0", "a", "trainer", 0, "h", "r", "x"]], [1, [[0]], False, 1], None, None, ""],  # long row
        [0, [["t0", "a", "trainer", 0, "h", "r"]], [1, [[0]], False, 1], None, [[], [], [1]], ""],  # basis
        [0, [["t0", "a", "trainer", 0, "h", "r"]], [1, [[0]], False, 1], None,
         [[["x", "trainer", None, "h", "r"]], [], [1, [[0]]], [], None], ""],  # basis member invalid
        [0, [["b", "a", "spare", None, "", ""], ["a", "a", "trainer", 0, "", ""]], [1, [[0]], False, 1],
         None, None, ""],  # not sorted
        ["x", [], [1, [[0]], False, 1], None, None, ""],  # epoch not a number
    ],
)
def test_from_wire_refuses_malformed_views(obj: object) -> None:
    with pytest.raises(ProtocolError, match="malformed view"):
        View.from_wire(obj)  # type: ignore[arg-type]


def test_from_wire_refuses_a_truncated_basis_topology() -> None:
    with pytest.raises(ProtocolError, match="malformed view"):
        View.from_wire([0, [["t0", "a", "trainer", 0, "h", "r"]], [1, [[0]], False, 1], None,
                        [[], [], [1], [], None], ""])


@pytest.mark.parametrize(
    "rows",
    [
        [["a", "addr", "bogus-role", None, "", ""], ["b", "addr", "trainer", 0, "", ""]],
        [["a", "addr", "trainer", 5, "", ""], ["b", "addr", "trainer", 0, "", ""]],  # rank outside world
        [["a", "addr", "trainer", 0, "", ""], ["a", "addr", "spare", None, "", ""]],  # node listed twice
        [["a", "addr", "spare", 3, "", ""], ["b", "addr", "trainer", 0, "", ""]],  # spare with a rank
    ],
)
def test_from_wire_refuses_inconsistent_members(rows: list) -> None:
    with pytest.raises(ProtocolError):
        View.from_wire([1, rows, [1, [[0]], False, 1], None, None, ""])


# -- View.next --------------------------------------------------------------------------------------


def test_next_promotes_a_spare_to_the_lost_rank() -> None:
    v0 = job(4, 2)
    v1 = v0.next(remove("t1"))
    assert v1.epoch == 1
    assert "t1" not in v1
    assert v1.topology == v0.topology
    a = v1.assignment()
    assert sorted(a) == [0, 1, 2, 3]
    assert a[0] == "t0" and a[2] == "t2" and a[3] == "t3"  # survivors keep their rank
    assert a[1] in ("s0", "s1")
    promoted = v1.member(a[1])
    assert promoted is not None and promoted.role == TRAINER and promoted.rank == 1
    assert promoted.addr == f"addr-{a[1]}"
    left = [m for m in v1.members if m.role == SPARE]
    assert len(left) == 1 and left[0].rank is None
    assert not v1.stopped
    assert v1.holders() == ["t0", "t2", "t3"]
    # deterministic: every agent computes the same next view
    assert v0.next(remove("t1")) == v1 and v0.next(remove("t1")).config_id == v1.config_id


def test_next_is_independent_of_change_order() -> None:
    v0 = job(4, 3)
    a = v0.next([Change("t1", REMOVE), Change("t3", REMOVE), Change("j", JOIN, "addr-j")])
    b = v0.next([Change("j", JOIN, "addr-j"), Change("t3", REMOVE), Change("t1", REMOVE)])
    assert a == b and a.config_id == b.config_id


def test_next_prefers_a_spare_on_the_lost_trainers_host() -> None:
    members = [trainer("t0", 0, host="hA"), trainer("t1", 1, host="hB"),
               spare("s0", host="hC"), spare("s1", host="hB")]
    v1 = View.initial(members, JobTopology.ddp(2)).next(remove("t1"))
    assert v1.assignment()[1] == "s1"


def test_next_without_spare_shrinks_when_allowed() -> None:
    v0 = job(4, 0, allow_shrink=True)
    v1 = v0.next(remove("t2"))
    assert not v1.stopped
    assert v1.topology.world_size == 3
    assert v1.topology.allow_shrink is True
    assert sorted(v1.assignment()) == [0, 1, 2]
    assert set(v1.assignment().values()) == {"t0", "t1", "t3"}
    assert all(m.role == TRAINER for m in v1.members)


def test_next_without_spare_stops_when_shrink_not_allowed() -> None:
    v0 = job(4, 0, allow_shrink=False)
    v1 = v0.next(remove("t2"))
    assert v1.stopped
    assert "allow_shrink" in v1.stopped
    assert v1.epoch == 1
    assert v1.store_node is None
    assert "t2" not in v1 and set(v1.nodes) == {"t0", "t1", "t3"}
    # a stopped view differs from any running view of the same members
    assert v1.config_id != View(1, v1.members, v1.topology, None).config_id


def test_next_after_a_stopped_view_stays_stopped() -> None:
    v1 = job(4, 0, allow_shrink=False).next(remove("t2"))
    v2 = v1.next(remove("t1") + [Change("j0", JOIN, "addr-j0")])  # used to raise inside the election
    assert v2.epoch == 2 and v2.stopped == v1.stopped
    assert set(v2.nodes) == {"t0", "t3", "j0"} and v2.store_node is None and v2.basis is None
    assert View.from_wire(msgpack.unpackb(msgpack.packb(v2.to_wire()), raw=False)) == v2


def test_next_admits_joiners_as_spares() -> None:
    v0 = job(3, 0)
    v1 = v0.next([Change("j1", JOIN, "addr-j1", "hj", "rj"), Change("j0", JOIN, "addr-j0")])
    assert v1.epoch == 1
    assert v1.assignment() == v0.assignment()
    for name, addr in (("j0", "addr-j0"), ("j1", "addr-j1")):
        m = v1.member(name)
        assert m is not None and m.role == SPARE and m.rank is None and m.addr == addr
    assert v1.member("j1").host == "hj" and v1.member("j1").rack == "rj"  # type: ignore[union-attr]
    assert v1.nodes == tuple(sorted(v1.nodes))


def test_joiner_replaces_a_trainer_removed_in_the_same_change() -> None:
    v1 = job(3, 0).next([Change("t0", REMOVE), Change("j", JOIN, "addr-j")])
    assert not v1.stopped
    assert v1.assignment()[0] == "j"


def test_join_of_a_member_is_ignored_and_remove_wins_over_join() -> None:
    v0 = job(3, 1)
    v1 = v0.next([Change("t0", JOIN, "elsewhere")])
    assert v1.members == v0.members
    v2 = v0.next([Change("s0", REMOVE), Change("s0", JOIN, "addr-s0")])
    assert "s0" not in v2


def test_store_moves_off_a_removed_store_node() -> None:
    v0 = job(4, 1)
    assert v0.store_node == "t0"
    v1 = v0.next(remove("t0"))
    assert v1.store_node is not None and v1.store_node != "t0" and v1.store_node in v1


# -- index and quorums --------------------------------------------------------------------------------


def test_index_is_the_position_in_the_sorted_member_list() -> None:
    v = job(5, 3)
    for i, m in enumerate(v.members):
        assert v.index(m.node) == i
        assert v.member(m.node) == m
        assert m.node in v
    for absent in ("", "a", "t", "t00", "zzz", "t5"):
        assert v.index(absent) is None
        assert v.member(absent) is None
        assert absent not in v
    assert 3 not in v  # non-strings are never members
    assert len(v) == 8


def _view_of(n: int) -> View:
    return View.initial([trainer(f"n{i:04d}", i) for i in range(n)], JobTopology.ddp(n))


@pytest.mark.parametrize(
    "n, majority, fast",
    [
        (1, 1, 1), (2, 2, 2), (3, 2, 3), (4, 3, 4), (5, 3, 4), (6, 4, 5), (7, 4, 6), (8, 5, 7),
        (9, 5, 7), (10, 6, 8), (16, 9, 13), (1024, 513, 769),
    ],
)
def test_quorum_tables(n: int, majority: int, fast: int) -> None:
    v = _view_of(n)
    assert v.majority() == majority
    assert v.fast_quorum() == fast
    assert v.fast_quorum() == n - (n - 1) // 4


def test_two_fast_quorums_and_a_classic_quorum_intersect() -> None:
    # the Fast Paxos condition for our quorum sizes: 2 * Qf + Qc > 2N for every N
    for n in range(1, 201):
        qf = n - (n - 1) // 4
        qc = n // 2 + 1
        assert 2 * qf + qc > 2 * n, n
        assert qf >= qc  # a fast quorum is also a classic one
        assert 2 * qc > n  # two classic quorums intersect


# -- plan -----------------------------------------------------------------------------------------


def test_view_0_has_no_plan() -> None:
    with pytest.raises(ProtocolError, match="view 0"):
        job(2, 1).plan({})
    assert job(2, 1).holders() == []


@pytest.mark.parametrize("shrink", [False, True])
def test_plan_equals_a_direct_election(shrink: bool) -> None:
    v0 = job(4, 0 if shrink else 1, allow_shrink=shrink)
    v1 = v0.next(remove("t1"))
    reports = {
        "t0": StateReport("t0", 0, 9, 10, 4096),
        "t2": StateReport("t2", 2, 9, None, 4096),
        "t3": StateReport("t3", 3, 9, 10, 4096),
    }
    assert v1.holders() == ["t0", "t2", "t3"]
    survivors = [m.as_member() for m in v0.members if m.node != "t1"]  # rebuilt here, not from basis
    direct = elect(
        1, survivors, v0.assignment(), reports, v0.topology,
        previous_members={m.node: m.as_member() for m in v0.members},
        previous_store=v0.store_node, min_stripe_bytes=1,
    )
    plan = v1.plan(reports)
    assert plan == direct
    assert plan.digest() == direct.digest()
    assert plan.action == ("shrink" if shrink else "resume")
    assert plan.target_step == 10  # the in-flight step held by t0 and t3 is servable to t2
    # the plan agrees with the view about who holds which rank
    assert dict(plan.assignment) == v1.assignment()
    assert plan.world_size == v1.topology.world_size
    assert plan.store_node == v1.store_node
