"""``gossiprec bench recovery``: time in-place recovery of a real job (RTO, phases, transfer vs TCP).

Theory of operation
-------------------
Each trial is a fresh local job (:class:`~gossiprec.harness.job.LocalJob`: one ``gossiprec run`` per
member, ``ranks`` trainers and one hot spare). The trainers (:func:`trainer_main`) train the harness
workload's MLP (:func:`gossiprec.harness.workload.build`), its width chosen so that the state
(parameters + both AdamW moments, about 12 bytes per parameter) is at least ``--state-mb`` MB (10**6
bytes). A step is: local gradients, then pacing (sleep until ``step_ms`` has passed since the step
began: it stands in for a longer forward/backward, so it sits *before* the all-reduce and the first
step after a recovery pays it too), an all-reduce (``avg``; ``--exact``: rank-ordered, ``world_size``
times the bytes), the optimizer step and the commit.

When every rank has committed ``kill_at`` steps, the bench SIGKILLs the last rank's trainer
(``--victim`` chooses another) and stamps ``t_kill`` on the clock the trainers stamp their records
with. The survivors and the spare train ``post_steps`` more and exit. Per trial the report gives the
phases of :func:`gossiprec.harness.timeline.timeline` in seconds after the kill, ``rto_s`` (kill ->
every rank has committed its first step after the recovery), ``normal_step_s`` (the median
commit-to-commit interval before the kill, after ``WARMUP``, pooled over the survivors),
``rto_minus_step_s`` (what :data:`RTO_TARGET_S` bounds), ``replicas_identical`` (every survivor ended
with the same state hash) and ``loadavg_1m`` at the kill (how much other work shared the CPUs). Each
trainer also times every step from ``begin_step()`` returned to ``commit()`` returned, in wall and process
CPU time (every thread: the snapshot copier and the replicas' digest too): ``step_s`` / ``step_cpu_s``
(median of the normal steps), ``first_step_s`` / ``first_step_cpu_s`` and ``second_step_*`` (the steps
after the recovery, median over the recovered ranks) and ``first_step_over_step_s`` /
``first_step_over_step_cpu_s`` (and ``second_step_over_*``): what those steps cost beyond a normal one
(on shared CPUs the CPU times are the steadier figures). A
phase that comes out negative (a failure event before the kill, e.g. a starved member suspected
during start-up, is the earliest one a record holds) is reported as None with a note.

Throughput: ``transfer_mb_s`` is the receivers' bytes over their fetch time (connect to last byte
authenticated, donor-side sealing included); ``tcp_mb_s`` is plain loopback TCP
(:func:`gossiprec.bench.transfer.loopback_tcp_baseline`, no authentication) moving as many bytes,
``TCP_REPEATS`` times after each trial, when the job's trainers are gone: the baseline has the CPUs
to itself while the recovery shares them with the job, so the ratio is conservative. Each trial's
``transfer_vs_tcp`` is its ``transfer_mb_s`` over the median of its own ``tcp_mb_s``; the report's
``transfer_vs_tcp`` is the ratio of the medians over the trials, ``transfer_vs_tcp_per_trial`` the
spread of the trials' own ratios.

``--scale 4,8,16`` runs the trials (a small model by default) for each size and reports the ratio of
the largest size's median RTO to the smallest's (``ratio_16_over_4``, bounded by
:data:`SCALE_TARGET`). Everything runs on this machine's CPUs: with more processes than cores, pick
``--step-ms`` large enough that the ranks are not starved, or the figures measure the scheduler. The
report is one JSON object on stdout, progress goes to stderr; a failed trial keeps its working
directory (every agent's and trainer's log; ``--agent-log-level info`` logs every agent event).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from gossiprec.bench.agents import percentile
from gossiprec.errors import ConfigError, GossiprecError
from gossiprec.harness.job import LocalJob, read_int
from gossiprec.harness.timeline import PHASES, timeline
from gossiprec.harness.workload import DIM, LAYERS, state_params

WARMUP = 2
"""Commits at the start of a run whose intervals are not "normal" steps (first all-reduce, caches)."""
TCP_REPEATS = 3
"""Loopback TCP baseline measurements after each trial."""
RTO_TARGET_S = 0.3
"""The target: median RTO <= this + one normal step."""
TRANSFER_TARGET = 0.9
"""The target: transfer throughput >= this fraction of plain loopback TCP."""
SCALE_TARGET = 1.5
"""The target: RTO at the largest size <= this times the RTO at the smallest."""


class RecoveryBenchError(GossiprecError):
    """A benchmark job could not be started, did not reach the kill, or did not finish."""


# --------------------------------------------------------------------------------------------------
# sizing and statistics (pure)


def hidden_for_state(nbytes: int, layers: int = LAYERS, dim: int = DIM) -> int:
    """The smallest width whose params + two AdamW moments (12 bytes/param) reach ``nbytes``."""
    if nbytes <= 0:
        raise ConfigError(f"state size must be positive, got {nbytes} bytes")
    h = 1
    if layers > 1:  # solve (layers-1) h^2 + (2 dim + layers) h + dim = nbytes / 12, then adjust
        a, b, c = layers - 1, 2 * dim + layers, dim - nbytes / 12
        h = max(1, int((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)))
    else:
        h = max(1, int((nbytes / 12 - dim) // (2 * dim + 1)))
    while h > 1 and 12 * state_params(h - 1, layers, dim) >= nbytes:
        h -= 1
    while 12 * state_params(h, layers, dim) < nbytes:
        h += 1
    return h


def stats(values: Sequence[float | None], nd: int = 4) -> dict[str, float] | None:
    """``{median, p90, min, max, n}`` of the values that are not None (None when there are none)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return {"median": round(percentile(xs, 50), nd), "p90": round(percentile(xs, 90), nd),
            "min": round(min(xs), nd), "max": round(max(xs), nd), "n": len(xs)}


