"""Stragglers in synchronous training: the core check (pure) and live jobs of the harness.

The check (:mod:`gossiprec.core.stragglers`) compares each rank's wait inside its collectives with its
peers': the rank the others wait for waits least. Unit tests feed it samples as the hang check would
(one per step moved on); the live tests slow one rank of a 4-rank job with a ``lag`` fault (a sleep in
its step) and read its agents' warnings.
"""

from __future__ import annotations

import random
import re
import statistics
from pathlib import Path

import pytest

from gossiprec.core.config import AgreementConfig
from gossiprec.core.stragglers import StragglerCheck, Verdict, behind_of

RANKS = ("n0", "n1", "n2", "n3")
STEP_MS = 100


def _cfg(**overrides: object) -> AgreementConfig:
    """The defaults without the warm-up (tests of the rule from the first sample on)."""
    return AgreementConfig(**{"straggler_warmup_steps": 0, **overrides})  # type: ignore[arg-type]


def _feed(check: StragglerCheck, waits_of_step: list[dict[str, int]], subjects: tuple[str, ...] = RANKS,
          step_ms: int = STEP_MS) -> list[tuple[int, Verdict]]:
    """One sample per step: each step's waits (ms) for every rank. Returns (sample index, verdict)."""
    out = []
    for i, waits in enumerate(waits_of_step):
        ranks = {n: (i, step_ms, w) for n, w in waits.items()}
        out += [(i, v) for v in check.judge(ranks, subjects)]
    return out


def _rolling(series: list[dict[str, float]], window: int = 8) -> list[dict[str, int]]:
    """What the trainers report: each rank's mean wait over its last ``window`` steps."""
    out = []
    for i in range(len(series)):
        part = series[max(0, i - window + 1):i + 1]
        out.append({n: int(statistics.mean(s[n] for s in part)) for n in series[0]})
    return out


def _job(steps: int, slow: str | None, lag_ms: float, rng: random.Random, jitter_ms: float,
         from_step: int = 0) -> list[dict[str, float]]:
    """Per-step waits of a synchronous job: every rank computes ~STEP_MS with jitter, ``slow`` ``lag_ms``
    more from ``from_step``; each waits for the last arrival (plus a little transfer time)."""
    series = []
    for i in range(steps):
        arrive = {n: rng.uniform(0, jitter_ms) + (lag_ms if n == slow and i >= from_step else 0.0)
                  for n in RANKS}
        last = max(arrive.values())
        series.append({n: last - a + rng.uniform(0, 1.0) for n, a in arrive.items()})
    return series


def test_behind_is_the_median_peer_wait_minus_its_own() -> None:
    assert behind_of({"a": 30, "b": 31, "c": 29, "d": 0}) == {"a": -1, "b": -2, "c": 1, "d": 30}
    assert behind_of({"a": 5}) == {"a": 0}


@pytest.mark.parametrize("seed", range(5))
def test_jitter_of_a_busy_machine_reports_nothing(seed: int) -> None:
    rng = random.Random(seed)
    # each rank's arrival jitters by up to 25 ms a step (a quarter of the step): ranks take turns being last
    verdicts = _feed(StragglerCheck(AgreementConfig()), _rolling(_job(500, None, 0.0, rng, 25.0)))
    assert verdicts == []


def test_a_single_slow_step_reports_nothing() -> None:
    rng = random.Random(7)
    series = _job(200, None, 0.0, rng, 5.0)
    series[100] = {n: (60.0 if n != "n2" else 0.0) for n in RANKS}  # one 60 ms hiccup of n2
    assert _feed(StragglerCheck(AgreementConfig()), _rolling(series)) == []


@pytest.mark.parametrize("seed", range(3))
def test_a_rank_slowed_by_30_percent_is_reported_within_20_steps_with_its_magnitude(seed: int) -> None:
    rng = random.Random(seed)
    lag = 0.3 * STEP_MS
    verdicts = _feed(StragglerCheck(AgreementConfig()), _rolling(_job(200, "n3", lag, rng, 5.0, from_step=50)))
    assert [v.subject for _, v in verdicts] == ["n3"]  # once, and only the slow rank
    at, v = verdicts[0]
    assert v.kind == "report" and 50 <= at < 50 + 20, at
    assert abs(v.behind_ms - lag) <= 0.25 * lag, v


