"""``gossiprec bench baseline``: gossiprec versus the plain loop (overhead) and the torchrun way (lost time).

Theory of operation
-------------------
Every job trains the harness workload (:func:`gossiprec.harness.workload.build`, width from
``--state-mb`` as in :mod:`gossiprec.bench.recovery`) with the same step: local gradients, pacing
(it stands in for a longer forward/backward), one flat gloo all-reduce of the gradients (sum, then
divide by the world size, as ``ResilientTrainer.allreduce_gradients`` does), the optimizer step and
a progress file. Five kinds of job run one after the other, each ``steps`` steps on ``ranks`` ranks:

``plain``
    ``torchrun --standalone`` workers (:func:`worker_main`), no gossiprec, no checkpoint: the reference.
``gossiprec``
    the recovery bench's trainer under one ``gossiprec run`` per member, plus the hot spare the
    failure job needs; no failure.
``torchrun``
    ``plain`` plus a checkpoint every ``checkpoint_every`` steps: rank 0 ``torch.save``-s model,
    optimizer, data position and RNG (temporary file, then ``os.replace``; no fsync, which favours
    this baseline) before it commits the step.
``torchrun-kill``
    ``torchrun`` with one restart: once every rank has committed ``kill_at`` steps the bench SIGKILLs
    the last rank's worker; torchrun's agent notices (it polls every :data:`MONITOR_INTERVAL_S`),
    stops *all* workers and starts fresh ones, which load the last checkpoint and redo the steps since.
``gossiprec-kill``
    ``gossiprec`` with the same kill (:func:`gossiprec.bench.recovery.run_trial`): the spare takes the
    dead rank's place in place; nothing committed is lost.

**Overhead** compares ``plain`` with ``gossiprec`` by their step times (the intervals between the
job's consecutive commits, after ``WARMUP``): the ratio of the medians minus one, with a bootstrap
interval (:func:`overhead_ci`), so a figure inside the noise shows as an interval around 0. The pair
runs ``rounds`` times, alternating which goes first, so that a load drifting over the run biases
neither. **Lost time** compares the walls of the jobs (the last rank's first commit of step 1 to its
commit of step ``steps``) and, less noisy, the time from the kill until every rank is back at step
``kill_at + 1`` (:func:`_torchrun_loss`, :func:`_gossiprec_loss`). Every job reports the SHA-256 of
its final state: all must agree (``final_states_identical``), i.e. the jobs did the same training,
across restarts and recoveries, bit for bit.

Everything runs on this machine's CPUs (``cpu_count`` and load averages are in the report): with more
processes than cores the figures include scheduling. Progress lines go to stderr, the report (one
JSON object) to stdout. A failed job is reported with its error and the work directory is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from gossiprec.agent.launcher import THP_VAR
from gossiprec.bench.agents import percentile
from gossiprec.bench.recovery import (
    WARMUP, RecoverySpec, TrialResult, hidden_for_state, run_trial, trainer_argv,
)
from gossiprec.errors import ConfigError, GossiprecError
from gossiprec.harness.job import LocalJob, read_float, read_int, reap
from gossiprec.harness.workload import LAYERS, state_params

OVERHEAD_TARGET = 0.01
"""The target: gossiprec's step time <= (1 + this) x the plain loop's."""
LOSS_RATIO_TARGET = 10.0
"""The target: the torchrun way loses at least this many times more time than gossiprec."""
MONITOR_INTERVAL_S = 0.1
"""torchrun's ``--monitor-interval``, at its default."""
BOOTSTRAP_SAMPLES = 1000
JOBS = ("plain", "gossiprec", "torchrun", "torchrun-kill", "gossiprec-kill")

Series = list[tuple[int, float]]
"""One process's commits: ``(step, time.monotonic())``, in order."""


class BaselineBenchError(GossiprecError):
    """A job of the baseline bench could not start, did not reach the kill, or did not finish."""


