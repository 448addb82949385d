"""The demo's trainer process (``python -m gossiprec.harness.trainer``): one rank or spare under ``gossiprec run``.

It trains the demo workload (:mod:`gossiprec.harness.workload`) with
:class:`~gossiprec.trainer.loop.ResilientTrainer`, the gradients reduced in rank order
(``exact=True``) so that the orchestrator can replay the run bit for bit, each step paced to
``--step-ms``. The ranks start together in ``start()`` (the first group is the barrier) and wait there
up to ``--wait-for-spares`` seconds for the spares to be up, so that a fault does not find one still
loading; ``--late S`` makes this process sleep S seconds first (a rank importing torch from a slow
file system). Its ``--fault`` arguments fire at their phases
(:class:`~gossiprec.harness.faults.FaultInjector`); ``--mistake`` makes it commit one of the loop
mistakes of :data:`MISTAKES`, for the tests of what catches them. ``--gate STEP:PATH`` makes it wait
after committing STEP until PATH exists: the orchestrator's fault lands between two steps of every rank,
however far a loaded machine lets the training run ahead of it. It exits with the codes of
:mod:`gossiprec.trainer.exits` (0 finished or not needed, 75 stopped).

What it leaves next to ``--out`` (``<node>.json``), for the orchestrator: ``.pid`` and ``.ready`` at
start-up, ``.step`` (the last committed step) after every commit, ``.records`` (one recovery record
per line, appended as they happen, so that they survive a later death), ``.fault`` (when a fault
fired), ``.dropped`` (one line each time it dropped its state to wait as a spare: fenced or removed),
and at the end ``.state`` (its complete state as bytes) and the ``.json`` report (or
``{"released": true}`` when a shrink released it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from gossiprec.harness.faults import Fault, FaultInjector, newest_plan_epoch
from gossiprec.harness.workload import (
    build, load_checkpoint, local_gradients, objects_of, save_checkpoint, scale_lr, state_bytes,
)

MISTAKES = ("data-write", "numpy-per-rank", "no-data-position", "wide-model")
"""Loop mistakes a trainer can be told to make (``--mistake``), for the tests of what catches them."""


def trainer_main(args: argparse.Namespace) -> int:
    """One rank (or a spare) under ``gossiprec run``."""
    import torch

    from gossiprec.trainer.state.capture import capture_state
    from gossiprec.trainer.config import TrainerConfig
    from gossiprec.trainer.exits import exit_code
    from gossiprec.trainer.loop import ResilientTrainer
    from gossiprec.trainer.exits import JobFinished, JobStopped, Released
    from gossiprec.trainer.recovery import NoReplica

    torch.set_num_threads(1)
    out = Path(args.out)
    (out.with_suffix(".pid")).write_text(str(os.getpid()))
    if args.late:
        time.sleep(args.late)  # a slow start: torch from a shared file system, CUDA initialisation
    mistake = args.mistake
    await_view = tuple(int(x) for x in args.await_view.split(":")) if args.await_view else None
    gates = {int(step): Path(path) for step, path in (g.split(":", 1) for g in args.gate)}
    model, opt, cursor = build(args.hidden * (2 if mistake == "wide-model" else 1))
    if mistake == "numpy-per-rank":
        import numpy as np

        np.random.seed(int(os.environ.get("GOSSIPREC_RANK", "99")))  # the classic: a seed per rank
    records: list[dict[str, Any]] = []
    resizes: list[list[int]] = []
    loads: list[int] = []
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    faults = [Fault.parse("", f) for f in args.fault]

    def on_resize(old: int, new: int) -> None:
        resizes.append([old, new])
        if args.lr_scale:
            scale_lr(opt, old, new)

    def on_no_replica(info: NoReplica) -> int:
        assert ckpt is not None
        if not ckpt.exists():
            raise JobStopped(f"no replica left ({info.reason}) and no checkpoint at {ckpt} yet")
        loads.append(load_checkpoint(ckpt, rt.objects))
        return loads[-1]

    def on_recovered(rec: Any) -> None:
        records.append({**rec.to_dict(), "node": rt.node})
        with open(out.with_suffix(".records"), "a") as f:  # kept even if this trainer dies later
            f.write(json.dumps(records[-1]) + "\n")

    hook = (FaultInjector(faults, out.with_suffix(".fault"), args.slow_fetch, plan_epoch=lambda: newest_plan_epoch(rt),
                          lag_s=args.lag_ms / 1000.0)
            if faults or args.slow_fetch else None)
    objects = objects_of(model, opt, cursor)
    if mistake == "no-data-position":
        del objects["data"]  # the cursor still moves, but nobody carries it to a spare
    config = TrainerConfig(timeout=args.timeout, wait_for_spares=args.wait_for_spares,
                           snapshot_copies=args.snapshot_copies,
                           **({"start_timeout": args.start_timeout} if args.start_timeout else {}),
                           **({"recovery_timeout": args.recovery_timeout} if args.recovery_timeout else {}))
    def on_drop(why: str) -> None:
        with open(out.with_suffix(".dropped"), "a") as f:  # kept if this process dies later
            f.write(why + "\n")

    rt = ResilientTrainer(objects, config, on_recovered=on_recovered, on_resize=on_resize,
                          on_no_replica=on_no_replica if ckpt is not None else None, on_phase=hook,
                          on_drop=on_drop)
    if args.slow_views:
        slow_views(rt, args.slow_views)
    if args.bucket_mb > 0:
        rt.overlap_gradients(model.parameters(), exact=True, bucket_mb=args.bucket_mb)
    out.with_suffix(".ready").write_text("1")  # torch imported, model and optimizer built
    while args.start_gate and not Path(args.start_gate).exists():
        time.sleep(0.01)  # the orchestrator changes the view first
    t_start = time.monotonic()
    progress = out.with_suffix(".step")
    commits: list[float] = []
    try:
        rt.start()
        print(f"gossiprec demo trainer {rt.node}: joined as rank {rt.rank} in "
              f"{time.monotonic() - t_start:.2f}s", file=sys.stderr, flush=True)
        while rt.step < args.steps:
            rt.begin_step()
            t0 = time.monotonic()
            if args.pace == "compute":
                time.sleep(args.step_ms / 1000.0)  # a fixed compute time: waiting for peers is no credit
            if mistake == "data-write":
                with torch.no_grad():
                    next(model.parameters()).data.mul_(0.999)  # a hand-made decay, in the forbidden window
            local_gradients(model, cursor, rt.rank)
            if not rt.allreduce_gradients(model.parameters(), exact=True):
                continue
            opt.step()
            cursor.index += 1
            rt.commit()
            commits.append(time.monotonic())
            progress.write_text(str(rt.step))
            while rt.step in gates and not gates[rt.step].exists():
                time.sleep(0.01)  # the orchestrator opens it once it has done what it does at this step
            if await_view is not None and rt.step == await_view[0]:
                wait_for_view(rt, await_view[1])
            if ckpt is not None and args.checkpoint_every and rt.rank == 0 \
                    and rt.step % args.checkpoint_every == 0:
                save_checkpoint(ckpt, rt.objects, rt.step)
            if args.verbose and rt.step % 10 == 0:
                print(f"{rt.node} step {rt.step} at {time.monotonic():.3f} ({rt.step_ms} ms)", file=sys.stderr,
                      flush=True)
            left = args.step_ms / 1000.0 - (time.monotonic() - t0) if args.pace == "step" else 0.0
            if left > 0:
                time.sleep(left)  # pacing: stands in for a longer compute step
    except (Released, JobFinished, JobStopped) as exc:
        print(f"gossiprec demo trainer {rt.node}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if isinstance(exc, Released):
            out.write_text(json.dumps({"node": rt.node, "released": True, "step": rt.step, "records": records}))
        rt.close()
        os._exit(exit_code(exc))
    final = capture_state(objects_of(model, opt, cursor), step=rt.step, checksum=False)
    out.with_suffix(".state").write_bytes(state_bytes(final))
    out.write_text(json.dumps({"node": rt.node, "rank": rt.rank, "world_size": rt.world_size, "step": rt.step,
                               "records": records, "resizes": resizes, "checkpoint_loads": loads,
                               "commit_times": commits, "state_bytes": final.header.total_nbytes,
                               "interruptions": rt.interruptions, "epoch": rt.epoch,
                               "view_members": sorted(rt._follower.members or ()),
                               "view_epoch": rt._follower.view_epoch}))
    rt.finish()
    os._exit(0)  # a graveyard may hold a hung group whose destructor would block


def slow_views(rt: Any, seconds: float) -> None:
    """Make the trainer learn of each new view ``seconds`` late (its follower sleeps before it takes one in),
    as a loaded machine can: the tests of what the agent's report may promise before the trainer knows."""
    from gossiprec.core.events import ViewInstalled

    follower = rt._follower
    take = follower.on_event

    def late(ev: Any) -> None:
        if isinstance(ev, ViewInstalled):
            time.sleep(seconds)
        take(ev)

    follower.on_event = late


