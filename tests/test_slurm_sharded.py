"""A sharded job under a real slurmctld, launched the way its users launch it: ``sbatch
deploy/slurm/gossiprec.sbatch`` with ``GOSSIPREC_MESH`` and nothing edited by hand, on three emulated nodes
of two tasks each (the third node's two tasks are the hot spares), HSDP replicate=2 x shard=2 over the small
language model of :mod:`gossiprec.harness.tiny_lm` (embeddings, blocks, final norm and tied head at the
root, a buffer, dropout, clipping, an LR schedule, a data position).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.sharded import STEPS, shrunk_reference
from tests.support.slurm import SlurmCluster, procs_with, read_int, slurm_unavailable, wait_job

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(slurm_unavailable()), reason=slurm_unavailable() or "slurm available")]


def _records(work: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for p in sorted(work.glob("*.records")) for line in p.read_text().splitlines()]


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _sbatch(cluster: SlurmCluster, work: Path, trainer: str, *options: str, **env: str) -> str:
    cluster.env.update({"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                        "PYTHONPATH": str(ROOT), "GOSSIPREC_WORKDIR": str(work), "OMP_NUM_THREADS": "1",
                        "PYTHONUNBUFFERED": "1", **env})
    return cluster.run("sbatch", "--parsable", *options, "--nodes=3", "--ntasks-per-node=2", f"--chdir={work}",
                       f"--output={work}/batch.out", str(ROOT / "deploy/slurm/gossiprec.sbatch"),
                       "bash", "-c", trainer).strip()


def _kill_slot(job: str, node: str, local: int) -> list[int]:
    """SIGKILL the gossiprec processes of one task of ``node`` (its wrapper, agent and trainer)."""
    pids = [pid for pid, cmd in procs_with({"SLURM_JOB_ID": job, "SLURMD_NODENAME": node,
                                            "SLURM_LOCALID": str(local)}) if "gossiprec" in cmd]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


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


def test_an_hsdp_job_under_sbatch_loses_a_whole_node_then_another_and_shrinks(tmp_path: Path) -> None:
    """``GOSSIPREC_MESH=replicate=2,shard=2`` and ``--allow-shrink``. Node n2 holds ranks 2 and 3 (shards 0 and 1
    of replica group 1); every gossiprec process on it is killed at once. One view change replaces both from
    the spares of n3, each receiving its shard from the same coordinate of the other replica (n1's ranks 0
    and 1). Then n3's first slot is lost (its agent and its trainer), with no spare left: replica group 1 is
    dropped, n3's other rank is released (exit 0), and n1's ranks train on as a 1 x 2 mesh. The job ends with
    the state of a job that shrank at that step (plain torchrun: 2 x 2 to that step, then replica 0 alone,
    :func:`~tests.support.sharded.shrunk_reference`), which holds the failure-free run up to the shrink, so
    the first recovery was exact too.

    Not all of n3 the second time: the view then has four members, two on n3, and losing both leaves n1's
    two, exactly half: no side holds a majority of the view, so both fence (by design: a half never
    decides). Nor n1: it runs the batch script, whose loss ends any Slurm job."""
    from gossiprec.bench.sharded_overhead import training_digest

    work = tmp_path / "job"
    work.mkdir()
    trainer = (f"exec {shlex.quote(sys.executable)} -m gossiprec.harness.sharded_trainer --layout hsdp --model lm "
               f'--steps {STEPS} --step-ms 400 --timeout 60 --out "{work}/$GOSSIPREC_NODE.json"')
    with SlurmCluster(tmp_path / "slurm", nodes=3, cpus=2) as cluster:
        job = _sbatch(cluster, work, trainer, GOSSIPREC_MESH="replicate=2,shard=2",
                      GOSSIPREC_SPEC_ARGS="--allow-shrink", GOSSIPREC_KEYRING=_keyring(tmp_path))
        try:
            wait_job(lambda: read_int(work / "n2-0.step") >= 2 and read_int(work / "n2-1.step") >= 2, 180,
                     "n2's ranks at step 2", cluster, job)
            killed = _kill_node(job, "n2")
            assert len(killed) >= 6, killed  # two task wrappers, two agents, two trainers
            wait_job(lambda: read_int(work / "n3-0.step") >= 5 and read_int(work / "n3-1.step") >= 5, 180,
                     "n3's ranks at step 5", cluster, job)
            receivers = [r for r in _records(work) if r["role"] == "receiver"]
            _kill_slot(job, "n3", 0)
            wait_job(lambda: cluster.job_state(job)[0] == "COMPLETED", 240, "the job's end", cluster, job)
        finally:
            if cluster.job_state(job)[0] in ("PENDING", "RUNNING"):
                cluster.run("scancel", job, check=False)
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(work.glob("*.log")))
        assert cluster.job_state(job) == ("COMPLETED", "0:0"), logs + (work / "batch.out").read_text()
    assert len({r["epoch"] for r in receivers}) == 1, receivers  # both of n2's ranks replaced in one view change
    assert {r["rank"]: r["donors"] for r in receivers} == {2: ["n1-0"], 3: ["n1-1"]}, receivers  # own shard's peer
    reports = {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in work.glob("n*-*.json")}
    assert {r: (rep["node"], rep["world_size"], rep["step"]) for r, rep in reports.items()} == {
        0: ("n1-0", 2, STEPS), 1: ("n1-1", 2, STEPS)}, logs
    assert (work / "exit/n3-1").read_text().strip() == "0", logs  # released by the shrink
    assert "Released" in (work / "n3-1.log").read_text(), logs
    shrinks = [r for r in _records(work) if r["previous_world_size"] == 4 and r["world_size"] == 2]
    targets = {r["target_step"] for r in shrinks}
    assert {r["node"] for r in shrinks} == {"n1-0", "n1-1"} and len(targets) == 1, shrinks
    ref = shrunk_reference("hsdp", targets.pop(), 0, tmp_path / "ref", "--model", "lm")
    got = {r: training_digest(work / f"n1-{r}.state") for r in (0, 1)}
    assert got == {r: rep["digest"] for r, rep in ref.items()}, logs  # byte for byte, both shards
    assert not procs_with({"SLURM_JOB_ID": job}), procs_with({"SLURM_JOB_ID": job})


def test_a_sharded_job_stopped_in_good_order_exits_75_and_slurm_requeues_it_from_its_checkpoint(
        tmp_path: Path, gpt_reference: dict[str, Any]) -> None:
    """The example GPT (``examples/gpt_hsdp.py --ckpt DIR --ckpt-every 10``) under ``sbatch --requeue`` with
    ``GOSSIPREC_MESH`` and no ``--allow-shrink``; the cluster's ``RequeueExit=75``. Node n2 is lost whole
    (both its ranks replaced from n3's spares), then a slot of n3 with no spare left: the job stops in good
    order, the batch script exits 75, Slurm queues the job again, and the new run resumes from the newest
    complete checkpoint and ends with the failure-free run's state, bit for bit (each rank checks with
    ``--expect`` and says so)."""
    from tests.support.gpt import SCRIPT, STEPS as GPT_STEPS, sha256s

    work = tmp_path / "job"
    work.mkdir()
    ref_out = gpt_reference["logs"]["n0"].parent / "out"
    trainer = (f"exec {shlex.quote(sys.executable)} {SCRIPT} --steps {GPT_STEPS} --out {work}/out --ckpt {work}/ckpt "
               f"--ckpt-every 10 --expect {ref_out} --wait-for-spares 120")
    with SlurmCluster(tmp_path / "slurm", nodes=3, cpus=2) as cluster:
        job = _sbatch(cluster, work, trainer, "--requeue", "--open-mode=append",
                      GOSSIPREC_MESH="replicate=2,shard=2", GOSSIPREC_KEYRING=_keyring(tmp_path))
        log = work / "n1-0.log"
        try:
            wait_job(lambda: "checkpoint of step 10 saved" in _text(log), 180, "the first checkpoint", cluster, job)
            _kill_node(job, "n2")
            wait_job(lambda: "recovered in epoch 1" in _text(work / "n3-0.log"), 180, "n3-0 took a rank", cluster, job)
            _kill_slot(job, "n3", 0)
            wait_job(lambda: "exit codes: 0" in _text(work / "batch.out").split("exit codes: 75")[-1]
                     and "exit codes: 75" in _text(work / "batch.out"), 300, "the requeued run's end", cluster, job)
            wait_job(lambda: cluster.job_state(job)[0] == "COMPLETED", 60, "the job's end", cluster, job)
        finally:
            if cluster.job_state(job)[0] in ("PENDING", "RUNNING", "REQUEUED"):
                cluster.run("scancel", job, check=False)
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(work.glob("*.log")))
        info = cluster.run("scontrol", "show", "job", job)
        assert cluster.job_state(job) == ("COMPLETED", "0:0"), logs + _text(work / "batch.out")
        assert "Restarts=1" in info, info  # queued again once, by RequeueExit=75
    batch = _text(work / "batch.out")
    assert "the tasks' exit codes: 75" in batch and batch.rstrip().endswith("the tasks' exit codes: 0"), batch
    digests = {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted((work / "out").glob("rank*.json"))}
    assert {r: d["state_sha256"] for r, d in digests.items()} == sha256s(gpt_reference), logs
    resumed = [line for p in work.glob("*.log") for line in _text(p).splitlines()
               if "gpt_hsdp rank" in line and "resumed from the checkpoint" in line]
    assert len(resumed) == 4, logs  # every rank of the second run, from the same step
    assert len({line.split("checkpoint of step ")[1].split()[0] for line in resumed}) == 1, resumed
    assert all("equals the failure-free run's, bit for bit" in _text(work / f"{d['node']}.log")
               for d in digests.values()), logs
