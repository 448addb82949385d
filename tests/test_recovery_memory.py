"""Kill-in-every-phase with one host copy of the state and with none, end to end.

The same harness as :mod:`tests.test_recovery_faults` (real agents and trainer processes on loopback,
faults injected at exact phases of exact steps), with ``TrainerConfig.snapshot_copies`` 1 (the last
commit, overwritten in place while the next step computes) and 0 (no copy: the live tensors until the
next optimizer step). A rank dies in the forward pass, with the gradient all-reduce in flight, in its
optimizer step and between steps; with hidden=1024 the survivors' background copy of a commit (over
the copier's threshold, so on its thread) is still running when the next step's kill lands, so the
last committed step must be served while it is being written. Every run must end bit-identical to the
failure-free run with no committed step lost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gossiprec.harness.faults import Fault
from gossiprec.harness.scenario import run_scenario
from tests.support.second_plan import second_plan_run


def _kills_in_every_phase(tmp_path: Path, copies: int) -> dict:
    faults = [Fault("n1", "kill", 6, "compute"), Fault("n0", "kill", 12, "communicate"),
              Fault("n2", "kill", 18, "optimizer"), Fault("n3", "kill", 24, "committed"),
              Fault("n4", "kill", 29, "compute")]
    res = run_scenario(2, 5, 34, faults, hidden=1024, step_ms=10.0, workdir=str(tmp_path), timeout=200.0,
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


def _records(workdir: Path, node: str) -> list[dict]:
    path = workdir / f"{node}.records"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.slow
def test_one_copy_kill_in_the_survivors_optimizer_step_loses_nothing(tmp_path: Path) -> None:
    # the view without n1 is installed while the survivors are in their optimizer step of step 12: they
    # commit 12 knowing of it, so each keeps its copy of 11 and holds 12 as its live tensors, and reports
    # both (committed 11, in flight 12); the plan resumes at 12, which they serve from the live tensors
    faults = [Fault("n1", "kill", 12, "optimizer"), Fault("n0", "slow", 12, "optimizer"),
              Fault("n2", "slow", 12, "optimizer")]
    res = run_scenario(3, 1, 20, faults, hidden=32, step_ms=10.0, workdir=str(tmp_path), timeout=120.0,
                       trainer_args=["--snapshot-copies", "1"])
    assert res["bit_identical"] and res["final_step"] == [20], res
    (kill,) = res["faults"]
    assert kill["lost_steps"] == 0 and kill["epochs"] == [1], kill
    assert all(r["target_step"] == 12 for n in ("n0", "n2", "n3") for r in _records(tmp_path, n)), res
    assert list(kill["roles"].values()).count("receiver") == 1, kill


@pytest.mark.slow
def test_one_copy_second_plan_after_a_roll_back_resumes_at_the_kept_step(tmp_path: Path) -> None:
    # test_recovery_faults' second-plan run with one copy: the first plan (reports not held) targets 11,
    # so n2 reloads its copy of 11, which overwrites the live step 12 it committed after the view; it tells
    # its agent so, and the second plan (n0 died serving) resumes at 11, the step n2 still holds. Two
    # copies would resume at 12; one copy loses that step and still ends bit-identical.
    _, n2 = second_plan_run(tmp_path, copies=1)
    assert [s[1] for s in n2["superseded"]] == [11] and n2["target_step"] == 11, n2
    assert n2["lost_steps"] == 1, n2
