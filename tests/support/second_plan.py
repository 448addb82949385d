"""The second-plan run shared by tests/test_recovery_faults.py (two snapshot copies) and
tests/test_recovery_memory.py (one): n1 dies in its optimizer step of step 12 while the survivors n0 and
n2 are held there too; the first plan (reports not held) targets 11; n0, the donor of spare n3, dies
while serving it (a slowed receiver), and a second plan follows while n2 is still in its recovery."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gossiprec.harness.faults import Fault
from gossiprec.harness.scenario import run_scenario

STEPS = 24
FAULTS = [Fault("n1", "kill", 12, "optimizer"), Fault("n0", "hold", 12, "optimizer"),
          Fault("n2", "hold", 12, "optimizer"), Fault("n0", "kill", 11, "serve")]


def records(workdir: Path, node: str) -> list[dict[str, Any]]:
    path = workdir / f"{node}.records"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def second_plan_run(tmp_path: Path, copies: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the run's result, n2's recovery record that a second plan superseded). Every run must end
    bit-identical at :data:`STEPS`. Under load n2's trainer may come to the first plan only after n0 has
    died and the second view is in, or find the first plan's step gone: that run is right, but does not
    take the path under test (n2 in its recovery when the second plan comes), so it runs once more; twice
    without it fails."""
    for attempt in (1, 2):
        work = tmp_path / f"run{attempt}"
        res = run_scenario(3, 2, STEPS, FAULTS, hidden=1024, step_ms=10.0, workdir=str(work), timeout=150.0,
                           slow_fetch=0.15, protocol={"report_hold": 0},
                           trainer_args=["--snapshot-copies", str(copies)])
        assert res["bit_identical"] and res["final_step"] == [STEPS], res
        assert all(f["fired"] for f in res["faults"]), res["faults"]
        superseded = [r for r in records(work, "n2") if r["superseded"]]
        # the path under test: n2 reloaded step 11 for the first plan and was building its group when the
        # second view came; an attempt that found no step 11 (n2's commit of 12 overwrote it before its
        # trainer knew of the view) is a right run of another path
        if superseded and not any("holds steps" in why for _, _, why in superseded[0]["superseded"]):
            (n2,) = superseded
            return res, n2
    pytest.fail(f"n2 began the first plan in neither run (records: {records(work, 'n2')})")
