"""The examples run as their text says (the simulator tour end to end; the training scripts are run
under gossiprec by the recovery tests' workload, which they mirror)."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
def test_the_simulator_tour_runs_and_shows_what_it_says(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLES / "simulator_tour.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("\n== ") == 6 and "gossiprec sim --scenario partition --nodes 10 --seed 4" in out


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("GOSSIPREC_SHARDED_FULL"),
                    reason="with the sharded matrix (GOSSIPREC_SHARDED_FULL=1): the example does not wait for its "
                           "spare, and on a loaded machine a rank was once removed before its first step")
def test_the_sharded_tp_example_trains_under_gossiprec_and_ends_cleanly(tmp_path: Path) -> None:
    """examples/sharded_tp.py as its text says: four ranks of a dp x tp mesh and a hot spare, each under
    ``gossiprec run`` with the job spec's [job] table the script prints; every process ends with exit 0
    (the spare too, when training is over) and rank 0 reports the last step."""
    import subprocess
    import sys
    import time

    from gossiprec.harness.job import LocalJob

    script = EXAMPLES / "sharded_tp.py"
    table = subprocess.run([sys.executable, str(script), "--job-table"], check=True, capture_output=True,
                           text=True).stdout
    assert 'topology = "grid"' in table and "dp = 2" in table and "tp_pp = 2" in table
    with LocalJob(tmp_path / "job", 4, 1, job_table=table) as job:
        for node in job.names:
            out = job.path(node, ".out")  # (a launcher's trainer has no stdout of its own: to a file)
            code = (f"import runpy, sys; sys.stdout = open({str(out)!r}, 'w', buffering=1); "
                    f"sys.argv = [{str(script)!r}]; runpy.run_path({str(script)!r}, run_name='__main__')")
            job.spawn(node, [sys.executable, "-c", code])
        deadline = time.monotonic() + 240.0
        while any(p.poll() is None for p in job.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        exits = {n: p.poll() for n, p in job.procs.items()}  # (leaving the block reaps what is left)
    assert exits == {n: 0 for n in job.names}, (exits, f"logs in {job.dir}")
    assert "step 200 loss" in job.path("n0", ".out").read_text(), f"logs in {job.dir}"
