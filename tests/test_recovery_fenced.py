"""A node cut off from the job drops its state and waits as a spare in the same process, then rejoins:
the whole node (agent and trainer) is SIGSTOPped until the others have recovered without it, then
SIGCONTed. Real agents and trainers on loopback (:func:`~gossiprec.harness.scenario.run_scenario`); the
ranks wait at step 12 for the view to hold the node again, so the job cannot end before it rejoined."""

from __future__ import annotations

from pathlib import Path

import pytest

from gossiprec.harness.faults import Fault
from gossiprec.harness.scenario import run_scenario


@pytest.mark.slow
def test_a_node_cut_off_then_healed_waits_as_a_spare_instead_of_dying(tmp_path: Path) -> None:
    res = run_scenario(2, 1, 24, [Fault("n1", "pause", 5)], hidden=32, step_ms=30.0, workdir=str(tmp_path),
                       timeout=240.0, trainer_args=["--await-view", "12:3"])
    assert res["bit_identical"] and res["final_step"] == [24], res
    (cut,) = res["faults"]
    assert cut["fired"] and cut["assignment_after"] == {0: "n0", 1: "n2"}, cut  # the spare took its rank
    dropped = (tmp_path / "n1.dropped").read_text().splitlines()
    assert dropped and all("fenced" in why or "no rank" in why for why in dropped), dropped
    # its removal is the one recovery: its return as a spare (a view of 3 again) leaves the group as it is
    assert cut["epochs"] == [1], cut
    log = (tmp_path / "n1.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    assert "is kept" in log, log[-3000:]  # its launcher kept the process that had dropped its state
    assert res["exits"]["n1"] == 0, (res["exits"], log[-3000:])  # it ended with the job, as an unused spare

