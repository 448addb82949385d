"""Launching under Slurm: the job spec computed from a host list (``gossiprec spec``), and the batch
script of ``deploy/slurm`` run by a real slurmctld with four emulated nodes, where one trainer is
SIGKILLed and later every gossiprec process of one node, and the job still ends as a failure-free
run would, with nothing it started left running."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gossiprec.agent.jobspec import view0_from_dict
from gossiprec.agent.spec import expand_hostlist, layout, slurm_environment, to_toml
from gossiprec.errors import ConfigError
from tests.support.slurm import SlurmCluster, procs_with, read_int, slurm_unavailable, wait_job

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, hosts", [
    ("gpu7", ["gpu7"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("node[08-11],gpu7", ["node08", "node09", "node10", "node11", "gpu7"]),
    ("a[1-2,5]b", ["a1b", "a2b", "a5b"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
])
def test_hostlists_expand_as_slurm_writes_them(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, why", [
    ("n[1-3", "without its ']'"), ("n1-3]", "without its '['"), ("n[3-1]", "runs backwards"),
    ("n[a-b]", "not a number"), ("n1,,n2", "empty entry"), ("n[1-2],n1", "names a host twice"),
])
def test_a_bad_hostlist_says_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=__import__("re").escape(why)):
        expand_hostlist(text)


def test_the_layout_gives_ranks_in_host_order_spares_last_and_ports_per_address() -> None:
    addrs = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "127.0.0.1", "d": "127.0.0.1"}
    slots = layout(["a", "b", "c", "d"], 2, 3, 29400, addrs.__getitem__)
    assert [(s.name, s.role, s.rank) for s in slots] == [
        ("a-0", "trainer", 0), ("a-1", "trainer", 1), ("b-0", "trainer", 2), ("b-1", "trainer", 3),
        ("c-0", "trainer", 4), ("c-1", "spare", None), ("d-0", "spare", None), ("d-1", "spare", None)]
    # hosts of their own start at the base port; hosts sharing an address (emulated) take turns
    assert [s.addr for s in slots] == ["10.0.0.1:29400", "10.0.0.1:29403", "10.0.0.2:29400", "10.0.0.2:29403",
                                      "127.0.0.1:29400", "127.0.0.1:29403", "127.0.0.1:29406", "127.0.0.1:29409"]
    view = view0_from_dict(__import__("tomllib").loads(to_toml(slots)))
    assert view.topology.world_size == 5 and len(view.members) == 8
    for bad, why in (((0, 0), "nproc-per-node"), ((2, 8), "--spares must be in 0..7"),
                     ((2, 0, 65530), "no room")):
        with pytest.raises(ConfigError, match=why):
            layout(["a", "b", "c", "d"], bad[0], bad[1], bad[2] if len(bad) > 2 else 29400, addrs.__getitem__)


def test_a_slurm_task_finds_its_hosts_and_itself() -> None:
    env = {"SLURM_JOB_NODELIST": "n[1-4]", "SLURMD_NODENAME": "n3", "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "2(x4)"}
    assert slurm_environment(env) == (["n1", "n2", "n3", "n4"], "n3", 1, 2)
    with pytest.raises(ConfigError, match="inside a Slurm job"):
        slurm_environment({})


def test_the_spec_command_prints_run_arguments_the_launcher_accepts(tmp_path: Path) -> None:
    from gossiprec.agent.launcher import main as run_main  # noqa: F401 (its parser reads these words)
    from gossiprec.agent.settings import add_agent_arguments

    out = subprocess.run([sys.executable, "-m", "gossiprec", "spec", "--hosts", "n[1-3]", "--spares", "1",
                          "--addr", "n1=127.0.0.1", "--addr", "n2=127.0.0.1", "--addr", "n3=127.0.0.1",
                          "--node", "n2", "--local-index", "0", "--out", str(tmp_path / "job.toml"), "--me"],
                         capture_output=True, text=True, check=True)
    words = shlex.split(out.stdout)
    import argparse

    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    args = parser.parse_args(words + ["--job", str(tmp_path / "job.toml")])
    assert (args.name, args.port, args.seeds) == ("n2-0", 29403, ["127.0.0.1:29400", "127.0.0.1:29403",
                                                                  "127.0.0.1:29406"])
    view = view0_from_dict(__import__("tomllib").loads((tmp_path / "job.toml").read_text()))
    assert view.member("n2-0").addr == "127.0.0.1:29403" and view.member("n3-0").role == "spare"  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------------
# a real Slurm


@pytest.mark.slow
@pytest.mark.skipif(bool(slurm_unavailable()), reason=slurm_unavailable() or "slurm available")
def test_a_slurm_job_loses_a_trainer_then_a_node_and_finishes_as_if_nothing_happened(tmp_path: Path) -> None:
    from gossiprec.harness.workload import reference_state
    from gossiprec.security.keyring import Keyring, decode_key, generate_key

    steps, hidden = 60, 32
    work = tmp_path / "job"
    work.mkdir()
    keyring = tmp_path / "keyring.json"
    Keyring([decode_key(generate_key())]).save(keyring)
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT),
           "GOSSIPREC_KEYRING": str(keyring), "GOSSIPREC_SPARES": "2", "GOSSIPREC_WORKDIR": str(work),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    trainer = (f'exec {shlex.quote(sys.executable)} -m gossiprec.harness.trainer --steps {steps} '
               f'--hidden {hidden} --step-ms 30 --out "{work}/$GOSSIPREC_NODE.json"')
    with SlurmCluster(tmp_path / "slurm") as cluster:
        cluster.env.update(env)
        job = cluster.run("sbatch", "--parsable", "--nodes=4", "--ntasks-per-node=1", f"--chdir={work}",
                          f"--output={work}/batch.out", str(ROOT / "deploy/slurm/gossiprec.sbatch"),
                          "bash", "-c", trainer).strip()
        ours = {"SLURM_JOB_ID": job}
        try:
            # n1-0 and n2-0 train (ranks 0, 1); n3-0 and n4-0 are the hot spares
            wait_job(lambda: read_int(work / "n2-0.step") >= 15, 120, "n2-0 at step 15", cluster, job)
            os.kill(read_int(work / "n2-0.pid"), signal.SIGKILL)  # one trainer dies: spare n3-0 takes rank 1
            wait_job(lambda: read_int(work / "n3-0.step") >= 35, 120, "n3-0 training on", cluster, job)
            node3 = [pid for pid, cmd in procs_with({**ours, "SLURMD_NODENAME": "n3"}) if "gossiprec" in cmd]
            assert len(node3) >= 2, node3  # its agent and its trainer
            for pid in node3:  # every gossiprec process of node n3 at once: spare n4-0 takes rank 1
                os.kill(pid, signal.SIGKILL)
            wait_job(lambda: cluster.job_state(job)[0] == "COMPLETED", 180, "the job's end", cluster, job)
        finally:
            if cluster.job_state(job)[0] in ("PENDING", "RUNNING"):
                cluster.run("scancel", job, check=False)
        state, code = cluster.job_state(job)
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(work.glob("*.log")))
        assert (state, code) == ("COMPLETED", "0:0"), logs
        expected = reference_state(steps, 2, hidden)
        finished = [n for n in ("n1-0", "n4-0") if (work / f"{n}.state").exists()]
        assert finished == ["n1-0", "n4-0"], logs
        assert all((work / f"{n}.state").read_bytes() == expected for n in finished), "not bit-identical"
        assert not procs_with(ours), procs_with(ours)  # nothing the job started is left running