def normal_step_s(commits: Sequence[Sequence[float]], t_kill: float, warmup: int = WARMUP) -> float | None:
    """Median interval between consecutive commits ``(step, t)`` before ``t_kill``, after ``warmup``."""
    gaps: list[float] = []
    for (s0, t0), (s1, t1) in zip(commits, commits[1:]):
        if s0 >= warmup and s1 == s0 + 1 and t1 < t_kill:
            gaps.append(t1 - t0)
    return percentile(gaps, 50) if gaps else None


Times = list[tuple[float, float]]


def step_times(outs: Sequence[dict[str, Any]], t_kill: float, warmup: int = WARMUP) -> tuple[Times, Times, Times]:
    """``(wall, cpu)`` of each rank's first and second steps after the recovery, and of its normal steps
    (after ``warmup``, committed before ``t_kill``), from the trainers' ``steps`` (begin_step() returned to
    commit() returned; cpu: the process's CPU time, every thread)."""
    first: Times = []
    second: Times = []
    normal: Times = []
    for o in outs:
        after = 0
        for (step, wall, cpu, new_epoch), (_, t) in zip(o.get("steps", ()), o["commits"], strict=False):
            if t >= t_kill and (after == 1 or new_epoch and after == 0):
                (first if after == 0 else second).append((wall, cpu))
                after += 1
            elif t < t_kill and step > warmup and not new_epoch:
                normal.append((wall, cpu))
    return first, second, normal


# --------------------------------------------------------------------------------------------------
# the trainer (one rank or the spare, under ``gossiprec run``)


