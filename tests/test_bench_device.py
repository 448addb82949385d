"""``gossiprec bench device-transfer`` on CPU (CI has no GPU): a small state moves from two donor processes,
striped, and arrives bit-identical; the report carries every figure the GPU run records."""

from __future__ import annotations

import pytest

from gossiprec.bench.device import run
from gossiprec.errors import ConfigError


def test_cpu_state_moves_between_processes_bit_identical() -> None:
    report = run("cpu", 20_000_000, [1, 2], 1)
    assert report["bit_identical"] is True
    assert report["device"] == "cpu" and report["pinned"] is False
    # about 20 MB: weights + two AdamW moments, plus the RNG entry
    assert 15_000_000 < report["state_bytes"] < 25_000_000
    assert [t["donors"] for t in report["transfer"]] == [1, 2]
    for t in report["transfer"]:
        assert len(t["seconds"]) == 1 and t["seconds"][0] > 0
        assert t["mb_s"] == pytest.approx(report["state_bytes"] / 1e6 / t["seconds"][0], rel=0.01)
    assert report["capture_s"] > 0 and report["apply_s"] >= 0 and report["tcp_mb_s"] > 0
    assert report["d2h_gb_s"] is None and report["h2d_gb_s"] is None


def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="no CUDA device"):
        run("cuda", 1_000_000, [1], 1)
