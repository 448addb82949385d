"""A walk through gossiprec's simulator: the very core the agents run, on a virtual clock.

    python examples/simulator_tour.py

Each stop runs one agreement scenario (a few seconds of wall time each) and prints what it shows.
Every run is deterministic: the same seed gives the same figures, and a broken invariant names the
seed and the command that replays it. The same scenarios run from the command line:
``gossiprec sim --scenario NAME --nodes N --seed S --json``.
"""

from __future__ import annotations

from gossiprec.sim.agree import AgreeParams, run_agreement


def stop(title: str, params: AgreeParams, show: tuple[str, ...]) -> dict:
    res = run_agreement(params)
    print(f"\n== {title}\n   gossiprec sim --scenario {params.scenario} --nodes {params.nodes} --seed {params.seed}")
    for key in show:
        print(f"   {key:22s} {res.get(key)}")
    assert res["invariant_violations"] == 0  # one view per epoch, quorums, identical plans, no minority decision
    return res


def main() -> None:
    # 1. A trainer host crashes: probes fail, its observers alert, every member votes for the same cut,
    #    a fast quorum decides the new view, and every member computes the same recovery plan.
    stop("a crash: one view change, one plan", AgreeParams(scenario="crash", nodes=16, seed=1),
         ("removed", "agree_s", "plan_s", "views_decided", "fast_path_ratio"))
    # 2. A rack (5% of the nodes) fails at once: the alerts settle, and all of it lands in one change.
    stop("a rack at once", AgreeParams(scenario="rack", nodes=40, seed=2),
         ("expected_removed", "removed", "views_decided"))
    # 3. A rank hangs (alive, answers probes, its step stalls): the agents find it from the step
    #    counters and remove only it; a straggler that lags but moves is kept.
    stop("a hung rank", AgreeParams(scenario="hang", nodes=12, seed=3), ("removed", "healthy_removed"))
    stop("a straggler is not evicted", AgreeParams(scenario="straggler", nodes=12, seed=3),
         ("removed", "healthy_removed"))
    # 4. A partition: the majority side decides without the minority, the minority fences (its
    #    trainers stop) instead of deciding a view of its own; after the heal they come back as spares.
    stop("a partition: the minority fences", AgreeParams(scenario="partition", nodes=10, seed=4),
         ("removed", "fenced", "joined"))
    # 5. Exact halves: neither side has a majority, so neither decides while split (split brain is
    #    impossible; the checker fails the run if either did); everyone fences, and once healed they
    #    agree again.
    stop("exact halves: no decision until the heal", AgreeParams(scenario="split", nodes=10, seed=5),
         ("fenced", "views_decided"))
    print("\nMore: `gossiprec sim --help` (every fault option), `make sim-seeds` (thousands of seeds).")


if __name__ == "__main__":
    main()
