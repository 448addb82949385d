"""``gossiprec events``: the lossy ``follow`` stream of the control channel, the follower's records and
words, and the bootstrap in words (``status``, ``members`` and the log while view 0 is not agreed)."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from gossiprec.agent.follow import AgentTooOld, Follower, follow, words
from gossiprec.agent.hub import EventHub, Gap, Stamped
from gossiprec.agent.ops import cmd_events, cmd_members, cmd_status
from gossiprec.agent.pump import Agent
from gossiprec.agent.settings import AgentSettings
from gossiprec.bench.agents import job_spec
from gossiprec.core.bootstrap import BootParams, Bootstrap, Candidate
from gossiprec.core.bootwords import boot_state, boot_words
from gossiprec.core.events import MemberFailed, ProbeResult
from gossiprec.errors import GossiprecError
from gossiprec.harness.ports import free_ports
from gossiprec.local.client import ControlClient
from gossiprec.local.server import ControlServer


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="gre", dir="/tmp")  # Unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _status(path: str) -> dict[str, Any]:
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
        except (OSError, GossiprecError, KeyError, TypeError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


# --- live: real agent processes, `gossiprec events --json` as a subprocess ----------------------------
def test_events_json_shows_a_sigkilled_agent_then_the_view_change_with_its_cause(sockdir: str) -> None:
    names = ["n0", "n1", "n2"]
    ports = free_ports(3)
    job = Path(sockdir) / "job.toml"
    job.write_text(job_spec(list(zip(names, ports)), 1))  # n0, n1 trainers; n2 a spare
    socks = [f"{sockdir}/{n}.sock" for n in names]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    watcher: subprocess.Popen[str] | None = None
    try:
        for name, port, sock in zip(names, ports, socks):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "gossiprec", "agent", "--name", name, "--bind", "127.0.0.1",
                 "--port", str(port), "--insecure", "--job", str(job), "--control-socket", sock,
                 "--seed", f"127.0.0.1:{ports[0]}", "--log-level", "warning"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for sock in socks:
            _wait(lambda sock=sock: _status(sock)["live"] == 3 and _status(sock)["view"]["epoch"] == 0,
                  30, f"agent at {sock}")
        watcher = subprocess.Popen(
            [sys.executable, "-m", "gossiprec", "events", "--json", "--control-socket", socks[0]],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert _wait(lambda: _status(socks[0])["subscribers"] >= 1, 15, "the follower to subscribe")
        procs[1].send_signal(signal.SIGKILL)  # rank 1's agent: no leave, only silence
        _wait(lambda: _status(socks[0])["view"]["epoch"] >= 1, 30, "n0 to install epoch 1")
        _wait(lambda: _status(socks[0]).get("plan") is not None, 15, "n0's plan of epoch 1")
        time.sleep(0.3)
        watcher.send_signal(signal.SIGINT)  # Ctrl-C
        out, err = watcher.communicate(timeout=15)
        assert watcher.returncode == 0, err
        recs = [json.loads(line) for line in out.splitlines()]
        assert all(r["v"] == 1 and r["node"] == "n0" and isinstance(r["time"], float) for r in recs)
        kinds = [r["kind"] for r in recs]
        assert "probe" not in kinds  # one per probe: left out unless --probes
        failure = next(i for i, r in enumerate(recs)
                       if r["kind"] in ("suspect", "failed", "alert") and n1_of(r) == "n1")
        view = next(i for i, r in enumerate(recs) if r["kind"] == "view" and "n1" in r["removed"])
        plan = next(i for i, r in enumerate(recs) if r["kind"] == "plan" and r["epoch"] == recs[view]["epoch"])
        assert failure < view < plan, kinds
        cause = recs[view]["causes"]["n1"]
        assert cause == "unreachable" or re.fullmatch(r"(failed, declared dead|suspected) by n[02]", cause), recs[view]
        assert recs[plan]["plan"]["replacements"] == {"1": "n2"}  # the spare takes rank 1
        assert [r["time"] for r in recs] == sorted(r["time"] for r in recs)

        # a lost agent: exit 1, and say so
        watcher = subprocess.Popen(
            [sys.executable, "-m", "gossiprec", "events", "--control-socket", socks[2]],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert _wait(lambda: _status(socks[2])["subscribers"] >= 1, 15, "the second follower")
        procs[2].send_signal(signal.SIGKILL)
        out, err = watcher.communicate(timeout=15)
        assert watcher.returncode == 1
        assert "lost the agent at" in err and socks[2] in err, err
    finally:
        for p in [*procs, *([watcher] if watcher is not None else [])]:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)


def n1_of(rec: dict[str, Any]) -> Any:
    return rec.get("subject") if rec["kind"] == "alert" else rec.get("name")


# --- lossy subscriptions: a slow reader gets a gap, the agent's memory stays bounded ------------------
def test_a_lossy_subscription_drops_what_does_not_fit_and_says_how_many() -> None:
    hub = EventHub()
    sub = hub.follow(100)
    for i in range(10_000):
        hub.publish(MemberFailed(f"m{i}", 1, "x", float(i)))
        assert len(sub) <= 101  # the queue and one gap, whatever the reader does
    assert not sub.closed and not sub.overflowed and sub.dropped == 9_900
    items = [sub.get_nowait() for _ in range(len(sub))]
    assert all(isinstance(s, Stamped) for s in items[:100])
    assert [s.event.name for s in items[:100]] == [f"m{i}" for i in range(100)]  # type: ignore[union-attr]
    assert isinstance(items[100], Gap) and items[100].dropped == 9_900
    hub.publish(MemberFailed("late", 1, "x", 0.0))  # room again: events flow after the gap
    nxt = sub.get_nowait()
    assert isinstance(nxt, Stamped) and nxt.event.name == "late"
    quiet = hub.follow(10, frozenset({"ProbeResult"}))  # left out before they take room
    for i in range(100):
        hub.publish(ProbeResult("m", True, float(i)))
    hub.publish(MemberFailed("m", 1, "x", 1.0))
    assert len(quiet) == 1 and quiet.dropped == 0


class _HubBackend:
    """A control backend with nothing but a hub (the server's follow path, without an agent)."""

    node_name = "hb"

    def __init__(self) -> None:
        self.hub = EventHub()
        self.subs: list[Any] = []

    def control_follow(self, queue: int, probes: bool) -> Any:
        self.subs.append(self.hub.follow(queue))
        return self.subs[-1]

    def control_subscribe(self) -> Any:
        return self.hub.subscribe()


async def test_a_reader_that_does_not_read_gets_a_gap_and_the_agent_never_blocks(sockdir: str) -> None:
    backend = _HubBackend()
    path = f"{sockdir}/hb.sock"
    async with ControlServer(path, backend):  # type: ignore[arg-type]  # only the ops used here
        client = await asyncio.to_thread(ControlClient, path)
        try:
            await asyncio.to_thread(client.request, "follow", queue=50)
            sub = backend.subs[0]
            n = 20_000
            pad = "x" * 200  # ~4 MB in all: far more than the socket buffers hold
            t0 = time.perf_counter()
            for i in range(n):
                backend.hub.publish(MemberFailed(f"m{i}", 1, pad, float(i)))  # never waits on the reader
                assert len(sub) <= 51
                if i % 500 == 0:
                    await asyncio.sleep(0)  # let the forwarder fill the socket
            publish_s = time.perf_counter() - t0

            def read_all() -> list[dict[str, Any]]:
                got: list[dict[str, Any]] = []
                while (frame := client.next_event(timeout=1.0)) is not None:
                    got.append(frame)
                return got

            frames = await asyncio.to_thread(read_all)
        finally:
            client.close()
    gaps = [f for f in frames if f["event"] == "Gap"]
    events = [f for f in frames if f["event"] == "MemberFailed"]
    assert gaps and all(g["dropped"] > 0 and isinstance(g["time"], float) for g in gaps)
    assert len(events) + sum(g["dropped"] for g in gaps) == n  # every event either delivered or counted
    assert len(events) < n / 2
    idx = [int(f["name"][1:]) for f in events]
    assert idx == sorted(idx)  # in order
    assert publish_s < 5.0


async def test_an_agent_without_follow_is_an_agent_too_old_error(sockdir: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import gossiprec.local.server as server

    monkeypatch.delitem(server._OPS, "follow")  # an agent of before the follow op
    path = f"{sockdir}/old.sock"
    async with ControlServer(path, _HubBackend()):  # type: ignore[arg-type]
        with pytest.raises(AgentTooOld, match="too old"):
            await asyncio.to_thread(lambda: next(follow(path)))
        err = io.StringIO()
        args = argparse.Namespace(control_socket=path, port=None, json=True, timeout=5.0, probes=False)
        rc = await asyncio.to_thread(cmd_events, args, io.StringIO(), err)
    assert rc == 1
    assert "too old" in err.getvalue() and "upgrade" in err.getvalue()


def test_records_carry_the_cause_of_a_removal_and_words_say_it() -> None:
    f = Follower("n0")
    f.record({"event": "AlertRaised", "subject": "n1", "reason": "hung", "at": 1.0, "time": 100.0})
    rec = f.record({"event": "ViewInstalled", "epoch": 2, "config_id": "c", "members": ["n0", "n2"],
                    "removed": ["n1"], "joined": [], "fast": True, "decided_here": False, "at": 2.0,
                    "stopped": "", "time": 101.0})
    assert rec["kind"] == "view" and rec["causes"] == {"n1": "hung"} and "at" not in rec
    assert "removed n1 (hung)" in words(rec)
    hang = f.record({"event": "AlertRaised", "subject": "n3", "reason": "hung", "at": 3.0, "time": 102.5})
    assert words(hang).endswith("alert      hang report: n3 hung")
    new = f.record({"event": "SomethingNew", "x": 1, "time": 103.0})
    assert new["kind"] == "something_new" and words(new).endswith("x=1")
    gap = f.record({"event": "Gap", "dropped": 7, "at": 104.0, "time": 104.0})
    assert gap["kind"] == "gap" and "7 events dropped" in words(gap)


# --- the bootstrap in words ---------------------------------------------------------------------------
def test_boot_words_name_the_missing_seed_and_count_the_others() -> None:
    params = BootParams(4, 0, ("h:1", "h:2", "h:3"))
    boot = Bootstrap(params, Candidate("a", "h:1"), 0.0, __import__("random").Random(1))
    boot.known["b"] = Candidate("b", "h:2")
    boot.known["x"] = Candidate("x", "h:9")  # not a seed
    text = boot_words(boot_state(boot))
    assert text == "3 of 4 agents found (a, b, x); waiting for: seed h:3 (silent); seeds answering: 2 of 3"
    boot.known["c"] = Candidate("c", "h:3")
    assert "waiting for: view 0 to be agreed by a majority of the seeds (2 of 3)" in boot_words(boot_state(boot))
    del boot.known["c"], boot.known["x"]
    boot.answered.add("h:3")  # answered, so not missing: the two missing agents have no name yet
    assert "waiting for: 2 more agents not heard of yet; seeds answering: 3 of 3" in boot_words(boot_state(boot))


async def test_status_members_and_the_log_of_a_bootstrapping_agent_say_what_it_waits_for(
        sockdir: str, caplog: pytest.LogCaptureFixture) -> None:
    mine, silent = free_ports(2)
    agent = Agent(AgentSettings(name="b0", bind_host="127.0.0.1", port=mine, insecure=True, nnodes=2,
                                control_socket=f"{sockdir}/b0.sock",
                                seeds=(f"127.0.0.1:{mine}", f"127.0.0.1:{silent}")))
    want = f"1 of 2 agents found (b0); waiting for: seed 127.0.0.1:{silent} (silent); seeds answering: 1 of 2"
    caplog.set_level("INFO", logger="gossiprec")
    await agent.start()
    try:
        args = argparse.Namespace(control_socket=agent.control_path, port=None, json=False, timeout=5.0)
        out, err = io.StringIO(), io.StringIO()
        assert await asyncio.to_thread(cmd_status, args, out, err) == 0, err.getvalue()
        assert f"bootstrap   {want}" in out.getvalue()
        assert "view        none (view 0 not agreed yet: see bootstrap)" in out.getvalue()
        out = io.StringIO()
        assert await asyncio.to_thread(cmd_members, args, out, err) == 0, err.getvalue()
        assert out.getvalue().splitlines()[-1] == f"bootstrap: {want}"
        # the log says it with each progress event (every 5 s)
        await agent.wait_until(lambda: any(want in r.getMessage() for r in caplog.records), 8)
        assert not any("BootProgress" in r.getMessage() for r in caplog.records)
    finally:
        agent.abort()
        await agent.aclose()
