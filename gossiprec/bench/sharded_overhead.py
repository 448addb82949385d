"""``gossiprec bench sharded --overhead``: a sharded loop's step time with gossiprec, against the same loop without it.

Theory of operation
-------------------
Per layout (``tp``: dp x tp DTensor tensor parallelism; ``hsdp``: FSDP2 on a replicate x shard mesh),
``--rounds`` rounds of failure-free jobs of ``--steps`` steps, one of each kind per round, taking turns
(the order rotates from round to round, so that a drift of the machine's load falls on every kind):

- **plain**: the four ranks of :mod:`gossiprec.harness.sharded_trainer` with ``--plain`` under torchrun:
  torch's own gloo group and ``init_device_mesh``, no agent, no snapshot;
- **gossiprec** with each of ``--copies`` (``TrainerConfig.snapshot_copies``): the same ranks under
  agents (:func:`gossiprec.harness.sharded.run_sharded`) with one hot spare, as a real job runs: the
  managed groups, the commit and its barrier (1 copy: the commit barrier; 0: the ready barrier),
  progress reports, the agents' gossip.

Same model, mesh, data, optimizer and pacing: ``--pace-ms`` of sleep inside every step, between forward
and backward, stands in for the compute of a real model (four ranks computing on two cores would put
every other process's CPU time on the critical path, which an accelerator's compute does not). A step
time is the interval between the job's consecutive commits (the last rank to finish each step), from
step :data:`~gossiprec.bench.recovery.WARMUP` + 1 on. Per layout: the plain loop's step time and CPU
time per step and rank (``plain_step_s``, ``plain_cpu_ms_per_step``: every thread of the trainer
process, the median over ranks and rounds; agents not included), and per number of copies
(``gossiprec["1"]``, ...): its step times (pooled over the rounds), ``overhead_pct`` = median ratio - 1
with its 95 % bootstrap interval, the same per round, its CPU time per step, the host memory kept
per rank, and ``same_state``: every rank's final model, optimizer and RNG state is the same as the
plain job's of every round (gossiprec's own entry, its data position, left out). One JSON object on
stdout, progress on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import msgpack

from gossiprec.bench.agents import percentile
from gossiprec.bench.baseline import Series, _env, job_step_times, overhead_ci, series_stats
from gossiprec.bench.recovery import WARMUP
from gossiprec.errors import GossiprecError

OVERHEAD_TARGET = 0.005
"""The issue's target: a sharded step with gossiprec <= (1 + this) x the plain loop's."""
RANKS = 4


def training_digest(path: Path) -> str:
    """SHA-256 of a rank's final state file without gossiprec's own entry (which a plain run lacks):
    its model, optimizer and RNG trees and every tensor's bytes."""
    data = path.read_bytes()
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    header = unpacker.unpack()
    trees = {k: v for k, v in header["trees"].items() if k != "gossiprec"}
    digest = hashlib.sha256(msgpack.packb([header["tensors"], trees], use_bin_type=True))
    digest.update(data[unpacker.tell():])
    return digest.hexdigest()


def run_plain(layout: str, steps: int, hidden: int, pace_ms: float, work: Path, timeout: float,
              trainer_args: Sequence[str] = ()) -> dict[str, Any]:
    """The plain job under torchrun: ``{"commits": rank -> Series, "states": rank -> digest}``
    (``trainer_args``: more options for every rank, e.g. ``--model lm``)."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
           str(RANKS), "-m", "gossiprec.harness.sharded_trainer", "--plain", "--layout", layout, "--steps",
           str(steps), "--hidden", str(hidden), "--pace-ms", str(pace_ms), "--out", str(work / "r{rank}.json"),
           *trainer_args]
    with open(work / "torchrun.log", "wb") as log:
        try:
            proc = subprocess.run(cmd, env={**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise GossiprecError(f"plain {layout}: not done within {timeout:.0f} s; see {work}/torchrun.log") from exc
    if proc.returncode != 0:
        raise GossiprecError(f"plain {layout}: torchrun exited with {proc.returncode}; see {work}/torchrun.log")
    reports = {r: json.loads((work / f"r{r}.json").read_text()) for r in range(RANKS)}
    return {"commits": {r: [(int(s), float(t)) for s, t in rep["commits"]] for r, rep in reports.items()},
            "cpu_ms": cpu_per_step_ms([rep["cpu_s"] for rep in reports.values()]),
            "states": {r: training_digest(work / f"r{r}.state") for r in range(RANKS)},
            "state_bytes": max(rep["state_bytes"] for rep in reports.values())}


def run_managed(layout: str, steps: int, hidden: int, pace_ms: float, work: Path, timeout: float,
                copies: int = 1) -> dict[str, Any]:
    """The same job under gossiprec, with one hot spare and ``copies`` snapshot copies; the same keys as
    :func:`run_plain`, plus ``kept_bytes``."""
    from gossiprec.harness.sharded import run_sharded

    res = run_sharded(layout, steps, spares=1, hidden=hidden, workdir=str(work), timeout=timeout,
                      trainer_args=["--pace-ms", str(pace_ms), "--snapshot-copies", str(copies)])
    return {"commits": res["commits"], "cpu_ms": cpu_per_step_ms(list(res["cpu_s"].values())),
            "states": {r: training_digest(work / f"{node}.state") for r, node in res["assignment"].items()},
            "state_bytes": max(res["state_bytes"].values()), "kept_bytes": max(res["kept_bytes"].values())}


def cpu_per_step_ms(cpu: Sequence[Sequence[float]]) -> float | None:
    """A job's CPU time per step and rank, ms: each rank's process CPU time from its commit of step
    ``WARMUP`` to its last, over those steps; the median of the ranks'."""
    per = [1000 * (c[-1] - c[WARMUP - 1]) / (len(c) - WARMUP) for c in cpu if len(c) > WARMUP]
    return round(percentile(per, 50), 3) if per else None