# --------------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True, slots=True)
class BaselineSpec:
    """One configuration. Seconds for times, MB = 10**6 bytes."""

    ranks: int = 2
    steps: int = 200
    step_ms: float = 100.0
    """Each step takes at least this long (pacing before the all-reduce)."""
    state_mb: float = 1.0
    """Lower bound on the state (params + AdamW moments); sets the MLP width unless ``hidden``."""
    hidden: int | None = None
    checkpoint_every: int = 40
    """The torchrun way saves a checkpoint every this many steps."""
    kill_at: int = 60
    """SIGKILL the last rank once every rank has committed this many steps (default: between two
    checkpoints, so the torchrun way redoes half a checkpoint interval, its average case)."""
    rounds: int = 2
    """Runs of the ``plain`` / ``gossiprec`` pair, alternating which goes first (ABBA...), so that a load
    that drifts over time biases neither; their step times are pooled and their walls' median used."""
    overhead_only: bool = False
    """Run only the ``plain`` / ``gossiprec`` pairs (the overhead), not the three jobs of the lost time."""
    pg_timeout: float = 30.0
    """Group and collective timeout of every trainer, seconds."""
    job_timeout: float | None = None
    """Bound on one job, seconds (default: 120 + 4 x the paced training time)."""
    agent_log_level: str = "warning"
    workdir: str | None = None
    keep: bool = False

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ConfigError(f"--ranks must be at least 2 (gossiprec needs a survivor to donate the "
                              f"state), got {self.ranks}")
        if not self.state_mb > 0 or (self.hidden is not None and self.hidden < 1):
            raise ConfigError("--state-mb and --hidden must be positive")
        if self.step_ms < 0:
            raise ConfigError(f"--step-ms must not be negative, got {self.step_ms}")
        if self.rounds < 1:
            raise ConfigError(f"--rounds must be at least 1, got {self.rounds}")
        if self.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be at least 1, got {self.checkpoint_every}")
        if not WARMUP + 2 <= self.kill_at < self.steps:
            raise ConfigError(f"--kill-at must be in {WARMUP + 2}..{self.steps - 1} (normal steps are "
                              f"measured before the kill; steps remain after it), got {self.kill_at}")
        if self.steps < 2 * WARMUP + 4:
            raise ConfigError(f"--steps must be at least {2 * WARMUP + 4}, got {self.steps}")

    @property
    def width(self) -> int:
        return self.hidden if self.hidden is not None else hidden_for_state(int(self.state_mb * 1e6))

    @property
    def timeout(self) -> float:
        return self.job_timeout or 120.0 + 4 * self.steps * self.step_ms / 1000.0


@dataclass(slots=True)
class JobResult:
    """What one job left behind (times are ``time.monotonic()`` of this machine)."""

    name: str
    first: list[Series] = field(default_factory=list)
    """The series that start at step 1 (the first processes of each rank)."""
    last: list[Series] = field(default_factory=list)
    """The series of the processes that finished the job."""
    busy_s: list[float] = field(default_factory=list)
    """Per-step busy time (everything but the pacing sleep), pooled over the finishing processes."""
    sha256: list[str] = field(default_factory=list)
    startup_s: float | None = None
    saves_s: list[float] = field(default_factory=list)
    t_kill: float | None = None
    restart_s: dict[str, float | None] = field(default_factory=dict)
    resumed_from: int | None = None
    trial: TrialResult | None = None
    loadavg: list[float] = field(default_factory=list)
    """1-minute load average at the start and the end of the job."""
    state_bytes: int = 0
    """The captured state's payload (gossiprec jobs) or the checkpoint file's size (torchrun jobs)."""


# --------------------------------------------------------------------------------------------------
# statistics (pure)


def series_stats(xs: Sequence[float], nd: int = 4) -> dict[str, float] | None:
    """``{median, p10, p90, mean, n}`` of ``xs`` (None when empty)."""
    if not xs:
        return None
    return {"median": round(percentile(xs, 50), nd), "p10": round(percentile(xs, 10), nd),
            "p90": round(percentile(xs, 90), nd), "mean": round(sum(xs) / len(xs), nd), "n": len(xs)}


def job_commit_times(series: Sequence[Series]) -> dict[int, float]:
    """Step -> when the job committed it (the last of the processes that committed it; the latest
    commit when a step was done again after a restart)."""
    out: dict[int, float] = {}
    for s in series:
        for step, t in s:
            out[step] = max(out.get(step, t), t)
    return out


def job_step_times(series: Sequence[Series], warmup: int = WARMUP) -> list[float]:
    """Intervals between the job's consecutive commits, from step ``warmup + 1`` on."""
    at = job_commit_times(series)
    return [at[s] - at[s - 1] for s in sorted(at) if s - 1 >= warmup and s - 1 in at]


def wall_s(first: Sequence[Series], last: Sequence[Series], steps: int) -> float | None:
    """Last commit of step ``steps`` in ``last`` minus the last rank's first commit of step 1 in ``first``."""
    starts = [min(t for s, t in ser if s == 1) for ser in first if any(s == 1 for s, _ in ser)]
    ends = [t for ser in last for s, t in ser if s == steps]
    if not starts or not ends:
        return None
    return max(ends) - max(starts)


