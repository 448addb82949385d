"""``gossiprec bench ddp``: data-parallel step time with and without gossiprec, gloo on the CPU, 2 ranks.

Two processes on loopback train the same model (square linear layers, ``--mb`` MB of weights, AdamW)
from the same initial state; after ``--warmup`` steps each, the loops take turns step by step for
``--rounds`` x ``--steps`` timed steps (machine load drifts: every loop sees the same drift):

``plain``
    no gossiprec: ``torch.distributed``'s default group, the gradients concatenated after backward
    and averaged in one ``all_reduce``.
``ddp``
    torch's ``DistributedDataParallel`` on the default group (25 MB buckets overlapped with backward).
``flat``
    :class:`ResilientTrainer`: ``allreduce_gradients`` (one flat, interruptible all-reduce on the
    epoch's group) and ``commit()`` every step.
``buckets``
    :class:`ResilientTrainer` with ``overlap_gradients`` (25 MB buckets all-reduced while backward
    runs, waited interruptibly before the optimizer) and ``commit()`` every step.
``buckets-nocommit``
    the same all-reduce path without ``commit()``: what the commit costs, separately.

The trainer runs without an agent (a stub takes its reports); its group is an
:class:`~gossiprec.trainer.collectives.groups.EpochGroups` group as a recovery builds it. ``--copies`` is
``TrainerConfig.snapshot_copies``. Report (rank 0's clock): per loop the median, p10 and p90 step
time and the overhead against ``plain`` (ratio of medians minus one; ``paired_overhead_pct``: the
median of each turn's ratio to the ``plain`` step just before it, which cancels slow load drift), the
median CPU time of rank 0's process per step (all its threads: what the loop costs the machine,
whatever else shares it) and its overhead against ``plain``; the host memory each gossiprec
loop keeps for recovery (bytes, and as a multiple of the state); ``same_final_state``: every loop ends
with the same parameters bit for bit (with two ranks every reduction is one addition, so bucket
boundaries cannot change a result).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from gossiprec.bench.commit import _StubControl
from gossiprec.errors import ConfigError

LOOPS = ("plain", "ddp", "flat", "buckets", "buckets-nocommit")
HOST = "127.0.0.1"


def _model(mb: float, layers: int, seed: int = 0) -> Any:
    import torch

    dim = max(8, int((mb * 1e6 / 4 / layers) ** 0.5))
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(dim, dim), torch.nn.GELU())])


def _rank_main(rank: int, port: int, store_port: int, args: dict[str, Any], out: str) -> None:
    import hashlib

    import torch
    import torch.distributed as dist

    from gossiprec.trainer.config import TrainerConfig
    from gossiprec.trainer.collectives.groups import EpochGroups, connect_store, start_store_server
    from gossiprec.trainer.loop import ResilientTrainer

    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=2)
    if rank == 0:
        store, _ = start_store_server(HOST, store_port)
    else:
        store = connect_store(HOST, store_port)
    groups = EpochGroups(store, timeout=60.0, host=HOST)
    groups.build(0, rank, 2)
    dim = _model(args["mb"], args["layers"])[0].in_features
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args["batch"], dim, generator=gen)
    y = torch.randn(args["batch"], dim, generator=gen)

    loops: dict[str, dict[str, Any]] = {}
    for name in args["loops"]:
        model = _model(args["mb"], args["layers"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loop: dict[str, Any] = {"model": model, "opt": opt, "times": [], "cpu": [], "net": model, "rt": None}
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            loop["net"] = DistributedDataParallel(model, bucket_cap_mb=25)
        elif name != "plain":
            config = TrainerConfig(stateless_data=True, snapshot_copies=args["copies"], verify_replicas=False)
            rt = ResilientTrainer({"model": model, "optimizer": opt}, config, control=_StubControl(),  # type: ignore[arg-type]
                                  key=bytes(32))
            rt.groups = groups
            rt.install(rt.identity.but(rank=rank, world_size=2, epoch=0))
            rt._commit_snapshot(0)
            if name.startswith("buckets"):
                rt.overlap_gradients(model.parameters(), bucket_mb=25.0)
            loop["rt"] = rt
        loops[name] = loop

    def step(name: str) -> None:
        lp = loops[name]
        model, opt, rt = lp["model"], lp["opt"], lp["rt"]
        opt.zero_grad()
        torch.nn.functional.mse_loss(lp["net"](x), y).backward()
        if name == "plain":
            params = list(model.parameters())
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat.div_(2)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p))
                offset += n
        elif rt is not None:
            rt.begin_step()
            if not rt.allreduce_gradients(model.parameters()):
                raise RuntimeError("the all-reduce was interrupted (no agent here: should not happen)")
        opt.step()
        if rt is not None and name != "buckets-nocommit":
            rt.commit()
        elif rt is not None:
            rt.install(rt.identity.but(step=rt.step + 1))

    for name in args["loops"]:
        for _ in range(args["warmup"]):
            step(name)
    for _ in range(args["rounds"] * args["steps"]):
        for name in args["loops"]:  # one step of each loop in turn: load that drifts hits every loop alike
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step(name)
            loops[name]["times"].append(time.perf_counter() - t0)
            loops[name]["cpu"].append(time.process_time() - c0)
    report: dict[str, Any] = {"loops": {}}
    for name, lp in loops.items():
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in lp["model"].parameters())).hexdigest()
        row: dict[str, Any] = {"times": lp["times"], "cpu": lp["cpu"], "digest": digest}
        rt = lp["rt"]
        if rt is not None:
            rt.snapshots.settle()
            row["host_bytes"] = rt.snapshots.host_bytes()
            row["state_bytes"] = sum(p.nbytes * 3 for p in lp["model"].parameters())
            rt.close()
        report["loops"][name] = row
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # the gossiprec groups' destructors are not needed


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"median_s": round(statistics.median(s), 5), "p10_s": round(s[len(s) // 10], 5),
            "p90_s": round(s[(len(s) * 9) // 10], 5)}


def run(mb: float = 64.0, layers: int = 8, batch: int = 64, steps: int = 10, warmup: int = 2, rounds: int = 3,
        loops: tuple[str, ...] = LOOPS, copies: int = 1, threads: int = 1, timeout: float = 900.0) -> dict[str, Any]:
    """Run the loops on two local processes; returns the report (see the module docstring)."""
    import socket
    import subprocess
    import tempfile

    import torch

    if any(name not in LOOPS for name in loops) or not loops:
        raise ConfigError(f"loops must be some of {LOOPS}, got {loops!r}")
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind((HOST, 0))
            ports.append(s.getsockname()[1])
    args = {"mb": mb, "layers": layers, "batch": batch, "steps": steps, "warmup": warmup, "rounds": rounds,
            "loops": list(loops), "copies": copies, "threads": threads}
    with tempfile.TemporaryDirectory(prefix="gossiprec-bench-ddp-") as tmp:
        out = os.path.join(tmp, "report.json")
        code = ("import json, sys; from gossiprec.bench.ddp import _rank_main; a = sys.argv; "
                "_rank_main(int(a[1]), int(a[2]), int(a[3]), json.loads(a[4]), a[5])")
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(ports[0]), str(ports[1]), json.dumps(args),
                                   out]) for r in range(2)]
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if codes != [0, 0]:
            raise ConfigError(f"the benchmark's ranks exited with {codes}")
        with open(out) as f:
            raw = json.load(f)
    result: dict[str, Any] = {"torch": torch.__version__, "backend": "gloo", "world_size": 2, "mb": mb,
                              "layers": layers, "batch": batch, "steps": steps * rounds, "copies": copies,
                              "threads_per_rank": threads, "cpus": os.cpu_count(), "loops": {}}
    plain = raw["loops"].get("plain")
    for name, row in raw["loops"].items():
        out_row: dict[str, Any] = _stats(row["times"])
        out_row["cpu_median_s"] = round(statistics.median(row["cpu"]), 5)
        if plain is not None and name != "plain":
            ratios = [t / b for t, b in zip(row["times"], plain["times"], strict=True)]
            out_row["paired_overhead_pct"] = round(100 * (statistics.median(ratios) - 1), 2)
            base_cpu = statistics.median(plain["cpu"])
            out_row["cpu_overhead_pct"] = round(100 * (out_row["cpu_median_s"] / base_cpu - 1), 2)
        if "host_bytes" in row:
            out_row["host_bytes_kept"] = row["host_bytes"]
            out_row["host_copies_of_state"] = round(row["host_bytes"] / row["state_bytes"], 3)
            result["state_bytes"] = row["state_bytes"]
        result["loops"][name] = out_row
    base = result["loops"].get("plain")
    for name, row in result["loops"].items():
        row["overhead_pct"] = (round(100 * (row["median_s"] / base["median_s"] - 1), 2)
                               if base and name != "plain" else None)
    result["same_final_state"] = len({row["digest"] for row in raw["loops"].values()}) == 1
    return result


def _cmd(args: argparse.Namespace) -> int:
    loops = tuple(x.strip() for x in args.loops.split(",") if x.strip())
    report = run(args.mb, args.layers, args.batch, args.steps, args.warmup, args.rounds, loops, args.copies,
                 args.threads)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2), flush=True)
    return 0 if report["same_final_state"] else 1


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``ddp`` to the ``bench`` sub-commands (sets ``func``)."""
    p = subparsers.add_parser(
        "ddp", help="data-parallel step time: plain torch, torch DDP and gossiprec's paths (gloo, CPU, 2 ranks)",
        description="Train one model on two local gloo ranks with a plain all-reduce loop, torch DDP and "
                    "gossiprec's flat and bucketed paths (with a commit per step), in turns, and print step "
                    "times, overheads and host memory kept as JSON.")
    p.add_argument("--mb", type=float, default=64.0, help="weights in MB (64; AdamW adds twice that)")
    p.add_argument("--layers", type=int, default=8, help="square linear layers (8)")
    p.add_argument("--batch", type=int, default=64, help="rows per step (64)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per loop and round (10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per loop first (2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the loops in turn (3)")
    p.add_argument("--loops", default=",".join(LOOPS), help=f"loops to run ({','.join(LOOPS)})")
    p.add_argument("--copies", type=int, default=1, help="TrainerConfig.snapshot_copies of the gossiprec loops (1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    p.add_argument("--json", action="store_true", help="one JSON line")
    p.set_defaults(func=_cmd)
    return p  # type: ignore[no-any-return]
