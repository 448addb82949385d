"""``gossiprec bench ddp`` on a small model: every loop runs on two gloo ranks, the report has every
figure, and all loops end with the same parameters bit for bit (figures: the benchmark's own output)."""

from __future__ import annotations

import pytest

from gossiprec.bench.ddp import LOOPS, run
from gossiprec.errors import ConfigError


@pytest.mark.slow
def test_small_ddp_bench_reports_every_loop_and_the_same_final_state() -> None:
    report = run(mb=2.0, layers=2, batch=8, steps=2, warmup=1, rounds=1, copies=1, timeout=300.0)
    assert set(report["loops"]) == set(LOOPS) and report["same_final_state"] is True, report
    for name, row in report["loops"].items():
        assert 0 < row["p10_s"] <= row["median_s"] <= row["p90_s"], row
        assert (row["overhead_pct"] is None) == (name == "plain"), row
    for name in ("flat", "buckets"):
        assert report["loops"][name]["host_copies_of_state"] == pytest.approx(1.0, abs=0.01)


def test_unknown_loops_are_refused() -> None:
    with pytest.raises(ConfigError, match="loops"):
        run(loops=("plain", "nope"))
