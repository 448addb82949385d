"""Real agents as separate processes on loopback: a job of 16 starts from one job spec, one agent is
SIGKILLed, and every survivor installs the same new view with a spare in the lost rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gossiprec.harness.ports import free_ports
from gossiprec.errors import GossiprecError
from gossiprec.local.client import ControlClient

N = 16
SPARES = 2


def _status(path: str) -> dict:
    with ControlClient(path) as c:
        return dict(c.request("status")["status"])


def _wait(pred, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except (OSError, GossiprecError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


@pytest.mark.slow
def test_sigkill_one_of_16_agents_all_survivors_install_the_same_view(tmp_path: Path) -> None:
    ports = free_ports(N)
    names = [f"a{i:02d}" for i in range(N)]
    lines = ['[job]', 'topology = "ddp"', 'allow_shrink = true', '']
    for i, (name, port) in enumerate(zip(names, ports)):
        role = "trainer" if i < N - SPARES else "spare"
        rank = f"rank = {i}\n" if role == "trainer" else ""
        lines.append(f'[[members]]\nname = "{name}"\naddr = "127.0.0.1:{port}"\nrole = "{role}"\n{rank}'
                     f'host = "h{i}"\nrack = "r{i % 4}"\n')
    job = tmp_path / "job.toml"
    job.write_text("\n".join(lines))
    socks = [str(tmp_path / f"{n}.sock") for n in names]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = []
    try:
        for name, port, sock in zip(names, ports, socks):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "gossiprec", "agent", "--name", name, "--bind", "127.0.0.1",
                 "--port", str(port), "--insecure", "--job", str(job), "--control-socket", sock,
                 "--seed", f"127.0.0.1:{ports[0]}", "--log-level", "warning"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for p, sock in zip(procs, socks):
            try:
                _wait(lambda sock=sock: _status(sock)["view"]["epoch"] == 0, 30, f"agent at {sock}")
            except AssertionError:
                p.kill()
                raise AssertionError(p.communicate(timeout=5)[1].decode()[-2000:]) from None
        time.sleep(1.0)  # a few probe rounds with everyone up
        victim = 3
        procs[victim].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        survivors = [s for i, s in enumerate(socks) if i != victim]

        def all_moved() -> list[dict]:
            out = [_status(s) for s in survivors]
            return out if all(st["view"]["epoch"] >= 1 for st in out) else []

        statuses = _wait(all_moved, 20, "every survivor to install epoch 1")
        elapsed = time.monotonic() - t_kill
        views = {(st["view"]["epoch"], st["view"]["config_id"]) for st in statuses}
        assert len(views) == 1, views
        members = statuses[0]["view"]["members"]
        assert names[victim] not in [m["node"] for m in members]
        ranks = sorted(m["rank"] for m in members if m["role"] == "trainer")
        assert ranks == list(range(N - SPARES))  # a spare took rank 3
        assert elapsed < 10, elapsed
        print(f"new view everywhere {elapsed:.2f} s after SIGKILL")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