def trainer_main(args: argparse.Namespace) -> int:
    """Train the harness workload to ``args.steps``, paced, and write what the bench reads: ``.pid``
    once the model is built, ``.step`` after every commit and, at the end, the report (recovery
    records, commit times, busy times, the final state's SHA-256 and size)."""
    import torch

    from gossiprec.harness.workload import build, local_gradients, objects_of, state_digest
    from gossiprec.trainer.config import TrainerConfig
    from gossiprec.trainer.loop import ResilientTrainer

    torch.set_num_threads(1)
    out = Path(args.out)
    model, opt, cursor = build(args.hidden, args.layers)
    records: list[dict[str, Any]] = []
    rt = ResilientTrainer(objects_of(model, opt, cursor), TrainerConfig(timeout=args.timeout),
                          on_recovered=lambda r: records.append(r.to_dict()))
    out.with_suffix(".pid").write_text(str(os.getpid()))  # the model is built: a warm spare from here
    rt.start()
    progress = out.with_suffix(".step")
    commits: list[tuple[int, float]] = []
    busy: list[float] = []
    steps: list[tuple[int, float, float, bool]] = []
    epoch = 0  # a spare's first commit is in a later epoch: it counts as a first step after a recovery
    pace = args.step_ms / 1000.0
    while rt.step < args.steps:
        rt.begin_step()
        t0, c0 = time.monotonic(), time.process_time()
        local_gradients(model, cursor, rt.rank)
        left = pace - (time.monotonic() - t0)
        if left > 0:
            time.sleep(left)  # stands in for a longer forward/backward: before the collective
        slept = max(0.0, left)
        if not rt.allreduce_gradients(model.parameters(), exact=args.exact):
            continue
        opt.step()
        cursor.index += 1
        rt.commit()
        t1, c1 = time.monotonic(), time.process_time()
        commits.append((rt.step, t1))
        busy.append(t1 - t0 - slept)
        steps.append((rt.step, t1 - t0, c1 - c0, rt.epoch != epoch))  # a new epoch's first commit: after a recovery
        epoch = rt.epoch
        progress.write_text(str(rt.step))
    sha256, nbytes = state_digest(objects_of(model, opt, cursor), rt.step)
    out.write_text(json.dumps({"node": rt.node, "rank": rt.rank, "step": rt.step, "records": records,
                               "commits": commits, "busy_s": busy, "steps": steps, "state_sha256": sha256,
                               "state_bytes": nbytes}))
    rt.finish()
    os._exit(0)  # a graveyard may hold a hung group whose destructor would block


# --------------------------------------------------------------------------------------------------
# the orchestrator


@dataclass(frozen=True, slots=True)
class RecoverySpec:
    """One configuration to benchmark. Seconds for times, MB = 10**6 bytes."""

    ranks: int = 2
    spares: int = 1
    state_mb: float = 100.0
    """Lower bound on the state (params + AdamW moments); sets the MLP width unless ``hidden``."""
    hidden: int | None = None
    """MLP width (overrides ``state_mb``)."""
    trials: int = 3
    step_ms: float = 50.0
    """Each step takes at least this long (pacing before the all-reduce)."""
    kill_at: int = 10
    """Kill once every rank has committed this many steps."""
    post_steps: int = 4
    """Steps trained after the kill."""
    exact: bool = False
    victim: int | None = None
    """Rank to kill (default: the last)."""
    trial_timeout: float = 180.0
    """Bound on one trial (start-up, training to the kill, recovery, the rest), seconds."""
    pg_timeout: float = 30.0
    """The trainers' group and collective timeout, seconds."""
    agent_log_level: str = "warning"
    """``--log-level`` of every ``gossiprec run`` (``info`` logs each agent event, for diagnosis)."""
    workdir: str | None = None
    keep: bool = False

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ConfigError(f"--ranks must be at least 2 (a survivor must donate the state), got {self.ranks}")
        if self.spares != 1:
            raise ConfigError(f"--spares must be 1 (the bench starts one hot spare), got {self.spares}")
        if self.trials < 1:
            raise ConfigError(f"--trials must be at least 1, got {self.trials}")
        if not self.state_mb > 0 or (self.hidden is not None and self.hidden < 1):
            raise ConfigError("--state-mb and --hidden must be positive")
        if self.kill_at < WARMUP + 2 or self.post_steps < 1:
            raise ConfigError(f"--kill-at must be at least {WARMUP + 2} (normal steps are measured before "
                              f"the kill) and post_steps at least 1, got {self.kill_at}, {self.post_steps}")
        if self.step_ms < 0:
            raise ConfigError(f"--step-ms must not be negative, got {self.step_ms}")
        if self.victim is not None and not 0 <= self.victim < self.ranks:
            raise ConfigError(f"--victim must be a rank in 0..{self.ranks - 1}, got {self.victim}")

    @property
    def width(self) -> int:
        return self.hidden if self.hidden is not None else hidden_for_state(int(self.state_mb * 1e6))


