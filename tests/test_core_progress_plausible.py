"""A trainer's report cannot decide who is hung: a rank reported implausibly far ahead of every other is
the anomaly (alerted ``implausible`` and removed), not the ranks waiting for it; a trainer's own report that
jumps further ahead than synchronous training can go is refused."""

from __future__ import annotations

from typing import Any

import pytest

from gossiprec.core.events import AlertRaised
from gossiprec.core.wire import PHASES
from gossiprec.errors import ProtocolError
from gossiprec.sim.agree import AgreeParams, AgreementChecker, build_cluster

COMPUTE, COMMUNICATE = PHASES.index("compute"), PHASES.index("communicate")


def _watched(params: AgreeParams) -> tuple[Any, list[str], AgreementChecker, list[tuple[str, str, str]]]:
    """A simulated cluster whose invariants are checked on every event (the checker raises at a breach)
    and whose alerts are collected as (observer, subject, reason)."""
    cluster, names, extra = build_cluster(params)
    checker = AgreementChecker(cluster, params, extra["identity"])
    cluster.observers.append(checker)
    alerts: list[tuple[str, str, str]] = []
    cluster.observers.append(lambda now, i, ev: alerts.append((names[i], ev.subject, ev.reason))
                             if isinstance(ev, AlertRaised) else None)
    return cluster, names, checker, alerts


def _bogus_leader_run(seed: int, bogus_step: int | None) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """Ranks 0 and 1 wait at step 10 from t = 1 s while rank 2 reports ``bogus_step`` (None: all three
    train in lockstep from t = 1.3 s, rank 2 always one step ahead)."""
    params = AgreeParams(scenario="crash", nodes=3, spares=0, seed=seed, duration=10.0)
    cluster, names, checker, alerts = _watched(params)

    def report() -> None:
        now = cluster.now
        step = 10 if bogus_step is not None or now < 1.3 else 11 + int((now - 1.3) / 0.3)
        for i in (0, 1):  # two healthy ranks waiting in the collective of step 10
            cluster.nodes[i].machine.set_progress(step, COMPUTE if now < 1.0 else COMMUNICATE, 300, now)
        if now >= 1.0:  # the third's first report: a counter gone wrong
            cluster.nodes[2].machine.set_progress(step + 1 if bogus_step is None else bogus_step, COMPUTE, 300,
                                                  now)
        cluster.at(now + 0.1, report)

    cluster.at(0.1, report)
    cluster.run_until(params.duration)
    return {"removed": dict(checker.removed_at), "names": names}, alerts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_rank_reporting_step_2_62_is_removed_not_the_two_waiting_for_it(seed: int) -> None:
    r, alerts = _bogus_leader_run(seed, 2**62)
    names = r["names"]
    assert names[0] not in r["removed"] and names[1] not in r["removed"], f"seed {seed}: healthy removed {alerts}"
    assert names[2] in r["removed"], f"seed {seed}: the bogus rank stayed {alerts}"
    reasons = {reason for _, subject, reason in alerts if subject == names[2]}
    assert "implausible" in reasons and reasons <= {"implausible", "joining"}, reasons  # (back as a spare)
    assert not [a for a in alerts if a[1] != names[2]], f"seed {seed}: {alerts}"


def test_a_rank_one_step_ahead_is_nothing_unusual() -> None:
    # synchronous training allows one step (the leader started the next compute): nobody judged
    r, alerts = _bogus_leader_run(1, None)
    assert r["removed"] == {} and alerts == []


def test_a_report_that_jumps_further_than_training_can_go_is_refused() -> None:
    cluster, _, _ = build_cluster(AgreeParams(scenario="crash", nodes=3, spares=0))
    node = cluster.nodes[0].machine
    node.set_progress(10, COMPUTE, 300, 1.0)
    with pytest.raises(ProtocolError, match="jumped from 10 to"):
        node.set_progress(2**62, COMPUTE, 300, 1.1)
    assert node.my_progress[0] == 10  # nothing kept
    node.set_progress(11, COMPUTE, 300, 1.4)  # the next step
    node.set_progress(20, COMPUTE, 1, 1.5)  # a burst the agent saw late: fast steps in 0.1 s are plausible
    node.set_progress(5, COMPUTE, 300, 1.6)  # back to a checkpoint: allowed
    node.set_progress(5, PHASES.index("recovering"), 300, 1.7)
    node.set_progress(9000, COMPUTE, 300, 1.71)  # out of recovery, at the state it received
    assert node.my_progress[0] == 9000


def test_one_rank_ahead_of_a_single_lagging_other_is_not_the_anomaly() -> None:
    # two ranks and a spare, 30 ms steps; rank 1's agent hears its trainer 3 steps late (starved on a
    # loaded host). One against one cannot tell a counter gone wrong from a lagging report: nobody is
    # judged (before, the spare alerted rank 0 "implausible" at once, and with rank 1 SIGSTOPped next the
    # cut held both ranks, so the healthy one fenced with the only copy of the state)
    params = AgreeParams(scenario="crash", nodes=3, spares=1, seed=1, duration=6.0)
    cluster, names, checker, alerts = _watched(params)

    def report() -> None:
        now = cluster.now
        step = int(now / 0.03)
        cluster.nodes[0].machine.set_progress(step, COMPUTE, 30, now)
        cluster.nodes[1].machine.set_progress(max(0, step - 3), COMPUTE, 30, now)
        cluster.at(now + 0.01, report)

    cluster.at(0.01, report)
    cluster.run_until(params.duration)
    assert alerts == [] and checker.removed_at == {}, alerts
