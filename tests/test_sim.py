"""The simulator as CI runs it: membership figures, determinism, and every agreement scenario over
many seeds (kept to minutes; `make sim-seeds` runs thousands)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gossiprec.errors import ConfigError, InvariantViolation
from gossiprec.sim.agree import SCENARIOS, AgreeParams, run_agreement
from gossiprec.sim.run import SimParams, run_membership
from gossiprec.sim.seeds import run_seeds


def _strip(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("wall_s", "events_per_wall_s", "cpu_s", "events_per_cpu_s")}


def test_membership_run_detects_every_crash_without_false_positives() -> None:
    r = run_membership(SimParams(nodes=60, crash=3, loss=0.01, duration=10, seed=7))
    assert r["undetected"] == 0
    assert r["false_positives"] == 0
    assert r["detected_pairs"] == 3 * 57  # every (crashed, survivor) pair
    assert r["detect_s"]["p99"] < 3.0
    assert r["invariant_violations"] == 0
    assert 0 < r["bytes_per_node_s"] < 4000


def test_pauses_under_loss_cause_no_false_positive() -> None:
    r = run_membership(SimParams(nodes=50, loss=0.05, pause_frac=0.1, pause_max=1.0, pause_every=3.0,
                                 duration=40, seed=3))
    assert r["paused_nodes"] == 5
    assert r["false_positives"] == 0, r["false_positive_nodes"]


def test_long_pause_is_detected_and_the_node_comes_back() -> None:
    # a node frozen for 5 s is declared dead (it is excused from false_positives), then refutes
    r = run_membership(SimParams(nodes=20, pause_frac=0.05, pause_max=6.0, pause_every=1000, duration=30,
                                 seed=11))
    assert r["false_positives"] == 0


def test_same_seed_same_result_byte_for_byte() -> None:
    p = SimParams(nodes=40, crash=2, loss=0.02, duplicate=0.01, reorder=0.05, duration=8, seed=21)
    a, b = run_membership(p), run_membership(p)
    assert json.dumps(_strip(a), sort_keys=True) == json.dumps(_strip(b), sort_keys=True)
    ap = AgreeParams(scenario="rack", nodes=20, seed=5, duration=8)
    assert _strip(run_agreement(ap)) == _strip(run_agreement(ap))


def test_bad_parameters_are_refused_clearly() -> None:
    with pytest.raises(ConfigError, match="--crash"):
        run_membership(SimParams(nodes=5, crash=5))
    with pytest.raises(ConfigError, match="loss"):
        run_membership(SimParams(nodes=5, loss=1.5))
    with pytest.raises(ConfigError, match="unknown scenario"):
        run_agreement(AgreeParams(scenario="meteor"))


# expectations per scenario over many seeds (GOSSIPREC_SIM_SEEDS overrides; `make sim-seeds` runs 10,000)
SEEDS = int(os.environ.get("GOSSIPREC_SIM_SEEDS", "40"))
SWEPT_ELSEWHERE = {"delay", "flappart", "stall", "restart", "respawn", "heal", "mass", "rackflap", "quiet", "blip",
                   "mute"}
"""Scenarios with expectations of their own (tests/test_sim_agreement.py; ``gossiprec bench agreement``)."""


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s not in SWEPT_ELSEWHERE])
def test_scenario_over_seeds(scenario: str) -> None:
    duration = {"flap": 24.0, "partition": 16.0, "split": 16.0, "crash": 8.0, "rack": 8.0, "donor": 10.0,
                "oneway": 10.0}.get(scenario, 12.0)
    s = run_seeds(AgreeParams(scenario=scenario, nodes=10, spares=2, duration=duration), SEEDS, workers=2)
    assert s["invariant_violations"] == 0, s["violations"]
    assert s["missed_removals"] == 0, s["missed_seeds"]
    if scenario != "split":
        assert s["healthy_removed_runs"] == 0, s["healthy_removed_seeds"]
    if scenario in ("crash", "rack", "hang", "oneway", "flap"):
        assert s["one_view_change_ratio"] == 1.0
    if scenario in ("crash", "rack", "hang"):
        assert s["agree_missing_runs"] == 0 and s["plan_missing_runs"] == 0, s
        assert s["agree_s_across_runs"]["max"] < 3.0
        assert s["plan_s_across_runs"]["max"] < 3.5


def test_split_brain_never_decides_while_split() -> None:
    # exact halves: no side has a majority; the checker raises if anyone decides before the heal
    # fencing waits until SWIM on each side suspects enough of the other (up to ~15 s at N=12)
    r = run_agreement(AgreeParams(scenario="split", nodes=12, seed=4, duration=20, heal_after=100))
    assert r["views_decided"] == 0
    assert r["invariant_violations"] == 0
    assert len(r["fenced"]) == 12  # everyone stops its trainer


def test_partition_minority_never_decides_and_majority_moves_on() -> None:
    r = run_agreement(AgreeParams(scenario="partition", nodes=11, seed=2, duration=20, heal_after=100))
    assert r["invariant_violations"] == 0
    assert r["views_decided"] >= 1
    minority = set(r["fenced"])
    assert len(minority) == 5  # every minority member stops its trainer
    # the majority removes the whole minority, and only it (members already dead in SWIM when the first
    # view change lands are watched again in the next epoch)
    assert set(r["removed"]) == minority


def test_cli_json_has_the_documented_keys() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gossiprec", "sim", "--nodes", "30", "--crash", "2", "--loss", "0.01",
         "--duration", "6", "--seed", "3", "--json"], capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout)
    for key in ("nodes", "seed", "virtual_s", "wall_s", "events", "detect_s", "undetected", "false_positives",
                "msgs_per_node_s", "bytes_per_node_s", "bytes_per_node_s_max"):
        assert key in r
    assert set(r["detect_s"]) == {"p50", "p99", "max"}
    out = subprocess.run(
        [sys.executable, "-m", "gossiprec", "sim", "--scenario", "crash", "--nodes", "12", "--duration", "8",
         "--json"], capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout)
    for key in ("agree_s", "views_decided", "invariant_violations", "fast_path_ratio", "plan_s"):
        assert key in r
    assert r["views_decided"] == 1 and r["invariant_violations"] == 0


def test_calendar_queue_pops_in_time_then_push_order() -> None:
    """The event queue must order exactly like one heap of (time, seq): across buckets, within a bucket,
    for equal times (push order), for entries pushed into the current bucket, and for infinite times."""
    from gossiprec.sim.cluster import SimCluster

    class Idle:
        def receive(self, data: bytes, now: float, reliable: bool = False) -> None: ...
        def tick(self, now: float) -> None: ...
        def next_deadline(self) -> float: return float("inf")
        def take_sends(self) -> list: return []
        def take_events(self) -> list: return []

    cluster = SimCluster(2, lambda *a: Idle(), seed=1)
    seen: list[tuple[float, str]] = []
    times = [0.5, 0.0004, 2.0, 0.0004, 0.0011, 0.00099, 7.25, 0.5, 1e-9]
    for i, t in enumerate(times):
        cluster.at(t, lambda t=t, i=i: seen.append((t, f"a{i}")))
    # pushed while running, into the bucket being drained and just behind the clock's bucket
    cluster.at(0.0005, lambda: cluster.at(0.0006, lambda: seen.append((0.0006, "late"))))
    cluster.at(float("inf"), lambda: seen.append((float("inf"), "never")))
    assert cluster.pending() == len(times) + 2
    cluster.run_until(1.0)
    assert cluster.events_processed == 9
    cluster.run_until(10.0)
    expected = sorted([(t, i) for i, t in enumerate(times)] + [(0.0006, 99)])
    assert [t for t, _ in seen] == [t for t, _ in expected]
    assert [name for _, name in seen] == [("late" if i == 99 else f"a{i}") for _, i in expected]
    assert cluster.pending() == 1 and cluster.now == 10.0  # the infinite one never runs


@pytest.mark.parametrize("signing", ["none", "digest"])
def test_the_quorum_audit_counts_delivered_votes_itself(monkeypatch: pytest.MonkeyPatch, signing: str) -> None:
    """A vote-merging bug in the core (here every bitmap, or with signed votes every single vote, is
    taken for the whole view's votes) makes members decide on the first one they get; the audit merges
    the votes the network delivered and finds no fast quorum behind that decision."""
    from gossiprec.core.consensus import Consensus
    from gossiprec.core.wire import Vote, Votes

    merge = Consensus.on_votes

    def everyone_voted(self: Consensus, msg: Votes) -> None:
        merge(self, Votes(msg.epoch, msg.config, msg.digest, b"\xff" * len(msg.bitmap)))

    def every_vote_counts_for_all(self: Consensus, msg: Vote) -> None:
        self.votes[msg.digest] = (1 << len(self.view)) - 1
        self._check_fast(msg.digest)

    monkeypatch.setattr(Consensus, "on_votes", everyone_voted)
    monkeypatch.setattr(Consensus, "on_vote", every_vote_counts_for_all)
    with pytest.raises(InvariantViolation, match="on the fast path without a fast quorum"):
        run_agreement(AgreeParams(scenario="crash", nodes=10, seed=1, duration=8, signing=signing))


def test_the_quorum_audit_counts_delivered_accepts_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a view of 4 a failure leaves no fast quorum: a classic round decides. A coordinator that
    decides at the first Accepted (its own) is refused: the audit counts the acceptors whose Accepted
    the network delivered to it."""
    from gossiprec.core.consensus import Consensus
    from gossiprec.core.wire import Accepted

    def hasty(self: Consensus, msg: Accepted) -> None:
        if self.my_round == (msg.round, msg.coordinator) and self.accept_value is not None \
                and msg.digest == self.accept_value[0] and self.decided is None:
            self.accepts.add(msg.acceptor)
            self._decide(msg.digest, self.accept_value[1], fast=False)

    monkeypatch.setattr(Consensus, "on_accepted", hasty)
    with pytest.raises(InvariantViolation, match="without a majority of accepts"):
        run_agreement(AgreeParams(scenario="crash", nodes=4, spares=1, seed=1, duration=8))
    monkeypatch.undo()
    r = run_agreement(AgreeParams(scenario="crash", nodes=4, spares=1, seed=1, duration=8))
    assert r["invariant_violations"] == 0 and r["views_decided"] >= 1 and r["fast_path_ratio"] == 0.0
