"""``gossiprec members`` / ``gossiprec status`` against three real agents (in this process, on loopback,
from one job spec), and their error when no agent listens."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import shutil
import tempfile
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest

from gossiprec.bench.agents import job_spec
from gossiprec.harness.ports import free_ports
from gossiprec.agent.pump import Agent
from gossiprec.local.client import ControlClient
from gossiprec.agent.ops import (
    add_cli, cmd_members, cmd_status, format_members, member_rows, resolve_control_path,
)
from gossiprec.agent.settings import AgentSettings, default_control_path


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="gro", dir="/tmp")  # Unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@contextlib.asynccontextmanager
async def job_cluster(sockdir: str, n: int = 3, spares: int = 1) -> AsyncIterator[list[Agent]]:
    """``n`` agents running the whole core from one job spec; yields once each sees all ``n`` alive."""
    names = [f"n{i}" for i in range(n)]
    ports = free_ports(n)
    job = Path(sockdir) / "job.toml"
    job.write_text(job_spec(list(zip(names, ports)), spares))
    agents: list[Agent] = []
    try:
        for name, port in zip(names, ports):
            a = Agent(AgentSettings(name=name, bind_host="127.0.0.1", port=port, insecure=True,
                                    control_socket=f"{sockdir}/{name}.sock", job=str(job),
                                    seeds=(f"127.0.0.1:{ports[0]}",)))
            await a.start()
            agents.append(a)
        for a in agents:
            await a.wait_until(lambda a=a: a.live_count() == n, 10)
        yield agents
    finally:
        for a in reversed(agents):
            a.abort()
        for a in reversed(agents):
            await a.aclose()


def _args(path: str, as_json: bool) -> argparse.Namespace:
    return argparse.Namespace(control_socket=path, port=None, json=as_json, timeout=5.0)


async def _run(cmd, path: str, as_json: bool) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    out, err = io.StringIO(), io.StringIO()
    # the CLI is a blocking client; the agents live on this loop, so it runs in a thread
    rc = await asyncio.to_thread(cmd, _args(path, as_json), out, err)
    return rc, out.getvalue(), err.getvalue()


async def test_members_lists_every_member_with_rank_epoch_and_progress(sockdir: str) -> None:
    async with job_cluster(sockdir) as agents:
        n0, n1, _ = agents

        def report() -> None:
            with ControlClient(n0.control_path) as c:
                c.report(41, "compute", 812)

        await asyncio.to_thread(report)
        assert n1.machine is not None
        await n1.wait_until(lambda: (p := n1.machine.progress("n0")) is not None and p.step == 41, 10)

        rc, out, err = await _run(cmd_members, n1.control_path, True)
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["node"] == "n1"
        rows = {r["node"]: r for r in doc["members"]}
        assert set(rows) == {"n0", "n1", "n2"}
        assert [(rows[n]["role"], rows[n]["rank"]) for n in ("n0", "n1", "n2")] == \
            [("trainer", 0), ("trainer", 1), ("spare", None)]
        assert all(r["status"] == "alive" and r["epoch"] == 0 and r["in_view"] for r in rows.values())
        assert rows["n0"]["address"] == n0.addr
        assert (rows["n0"]["step"], rows["n0"]["step_ms"]) == (41, 812)  # gossiped from n0 to n1
        assert rows["n1"]["self"] and not rows["n0"]["self"]
        assert rows["n2"]["step"] is None

        rc, out, err = await _run(cmd_members, n1.control_path, False)
        assert rc == 0, err
        lines = out.strip().splitlines()
        assert lines[0].split() == ["Node", "Address", "Role", "Rank", "Status", "Epoch", "Step", "Step", "time",
                                    "Behind"]
        first = lines[1].split()
        # (Behind: "-" with one training rank heard, nobody to compare it with)
        assert first[:7] == ["n0", n0.addr, "trainer", "0", "alive", "0", "41"] and first[7:] == ["812", "ms", "-"]
        assert lines[2].split()[:3] == ["*", "n1", n1.addr]  # this agent is starred
        assert lines[3].split()[:4] == ["n2", agents[2].addr, "spare", "-"]


async def test_status_shows_view_health_and_fence_state(sockdir: str) -> None:
    async with job_cluster(sockdir) as agents:
        rc, out, err = await _run(cmd_status, agents[2].control_path, True)
        assert rc == 0, err
        st = json.loads(out)
        assert st["node"] == "n2" and st["addr"] == agents[2].addr
        assert st["view"]["epoch"] == 0
        assert {m["node"] for m in st["view"]["members"]} == {"n0", "n1", "n2"}
        assert st["health"] == 0 and st["live"] == 3 and st["fenced"] is None

        rc, out, err = await _run(cmd_status, agents[2].control_path, False)
        assert rc == 0, err
        assert "view        epoch 0, 3 members (2 trainers, 1 spares)" in out
        assert "fenced      no" in out
        assert "health      0 " in out
        assert "members     3 live of 3 known" in out


@pytest.mark.parametrize("cmd", [cmd_members, cmd_status])
def test_no_agent_is_a_clear_error(sockdir: str, cmd) -> None:  # type: ignore[no-untyped-def]
    out, err = io.StringIO(), io.StringIO()
    path = f"{sockdir}/nobody.sock"
    assert cmd(_args(path, False), out, err) == 1
    assert out.getvalue() == ""
    assert f"no agent is listening on {path}" in err.getvalue()
    assert "--control-socket" in err.getvalue()


def test_control_path_resolution_order() -> None:
    env = {"GOSSIPREC_CONTROL": "/run/a.sock", "GOSSIPREC_PORT": "8123", "XDG_RUNTIME_DIR": "/run/u"}
    assert resolve_control_path("/x.sock", None, env) == "/x.sock"
    assert resolve_control_path(None, None, env) == "/run/a.sock"
    del env["GOSSIPREC_CONTROL"]
    assert resolve_control_path(None, None, env) == default_control_path(8123, env)
    assert resolve_control_path(None, 9000, env) == default_control_path(9000, env)
    assert resolve_control_path(None, None, {"XDG_RUNTIME_DIR": "/r"}).endswith("agent-7980.sock")


def test_rows_order_view_members_by_rank_then_others() -> None:
    status = {"view": {"epoch": 4, "members": [
        {"node": "b", "role": "trainer", "rank": 1}, {"node": "a", "role": "trainer", "rank": 0},
        {"node": "s", "role": "spare", "rank": None}, {"node": "ghost", "role": "spare", "rank": None}]}}
    members = [{"name": n, "addr": f"{n}:1", "status": "alive", "role": "spare", "step": -1}
               for n in ("s", "b", "x", "a")]
    rows = member_rows(status, members)
    assert [r["node"] for r in rows] == ["a", "b", "ghost", "s", "x"]
    assert rows[-1]["epoch"] is None and rows[0]["epoch"] == 4
    assert rows[2]["status"] == "unknown"
    table = format_members(rows).splitlines()
    assert len(table) == 6 and table[-1].split()[:6] == ["x", "x:1", "spare", "-", "alive", "-"]


def test_cli_registers_both_commands() -> None:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["members", "--json", "--control-socket", "/tmp/s"])
    assert args.func is cmd_members and args.json and args.control_socket == "/tmp/s"
    assert parser.parse_args(["status"]).func is cmd_status
