"""The typed contract between a trainer and its agent: what crosses the process boundary reads back as
the same objects, and anything else (another version, a damaged value) is refused with a clear error."""

from __future__ import annotations

import msgpack
import pytest

from gossiprec.core.election import PLAN_FORMAT, Plan, StateReport, elect
from gossiprec.core.topology import JobTopology, Member
from gossiprec.errors import DecodeError
from gossiprec.local.protocol import event_to_dict


def _plans() -> list[Plan]:
    """A resume with a transfer, a shrink, a checkpoint and a stop."""
    prev = {r: f"n{r}" for r in range(4)}
    members = {n: Member(n, "trainer", r, f"h{r}", "r0") for r, n in prev.items()}
    reports = {n: StateReport(n, r, 10, None, 1 << 22) for r, n in prev.items() if r != 3}
    out = []
    for spares, topo in ((1, JobTopology.ddp(4)), (0, JobTopology.ddp(4, allow_shrink=True)),
                         (1, JobTopology.grid(2, 2)), (0, JobTopology.ddp(4))):
        alive = tuple(m for m in members.values() if m.rank != 3) + tuple(
            Member(f"s{i}", "spare", None, "hs", "rs") for i in range(spares))
        rep = dict(reports) if topo.world_size == 4 and topo.replica_groups != ((0, 2), (1, 3)) else {
            n: r for n, r in reports.items() if n != "n1"}
        out.append(elect(2, alive, prev, rep, topo, previous_members=members))
    return out


def test_every_kind_of_plan_reads_back_as_itself_through_msgpack() -> None:
    plans = _plans()
    assert sorted(p.action for p in plans) == ["checkpoint", "resume", "shrink", "stop"]
    for plan in plans:
        wire = msgpack.unpackb(msgpack.packb(plan.to_wire(), use_bin_type=True), raw=False)
        back = Plan.from_wire(wire)
        assert back == plan and back.digest() == plan.digest()


@pytest.mark.parametrize("mutate, reason", [
    (lambda w: w.__setitem__(0, "gossiprec.plan/0"), "plan format"),
    (lambda w: w.__setitem__(2, "restart"), "unknown plan action"),
    (lambda w: w.__setitem__(1, -1), "epoch must be an integer"),
    (lambda w: w.__setitem__(6, [[0]]), "assignment must be a list of pairs"),
    (lambda w: w.__setitem__(8, [[1, "n", None, "d", 0, 5]]), "a transfer is a list of 7 fields"),
    (lambda w: w.pop(), "a plan is a list of 14 fields"),
])
def test_a_damaged_or_foreign_plan_is_refused(mutate, reason) -> None:  # type: ignore[no-untyped-def]
    wire = _plans()[0].to_wire()
    mutate(wire)
    with pytest.raises(DecodeError, match=reason):
        Plan.from_wire(wire)
    assert PLAN_FORMAT.startswith("gossiprec.plan/")


def test_an_event_carries_its_plan_in_the_wire_form() -> None:
    from gossiprec.core.events import PlanReady

    plan = _plans()[0]
    frame = event_to_dict(PlanReady(plan.epoch, plan.digest(), plan, 12.5))
    assert frame["event"] == "PlanReady" and frame["plan"] == plan.to_wire()
    assert Plan.from_wire(frame["plan"]) == plan
