"""A local job on hosts of its own (``LocalJob(hosts=...)``): the job spec names each host's address with
the same ports everywhere, each launcher starts through its host's command and binds its address, and a
crash cuts the host's network before it kills everything on it. A fake set of hosts records the calls."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from gossiprec.agent.jobspec import load_view0
from gossiprec.harness.job import HOST_PORT, LocalJob


class FakeHosts:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, list[str]]] = []

    def addr(self, index: int) -> str:
        return f"10.9.0.{11 + index}"

    def command(self, index: int, argv: Sequence[str]) -> list[str]:
        self.calls.append(("command", index, list(argv)))
        return [sys.executable, "-c", "import time; time.sleep(60)"]  # stands in for the wrapped launcher

    def cut(self, index: int) -> None:
        self.calls.append(("cut", index, []))

    def kill_all(self, index: int) -> None:
        self.calls.append(("kill_all", index, []))


def test_a_job_on_hosts_of_its_own_names_their_addresses_and_starts_through_them(tmp_path: Path) -> None:
    hosts = FakeHosts()
    with LocalJob(tmp_path, 2, 1, hosts=hosts) as job:
        text = (tmp_path / "job.toml").read_text()
        for i in range(3):
            assert f'addr = "10.9.0.{11 + i}:{HOST_PORT}"' in text, text
        view = load_view0(str(tmp_path / "job.toml"))
        assert sorted(m.node for m in view.members) == ["n0", "n1", "n2"], view
        proc = job.spawn("n1", ["python", "train.py"])
        (kind, index, argv), = hosts.calls
        assert (kind, index) == ("command", 1)
        at = argv.index("--bind")
        assert argv[at:at + 4] == ["--bind", "10.9.0.12", "--port", str(HOST_PORT)], argv
        assert argv[argv.index("--seed") + 1] == f"10.9.0.11:{HOST_PORT}", argv
        assert argv[-3:] == ["--", "python", "train.py"], argv
        job.crash("n1")
        assert [c[:2] for c in hosts.calls[1:]] == [("cut", 1), ("kill_all", 1)]  # silent first, then dead
        assert proc.poll() is not None
