"""``gossiprec demo``: kill a rank of a real job on this machine, hang another, watch both recover in place.

Theory of operation
-------------------
The demo runs one scenario of the local-job harness (:func:`gossiprec.harness.scenario.run_scenario`):
on loopback, one ``gossiprec run`` per node (an agent plus its trainer child), ``ranks`` trainers and
``spares`` hot spares, training a small MLP with :class:`~gossiprec.trainer.loop.ResilientTrainer`
(:mod:`gossiprec.harness.workload`), each step paced to ``step_ms``. By default it runs 4 ranks and 2
spares: at step 80 it SIGKILLs rank 3 (the first spare takes its place), at step 140 it SIGSTOPs
rank 2 (its agent keeps gossiping the stalled step, the others declare it hung and the second spare
takes its place; its launcher kills the stopped process once the node is out of the view). Two
spares, because a spare is spent per fault; with ``--allow-shrink`` and no spare left the world
shrinks instead.

At the end the demo compares every trainer's final state (model, optimizer, data position, RNG) with
the same training without failure, computed in this process, and prints, per fault, the timeline
measured from the fault: detected (the agents' first failure event), agreed (new view), planned,
state moved, group rebuilt, first step done. ``--json`` prints ``faults`` (one entry per fault:
``rto_s``, ``phases_s``, ``lost_steps``, ``transfer_mb_s``, ...) and, for the first fault, the same keys
at the top level, with ``bit_identical`` and ``median_step_s`` (a hang's RTO bound is
``3 * median_step_s + 1``), and ``timeline``: the job's timeline file in the work directory (every
agent's recovery lines and step samples, :mod:`gossiprec.agent.recoveries`), whose ``gossiprec report``
command the demo prints.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from gossiprec.errors import ConfigError, GossiprecError
from gossiprec.harness.faults import Fault
from gossiprec.harness.scenario import run_scenario


def run_demo(ranks: int = 4, steps: int = 200, kill_at: int = 80, hidden: int = 256, step_ms: float = 20.0,
             workdir: str | None = None, victim: int | None = None, timeout: float = 100.0,
             log: Any = None, verbose: bool = False, *, spares: int = 1, hang_at: int | None = None,
             hang_victim: int | None = None, allow_shrink: bool = False) -> dict[str, Any]:
    """SIGKILL rank ``victim`` (default the last) once every rank passed ``kill_at``; with ``hang_at``,
    later SIGSTOP rank ``hang_victim`` (default the one before the last) once it passed ``hang_at``.
    Returns the result dict of :func:`run_scenario`."""
    victim = ranks - 1 if victim is None else victim
    faults = [Fault(f"n{victim}", "kill", kill_at)]
    if hang_at is not None:
        hang_victim = max(0, ranks - 2) if hang_victim is None else hang_victim
        if hang_victim == victim:
            raise ConfigError("the hung rank must differ from the killed one")
        faults.append(Fault(f"n{hang_victim}", "stop", hang_at))
    return run_scenario(ranks, spares, steps, faults, hidden=hidden, step_ms=step_ms, workdir=workdir,
                        timeout=timeout, allow_shrink=allow_shrink, log=log, verbose=verbose)


def _print_human(res: dict[str, Any], out: Any) -> None:
    print(f"\n{res['ranks']} ranks + {res['spares']} spare(s), {res['steps']} steps, "
          f"state {res.get('state_bytes', 0) / 1e6:.2f} MB, median step {res.get('median_step_s')} s", file=out)
    for f in res.get("faults", []):
        what = {"kill": "SIGKILL", "stop": "SIGSTOP (hang)"}[f["kind"]]
        where = "sent by the demo" if f["phase"] == "any" else f"by itself, {f['phase']} phase"
        print(f"\n{what} of {f['node']} at step {f.get('step')} ({where})", file=out)
        if not f["fired"]:
            print("  never happened", file=out)
            continue
        print(f"  timeline (seconds after the signal), epoch {f.get('epoch')}, plan {f.get('action')}:", file=out)
        for k, v in f.get("phases_s", {}).items():
            print(f"    {k:22s} {'-' if v is None else f'{v:8.3f}'}", file=out)
        print(f"  RTO (signal -> every rank finished its first step after recovery): {f.get('rto_s')} s", file=out)
        if f["kind"] == "stop" and res.get("median_step_s"):
            bound = 3 * res["median_step_s"] + 1.0
            print(f"  hang RTO bound 3 x median step + 1 s = {bound:.3f} s", file=out)
        print(f"  transfer: {f.get('transfer_bytes', 0)} bytes at {f.get('transfer_mb_s')} MB/s; "
              f"committed steps lost: {f.get('lost_steps')}; recoveries: epochs {f.get('epochs')}", file=out)
    for node, killed in res.get("hung_killed_by_launcher", {}).items():
        print(f"\nhung trainer of {node} killed by its launcher when removed from the view: {killed}", file=out)
    print(f"final state equals the failure-free run bit for bit: {res.get('bit_identical')}", file=out)
    timeline = res.get("timeline")
    if timeline:
        plot = str(timeline).rsplit(".", 1)[0] + ".png"
        print(f"\nevery recovery, phase by phase, is in {timeline}; to draw it:\n"
              f"  gossiprec report {timeline} --plot {plot}", file=out)


def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        res = run_demo(args.ranks, args.steps, args.kill_at, args.hidden, args.step_ms, args.workdir,
                       log=None if args.json else sys.stderr, spares=args.spares,
                       hang_at=args.hang_at if args.hang_at > 0 else None, allow_shrink=args.allow_shrink)
    except (GossiprecError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"gossiprec demo: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res))
    else:
        _print_human(res, sys.stdout)
    return 0 if res.get("bit_identical") else 1


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4, help="trainer ranks")
    p.add_argument("--spares", type=int, default=2, help="hot spares (one is spent per fault)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", dest="kill_at", type=int, default=80, help="SIGKILL the last rank at this step")
    p.add_argument("--hang-at", dest="hang_at", type=int, default=140,
                   help="SIGSTOP the rank before the last at this step (0: no hang)")
    p.add_argument("--allow-shrink", dest="allow_shrink", action="store_true",
                   help="with no spare left, shrink the data-parallel world instead of stopping")
    p.add_argument("--hidden", type=int, default=256, help="MLP width (state size grows with its square)")
    p.add_argument("--step-ms", dest="step_ms", type=float, default=20.0, help="pace each step to this long")
    p.add_argument("--workdir", default=None, help="where logs and outputs go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_demo)


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="kill and hang ranks of a local job and watch them recover in place",
                              description=__doc__.split("\n\n")[0] if __doc__ else None)
    _add_arguments(p)
    return p  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gossiprec demo")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
