"""A sharded job under a real slurmctld, launched the way its users launch it: ``sbatch
deploy/slurm/gossiprec.sbatch`` with ``GOSSIPREC_MESH`` and nothing edited by hand, on three emulated nodes
of two tasks each (the third node's two tasks are the hot spares), HSDP replicate=2 x shard=2 over the small
language model of :mod:`gossiprec.harness.tiny_lm` (embeddings, blocks, final norm and tied head at the
root, a buffer, dropout, clipping, an LR schedule, a data position).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.sharded import STEPS, reference
from tests.support.slurm import SlurmCluster, procs_with, read_int, slurm_unavailable, wait_job

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(slurm_unavailable()), reason=slurm_unavailable() or "slurm available")]


def _records(work: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for p in sorted(work.glob("*.records")) for line in p.read_text().splitlines()]


def _sbatch(cluster: SlurmCluster, work: Path, trainer: str, **env: str) -> str:
    cluster.env.update({"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                        "PYTHONPATH": str(ROOT), "GOSSIPREC_WORKDIR": str(work), "OMP_NUM_THREADS": "1",
                        "PYTHONUNBUFFERED": "1", **env})
    return cluster.run("sbatch", "--parsable", "--nodes=3", "--ntasks-per-node=2", f"--chdir={work}",
                       f"--output={work}/batch.out", str(ROOT / "deploy/slurm/gossiprec.sbatch"),
                       "bash", "-c", trainer).strip()


def _keyring(tmp: Path) -> str:
    from gossiprec.security.keyring import Keyring, decode_key, generate_key

    path = tmp / "keyring.json"
    Keyring([decode_key(generate_key())]).save(path)
    return str(path)


def _kill_node(job: str, node: str) -> list[int]:
    """SIGKILL every gossiprec process of ``node`` at once (its task wrappers, agents and trainers; the
    batch script's sruns run on the first node, so that node is never one to lose)."""
    pids = [pid for pid, cmd in procs_with({"SLURM_JOB_ID": job, "SLURMD_NODENAME": node}) if "gossiprec" in cmd]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # a short-lived helper process (a spec computation) already gone
            pass
    return pids


def test_an_hsdp_job_under_sbatch_loses_a_whole_node_and_ends_bit_identical(tmp_path: Path, ref_dir: Path) -> None:
    """Node n2 holds ranks 2 and 3 (shards 0 and 1 of replica group 1); every gossiprec process on it is
    killed at once. One view change replaces both from the spares of n3, each receiving its shard from the
    same coordinate of the other replica (n1's ranks 0 and 1), and the job ends as the failure-free run.
    (n1 runs the batch script itself: losing it ends any Slurm job, so it is not the node lost here.)"""
    work = tmp_path / "job"
    work.mkdir()
    trainer = (f"exec {shlex.quote(sys.executable)} -m gossiprec.harness.sharded_trainer --layout hsdp --model lm "
               f'--steps {STEPS} --step-ms 400 --timeout 60 --out "{work}/$GOSSIPREC_NODE.json"')
    with SlurmCluster(tmp_path / "slurm", nodes=3, cpus=2) as cluster:
        job = _sbatch(cluster, work, trainer, GOSSIPREC_MESH="replicate=2,shard=2",
                      GOSSIPREC_KEYRING=_keyring(tmp_path))
        try:
            wait_job(lambda: read_int(work / "n2-0.step") >= 2 and read_int(work / "n2-1.step") >= 2, 180,
                     "n2's ranks at step 2", cluster, job)
            killed = _kill_node(job, "n2")
            assert len(killed) >= 6, killed  # two task wrappers, two agents, two trainers
            wait_job(lambda: cluster.job_state(job)[0] == "COMPLETED", 240, "the job's end", cluster, job)
        finally:
            if cluster.job_state(job)[0] in ("PENDING", "RUNNING"):
                cluster.run("scancel", job, check=False)
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(work.glob("*.log")))
        assert cluster.job_state(job) == ("COMPLETED", "0:0"), logs + (work / "batch.out").read_text()
    reports = {json.loads(p.read_text())["rank"]: json.loads(p.read_text())
               for p in work.glob("n*-*.json")}
    assert sorted(reports) == [0, 1, 2, 3], logs
    assert {r: reports[r]["node"] for r in reports} == {0: "n1-0", 1: "n1-1", 2: "n3-0", 3: "n3-1"}, logs
    states = {r: hashlib.sha256((work / f"{rep['node']}.state").read_bytes()).hexdigest() for r, rep in reports.items()}
    assert states == reference("hsdp", ref_dir, "--model", "lm"), logs  # byte for byte, every rank's shards
    receivers = [r for r in _records(work) if r["role"] == "receiver"]
    assert len({r["epoch"] for r in receivers}) == 1, receivers  # both ranks replaced in one view change
    assert {r["rank"]: r["donors"] for r in receivers} == {2: ["n1-0"], 3: ["n1-1"]}, receivers  # own shard's peer
    assert not procs_with({"SLURM_JOB_ID": job}), procs_with({"SLURM_JOB_ID": job})
