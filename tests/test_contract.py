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


def test_every_core_event_reads_back_as_itself_and_a_damaged_one_is_refused() -> None:
    from gossiprec.core.events import (
        AlertRaised, Fenced, JobFinished, MemberFailed, PlanReady, Straggler, ViewInstalled,
    )
    from gossiprec.local.protocol import EVENT_TYPES, decode_event

    plan = _plans()[0]
    events = [ViewInstalled(3, "c0ffee", ("n0", "n1"), ("n2",), (), True, False, 1.5, "stop: no spare"),
              ViewInstalled(4, "c0ffee", ("n0",), (), ("s1",), False, True, 2.0),
              PlanReady(plan.epoch, plan.digest(), plan, 12.5), Fenced(2, "no quorum", 3.0),
              JobFinished(5, 100, "n0", 4.0), MemberFailed("n1", 2, "n0", 5.0), AlertRaised("n1", "hung", 6.0),
              Straggler("n3", 25, 40, 7.0)]
    for ev in events:
        frame = msgpack.unpackb(msgpack.packb(event_to_dict(ev), use_bin_type=True), raw=False)
        assert decode_event(frame) == ev
    assert {"ViewInstalled", "PlanReady", "Fenced", "JobFinished", "MemberFailed"} <= set(EVENT_TYPES)
    assert decode_event({"event": "AgentLeaving", "name": "n0"}) is None  # the agent's own, not the core's
    for bad in ({"event": "Fenced", "epoch": "2", "reason": "x", "at": 1.0},  # a string for an int
                {"event": "Fenced", "epoch": 2, "at": 1.0},  # a field missing
                {"event": "PlanReady", "epoch": 2, "digest": "d", "plan": {"epoch": 2}, "at": 1.0}):  # a dict plan
        with pytest.raises(DecodeError):
            decode_event(bad)


def test_the_status_view_reads_back_and_a_damaged_one_is_refused() -> None:
    from gossiprec.core.topology import JobTopology
    from gossiprec.core.view import View, ViewMember
    from gossiprec.local.protocol import ViewBrief

    view = View.initial([ViewMember("n0", "n0:1", "trainer", 0), ViewMember("n1", "n1:1", "trainer", 1),
                         ViewMember("s0", "s0:1", "spare", None)], JobTopology.ddp(2))
    brief = ViewBrief.from_view(view)
    back = ViewBrief.from_wire(msgpack.unpackb(msgpack.packb(brief.to_wire()), raw=False))
    assert back == brief and back.world_size == 2 and back.node_of_rank(1) == "n1"
    assert back.member("s0") is not None and back.member("s0").rank is None  # type: ignore[union-attr]
    wire = brief.to_wire()
    del wire["members"][0]["role"]
    with pytest.raises(DecodeError, match="bad_view"):
        ViewBrief.from_wire(wire)


async def test_a_client_of_another_version_gets_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from gossiprec.agent.pump import Agent
    from gossiprec.agent.settings import AgentSettings
    from gossiprec.local.protocol import CONTROL_VERSION, encode_frame

    s = AgentSettings(name="n0", bind_host="127.0.0.1", port=0, insecure=True,
                      control_socket=str(tmp_path / "n0.sock"))
    async with Agent(s) as agent:
        reader, writer = await asyncio.open_unix_connection(agent.control_path)
        writer.write(encode_frame({"op": "hello", "version": CONTROL_VERSION - 1}))
        head = await reader.readexactly(4)
        frame = msgpack.unpackb(await reader.readexactly(int.from_bytes(head, "big")), raw=False)
        writer.close()
    assert frame["error"] == "unsupported_version"
    assert f"this agent speaks {CONTROL_VERSION}" in frame["message"] and "version of the agent" in frame["message"]
