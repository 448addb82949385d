"""The examples run as their text says (the simulator tour end to end; the training scripts are run
under gossiprec by the recovery tests' workload, which they mirror)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
def test_the_simulator_tour_runs_and_shows_what_it_says(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLES / "simulator_tour.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("\n== ") == 6 and "gossiprec sim --scenario partition --nodes 10 --seed 4" in out
