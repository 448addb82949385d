"""What the trainer's follower makes of the agent's events: when a recovery's failure was detected, and
the fence that turns a trainer into a waiting spare (events fed in directly, no agent)."""

from __future__ import annotations

import threading
import time

from gossiprec.core.election import Plan
from gossiprec.core.events import (
    Fenced, MemberAlive, MemberLeft, MemberSuspected, PlanReady, Unfenced, ViewInstalled,
)
from gossiprec.trainer.follower import Follower


def _follower() -> tuple[Follower, list[str]]:
    aborts: list[str] = []
    f = Follower("/nonexistent.sock", threading.Event(), abort=aborts.append, abort_older=lambda e, r: None,
                 on_plan=lambda plan: None)
    return f, aborts


def _view(epoch: int, members: tuple[str, ...], at: float, removed: tuple[str, ...] = ()) -> ViewInstalled:
    return ViewInstalled(epoch, f"c{epoch}", members, removed, (), False, True, at)


def test_a_refuted_start_up_suspicion_of_a_survivor_does_not_date_the_victims_failure() -> None:
    f, _ = _follower()
    f.on_event(_view(0, ("n0", "n1", "n2"), 1.0))
    f.on_event(MemberSuspected("n0", 0, "n1", 2.0))  # a starved member during start-up...
    f.on_event(MemberAlive("n0", 1, 2.5))  # ...refuted
    f.on_event(MemberLeft("n2", 0, 10.0))  # the victim, killed at 9.9
    assert f.detection_since(0.0) == (None, 1.0)  # the view still holds n2: not yet agreed
    f.on_event(_view(1, ("n0", "n1", "n3"), 10.4, removed=("n2",)))
    assert f.detection_since(0.0) == (10.0, 10.4)
    # a failure before the last recovery belongs to it, not to the next one
    assert f.detection_since(10.2) == (None, 10.4)


def test_a_suspicion_of_the_victim_refuted_before_it_died_counts_from_after_it() -> None:
    f, _ = _follower()
    f.on_event(_view(0, ("n0", "n1"), 1.0))
    f.on_event(MemberSuspected("n1", 0, "n0", 2.0))
    f.on_event(MemberAlive("n1", 1, 2.2))
    f.on_event(MemberSuspected("n1", 1, "n0", 7.0))
    f.on_event(_view(1, ("n0", "n2"), 7.5, removed=("n1",)))
    assert f.detection_since(0.0) == (7.0, 7.5)


def test_a_fence_aborts_and_holds_until_unfenced() -> None:
    f, aborts = _follower()
    f.on_event(_view(0, ("n0", "n1", "n2"), 1.0))
    f.on_event(Fenced(0, "no quorum: cannot reach a majority of the view", 3.0))
    assert f.fenced.startswith("no quorum") and aborts and f.trouble(0)
    f.on_event(Unfenced(2, 9.0))
    assert f.fenced == "" and f.newest_group == 2


def _plan(epoch: int) -> Plan:
    from gossiprec.core.election import StateReport, elect
    from gossiprec.core.topology import JobTopology, Member

    members = [Member(f"n{r}", "trainer", r, f"h{r}", "r0") for r in range(2)]
    reports = {f"n{r}": StateReport(f"n{r}", r, 5, 6, 100) for r in range(2)}
    return elect(epoch, members, {0: "n0", 1: "n1"}, reports, JobTopology.ddp(2))


def test_the_gates_look_ahead_waits_for_the_newest_views_plan() -> None:
    """``plan_after``: the plan of the newest view only (a plan of a view already superseded is not
    the one the job follows), and nothing once fenced."""
    f, _ = _follower()
    polls: list[int] = []
    f.on_event(_view(2, ("n0", "n1"), 1.0))
    f.on_event(PlanReady(1, "d1", _plan(1), 1.0))
    assert f.plan_after(0, time.monotonic() + 0.15, poll=lambda: polls.append(1)) is None  # epoch 2's is not in
    assert polls  # the status fallback was asked meanwhile
    later = threading.Timer(0.05, lambda: f.on_event(PlanReady(2, "d2", _plan(2), 2.0)))
    later.start()
    got = f.plan_after(0, time.monotonic() + 30)
    later.join()
    assert got is not None and got.epoch == 2 and got.target_step == 6
    assert f.plan_after(2, time.monotonic() + 0.05) is None  # nothing newer than epoch 2
    f.on_event(Fenced(2, "no quorum", 3.0))
    start = time.monotonic()
    assert f.plan_after(0, start + 30) is None and time.monotonic() - start < 10  # at once, not at the deadline


def test_each_newer_group_is_told_once_the_loop_would_see_it_and_before_the_old_groups_are_aborted() -> None:
    calls: list[tuple[str, int, bool]] = []
    f: Follower

    def seen(epoch: int) -> None:
        calls.append(("seen", epoch, f.trouble(epoch - 1)))  # the loop's look already says so

    f = Follower("/nonexistent.sock", threading.Event(), abort=lambda why: None,
                 abort_older=lambda e, why: calls.append(("abort_older", e, True)), on_plan=lambda plan: None,
                 see_group=seen)
    f.on_event(_view(0, ("n0", "n1", "n2"), 1.0))
    f.on_event(_view(1, ("n0", "n1", "n2", "s0"), 2.0))
    assert calls[-2:] == [("seen", 1, True), ("abort_older", 1, True)], calls
    f.on_event(ViewInstalled(2, "c2", ("n0", "n1", "n2"), ("s0",), (), False, True, 3.0, group_epoch=1))
    assert calls[-2:] == [("seen", 1, True), ("abort_older", 1, True)], calls  # it kept the group: still 1
    f.on_event(Unfenced(4, 9.0))
    assert calls[-1][:2] == ("seen", 4), calls
    f.absorb_status({"view": None}, 4)
    assert calls[-1][:2] == ("seen", 4), calls
