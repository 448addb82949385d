"""A sharded job's trainer (``python -m gossiprec.harness.sharded_trainer``): one rank or spare under ``gossiprec run``.

Two layouts of four ranks, each a tiny MLP (8 -> 16 -> 8) trained with AdamW and gradient clipping
(``--model lm``: the small language model of :mod:`gossiprec.harness.tiny_lm` instead, with root-level
parameters, tied embeddings, a buffer, dropout, an LR schedule and a data position):

- ``tp``: a ``("dp", "tp") = (2, 2)`` mesh; DTensor tensor parallelism along ``tp`` (column-wise first
  layer, row-wise second: an all-reduce in every forward), gradients averaged along ``dp`` with
  ``dist.all_reduce`` on the local shards;
- ``hsdp``: a ``("replicate", "shard") = (2, 2)`` mesh; FSDP2 ``fully_shard`` on both dimensions
  (all-gathers in forward, reduce-scatters and the replicate all-reduce in backward).

Batches are a function of (step, data-parallel coordinate) alone (``stateless_data``). Faults
(``--fault KIND@PHASE:STEP``, :class:`~gossiprec.harness.faults.FaultInjector`) fire at ``forward``
(before the second layer: its tensor-parallel peer then waits in the row-wise all-reduce), ``backprop``
(between the two layers' gradients), ``clip`` (after backward, before the clip-norm all-reduce),
``optimizer`` (inside ``opt.step()``, after clipping) and
``committed`` (between steps), and at the trainer's own phases.

``--dcp DIR --dcp-every N``: checkpoints with :class:`~gossiprec.trainer.checkpoint.DcpCheckpoints`
(a run resumes from the newest complete one in DIR; a plan with no replica left loads it).

What it leaves next to ``--out`` (``<node>.json``): ``.pid``, ``.ready``, ``.step`` (the last step it
committed), ``.records`` (one recovery record per line), ``.fault`` (when a fault fired), and at the end
``.state`` (the rank's local state as bytes: its shards of the model and optimizer) and the ``.json``
report (rank, step, records, the bytes of its state and of the snapshots it keeps for recovery, each
``on_resize`` call with the mesh's shape it saw, the final mesh's shape, the checkpoint step it resumed
from and the steps it saved).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gossiprec.harness import tiny_lm
from gossiprec.harness.faults import Fault, FaultInjector, newest_plan_epoch
from gossiprec.trainer.collectives.sharded import MeshSpec

LAYOUTS = {"tp": MeshSpec((2, 2), ("dp", "tp")), "hsdp": MeshSpec((2, 2), ("replicate", "shard"))}
"""The meshes of the two layouts; the job spec's ``[job]`` table is written from these."""
DIM, HIDDEN, BATCH = 8, 16, 4


def build_objects(layout: str, mesh: Any, hidden: int = HIDDEN) -> dict[str, Any]:
    """Model and optimizer of ``layout`` on ``mesh``, the same in every process (seeded); ``hidden``:
    the MLP's width."""
    import torch
    import torch.nn as nn

    from gossiprec.trainer.objects import training_state

    torch.manual_seed(0)
    random.seed(0)  # every generator in the state must be identical across the replicas of a shard
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:
        pass
    model = nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU(), nn.Linear(hidden, DIM))
    if layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        # src_data_rank=None: every rank shards its own (identically seeded) copy, no scatter, so a
        # spare builds its model before it has joined its peers' epoch
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}, src_data_rank=None)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return training_state(model, opt)


def train_step(layout: str, objects: dict[str, Any], mesh: Any, step: int, pace_s: float = 0.0,
               clip: bool = True, before_clip: Callable[[], None] | None = None) -> None:
    """One step: forward, backward, data-parallel averaging (tp), clipping, optimizer. ``pace_s``: a sleep
    between forward and backward, standing in for a longer compute step (the overhead bench's pacing).
    ``clip``: the clip-norm all-reduce, which also keeps every rank out of its optimizer step until
    every rank's data-parallel reduction is done (without it a replica group may step before another).
    ``before_clip``: called after backward (and the data-parallel averaging), before clipping."""
    import torch
    import torch.distributed as dist

    model, opt = objects["model"], objects["optimizer"]
    dp = mesh.get_coordinate()[0]
    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(1000 * step + dp))
    loss = model(x).pow(2).mean()
    if pace_s:
        time.sleep(pace_s)
    loss.backward()
    if layout == "tp":
        group = mesh["dp"].get_group()
        for p in model.parameters():
            g = p.grad.to_local()
            dist.all_reduce(g, group=group)
            g.div_(mesh["dp"].size())
    if before_clip is not None:
        before_clip()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a norm all-reduce over the shards
    opt.step()
    opt.zero_grad()


