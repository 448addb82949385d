"""The sbatch script's own logic, without Slurm: ``srun``, ``scontrol`` and ``gossiprec`` are stubs on PATH.

What it asks srun for (one step per node, a GPU per task when the allocation has GPUs, a log per task named
by node and local index) and the exit status it gives Slurm from its tasks' codes (75 for a job stopped in
good order, so that ``--requeue`` with ``RequeueExit=75`` restarts it). ``tests/test_slurm.py`` runs the
same script on a real slurmctld.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy/slurm/gossiprec.sbatch"

SRUN = r"""#!/bin/bash
# srun stub: record the options, then run each of the step's tasks as srun would (SLURM_LOCALID 0..n-1)
opts=()
while [ "$1" != bash ]; do
  case "$1" in --ntasks=*) n=${1#--ntasks=} ;; --nodelist=*) node=${1#--nodelist=} ;; esac
  opts+=("$1")
  shift
done
echo "${opts[*]}" >> "$GOSSIPREC_WORKDIR/srun.args"
for ((i = 0; i < n; i++)); do SLURMD_NODENAME=$node SLURM_LOCALID=$i "$@"; done
"""
SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && printf 'n1\\nn2\\n'
"""
GOSSIPREC = r"""#!/bin/bash
# gossiprec stub: `spec` prints run arguments; `run` exits with CODE_<node>_<local index> (default 0)
[ "$1" = spec ] && { echo "--name $SLURMD_NODENAME-$SLURM_LOCALID"; exit 0; }
var=CODE_${SLURMD_NODENAME}_${SLURM_LOCALID}
exit ${!var:-0}
"""


def _run(tmp_path: Path, **env: str) -> tuple[int, list[str], str]:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("gossiprec", GOSSIPREC)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    work = tmp_path / "work"
    base = {"PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_JOB_ID": "7", "GOSSIPREC_WORKDIR": str(work)}
    out = subprocess.run(["bash", str(SCRIPT), "python", "train.py"], env={**base, **env}, capture_output=True,
                         text=True, timeout=60)
    args = (work / "srun.args").read_text().splitlines() if (work / "srun.args").exists() else []
    return out.returncode, args, out.stderr


def test_one_step_per_node_with_a_log_per_task(tmp_path: Path) -> None:
    rc, args, _ = _run(tmp_path)
    assert rc == 0
    assert sorted(args) == [
        f"--nodes=1 --ntasks=2 --nodelist={n} --exact --kill-on-bad-exit=0 --export=ALL "
        f"--output={tmp_path}/work/{n}-%t.log" for n in ("n1", "n2")]
    assert sorted(p.name for p in (tmp_path / "work/exit").iterdir()) == ["n1-0", "n1-1", "n2-0", "n2-1"]


@pytest.mark.parametrize("env, gpu", [
    ({"SLURM_GPUS_ON_NODE": "2"}, "--gpus-per-task=1 --gpu-bind=none"),
    ({"SLURM_JOB_GPUS": "0,1"}, "--gpus-per-task=1 --gpu-bind=none"),
    ({"SLURM_GPUS_ON_NODE": "2", "GOSSIPREC_GPU_ARGS": "--gpus-per-task=1 --gpu-bind=single:1"},
     "--gpus-per-task=1 --gpu-bind=single:1"),
    ({"SLURM_GPUS_ON_NODE": "2", "GOSSIPREC_GPU_ARGS": ""}, None),
    ({}, None),
])
def test_a_gpu_per_task_where_the_allocation_has_gpus(tmp_path: Path, env: dict[str, str], gpu: str | None) -> None:
    rc, args, _ = _run(tmp_path, **env)
    assert rc == 0 and len(args) == 2
    for a in args:
        if gpu is None:
            assert "--gpu" not in a, a
        else:
            assert f"--kill-on-bad-exit=0 {gpu} --export=ALL" in a, a


@pytest.mark.parametrize("codes, status", [
    ({}, 0),                                                # every task finished (or was a spare released)
    ({"CODE_n1_0": "75", "CODE_n1_1": "75", "CODE_n2_0": "75", "CODE_n2_1": "75"}, 75),  # stopped: requeue
    ({"CODE_n1_0": "137", "CODE_n1_1": "137", "CODE_n2_0": "75", "CODE_n2_1": "0"}, 75),  # a shrink, then a stop
    ({"CODE_n1_0": "137", "CODE_n1_1": "1", "CODE_n2_0": "0", "CODE_n2_1": "0"}, 0),     # the job finished
    ({"CODE_n1_0": "1", "CODE_n1_1": "1", "CODE_n2_0": "143", "CODE_n2_1": "1"}, 1),     # nobody finished
])
def test_the_exit_status_tells_slurm_whether_to_requeue(tmp_path: Path, codes: dict[str, str], status: int) -> None:
    rc, _, err = _run(tmp_path, **codes)
    assert rc == status, err
    assert "the tasks' exit codes:" in err


def test_a_requeued_run_counts_only_its_own_exit_codes(tmp_path: Path) -> None:
    rc, _, _ = _run(tmp_path, CODE_n1_0="75")
    assert rc == 75
    rc, _, _ = _run(tmp_path)  # the same job id, so the same workdir: the first run's 75 is gone
    assert rc == 0
