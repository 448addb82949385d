"""A real Slurm cluster on this machine for tests: munged, slurmctld and emulated slurmd nodes.

Every node is this machine (``NodeAddr=127.0.0.1``, one ``slurmd -N nK`` each, its own port); the
daemons read a ``slurm.conf`` in a scratch folder through ``SLURM_CONF``, so nothing under /etc/slurm is
touched. :class:`SlurmCluster` starts them and stops every daemon it started, also when a test fails.
Needs root and Debian's slurmctld, slurmd, slurm-client and munge packages (``.ci/run`` installs them).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged", "munge")


def slurm_unavailable() -> str:
    """Why no Slurm cluster can be started here ("" when one can)."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as their users)"
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd " \
               "slurm-client munge"
    if not Path("/etc/munge/munge.key").exists():
        return "no /etc/munge/munge.key (the munge package creates it)"
    return ""


def _free_port_block(n: int) -> int:
    """The first of ``n`` consecutive free TCP ports."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n < 65000 and all(_free(first + i) for i in range(n)):
            return first
    raise RuntimeError(f"no {n} consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


MUNGE_SOCKET = "/run/munge/munge.socket.2"


def _munged_running() -> bool:
    return subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0


class SlurmCluster:
    """``nodes`` emulated nodes n1..nN of ``cpus`` CPUs each, in ``state`` (a scratch folder)."""

    def __init__(self, state: Path, nodes: int = 4, cpus: int = 2) -> None:
        self.state = state
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus
        self.conf = state / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._munged = False

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        for sub in ("state", "log", *(f"spool/{n}" for n in self.nodes)):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0]
        ctl_port = _free_port_block(1)
        node_port = _free_port_block(len(self.nodes))
        s = self.state
        self.conf.write_text("\n".join([
            "ClusterName=ci", f"SlurmctldHost={host}", f"SlurmctldPort={ctl_port}", "SlurmUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", "MailProg=/bin/true",
            f"StateSaveLocation={s}/state", f"SlurmdSpoolDir={s}/spool/%n",
            f"SlurmctldPidFile={s}/slurmctld.pid", f"SlurmdPidFile={s}/slurmd-%n.pid",
            f"SlurmctldLogFile={s}/log/slurmctld.log", f"SlurmdLogFile={s}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "SlurmdParameters=config_overrides", "ReturnToService=2",
            "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=5", "MinJobAge=300",
            "RequeueExit=75",  # the sbatch script exits 75 for a job stopped in good order: requeued
            # a requeued job waits out its first run's credentials before it starts again (120 s by default)
            "AuthInfo=cred_expire=10",
            f"NodeName=n[1-{len(self.nodes)}] NodeHostname={host} NodeAddr=127.0.0.1 "
            f"Port={node_port}-{node_port + len(self.nodes) - 1} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
        self._start_munge()
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        for n in self.nodes:
            self._spawn(["slurmd", "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            if len(states) == len(self.nodes) and all(v == "idle" for v in states.values()):
                return
            if any(p.poll() is not None for p in self._procs):
                break
            time.sleep(0.3)
        raise RuntimeError(f"the Slurm cluster did not come up: {self.logs()}")

    def _start_munge(self) -> None:
        if _munged_running():
            return  # one is running already: keep it (and do not stop it)
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True, capture_output=True)
        self._munged = True
        deadline = time.monotonic() + 15  # the daemon forks before its socket is there
        while not Path(MUNGE_SOCKET).exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _spawn(self, argv: list[str], name: str) -> None:
        log = open(self.state / "log" / f"{name}.stdout", "wb")
        self._procs.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))
        log.close()

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0) -> str:
        """A Slurm client command against this cluster; its standard output."""
        out = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout

    def job_state(self, job: str) -> tuple[str, str]:
        """(JobState, ExitCode) of a job, e.g. ("COMPLETED", "0:0")."""
        out = self.run("scontrol", "show", "job", job, check=False)
        state = re.search(r"JobState=(\S+)", out)
        code = re.search(r"\bExitCode=(\S+)", out)
        return (state.group(1) if state else "UNKNOWN", code.group(1) if code else "?")

    def logs(self) -> str:
        parts = []
        for f in sorted((self.state / "log").glob("*")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop every daemon this cluster started (and every job it still runs)."""
        for p in reversed(self._procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs.clear()
        if self._munged:
            subprocess.run(["pkill", "-x", "munged"], capture_output=True)
            self._munged = False
            # wait for it to be gone: the next cluster would otherwise take the dying one for a live one
            deadline = time.monotonic() + 15
            while _munged_running() and time.monotonic() < deadline:
                time.sleep(0.05)


def read_int(path: Path) -> int:
    """The integer a progress file holds; -1 while it is absent or half written."""
    try:
        return int(path.read_text() or -1)
    except (OSError, ValueError):
        return -1


def procs_with(env_items: dict[str, str]) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose environment holds every item of ``env_items``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            environ = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace")
                           .split("\0") if "=" in kv)
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd and all(environ.get(k) == v for k, v in env_items.items()):
            out.append((int(d.name), cmd))
    return out


def wait_job(cond: Callable[[], bool], timeout: float, what: str, cluster: SlurmCluster, job: str) -> None:
    """Wait for ``cond`` while ``job`` runs; AssertionError with the cluster's logs when it ends or times out first."""
    deadline = time.monotonic() + timeout
    while not cond():
        state = cluster.job_state(job)[0]
        # the condition is read again after the state: the job may have ended right after it was first read
        alive = state in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED")  # (requeued: runs again)
        if (time.monotonic() > deadline or not alive) and not cond():
            raise AssertionError(f"{what}: not within {timeout:.0f} s (job {state})\n{cluster.logs()}")
        time.sleep(0.05)
