"""``gossiprec bench commit`` on CPU (CI has no GPU): the three loops run, the report has every figure,
and the trainer's snapshots, copied inside commit() or in the background, hold the committed bytes."""

from __future__ import annotations

import pytest

from gossiprec.bench.commit import run
from gossiprec.errors import ConfigError


def test_cpu_commit_loops_report_and_snapshots_are_exact() -> None:
    report = run("cpu", 3_000_000, 64, steps=4, warmup=1, modes=["none", "inline", "deferred"])
    assert report["device"] == "cpu" and set(report["modes"]) == {"none", "inline", "deferred"}
    assert 2_000_000 < report["state_bytes"] < 4_000_000
    none = report["modes"]["none"]
    assert none["overhead_pct"] is None and none["snapshot_identical"] is None
    for mode in ("inline", "deferred"):
        row = report["modes"][mode]
        assert row["snapshot_identical"] is True
        assert 0 < row["p10_s"] <= row["median_s"] <= row["p90_s"]
        assert row["overhead_pct"] == pytest.approx(100 * (row["median_s"] / none["median_s"] - 1), abs=0.01)


def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="no CUDA device"):
        run("cuda", 1_000_000, 8, 2, 0, ["none"])


def test_host_memory_kept_is_two_one_or_almost_no_copies_of_the_state() -> None:
    report = run("cpu", 3_000_000, 64, steps=3, warmup=1, modes=["deferred", "single", "live"])
    rows = report["modes"]
    assert all(rows[m]["snapshot_identical"] is True for m in rows), rows
    assert rows["deferred"]["host_bytes_kept"] == 2 * rows["single"]["host_bytes_kept"]
    assert rows["single"]["host_copies_of_state"] == pytest.approx(1.0, abs=0.01)
    assert rows["live"]["host_copies_of_state"] < 0.01  # the RNG state only


def test_sizes_report_the_floor_of_one_copy_and_each_modes_added_cpu() -> None:
    from gossiprec.bench.commit import TARGETS, run_sizes

    report = run_sizes("cpu", [1.0, 2.0], 16, steps=3, warmup=1, modes=["none", "live", "single"], step_ms=5.0,
                       rounds=2)
    assert [s["state_mb"] for s in report["sizes"]] == [1.0, 2.0] and report["targets"] == TARGETS
    small, large = report["sizes"]
    assert large["state_bytes"] > small["state_bytes"] > 0
    for size in report["sizes"]:
        assert size["floor_copy_ms"] > 0 and size["floor_copy_cpu_ms"] > 0
        none = size["modes"]["none"]
        assert none["added_cpu_ms"] is None and none["own_cpu_ms"] is None and none["cpu_s"] > 0
        assert none["median_s"] >= 0.005  # padded to --step-ms at least
        for mode in ("live", "single"):
            row = size["modes"][mode]
            assert row["snapshot_identical"] is True
            assert row["added_cpu_ms"] == pytest.approx(1000 * (row["cpu_s"] - none["cpu_s"]), abs=0.002)
            assert 0 < row["own_cpu_ms"] < 1000 * row["cpu_s"]  # the commit's own share of the process's CPU
        single = size["modes"]["single"]
        assert size["met"] == {"single_cpu": single["own_cpu_ms"] <= size["floor_copy_cpu_ms"] + 0.5}


def test_own_cpu_counts_the_trainers_threads_and_no_other() -> None:
    import threading
    import time

    from gossiprec.bench.commit import _own_threads_cpu

    def spin() -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass

    before = _own_threads_cpu()
    go = threading.Event()
    ours = threading.Thread(target=lambda: (spin(), go.wait()), name="gossiprec-test")
    other = threading.Thread(target=lambda: (spin(), go.wait()), name="not-ours")
    ours.start()
    other.start()
    try:
        time.sleep(0.01)
        while ours.is_alive() and _own_threads_cpu().get(ours.ident or 0, 0.0) < 0.05:
            time.sleep(0.01)
        after = _own_threads_cpu()
    finally:
        go.set()
        ours.join()
        other.join()
    assert set(after) - set(before) == {ours.ident}
    assert after[ours.ident or 0] >= 0.05


def test_sizes_need_the_loop_without_gossiprec() -> None:
    from gossiprec.bench.commit import run_sizes

    with pytest.raises(ConfigError, match="must hold none"):
        run_sizes("cpu", [1.0], 8, 2, 0, ["live"])