@dataclass(slots=True)
class TrialResult:
    index: int
    victim: str = ""
    rto_s: float | None = None
    normal_step_s: float | None = None
    rto_minus_step_s: float | None = None
    step_compute_s: float | None = None
    """Median busy time of a step (everything but the pacing sleep), before the kill."""
    step_s: float | None = None
    """Median wall time of a normal step, begin_step() returned to commit() returned (before the kill)."""
    step_cpu_s: float | None = None
    """The process CPU time (all threads) of those steps, median."""
    first_step_s: float | None = None
    """Median over the recovered ranks of the same wall time for their first step after the recovery."""
    first_step_cpu_s: float | None = None
    first_step_over_step_s: float | None = None
    """``first_step_s - step_s``: what the first step after a recovery costs beyond a normal one."""
    first_step_over_step_cpu_s: float | None = None
    second_step_s: float | None = None
    """The same for the second step after the recovery (where the replicas' comparison runs)."""
    second_step_cpu_s: float | None = None
    second_step_over_step_s: float | None = None
    second_step_over_step_cpu_s: float | None = None
    phases_s: dict[str, float | None] = field(default_factory=dict)
    lost_steps: int | None = None
    transfer_bytes: int = 0
    transfer_mb_s: float | None = None
    tcp_mb_s: list[float] = field(default_factory=list)
    transfer_vs_tcp: float | None = None
    """``transfer_mb_s`` over the median of this trial's ``tcp_mb_s``."""
    replicas_identical: bool | None = None
    final_step: list[int] = field(default_factory=list)
    roles: dict[str, str] = field(default_factory=dict)
    state_bytes: int = 0
    startup_s: float | None = None
    loadavg_1m: float | None = None
    """The machine's 1-minute load average at the kill (other work on the machine skews the figures)."""
    per_rank: list[dict[str, Any]] = field(default_factory=list)
    """Each recovered rank's own timeline (seconds after the kill) and role, for finding the slow one."""
    notes: list[str] = field(default_factory=list)
    error: str | None = None


def trainer_argv(out: Path, steps: int, hidden: int, step_ms: float, timeout: float,
                 exact: bool = False) -> list[str]:
    """The command line of :func:`trainer_main` writing its report to ``out``."""
    return [sys.executable, "-m", "gossiprec.bench.recovery", "trainer", "--steps", str(steps),
            "--hidden", str(hidden), "--layers", str(LAYERS), "--step-ms", str(step_ms),
            "--timeout", str(timeout), *(["--exact"] if exact else []), "--out", str(out)]


def run_trial(spec: RecoverySpec, index: int, tmp: Path, say: Callable[[str], None]) -> TrialResult:
    """One fresh job: start, train to ``kill_at``, SIGKILL the victim, wait for the end, collect."""
    from gossiprec.bench.transfer import loopback_tcp_baseline

    ranks = spec.ranks
    victim = ranks - 1 if spec.victim is None else spec.victim
    steps = spec.kill_at + spec.post_steps
    with LocalJob(tmp, ranks, spec.spares) as job:
        names = job.names
        res = TrialResult(index, victim=names[victim])
        t_start = time.monotonic()
        deadline = t_start + spec.trial_timeout
        for name in names:
            job.spawn(name, trainer_argv(job.path(name, ".json"), steps, spec.width, spec.step_ms,
                                         spec.pg_timeout, spec.exact), agent_log_level=spec.agent_log_level)
        procs = list(job.procs.values())
        started = False
        while True:
            if not started and all(job.pid(n) > 0 for n in names) and \
                    min(read_int(job.path(n, ".step")) for n in job.trainers) >= 1:
                started = True
                res.startup_s = round(time.monotonic() - t_start, 2)
                say(f"trial {index}: {ranks} ranks + {spec.spares} spare training after {res.startup_s} s")
            if min(read_int(job.path(n, ".step")) for n in job.trainers) >= spec.kill_at:
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RecoveryBenchError(f"trial {index}: the job did not reach step {spec.kill_at}; "
                                         f"see the logs in {tmp}")
            time.sleep(0.005)
        # stamped before the signal: the exit bell makes the victim's agent leave within microseconds,
        # often before a loaded orchestrator would run again after os.kill
        t_kill = time.monotonic()
        pid = job.signal(names[victim], signal.SIGKILL)
        res.loadavg_1m = round(os.getloadavg()[0], 2)
        say(f"trial {index}: SIGKILL trainer of {names[victim]} (rank {victim}, pid {pid})")
        for i, p in enumerate(procs):
            if i != victim:
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired as exc:
                    raise RecoveryBenchError(f"trial {index}: {names[i]} did not finish within the trial "
                                             f"timeout ({spec.trial_timeout:.0f} s); see {tmp}") from exc
        bad = {n: p.returncode for i, (n, p) in enumerate(zip(names, procs)) if i != victim and p.returncode}
        if bad:
            raise RecoveryBenchError(f"trial {index}: trainers failed with exit codes {bad}; see {tmp}")
        outs = [json.loads(job.path(n, ".json").read_text()) for i, n in enumerate(names) if i != victim]
        _collect(res, outs, t_kill)
        res.tcp_mb_s = [round(loopback_tcp_baseline(res.state_bytes), 1) for _ in range(TCP_REPEATS)]
        res.transfer_vs_tcp = trial_ratio(res.transfer_mb_s, res.tcp_mb_s)
        return res


