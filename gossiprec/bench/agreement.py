"""``gossiprec bench agreement``: the simulator's scenarios of agreement under trouble, over many seeds.

What it reports, per scenario (one JSON object on stdout): invariant violations (with the seed and the
replay command of each), runs with a decision that removed a majority of its view (must be 0), runs
that removed a healthy node, runs that ended with a live node fenced or outside the one view, a node
removed more than once, view changes per run, agreement time across runs (fault -> every survivor
installed the view without the failed nodes) and settle time (the last fault -> every live node in one
view of exactly the live nodes, unfenced), and the simulator's events per CPU second, against a quiet run
of the same size (the cost of cut detection under partitions and hang storms).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gossiprec.sim.agree import AgreeParams
from gossiprec.sim.seeds import run_seeds

SCENARIOS: dict[str, dict[str, float]] = {
    "quiet": {"duration": 12.0},
    "flappart": {"duration": 22.0, "heal_after": 10.0},
    "stall": {"duration": 14.0},
    "restart": {"duration": 16.0},
    "respawn": {"duration": 16.0},
    "heal": {"duration": 18.0, "heal_after": 6.0},
    "mass": {"duration": 10.0},
    "rackflap": {"duration": 14.0},
    "delay": {"duration": 20.0},
    "partition": {"duration": 16.0},
    "hang": {"duration": 12.0},
    "blip": {"duration": 20.0, "nodes": 3, "spares": 1},
}
"""Scenario -> its parameters (virtual seconds), the same as tests/test_sim_agreement.py uses; a scenario
about a small job (two starved members of three) pins its size, whatever ``--nodes`` says."""

KEYS = ("invariant_violations", "violations", "majority_removed_runs", "missed_removals", "missed_seeds",
        "healthy_removed_runs", "healthy_removed_seeds", "ended_fenced_runs", "ended_fenced_seeds",
        "unsettled_runs", "unsettled_seeds", "removed_again_runs", "removed_again_seeds",
        "one_view_change_ratio", "view_changes_per_run", "agree_s_across_runs", "settle_s_across_runs",
        "cpu_s_total", "events_per_cpu_s")


def run(nodes: int, seeds: int, scenarios: list[str], workers: int, progress: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": nodes, "seeds": seeds, "scenarios": {}}
    for sc in scenarios:
        params = AgreeParams(scenario=sc, **{"nodes": nodes, **SCENARIOS[sc]})  # type: ignore[arg-type]
        s = run_seeds(params, seeds, workers=workers, progress=progress)
        out["scenarios"][sc] = {"nodes": params.nodes, **{k: s[k] for k in KEYS}}
    quiet = out["scenarios"].get("quiet")
    if quiet and quiet["events_per_cpu_s"]:
        # how much slower each scenario simulates than the quiet run (1.0: as fast)
        out["cpu_cost_vs_quiet"] = {sc: round(quiet["events_per_cpu_s"] / max(1, r["events_per_cpu_s"]), 2)
                                    for sc, r in out["scenarios"].items()}
    return out


def _cmd(args: argparse.Namespace) -> int:
    scenarios = args.scenarios.split(",") if args.scenarios else list(SCENARIOS)
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        print(f"gossiprec bench agreement: error: unknown scenario {', '.join(unknown)}; choose from "
              f"{', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    report = run(args.nodes, args.seeds, scenarios, args.workers, not args.quiet)
    print(json.dumps(report, indent=None if args.json else 2))
    bad = sum(r["invariant_violations"] for r in report["scenarios"].values())
    return 1 if bad else 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``agreement`` to the ``bench`` sub-commands (sets ``func``)."""
    p = subparsers.add_parser(
        "agreement", help="agreement under flapping partitions, stalls, restarts, heals and mass crashes "
                          "(simulator, many seeds)",
        description="Run the simulator's agreement scenarios over seeds 1..N and print one JSON report: per "
                    "scenario the invariant record (every failure with its seed and replay command), "
                    "healthy removals, runs ending fenced or unsettled, view changes per run, agreement "
                    "and settle times across runs, and events per CPU second against a quiet run.")
    p.add_argument("--nodes", type=int, default=16, help="cluster size (default 16)")
    p.add_argument("--seeds", type=int, default=100, help="seeds per scenario (default 100)")
    p.add_argument("--scenarios", default=None, help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--json", action="store_true", help="compact JSON (one line)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd)
    return p  # type: ignore[no-any-return]
