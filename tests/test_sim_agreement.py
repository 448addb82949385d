"""Agreement that never kills the job: the simulator's fault scenarios for each way a decision, a stall,
a restart or a heal could take a healthy job down, checked over a few seeds (the bench command
``gossiprec-bench agreement`` runs hundreds). Every failed check names its seed."""

from __future__ import annotations

from gossiprec.sim.agree import AgreeParams, run_agreement


def _seeds(scenario: str, seeds: range, **kw: object) -> list[dict]:
    return [run_agreement(AgreeParams(scenario=scenario, seed=s, **kw)) for s in seeds]  # type: ignore[arg-type]


def test_a_delayed_node_is_removed_once_not_again_and_again() -> None:
    # every packet to or from one node 0.3-0.8 s late: it misses every probe, so it goes once; its
    # joiner observers admit it only once it answers a probe in time, so it does not come back just to
    # be removed again (each a recovery of the job)
    for r in _seeds("delay", range(1, 4), nodes=10, duration=20.0):
        assert r["invariant_violations"] == 0, r["seed"]
        assert r["most_removals"] <= 1, f"seed {r['seed']}: removed {r['most_removals']} times"
        assert r["views_decided"] <= 1, f"seed {r['seed']}: {r['views_decided']} view changes"