def trial_ratio(transfer_mb_s: float | None, tcp_mb_s: Sequence[float]) -> float | None:
    """One trial's transfer throughput over the median of its plain-TCP measurements (None without both)."""
    if not transfer_mb_s or not tcp_mb_s:
        return None
    tcp = percentile(list(tcp_mb_s), 50)
    return round(transfer_mb_s / tcp, 3) if tcp > 0 else None


def _collect(res: TrialResult, outs: Sequence[dict[str, Any]], t_kill: float) -> None:
    tl = timeline(t_kill, [r for o in outs for r in o["records"]])
    res.rto_s = tl["rto_s"]
    res.phases_s = dict(tl["phases_s"])
    for phase, value in tl["phases_s"].items():
        if value is not None and value < 0:  # an older failure event (the kill is stamped before it is sent)
            res.phases_s[phase] = None
            res.notes.append(f"{phase} was {value} s: a failure event before the kill masks the real one")
    res.lost_steps = tl["lost_steps"]
    res.transfer_mb_s = tl["transfer_mb_s"]
    res.transfer_bytes = int(tl.get("transfer_bytes") or 0)
    res.roles = {str(k): v for k, v in (tl.get("roles") or {}).items()}
    res.state_bytes = int(outs[0]["state_bytes"])
    res.per_rank = [{"rank": r["rank"], "role": r["role"], "transfer_s": round(r["transfer_s"], 4),
                     **{k.removesuffix("_at"): round(r[k] - t_kill, 4)
                        for k in ("planned_at", "state_at", "group_at", "first_step_at")}}
                    for o in outs for r in o["records"][:1]]
    res.final_step = sorted({int(o["step"]) for o in outs})
    res.replicas_identical = len({o["state_sha256"] for o in outs}) == 1
    gaps = [g for g in (normal_step_s(o["commits"], t_kill) for o in outs) if g is not None]
    res.normal_step_s = round(percentile(gaps, 50), 4) if gaps else None
    pre = [b for o in outs for (s, t), b in zip(o["commits"], o["busy_s"]) if s > WARMUP and t < t_kill]
    res.step_compute_s = round(percentile(pre, 50), 4) if pre else None
    if res.rto_s is not None and res.normal_step_s is not None:
        res.rto_minus_step_s = round(res.rto_s - res.normal_step_s, 4)
    first, second, normal = step_times(outs, t_kill)
    for i, name in ((0, ""), (1, "_cpu")):
        b = round(percentile([n[i] for n in normal], 50), 4) if normal else None
        setattr(res, f"step{name}_s", b)
        for which, times in (("first", first), ("second", second)):
            a = round(percentile([f[i] for f in times], 50), 4) if times else None
            setattr(res, f"{which}_step{name}_s", a)
            if a is not None and b is not None:
                setattr(res, f"{which}_step_over_step{name}_s", round(a - b, 4))


