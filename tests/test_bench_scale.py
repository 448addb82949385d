"""``gossiprec bench scale`` at tiny sizes: the simulator row and a real-agent row (6 agents from seeds,
one SIGKILL) carry every column, measured where the kind measures it and null where it does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gossiprec.agent.cli import run_async
from gossiprec.bench import scale
from gossiprec.bench.agents import BenchSpec
from gossiprec.bench.seeded import run_seeded
from gossiprec.sim.costs import CryptoCosts

SIM_MEASURED = ("detect_p99_s", "agree_p50_s", "agree_p99_s", "plan_ready_p99_s", "cpu_per_agent_per_recovery_s",
                "bytes_per_agent_s", "bootstrap_s", "bytes_per_seed")
REAL_MEASURED = ("detect_p99_s", "agree_p50_s", "agree_p99_s", "cpu_per_agent_per_recovery_s", "bytes_per_agent_s",
                 "bootstrap_s", "bytes_per_seed", "idle_cpu_pct_per_agent", "rss_mb_per_agent")


def test_scale_rows_sim_and_real() -> None:
    report = scale.run([6], real_max=6, trials=1, idle_s=1.0, per_process=8, sim_duration=6.0,
                       costs=CryptoCosts.parse("40,140,3"), seed=1)
    assert report["sizes"] == [6] and len(report["load_avg_before"]) == 3
    sim, real = report["rows"]
    assert (sim["kind"], real["kind"]) == ("sim", "real")
    for row, measured in ((sim, SIM_MEASURED), (real, REAL_MEASURED)):
        assert row["nodes"] == 6
        assert set(scale.COLUMNS) <= set(row)
        missing = [k for k in measured if row[k] is None]
        assert not missing, (row["kind"], missing, row)
        assert row["agree_p99_s"] >= row["agree_p50_s"] > 0
        assert 0 < row["detect_p99_s"] <= row["agree_p99_s"]
        assert row["bootstrap_s"] >= 0 and row["bytes_per_seed"] > 0 and row["bytes_per_agent_s"] > 0
        assert row["disagreements"] == 0 and row["trials"] == 1
    # what a kind does not measure is null, not made up
    assert all(sim[k] is None for k in ("idle_cpu_pct_per_agent", "rss_mb_per_agent", "refused"))
    assert real["plan_ready_p99_s"] is None
    assert sim["plan_ready_p99_s"] >= sim["agree_p50_s"]
    assert real["refused"] == 0 and real["rss_mb_per_agent"] > 10
    assert real["detail"]["processes"] == 6 and real["detail"]["agents_per_process"] == 1
    assert real["agree_p99_s"] < 10


def test_scale_cli_sim_only_with_plot(tmp_path: Path) -> None:
    png = tmp_path / "scale.png"
    out = subprocess.run([sys.executable, "-m", "gossiprec", "bench", "scale", "--sizes", "5", "--real-max", "0",
                          "--sim-duration", "6", "--crypto-cost-us", "40,140,3", "--json", "--quiet",
                          "--plot", str(png)], capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout)
    assert [(r["kind"], r["nodes"]) for r in report["rows"]] == [("sim", 5)]
    assert report["crypto_cost"]["sign_us"] == 40
    assert png.stat().st_size > 1000


def test_seeded_agents_packed_two_per_process() -> None:
    """The seeds and the victim run alone, the 3 others share 2 processes (bench/agent_host.py); the
    shared processes' CPU and RSS are split between their agents."""
    spec = BenchSpec(nodes=7, trials=1, spares=1, idle_s=1.0, idle_warmup_s=1.0)
    report = run_async(run_seeded(spec, None, per_process=2))
    assert report["processes"] == 3 + 1 + 2 and report["idle"]["processes"] == 6
    # (late_subscriptions, an agent whose view 0 came before the bench subscribed, depends on timing)
    assert report["agents_per_process"] == 2 and 0 <= report["late_subscriptions"] <= 7
    (trial,) = report["per_trial"]
    assert trial["agreed"] and not trial["timed_out"] and trial["survivors"] == 6
    assert report["disagreements"] == 0 and report["bootstrap_s"] >= 0
    assert 5 < report["idle"]["rss_mb"]["mean"] < report["idle"]["rss_mb"]["max"]


@pytest.mark.parametrize("sizes", ["", "2,16", "x"])
def test_scale_rejects_bad_sizes(sizes: str) -> None:
    out = subprocess.run([sys.executable, "-m", "gossiprec", "bench", "scale", "--sizes", sizes, "--real-max", "0",
                          "--crypto-cost-us", "40,140"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--sizes" in out.stderr
