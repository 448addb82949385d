"""Agents whose job specs differ refuse each other on both sides, naming both digests and the members
that differ, and neither side decides a view (no two views of one epoch, whatever the member lists).
With signatures on (real agents), an agent is fenced only by the signed word of a member of its own
view 0; one whose view 0 shares no member with the sender's only reports it."""

from __future__ import annotations

import random

import pytest

from gossiprec.core.config import AgreementConfig, Config
from gossiprec.core.events import Fenced, JobSpecMismatch, ViewInstalled
from gossiprec.core.fencing import SPEC_FENCE
from gossiprec.core.node import Node
from gossiprec.core.records import MemberInfo
from gossiprec.core.topology import JobTopology
from gossiprec.core.view import View, ViewMember
from gossiprec.sim.cluster import SimCluster


def _view(trainers: list[str], spares: list[str] = ()) -> View:  # type: ignore[assignment]
    members = [ViewMember(n, n, "trainer", i) for i, n in enumerate(trainers)]
    members += [ViewMember(n, n, "spare", None) for n in spares]
    return View.initial(members, JobTopology.ddp(len(trainers)))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_two_specs_refuse_each_other_and_neither_side_decides(seed: int) -> None:
    names = ["a", "b", "c", "d", "e"]
    spec_a = _view(["a", "b", "c", "d", "e"])        # what a, b and c read
    spec_b = _view(["d", "e", "f"])                  # what d and e read: f never starts
    config, acfg = Config.profile("sim"), AgreementConfig.profile("sim")

    def make(idx: int, now: float, incarnation: int, rng: random.Random) -> Node:
        name = names[idx]
        view = spec_a if name in ("a", "b", "c") else spec_b
        members = {m.node: MemberInfo(m.node, m.addr, 1) for m in view.members if m.node != name}
        return Node(config, name, name, incarnation=incarnation, rng=rng, now=now, view=view, role="trainer",
                    members=members, agreement=acfg)

    cluster = SimCluster(5, make, seed=seed, names=names)
    events: list[tuple[str, object]] = []
    cluster.observers.append(lambda now, idx, ev: events.append((names[idx], ev)))
    cluster.run_until(20.0)

    installed = [(n, ev.epoch) for n, ev in events if isinstance(ev, ViewInstalled) and ev.epoch > 0]
    assert installed == [], f"a view was decided although the specs differ (seed {seed}): {installed}"
    for i, name in enumerate(names):
        node = cluster.nodes[i].machine
        assert isinstance(node, Node)
        assert node.fenced.startswith(SPEC_FENCE), (name, node.fenced, seed)
        assert spec_a.config_id in node.fenced and spec_b.config_id in node.fenced, node.fenced
    mismatches = {n: [ev for m, ev in events if m == n and isinstance(ev, JobSpecMismatch)] for n in names}
    # every agent names the other side's digest, and, once the other view 0 arrived, the differing members
    for n in names:
        full = [ev for ev in mismatches[n] if ev.only_ours or ev.only_theirs]
        assert full, f"{n} never named the differing members (seed {seed}): {mismatches[n]}"
    a_side = next(ev for ev in mismatches["a"] if ev.only_ours or ev.only_theirs)
    assert (a_side.ours, a_side.theirs) == (spec_a.config_id, spec_b.config_id)
    assert a_side.only_ours == ("a", "b", "c") and a_side.only_theirs == ("f",) and a_side.differ == ("d", "e")
    fences = [ev for _, ev in events if isinstance(ev, Fenced) and ev.reason.startswith(SPEC_FENCE)]
    assert len(fences) == 5


def test_one_spec_everywhere_raises_nothing() -> None:
    names = ["a", "b", "c"]
    view = _view(names)
    config, acfg = Config.profile("sim"), AgreementConfig.profile("sim")

    def make(idx: int, now: float, incarnation: int, rng: random.Random) -> Node:
        name = names[idx]
        members = {m.node: MemberInfo(m.node, m.addr, 1) for m in view.members if m.node != name}
        return Node(config, name, name, incarnation=incarnation, rng=rng, now=now, view=view, role="trainer",
                    members=members, agreement=acfg)

    cluster = SimCluster(3, make, seed=4, names=names)
    events: list[object] = []
    cluster.observers.append(lambda now, idx, ev: events.append(ev))
    cluster.run_until(10.0)
    assert not [ev for ev in events if isinstance(ev, (JobSpecMismatch, Fenced))]


@pytest.mark.slow
def test_five_real_agents_two_on_another_spec_all_refuse_with_both_digests(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import os
    import re
    import subprocess
    import sys
    import time
    from pathlib import Path

    from gossiprec.agent.jobspec import load_view0
    from gossiprec.harness.ports import free_ports

    ports = free_ports(6, width=3)
    addr = {n: f"127.0.0.1:{p}" for n, p in zip("abcdef", ports)}

    def spec(path: Path, members: str) -> str:
        rows = "".join(f'[[members]]\nname = "{n}"\naddr = "{addr[n]}"\nrank = {i}\n\n' for i, n in enumerate(members))
        path.write_text(f'[job]\ntopology = "ddp"\n\n{rows}')
        return str(path)

    spec_a, spec_b = spec(tmp_path / "a.toml", "abcde"), spec(tmp_path / "b.toml", "def")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = {}
    try:
        for n in "abcde":
            job = spec_a if n in "abc" else spec_b
            with open(tmp_path / f"{n}.log", "wb") as log:
                procs[n] = subprocess.Popen(
                    [sys.executable, "-m", "gossiprec", "agent", "--name", n, "--job", job, "--insecure",
                     "--control-socket", str(tmp_path / f"{n}.sock")], env=env, stdout=log, stderr=subprocess.STDOUT)

        def status(n: str) -> dict:
            out = subprocess.run([sys.executable, "-m", "gossiprec", "status", "--json", "--control-socket",
                                  str(tmp_path / f"{n}.sock")], env=env, capture_output=True, text=True, timeout=30)
            return json.loads(out.stdout) if out.returncode == 0 else {}

        # a, b and c hold d and e in their view 0: d's and e's signed word fences them for good. d and e
        # hold no a, b or c: another spec in the word of a name outside their view 0 is reported, not
        # obeyed (a key holder could sign one under any fresh name and stop every agent for good).
        deadline = time.monotonic() + 90
        fenced: dict[str, str] = {}
        while time.monotonic() < deadline and len(fenced) < 3:
            for n in "abc":
                st = status(n)
                reason = str(st.get("fenced") or "")
                if "job spec mismatch" in reason:
                    fenced[n] = reason
            time.sleep(0.5)
        logs = "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text(errors='replace')[-1500:]}" for n in "abcde")
        assert set(fenced) == set("abc"), f"{fenced}\n{logs}"
        da, db = load_view0(spec_a).config_id, load_view0(spec_b).config_id
        assert all(da in r and db in r for r in fenced.values()), fenced
        for n in "abcde":
            text = (tmp_path / f"{n}.log").read_text()
            assert "ERROR" in text and "JobSpecMismatch" in text, f"{n}\n{logs}"  # both sides report it
        for n in "de":
            assert "job spec mismatch" not in str(status(n).get("fenced") or ""), logs
        for n in "abc":  # the fenced side decides no view, and installs none of the other side's
            text = (tmp_path / f"{n}.log").read_text()
            assert re.search(r"event=ViewInstalled epoch=[1-9]", text) is None, logs
        assert "only_theirs=['f']" in (tmp_path / "a.log").read_text(), logs  # the differing member named
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