def test_an_episode_is_reported_once_and_again_after_it_ended() -> None:
    check = StragglerCheck(_cfg())
    slow = [{"n0": 30, "n1": 30, "n2": 30, "n3": 0}] * 10
    fine = [{n: 0 for n in RANKS}] * 5
    verdicts = _feed(check, slow + fine + slow)  # (one sample per step: reported once 6 steps are in)
    assert [(i, v.subject, v.kind) for i, v in verdicts] == [(6, "n3", "report"), (21, "n3", "report")]


def test_the_first_steps_of_a_view_are_not_judged() -> None:
    slow = [{"n0": 30, "n1": 30, "n2": 30, "n3": 0}] * 40
    got = _feed(StragglerCheck(AgreementConfig()), slow)
    assert [(i, v.kind) for i, v in got] == [(16 + 6, "report")]  # warm-up, then the 6-step span
    check = StragglerCheck(AgreementConfig())
    _feed(check, slow[:10])
    check.start_view()  # a recovery: the warm-up starts again
    assert _feed(check, slow[:20]) == []


def test_only_subjects_are_judged_and_a_step_counts_once() -> None:
    check = StragglerCheck(_cfg())
    waits = {"n0": (5, STEP_MS, 30), "n1": (5, STEP_MS, 30), "n2": (5, STEP_MS, 30), "n3": (5, STEP_MS, 0)}
    for _ in range(10):  # the same step's figures again and again: one sample
        assert check.judge(waits, ("n3",)) == []
    assert check.judge({n: (s + 1, ms, w) for n, (s, ms, w) in waits.items()}, ("n0", "n1")) == []


def test_thresholds_come_from_the_config() -> None:
    loose = _cfg(straggler_floor_ms=50)
    slow = [{"n0": 30, "n1": 30, "n2": 30, "n3": 0}] * 20
    assert _feed(StragglerCheck(loose), slow) == []  # 30 ms is below a 50 ms floor
    assert _feed(StragglerCheck(_cfg(straggler_ratio=0.5)), slow) == []  # below half a 100 ms step
    assert [i for i, _ in _feed(StragglerCheck(_cfg(straggler_samples=12)), slow)] == [11]
    assert [i for i, _ in _feed(StragglerCheck(_cfg(straggler_steps=4)), slow)] == [4]


def test_eviction_needs_the_option_and_its_threshold_and_is_retracted() -> None:
    slow = [{"n0": 30, "n1": 30, "n2": 30, "n3": 0}] * 20
    assert [v.kind for _, v in _feed(StragglerCheck(_cfg()), slow)] == ["report"]
    evicting = _cfg(evict_stragglers=True)
    got = _feed(StragglerCheck(evicting), slow + [{n: 0 for n in RANKS}])
    assert [(i, v.kind) for i, v in got] == [(6, "report"), (15, "evict"), (20, "retract")]
    # 20 ms of a 100 ms step: reported, below the 25% eviction threshold
    mild = [{"n0": 20, "n1": 20, "n2": 20, "n3": 0}] * 20
    assert [v.kind for _, v in _feed(StragglerCheck(evicting), mild)] == ["report"]



def test_metrics_count_reports_and_show_waits_and_magnitudes_by_rank() -> None:
    pytest.importorskip("prometheus_client")
    from gossiprec.agent.metrics import AgentMetrics
    from gossiprec.core.events import Straggler

    class Status:
        def control_status(self) -> dict[str, object]:
            members = [{"node": n, "role": "trainer", "rank": i} for i, n in enumerate(RANKS)]
            return {"node": "n1", "view": {"epoch": 0, "members": members}, "wait_ms": 31,
                    "behind": {"n0": -1, "n3": 29}}

    m = AgentMetrics(Status())
    m.observe(Straggler("n3", 29, 34, 5.0))
    v = m.registry.get_sample_value
    assert v("gossiprec_straggler_reports_total") == 1
    assert v("gossiprec_collective_wait_ms", {"rank": "1"}) == 31
    assert v("gossiprec_straggler_behind_ms", {"rank": "3"}) == 29
    assert v("gossiprec_straggler_behind_ms", {"rank": "0"}) == -1


def test_members_shows_how_long_the_others_wait_for_each_rank() -> None:
    from gossiprec.agent.ops import format_members, member_rows

    status = {"view": {"epoch": 0, "members": [{"node": n, "role": "trainer", "rank": i}
                                                for i, n in enumerate(RANKS)]}}
    members = [{"name": n, "addr": f"h:{i}", "status": "alive", "step": 40, "step_ms": 130,
                "behind_ms": 29 if n == "n3" else -1, "self": n == "n0"} for i, n in enumerate(RANKS)]
    lines = format_members(member_rows(status, members)).splitlines()
    assert lines[0].split()[-1] == "Behind"
    assert lines[4].split()[0] == "n3" and lines[4].split()[-2:] == ["29", "ms"]
    assert lines[2].split()[-2:] == ["0", "ms"]