def _pct(x: float | None) -> float | None:
    return None if x is None else round(100 * x, 3)


def compare(plain: Sequence[Sequence[Series]], managed: Sequence[Sequence[Series]]) -> dict[str, Any]:
    """Step times and overhead from the rounds' commit series (pure): ``plain[i]`` and ``managed[i]``
    are round i's jobs, one series per rank."""
    per_round = []
    for p, m in zip(plain, managed):
        ps, ms = job_step_times(p), job_step_times(m)
        ratio = percentile(ms, 50) / percentile(ps, 50) - 1 if ps and ms else None
        per_round.append(_pct(ratio))
    ps = [x for job in plain for x in job_step_times(job)]
    ms = [x for job in managed for x in job_step_times(job)]
    ratio = percentile(ms, 50) / percentile(ps, 50) - 1 if ps and ms else None
    ci = overhead_ci(ps, ms)
    return {"plain_step_s": series_stats(ps), "gossiprec_step_s": series_stats(ms),
            "overhead_pct": _pct(ratio), "overhead_ci95_pct": None if ci is None else [_pct(ci[0]), _pct(ci[1])],
            "overhead_ms": None if ratio is None else round(1000 * (percentile(ms, 50) - percentile(ps, 50)), 3),
            "per_round_pct": per_round,
            f"within_{OVERHEAD_TARGET * 100:g}pct": None if ratio is None else ratio <= OVERHEAD_TARGET}


def run_overhead(layouts: Sequence[str], *, rounds: int, steps: int, hidden: int, pace_ms: float,
                 workdir: str | None, say: Callable[[str], None], copies: Sequence[int] = (1,)) -> dict[str, Any]:
    """Every layout's rounds (see the module docstring); a failed job is reported under ``errors``."""
    base = Path(workdir or tempfile.mkdtemp(prefix="gossiprec-bench-overhead-"))
    timeout = 120.0 + 4 * steps * pace_ms / 1000.0
    out: dict[str, Any] = {"bench": "sharded-overhead", "steps": steps, "hidden": hidden, "pace_ms": pace_ms,
                           "rounds": rounds, "copies": list(copies), "cpu_count": os.cpu_count(), "layouts": {},
                           "errors": {}}
    kinds = ["plain", *(str(c) for c in copies)]

    def run(kind: str, layout: str, work: Path) -> dict[str, Any]:
        if kind == "plain":
            return run_plain(layout, steps, hidden, pace_ms, work, timeout)
        return run_managed(layout, steps, hidden, pace_ms, work, timeout, copies=int(kind))

    for layout in layouts:
        jobs: dict[str, dict[int, dict[str, Any]]] = {k: {} for k in kinds}
        loads: list[float] = []
        for i in range(rounds):
            for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
                name = f"{layout}-{'plain' if kind == 'plain' else 'copies' + kind}-{i}"
                t0 = time.monotonic()
                try:
                    jobs[kind][i] = run(kind, layout, base / name)
                except GossiprecError as exc:
                    out["errors"][name] = str(exc)
                    say(f"{name}: FAILED: {exc}")
                    continue
                loads.append(round(os.getloadavg()[0], 2))
                say(f"{name}: done in {time.monotonic() - t0:.1f} s (load {loads[-1]})")
        plain = jobs["plain"]
        cpus = [j["cpu_ms"] for j in plain.values() if j["cpu_ms"] is not None]
        steps_s = [x for j in plain.values() for x in job_step_times(list(j["commits"].values()))]
        report: dict[str, Any] = {
            "plain_step_s": series_stats(steps_s),
            "plain_cpu_ms_per_step": round(percentile(cpus, 50), 3) if cpus else None,
            "state_bytes": max((j["state_bytes"] for js in jobs.values() for j in js.values()), default=0),
            "gossiprec": {}, "loadavg_1m": loads}
        for kind in kinds[1:]:
            pairs = [(plain[i], jobs[kind][i]) for i in range(rounds) if i in plain and i in jobs[kind]]
            mode = compare([list(p["commits"].values()) for p, _ in pairs],
                           [list(m["commits"].values()) for _, m in pairs])
            del mode["plain_step_s"]
            cpus = [j["cpu_ms"] for j in jobs[kind].values() if j["cpu_ms"] is not None]
            mode.update(cpu_ms_per_step=round(percentile(cpus, 50), 3) if cpus else None,
                        kept_bytes=max((m["kept_bytes"] for m in jobs[kind].values()), default=0),
                        same_state=bool(pairs) and all(p["states"] == m["states"] for p, m in pairs),
                        rounds_compared=len(pairs))
            report["gossiprec"][kind] = mode
        out["layouts"][layout] = report
    out["workdir"] = str(base)
    return out