def wait_for_view(rt: Any, members: int) -> None:
    """Poll the agent until its view holds ``members`` members (or the trainer is interrupted: a newer
    view than the one trained in, which the next step recovers into, may be the one awaited)."""
    from gossiprec.local.protocol import ViewBrief

    while True:
        st = rt.control.status()
        view = ViewBrief.from_wire(st["view"]) if st.get("view") else None
        if view is not None and len(view.members) >= members:
            return
        time.sleep(0.05)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gossiprec.harness.trainer",
                                description="One rank or spare of a local job (see the module docstring).")
    p.add_argument("--steps", type=int, required=True, help="train until this step is committed")
    p.add_argument("--hidden", type=int, default=256, help="MLP width")
    p.add_argument("--step-ms", dest="step_ms", type=float, default=20.0, help="pace each step to this long")
    p.add_argument("--pace", choices=("step", "compute"), default="step",
                   help="step: sleep what is left of --step-ms after the step (time waiting for peers counts); "
                        "compute: sleep --step-ms before the gradients, as a fixed compute time (a rank slowed "
                        "by a lag fault makes the others wait that much)")
    p.add_argument("--lag-ms", dest="lag_ms", type=float, default=0.0,
                   help="how long a lag fault sleeps at its phase of every step")
    p.add_argument("--timeout", type=float, default=30.0, help="group and collective timeout, seconds")
    p.add_argument("--out", required=True, help="the report's path; the other files go beside it")
    p.add_argument("--late", type=float, default=0.0, help="sleep this long before anything else (a slow start)")
    p.add_argument("--wait-for-spares", dest="wait_for_spares", type=float, default=0.0,
                   help="start() waits this long for the spares to be up (TrainerConfig.wait_for_spares)")
    p.add_argument("--start-timeout", dest="start_timeout", type=float, default=0.0,
                   help="TrainerConfig.start_timeout (0: its default)")
    p.add_argument("--recovery-timeout", dest="recovery_timeout", type=float, default=0.0,
                   help="TrainerConfig.recovery_timeout (0: its default)")
    p.add_argument("--await-view", dest="await_view", default="",
                   help="STEP:N: after committing STEP, wait until the agent's view holds N members (a node "
                        "cut off has rejoined)")
    p.add_argument("--start-gate", dest="start_gate", default="",
                   help="PATH: wait until PATH exists before start() (its agent's view may change meanwhile)")
    p.add_argument("--gate", action="append", default=[],
                   help="STEP:PATH: after committing STEP, wait until PATH exists (repeatable)")
    p.add_argument("--fault", action="append", default=[], help="KIND@PHASE:STEP (repeatable)")
    p.add_argument("--slow-fetch", dest="slow_fetch", type=float, default=0.0,
                   help="sleep this long per received chunk of state")
    p.add_argument("--checkpoint", default="", help="checkpoint file (rank 0 writes it, on_no_replica loads it)")
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=0)
    p.add_argument("--lr-scale", dest="lr_scale", action="store_true", help="on_resize scales the learning rate")
    p.add_argument("--mistake", choices=MISTAKES, default=None)
    p.add_argument("--bucket-mb", dest="bucket_mb", type=float, default=0.0,
                   help="all-reduce gradients in buckets of this many MiB during backward (0: one flat all-reduce)")
    p.add_argument("--snapshot-copies", dest="snapshot_copies", type=int, default=1,
                   help="TrainerConfig.snapshot_copies: host copies of the state kept for recovery (2, 1, 0)")
    p.add_argument("--slow-views", dest="slow_views", type=float, default=0.0,
                   help="learn of each new view this many seconds late (the follower sleeps first)")
    p.add_argument("--verbose", action="store_true", help="a progress line every 10 steps")
    return p


def main(argv: list[str] | None = None) -> int:
    return trainer_main(_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
