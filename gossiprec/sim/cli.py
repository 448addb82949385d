"""``gossiprec sim``: run the deterministic simulator from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from gossiprec.errors import GossiprecError, InvariantViolation
from gossiprec.sim.agree import SCENARIOS, AgreeParams, run_agreement
from gossiprec.sim.costs import CryptoCosts
from gossiprec.sim.run import SimParams, run_membership
from gossiprec.sim.seeds import run_seeds

SIM_HELP = """\
Simulate a cluster of N gossiprec cores on a virtual clock and print what they detected.

Faults: --crash K nodes crash at --crash-at (default min(5 s, duration/3)), optionally restarting
--restart-after seconds later with a new incarnation; --pause-frac of the nodes freeze at random moments
(Poisson, mean gap --pause-every) for up to --pause-max seconds and resume with a backlog; the network
loses (--loss), duplicates (--dup) and reorders (--reorder) datagrams.

Figures: detect_s is measured per (failed node, surviving observer) pair, from the crash to the moment
that survivor considers the node dead; false_positives counts nodes that never failed (and never paused
longer than 1 s) but were declared dead by anyone; bytes are datagram payload bytes sent.

Agreement scenarios (--scenario, the whole core: overlay, cut detection, consensus, plan):
crash, rack (5% of nodes at once), hang (a trainer stalls), straggler (a trainer lags but moves),
partition (majority/minority, healed after 8 s), split (exact halves), oneway (a node loses all inbound
traffic), flap (80% loss on one node's links), donor (a donor dies during the plan), join (spares join),
delay (every packet of one node 0.3-0.8 s late), flappart (partitions re-split every 0.5-4 s until a final
heal), stall (the whole job waits 1.3-5 s in one collective), restart / respawn (an agent restarted from
the job spec before / after its removal), heal (exact halves healed in an intact view), mass (40% crash
at once), rackflap (a quarter of the nodes crash while another loses 80%), quiet (no fault: the baseline).
They report agree_s (fault -> every survivor installed the view without the failed nodes), plan_s
(fault -> identical plan everywhere), views_decided, fast_path_ratio and invariant_violations.
--seeds N repeats a scenario over seeds 1..N; --sweep 16,128,1024 measures a one-node crash per size
(with --seeds N, over seeds 1..N per size: agree_s and plan_s are then quantiles across the runs).

Real signature costs (--real-crypto; an agreement scenario, crash unless --scenario says otherwise, or
--sweep): every Ed25519 signature an agent makes or checks is charged, on its own virtual clock, the CPU
it takes on this machine (measured at startup: sign, verify, per KiB; or fixed with --crypto-cost-us),
so a busy agent handles later packets later. The JSON adds crypto_cost (the costs used), plan_ready_s
(p50, p99, max over survivors: kill -> the plan ready on that agent), cpu_per_recovery_s (per agent, p50,
max, mean: CPU charged from the kill to 1 s after the plan was ready everywhere, less its idle rate,
kind by kind),
bytes_per_agent_s (bytes sent per agent per idle second) and per_agent (verifications and signatures per
recovery, by message kind too; CPU; bytes sent and received per second idle and during the recovery).

The same --seed always gives the same result (wall_s and cpu_s aside); a failed invariant prints the seed and the
command that replays it.
"""


COST_KEYS = ("crypto_cost", "plan_ready_s", "cpu_per_recovery_s", "bytes_per_agent_s", "per_agent")
"""What a --sweep row adds with --real-crypto."""


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "sim", help="run the deterministic cluster simulator",
        description=SIM_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=100, help="cluster size N (default 100)")
    p.add_argument("--crash", type=int, default=0, help="nodes to crash at once (default 0)")
    p.add_argument("--crash-at", type=float, default=None, help="virtual second of the crash")
    p.add_argument("--restart-after", type=float, default=None,
                   help="restart the crashed nodes this many seconds later (new incarnation, rejoin)")
    p.add_argument("--loss", type=float, default=0.0, help="datagram loss probability (e.g. 0.01)")
    p.add_argument("--dup", type=float, default=0.0, help="datagram duplication probability")
    p.add_argument("--reorder", type=float, default=0.0,
                   help="probability a datagram is delayed by up to 5 ms extra (reordering)")
    p.add_argument("--latency", type=float, default=0.0002, help="one-way latency, seconds (0.0002)")
    p.add_argument("--pause-frac", type=float, default=0.0, help="fraction of nodes that pause at random")
    p.add_argument("--pause-max", type=float, default=1.0, help="longest pause, seconds (default 1)")
    p.add_argument("--pause-every", type=float, default=20.0, help="mean gap between pauses, seconds")
    p.add_argument("--duration", type=float, default=30.0, help="virtual seconds to simulate (30)")
    p.add_argument("--seed", type=int, default=1, help="seed of the one random generator (1)")
    p.add_argument("--profile", choices=("lan", "wan", "sim"), default="lan", help="config profile")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a Config field, e.g. --set probe_interval=0.2 (repeatable)")
    p.add_argument("--scenario", choices=SCENARIOS, default=None,
                   help="run the full agreement core under a named fault scenario (see below)")
    p.add_argument("--spares", type=int, default=2, help="hot spares in agreement scenarios (2)")
    p.add_argument("--seeds", type=int, default=None,
                   help="with --scenario: run seeds 1..N in worker processes and summarise")
    p.add_argument("--workers", type=int, default=2, help="worker processes for --seeds (2)")
    p.add_argument("--sweep", default=None, metavar="N1,N2,...",
                   help="crash of one node at each cluster size: one JSON line per size")
    p.add_argument("--real-crypto", action="store_true",
                   help="charge each agent Ed25519's measured CPU per signature made and checked (see below)")
    p.add_argument("--crypto-cost-us", default=None, metavar="SIGN,VERIFY[,PER_KB]",
                   help="with --real-crypto: these costs in microseconds instead of measuring them")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress stays on stderr)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--plot", metavar="FILE.png", help="draw the detection CDF and membership size")
    p.set_defaults(func=run_cli)
    return p


def _overrides(items: list[str]) -> tuple[tuple[str, Any], ...]:
    out = []
    for item in items:
        if "=" not in item:
            raise GossiprecError(f"--set takes FIELD=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        value: Any
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.append((key.strip(), value))
    return tuple(out)


def params_from_args(args: argparse.Namespace) -> SimParams:
    return SimParams(
        nodes=args.nodes, seed=args.seed, duration=args.duration, profile=args.profile, crash=args.crash,
        crash_at=args.crash_at, restart_after=args.restart_after, loss=args.loss, duplicate=args.dup,
        reorder=args.reorder, latency=args.latency, pause_frac=args.pause_frac, pause_max=args.pause_max,
        pause_every=args.pause_every, config_overrides=_overrides(args.set),
    )


def crypto_costs(args: argparse.Namespace) -> CryptoCosts | None:
    """The costs ``--real-crypto`` charges (measured here, unless ``--crypto-cost-us`` fixes them)."""
    if args.crypto_cost_us is not None and not args.real_crypto:
        raise GossiprecError("--crypto-cost-us needs --real-crypto")
    if not args.real_crypto:
        return None
    if args.seeds:
        raise GossiprecError("--real-crypto measures one run per size: drop --seeds")
    costs = CryptoCosts.parse(args.crypto_cost_us) if args.crypto_cost_us else CryptoCosts.measure()
    if not args.quiet:
        c = costs.as_dict()
        print(f"charging Ed25519 costs ({'measured' if costs.measured else 'given'}): sign {c['sign_us']} us, "
              f"verify {c['verify_us']} us, +{c['per_kb_us']} us per KiB", file=sys.stderr)
    return costs


def run_cli(args: argparse.Namespace) -> int:
    args.costs = crypto_costs(args)
    if args.costs is not None and not args.sweep and not args.scenario:
        args.scenario = "crash"
    if args.sweep:
        return run_sweep(args)
    if args.scenario:
        return run_scenario(args)
    params = params_from_args(args)
    if not args.json:
        print(f"simulating {params.nodes} nodes for {params.duration:g} virtual s (seed {params.seed})",
              file=sys.stderr)
    try:
        result = run_membership(params, show_progress=not args.quiet)
    except InvariantViolation as exc:
        print(f"INVARIANT VIOLATED: {exc}", file=sys.stderr)
        return 3
    series = result.pop("_series")
    if args.plot:
        plot(result, series, args.plot)
    if args.json:
        print(json.dumps(result, sort_keys=False))
    else:
        print(summary_text(result))
    return 0


def _agree_params(args: argparse.Namespace, **over: Any) -> AgreeParams:
    fields = dict(scenario=args.scenario or "crash", nodes=args.nodes, spares=args.spares, seed=args.seed,
                  duration=args.duration, loss=args.loss, profile=args.profile,
                  crash=max(1, args.crash), crypto_costs=getattr(args, "costs", None))
    if args.crash_at is not None:
        fields["fault_at"] = args.crash_at
    fields.update(over)
    return AgreeParams(**fields)


def run_scenario(args: argparse.Namespace) -> int:
    params = _agree_params(args)
    if args.seeds:
        result = run_seeds(params, args.seeds, workers=args.workers, progress=not args.json)
    else:
        try:
            result = run_agreement(params, show_progress=not args.quiet)
        except InvariantViolation as exc:
            print(f"INVARIANT VIOLATED: {exc}", file=sys.stderr)
            return 3
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 3 if result.get("invariant_violations") else 0


def run_sweep(args: argparse.Namespace) -> int:
    try:
        sizes = [int(x) for x in args.sweep.split(",") if x.strip()]
    except ValueError:
        raise GossiprecError(f"--sweep takes sizes like 16,128,1024, got {args.sweep!r}") from None
    rows = []
    for n in sizes:
        params = _agree_params(args, scenario="crash", nodes=n, spares=min(args.spares, n - 2), crash=1,
                               train=False)
        if not args.quiet:
            print(f"n={n}:", file=sys.stderr, flush=True)
        if args.seeds:
            # seeds 1..S per size: agree_s and plan_s are then quantiles over the runs' worst survivors
            w0 = time.perf_counter()
            r = run_seeds(params, args.seeds, workers=args.workers, progress=not args.quiet)
            row = {"nodes": n, "seeds": args.seeds, "agree_s": r["agree_s_across_runs"],
                   "plan_s": r["plan_s_across_runs"], "fast_path_ratio": r["fast_path_ratio"],
                   "invariant_violations": r["invariant_violations"], "missed_removals": r["missed_removals"],
                   "agree_missing_runs": r["agree_missing_runs"], "wall_s": round(time.perf_counter() - w0, 3),
                   "cpu_s": r["cpu_s_total"], "events": r["events_total"]}
        else:
            r = run_agreement(params, show_progress=not args.quiet)
            row = {k: r[k] for k in ("nodes", "seed", "agree_s", "plan_s", "views_decided", "fast_path_ratio",
                                     "invariant_violations", "wall_s", "cpu_s", "events", *COST_KEYS) if k in r}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.plot:
        plot_sweep(rows, args.plot)
    return 0


def plot_sweep(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [r["nodes"] for r in rows]
    ax.plot(ns, [r["agree_s"]["max"] for r in rows], "o-", label="agree (all survivors)")
    ax.plot(ns, [r["plan_s"]["max"] for r in rows], "s-", label="plan everywhere")
    ax.set_xscale("log")
    ax.set_xlabel("cluster size N")
    ax.set_ylabel("virtual s after the crash")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_text(r: dict[str, Any]) -> str:
    d = r["detect_s"]
    lines = [
        f"nodes {r['nodes']}, seed {r['seed']}, profile {r['profile']}, {r['virtual_s']:g} virtual s "
        f"in {r['wall_s']:.1f} s wall ({r['events']:,} events, {r['events_per_wall_s']:,} events/s)",
        f"crashed {r['crashed']}, paused nodes {r['paused_nodes']}, loss {r['loss']:g}",
    ]
    if d["p50"] is not None:
        lines.append(f"detection latency: p50 {d['p50']:.3f} s, p99 {d['p99']:.3f} s, max {d['max']:.3f} s "
                     f"over {r['detected_pairs']:,} (failed, survivor) pairs")
    lines.append(f"undetected pairs {r['undetected']}, false positives {r['false_positives']}"
                 + (f" ({', '.join(r['false_positive_nodes'])})" if r['false_positives'] else ""))
    lines.append(f"load per node: {r['msgs_per_node_s']:.1f} msgs/s, {r['bytes_per_node_s']:.0f} B/s mean, "
                 f"{r['bytes_per_node_s_max']:.0f} B/s max")
    lines.append(f"invariant violations {r['invariant_violations']}")
    return "\n".join(lines)


def plot(result: dict[str, Any], series: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise GossiprecError("--plot needs matplotlib: pip install 'gossiprec[plot]'") from exc
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    det = series["detect"]
    if det:
        a.plot(det, [(i + 1) / len(det) for i in range(len(det))])
    a.set_xlabel("detection latency (virtual s)")
    a.set_ylabel("fraction of (failed, survivor) pairs")
    a.set_title(f"detection CDF, N={result['nodes']}")
    a.grid(alpha=0.3)
    mem = series["membership"]
    if mem:
        t = [m[0] for m in mem]
        b.plot(t, [m[1] for m in mem], label="mean")
        b.fill_between(t, [m[2] for m in mem], [m[3] for m in mem], alpha=0.3, label="min..max")
    b.set_xlabel("virtual s")
    b.set_ylabel("members believed alive")
    b.set_title("membership size")
    b.legend()
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
