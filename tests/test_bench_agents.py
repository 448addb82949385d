"""``gossiprec bench agents`` on four real agent processes: both modes return the report's keys with
numbers that make sense; and the pieces it is built from (job spec, percentiles, spec validation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest

from gossiprec.bench.agents import BenchSpec, job_spec, percentile, run_bench, summary
from gossiprec.errors import ConfigError
from gossiprec.agent.cli import run_async
from gossiprec.agent.jobspec import view0_from_dict

TRIAL_KEYS = {"index", "victim", "new_view_s", "survivor_p50_s", "first_alert_s", "epoch", "agreed",
              "survivors", "fenced", "timed_out", "restore_s", "error", "alerts_s", "fast_ratio", "survivor_cpu_s",
              "window_s"}


def _check_trials(report: dict, nodes: int, trials: int) -> None:
    assert report["nodes"] == nodes and report["trials"] == trials
    assert set(report["new_view_s"]) == {"p50", "p99", "max"}
    assert 0 < report["new_view_s"]["p50"] <= report["new_view_s"]["p99"] <= report["new_view_s"]["max"] < 30
    assert report["timed_out"] == 0 and report["disagreements"] == 0
    assert len(report["per_trial"]) == trials
    for t in report["per_trial"]:
        assert set(t) == TRIAL_KEYS
        assert t["agreed"] and t["survivors"] == nodes - 1 and t["fenced"] == 0 and t["error"] is None
        assert t["epoch"] >= 1 and t["restore_s"] is not None
        assert 0 < t["survivor_p50_s"] <= t["new_view_s"]
        alerts = list(t["alerts_s"])
        assert alerts == sorted(alerts) and all(0 < a < t["new_view_s"] for a in alerts)
        assert t["first_alert_s"] == (alerts[0] if alerts else None)
        assert 0 <= t["fast_ratio"] <= 1
        assert t["window_s"] >= t["new_view_s"] and t["survivor_cpu_s"] >= 0


@pytest.mark.slow
def test_cli_exit_mode_with_idle_window() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GOSSIPREC_")}
    out = subprocess.run(
        [sys.executable, "-m", "gossiprec.bench.agents", "agents", "--nodes", "4", "--trials", "1",
         "--mode", "exit", "--idle", "1", "--idle-warmup", "0", "--json", "--quiet", "--trial-timeout", "20"],
        capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["mode"] == "exit" and report["secure"] is True
    _check_trials(report, 4, 1)
    # the victim announced its own departure: an alert follows within a fraction of a second
    assert report["per_trial"][0]["first_alert_s"] is not None
    assert report["per_trial"][0]["first_alert_s"] < 2.0
    idle = report["idle"]
    assert idle["agents"] == 4 and idle["seconds"] >= 1.0
    assert 0 <= idle["cpu_pct_of_core"]["mean"] <= idle["cpu_pct_of_core"]["max"]
    split = idle["cpu_user_pct"]["mean"] + idle["cpu_system_pct"]["mean"]  # user + system = the total
    assert split == pytest.approx(idle["cpu_pct_of_core"]["mean"], abs=0.01)
    assert 5 < idle["rss_mb"]["mean"] < 500
    assert idle["tx_datagrams_per_s"]["mean"] > 1  # agents probe each other several times a second
    assert idle["loopback_bytes_per_s_per_agent"] > 0


@pytest.mark.slow
def test_kill_mode_in_process() -> None:
    report = run_async(run_bench(BenchSpec(nodes=4, trials=1, mode="kill", settle_s=0.5, trial_timeout=20)))
    assert report["mode"] == "kill" and "idle" not in report
    _check_trials(report, 4, 1)
    # a silent death is found by probes: an observer alerts before the view changes
    t = report["per_trial"][0]
    assert t["first_alert_s"] is not None and t["first_alert_s"] <= t["new_view_s"]


def test_job_spec_is_a_valid_view0() -> None:
    text = job_spec([("a", 1001), ("b", 1002), ("c", 1003), ("d", 1004)], spares=1)
    view = view0_from_dict(tomllib.loads(text))
    assert [(m.node, m.role, m.rank) for m in view.members] == \
        [("a", "trainer", 0), ("b", "trainer", 1), ("c", "trainer", 2), ("d", "spare", None)]
    assert view.member("c") is not None and view.member("c").addr == "127.0.0.1:1003"


def test_percentiles() -> None:
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    assert summary([]) is None
    assert summary([0.2, 0.1, 0.4]) == {"p50": 0.2, "p99": pytest.approx(0.396), "max": 0.4}


@pytest.mark.parametrize("kw, msg", [
    ({"mode": "pause"}, "--mode"),
    ({"nodes": 2}, "at least 3"),
    ({"trials": 0, "idle_s": 0}, "nothing to do"),
    ({"nodes": 3, "spares": 1}, "no trainer outside"),
    ({"nodes": 4, "spares": 3}, "--spares"),
    ({"restore": "reboot"}, "--restore"),
])
def test_spec_validation(kw: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        BenchSpec(**kw)
