"""Agreement that never kills the job: the simulator's fault scenarios for each way a decision, a stall,
a restart or a heal could take a healthy job down, checked over a few seeds each (``gossiprec bench
agreement`` runs hundreds). Every run checks the invariants on every event (one view per epoch, quorums
from delivered packets, no decision that removes a majority); every failed check names its seed."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from gossiprec.core.fencing import RESTART_FENCE
from gossiprec.core.view import REMOVE
from gossiprec.core.wire import RESTARTED, Alert
from gossiprec.errors import InvariantViolation
from gossiprec.sim.agree import AgreeParams, run_agreement

SEEDS = range(1, 4)


def _runs(scenario: str, seeds: range = SEEDS, **kw: Any) -> list[dict[str, Any]]:
    out = []
    for s in seeds:
        try:
            out.append(run_agreement(AgreeParams(scenario=scenario, seed=s, **kw)))
        except InvariantViolation as exc:  # (its message names the seed and the replay command)
            pytest.fail(str(exc))
    return out


def _settled(r: dict[str, Any], within: float) -> None:
    seed = r["seed"]
    assert r["settled_at_end"], f"seed {seed}: live nodes not in one view of exactly them at the end"
    assert r["fenced_at_end"] == [], f"seed {seed}: ended fenced: {r['fenced_at_end']}"
    assert r["settle_s"] is not None and r["settle_s"] <= within, f"seed {seed}: settled after {r['settle_s']} s"


def test_a_delayed_node_is_removed_once_not_again_and_again() -> None:
    # every packet to or from one node 0.3-0.8 s late: it misses every probe, so it goes once; its
    # joiner observers admit it only once it answers a probe in time, so it does not come back just to
    # be removed again (each a recovery of the job)
    for r in _runs("delay", nodes=10, duration=20.0):
        assert r["most_removals"] <= 1, f"seed {r['seed']}: removed {r['most_removals']} times"
        assert r["views_decided"] <= 1, f"seed {r['seed']}: {r['views_decided']} view changes"
        _settled(r, within=20.0)


def test_flapping_partitions_never_remove_a_majority_and_everyone_is_back_after_the_heal() -> None:
    # partitions re-split differently every 0.5-4 s for 10 s (the checker fails any decision removing a
    # majority of its view); after the final heal every node is back in one view, unfenced
    for r in _runs("flappart", nodes=16, duration=22.0, heal_after=10.0):
        _settled(r, within=8.0)


def test_a_crash_while_the_survivors_are_starved_is_still_decided() -> None:
    # three members: one crashes while the two others are starved for a moment (every packet 0.5-1.5 s
    # late), so they accuse each other and retract. Late copies of those alerts, arriving after the
    # retractions, kept a healthy member in the cut, so it removed a majority and was withheld until
    # both fenced for good (seeds 13 and 14 did, before alerts were numbered)
    for r in _runs("blip", seeds=range(1, 21), nodes=3, spares=1, duration=20.0):
        assert r["removed"] == r["expected_removed"], f"seed {r['seed']}: removed {r['removed']}"
        _settled(r, within=10.0)


@pytest.mark.parametrize("nodes,spares", [(3, 1), (10, 2)])
def test_a_node_that_accused_everyone_and_then_died_is_removed_alone(nodes: int, spares: int) -> None:
    # it heard nobody for 1.2-2.5 s (so it accused its subjects), then crashed, its alerts never retracted;
    # at 3 members each healthy one's cut kept only the other, which that stale word made look
    # unreachable: both withheld the cut and fenced for good
    for r in _runs("mute", seeds=range(1, 21), nodes=nodes, spares=spares, duration=16.0):
        assert r["removed"] == r["expected_removed"], f"seed {r['seed']}: removed {r['removed']}"
        assert set(r["fenced"]) <= set(r["expected_removed"]), f"seed {r['seed']}: fenced {r['fenced']}"
        _settled(r, within=6.0)


def test_a_job_wide_stall_is_no_ones_hang() -> None:
    # the whole job waits 1.3-5 s in one collective, then resumes: nobody removed, no view change
    for r in _runs("stall", nodes=16, duration=14.0):
        assert r["views_decided"] == 0 and r["removed"] == [], f"seed {r['seed']}: removed {r['removed']}"
        assert r["training_step"] > 0


@pytest.mark.parametrize("scenario", ["restart", "respawn"])
def test_a_restarted_agent_is_back_in_the_view(scenario: str) -> None:
    # an agent restarted from the job spec before (0.2-1.2 s) or after (6-8 s) its removal: its old place
    # goes once (no silent takeover, no job waiting for a trainer that reports nothing), and the new
    # process is back in the view as a spare, nobody fenced
    for r in _runs(scenario, nodes=16, duration=16.0):
        assert r["removed"] == r["expected_removed"], f"seed {r['seed']}: removed {r['removed']}"
        assert r["most_removals"] == 1, f"seed {r['seed']}"
        assert set(r["expected_removed"]) <= set(r["joined"]), f"seed {r['seed']}: not back in the view"
        _settled(r, within=5.0)


def test_a_reprovisioned_host_of_a_small_job_is_admitted_back_as_a_spare() -> None:
    # two trainers and a spare, as the harness's reprovision fault: a trainer's host dies, the spare takes
    # its rank, and the host comes back from the job spec (view 0, same name and address) 6-8 s later
    for r in _runs("respawn", nodes=3, spares=1, duration=16.0):
        assert r["removed"] == r["expected_removed"] and r["most_removals"] == 1, f"seed {r['seed']}"
        assert set(r["expected_removed"]) <= set(r["joined"]), f"seed {r['seed']}: not admitted back"
        _settled(r, within=3.0)


def _quiet_with(monkeypatch: pytest.MonkeyPatch, at: float, act: Callable[[Any], None]) -> dict[str, Any]:
    """The quiet scenario (10 nodes, seed 1) with ``act(cluster)`` run at virtual time ``at``."""
    import gossiprec.sim.agree as agree

    build = agree.build_cluster

    def patched(params: AgreeParams) -> Any:
        cluster, names, extra = build(params)
        cluster.at(at, lambda: act(cluster))
        return cluster, names, extra

    monkeypatch.setattr(agree, "build_cluster", patched)
    return run_agreement(AgreeParams(scenario="quiet", nodes=10, seed=1, duration=8.0))


def test_a_node_that_refutes_suspicion_during_start_up_is_not_taken_for_a_restart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # suspected once while it still says hello: it refutes (its incarnation rises), yet it is the same
    # process; its Hello names the incarnation it started at, so no observer alerts 'restarted'
    def refute(cluster: Any) -> None:
        m = cluster.nodes[3].machine
        before = m.incarnation
        m.swim._refute(m.incarnation, "n00001", cluster.now)
        assert m.incarnation > before

    r = _quiet_with(monkeypatch, 1.2, refute)
    assert r["views_decided"] == 0 and r["removed"] == [], r["removed"]
    assert r["fenced"] == []


def test_one_restarted_alert_that_makes_no_change_does_not_fence_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    # one observer's word that n3 restarted (a stale record of an older process, say): too few alerts for
    # a change, so n3 is no restart; it fences at once (a restart's trainer must not take the old place
    # over), then unfences in the same view
    def one_alert(cluster: Any) -> None:
        m = cluster.nodes[3].machine
        v = m.view
        observer = m.overlay(v).observers(m.name)[0]
        signer = next(n.machine for n in cluster.nodes if n.name == observer)  # the observer's own word
        alert = signer.auth.sign(Alert(v.epoch, v.config_id, observer, m.name, REMOVE, RESTARTED, False, m.addr,
                                       "", ""))
        m.count_alert(alert, cluster.now)
        assert m.fenced == RESTART_FENCE

    r = _quiet_with(monkeypatch, 2.5, one_alert)
    assert r["fenced"] != [], "the alert fenced nobody: the test tests nothing"
    assert r["views_decided"] == 0 and r["removed"] == []
    assert r["fenced_at_end"] == []


def test_fencing_ends_after_the_final_heal() -> None:
    # exact halves for 6 s: no side may decide and members fence; healed, the view is intact and every
    # node unfences in it (only a new view used to unfence)
    rs = _runs("heal", nodes=16, duration=18.0, heal_after=6.0)
    assert any(r["fenced"] for r in rs), "no run fenced: the scenario tests nothing"
    for r in rs:
        assert r["views_decided"] == 0, f"seed {r['seed']}"
        _settled(r, within=6.0)


def test_a_vote_cast_while_cut_off_removes_no_one_after_the_heal() -> None:
    # in these seeds one half, cut off, votes to remove part of the other half (a member of it that it had
    # no news of counted as reachable), and its coordinators keep asking for promises. Healed, the first
    # promise from the other side used to make a majority and remove four healthy members. They answer
    # again (back from the dead in SWIM, their alerts retracted): nothing may be decided
    for seed in (14, 27, 32):
        try:
            r = run_agreement(AgreeParams(scenario="heal", seed=seed, nodes=16, duration=18.0, heal_after=6.0))
        except InvariantViolation as exc:
            pytest.fail(str(exc))
        assert r["views_decided"] == 0 and r["removed"] == [], f"seed {seed}: removed {r['removed']}"
        _settled(r, within=6.0)


def test_forty_percent_crashed_at_once_go_in_one_view_change() -> None:
    for r in _runs("mass", nodes=16, duration=10.0):
        assert r["removed_all_expected"] and r["healthy_removed"] == [], f"seed {r['seed']}"
        assert len(r["removal_epochs"]) == 1, f"seed {r['seed']}: {r['removal_epochs']}"
        assert r["agree_s"]["max"] is not None and r["agree_s"]["max"] < 3.5, f"seed {r['seed']}: {r['agree_s']}"
        _settled(r, within=3.5)


def test_a_rack_and_a_flapping_node_take_no_healthy_node_with_them() -> None:
    # a quarter of the nodes (one rack) crash while another loses 80% of its packets: the flapper accuses
    # its subjects, and with crashed rack members among their observers it must not take one out
    for r in _runs("rackflap", nodes=16, duration=14.0):
        assert r["removed_all_expected"], f"seed {r['seed']}: kept {set(r['expected_removed']) - set(r['removed'])}"
        assert r["healthy_removed"] == [], f"seed {r['seed']}: removed healthy {r['healthy_removed']}"
        # the rack's members go together (a member whose observers' probes reached it late is in doubt,
        # and holds the proposal until its alerts come), whatever becomes of the flapper
        rack = set(r["expected_removed"]) - set(r["dont_care"])
        assert len(rack) == 4 and len({r["removal_epoch_of"][x] for x in rack}) == 1, \
            f"seed {r['seed']}: {r['removal_epoch_of']}"
        _settled(r, within=10.0)


def test_the_bench_command_reports_every_figure() -> None:
    from gossiprec.bench.agreement import KEYS, run

    report = run(nodes=10, seeds=1, scenarios=["quiet", "stall"], workers=1, progress=False)
    for sc in ("quiet", "stall"):
        row = report["scenarios"][sc]
        assert set(KEYS) <= set(row)
        assert row["invariant_violations"] == 0 and row["majority_removed_runs"] == 0
    assert set(report["cpu_cost_vs_quiet"]) == {"quiet", "stall"}


@pytest.mark.parametrize("scenario, spares, nodes", [("crash", 2, 10), ("crash", 1, 4), ("restart", 2, 10)])
def test_the_simulator_agrees_with_real_ed25519_signatures(scenario: str, spares: int, nodes: int) -> None:
    # the agents' own scheme in place of the simulator's keyed hash: the same decisions (a fast round at
    # 10 members, a classic round at 4, where a failure leaves no fast quorum; a restart's rejoin)
    for signing in ("ed25519", "digest", "none"):
        (r,) = _runs(scenario, range(1, 2), nodes=nodes, spares=spares, duration=10.0, signing=signing)
        assert r["invariant_violations"] == 0 and r["views_decided"] >= 1, (signing, r["views_decided"])
        assert r["removed"] == r["expected_removed"], (signing, r["removed"])
        _settled(r, 10.0)