def overhead_ci(base: Sequence[float], other: Sequence[float], samples: int = BOOTSTRAP_SAMPLES,
                seed: int = 0, level: float = 0.95) -> tuple[float, float] | None:
    """Bootstrap interval of ``median(other) / median(base) - 1`` (both resampled with replacement)."""
    if not base or not other:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(samples):
        b = percentile(rng.choices(base, k=len(base)), 50)
        o = percentile(rng.choices(other, k=len(other)), 50)
        if b > 0:
            ratios.append(o / b - 1.0)
    if not ratios:
        return None
    tail = (1.0 - level) / 2 * 100
    return percentile(ratios, tail), percentile(ratios, 100 - tail)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 2) if num is not None and den is not None and den > 0 else None


# --------------------------------------------------------------------------------------------------
# the plain worker (one rank under torchrun)


def save_torch_checkpoint(path: Path, model: Any, opt: Any, cursor: Any, step: int) -> None:
    """The usual torchrun-job checkpoint: ``torch.save`` of everything to a temporary file, then rename."""
    import torch

    blob = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "data": cursor.state_dict(), "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)


def load_torch_checkpoint(path: Path, model: Any, opt: Any, cursor: Any) -> int:
    """Load a :func:`save_torch_checkpoint` file (``weights_only``: no arbitrary unpickling); its step."""
    import torch

    blob = torch.load(path, weights_only=True)
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    cursor.load_state_dict(blob["data"])
    torch.set_rng_state(blob["rng"]["torch"])
    version, internal, gauss = blob["rng"]["python"]
    random.setstate((version, tuple(internal), gauss))
    return int(blob["step"])


def state_sha256(model: Any, opt: Any, cursor: Any, step: int) -> str:
    """The hash of the final state every job reports (the recovery trainer's too:
    :func:`~gossiprec.harness.workload.state_digest`)."""
    from gossiprec.harness.workload import objects_of, state_digest

    return state_digest(objects_of(model, opt, cursor), step)[0]


def worker_main(args: argparse.Namespace) -> int:
    """One rank of a plain job under torchrun (``RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT``)."""
    t_main = time.monotonic()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out_dir) / f"r{rank}-a{attempt}"
    out.with_suffix(".pid").write_text(str(os.getpid()))
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gossiprec.harness.workload import build, local_gradients, set_flat_grads

    t_torch = time.monotonic()
    torch.set_num_threads(1)
    model, opt, cursor = build(args.hidden, args.layers)
    params = [p for p in model.parameters() if p.requires_grad]
    t_built = time.monotonic()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    t_pg = time.monotonic()
    ckpt = Path(args.ckpt) if args.ckpt else None
    step = load_torch_checkpoint(ckpt, model, opt, cursor) if ckpt is not None and ckpt.exists() else 0
    resumed_from, t_loaded = step, time.monotonic()
    progress = out.with_suffix(".step")
    commits: Series = []
    busy: list[float] = []
    saves: list[float] = []
    pace = args.step_ms / 1000.0
    while step < args.steps:
        t0 = time.monotonic()
        local_gradients(model, cursor, rank)
        left = pace - (time.monotonic() - t0)
        if left > 0:
            time.sleep(left)  # stands in for a longer forward/backward: before the collective
        slept = max(0.0, left)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat.div_(world)
        set_flat_grads(params, flat)
        opt.step()
        cursor.index += 1
        step += 1
        if ckpt is not None and args.ckpt_every and rank == 0 and step % args.ckpt_every == 0:
            ts = time.monotonic()
            save_torch_checkpoint(ckpt, model, opt, cursor, step)
            saves.append(time.monotonic() - ts)
        t1 = time.monotonic()
        commits.append((step, t1))
        busy.append(t1 - t0 - slept)
        progress.write_text(str(step))
        if step == 1:  # where the job's wall time starts, kept even if this process dies later
            out.with_suffix(".t1").write_text(repr(t1))
    out.with_suffix(".json").write_text(json.dumps({
        "rank": rank, "attempt": attempt, "step": step, "commits": commits, "busy_s": busy, "saves_s": saves,
        "resumed_from": resumed_from, "t_main": t_main, "t_torch": t_torch, "t_built": t_built, "t_pg": t_pg,
        "t_loaded": t_loaded,
        "state_sha256": state_sha256(model, opt, cursor, step)}))
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------------
# jobs


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOSSIPREC_", "TORCHELASTIC_"))}
    # every kind of job gets the allocator setting `gossiprec run` gives its child (launcher.THP_VAR),
    # so that the plain and torchrun jobs are not slower for a reason unrelated to recovery
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", THP_VAR: env.get(THP_VAR, "1")}


