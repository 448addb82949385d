"""Bootstrap benchmark: launch to first step of N torchrun nodes on loopback, c10d rendezvous against
``--rdzv-backend gossiprec``, alternated in one run (same machine, same load), figures as JSON.

Each torchrun node runs one worker (``--nproc-per-node 1 --max-restarts 0``, the combination the
gossiprec backend supports), all on 127.0.0.1. The worker, this script itself with ``--worker``,
builds the same small MLP in both cases and takes one data-parallel step:

* ``c10d``: torchrun's c10d rendezvous (its store on node 0's endpoint), then ``init_process_group
  ("gloo")`` from the environment torchrun sets, one gradient all-reduce and an optimizer step;
* ``gossiprec``: ``gossiprec torchrun`` with the gossiprec backend (every node's agent starts inside
  its torchrun, no store host), then ``ResilientTrainer(...).start()`` (the agreed view, its gloo
  group), one step and its commit.

A worker writes the wall-clock times at which it was spawned, had imported torch, had its group and
had done its first step. The figure of a launch is the latest first step (every rank has stepped)
minus the moment the first torchrun was spawned: torchrun's start-up, torch's import in every
worker, the rendezvous, the group and the step, alike in both cases but for the rendezvous and the
group (``phases_s``: the latest rank's moment of each phase, from the launch). The JSON holds every
launch and the median per backend::

    python examples/torchrun_bootstrap.py --nodes 8 --repeat 3 --out torchrun_bootstrap.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BACKENDS = ("c10d", "gossiprec")
LAUNCH_TIMEOUT_S = 300.0
"""A guard against a hung launch, not a figure."""


def worker(backend: str, out: Path) -> int:
    """One torchrun worker: one data-parallel step, then the time it was done, into ``out``."""
    spawned = time.time()
    import torch

    marks = {"worker_spawned": spawned, "torch_imported": time.time()}
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(int(os.environ.get("RANK", "0"))))
    if backend == "c10d":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        marks["group_ready"] = time.time()
        torch.nn.functional.mse_loss(model(x), x).backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        opt.step()
        marks["first_step"] = time.time()
        out.write_text(json.dumps(marks))
        dist.destroy_process_group()
        return 0
    from gossiprec.trainer import ResilientTrainer, TrainerConfig, training_state

    config = TrainerConfig(stateless_data=True)  # the batch is a function of the rank alone
    rt = ResilientTrainer(training_state(model, opt, rng=False), config=config).start()
    marks["group_ready"] = time.time()
    rt.begin_step()
    torch.nn.functional.mse_loss(model(x), x).backward()
    if not rt.allreduce_gradients(model.parameters()):
        raise SystemExit("a recovery during the benchmark's only step: nothing was killed, so something is wrong")
    opt.step()
    rt.commit()
    marks["first_step"] = time.time()
    out.write_text(json.dumps(marks))
    rt.finish(exit_code=0)
    return 0


def launch(backend: str, nodes: int, work: Path, env: dict[str, str], nice: int) -> dict[str, Any]:
    """Start ``nodes`` torchruns for ``backend``, wait for them; launch-to-first-step figures."""
    from gossiprec.harness.ports import free_ports

    work.mkdir(parents=True)
    common = ["--nnodes", str(nodes), "--nproc-per-node", "1", "--max-restarts", "0", "--monitor-interval", "0.1"]
    if backend == "c10d":
        port = free_ports(1)[0]
        per_node = [["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", work.name]
                    for _ in range(nodes)]
    else:
        base = free_ports(1, width=3 * nodes)[0]
        hosts = ";".join(f"n{i}=127.0.0.1" for i in range(nodes))
        conf = f"hosts=n[0-{nodes - 1}],base_port={base},addr={hosts},trainer_nice={nice}"
        per_node = [["--rdzv-backend", "gossiprec", "--rdzv-id", work.name, "--rdzv-conf", f"{conf},host=n{i}"]
                    for i in range(nodes)]
    # the wrapper registers the backend in-process, so the figure needs no entry point installed
    torchrun = [sys.executable, "-m", "torch.distributed.run"] if backend == "c10d" else [
        sys.executable, "-m", "gossiprec", "torchrun"]
    procs = []
    t0 = time.time()
    for i, args in enumerate(per_node):
        cmd = [*torchrun, *common, *args, "--no-python", sys.executable, str(Path(__file__).resolve()),
               "--worker", backend, "--first", str(work / f"n{i}.first")]
        with open(work / f"n{i}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, t0 + LAUNCH_TIMEOUT_S - time.time())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    t_end = time.time()
    marks = [json.loads(f.read_text()) for f in sorted(work.glob("*.first"))]
    firsts = [m["first_step"] for m in marks]
    ok = len(firsts) == nodes and not any(codes)
    if not ok:
        tail = (work / "n0.log").read_text(errors="replace")[-2000:]
        print(f"{backend}: a launch failed (exit codes {codes}); n0's log ends:\n{tail}", file=sys.stderr)
    return {"backend": backend, "ok": ok, "exit_codes": codes,
            "first_step_s": round(max(firsts) - t0, 3) if ok else None,
            "earliest_rank_first_step_s": round(min(firsts) - t0, 3) if firsts else None,
            # the latest rank's moment of each phase, from the launch
            "phases_s": {k: round(max(m[k] for m in marks) - t0, 3) for k in marks[0]} if ok else None,
            "all_exited_s": round(t_end - t0, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=8, help="torchrun nodes (one rank each)")
    ap.add_argument("--repeat", type=int, default=3, help="launches per backend, alternated")
    ap.add_argument("--out", default="", help="write the JSON here too")
    # 0 by default: on a machine shared with other work, workers niced below the agent (the backend's
    # default) would time that other work, not the rendezvous; c10d's workers are not niced either
    ap.add_argument("--trainer-nice", dest="trainer_nice", type=int, default=0,
                    help="the gossiprec backend's trainer_nice (0: the workers at torchrun's priority)")
    ap.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    ap.add_argument("--first", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, Path(args.first))
    from gossiprec.security.keyring import Keyring, decode_key, generate_key

    root = Path(tempfile.mkdtemp(prefix="gossiprec-torchrun-bench-"))
    Keyring([decode_key(generate_key())]).save(root / "keyring.json")
    env = {**os.environ, "GOSSIPREC_KEYRING": str(root / "keyring.json"), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    env.pop("GOSSIPREC_NODE", None)
    runs = []
    for r in range(args.repeat):
        for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:  # neither always first
            runs.append({"repeat": r, **launch(backend, args.nodes, root / f"{backend}-{r}", env, args.trainer_nice)})
            print(json.dumps(runs[-1]), file=sys.stderr)
    summary = {}
    for backend in BACKENDS:
        figs = [x["first_step_s"] for x in runs if x["backend"] == backend and x["ok"]]
        summary[backend] = {"launches_ok": len(figs), "first_step_median_s": statistics.median(figs) if figs else None,
                            "first_step_min_s": min(figs) if figs else None,
                            "first_step_max_s": max(figs) if figs else None}
    report = {"benchmark": "torchrun_bootstrap", "nodes": args.nodes, "nproc_per_node": 1, "repeat": args.repeat,
              "trainer_nice": args.trainer_nice,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load1": os.getloadavg()[0]},
              "torch": __import__("torch").__version__, "summary": summary, "runs": runs, "work": str(root)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(x["ok"] for x in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
