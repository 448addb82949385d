"""No fixed coordinator: the trainer hosting the current epoch's store dies (at epoch 0, then at a later
epoch), two ranks die together, a rank starts long after the others, a spare is removed before the ranks
start; every job ends bit-identical.

Real agents and trainer processes on loopback (:func:`~gossiprec.harness.scenario.run_scenario`); each
run waits for events (committed steps, records), bounded only by generous timeouts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gossiprec.harness.faults import Fault
from gossiprec.harness.job import LocalJob
from gossiprec.harness.scenario import STORE_HOST, Action, run_scenario
from gossiprec.local.client import ControlClient
from gossiprec.local.protocol import ViewBrief


def _check(res: dict, steps: int) -> None:
    assert res["bit_identical"], res
    assert res["final_step"] == [steps], res
    assert all(f["fired"] for f in res["faults"]), res["faults"]


@pytest.mark.slow
def test_the_store_hosts_death_at_epoch_0_and_at_a_later_epoch(tmp_path: Path) -> None:
    # epoch 0's store is rank 0's (n0); each later epoch's is named by its plan, never a dead host.
    # Kill the host of the store in use each time, from outside (SIGKILL, no warning)
    faults = [Fault(STORE_HOST, "kill", 4), Fault(STORE_HOST, "kill", 10)]
    res = run_scenario(2, 2, 16, faults, hidden=32, step_ms=20.0, workdir=str(tmp_path), timeout=240.0)
    _check(res, 16)
    first, second = res["faults"]
    assert first["node"] == "n0", first  # epoch 0's store host
    assert second["node"] != "n0" and second["epochs"] and min(second["epochs"]) > min(first["epochs"]), res
    for f in (first, second):
        assert f["node"] not in f["assignment_after"].values(), f  # replaced by a spare
        assert f["lost_steps"] == 0, f


@pytest.mark.slow
def test_two_ranks_dying_together_are_removed_by_one_view_change(tmp_path: Path) -> None:
    # n0 and n2 SIGKILL themselves at the same point of the same step; their launchers announce both
    # departures, which the agents batch into one proposal while the news keeps coming within the settle
    # window (widened here from 30 ms to 1 s: on a loaded machine two launchers may wake further apart)
    faults = [Fault("n0", "kill", 6, "committed"), Fault("n2", "kill", 6, "committed")]
    res = run_scenario(3, 2, 14, faults, hidden=32, step_ms=20.0, workdir=str(tmp_path), timeout=240.0,
                       protocol={"settle_departed": 1.0})
    _check(res, 14)
    records = [json.loads(line) for n in ("n1", "n3", "n4")
               for line in (tmp_path / f"{n}.records").read_text().splitlines()]
    assert {(r["epoch"], r["world_size"]) for r in records} == {(1, 3)}, records  # one view change, both removed
    assert {r["node"]: r["role"] for r in records} == {"n1": "donor", "n3": "receiver", "n4": "receiver"}, records
    after = res["faults"][-1]["assignment_after"]
    assert after[1] == "n1" and {after[0], after[2]} == {"n3", "n4"}, after  # the survivor keeps its rank


@pytest.mark.slow
def test_a_rank_starting_long_after_the_others_neither_crashes_nor_stalls_the_job(tmp_path: Path) -> None:
    # n1's trainer sleeps over twice the group timeout before it builds anything (a slow import, CUDA
    # start-up): start() is the barrier, so the others wait for it instead of failing their first group
    res = run_scenario(2, 1, 8, [], hidden=32, step_ms=10.0, workdir=str(tmp_path), timeout=240.0,
                       trainer_timeout=5.0, late={"n1": 12.0})
    _check(res, 8)
    assert not (tmp_path / "n0.records").exists(), "the late rank caused a recovery"
    assert res["exits"]["n0"] == 0 and res["exits"]["n1"] == 0, res["exits"]


@pytest.mark.slow
def test_views_changed_before_the_trainers_start_leave_them_training(tmp_path: Path) -> None:
    # a spare's host and then a rank's die before any rank has called start(), so the others come up in a
    # later view with no group built: the survivor commits step 0, its initial state, for the plan to
    # resume from (it once resumed from snapshots nobody held, and every rank failed each plan until the
    # job died), and the other spare takes the lost rank with that state
    go = tmp_path / "go"

    def all_ready(job: LocalJob) -> bool:
        return all(job.path(n, ".ready").exists() for n in job.names)

    def members(job: LocalJob) -> set[str]:
        with ControlClient(str(job.path("n0", ".sock"))) as c:
            view = c.status().get("view")
        return {m.node for m in ViewBrief.from_wire(view).members} if view is not None else set()

    # one at a time: each view is decided by a majority of the one before
    actions = [Action("crash of a spare's host", all_ready, lambda job: job.crash("n3")),
               Action("crash of a rank's host", lambda job: "n3" not in members(job), lambda job: job.crash("n1")),
               Action("the others start", lambda job: members(job) == {"n0", "n2"}, lambda job: go.touch())]
    res = run_scenario(2, 2, 8, [], hidden=32, step_ms=10.0, workdir=str(tmp_path), timeout=120.0,
                       may_fail={"n1", "n3"}, actions=actions, trainer_args=["--start-gate", str(go)])
    _check(res, 8)
    assert res["exits"]["n0"] == 0 and res["exits"]["n2"] == 0, res["exits"]
    records = [json.loads(line) for n in ("n0", "n2") for line in (tmp_path / f"{n}.records").read_text().splitlines()]
    assert {(r["node"], r["role"], r["rank"], r["target_step"]) for r in records} == {
        ("n0", "donor", 0, 0), ("n2", "receiver", 1, 0)}, records
