"""``gossiprec bench bootstrap``: launch to the first committed step, without a member list.

Two ways to start the same job of ``ranks`` single-process nodes on loopback, taking turns, in one run:

``gossiprec``
    ``ranks`` (+ ``spares``) ``gossiprec run --nnodes ... --seed ...`` processes, each an agent and a
    trainer (:mod:`gossiprec.harness.trainer`, one step of the demo MLP). The seed list names three
    addresses; the first never starts (a dead host), so every agent must find the job through the
    others. Done when every rank has committed step 1.
``torchrun-c10d``
    ``ranks`` ``torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT``
    processes, each with a worker that builds the same model, makes one all-reduce and one optimizer
    step. The rendezvous endpoint is one node's store: with that host dead the job never starts, so the
    dead-seed case has no torchrun figure (the report says so).

Both pay for Python and torch start-up on every rank (on a 2-core machine most of the time); the
figure is wall time from the first spawn to the last rank's first step, with the per-rank spread.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gossiprec.harness.ports import free_ports

_WORKER = r"""
import os, sys, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, {hidden}), torch.nn.GELU(), torch.nn.Linear({hidden}, 64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss = model(torch.randn(32, 64)).pow(2).mean()
loss.backward()
flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
dist.all_reduce(flat)
opt.step()
open(sys.argv[1] + f"/r{{dist.get_rank()}}.step", "w").write(str(time.time()))
dist.barrier()
dist.destroy_process_group()
"""


def _wait_files(paths: list[Path], procs: list[subprocess.Popen[bytes]], timeout: float) -> list[float] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return [p.stat().st_mtime for p in paths]
        if all(pr.poll() is not None for pr in procs):
            return None
        time.sleep(0.02)
    return None


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _first_steps(files: list[Path], procs: list[subprocess.Popen[bytes]], t0: float, tmp: Path,
                 timeout: float) -> dict[str, Any]:
    """Wait for every rank's first-step file, let the job end (a minute at most), stop what is left."""
    try:
        stamps = _wait_files(files, procs, timeout)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                break
    finally:
        _stop(procs)
    if stamps is None:
        return {"ok": False, "log_dir": str(tmp)}
    return {"ok": True, "first_step_s": round(max(stamps) - t0, 3), "spread_s": round(max(stamps) - min(stamps), 3)}


def run_gossiprec(ranks: int, spares: int, hidden: int, tmp: Path, timeout: float) -> dict[str, Any]:
    n = ranks + spares
    ports = free_ports(n + 1, width=3)
    dead = f"127.0.0.1:{ports[-1]}"
    seeds = [dead, f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1 if n > 1 else 0]}"]
    seeds = list(dict.fromkeys(seeds))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.time()
    for i in range(n):
        argv = [sys.executable, "-m", "gossiprec", "run", "--name", f"b{i:03d}", "--bind", "127.0.0.1",
                "--port", str(ports[i]), "--insecure", "--nnodes", str(n), "--spares", str(spares),
                "--host", "localhost", "--local-index", str(i), "--trainer-nice", "0",
                *[a for s in seeds for a in ("--seed", s)], "--",
                sys.executable, "-m", "gossiprec.harness.trainer", "--steps", "1", "--hidden", str(hidden),
                "--out", str(tmp / f"b{i:03d}.json")]
        with open(tmp / f"b{i:03d}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    files = [tmp / f"b{i:03d}.step" for i in range(ranks)]  # ranks 0.. are the first in rank order
    return {**_first_steps(files, procs, t0, tmp, timeout), "dead_seed": dead, "seeds": seeds}


def run_torchrun(ranks: int, hidden: int, tmp: Path, timeout: float) -> dict[str, Any]:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    script = tmp / "worker.py"
    script.write_text(_WORKER.format(hidden=hidden))
    port = free_ports(1)[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.time()
    for i in range(ranks):
        argv = [torchrun, "--nnodes", str(ranks), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench", "--max-restarts", "0",
                str(script), str(tmp)]
        with open(tmp / f"t{i:03d}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return _first_steps([tmp / f"r{r}.step" for r in range(ranks)], procs, t0, tmp, timeout)


def run(ranks_list: list[int], trials: int, spares: int, hidden: int, timeout: float, keep: bool) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    root = Path(tempfile.mkdtemp(prefix="gossiprec-bench-boot-"))
    for ranks in ranks_list:
        for trial in range(trials):
            for way in ("gossiprec", "torchrun-c10d"):  # taking turns: the machine's load hits both alike
                tmp = root / f"{way}-{ranks}-{trial}"
                tmp.mkdir()
                print(f"bench bootstrap: {way}, {ranks} ranks, trial {trial + 1}/{trials}", file=sys.stderr, flush=True)
                r = (run_gossiprec(ranks, spares, hidden, tmp, timeout) if way == "gossiprec"
                     else run_torchrun(ranks, hidden, tmp, timeout))
                rows.append({"way": way, "ranks": ranks, "trial": trial, **r})
    summary: dict[str, Any] = {}
    for ranks in ranks_list:
        for way in ("gossiprec", "torchrun-c10d"):
            got = [r["first_step_s"] for r in rows if r["way"] == way and r["ranks"] == ranks and r["ok"]]
            summary[f"{way}/{ranks}"] = {"median_s": round(statistics.median(got), 3) if got else None,
                                         "min_s": min(got) if got else None, "max_s": max(got) if got else None,
                                         "ok": len(got), "trials": trials}
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "bench": "bootstrap", "ranks": ranks_list, "trials": trials, "spares": spares, "hidden": hidden,
        "cpus": os.cpu_count(), "summary": summary, "runs": rows,
        "note": ("gossiprec: the first of its three seeds never starts; torchrun-c10d: all nodes up (with its "
                 "rendezvous endpoint's host dead, a c10d job does not start at all)"),
        **({"kept": str(root)} if keep else {}),
    }


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bootstrap", help="launch to first step: gossiprec --nnodes vs torchrun c10d",
                              description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--ranks", default="8", help="comma-separated job sizes (default 8)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--spares", type=int, default=0, help="hot spares beside the ranks (gossiprec only)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch before it counts as failed")
    p.add_argument("--keep", action="store_true", help="keep the logs")

    def _cmd(args: argparse.Namespace) -> int:
        ranks = [int(x) for x in str(args.ranks).split(",") if x.strip()]
        print(json.dumps(run(ranks, args.trials, args.spares, args.hidden, args.timeout, args.keep), indent=2))
        return 0

    p.set_defaults(func=_cmd)
    return p  # type: ignore[no-any-return]