def _arm(objects: dict[str, Any], rt: Any, hook: FaultInjector) -> None:
    """The in-step fault phases: ``forward``, ``backprop`` and ``optimizer`` of step ``rt.step + 1``."""
    model, opt = objects["model"], objects["optimizer"]

    def at(phase: str) -> None:
        hook(rt.step + 1, phase)

    model[2].register_forward_pre_hook(lambda _m, _a: at("forward"))

    def relu_out(_m: Any, _a: Any, out: Any) -> None:
        if out.requires_grad:
            out.register_hook(lambda _g: at("backprop"))

    model[1].register_forward_hook(relu_out)
    opt.register_step_pre_hook(lambda _o, _a, _k: at("optimizer"))


def trainer_main(args: argparse.Namespace) -> int:
    import torch

    from gossiprec.trainer.checkpoint import DcpCheckpoints
    from gossiprec.trainer.state.capture import capture_state
    from gossiprec.trainer.config import TrainerConfig
    from gossiprec.trainer.exits import exit_code
    from gossiprec.trainer.loop import ResilientTrainer
    from gossiprec.trainer.exits import JobFinished, JobStopped, Released
    from gossiprec.harness.workload import state_bytes

    torch.set_num_threads(1)
    out = Path(args.out)
    out.with_suffix(".pid").write_text(str(os.getpid()))
    layout = args.layout
    records: list[dict[str, Any]] = []
    rt: Any = None

    hook = FaultInjector([Fault.parse("", f) for f in args.fault], out.with_suffix(".fault"),
                         plan_epoch=lambda: newest_plan_epoch(rt))

    def build(mesh: Any) -> dict[str, Any]:
        if args.model == "lm":
            objects = tiny_lm.build_objects(layout, mesh)
            tiny_lm.arm(objects, lambda phase: hook(rt.step + 1, phase))
        else:
            objects = build_objects(layout, mesh, args.hidden)
            _arm(objects, rt, hook)
        if args.seed_per_shard:  # the same along the replicate dimension: replicas stay identical
            torch.manual_seed(1 + mesh.get_coordinate()[1])
        return objects

    def on_recovered(rec: Any) -> None:
        records.append({**rec.to_dict(), "node": rt.node})
        with open(out.with_suffix(".records"), "a") as f:  # kept even if this trainer dies later
            f.write(json.dumps(records[-1]) + "\n")

    config = TrainerConfig(timeout=args.timeout, wait_for_spares=args.wait_for_spares,
                           stateless_data=args.model == "mlp",
                           snapshot_copies=args.snapshot_copies)
    started: set[int] = set()

    # a diagnostic, off in tests: GOSSIPREC_STALL_DUMP_S=<s> prints every thread's stack to the log when
    # no phase came for that long (a rank stuck in a collective shows where). faulthandler's watchdog
    # reads the other threads without the GIL: one trainer of 19 loaded jobs died in such a dump
    stall_dump = float(os.environ.get("GOSSIPREC_STALL_DUMP_S", "0"))

    def on_phase(step: int, phase: str) -> None:
        if stall_dump:
            faulthandler.dump_traceback_later(stall_dump, repeat=True)
        if phase == "compute" and args.leave_grad and step in started:  # a redone step: a gradient left on
            started.discard(step)
            args.leave_grad = False
            p = rt.objects["model"].get_parameter(args.leave_grad_on)
            p.grad = torch.zeros_like(p)
        elif phase == "compute":
            started.add(step)
        hook(step, phase)

    resizes: list[tuple[int, int, list[int]]] = []  # (old world, new world, the mesh's shape then)

    def on_resize(old: int, new: int) -> None:
        resizes.append((old, new, list(rt.mesh.shape)))  # rt.mesh and rt.objects are the new mesh's already

    ck = DcpCheckpoints(args.dcp, every=args.dcp_every) if args.dcp else None
    rt = ResilientTrainer(None, config, mesh=LAYOUTS[layout], build=build, on_recovered=on_recovered,
                          on_phase=on_phase, on_resize=on_resize,
                          on_no_replica=ck.on_no_replica if ck is not None else None)
    out.with_suffix(".ready").write_text("1")
    while args.start_gate and not Path(args.start_gate).exists():
        time.sleep(0.02)  # the harness holds start() back (to change the view before any rank starts)
    commits: list[tuple[int, float]] = []
    cpu: list[float] = []  # the process's CPU time at each commit (every thread's)
    losses: dict[int, float] = {}  # (--model lm) step -> its loss, as the committed run of it returned
    resumed: int | None = None  # (--dcp) the checkpoint's step a restarted run went on from
    saved: list[int] = []
    try:
        rt.start()
        if ck is not None:
            resumed = ck.resume(rt)
        while rt.step < args.steps:
            if args.model == "lm":
                done = rt.run_step(lambda _s: tiny_lm.train_step(layout, rt.objects, rt.mesh, clip=not args.no_clip))
                if done.committed and done.value is not None:
                    # (a step interrupted on this rank but committed by the plan, its state taken from the
                    # replica peer, has no loss of this rank's own)
                    losses[done.step] = done.value
            else:
                with rt.training_step() as step:
                    train_step(layout, rt.objects, rt.mesh, step, args.pace_ms / 1000.0, clip=not args.no_clip,
                               before_clip=lambda: hook(rt.step + 1, "clip"))
            commits.append((rt.step, time.monotonic()))
            cpu.append(time.process_time())
            out.with_suffix(".step").write_text(str(rt.step))  # progress, for an orchestrator outside
            if ck is not None and ck.maybe_save(rt) is not None:
                saved.append(rt.step)
            if args.step_ms:
                time.sleep(args.step_ms / 1000.0)  # pacing: stands in for a longer compute step
    except (Released, JobFinished, JobStopped) as exc:
        print(f"gossiprec sharded trainer {rt.node}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        rt.close()
        os._exit(exit_code(exc))
    final = capture_state(rt.objects, step=rt.step, checksum=False)
    out.with_suffix(".state").write_bytes(state_bytes(final))
    out.write_text(json.dumps({"node": rt.node, "rank": rt.rank, "world_size": rt.world_size, "step": rt.step,
                               "records": records, "state_bytes": final.header.total_nbytes,
                               "kept_bytes": rt.snapshot_bytes,
                               "hung": rt.sharded.hung if rt.sharded is not None else 0,
                               "commits": commits, "cpu_s": cpu, "losses": losses, "resizes": resizes,
                               "mesh": list(rt.mesh.shape), "resumed": resumed, "saved": saved}))
    rt.finish()
    os._exit(0)  # an aborted backend may hold collectives whose destructor would block (managed.py)


def plain_main(args: argparse.Namespace) -> int:
    """The same rank without gossiprec, under torchrun (``--plain``): torch's own process group and
    ``init_device_mesh``, the same objects and steps; the report holds its commits and final state.

    ``--ckpt-out DIR``: at the end, save the job with torch's distributed checkpoint (model and optimizer,
    ``torch.distributed.checkpoint``) and every rank's other objects (schedule, data position, RNG) beside
    it. ``--ckpt-in DIR --resume-at K --from-replica D``: start from such a checkpoint, saved at step ``K``,
    on the mesh of the ranks torchrun starts (the layout's, its replicate dimension as many rows as that
    takes), each rank taking the other objects of the rank of replica ``D`` at its own shard coordinate,
    and train steps ``K+1`` to ``--steps``."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gossiprec.harness.workload import state_bytes
    from gossiprec.trainer.state.capture import capture_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    spec = LAYOUTS[args.layout].resized(dist.get_world_size())
    mesh = init_device_mesh("cpu", spec.shape, mesh_dim_names=spec.names)
    lm = args.model == "lm"
    objects = tiny_lm.build_objects(args.layout, mesh) if lm else build_objects(args.layout, mesh, args.hidden)
    first = 1
    if args.ckpt_in:
        _load_checkpoint(objects, Path(args.ckpt_in), args.from_replica * (spec.world_size // spec.shape[0])
                         + dist.get_rank() % (spec.world_size // spec.shape[0]))
        first = args.resume_at + 1
    commits: list[tuple[int, float]] = []
    cpu: list[float] = []
    losses: dict[int, float] = {}
    for step in range(first, args.steps + 1):
        if lm:
            losses[step] = tiny_lm.train_step(args.layout, objects, mesh, clip=not args.no_clip)
        else:
            train_step(args.layout, objects, mesh, step, args.pace_ms / 1000.0, clip=not args.no_clip)
        commits.append((step, time.monotonic()))
        cpu.append(time.process_time())
    if args.ckpt_out:
        _save_checkpoint(objects, Path(args.ckpt_out), dist.get_rank())
    out = Path(args.out.replace("{rank}", str(dist.get_rank())))
    final = capture_state(objects, step=args.steps, checksum=False)
    out.with_suffix(".state").write_bytes(state_bytes(final))
    out.write_text(json.dumps({"node": f"plain{dist.get_rank()}", "rank": dist.get_rank(),
                               "world_size": dist.get_world_size(), "step": args.steps,
                               "state_bytes": final.header.total_nbytes, "commits": commits, "cpu_s": cpu,
                               "losses": losses}))
    # every rank past its last collective before any tears its groups down: gloo aborted a rank with
    # "terminate called without an active exception" once (CI, HSDP) when a peer destroyed first
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _save_checkpoint(objects: dict[str, Any], path: Path, rank: int) -> None:
    """Model and optimizer with ``torch.distributed.checkpoint`` under ``path``; this rank's other objects
    (``torch.save`` of their state dicts) in ``path/rank{rank}.pt``."""
    import torch
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(objects["model"], objects["optimizer"])
    state_dict_saver.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))
    torch.save({k: o.state_dict() for k, o in objects.items() if k not in ("model", "optimizer")},
               path / f"rank{rank}.pt")


def _load_checkpoint(objects: dict[str, Any], path: Path, source_rank: int) -> None:
    """What :func:`_save_checkpoint` saved into ``objects`` (the other objects: those of ``source_rank``)."""
    import torch
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = objects["model"], objects["optimizer"]
    model_sd, optim_sd = get_state_dict(model, opt)
    state_dict_loader.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))  # in place
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    rest = torch.load(path / f"rank{source_rank}.pt", weights_only=False)
    for k, sd in rest.items():
        objects[k].load_state_dict(sd)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gossiprec.harness.sharded_trainer",
                                description="One rank or spare of a sharded local job (see the module docstring).")
    p.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    p.add_argument("--steps", type=int, required=True, help="train until this step is committed")
    p.add_argument("--out", required=True, help="the report's path; the other files go beside it")
    p.add_argument("--step-ms", dest="step_ms", type=float, default=0.0, help="sleep this long after each step")
    p.add_argument("--timeout", type=float, default=30.0, help="group and collective timeout, seconds")
    p.add_argument("--wait-for-spares", dest="wait_for_spares", type=float, default=0.0,
                   help="start() waits this long for the spares to be up")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="the MLP's width")
    p.add_argument("--model", choices=("mlp", "lm"), default="mlp",
                   help="the tiny MLP, or the small language model of gossiprec.harness.tiny_lm")
    p.add_argument("--no-clip", dest="no_clip", action="store_true",
                   help="no gradient clipping (and so no norm all-reduce before the optimizer step)")
    p.add_argument("--snapshot-copies", dest="snapshot_copies", type=int, default=None,
                   help="TrainerConfig.snapshot_copies (default: the trainer's, 1; 0: snapshot-free)")
    p.add_argument("--pace-ms", dest="pace_ms", type=float, default=0.0,
                   help="sleep this long inside each step, between forward and backward (stands in for compute)")
    p.add_argument("--plain", action="store_true",
                   help="run without gossiprec under torchrun ('{rank}' in --out becomes the rank)")
    p.add_argument("--ckpt-out", dest="ckpt_out", default="",
                   help="(--plain) at the end, save a distributed checkpoint into this directory")
    p.add_argument("--ckpt-in", dest="ckpt_in", default="", help="(--plain) start from this checkpoint")
    p.add_argument("--resume-at", dest="resume_at", type=int, default=0,
                   help="(--plain, --ckpt-in) the step the checkpoint was saved at")
    p.add_argument("--from-replica", dest="from_replica", type=int, default=0,
                   help="(--plain, --ckpt-in) the replica (replicate coordinate) whose other objects each rank takes")
    p.add_argument("--fault", action="append", default=[], help="KIND@PHASE:STEP (repeatable)")
    p.add_argument("--leave-grad", dest="leave_grad", action="store_true",
                   help="at the first step redone after a recovery, put a gradient on --leave-grad-on before "
                        "the step's code runs (what the trainer's guard must refuse)")
    p.add_argument("--leave-grad-on", dest="leave_grad_on", default="ln_f.weight",
                   help="the parameter --leave-grad writes (a name in the model)")
    p.add_argument("--dcp", default="", help="a directory of DCP checkpoints (DcpCheckpoints): the run resumes from "
                   "its newest complete one, on_no_replica loads it")
    p.add_argument("--dcp-every", dest="dcp_every", type=int, default=0,
                   help="save a checkpoint every N committed steps (with --dcp)")
    p.add_argument("--seed-per-shard", dest="seed_per_shard", action="store_true",
                   help="seed torch's generator by the rank's shard (second mesh coordinate): a value of the state "
                        "that differs between the ranks of one replica")
    p.add_argument("--start-gate", dest="start_gate", default="",
                   help="call start() only once this file exists (default: at once)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return plain_main(args) if args.plain else trainer_main(args)


if __name__ == "__main__":
    sys.exit(main())
