"""Real agents and trainers, no job spec: four `gossiprec run --nnodes 2 --nproc-per-node 2 --spares 1`
on loopback agree on view 0 through three seeds (the first of them never starts), train, lose a rank to
SIGKILL, and finish bit-identical to a failure-free run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gossiprec.harness.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent


def _wait(cond, timeout: float, what: str, procs: list[subprocess.Popen], logs: Path) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                              for p in sorted(logs.glob("*.log")))
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{tails}")
        time.sleep(0.05)


def _read_int(p: Path) -> int:
    try:
        return int(p.read_text() or -1)
    except (OSError, ValueError):
        return -1


@pytest.mark.slow
def test_four_agents_agree_on_view_zero_without_a_spec_and_recover_a_killed_rank(tmp_path: Path) -> None:
    from gossiprec.harness.workload import reference_state

    steps, hidden = 60, 32
    ports = free_ports(5, width=3)  # agent ports; each trainer uses +1 and +2
    dead_seed = f"127.0.0.1:{ports[4]}"        # listed first, never started
    seeds = [dead_seed, f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[2]}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []
    hosts = ["hostA", "hostA", "hostB", "hostB"]
    try:
        for i in range(4):
            name = f"a{i}"
            argv = [sys.executable, "-m", "gossiprec", "run", "--name", name, "--bind", "127.0.0.1",
                    "--port", str(ports[i]), "--insecure", "--nnodes", "2", "--nproc-per-node", "2",
                    "--spares", "1", "--host", hosts[i], "--local-index", str(i % 2),
                    "--bootstrap-timeout", "120", *[a for s in seeds for a in ("--seed", s)], "--",
                    sys.executable, "-m", "gossiprec.harness.trainer", "--steps", str(steps), "--hidden",
                    str(hidden), "--step-ms", "40", "--out", str(tmp_path / f"{name}.json")]
            with open(tmp_path / f"{name}.log", "wb") as log:
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        # ranks by (host, local index): a0 -> 0, a1 -> 1, a2 -> 2, a3 the spare
        _wait(lambda: _read_int(tmp_path / "a1.step") >= 15, 150, "a1 at step 15", procs, tmp_path)
        os.kill(_read_int(tmp_path / "a1.pid"), signal.SIGKILL)
        for p in procs:
            p.wait(timeout=150)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                     for p in sorted(tmp_path.glob("*.log")))
    assert "view 0 agreed through the seeds: 4 members" in (tmp_path / "a0.log").read_text(), logs
    results = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a0", "a2", "a3")}
    assert {n: r["rank"] for n, r in results.items()} == {"a0": 0, "a2": 2, "a3": 1}, logs  # the spare took rank 1
    expected = reference_state(steps, 3, hidden)
    for n in ("a0", "a2", "a3"):
        assert (tmp_path / f"{n}.state").read_bytes() == expected, f"{n} is not bit-identical\n{logs}"
    assert [p.returncode for p in procs] == [0, 137, 0, 0], logs
