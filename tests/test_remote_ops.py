"""``gossiprec members|status --agent HOST:PORT``: asking any agent of the cluster over its authenticated
protocol (:mod:`gossiprec.agent.remote`, :mod:`gossiprec.agent.remote_client`).

Three keyed agents run in this event loop from one job spec, on loopback; the commands run in a thread
(their client runs an event loop of its own, as from a shell). Hostile queries are built with a
:class:`~gossiprec.security.crypto.Sealer` and a plain UDP socket. The paging tests are unit level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import random
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import msgpack
import pytest

from gossiprec.agent.ops import cmd_members, cmd_status
from gossiprec.agent.pump import Agent
from gossiprec.agent.remote import RemoteLimits, RemoteOps, is_query, pages_of, same_addr, source_addr
from gossiprec.agent.remote_client import NO_KEYRING, RemoteError, _Pages, keyring_path, parse_agent
from gossiprec.agent.settings import AgentSettings
from gossiprec.bench.agents import job_spec
from gossiprec.core.wire import OpsPage, OpsQuery, Ping, decode_packet, encode_packet
from gossiprec.harness.ports import free_ports
from gossiprec.security.crypto import Sealer
from gossiprec.security.keyring import Keyring

KEY_A = bytes(range(32))
KEY_B = bytes(range(7, 39))
CLUSTER = "gossiprec"  # the agents' default cluster name
N = 3


@pytest.fixture
def workdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="grr", dir="/tmp")  # Unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def keyring_file(directory: str, name: str, key: bytes) -> str:
    path = f"{directory}/{name}.keys"
    Keyring([key]).save(path)
    return path


@contextlib.asynccontextmanager
async def keyed_cluster(workdir: str) -> AsyncIterator[list[Agent]]:
    """N keyed agents from one job spec (one spare); yields once each sees all N alive in view 0."""
    names = [f"n{i}" for i in range(N)]
    ports = free_ports(N)
    job = Path(workdir) / "job.toml"
    job.write_text(job_spec(list(zip(names, ports)), 1))
    agents: list[Agent] = []
    try:
        for name, port in zip(names, ports):
            a = Agent(AgentSettings(name=name, bind_host="127.0.0.1", port=port, job=str(job),
                                    keyring=keyring_file(workdir, name, KEY_A),
                                    control_socket=f"{workdir}/{name}.sock"))
            await a.start()
            agents.append(a)
        for a in agents:
            await a.wait_until(lambda a=a: a.live_count() == N and getattr(a.machine, "view", None) is not None,
                               10)
        yield agents
    finally:
        for a in reversed(agents):
            a.abort()
        for a in reversed(agents):
            await a.aclose()


def _args(*, control: str | None = None, agent: str | None = None, keyring: str | None = None,
          timeout: float | None = None) -> argparse.Namespace:
    return argparse.Namespace(control_socket=control, port=None, json=True, timeout=timeout, agent=agent,
                              keyring=keyring, cluster=None)


async def _run(cmd: Any, args: argparse.Namespace) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    # the command blocks (its client runs a loop of its own); the agents live on this loop
    rc = await asyncio.to_thread(cmd, args, out, err)
    return rc, out.getvalue(), err.getvalue()


def _stable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "step_ms"} for r in rows]


def _rejects(a: Agent) -> int:
    assert a.transport is not None
    return sum(a.transport.stats()["rejects"].values())


# --- live: three keyed agents ----------------------------------------------------------------------
async def test_remote_members_and_status_match_the_local_ones(workdir: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    async with keyed_cluster(workdir) as agents:
        target = agents[2]
        assert target.remote is not None
        target.remote.limits = RemoteLimits(page_size=700)  # a real answer in several pages
        monkeypatch.setenv("GOSSIPREC_KEYRING", keyring_file(workdir, "operator", KEY_A))
        rc, local, err = await _run(cmd_members, _args(control=target.control_path))
        assert rc == 0, err
        rc, remote, err = await _run(cmd_members, _args(agent=target.addr))
        assert rc == 0, err
        lm, rm = json.loads(local), json.loads(remote)
        assert rm["node"] == lm["node"] == "n2"
        assert _stable(rm["members"]) == _stable(lm["members"])
        assert sorted(r["node"] for r in rm["members"]) == ["n0", "n1", "n2"]
        assert [r["self"] for r in rm["members"]].count(True) == 1
        assert target.counters["ops_answered"] == 1 and target.counters["ops_pages"] > 1

        rc, local, err = await _run(cmd_status, _args(control=target.control_path))
        assert rc == 0, err
        rc, remote, err = await _run(cmd_status, _args(agent=target.addr))
        assert rc == 0, err
        ls, rs = json.loads(local), json.loads(remote)
        for key in ("node", "addr", "cluster", "role", "rank", "secure", "live", "known", "view", "plan",
                    "fenced"):
            assert rs[key] == ls[key], key
        assert rs["node"] == "n2" and rs["view"]["epoch"] == ls["view"]["epoch"]
        # the text form, from another agent (n0) this time, with the keyring named by flag
        args = _args(agent=agents[0].addr, keyring=keyring_file(workdir, "op2", KEY_A))
        args.json = False
        rc, text, err = await _run(cmd_status, args)
        assert rc == 0, err
        assert text.startswith(f"node        n0 ({agents[0].addr})") and "members     3 live of 3 known" in text
        assert agents[0].counters["ops_answered"] == 1


async def test_wrong_key_times_out_with_a_clear_error_and_is_counted(workdir: str) -> None:
    async with keyed_cluster(workdir) as agents:
        target = agents[1]
        before = _rejects(target)
        rc, out, err = await _run(cmd_members, _args(agent=target.addr, timeout=1.5,
                                                     keyring=keyring_file(workdir, "wrong", KEY_B)))
        assert rc == 1 and out == ""
        assert (f"no answer from {target.addr} within 1.5 s: wrong key, wrong port, or agent down"
                in err), err
        assert _rejects(target) > before
        assert "ops_queries" not in target.counters  # refused by the transport, never seen above it


async def test_unauthenticated_and_third_party_queries_are_not_answered(workdir: str) -> None:
    async with keyed_cluster(workdir) as agents:
        target = agents[0]
        assert target.remote is not None
        host, port = target.addr.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            me = f"127.0.0.1:{sock.getsockname()[1]}"
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)
            listener.setblocking(False)
            third = f"127.0.0.1:{listener.getsockname()[1]}"
            # an unsealed query (what an agent run --insecure would send): the opener refuses it
            before = _rejects(target)
            sock.sendto(Sealer(None, CLUSTER, insecure=True).seal(
                encode_packet([OpsQuery(0, 1, me)]), target.addr), (host, int(port)))
            await target.wait_until(lambda: _rejects(target) > before, 5)
            # a key holder asking for the answer to go to a third party: refused, counted
            sealer = Sealer(Keyring([KEY_A]), CLUSTER)
            sock.sendto(sealer.seal(encode_packet([OpsQuery(1, 2, third)]), target.addr), (host, int(port)))
            await target.wait_until(lambda: target.counters.get("ops_refused_source", 0) == 1, 5)
            await asyncio.sleep(0.3)
            with pytest.raises(BlockingIOError):
                listener.accept()  # nobody connected to the third party
            assert target.counters.get("ops_queries") == 1 and "ops_answered" not in target.counters
        finally:
            sock.close()
            listener.close()


async def test_answers_are_rate_limited_per_source(workdir: str) -> None:
    async with keyed_cluster(workdir) as agents:
        target = agents[0]
        assert target.remote is not None
        burst = target.remote.limits.burst
        host, port = target.addr.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            me = f"127.0.0.1:{sock.getsockname()[1]}"
            tcp.bind(("127.0.0.1", sock.getsockname()[1]))  # the answers' connections land here
            tcp.listen(64)
            sealer = Sealer(Keyring([KEY_A]), CLUSTER)
            for req in range(3 * burst):
                sock.sendto(sealer.seal(encode_packet([OpsQuery(1, req, me)]), target.addr), (host, int(port)))
            await target.wait_until(lambda: target.counters.get("ops_queries", 0) == 3 * burst, 5)
            # within a fraction of a second the bucket refills by well under one answer
            assert target.counters["ops_answered"] in (burst, burst + 1)
            assert target.counters["ops_rate_limited"] == 3 * burst - target.counters["ops_answered"]
        finally:
            sock.close()
            tcp.close()


# --- errors at the edge ----------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", [cmd_members, cmd_status])
def test_no_keyring_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cmd: Any) -> None:
    monkeypatch.delenv("GOSSIPREC_KEYRING", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no default keyring there
    out, err = io.StringIO(), io.StringIO()
    assert cmd(_args(agent="127.0.0.1:7946"), out, err) == 1
    assert NO_KEYRING in err.getvalue() and out.getvalue() == ""
    assert NO_KEYRING == "--agent needs the cluster keyring: --keyring PATH or GOSSIPREC_KEYRING"


@pytest.mark.parametrize("bad", ["nohost", "10.0.0.1:0", "10.0.0.1:x", ":7946", "10.0.0.1:70000"])
def test_bad_agent_address_is_a_clear_error(bad: str) -> None:
    with pytest.raises(RemoteError, match="bad --agent .*expected HOST:PORT"):
        parse_agent(bad)
    out, err = io.StringIO(), io.StringIO()
    assert cmd_members(_args(agent=bad, keyring="/nonexistent"), out, err) == 1
    assert "bad --agent" in err.getvalue()


def test_keyring_resolution_order(tmp_path: Path) -> None:
    env = {"GOSSIPREC_KEYRING": "/e.keys", "XDG_CONFIG_HOME": str(tmp_path)}
    assert keyring_path("/f.keys", env) == "/f.keys"
    assert keyring_path(None, env) == "/e.keys"
    del env["GOSSIPREC_KEYRING"]
    with pytest.raises(RemoteError, match="needs the cluster keyring"):
        keyring_path(None, env)
    default = tmp_path / "gossiprec" / "keyring.json"
    default.parent.mkdir()
    Keyring([KEY_A]).save(str(default))
    assert keyring_path(None, env) == str(default)


# --- unit: paging, the query check, the source check -------------------------------------------
class FakeAgent:
    def __init__(self, n: int) -> None:
        self.rows = [{"name": f"member-{i:05d}", "addr": f"10.0.{i // 250}.{i % 250}:7946", "status": "alive",
                      "role": "trainer", "step": i, "phase": "compute", "step_ms": 100, "self": i == 0}
                     for i in range(n)]

    def control_members(self) -> list[dict[str, Any]]:
        return self.rows

    def control_status(self) -> dict[str, Any]:
        return {"node": "member-00000", "view": None, "known": len(self.rows)}


def test_many_members_are_paged_and_put_back_together_in_any_order() -> None:
    sent: list[tuple[str, bytes, bool]] = []
    counters: dict[str, int] = {}
    ops = RemoteOps(FakeAgent(5000), lambda a, p, r: sent.append((a, p, r)), counters, keyed=True,
                    clock=lambda: 0.0, limits=RemoteLimits(page_size=64 * 1024))
    query = encode_packet([OpsQuery(0, 77, "10.1.2.3:40000")])
    assert is_query(query) and not is_query(encode_packet([Ping(1, "a", "b", "c:1")]))
    ops.on_query(query, False, ("10.1.2.3", 40000))
    assert counters["ops_answered"] == 1
    assert len(sent) == counters["ops_pages"] > 3  # the answer is far larger than one packet (MTU 1400)
    assert all(addr == "10.1.2.3:40000" and reliable for addr, _, reliable in sent)
    pages = [decode_packet(p, 2 * 1024 * 1024)[0] for _, p, _ in sent]
    assert all(type(p) is OpsPage and p.req == 77 for p in pages)
    assert [p.last for p in pages] == [False] * (len(pages) - 1) + [True]
    random.Random(5).shuffle(sent)
    collect = _Pages(77)
    for i, (_, payload, _) in enumerate(sent):
        assert not collect.done.is_set()
        collect.on_message(payload, True)
        collect.on_message(encode_packet([OpsPage(78, i, True, b"other query")]), True)  # ignored
    assert collect.done.is_set()
    got = msgpack.unpackb(collect.data(), raw=False)
    assert got["members"] == FakeAgent(5000).rows and got["status"]["known"] == 5000


def test_pages_of_edges() -> None:
    assert pages_of(1, b"", 10) == [OpsPage(1, 0, True, b"")]
    assert [p.data for p in pages_of(1, b"abcdefghij", 5)] == [b"abcde", b"fghij"]
    assert [p.last for p in pages_of(1, b"abcdefghijk", 5)] == [False, False, True]


def test_refusals_by_the_agent_side() -> None:
    sent: list[Any] = []
    counters: dict[str, int] = {}
    now = [0.0]
    ops = RemoteOps(FakeAgent(3), lambda *a: sent.append(a), counters, keyed=True, clock=lambda: now[0],
                    limits=RemoteLimits(rate=1.0, burst=2, total_rate=0.01, total_burst=3))
    q = encode_packet([OpsQuery(1, 5, "10.0.0.9:5000")])
    ops.on_query(q, True, None)  # a stream frame: its source is no reply address
    ops.on_query(q, False, ("10.0.0.8", 5000))  # another host
    ops.on_query(q, False, ("10.0.0.9", 5001))  # another port
    ops.on_query(q, False, None)
    assert counters == {"ops_queries": 4, "ops_refused_stream": 1, "ops_refused_source": 3} and not sent
    for _ in range(3):
        ops.on_query(q, False, ("::ffff:10.0.0.9", 5000, 0, 0))  # a dual-stack socket's view of it
    assert counters["ops_answered"] == 2 and counters["ops_rate_limited"] == 1
    now[0] = 1.0  # one more for this source, then the total's burst (3) is spent
    ops.on_query(q, False, ("10.0.0.9", 5000))
    other = encode_packet([OpsQuery(1, 6, "10.0.0.10:5000")])
    ops.on_query(other, False, ("10.0.0.10", 5000))
    assert counters["ops_answered"] == 3 and counters["ops_rate_limited"] == 2
    insecure: dict[str, int] = {}
    RemoteOps(FakeAgent(3), lambda *a: sent.append(a), insecure, keyed=False,
              clock=lambda: 0.0).on_query(q, False, ("10.0.0.9", 5000))
    assert insecure == {"ops_queries": 1, "ops_refused_insecure": 1}
    ops.on_query(encode_packet([OpsQuery(1, 5, "x")]) + b"\x00", False, ("10.0.0.9", 5000))
    assert counters["ops_bad_query"] == 1


def test_address_helpers() -> None:
    assert source_addr(("127.0.0.1", 5)) == "127.0.0.1:5"
    assert source_addr(("::ffff:127.0.0.1", 5, 0, 0)) == "127.0.0.1:5"
    assert source_addr(("::1", 5, 0, 0)) == "[::1]:5"
    assert source_addr("junk") is None
    assert same_addr("127.0.0.1:5", "127.0.0.1:5") and not same_addr("127.0.0.1:5", "127.0.0.1:6")
    assert not same_addr("localhost:5", "127.0.0.1:5")  # names are not proof of the source
    assert not same_addr("127.0.0.1:0", "127.0.0.1:0")


async def test_the_gossiprec_command_asks_by_host_name(workdir: str) -> None:
    """The real command line, in its own process, keyring from the environment, the agent named by
    ``localhost`` while it advertises 127.0.0.1 (the name is tried as its addresses too)."""
    import os
    import sys
    async with keyed_cluster(workdir) as agents:
        target = agents[1]
        port = target.addr.rsplit(":", 1)[1]
        env = {**os.environ, "GOSSIPREC_KEYRING": keyring_file(workdir, "operator", KEY_A)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gossiprec", "members", "--agent", f"localhost:{port}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()
        lines = out.decode().splitlines()
        assert lines[0].split()[:3] == ["Node", "Address", "Role"]
        assert sorted(line.split()[0] for line in lines[1:] if not line.startswith("*")) == ["n0", "n2"]
        assert [line.split()[1] for line in lines[1:] if line.startswith("*")] == ["n1"]
        assert target.counters["ops_answered"] >= 1


def test_pages_fit_the_transports_largest_message() -> None:
    sent: list[bytes] = []
    ops = RemoteOps(FakeAgent(200), lambda a, p, r: sent.append(p), {}, keyed=True, clock=lambda: 0.0,
                    max_message=4096)
    ops.on_query(encode_packet([OpsQuery(0, 2**64 - 1, "10.0.0.9:5000")]), False, ("10.0.0.9", 5000))
    assert len(sent) > 1 and all(len(p) <= 4096 for p in sent)
    assert max(len(p) for p in sent) > 4096 - 64  # the pages are as large as allowed


def test_agent_excludes_the_local_flags() -> None:
    out, err = io.StringIO(), io.StringIO()
    assert cmd_status(_args(agent="127.0.0.1:7946", control="/tmp/x.sock"), out, err) == 1
    assert "drop --control-socket / --port" in err.getvalue() and out.getvalue() == ""
