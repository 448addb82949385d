"""``gossiprec bench sharded``: in-place recovery of sharded jobs (dp x tp DTensor TP, HSDP), per layout.

Theory of operation
-------------------
Each trial is a fresh sharded local job (:func:`gossiprec.harness.sharded.run_sharded`: four ranks on
a 2 x 2 mesh and one hot spare, the MLP of :mod:`gossiprec.harness.sharded_trainer` ``--hidden`` wide)
in which rank 3's trainer SIGKILLs itself at ``--phase`` of step ``--kill-at``; the job trains
``--post-steps`` more. Per layout the report gives the median and range over the trials of
``rto_s`` (the fault -> every rank has committed its first step after the recovery) and of each phase
of :func:`gossiprec.harness.timeline.timeline` (seconds after the fault), ``bytes_per_donor`` (what
each donor sent the spare: one rank's shard, from the same coordinate of the other replica),
``state_bytes`` (one rank's local state: its shards of parameters and AdamW moments, RNG),
``kept_bytes`` and ``kept_ratio`` (host memory the rank's snapshots hold for recovery at the end, and
its ratio to ``state_bytes``), ``donor_is_replica_peer`` and ``bit_identical`` (every rank's final
state equals the failure-free run's, which runs once per layout). ``loadavg_1m`` says how much other
work shared the CPUs. One JSON object on stdout, progress on stderr; a failed trial keeps its working
directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence, cast

from gossiprec.errors import ConfigError, GossiprecError

LAYOUT_NAMES = ("tp", "hsdp")
PHASES = ("forward", "backprop", "optimizer", "committed")


def _stats(values: Sequence[float | None]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": round(statistics.median(vals), 4), "min": round(min(vals), 4), "max": round(max(vals), 4)}


def summarize(layout: str, trials: Sequence[dict[str, Any]], reference: dict[int, str]) -> dict[str, Any]:
    """The report of one layout from its trials' :func:`run_sharded` results (see the module docstring)."""
    faults = [t["faults"][0] for t in trials]
    phases = sorted({k for f in faults for k in f.get("phases_s", {})})
    per_donor = [f["transfer_bytes"] // max(1, sum(len(d) for d in f["donors"].values())) for f in faults]
    groups = trials[0]["replica_groups"] if trials else []

    def peer_ok(f: dict[str, Any]) -> bool:
        lost = next((r for r, role in f["roles"].items() if role == "receiver"), None)
        if lost is None:
            return False
        peer = next(r for g in groups if lost in g for r in g if r != lost)
        return cast(bool, f["donors"].get(lost) == [f["assignment"][peer]])

    state = [b for t in trials for b in t["state_bytes"].values()]
    kept = [b for t in trials for b in t["kept_bytes"].values()]
    return {"layout": layout, "trials": len(trials), "rto_s": _stats([f["rto_s"] for f in faults]),
            "phases_s": {p: _stats([f["phases_s"].get(p) for f in faults]) for p in phases},
            "bytes_per_donor": max(per_donor, default=0), "state_bytes": max(state, default=0),
            "kept_bytes": max(kept, default=0),
            "kept_ratio": round(max(kept) / max(state), 3) if state and kept and max(state) else None,
            "donor_is_replica_peer": all(peer_ok(f) for f in faults),
            "bit_identical": all(t["states"] == reference for t in trials),
            "lost_steps": max((f["lost_steps"] for f in faults), default=None)}


def run_bench(layouts: Sequence[str], *, trials: int, phase: str, kill_at: int, post_steps: int, hidden: int,
              workdir: str | None, say: Any, copies: Sequence[int] = (1,)) -> dict[str, Any]:
    from gossiprec.harness.faults import Fault
    from gossiprec.harness.sharded import run_sharded

    steps = kill_at + post_steps
    base = Path(workdir or tempfile.mkdtemp(prefix="gossiprec-bench-sharded-"))
    out: dict[str, Any] = {"bench": "sharded", "phase": phase, "kill_at": kill_at, "steps": steps,
                           "hidden": hidden, "layouts": {}, "failed_trials": 0}
    for layout in layouts:
        reference = run_sharded(layout, steps, spares=0, hidden=hidden, workdir=str(base / f"{layout}-ref"))["states"]
        done: dict[int, list[dict[str, Any]]] = {c: [] for c in copies}
        for i in range(trials):
            for c in copies:  # the modes take turns, trial by trial
                try:
                    res = run_sharded(layout, steps, [Fault("n3", "kill", kill_at, phase)], spares=1, hidden=hidden,
                                      workdir=str(base / f"{layout}-c{c}-{i}"),
                                      trainer_args=["--snapshot-copies", str(c)])
                except GossiprecError as exc:
                    say(f"{layout} copies={c} trial {i} failed: {exc}")
                    out["failed_trials"] += 1
                    continue
                res["faults"][0]["loadavg_1m"] = os.getloadavg()[0]
                say(f"{layout} copies={c} trial {i}: rto {res['faults'][0]['rto_s']} s")
                done[c].append(res)
        out["layouts"][layout] = {}
        for c in copies:
            summary = summarize(layout, done[c], reference)
            summary["loadavg_1m"] = _stats([t["faults"][0]["loadavg_1m"] for t in done[c]])
            out["layouts"][layout][str(c)] = summary
    out["workdir"] = str(base)
    return out


def _cmd_sharded(args: argparse.Namespace) -> int:
    progress = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    layouts = LAYOUT_NAMES if args.layout == "both" else (args.layout,)
    try:
        copies = [int(c) for c in args.copies.split(",")]
    except ValueError:
        copies = []
    if not copies or any(c not in (0, 1, 2) for c in copies) or len(set(copies)) != len(copies):
        raise ConfigError(f"--copies takes distinct snapshot copies among 0, 1, 2, comma-separated; "
                          f"got {args.copies!r}")
    if args.overhead:
        from gossiprec.bench.sharded_overhead import run_overhead

        if args.rounds < 1 or args.steps < 4 or args.pace_ms < 0:
            raise ConfigError("--overhead needs --rounds >= 1, --steps >= 4 and --pace-ms >= 0")
        over = run_overhead(layouts, rounds=args.rounds, steps=args.steps, hidden=args.hidden,
                            pace_ms=args.pace_ms, workdir=args.workdir, say=progress, copies=copies)
        print(json.dumps(over, indent=None if args.json else 2))
        return 1 if over["errors"] else 0
    report = run_bench(layouts, trials=args.trials, phase=args.phase, kill_at=args.kill_at,
                       post_steps=args.post_steps, hidden=args.hidden, workdir=args.workdir, say=progress,
                       copies=copies)
    print(json.dumps(report, indent=None if args.json else 2))
    return 1 if report["failed_trials"] else 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``sharded`` to the ``bench`` sub-commands (sets ``func``)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "sharded", help="time in-place recovery of sharded jobs (dp x tp DTensor TP, HSDP with FSDP2)",
        description="Per layout: a 2 x 2 mesh job with one hot spare, rank 3 SIGKILLed at a phase of a step; "
                    "RTO and phases, bytes per donor, host memory kept per rank, bit-identity with the "
                    "failure-free run. With --overhead: failure-free step time against the same loop "
                    "without gossiprec (gossiprec.bench.sharded_overhead). Prints one JSON report on stdout.")
    p.add_argument("--layout", choices=(*LAYOUT_NAMES, "both"), default="both")
    p.add_argument("--trials", type=int, default=3, help="kills to time per layout, each in a fresh job (3)")
    p.add_argument("--phase", choices=PHASES, default="backprop",
                   help="where in the step rank 3 dies (backprop: the backward pass)")
    p.add_argument("--kill-at", dest="kill_at", type=int, default=4, help="the step it dies in (4)")
    p.add_argument("--post-steps", dest="post_steps", type=int, default=4, help="steps after the fault (4)")
    p.add_argument("--hidden", type=int, default=16, help="the MLP's width (16)")
    p.add_argument("--workdir", default=None, help="keep job specs, logs and outputs here")
    p.add_argument("--overhead", action="store_true",
                   help="instead of kills: failure-free step time against the same loop under plain torchrun")
    p.add_argument("--rounds", type=int, default=2, help="--overhead: plain/gossiprec pairs per layout (2)")
    p.add_argument("--steps", type=int, default=60, help="--overhead: steps of every job (60)")
    p.add_argument("--pace-ms", dest="pace_ms", type=float, default=100.0,
                   help="--overhead: sleep inside each step, standing in for compute, ms (100)")
    p.add_argument("--copies", default="1",
                   help="snapshot copies to run, comma-separated (TrainerConfig.snapshot_copies; 0: snapshot-free), "
                        "taking turns trial by trial; the report has one entry per layout and copies (1)")
    p.add_argument("--json", action="store_true", help="compact JSON (one line)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd_sharded)
    return p
