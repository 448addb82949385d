"""A view change that leaves every trainer's group as it is interrupts no step.

A spare joining a running job, or a spare leaving it, changes the agreed view but no rank, no topology and
nothing the group view's plan reads: the view keeps its predecessor's group epoch
(:attr:`~gossiprec.core.view.View.group_epoch`). The trainers follow the group epoch, so none leaves its
step: 0 interruptions, no recovery record, still the group of epoch 0, and the final state equals the
failure-free run's bit for bit. The step time around the join is a benchmark's figure, not asserted here.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from gossiprec.core.node import Node
from gossiprec.core.view import JOIN, REMOVE, Change
from gossiprec.harness.job import LocalJob, read_int
from gossiprec.harness.scenario import Action, run_scenario
from tests.test_node import MiniNet, _in_optimizer
from tests.test_view import job


def test_a_spare_joining_or_leaving_keeps_the_group_epoch_store_and_basis() -> None:
    v0 = job(4, 1)
    v1 = v0.next([_join("j0")])
    assert v1.group_epoch == 0 and v1.store_node == v0.store_node and v1.basis is v0.basis
    assert v1.assignment() == v0.assignment() and "j0" in v1 and v1.config_id != v0.config_id
    spare = next(m.node for m in v0.members if m.role == "spare")
    v2 = v1.next([_remove(spare)])
    assert v2.group_epoch == 0 and spare not in v2
    lost = v0.assignment()[1]
    v3 = v2.next([_remove(lost)])  # a rank lost: the spare that joined takes it, a new group epoch
    assert v3.group_epoch == 3 and v3.assignment()[1] == "j0" and v3.basis is not None
    assert v3.basis.previous_assignment == tuple(sorted(v0.assignment().items()))
    v4 = v3.next([_join("j1")])
    assert v4.group_epoch == 3, v4  # a join after a group change keeps that group's epoch and basis
    assert v4.basis is v3.basis
    assert type(v4).from_wire(v4.to_wire()) == v4 and type(v4).from_wire(v4.to_wire()).group_epoch == 3


def test_removing_a_holder_of_the_group_views_plan_starts_a_new_group_epoch() -> None:
    # a survivor a shrink released is a spare, but the plan of the shrink's view reads its report (a donor):
    # a view that removes it cannot keep that group, whose plan may still be waiting for it
    from gossiprec.core.topology import JobTopology
    from gossiprec.core.view import View, ViewMember

    members = [ViewMember(f"t{i}", f"t{i}", "trainer", i) for i in range(4)]
    v0 = View.initial(members, JobTopology(4, ((0, 2), (1, 3)), allow_shrink=True, min_replicas=1))
    v1 = v0.next([_remove("t1")])  # no spare: the job shrinks to one replica group, t0 is released
    (released,) = [m.node for m in v1.members if m.role == "spare"]
    assert v1.group_epoch == 1 and v1.basis is not None and v1.is_holder(released)
    assert v1.next([_remove(released)]).group_epoch == 2
    assert v1.next([_join("j0")]).group_epoch == 1  # a join alone keeps it


def test_a_join_installed_while_a_report_is_held_leaves_the_group_views_plan_to_complete() -> None:
    # the guard: the ranks' reports for view 1 (a rank replaced) are held while their trainers may still
    # commit; a spare's join is installed meanwhile as view 2, which keeps group epoch 1: the plan of view 1
    # must still come, on every member, after that install (the trainers of group 1 wait for it)
    from gossiprec.core.wire import PHASES

    net = MiniNet(["n0", "n1", "n2", "n3", "s0"], spares=1)
    net.run(1.0)
    _in_optimizer(net, 5)  # every trainer in its optimizer step: reports for the next view are held
    net.nodes["n1"].leave(net.now)
    net.run(net.now + 0.3)
    live = ["n0", "n2", "n3", "s0"]
    for name in live:
        node = net.nodes[name]
        assert node.view is not None and node.view.epoch == 1 and node.view.group_epoch == 1, name
        assert node.plan is None, name
    assert net.nodes["n0"].aggregates.held_until is not None
    v1 = net.nodes["n0"].view
    assert v1 is not None
    v2 = v1.next([_join("j0")])
    assert v2.group_epoch == 1
    net.down.add("j0")  # (its process is not simulated: what is sent to it is lost)
    for name in live:  # the join's decision, everywhere at once
        net.nodes[name].install(v2, net.now, fast=False, decided_here=False, removed=(), joined=("j0",))
    for name in live:
        node = net.nodes[name]
        if node.view.member(name).role == "trainer":  # type: ignore[union-attr]
            node.set_state(5, None, 1000)  # the step committed: the held report goes out
            node.set_progress(6, PHASES.index("compute"), 100, net.now)
    net.run(net.now + 3.0)
    plans = {name: net.nodes[name].plan for name in live}
    assert all(p is not None and p.epoch == 1 for p in plans.values()), plans
    assert len({p.digest() for p in plans.values() if p is not None}) == 1
    # j0 never answers (not simulated): its removal is agreed too, a spare leaving, again in group epoch 1
    assert all(net.nodes[n].view.epoch == 3 and net.nodes[n].view.group_epoch == 1  # type: ignore[union-attr]
               and "j0" not in net.nodes[n].view for n in live)  # type: ignore[operator]
    assert plans["n0"].target_step == 5  # type: ignore[union-attr]  # the held reports counted: no roll back


def _join(node: str) -> Change:
    return Change(node, JOIN, node)


def _remove(node: str) -> Change:
    return Change(node, REMOVE)


def _kill_spare(node: str, at_step: int) -> Action:
    def when(job: LocalJob) -> bool:
        return read_int(job.path("n0", ".step")) >= at_step

    def do(job: LocalJob) -> None:
        job.signal(node, signal.SIGKILL)

    return Action(f"SIGKILL the spare {node}'s trainer", when, do)


@pytest.mark.slow
def test_a_spare_joining_then_a_spare_leaving_interrupts_no_trainer(tmp_path: Path) -> None:
    # n3 is not in the job spec: started at step 5, it joins as a spare (the ranks wait at step 40 until the
    # view holds it, so the job cannot end first); the listed spare n2 is SIGKILLed at step 60
    res = run_scenario(2, 1, 240, [], hidden=32, step_ms=20.0, workdir=str(tmp_path), timeout=240.0,
                       join_at=[5], actions=[_kill_spare("n2", 60)], may_fail=["n2"],
                       trainer_args=["--await-view", "40:4"])
    assert res["bit_identical"] and res["final_step"] == [240], res
    assert set(res["joined_at"]) == {"n3"}, res
    for node in ("n0", "n1"):
        t = res["trainers"][node]
        assert t["interruptions"] == 0 and t["epoch"] == 0, (node, t)  # no step left, still group 0
        assert t["view_members"] == ["n0", "n1", "n3"] and t["view_epoch"] >= 2, (node, t)  # joined, then left
    records = [p for p in tmp_path.glob("n[01].records") if p.read_text().strip()]
    assert not records, [p.read_text() for p in records]


def _two_decisions_apart() -> tuple[Any, Any, Node, Node]:
    """(view 0, view 1, n1, n0) of 5 ranks and a spare: n1 decided that n4 is lost (s0 takes its rank: group
    view 1), then that j0 joins (view 2 keeps group epoch 1); n0 still holds view 0."""
    from gossiprec.core.topology import JobTopology
    from gossiprec.core.view import View, ViewMember
    from tests.test_node import _decide, make_node

    names = ["n0", "n1", "n2", "n3", "n4"]
    members = [*(ViewMember(n, n, "trainer", i) for i, n in enumerate(names)), ViewMember("s0", "s0", "spare", None)]
    v0 = View.initial(members, JobTopology.ddp(5))
    ahead, behind = make_node("n1", v0), make_node("n0", v0)
    _decide(ahead, [_remove("n4")], 0.1)
    v1 = ahead.view
    _decide(ahead, [_join("j0")], 0.2)
    assert ahead.view is not None and (ahead.view.epoch, ahead.view.group_epoch) == (2, 1)
    return v0, v1, ahead, behind


def test_a_member_that_catches_up_past_a_group_view_by_delta_reports_to_its_plan() -> None:
    # n0 missed two decisions: n4 lost (s0 takes its rank: group view 1), then j0 joined (view 2 keeps group
    # epoch 1). The delta brings it to view 2; it installs view 1 on the way, reports its state to view 1's
    # plan and aggregates that plan, as the members that installed both do (its trainer waits for it)
    from gossiprec.core.wire import Report, ViewDelta, ViewRequest, encode_packet
    from tests.test_node import sent_messages

    v0, _, ahead, behind = _two_decisions_apart()
    ahead.take_sends()
    ahead.receive(encode_packet([ViewRequest(0, v0.config_id, "n0", "n0")]), 0.3)
    (delta,) = [m for a, m in sent_messages(ahead) if a == "n0"]
    assert isinstance(delta, ViewDelta) and len(delta.steps) == 2
    behind.take_events()
    behind.take_sends()
    behind.receive(encode_packet([delta]), 0.4, reliable=True)
    assert behind.view == ahead.view
    installed = [e for e in behind.take_events() if type(e).__name__ == "ViewInstalled"]
    assert [(e.epoch, e.group_epoch, e.removed, e.joined) for e in installed] == [(1, 1, ("n4",), ()),
                                                                                  (2, 1, (), ("j0",))]
    assert behind.aggregates.view is not None and behind.aggregates.view.epoch == 1
    reports = [m for _, m in sent_messages(behind) if isinstance(m, Report)]
    assert reports and all(r.epoch == 1 for r in reports), reports


def test_a_member_that_catches_up_past_a_group_view_by_full_view_reports_to_its_plan() -> None:
    # as above, but the answerer no longer remembers the change sets (more than MAX_DELTA_STEPS views behind):
    # its full view 2 goes after its group view 1, in one message; n0 installs both in turn and reports to view
    # 1's plan. A joiner asking gets view 2 alone (it holds no rank in view 1)
    from gossiprec.core.view import View
    from gossiprec.core.wire import JoinRequest, Report, ViewRequest, ViewState, decode_packet, encode_packet
    from tests.test_node import CFG, sent_messages

    v0, v1, ahead, behind = _two_decisions_apart()
    ahead.catchup.history.clear()  # (as if the views since were more than it remembers)
    ahead.take_sends()
    ahead.receive(encode_packet([ViewRequest(0, v0.config_id, "n0", "n0")]), 0.3)
    (send,) = [s for s in ahead.take_sends() if s.addr == "n0"]
    news = [m for m in decode_packet(send.payload, CFG.max_stream) if isinstance(m, ViewState)]
    assert [View.from_wire(m.view) for m in news] == [v1, ahead.view]  # the group view first
    behind.take_events()
    behind.take_sends()
    behind.receive(send.payload, 0.4, reliable=True)
    assert behind.view == ahead.view
    installed = [e for e in behind.take_events() if type(e).__name__ == "ViewInstalled"]
    assert [(e.epoch, e.group_epoch) for e in installed] == [(1, 1), (2, 1)]
    assert behind.aggregates.view == v1
    reports = [m for _, m in sent_messages(behind) if isinstance(m, Report)]
    assert reports and all(r.epoch == 1 for r in reports), reports
    ahead.receive(encode_packet([JoinRequest("j1", "j1", "", "", 0)]), 0.5)  # a joiner: the full view alone
    (send,) = [s for s in ahead.take_sends() if s.addr == "j1"]
    assert [View.from_wire(m.view) for m in decode_packet(send.payload, CFG.max_stream)
            if isinstance(m, ViewState)] == [ahead.view]
