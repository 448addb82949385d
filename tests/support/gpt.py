"""examples/gpt_hsdp.py as a user launches it, shared by its own tests and the launchers' tests: one job under
``gossiprec run --nnodes ... --mesh replicate=2,shard=2`` and the session's failure-free run of it."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "gpt_hsdp.py"
MESH = "replicate=2,shard=2"
STEPS = 40
JOB_S = 180.0
"""Bound on one job's run (about 12 s on an idle 2-core machine)."""


def run_job(work: Path, *args: str, kill: Sequence[str] = (), after: str = "step 10 loss",
            spares: int = 1) -> dict[str, Any]:
    """The example under ``gossiprec run --nnodes 5 --spares 1 --mesh replicate=2,shard=2`` (n0..n3 the
    ranks, n4 the spare; ``spares``: how many); ``kill``: SIGKILL these nodes' trainers at once when rank 0
    has logged ``after``. Returns each launcher's exit code, the digests in ``work/out`` and each node's log."""
    from gossiprec.harness.job import LocalJob
    from gossiprec.trainer import MeshSpec

    out = work / "out"
    with LocalJob(work, 4, spares, job_table=MeshSpec((2, 2), ("replicate", "shard")).job_toml(), mesh=MESH) as job:
        for node in job.names:
            # the script as is; the wrapper only writes the trainer's pid where LocalJob.signal reads it
            code = (f"import os, runpy, sys; open({str(job.path(node, '.pid'))!r}, 'w').write(str(os.getpid())); "
                    f"sys.argv = [{str(SCRIPT)!r}, '--steps', '{STEPS}', '--out', {str(out)!r}, "
                    f"'--wait-for-spares', '120', *{list(args)!r}]; "
                    f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
            job.spawn(node, [sys.executable, "-c", code])
        deadline = time.monotonic() + JOB_S
        killed = not kill
        while any(p.poll() is None for p in job.procs.values()):
            if not killed and after in job.path("n0", ".log").read_text(errors="replace"):
                for node in kill:
                    job.signal(node, signal.SIGKILL)
                killed = True
            assert time.monotonic() < deadline, f"the job did not end within {JOB_S:.0f} s; logs in {work}"
            time.sleep(0.05)
        exits = {n: p.poll() for n, p in job.procs.items()}
    digests = {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}
    return {"exits": exits, "digests": digests, "killed": killed, "logs": {n: job.path(n, ".log") for n in job.names}}


def sha256s(res: dict[str, Any]) -> dict[int, str]:
    return {r: d["state_sha256"] for r, d in res["digests"].items()}


@pytest.fixture(scope="session")
def gpt_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The failure-free run, once per session (its digests in ``logs["n0"].parent / "out"``)."""
    return run_job(tmp_path_factory.mktemp("gpt-ref"))
