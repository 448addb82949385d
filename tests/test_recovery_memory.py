"""Kill-in-every-phase with one host copy of the state and with none, end to end.

The same harness as :mod:`tests.test_recovery_faults` (real agents and trainer processes on loopback,
faults injected at exact phases of exact steps), with ``TrainerConfig.snapshot_copies`` 1 (the last
commit, overwritten in place while the next step computes) and 0 (no copy: the live tensors until the
next optimizer step). A rank dies in the forward pass, with the gradient all-reduce in flight, in its
optimizer step and between steps; with hidden=512 the survivors' background copy of a commit (over
the copier's threshold, so on its thread) is still running when the next step's kill lands, so the
last committed step must be served while it is being written. Every run must end bit-identical to the
failure-free run with no committed step lost.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gossiprec.harness.faults import Fault
from gossiprec.harness.scenario import run_scenario


def _kills_in_every_phase(tmp_path: Path, copies: int) -> dict:
    faults = [Fault("n1", "kill", 6, "compute"), Fault("n0", "kill", 12, "communicate"),
              Fault("n2", "kill", 18, "optimizer"), Fault("n3", "kill", 24, "committed"),
              Fault("n4", "kill", 29, "compute")]
    res = run_scenario(2, 5, 34, faults, hidden=512, step_ms=10.0, workdir=str(tmp_path), timeout=200.0,
                       trainer_args=["--snapshot-copies", str(copies)])
    assert res["bit_identical"], res
    assert res["final_step"] == [34], res
    assert [(f["phase"], f["step"], f["fired"]) for f in res["faults"]] == [
        ("compute", 6, True), ("communicate", 12, True), ("optimizer", 18, True), ("committed", 24, True),
        ("compute", 29, True)], res["faults"]
    for f in res["faults"]:
        assert f["lost_steps"] == 0, f  # nothing committed was lost, in any phase
        assert "receiver" in f["roles"].values(), f  # a spare took the rank with a survivor's state
        assert f["transfer_bytes"] == res["state_bytes"], f
    return res


@pytest.mark.slow
def test_one_copy_kills_in_every_phase_bit_identical(tmp_path: Path) -> None:
    _kills_in_every_phase(tmp_path, 1)


@pytest.mark.slow
def test_no_copy_kills_in_every_phase_bit_identical(tmp_path: Path) -> None:
    _kills_in_every_phase(tmp_path, 0)


@pytest.mark.slow
def test_bucketed_gradients_kills_in_every_phase_bit_identical(tmp_path: Path) -> None:
    # gradients all-reduced in buckets during backward (overlap_gradients, 0.25 MiB buckets: several
    # per step); "communicate" now fires inside backward, with the first bucket on the wire
    faults = [Fault("n1", "kill", 6, "compute"), Fault("n0", "kill", 12, "communicate"),
              Fault("n2", "kill", 18, "optimizer"), Fault("n3", "kill", 24, "committed")]
    res = run_scenario(2, 4, 30, faults, hidden=512, step_ms=10.0, workdir=str(tmp_path), timeout=200.0,
                       trainer_args=["--bucket-mb", "0.25", "--snapshot-copies", "1"])
    assert res["bit_identical"] and res["final_step"] == [30], res
    assert all(f["fired"] and f["lost_steps"] == 0 for f in res["faults"]), res["faults"]