def run_torchrun_job(spec: BaselineSpec, name: str, tmp: Path, *, checkpoint: bool, kill: bool,
                     say: Callable[[str], None]) -> JobResult:
    """One torchrun job of plain workers; with ``kill``, SIGKILL the last rank at ``kill_at``."""
    tmp.mkdir(parents=True, exist_ok=True)
    res = JobResult(name, loadavg=[round(os.getloadavg()[0], 2)])
    victim = spec.ranks - 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(spec.ranks), "--max-restarts", "1" if kill else "0",
           "--monitor-interval", str(MONITOR_INTERVAL_S), "-m", "gossiprec.bench.baseline", "worker",
           "--steps", str(spec.steps), "--hidden", str(spec.width), "--layers", str(LAYERS),
           "--step-ms", str(spec.step_ms), "--pg-timeout", str(spec.pg_timeout), "--out-dir", str(tmp)]
    if checkpoint:
        cmd += ["--ckpt", str(tmp / "ckpt.pt"), "--ckpt-every", str(spec.checkpoint_every)]
    t_start = time.monotonic()
    deadline = t_start + spec.timeout
    with open(tmp / "torchrun.log", "wb") as log:
        # rank 0 of each rendezvous round hosts a fresh TCPStore: with the agent's shared store, a
        # restarted gloo group reads the previous round's addresses and fails connectFullMesh
        proc = subprocess.Popen(cmd, env={**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                done = min(read_int(tmp / f"r{r}-a0.step") for r in range(spec.ranks))
                if res.startup_s is None and done >= 1:
                    res.startup_s = round(time.monotonic() - t_start, 2)
                    say(f"{name}: {spec.ranks} ranks training after {res.startup_s} s")
                if kill and res.t_kill is None and done >= spec.kill_at:
                    pid = read_int(tmp / f"r{victim}-a0.pid")
                    res.t_kill = time.monotonic()  # before the signal, as the recovery bench stamps it
                    os.kill(pid, signal.SIGKILL)
                    say(f"{name}: SIGKILL worker of rank {victim} (pid {pid}) after step {spec.kill_at}")
                if time.monotonic() > deadline:
                    raise BaselineBenchError(f"{name}: the job did not finish within {spec.timeout:.0f} s; "
                                             f"see {tmp}/torchrun.log")
                time.sleep(0.005)
        finally:
            reap([proc])
    if proc.returncode != 0:
        raise BaselineBenchError(f"{name}: torchrun exited with {proc.returncode}; see {tmp}/torchrun.log")
    if kill and res.t_kill is None:
        raise BaselineBenchError(f"{name}: the job ended before step {spec.kill_at}; see {tmp}/torchrun.log")
    attempt = 1 if kill else 0
    outs = []
    for r in range(spec.ranks):
        path = tmp / f"r{r}-a{attempt}.json"
        if not path.exists():
            raise BaselineBenchError(f"{name}: rank {r} of attempt {attempt} left no report; see "
                                     f"{tmp}/torchrun.log")
        outs.append(json.loads(path.read_text()))
    res.last = [[(int(s), float(t)) for s, t in o["commits"]] for o in outs]
    res.busy_s = [b for o in outs for b in o["busy_s"]]
    res.saves_s = [s for o in outs for s in o["saves_s"]]
    res.sha256 = sorted({o["state_sha256"] for o in outs})
    if checkpoint and (tmp / "ckpt.pt").exists():
        res.state_bytes = (tmp / "ckpt.pt").stat().st_size
    if kill:
        assert res.t_kill is not None
        # attempt 0 died without a report: its step-1 commits are in its ``.t1`` files
        res.first = [[(1, t)] for r in range(spec.ranks) if (t := read_float(tmp / f"r{r}-a0.t1")) is not None]
        res.resumed_from = min(int(o["resumed_from"]) for o in outs)
        res.restart_s = {k: _r(max(float(o[key]) for o in outs) - res.t_kill) for k, key in (
            ("workers_started", "t_main"), ("torch_imported", "t_torch"), ("model_built", "t_built"),
            ("group_initialised", "t_pg"),
            ("checkpoint_loaded", "t_loaded"))}
    else:
        res.first = res.last
    res.loadavg.append(round(os.getloadavg()[0], 2))
    return res


def _gossiprec_outputs(res: JobResult, outs: Sequence[dict[str, Any]]) -> None:
    series = [[(int(s), float(t)) for s, t in o["commits"]] for o in outs]
    res.first = [s for s in series if s and s[0][0] == 1]
    res.last = series
    res.busy_s = [b for o in outs for b in o["busy_s"]]
    res.sha256 = sorted({o["state_sha256"] for o in outs})
    res.state_bytes = int(outs[0]["state_bytes"]) if outs else 0


def run_gossiprec_job(spec: BaselineSpec, name: str, tmp: Path, say: Callable[[str], None]) -> JobResult:
    """One failure-free gossiprec job: ``ranks`` recovery-bench trainers + 1 hot spare under agents."""
    res = JobResult(name, loadavg=[round(os.getloadavg()[0], 2)])
    with LocalJob(tmp, spec.ranks, 1, env=_env()) as job:  # leaving it ends the spare, which waits for a rank
        t_start = time.monotonic()
        deadline = t_start + spec.timeout
        for node in job.names:
            job.spawn(node, trainer_argv(job.path(node, ".json"), spec.steps, spec.width, spec.step_ms,
                                         spec.pg_timeout), agent_log_level=spec.agent_log_level)
        procs = list(job.procs.values())
        trainers = procs[:spec.ranks]
        while any(p.poll() is None for p in trainers):
            if res.startup_s is None and min(read_int(job.path(n, ".step")) for n in job.trainers) >= 1:
                res.startup_s = round(time.monotonic() - t_start, 2)
                say(f"{name}: {spec.ranks} ranks + 1 spare training after {res.startup_s} s")
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                raise BaselineBenchError(f"{name}: the job did not finish within {spec.timeout:.0f} s (or the "
                                         f"spare's agent exited); see the logs in {tmp}")
            time.sleep(0.01)
        bad = {n: p.returncode for n, p in zip(job.trainers, trainers) if p.returncode}
        if bad:
            raise BaselineBenchError(f"{name}: trainers failed with exit codes {bad}; see the logs in {tmp}")
    _gossiprec_outputs(res, [json.loads(job.path(n, ".json").read_text()) for n in job.trainers])
    res.loadavg.append(round(os.getloadavg()[0], 2))
    return res


def run_gossiprec_kill_job(spec: BaselineSpec, name: str, tmp: Path, say: Callable[[str], None]) -> JobResult:
    """The same job with the last rank SIGKILLed at ``kill_at`` (:func:`gossiprec.bench.recovery.run_trial`)."""
    rspec = RecoverySpec(ranks=spec.ranks, spares=1, hidden=spec.width, trials=1, step_ms=spec.step_ms,
                         kill_at=spec.kill_at, post_steps=spec.steps - spec.kill_at,
                         trial_timeout=spec.timeout, pg_timeout=spec.pg_timeout,
                         agent_log_level=spec.agent_log_level)
    res = JobResult(name, loadavg=[round(os.getloadavg()[0], 2)])
    trial = run_trial(rspec, 0, tmp, lambda m: say(f"{name}: {m}"))
    res.trial, res.startup_s = trial, trial.startup_s
    victim = f"n{spec.ranks - 1}"
    outs = [json.loads(p.read_text()) for p in sorted(tmp.glob("n*.json")) if p.stem != victim]
    _gossiprec_outputs(res, outs)
    res.loadavg.append(round(os.getloadavg()[0], 2))
    return res


# --------------------------------------------------------------------------------------------------
# the bench


def job_names(rounds: int, overhead_only: bool = False) -> list[str]:
    """The jobs in the order they run: the plain/gossiprec pair ``rounds`` times, alternating which goes
    first (round r > 0 names its jobs ``plain.r`` and ``gossiprec.r``), then the other three (unless
    ``overhead_only``)."""
    names: list[str] = []
    for r in range(rounds):
        pair = [k if r == 0 else f"{k}.{r}" for k in JOBS[:2]]
        names += pair if r % 2 == 0 else pair[::-1]
    return names if overhead_only else names + list(JOBS[2:])


def kind_of(name: str) -> str:
    """The kind of job (one of :data:`JOBS`) a job name stands for."""
    return name.split(".", 1)[0]


def run_bench(spec: BaselineSpec, say: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Run the five jobs (see the module docstring) and return the JSON-ready report."""
    root = Path(spec.workdir) if spec.workdir else Path(tempfile.mkdtemp(prefix="grb", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    say(f"baseline bench: load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus; {spec.ranks} ranks, "
        f"{spec.steps} steps of >= {spec.step_ms} ms, hidden {spec.width} (~{12 * state_params(spec.width) / 1e6:.2f}"
        f" MB of state), checkpoint every {spec.checkpoint_every}, kill at {spec.kill_at}; workdir {root}")
    runners: dict[str, Callable[[str, Path], JobResult]] = {
        "plain": lambda n, d: run_torchrun_job(spec, n, d, checkpoint=False, kill=False, say=say),
        "gossiprec": lambda n, d: run_gossiprec_job(spec, n, d, say),
        "torchrun": lambda n, d: run_torchrun_job(spec, n, d, checkpoint=True, kill=False, say=say),
        "torchrun-kill": lambda n, d: run_torchrun_job(spec, n, d, checkpoint=True, kill=True, say=say),
        "gossiprec-kill": lambda n, d: run_gossiprec_kill_job(spec, n, d, say),
    }
    jobs: dict[str, JobResult] = {}
    errors: dict[str, str] = {}
    try:
        for name in job_names(spec.rounds, spec.overhead_only):
            t0 = time.monotonic()
            try:
                jobs[name] = runners[kind_of(name)](name, root / name)
            except (GossiprecError, OSError, ValueError, KeyError) as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                say(f"{name}: FAILED: {errors[name]}")
                continue
            say(f"{name}: done in {time.monotonic() - t0:.1f} s, wall "
                f"{_r(wall_s(jobs[name].first, jobs[name].last, spec.steps), 3)} s")
    finally:
        kept = bool(spec.keep or spec.workdir or errors)
        if not kept:
            shutil.rmtree(root, ignore_errors=True)
    return summarize(spec, jobs, errors, str(root) if kept else None)


def _job_report(spec: BaselineSpec, job: JobResult) -> dict[str, Any]:
    return {"wall_s": _r(wall_s(job.first, job.last, spec.steps)), "startup_s": job.startup_s,
            "step_s": series_stats(job_step_times(job.last)),
            "busy_s": series_stats(job.busy_s), "state_sha256": job.sha256, "loadavg_1m": job.loadavg}


def summarize(spec: BaselineSpec, jobs: dict[str, JobResult], errors: dict[str, str] | None = None,
              workdir: str | None = None) -> dict[str, Any]:
    """The report from the jobs that ran (pure; a missing job leaves its figures None).

    ``overhead``: per kind the step times' median, p10, p90 and mean, pooled over the rounds; the
    overhead is the ratio of the medians minus one, with its 95 % bootstrap interval, and the ratio
    of the walls (each kind's wall: the median of its rounds'). ``lost_time``: per approach (see
    :func:`_torchrun_loss`), and ``ratio_*`` = torchrun's over gossiprec's (none where gossiprec's
    loss is <= 0, i.e. inside the noise).
    """
    by_kind: dict[str, list[JobResult]] = {}
    for n, j in jobs.items():
        by_kind.setdefault(kind_of(n), []).append(j)
    walls: dict[str, float | None] = {}
    for k, js in by_kind.items():
        ws = [w for j in js if (w := wall_s(j.first, j.last, spec.steps)) is not None]
        walls[k] = percentile(ws, 50) if ws else None
    steps = {k: [x for j in by_kind[k] for x in job_step_times(j.last)] for k in JOBS[:3] if k in by_kind}
    med = {k: percentile(xs, 50) if xs else None for k, xs in steps.items()}
    pooled = {k: [b for j in js for b in j.busy_s] for k, js in by_kind.items()}
    busy = {k: percentile(bs, 50) if bs else None for k, bs in pooled.items()}
    plain, gr = steps.get("plain", []), steps.get("gossiprec", [])
    m_plain, m_gr = med.get("plain"), med.get("gossiprec")
    ratio = m_gr / m_plain - 1 if m_plain and m_gr is not None else None
    b_plain, b_gr = busy.get("plain"), busy.get("gossiprec")
    w_plain, w_gr = walls.get("plain"), walls.get("gossiprec")
    ci = overhead_ci(plain, gr)
    overhead = {
        "plain_step_s": series_stats(plain), "gossiprec_step_s": series_stats(gr),
        "overhead_pct": _r(None if ratio is None else 100 * ratio, 3),
        "overhead_ci95_pct": None if ci is None else [round(100 * ci[0], 3), round(100 * ci[1], 3)],
        "overhead_ms": _r(None if m_plain is None or m_gr is None else 1000 * (m_gr - m_plain), 3),
        "busy_overhead_ms": _r(None if b_plain is None or b_gr is None else 1000 * (b_gr - b_plain), 3),
        "wall_overhead_pct": _r(None if not w_plain or w_gr is None else 100 * (w_gr / w_plain - 1), 3),
        "within_noise": None if ci is None else ci[0] <= 0.0 <= ci[1],
    }
    tr = _torchrun_loss(spec, jobs, walls, med.get("torchrun"))
    go = _gossiprec_loss(jobs, walls)
    lost: dict[str, Any] = {"torchrun": tr, "gossiprec": go,
                            "ratio_total": _ratio(tr["total_lost_s"], go["total_lost_s"]),
                            "ratio_failure": _ratio(tr["failure_s"], go["failure_s"]),
                            "ratio_event": _ratio(tr["event_lost_s"], go["event_lost_s"])}
    notes = [f"{who}.{key} = {d[key]} s < 0: the wall-time difference is inside the run-to-run noise (see "
             "the jobs' loadavg_1m); the event figures are the less noisy ones"
             for who, d in (("torchrun", tr), ("gossiprec", go))
             for key in ("steady_overhead_s", "failure_s", "total_lost_s") if d[key] is not None and d[key] < 0]
    hashes = {n: j.sha256 for n, j in jobs.items()}
    identical = len({h for hs in hashes.values() for h in hs}) == 1 if hashes else None
    state_bytes = next((j.state_bytes for n, j in jobs.items() if n.startswith("gossiprec") and j.state_bytes), 0)
    report: dict[str, Any] = {
        "bench": "baseline", "ranks": spec.ranks, "steps": spec.steps, "step_ms": spec.step_ms,
        "rounds": spec.rounds,
        "state_mb_requested": spec.state_mb, "hidden": spec.width, "layers": LAYERS, "state_bytes": state_bytes,
        "checkpoint_bytes": jobs["torchrun"].state_bytes if "torchrun" in jobs else None,
        "checkpoint_every": spec.checkpoint_every, "kill_at": spec.kill_at, "victim_rank": spec.ranks - 1,
        "monitor_interval_s": MONITOR_INTERVAL_S, "cpu_count": os.cpu_count(),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
        "overhead": overhead,
        "lost_time": lost,
        "final_states_identical": identical,
        "targets": {
            f"overhead_le_{OVERHEAD_TARGET * 100:g}pct": None if ratio is None else ratio <= OVERHEAD_TARGET,
            f"lost_ratio_total_ge_{LOSS_RATIO_TARGET:g}x": None if lost["ratio_total"] is None
            else lost["ratio_total"] >= LOSS_RATIO_TARGET,
            f"lost_ratio_event_ge_{LOSS_RATIO_TARGET:g}x": None if lost["ratio_event"] is None
            else lost["ratio_event"] >= LOSS_RATIO_TARGET,
        },
        "jobs": {n: _job_report(spec, j) for n, j in jobs.items()},
        "errors": dict(errors or {}),
        "notes": notes,
    }
    if workdir:
        report["workdir"] = workdir
    return report


def _torchrun_loss(spec: BaselineSpec, jobs: dict[str, JobResult], walls: dict[str, float | None],
                   normal_step: float | None) -> dict[str, Any]:
    """The torchrun way's lost time. A job's wall runs from the last rank's first commit of step 1 to
    the last commit of step ``steps`` (the start-up before step 1 is left out, a restart's is in).
    ``steady_overhead_s`` = its failure-free wall minus the plain one (checkpoint saves);
    ``failure_s`` = its wall with the kill minus without; ``total_lost_s`` = with the kill minus
    plain. These differences of separately measured walls carry the run-to-run noise of whole jobs;
    the event view is less noisy: ``back_at_kill_step_s`` = kill -> every rank has committed step
    ``kill_at + 1`` (after redoing the steps since the checkpoint), ``event_lost_s`` = that minus one
    normal step. ``restart_phases_s``: after the kill, the last new worker to have started, imported
    torch, built the model, initialised the group (rendezvous) and loaded the checkpoint."""
    kill = jobs.get("torchrun-kill")
    saves = jobs["torchrun"].saves_s if "torchrun" in jobs else []
    back = None
    if kill is not None and kill.t_kill is not None:
        at = job_commit_times(kill.last).get(spec.kill_at + 1)
        back = None if at is None else at - kill.t_kill
    return {
        "steady_overhead_s": _r(_sub(walls.get("torchrun"), walls.get("plain"))),
        "checkpoint_saves": {"count": len(saves), "total_s": round(sum(saves), 4),
                             "median_s": _r(percentile(saves, 50)) if saves else None},
        "failure_s": _r(_sub(walls.get("torchrun-kill"), walls.get("torchrun"))),
        "total_lost_s": _r(_sub(walls.get("torchrun-kill"), walls.get("plain"))),
        "back_at_kill_step_s": _r(back), "normal_step_s": _r(normal_step),
        "event_lost_s": _r(_sub(back, normal_step)),
        "resumed_from_step": None if kill is None else kill.resumed_from,
        "redone_steps": None if kill is None or kill.resumed_from is None else spec.kill_at - kill.resumed_from,
        "restart_phases_s": {} if kill is None else dict(kill.restart_s),
    }


def _gossiprec_loss(jobs: dict[str, JobResult], walls: dict[str, float | None]) -> dict[str, Any]:
    """gossiprec's lost time, as :func:`_torchrun_loss` (its steady overhead: snapshots and reports);
    back at the kill step is the recovery bench's RTO."""
    trial = jobs["gossiprec-kill"].trial if "gossiprec-kill" in jobs else None
    return {
        "steady_overhead_s": _r(_sub(walls.get("gossiprec"), walls.get("plain"))),
        "failure_s": _r(_sub(walls.get("gossiprec-kill"), walls.get("gossiprec"))),
        "total_lost_s": _r(_sub(walls.get("gossiprec-kill"), walls.get("plain"))),
        "back_at_kill_step_s": None if trial is None else trial.rto_s,
        "normal_step_s": None if trial is None else trial.normal_step_s,
        "event_lost_s": None if trial is None else trial.rto_minus_step_s,
        "lost_steps": None if trial is None else trial.lost_steps,
        "phases_s": {} if trial is None else dict(trial.phases_s),
        "replicas_identical": None if trial is None else trial.replicas_identical,
    }


# --------------------------------------------------------------------------------------------------
# CLI


def _cmd_baseline(args: argparse.Namespace) -> int:
    if getattr(args, "baseline_cmd", "run") == "worker":
        return worker_main(args)
    try:
        spec = BaselineSpec(ranks=args.ranks, steps=args.steps, step_ms=args.step_ms, state_mb=args.state_mb,
                            hidden=args.hidden, checkpoint_every=args.checkpoint_every, kill_at=args.kill_at,
                            rounds=args.rounds, overhead_only=args.overhead_only,
                            pg_timeout=args.pg_timeout, job_timeout=args.job_timeout,
                            agent_log_level=args.agent_log_level, workdir=args.workdir, keep=args.keep)
    except ConfigError as exc:
        print(f"gossiprec bench baseline: error: {exc}", file=sys.stderr)
        return 2
    progress = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    report = run_bench(spec, progress)
    print(json.dumps(report, indent=None if args.json else 2))
    return 1 if report["errors"] else 0


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("baseline_cmd", nargs="?", choices=("run", "worker"), default="run", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=2, help="trainer ranks (default 2; gossiprec adds 1 spare)")
    p.add_argument("--steps", type=int, default=200, help="steps of every job (default 200)")
    p.add_argument("--step-ms", dest="step_ms", type=float, default=100.0,
                   help="minimum step time, ms: pacing before the all-reduce (default 100)")
    p.add_argument("--state-mb", dest="state_mb", type=float, default=1.0,
                   help="state size lower bound, MB = 10**6 bytes (default 1)")
    p.add_argument("--hidden", type=int, default=None, help="MLP width (overrides --state-mb)")
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=40,
                   help="the torchrun way's checkpoint interval, steps (default 40)")
    p.add_argument("--kill-at", dest="kill_at", type=int, default=60,
                   help="SIGKILL the last rank after this many steps (default 60)")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of the plain/gossiprec pair for the overhead, alternating their order (2)")
    p.add_argument("--overhead-only", dest="overhead_only", action="store_true",
                   help="run only the plain/gossiprec pairs (the overhead figures), not the lost-time jobs")
    p.add_argument("--pg-timeout", dest="pg_timeout", type=float, default=30.0,
                   help="group and collective timeout of the trainers, s (30)")
    p.add_argument("--job-timeout", dest="job_timeout", type=float, default=None,
                   help="bound on one job, s (default 120 + 4 x the paced training time)")
    p.add_argument("--agent-log-level", dest="agent_log_level", default="warning",
                   choices=("debug", "info", "warning", "error"), help="agents' log level (logs in the workdir)")
    p.add_argument("--workdir", default=None, help="keep every job's logs and outputs here")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--json", action="store_true", help="compact JSON (one line)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    # the worker's own options (``python -m gossiprec.bench.baseline worker``, under torchrun)
    p.add_argument("--layers", type=int, default=LAYERS, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", dest="out_dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-every", dest="ckpt_every", type=int, default=0, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_baseline)


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``baseline`` to the ``bench`` sub-commands (sets ``func``)."""
    p = subparsers.add_parser(
        "baseline", help="overhead without failures vs a plain loop; lost time vs the torchrun way",
        description="Run the same job plain (torchrun), with gossiprec, with torchrun-style checkpoints, and "
                    "with a SIGKILL both ways (torchrun restarts all workers from the checkpoint; gossiprec "
                    "recovers in place); report step-time overhead and lost time as one JSON object.")
    _add_arguments(p)
    return p  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gossiprec bench baseline")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
