"""``gossiprec bench baseline``: one tiny real run of the five jobs yields a report with sane values; and
the pure pieces (job step times, wall times, bootstrap interval, summary, targets, argument checks) and
the torchrun-style checkpoint round trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gossiprec.bench.baseline import (
    JOBS, BaselineSpec, JobResult, job_commit_times, job_names, job_step_times, kind_of, main, overhead_ci,
    series_stats, summarize, wall_s,
)
from gossiprec.bench.recovery import WARMUP, TrialResult
from gossiprec.errors import ConfigError


@pytest.mark.long  # a benchmark smoke run
@pytest.mark.slow
def test_tiny_run_reports_sane_values() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOSSIPREC_", "TORCHELASTIC_"))}
    steps, step_ms, every, kill_at = 12, 30, 4, 6
    out = subprocess.run(
        [sys.executable, "-m", "gossiprec.bench.baseline", "--steps", str(steps), "--step-ms", str(step_ms),
         "--hidden", "16", "--checkpoint-every", str(every), "--kill-at", str(kill_at), "--rounds", "1",
         "--json"],
        capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert "SIGKILL worker of rank 1" in out.stderr and "SIGKILL trainer of n1" in out.stderr
    assert r["bench"] == "baseline" and r["errors"] == {} and set(r["jobs"]) == set(JOBS)
    assert r["cpu_count"] == os.cpu_count() and r["hidden"] == 16 and r["state_bytes"] > 0
    # every job trained the same thing: plain, checkpointed, restarted from the checkpoint, recovered
    assert r["final_states_identical"] is True
    step = step_ms / 1000
    for name, job in r["jobs"].items():
        assert job["wall_s"] >= (steps - 1) * step * 0.95, name  # paced: no job can be faster
        # start-up is sampled by polling step files: a fast job can finish its first step between polls
        assert job["startup_s"] is None or job["startup_s"] > 0, name
        assert len(job["state_sha256"]) == 1, name
    # overhead: both series are the job's paced steps after the warm-up
    ov = r["overhead"]
    for key in ("plain_step_s", "gossiprec_step_s"):
        s = ov[key]
        assert s["n"] == steps - WARMUP and step * 0.95 <= s["p10"] <= s["median"] <= s["p90"] < 5
    lo, hi = ov["overhead_ci95_pct"]
    assert lo <= hi and ov["within_noise"] == (lo <= 0 <= hi)
    assert ov["overhead_pct"] == pytest.approx(
        100 * (ov["gossiprec_step_s"]["median"] / ov["plain_step_s"]["median"] - 1), abs=0.5)
    # the torchrun way: rank 0 saved at 4, 8, 12; the restart resumed from 4 and redid 5 and 6
    tr, go = r["lost_time"]["torchrun"], r["lost_time"]["gossiprec"]
    assert tr["checkpoint_saves"]["count"] == steps // every and tr["checkpoint_saves"]["total_s"] > 0
    assert r["checkpoint_bytes"] > r["state_bytes"] * 0.9
    assert tr["resumed_from_step"] == 4 and tr["redone_steps"] == 2
    phases = [tr["restart_phases_s"][k] for k in ("workers_started", "torch_imported", "model_built",
                                                  "group_initialised", "checkpoint_loaded")]
    assert 0 < phases[0] and phases == sorted(phases) and phases[-1] < tr["back_at_kill_step_s"]
    assert tr["event_lost_s"] == pytest.approx(tr["back_at_kill_step_s"] - tr["normal_step_s"], abs=1e-3)
    assert r["jobs"]["torchrun-kill"]["wall_s"] > r["jobs"]["torchrun"]["wall_s"] + phases[0]
    # gossiprec: in place, nothing committed lost, and far less time lost than a full restart
    assert go["lost_steps"] == 0 and go["replicas_identical"] is True
    assert 0 < go["back_at_kill_step_s"] < 30 and go["event_lost_s"] < tr["event_lost_s"]
    assert r["lost_time"]["ratio_event"] == pytest.approx(tr["event_lost_s"] / go["event_lost_s"], rel=0.02)
    assert tr["total_lost_s"] == pytest.approx(tr["steady_overhead_s"] + tr["failure_s"], abs=1e-3)
    assert go["total_lost_s"] == pytest.approx(go["steady_overhead_s"] + go["failure_s"], abs=1e-3)


def test_job_times_take_the_last_rank_and_the_redone_step() -> None:
    r0 = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5)]
    r1 = [(1, 1.1), (2, 2.2), (3, 3.0), (4, 4.0)]
    assert job_commit_times([r0, r1]) == {1: 1.1, 2: 2.2, 3: 3.0, 4: 4.5}
    assert job_step_times([r0, r1], warmup=2) == pytest.approx([0.8, 1.5])  # 2->3, 3->4
    assert job_step_times([r0, r1], warmup=1) == pytest.approx([1.1, 0.8, 1.5])
    # a restart: attempt 0 reached step 3, attempt 1 resumed from 2 and redid 3 later
    first = [[(1, 1.0)], [(1, 1.2)]]
    last = [[(3, 9.0), (4, 10.0)], [(3, 9.1), (4, 10.3)]]
    assert wall_s(first, last, steps=4) == pytest.approx(10.3 - 1.2)
    assert wall_s(first, last, steps=5) is None and wall_s([], last, steps=4) is None
    assert job_commit_times([[(3, 3.0)], [(3, 9.0)]])[3] == 9.0  # a step done again counts when redone


def test_series_stats_and_bootstrap_interval() -> None:
    assert series_stats([]) is None
    s = series_stats([float(x) for x in range(1, 11)])
    assert s == {"median": 5.5, "p10": 1.9, "p90": 9.1, "mean": 5.5, "n": 10}
    base = [0.100 + 0.001 * (i % 7) for i in range(200)]
    lo, hi = overhead_ci(base, list(base))  # type: ignore[misc]
    assert lo <= 0.0 <= hi and hi - lo < 0.05
    lo, hi = overhead_ci(base, [x * 1.05 for x in base])  # type: ignore[misc]
    assert 0.02 < lo <= 0.05 <= hi < 0.08  # a clear 5 % shift excludes 0
    assert overhead_ci([], base) is None
    assert overhead_ci(base, base, seed=3) == overhead_ci(base, base, seed=3)  # reproducible


def _series(t0: float, steps: int, dt: float, start: int = 1) -> list[tuple[int, float]]:
    return [(s, t0 + (s - start) * dt) for s in range(start, steps + 1)]


def _jobs(spec: BaselineSpec, gr_dt: float, gr_kill_extra: float) -> dict[str, JobResult]:
    n = spec.steps
    plain = _series(0.0, n, 0.1)
    gr = _series(0.0, n, gr_dt)
    ckpt = _series(0.0, n, 0.101)
    trial = TrialResult(0, victim="n1", rto_s=0.4, normal_step_s=0.1, rto_minus_step_s=0.3, lost_steps=0,
                        replicas_identical=True)
    killed = [(s, t + (gr_kill_extra if s > spec.kill_at else 0.0)) for s, t in gr]
    tk = JobResult("torchrun-kill", first=[[(1, 0.0)]], last=[_series(20.0, n, 0.1, start=41)],
                   t_kill=6.0, resumed_from=40, saves_s=[0.01] * 2,
                   restart_s={"workers_started": 1.0, "torch_imported": 2.5, "model_built": 2.6,
                              "group_initialised": 3.0, "checkpoint_loaded": 3.1})
    # attempt 1 commits step 61 (kill_at + 1) at 20.0 + 20 * 0.1 = 22.0: 16.0 s after the kill
    return {"plain": JobResult("plain", first=[plain], last=[plain], sha256=["a"]),
            "gossiprec": JobResult("gossiprec", first=[gr], last=[gr], sha256=["a"], state_bytes=1000),
            "torchrun": JobResult("torchrun", first=[ckpt], last=[ckpt], saves_s=[0.02] * 5, sha256=["a"],
                                  state_bytes=1200),
            "torchrun-kill": tk,
            "gossiprec-kill": JobResult("gossiprec-kill", first=[killed], last=[killed], trial=trial,
                                        sha256=["a"])}


def test_summary_lost_time_and_targets() -> None:
    spec = BaselineSpec(steps=200, kill_at=60, checkpoint_every=40, hidden=8, rounds=1)
    jobs = _jobs(spec, gr_dt=0.1005, gr_kill_extra=0.3)
    jobs["torchrun-kill"].sha256 = ["a"]
    r = summarize(spec, jobs)
    ov = r["overhead"]
    assert ov["overhead_pct"] == pytest.approx(0.5, abs=1e-3)
    assert ov["overhead_ms"] == pytest.approx(0.5, abs=1e-3)
    assert ov["within_noise"] is False and ov["plain_step_s"]["n"] == spec.steps - WARMUP
    tr, go = r["lost_time"]["torchrun"], r["lost_time"]["gossiprec"]
    assert tr["steady_overhead_s"] == pytest.approx(199 * 0.001)
    assert tr["back_at_kill_step_s"] == pytest.approx(16.0)
    assert tr["event_lost_s"] == pytest.approx(16.0 - 0.101, abs=1e-4)
    assert tr["normal_step_s"] == pytest.approx(0.101) and tr["redone_steps"] == 20
    assert tr["checkpoint_saves"] == {"count": 5, "total_s": 0.1, "median_s": 0.02}
    assert tr["total_lost_s"] == pytest.approx(20.0 + 159 * 0.1 - 19.9)
    assert go["failure_s"] == pytest.approx(0.3) and go["event_lost_s"] == 0.3
    assert go["total_lost_s"] == pytest.approx(0.3 + 199 * 0.0005)
    assert r["lost_time"]["ratio_event"] == 53.0
    assert r["targets"] == {"overhead_le_1pct": True, "lost_ratio_total_ge_10x": True,
                            "lost_ratio_event_ge_10x": True}
    assert r["final_states_identical"] is True and r["state_bytes"] == 1000 and r["checkpoint_bytes"] == 1200
    assert r["notes"] == [] and r["errors"] == {}
    # a slower gossiprec misses the overhead target; a different final state is flagged
    slow = _jobs(spec, gr_dt=0.102, gr_kill_extra=0.3)
    slow["plain"].sha256 = ["b"]
    r2 = summarize(spec, slow)
    assert r2["targets"]["overhead_le_1pct"] is False and r2["final_states_identical"] is False


def test_summary_with_missing_jobs_and_a_loss_inside_the_noise() -> None:
    spec = BaselineSpec(steps=200, kill_at=60, hidden=8, rounds=1)
    jobs = _jobs(spec, gr_dt=0.1, gr_kill_extra=0.0)
    jobs["gossiprec-kill"].last = jobs["gossiprec-kill"].first = [_series(0.0, 200, 0.0999)]  # faster than plain
    r = summarize(spec, jobs)
    assert r["lost_time"]["gossiprec"]["total_lost_s"] <= 0 and r["lost_time"]["ratio_total"] is None
    assert r["targets"]["lost_ratio_total_ge_10x"] is None
    assert [n.split(" ")[0] for n in r["notes"]] == ["gossiprec.failure_s", "gossiprec.total_lost_s"]
    del jobs["torchrun-kill"], jobs["gossiprec"]
    r = summarize(spec, jobs, {"gossiprec": "BaselineBenchError: boom"}, workdir="/tmp/x")
    assert r["overhead"]["overhead_pct"] is None and r["targets"]["overhead_le_1pct"] is None
    assert r["lost_time"]["torchrun"]["event_lost_s"] is None and r["lost_time"]["ratio_event"] is None
    assert r["errors"] == {"gossiprec": "BaselineBenchError: boom"} and r["workdir"] == "/tmp/x"


def test_rounds_alternate_and_pool() -> None:
    assert job_names(1) == list(JOBS)
    assert job_names(3) == ["plain", "gossiprec", "gossiprec.1", "plain.1", "plain.2", "gossiprec.2",
                            *JOBS[2:]]
    assert {kind_of(n) for n in job_names(4)} == set(JOBS)
    assert job_names(2, overhead_only=True) == ["plain", "gossiprec", "gossiprec.1", "plain.1"]
    spec = BaselineSpec(steps=200, kill_at=60, hidden=8, rounds=2)
    jobs = _jobs(spec, gr_dt=0.1005, gr_kill_extra=0.3)
    # a second round under more load: both slower by the same amount; the walls' median and the pooled
    # step times keep the overhead near 0.5 %
    slower = _series(0.0, 200, 0.1015)
    jobs["plain.1"] = JobResult("plain.1", first=[slower], last=[slower], sha256=["a"])
    slower_gr = _series(0.0, 200, 0.1015 * 1.005)
    jobs["gossiprec.1"] = JobResult("gossiprec.1", first=[slower_gr], last=[slower_gr], sha256=["a"])
    r = summarize(spec, jobs)
    assert r["rounds"] == 2 and r["overhead"]["plain_step_s"]["n"] == 2 * (200 - WARMUP)
    assert 0.3 < r["overhead"]["overhead_pct"] < 0.7
    assert r["overhead"]["wall_overhead_pct"] == pytest.approx(0.5, abs=0.01)
    assert set(r["jobs"]) == set(jobs)


def test_spec_and_argument_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert BaselineSpec(hidden=5).width == 5
    assert BaselineSpec(steps=100, step_ms=50).timeout == pytest.approx(120 + 4 * 5)
    for bad in ({"ranks": 1}, {"state_mb": 0}, {"hidden": 0}, {"step_ms": -1}, {"checkpoint_every": 0},
                {"kill_at": 3}, {"kill_at": 200}, {"steps": 7, "kill_at": 5}, {"rounds": 0}):
        with pytest.raises(ConfigError):
            BaselineSpec(**bad)  # type: ignore[arg-type]
    assert main(["--kill-at", "1"]) == 2
    assert "--kill-at must be in" in capsys.readouterr().err


def test_torch_checkpoint_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    from gossiprec.bench.baseline import load_torch_checkpoint, save_torch_checkpoint, state_sha256
    from gossiprec.harness.workload import build, local_gradients

    model, opt, cursor = build(8)
    for _ in range(3):
        local_gradients(model, cursor, 0)
        opt.step()
        cursor.index += 1
    path = tmp_path / "ckpt.pt"
    save_torch_checkpoint(path, model, opt, cursor, 3)
    assert path.exists() and not path.with_name("ckpt.pt.tmp").exists()
    model2, opt2, cursor2 = build(8)
    torch.manual_seed(99)  # the checkpoint's RNG state must come back too
    assert state_sha256(model2, opt2, cursor2, 3) != state_sha256(model, opt, cursor, 3)
    assert load_torch_checkpoint(path, model2, opt2, cursor2) == 3
    assert cursor2.index == 3
    assert state_sha256(model2, opt2, cursor2, 3) == state_sha256(model, opt, cursor, 3)
