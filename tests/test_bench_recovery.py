"""``gossiprec bench recovery``: one real kill trial (tiny state, 2 ranks + 1 spare) yields a report with
sane values; and the pure pieces (sizing, step time, summary, targets, argument checks)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from gossiprec.bench.recovery import (
    RecoverySpec, TrialResult, _sizes, hidden_for_state, normal_step_s, stats, step_times, summarize,
    trial_ratio,
)
from gossiprec.errors import ConfigError
from gossiprec.harness.timeline import PHASES
from gossiprec.harness.workload import state_params


@pytest.mark.slow
def test_one_kill_trial_reports_sane_values() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GOSSIPREC_")}
    out = subprocess.run(
        [sys.executable, "-m", "gossiprec.bench.recovery", "--ranks", "2", "--hidden", "16", "--trials", "1",
         "--step-ms", "30", "--kill-at", "5", "--post-steps", "2", "--trial-timeout", "90", "--json",
         "--agent-log-level", "info"],  # a failed trial keeps its logs: with every agent event in them
        capture_output=True, text=True, timeout=150, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert "SIGKILL trainer of n1" in out.stderr  # progress goes to stderr, the report alone to stdout
    assert report["bench"] == "recovery" and report["ranks"] == 2 and report["spares"] == 1
    assert report["failed_trials"] == 0 and report["cpu_count"] == os.cpu_count()
    t = report["per_trial"][0]
    assert t["error"] is None and t["victim"] == "n1"
    # the spare (n2) received exactly the state and took the dead rank; nothing committed was lost
    assert t["roles"] == {"0": "donor", "1": "receiver"}
    assert t["transfer_bytes"] == t["state_bytes"] == report["state_bytes"] > 0
    assert t["lost_steps"] == 0 and t["final_step"] == [7] and t["replicas_identical"] is True
    # the phases happen in order, all after the kill, and the RTO is the last one
    assert set(t["phases_s"]) == set(PHASES)
    # every figure is there and positive: the kill is stamped before it is sent, so the detection (the
    # victim's agent leaves within microseconds, on its trainer's exit bell) can never precede it
    assert all(v is not None and v > 0 for v in t["phases_s"].values()), t["phases_s"]
    assert t["notes"] == [], t["notes"]
    ordered = [t["phases_s"][p] for p in PHASES[2:]]  # agreed .. first_step_done
    assert ordered == sorted(ordered)
    # detection precedes agreement; a survivor notices when its main thread next touches the group (a
    # collective fails, or the next step begins), which may be before or after the agreement (a
    # starved survivor notices late), but always before it recovers
    assert t["phases_s"]["detected"] <= t["phases_s"]["agreed"]
    assert t["phases_s"]["noticed_by_trainers"] <= t["phases_s"]["group_rebuilt"]
    assert t["rto_s"] == t["phases_s"]["first_step_done"]
    # a normal step is paced to >= 30 ms; the RTO includes one step after the group is rebuilt
    assert t["normal_step_s"] >= 0.03
    assert t["rto_minus_step_s"] == pytest.approx(t["rto_s"] - t["normal_step_s"], abs=1e-3)
    assert len(t["tcp_mb_s"]) == 3 and min(t["tcp_mb_s"]) > 0  # latency-bound at a few kB
    assert t["transfer_mb_s"] > 0
    assert t["transfer_vs_tcp"] == pytest.approx(t["transfer_mb_s"] / sorted(t["tcp_mb_s"])[1], abs=1e-3)
    assert report["transfer_vs_tcp"] == pytest.approx(report["transfer_mb_s"]["median"]
                                                      / report["tcp_mb_s"]["median"], abs=1e-3)
    assert report["targets"]["state_ge_100mb"] is False  # 16-wide MLP: a few kB


def test_hidden_for_state_is_the_smallest_width_that_fits() -> None:
    for layers in (1, 2, 3):
        for nbytes in (1, 10_000, 1_000_000, 100_000_000):
            h = hidden_for_state(nbytes, layers)
            assert 12 * state_params(h, layers) >= nbytes
            assert h == 1 or 12 * state_params(h - 1, layers) < nbytes
    # ~100 MB = params + two AdamW moments: ~8.3 M float32 parameters
    assert 8.3e6 < state_params(hidden_for_state(100_000_000)) < 8.35e6
    with pytest.raises(ConfigError):
        hidden_for_state(0)


def test_state_params_matches_the_demo_model() -> None:
    torch = pytest.importorskip("torch")
    del torch
    from gossiprec.harness.workload import build

    for hidden, layers in ((16, 2), (40, 3), (7, 1)):
        model, _, _ = build(hidden, layers)
        assert sum(p.numel() for p in model.parameters()) == state_params(hidden, layers)


def test_normal_step_skips_warmup_and_the_kill() -> None:
    commits = [(1, 0.0), (2, 1.0), (3, 1.1), (4, 1.3), (5, 1.4), (6, 9.0), (7, 9.1)]
    # intervals from step 2 on, ending before t_kill = 2.0: 0.1, 0.2, 0.1 -> median 0.1
    assert normal_step_s(commits, t_kill=2.0) == pytest.approx(0.1)
    # a gap across a rollback (step numbers not consecutive) is not a step
    assert normal_step_s([(3, 0.0), (3, 5.0), (4, 5.2)], t_kill=10.0) == pytest.approx(0.2)
    assert normal_step_s(commits[:2], t_kill=2.0) is None


def test_step_times_take_the_first_and_second_steps_after_the_recovery() -> None:
    # (step, wall, cpu, first commit of a new epoch) per commit, and the commit times; the kill at t = 5
    survivor = {"steps": [(1, 9.0, 9.0, False), (2, 9.0, 9.0, False), (3, 0.1, 0.05, False), (4, 0.2, 0.07, False),
                          (5, 0.3, 0.2, True), (6, 0.15, 0.1, False), (7, 0.1, 0.06, False)],
                "commits": [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 6.0), (6, 7.0), (7, 8.0)]}
    spare = {"steps": [(5, 0.4, 0.3, True), (6, 0.2, 0.12, False)], "commits": [(5, 6.1), (6, 7.1)]}
    first, second, normal = step_times([survivor, spare], t_kill=5.0)
    assert first == [(0.3, 0.2), (0.4, 0.3)] and second == [(0.15, 0.1), (0.2, 0.12)]
    assert normal == [(0.1, 0.05), (0.2, 0.07)]  # after the warm-up, before the kill


def _trial(i: int, rto: float, step: float, xfer: float, tcp: list[float]) -> TrialResult:
    return TrialResult(i, victim="n1", rto_s=rto, normal_step_s=step, rto_minus_step_s=rto - step,
                       phases_s={p: rto * (k + 1) / len(PHASES) for k, p in enumerate(PHASES)},
                       lost_steps=0, transfer_bytes=120_000_000, transfer_mb_s=xfer, tcp_mb_s=tcp,
                       replicas_identical=True, state_bytes=120_000_000)


def test_summary_and_targets() -> None:
    spec = RecoverySpec(ranks=2, hidden=8, trials=4)
    ok = [_trial(0, 0.5, 0.3, 900.0, [1000.0]), _trial(1, 0.7, 0.3, 800.0, [1000.0]),
          _trial(2, 0.9, 0.3, 700.0, [1000.0])]
    rep = summarize(spec, [*ok, TrialResult(3, error="RecoveryBenchError: boom")])
    assert rep["failed_trials"] == 1 and len(rep["per_trial"]) == 4
    assert rep["rto_s"]["median"] == 0.7 and rep["rto_s"]["n"] == 3
    assert rep["rto_minus_step_s"]["median"] == pytest.approx(0.4)
    assert rep["transfer_vs_tcp"] == 0.8
    assert rep["transfer_vs_tcp_per_trial"] is None  # (the trials here carry no ratio of their own)
    assert rep["phases_s"]["first_step_done"]["median"] == 0.7
    assert rep["targets"] == {"state_ge_100mb": True, "rto_median_le_0.3s_plus_step": False,
                              "transfer_ge_90pct_tcp": False}
    fast = summarize(spec, [_trial(0, 0.4, 0.3, 950.0, [1000.0])])
    assert fast["targets"]["rto_median_le_0.3s_plus_step"] is True
    assert fast["targets"]["transfer_ge_90pct_tcp"] is True
    none = summarize(spec, [TrialResult(0, error="x")])
    assert none["rto_s"] is None and none["targets"]["transfer_ge_90pct_tcp"] is None
    assert trial_ratio(900.0, [1000.0, 800.0, 1200.0]) == 0.9  # over the trial's own median TCP
    assert trial_ratio(None, [1000.0]) is None and trial_ratio(900.0, []) is None
    ratios = [replace(t, transfer_vs_tcp=trial_ratio(t.transfer_mb_s, t.tcp_mb_s)) for t in ok]
    assert summarize(spec, ratios)["transfer_vs_tcp_per_trial"] == {"median": 0.8, "p90": 0.88, "min": 0.7,
                                                                    "max": 0.9, "n": 3}
    assert stats([None, 2.0, 1.0, 3.0]) == {"median": 2.0, "p90": 2.8, "min": 1.0, "max": 3.0, "n": 3}


def test_spec_and_argument_checks() -> None:
    assert RecoverySpec(hidden=None, state_mb=1.0).width == hidden_for_state(1_000_000)
    assert RecoverySpec(hidden=5).width == 5
    for bad in ({"ranks": 1}, {"spares": 2}, {"trials": 0}, {"kill_at": 2}, {"victim": 2}, {"state_mb": 0},
                {"post_steps": 0}):
        with pytest.raises(ConfigError):
            RecoverySpec(**bad)  # type: ignore[arg-type]
    assert _sizes("16,4,8") == [4, 8, 16]
    for bad_text in ("4", "4,x", "1,4"):
        with pytest.raises(argparse.ArgumentTypeError):
            _sizes(bad_text)