def run_config(spec: RecoverySpec, say: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Run ``spec.trials`` trials of one configuration; returns the JSON-ready report."""
    root = Path(spec.workdir) if spec.workdir else Path(tempfile.mkdtemp(prefix="grr", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    results: list[TrialResult] = []
    failed = False
    say(f"recovery bench: load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus; {spec.ranks} ranks + "
        f"{spec.spares} spare, hidden {spec.width} "
        f"(~{12 * state_params(spec.width) / 1e6:.1f} MB of state), {spec.trials} trial(s), "
        f"step {spec.step_ms} ms, workdir {root}")
    try:
        for i in range(spec.trials):
            try:
                r = run_trial(spec, i, root / f"trial{i}", say)
            except (GossiprecError, OSError, ValueError, KeyError) as exc:
                failed = True
                r = TrialResult(i, error=f"{type(exc).__name__}: {exc}")
            results.append(r)
            say(f"trial {i}: {json.dumps({k: v for k, v in asdict(r).items() if k != 'roles'})}")
    finally:
        kept = bool(spec.keep or spec.workdir or failed)
        if not kept:
            shutil.rmtree(root, ignore_errors=True)
    return summarize(spec, results, str(root) if kept else None)


def summarize(spec: RecoverySpec, results: Sequence[TrialResult], workdir: str | None = None) -> dict[str, Any]:
    """The report of one configuration from its trials (pure)."""
    ok = [r for r in results if r.error is None]
    phase_names = list(dict.fromkeys([*PHASES, *(p for r in ok for p in r.phases_s)])) if ok else []
    rto = stats([r.rto_s for r in ok])
    step = stats([r.normal_step_s for r in ok])
    over = stats([r.rto_minus_step_s for r in ok])
    xfer = stats([r.transfer_mb_s for r in ok], 1)
    tcp = stats([v for r in ok for v in r.tcp_mb_s], 1)
    ratio = round(xfer["median"] / tcp["median"], 3) if xfer and tcp and tcp["median"] > 0 else None
    state_bytes = ok[0].state_bytes if ok else 0
    report: dict[str, Any] = {
        "bench": "recovery", "ranks": spec.ranks, "spares": spec.spares, "trials": spec.trials,
        "cpu_count": os.cpu_count(), "loadavg_1m_end": round(os.getloadavg()[0], 2),
        "state_mb_requested": spec.state_mb, "hidden": spec.width,
        "layers": LAYERS, "state_bytes": state_bytes, "step_ms": spec.step_ms, "exact": spec.exact,
        "kill_at": spec.kill_at, "post_steps": spec.post_steps,
        "rto_s": rto,
        "normal_step_s": step,
        "rto_minus_step_s": over,
        "step_compute_s": stats([r.step_compute_s for r in ok]),
        **{k: stats([getattr(r, k) for r in ok]) for k in (
            "step_s", "first_step_s", "first_step_over_step_s", "second_step_s", "second_step_over_step_s",
            "step_cpu_s", "first_step_cpu_s", "first_step_over_step_cpu_s", "second_step_cpu_s",
            "second_step_over_step_cpu_s")},
        "phases_s": {p: stats([r.phases_s.get(p) for r in ok]) for p in phase_names},
        "transfer_mb_s": xfer,
        "tcp_mb_s": tcp,
        "transfer_vs_tcp": ratio,
        "transfer_vs_tcp_per_trial": stats([r.transfer_vs_tcp for r in ok], 3),
        "lost_steps_max": max((r.lost_steps or 0 for r in ok), default=None),
        "replicas_identical": all(r.replicas_identical for r in ok) if ok else None,
        "failed_trials": len(results) - len(ok),
        "targets": {
            "state_ge_100mb": state_bytes >= 100e6,
            f"rto_median_le_{RTO_TARGET_S}s_plus_step": (over["median"] <= RTO_TARGET_S) if over else None,
            f"transfer_ge_{int(TRANSFER_TARGET * 100)}pct_tcp": (ratio >= TRANSFER_TARGET) if ratio else None,
        },
        "per_trial": [asdict(r) for r in results],
    }
    if workdir:
        report["workdir"] = workdir
    return report


def run_scale(spec: RecoverySpec, sizes: Sequence[int], say: Callable[[str], None] = lambda m: None
              ) -> dict[str, Any]:
    """The same trials at each number of ranks in ``sizes``; RTO and phases per size, and the ratio."""
    per: dict[str, Any] = {}
    for n in sizes:
        per[str(n)] = run_config(replace(spec, ranks=n, workdir=None if spec.workdir is None
                                         else str(Path(spec.workdir) / f"ranks{n}")), say)
    med: dict[int, Any] = {n: (per[str(n)]["rto_s"] or {}).get("median") for n in sizes}
    lo, hi = min(sizes), max(sizes)
    ratio = round(med[hi] / med[lo], 3) if med.get(hi) and med.get(lo) else None
    report: dict[str, Any] = {
        "bench": "recovery-scale", "sizes": list(sizes), "cpu_count": os.cpu_count(),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
        "hidden": spec.width, "step_ms": spec.step_ms, "trials": spec.trials,
        "rto_median_s": {str(n): med[n] for n in sizes},
        "phases_median_s": {str(n): {p: (v or {}).get("median") for p, v in per[str(n)]["phases_s"].items()}
                            for n in sizes},
        f"ratio_{hi}_over_{lo}": ratio,
        "targets": {f"rto_{hi}_le_{SCALE_TARGET}x_{lo}": (ratio <= SCALE_TARGET) if ratio else None},
        "per_size": per,
    }
    return report


# --------------------------------------------------------------------------------------------------
# CLI


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--scale takes comma-separated rank counts, got {text!r}") from exc
    if len(sizes) < 2 or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"--scale needs at least two sizes, each >= 2, got {text!r}")
    return sorted(set(sizes))


def _cmd_recovery(args: argparse.Namespace) -> int:
    if getattr(args, "recovery_cmd", "run") == "trainer":
        return trainer_main(args)
    scale: list[int] | None = args.scale
    state_mb = args.state_mb if args.state_mb is not None else (1.0 if scale else 100.0)
    step_ms = args.step_ms if args.step_ms is not None else (200.0 if scale else 50.0)
    try:
        spec = RecoverySpec(ranks=scale[0] if scale else args.ranks, spares=args.spares, state_mb=state_mb,
                            hidden=args.hidden, trials=args.trials, step_ms=step_ms, kill_at=args.kill_at,
                            post_steps=args.post_steps, exact=args.exact, victim=args.victim,
                            trial_timeout=args.trial_timeout, agent_log_level=args.agent_log_level,
                            workdir=args.workdir, keep=args.keep)
    except ConfigError as exc:
        print(f"gossiprec bench recovery: error: {exc}", file=sys.stderr)
        return 2
    progress = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    report = run_scale(spec, scale, progress) if scale else run_config(spec, progress)
    print(json.dumps(report, indent=None if args.json else 2))
    failed = report.get("failed_trials") if not scale else sum(
        r["failed_trials"] for r in report["per_size"].values())
    return 1 if failed else 0


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recovery_cmd", nargs="?", choices=("run", "trainer"), default="run", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=2, help="trainer ranks (default 2)")
    p.add_argument("--spares", type=int, default=1, help="hot spares (1)")
    p.add_argument("--state-mb", dest="state_mb", type=float, default=None,
                   help="state size lower bound, MB = 10**6 bytes (default 100; 1 with --scale)")
    p.add_argument("--hidden", type=int, default=None, help="MLP width (overrides --state-mb)")
    p.add_argument("--trials", type=int, default=3, help="kills to time, each in a fresh job (default 3)")
    p.add_argument("--step-ms", dest="step_ms", type=float, default=None,
                   help="minimum step time, ms (default 50; 200 with --scale)")
    p.add_argument("--kill-at", dest="kill_at", type=int, default=10, help="kill after this many steps (10)")
    p.add_argument("--post-steps", dest="post_steps", type=int, default=4, help="steps after the kill (4)")
    p.add_argument("--exact", action="store_true", help="rank-ordered all-reduce (world_size x the bytes)")
    p.add_argument("--victim", type=int, default=None, help="rank to kill (default: the last)")
    p.add_argument("--scale", type=_sizes, default=None, metavar="R1,R2,...",
                   help="run each rank count (e.g. 4,8,16; small model) and report the ratio")
    p.add_argument("--trial-timeout", dest="trial_timeout", type=float, default=180.0,
                   help="bound on one trial, seconds (180)")
    p.add_argument("--agent-log-level", dest="agent_log_level", default="warning",
                   choices=("debug", "info", "warning", "error"), help="agents' log level (logs in the workdir)")
    p.add_argument("--workdir", default=None, help="keep job specs, logs and outputs here")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--json", action="store_true", help="compact JSON (one line)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    # the trainer's own options (``python -m gossiprec.bench.recovery trainer``)
    p.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=LAYERS, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_recovery)


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``recovery`` to the ``bench`` sub-commands (sets ``func``)."""
    p = subparsers.add_parser(
        "recovery", help="time in-place recovery of a real job: RTO, phases, transfer vs TCP, scale",
        description="Start a job of N trainer ranks + 1 hot spare on loopback, SIGKILL a rank, and time "
                    "kill -> every rank committed its first step after recovery, per phase; one fresh job "
                    "per trial. Prints one JSON report on stdout.")
    _add_arguments(p)
    return p  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gossiprec bench recovery")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
