"""``gossiprec bench scale``: one table of how detection, agreement, the plan, CPU, traffic and the
bootstrap grow with the cluster size N, from the simulator with real costs and from real agents.

Per size N of ``--sizes``, two kinds of row:

``sim``
    :func:`gossiprec.sim.agree.run_agreement` (scenario ``crash``: one trainer crashes at 3 virtual
    seconds, no training model), every Ed25519 signature charged on the agent's virtual clock
    (``--real-crypto``: measured here at start, or ``--crypto-cost-us``), plus
    :func:`gossiprec.sim.boot.run_bootstrap` (N candidates started together, three seeds, all alive; no
    CPU cost is charged there: its time is protocol rounds on the virtual network only).
``real``
    for N <= ``--real-max``: :func:`gossiprec.bench.seeded.run_seeded`, N agents on 127.0.0.1 that
    agree on view 0 from a seed list (``--nnodes``), an idle window, then ``--trials`` SIGKILLs. One
    process per agent unless ``--per-process K`` (above 16 agents, the agents that are neither seeds nor
    victims then run K to a process, on one event loop; on 2 loaded cores that made 32 agents fail their
    trials, see docs/benchmarks.md#scaling).

Columns (null where a kind does not measure it; never estimated):

- ``detect_p99_s``: kill -> the first survivor's alert about the victim (p99 over trials; sim: 1 trial);
- ``agree_p50_s`` / ``agree_p99_s``: kill -> the last survivor installed the view without the victim;
- ``plan_ready_p99_s`` (sim): kill -> the plan ready on a survivor, p99 over survivors;
- ``cpu_per_agent_per_recovery_s``: sim: Ed25519 CPU charged per agent from the kill to 1 s after the plan
  was ready everywhere, less the idle rate (mean over agents); real: CPU of all agent processes from the
  kill until every survivor installed the view, less the idle rate, divided by the survivors (mean over
  trials; it includes serving the bench's event subscriptions);
- ``bytes_per_agent_s``: idle bytes sent per agent per second (sim: payload; real: sealed bytes handed
  to the kernel, the transport's ``tx_bytes``);
- ``bootstrap_s``: sim: virtual seconds until every candidate learnt view 0 (all started at 0); real: from
  the last agent up (its control socket answered) until every agent learnt view 0;
- ``bytes_per_seed``: bytes received by a seed during the bootstrap (mean over the seeds);
- ``idle_cpu_pct_per_agent``, ``rss_mb_per_agent`` (real): at rest, a shared process split evenly;
- ``disagreements`` (real: trials whose survivors installed different views for the epoch; sim: broken
  invariants), ``refused`` (real: packets the agents' transports refused, summed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from gossiprec.errors import ConfigError, GossiprecError

DEFAULT_SIZES = (16, 128)
"""What finishes here in a few minutes per size (N=1,024 takes tens of minutes of simulator CPU)."""
COLUMNS = ("detect_p99_s", "agree_p50_s", "agree_p99_s", "plan_ready_p99_s", "cpu_per_agent_per_recovery_s",
           "bytes_per_agent_s", "bootstrap_s", "bytes_per_seed", "idle_cpu_pct_per_agent", "rss_mb_per_agent",
           "disagreements", "refused", "trials", "wall_s")


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 6) if xs else None


def sim_row(n: int, costs: Any, duration: float, seed: int) -> dict[str, Any]:
    from gossiprec.sim.agree import AgreeParams, run_agreement
    from gossiprec.sim.boot import BootSimParams, run_bootstrap

    w0 = time.perf_counter()
    r = run_agreement(AgreeParams(scenario="crash", nodes=n, spares=min(2, n - 2), seed=seed, duration=duration,
                                  crash=1, train=False, crypto_costs=costs))
    b = run_bootstrap(BootSimParams(nodes=n, expected=n, spares=min(2, n - 1), seeds=min(3, n), dead_seeds=0,
                                    start_spread=0.0, duration=3.0, seed=seed))
    cpu = r.get("cpu_per_recovery_s") or {}
    sent = r.get("bytes_per_agent_s") or {}
    return {
        "kind": "sim", "nodes": n,
        "detect_p99_s": r.get("detect_s"),
        "agree_p50_s": r["agree_s"]["p50"], "agree_p99_s": r["agree_s"]["p99"],
        "plan_ready_p99_s": (r.get("plan_ready_s") or {}).get("p99"),
        "cpu_per_agent_per_recovery_s": cpu.get("mean"),
        "bytes_per_agent_s": sent.get("mean"),
        "bootstrap_s": round(b["agree_s"], 4) if b["agree_s"] is not None and b["agreed_by"] == n else None,
        "bytes_per_seed": _mean([float(x) for x in b["seed_rx_bytes"]]),
        "idle_cpu_pct_per_agent": None, "rss_mb_per_agent": None,
        "disagreements": r["invariant_violations"] + len(b["invariant_violations"]),
        "refused": None, "trials": 1,
        "wall_s": round(time.perf_counter() - w0, 2),
        "detail": {"virtual_s": duration, "sim_cpu_s": r.get("cpu_s"), "plan_ready_everywhere": r.get(
            "plan_ready_everywhere"), "removed_all_expected": r.get("removed_all_expected"),
            "boot_agreed_by": b["agreed_by"], "boot_wall_s": b["wall_s"]},
    }


def real_row(n: int, trials: int, idle_s: float, per_process: int, seed: int, progress: Any) -> dict[str, Any]:
    from gossiprec.agent.cli import run_async
    from gossiprec.bench.agents import BenchSpec
    from gossiprec.bench.seeded import run_seeded

    w0 = time.perf_counter()
    spec = BenchSpec(nodes=n, trials=trials, mode="kill", spares=1 if n < 8 else 2, idle_s=idle_s,
                     idle_warmup_s=3.0, seed=seed)
    k = 1 if n <= 16 else per_process
    r = run_async(run_seeded(spec, progress, k))
    idle = r.get("idle") or {}
    seeds = r.get("seed_bytes_at_bootstrap") or []
    trials_done = [t for t in r["per_trial"] if t["new_view_s"] is not None]
    detect = [t["alerts_s"][0] for t in r["per_trial"] if t["alerts_s"]]
    from gossiprec.bench.agents import percentile
    return {
        "kind": "real", "nodes": n,
        "detect_p99_s": round(percentile(detect, 99), 4) if detect else None,
        "agree_p50_s": (r["new_view_s"] or {}).get("p50"), "agree_p99_s": (r["new_view_s"] or {}).get("p99"),
        "plan_ready_p99_s": None,
        "cpu_per_agent_per_recovery_s": r.get("cpu_per_agent_per_recovery_s"),
        "bytes_per_agent_s": (idle.get("tx_bytes_per_s") or {}).get("mean"),
        "bootstrap_s": r["bootstrap_s"],
        "bytes_per_seed": _mean([float(s["rx_bytes"]) for s in seeds]),
        "idle_cpu_pct_per_agent": (idle.get("cpu_pct_of_core") or {}).get("mean"),
        "rss_mb_per_agent": (idle.get("rss_mb") or {}).get("mean"),
        "disagreements": r["disagreements"], "refused": r["refused"]["total"],
        "trials": len(trials_done),
        "wall_s": round(time.perf_counter() - w0, 2),
        "detail": {"agents_per_process": k, "processes": r["processes"], "timed_out": r["timed_out"],
                   "bootstrap_after_spawn_s": r["bootstrap_after_spawn_s"], "spawn_s": r["spawn_s"],
                   "late_subscriptions": r["late_subscriptions"], "fenced": r["fenced"],
                   "refused_during_bootstrap": r["refused_during_bootstrap"]["total"],
                   "load_avg_before": r["load_avg_before"], "load_avg_after": r["load_avg_after"]},
    }


def run(sizes: list[int], real_max: int, trials: int, idle_s: float, per_process: int, sim_duration: float,
        costs: Any, seed: int, progress: Any = None) -> dict[str, Any]:
    load0 = os.getloadavg()
    rows: list[dict[str, Any]] = []
    for n in sizes:
        if progress is not None:
            print(f"bench scale: sim N={n}", file=progress, flush=True)
        rows.append(sim_row(n, costs, sim_duration, seed))
        if n <= real_max:
            if progress is not None:
                print(f"bench scale: real N={n}", file=progress, flush=True)
            try:
                rows.append(real_row(n, trials, idle_s, per_process, seed, progress))
            except (GossiprecError, OSError, TimeoutError) as exc:  # the row says so, with nothing measured
                rows.append({"kind": "real", "nodes": n, **{c: None for c in COLUMNS}, "error": str(exc)[:2000]})
    return {
        "bench": "scale", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cores": os.cpu_count(),
        "load_avg_before": [round(x, 2) for x in load0], "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "sizes": sizes, "real_max": real_max, "per_process": per_process, "sim_duration_s": sim_duration,
        "crypto_cost": costs.as_dict() if costs is not None else None,
        "columns": list(COLUMNS), "rows": rows,
    }


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = (("detect_p99_s", "detection p99"), ("agree_p99_s", "new view p99"),
              ("plan_ready_p99_s", "plan ready p99"), ("bootstrap_s", "bootstrap"))
    for kind, style in (("sim", "-o"), ("real", "--s")):
        rows = [r for r in report["rows"] if r["kind"] == kind]
        for key, label in series:
            pts = [(r["nodes"], r[key]) for r in rows if r.get(key)]
            if pts:
                ax1.plot(*zip(*pts), style, label=f"{label} ({kind})")
        for key, label in (("bytes_per_agent_s", "idle bytes/agent/s"),
                           ("cpu_per_agent_per_recovery_s", "CPU ms/agent/recovery")):
            scale = 1000.0 if key.startswith("cpu") else 1.0
            pts = [(r["nodes"], r[key] * scale) for r in rows if r.get(key)]
            if pts:
                ax2.plot(*zip(*pts), style, label=f"{label} ({kind})")
    for ax, title in ((ax1, "seconds"), (ax2, "cost per agent")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("agents N")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"gossiprec bench scale ({report['date']}, {report['cores']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--sizes takes sizes like 16,128,1024, got {text!r}") from None
    if not sizes or min(sizes) < 4:
        raise ConfigError(f"--sizes needs sizes of at least 4, got {text!r}")
    return sizes


def _cmd(args: argparse.Namespace) -> int:
    from gossiprec.sim.costs import CryptoCosts
    try:
        sizes = _sizes(args.sizes)
        if args.trials < 1 or args.idle <= 0 or args.per_process < 1:
            raise ConfigError("--trials and --per-process must be >= 1, --idle > 0")
        costs = CryptoCosts.parse(args.crypto_cost_us) if args.crypto_cost_us else CryptoCosts.measure()
        report = run(sizes, args.real_max, args.trials, args.idle, args.per_process, args.sim_duration, costs,
                     args.seed, None if args.quiet else sys.stderr)
    except GossiprecError as exc:
        print(f"gossiprec bench scale: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    if args.plot:
        plot(report, args.plot)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "scale", help="scaling table: simulator with real costs and real agents, against N",
        description="Per size N: the agreement simulator with Ed25519 costs charged and the bootstrap "
                    "simulator, and for N <= --real-max real agents bootstrapped from seeds with SIGKILL "
                    "trials. Prints one JSON table (null where a kind does not measure a column).")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                   help="comma-separated N (default 16,128; 1024 and 4800 take long in the simulator)")
    p.add_argument("--real-max", dest="real_max", type=int, default=128,
                   help="real agents for every size up to this (default 128; 0: simulator only)")
    p.add_argument("--trials", type=int, default=5, help="SIGKILLs per real size (default 5)")
    p.add_argument("--idle", type=float, default=10.0, metavar="S", help="idle window of real agents (default 10)")
    p.add_argument("--per-process", dest="per_process", type=int, default=1, metavar="K",
                   help="above 16 real agents, the seeds and victims alone, the others K per process "
                        "(default 1: a process per agent)")
    p.add_argument("--sim-duration", dest="sim_duration", type=float, default=8.0,
                   help="virtual seconds per simulated crash (default 8; the crash is at 3)")
    p.add_argument("--crypto-cost-us", dest="crypto_cost_us", default=None, metavar="SIGN,VERIFY[,PER_KB]",
                   help="fix the Ed25519 costs charged in the simulator (default: measured here)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--plot", default=None, metavar="OUT.png", help="draw the table against N (log-log)")
    p.add_argument("--json", action="store_true", help="compact JSON (one line)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd)
    return p  # type: ignore[no-any-return]