def test_a_lag_fault_sleeps_at_its_phase_of_every_step_from_its_step_on(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from gossiprec.harness import faults
    from gossiprec.harness.faults import Fault, FaultInjector

    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    hook = FaultInjector([Fault("", "lag", 5, "compute")], tmp_path / "f", lag_s=0.03,
                         send=lambda pid, sig: pytest.fail("a lag is no signal"))
    for step in range(1, 9):
        hook(step, "compute")
        hook(step, "communicate")
    assert slept == [0.03] * 4  # steps 5, 6, 7, 8; at compute only
    assert not (tmp_path / "f").exists()  # a stall, not recorded as the fault


# --- live jobs (the harness: 4 ranks, each step a fixed 100 ms of "compute" plus the model's) -----------
LIVE_STEP_MS = 100.0
LAG_MS = 30.0  # 30% of the step
LAG_FROM = 20
REPORT = re.compile(r"event Straggler .*\bnode=(\S+) behind_ms=(-?\d+) step=(\d+)")


def _reports(workdir: Path) -> list[tuple[str, str, int, int]]:
    """(reporting node, straggler, magnitude ms, its step then) from every agent's warnings."""
    out = []
    for log in sorted(workdir.glob("n*.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = REPORT.search(line)
            if m:
                out.append((log.stem, m.group(1), int(m.group(2)), int(m.group(3))))
    return out


def _lagging_job(workdir: Path, steps: int, spares: int = 0, protocol: dict[str, str] | None = None,
                 lag: bool = True) -> dict[str, object]:
    from gossiprec.harness.faults import Fault
    from gossiprec.harness.scenario import run_scenario

    faults = [Fault("n3", "lag", LAG_FROM, "compute")] if lag else []
    return run_scenario(4, spares, steps, faults, step_ms=LIVE_STEP_MS, workdir=str(workdir), timeout=300.0,
                        trainer_args=["--pace", "compute", "--lag-ms", str(LAG_MS)], protocol=protocol or {},
                        may_fail=("n3",) if spares else ())


def test_a_rank_slowed_by_30_percent_is_reported_by_its_observers_and_no_other(tmp_path: Path) -> None:
    res = _lagging_job(tmp_path, 60)
    assert res["bit_identical"], res
    reports = _reports(tmp_path)
    assert reports, "no straggler reported"
    assert {who for _, who, _, _ in reports} == {"n3"}, reports  # only the slow rank
    assert len({by for by, _, _, _ in reports}) == len(reports), reports  # once per observer
    for _, _, behind, step in reports:
        assert step - LAG_FROM <= 20, reports  # within 20 steps of the lag's start
        assert abs(behind - LAG_MS) <= 0.25 * LAG_MS, reports  # its magnitude


@pytest.mark.long
def test_an_unslowed_job_reports_no_straggler_over_500_steps(tmp_path: Path) -> None:
    from gossiprec.harness.scenario import run_scenario

    # the ordinary pacing (20 ms steps, waiting counts in the step): 4 ranks and 4 agents on 2 busy cores
    res = run_scenario(4, 0, 500, [], workdir=str(tmp_path), timeout=600.0)
    assert res["bit_identical"], res
    assert _reports(tmp_path) == []


@pytest.mark.long
def test_evict_stragglers_replaces_the_slow_rank_by_a_spare_bit_identical(tmp_path: Path) -> None:
    import json

    res = _lagging_job(tmp_path, 100, spares=1,
                       protocol={"evict_stragglers": "true", "straggler_evict_ratio": "0.15"})
    assert res["bit_identical"], res  # the final state is the failure-free run's, bit for bit
    assert {who for _, who, _, _ in _reports(tmp_path)} == {"n3"}
    spare = json.loads((tmp_path / "n4.json").read_text())
    assert spare["rank"] == 3 and spare["step"] == 100, spare  # the spare took the slow rank's place
    # it received the slow rank's state; later views (the removed node back as a spare) only resumed it
    roles = [r["role"] for r in spare["records"]]
    assert roles[0] == "receiver" and set(roles[1:]) <= {"survivor"}, spare["records"]
    assert not (tmp_path / "n3.json").exists()  # the slow rank did not finish the job
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("n[0-2].log"))
    assert "reason=straggler" in logs and "removed=['n3']" in logs
