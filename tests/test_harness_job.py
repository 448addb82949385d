"""The local-job harness: the job spec it writes is a valid view 0, and leaving a job's block ends every
process it started, a stopped trainer included, also when the block is left by Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys
import time
import tomllib
from pathlib import Path

import pytest

from gossiprec.agent.jobspec import view0_from_dict
from gossiprec.errors import ConfigError, GossiprecError
from gossiprec.harness.job import LocalJob, job_toml, read_int, read_json

SLEEPER = ("import os, sys, time; from pathlib import Path; "
           "Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(1000)")
"""A trainer that writes its pid where the harness looks for it, then does nothing."""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_job_toml_is_a_valid_view0() -> None:
    text = job_toml(["n0", "n1", "n2", "n3", "n4"], [1001, 1004, 1007, 1010, 1013], 4, tp_pp=2)
    doc = tomllib.loads(text)
    assert doc["job"] == {"topology": "grid", "dp": 2, "tp_pp": 2, "allow_shrink": False}
    view = view0_from_dict(doc)
    assert [(m.node, m.role, m.rank) for m in view.members] == [
        ("n0", "trainer", 0), ("n1", "trainer", 1), ("n2", "trainer", 2), ("n3", "trainer", 3),
        ("n4", "spare", None)]
    placed = tomllib.loads(job_toml(["a", "b"], [1, 2], 1, allow_shrink=True, placement=True))
    assert placed["job"]["allow_shrink"] is True
    assert [(m["host"], m["rack"]) for m in placed["members"]] == [("h0", "r0"), ("h1", "r1")]
    with pytest.raises(ConfigError, match="tp_pp must divide"):
        job_toml(["a", "b", "c"], [1, 2, 3], 3, tp_pp=2)


def test_readers_wait_out_half_written_files(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("")
    (tmp_path / "b").write_text('{"step": ')
    assert read_int(tmp_path / "a") == read_int(tmp_path / "missing") == -1
    assert read_json(tmp_path / "b") is None and read_json(tmp_path / "missing") is None
    (tmp_path / "b").write_text('{"step": 3}')
    assert read_json(tmp_path / "b") == {"step": 3}


def test_leaving_the_block_reaps_launchers_and_a_stopped_trainer(tmp_path: Path) -> None:
    job = LocalJob(tmp_path, 2, 1)
    assert job.trainers == ["n0", "n1"] and (tmp_path / "job.toml").exists()
    assert job.env["GOSSIPREC_KEYRING"] == str(tmp_path / "keyring.json")
    with pytest.raises(KeyboardInterrupt), job:
        for node in job.names:
            job.spawn(node, [sys.executable, "-c", SLEEPER, str(job.path(node, ".pid"))])
        deadline = time.monotonic() + 30
        while min(job.pid(n) for n in job.names) <= 0:
            assert time.monotonic() < deadline, [p.poll() for p in job.procs.values()]
            time.sleep(0.05)
        trainers = [job.pid(n) for n in job.names]
        os.kill(trainers[0], signal.SIGSTOP)  # a hung trainer ignores its launcher's SIGTERM
        t0 = time.monotonic()
        raise KeyboardInterrupt  # Ctrl-C while the job runs
    assert time.monotonic() - t0 < 5.0  # not the launcher's grace period for the stopped trainer
    assert all(p.poll() is not None for p in job.procs.values())
    assert not any(_alive(pid) for pid in trainers)


def test_signalling_a_trainer_that_has_not_written_its_pid_is_refused(tmp_path: Path) -> None:
    # read_int gives -1 for a missing .pid file, and os.kill(-1, SIGKILL) would end every process of
    # this user: the harness refuses instead
    job = LocalJob(tmp_path, 2, 0)
    try:
        with pytest.raises(GossiprecError, match="has not written its pid"):
            job.signal("n0", signal.SIGKILL)
    finally:
        job.close()
