"""The agent's state report and the trainer's commit, ordered: a report for a view that changes the
trainer's group names a step the trainer must still hold when the plan comes. A trainer that has not
taken the view in may still complete its collective (nobody of its group is lost: a released survivor
of a shrink leaving, a member removed by mistake) and commit the next step, dropping that one. So the
agent waits until the trainer's page says it has taken the view in (``seen_group``), and the trainer
writes a finishing phase before its commit reads the follower (see gossiprec.local.progress)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from gossiprec.core.wire import PHASES
from gossiprec.harness.faults import Fault
from gossiprec.harness.scenario import run_scenario
from gossiprec.local.progress import ProgressPage, page_path_for
from gossiprec.trainer.agent_link import AgentLink
from tests.test_node import MiniNet

COMPUTE = PHASES.index("compute")


@pytest.fixture
def tmpdir_() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="gro", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _computing(net: MiniNet, step: int, seen: int | None) -> None:
    for name, node in net.nodes.items():
        if node.view is not None and node.view.member(name).role == "trainer":  # type: ignore[union-attr]
            node.set_state(step - 1, None, 1000)
            node.set_progress(step, COMPUTE, 100, net.now)
            if seen is not None:
                node.set_trainer_seen(seen)


def test_a_report_waits_until_the_trainer_has_taken_the_view_in() -> None:
    from gossiprec.core.wire import Report

    net = MiniNet(["n0", "n1", "n2", "n3"])
    net.run(1.0)
    _computing(net, 5, seen=0)  # every trainer computes step 5 (committed 4): nothing would hold the report
    net.nodes["n1"].leave(net.now)
    net.run(1.5)
    assert all(net.nodes[n].view.epoch == 1 for n in ("n0", "n2", "n3"))  # type: ignore[union-attr]
    assert not net.plans() and not [m for _, src, m in net.sent if isinstance(m, Report) and src != "n1"]
    # n0's collective completed before its follower took the view in: it committed step 5, dropping 4
    net.nodes["n0"].set_state(5, None, 1000)
    for n in ("n0", "n2", "n3"):
        net.nodes[n].set_trainer_seen(1)
    net.run(1.6)
    plans = net.plans()
    assert set(plans) == {"n0", "n2", "n3"} and len({p.digest() for p in plans.values()}) == 1
    plan = plans["n0"]
    assert plan.target_step == 5 and {x.donor_node for x in plan.transfers} == {"n0"}, plan  # step 5 kept
    assert all(not net.nodes[n].counters.get("report_hold_unseen") for n in net.nodes)


def test_a_trainer_that_never_takes_the_view_in_is_waited_for_report_hold_and_counted() -> None:
    net = MiniNet(["n0", "n1", "n2", "n3"], report_hold=1.0)
    net.run(1.0)
    _computing(net, 5, seen=0)
    net.nodes["n1"].leave(net.now)
    net.run(1.9)
    assert not net.plans()
    net.run(2.6)
    plans = net.plans()
    assert set(plans) == {"n0", "n2", "n3"} and plans["n0"].target_step == 4
    assert net.nodes["n0"].counters.get("report_hold_unseen") == 1
    assert not net.nodes["n0"].counters.get("report_hold_expired")


def test_a_trainer_without_a_page_is_not_waited_for() -> None:
    net = MiniNet(["n0", "n1", "n2", "n3"])
    net.run(1.0)
    _computing(net, 5, seen=None)  # its reports go through the socket: it never says what it has seen
    net.nodes["n1"].leave(net.now)
    net.run(1.5)
    plans = net.plans()
    assert set(plans) == {"n0", "n2", "n3"} and plans["n0"].target_step == 4


def test_the_page_carries_the_newest_group_seen_and_a_commit_reads_as_finishing(tmpdir_: str) -> None:
    path = page_path_for(f"{tmpdir_}/s.sock")

    class Control:
        node = "n0"

    with ProgressPage.create(path, with_bell=False) as agent_side:
        link = AgentLink(Control(), on_lost=lambda why: None)  # type: ignore[arg-type]
        link.see_group(2)  # before the page is open: written when it opens
        link.open_page({"progress_page": path})
        try:
            r = agent_side.read()
            assert r is not None and r.seen_group == 2
            link.report(8, "compute")
            link.see_group(1)  # it only rises
            r = agent_side.read()
            assert r is not None and (r.step, PHASES[r.phase], r.seen_group) == (8, "compute", 2)
            link.finishing(8)  # a commit in the compute phase (a loop without allreduce_gradients)
            r = agent_side.read()
            assert r is not None and (r.step, PHASES[r.phase]) == (8, "optimizer")
            seq = agent_side.seq()
            link.finishing(8)  # already finishing: nothing written
            link.report(9, "communicate")
            link.finishing(9)
            r = agent_side.read()
            assert r is not None and (r.step, PHASES[r.phase]) == (9, "communicate") and r.seq == seq + 2
            link.see_group(3)
            r = agent_side.read()
            assert r is not None and (r.step, PHASES[r.phase], r.seen_group) == (9, "communicate", 3)
        finally:
            link.close()


@pytest.mark.slow
def test_survivors_that_learn_of_a_view_late_keep_the_step_their_agents_reported(tmp_path: Path) -> None:
    # a grid of 2 replicas x 2 shards may shrink: n1 is killed, the job shrinks to n2 and n3, and n0 is
    # released. Its exit then removes it from the view: a new group epoch while n2 and n3 train on, their
    # collectives complete. Each trainer learns of every view 0.3 s late (a loaded machine): before the fix
    # its agent reported at once the step it had committed, the trainer committed ~15 more and dropped it,
    # and the plan named a step no survivor held (RecoveryError after recovery_timeout).
    res = run_scenario(4, 0, 150, [Fault("n1", "kill", 30)], hidden=32, step_ms=20.0, tp_pp=2,
                       allow_shrink=True, workdir=str(tmp_path), timeout=120.0, may_fail=["n1"],
                       trainer_args=["--slow-views", "0.3", "--recovery-timeout", "15"])
    assert res["bit_identical"] and res["final_step"] == [150], res
    for node in ("n2", "n3"):
        t = res["trainers"][node]
        assert t["epoch"] == 2 and t["view_members"] == ["n2", "n3"], (node, t)  # the release's view was met
        assert t["interruptions"] == 2, (node, t)
    assert res["released"] == ["n0"], res
