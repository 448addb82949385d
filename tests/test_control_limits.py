"""Control-socket clients cannot hold the agent's resources: one that never reads is aborted after the
write timeout (its socket closed at once, not left to a close that waits for it), one that stays silent
is closed after the idle timeout unless it subscribed, and idle clients in every slot cannot lock out
``gossiprec status`` (the quietest is evicted). Real Unix sockets; every wait is for an event or a
counter, the timeouts only bound them."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from typing import Any, Iterator

import msgpack
import pytest

from gossiprec.agent.pump import Agent
from gossiprec.agent.settings import AgentSettings
from gossiprec.local.client import AsyncControlClient, ControlClient
from gossiprec.local.protocol import CONTROL_VERSION, encode_frame
from gossiprec.local.server import ControlServer


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="grl", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


class BigStatus:
    """A backend whose status reply is large, so that a client that does not read fills its socket."""

    node_name = "big"

    def control_report(self, step: int, phase: int, step_ms: int) -> None: ...
    def control_set_state(self, committed_step: int, inflight_step: int | None, state_bytes: int,
                          transfer_port: int | None) -> None: ...
    def control_finished(self, step: int) -> None: ...
    def control_recovered(self, record: dict[str, Any]) -> None: ...
    def control_checked(self, ok: bool) -> None: ...
    def control_members(self) -> list[dict[str, Any]]:
        return []

    def control_status(self) -> dict[str, Any]:
        return {"node": "big", "blob": "x" * 256 * 1024}

    def control_set_layout(self, layout: dict[Any, Any]) -> None: ...
    def control_layout(self) -> dict[Any, Any] | None:
        return None

    def control_subscribe(self) -> Any:
        raise AssertionError("not used")


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    head = await reader.readexactly(4)
    return msgpack.unpackb(await reader.readexactly(int.from_bytes(head, "big")), raw=False)


async def hello(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(encode_frame({"op": "hello", "version": CONTROL_VERSION}))
    assert (await read_frame(reader))["ok"]
    return reader, writer


def socket_inodes() -> set[str]:
    """``socket:[inode]`` of every socket this process holds open."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:"):
            out.add(link)
    return out


async def wait_for(cond: Any, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


async def test_clients_that_never_read_are_aborted_after_the_write_timeout(sockdir: str) -> None:
    async with ControlServer(f"{sockdir}/c.sock", BigStatus(), write_timeout=0.3) as server:
        base = socket_inodes()
        clients = [await hello(server.path) for _ in range(20)]
        mine = {os.readlink(f"/proc/self/fd/{w.get_extra_info('socket').fileno()}") for _, w in clients}
        # both ends of each connection live in this process: the server's are the new sockets not ours
        # (counted by inode, so that sockets other tests leave to the garbage collector do not count)
        servers = socket_inodes() - base - mine
        assert len(mine) == 20 and len(servers) >= 20, (len(mine), len(servers))
        for _, w in clients:
            for _ in range(40):  # 10 MiB of replies asked for, none read
                w.write(encode_frame({"op": "status"}))
        await wait_for(lambda: server.clients == 0)
        await asyncio.sleep(0)  # the transports' close callbacks
        # the server's ends are gone (aborted), although the clients still hold theirs unread
        await wait_for(lambda: not (servers & socket_inodes()))
        assert mine <= socket_inodes()
        assert server.counters["disconnects"] == 20
        for _, w in clients:
            w.close()


async def test_silent_clients_time_out_and_subscribers_do_not(sockdir: str) -> None:
    async with Agent(AgentSettings(name="n0", bind_host="127.0.0.1", port=0, insecure=True,
                                   control_socket=f"{sockdir}/n0.sock")) as agent:
        assert agent.control is not None
        agent.control.idle_timeout = 0.3
        async with await AsyncControlClient.connect(agent.control_path) as sub:
            await sub.subscribe()
            reader, writer = await hello(agent.control_path)
            async with asyncio.timeout(30):
                frame = await read_frame(reader)
                assert frame["ok"] is False and frame["error"] == "timeout", frame
                assert await reader.read() == b""
            writer.close()
            assert (await sub.request("ping"))["pong"]  # silent longer than that, but subscribed: kept
        assert agent.control.counters["refused_timeout"] == 1


async def test_idle_clients_in_every_slot_do_not_lock_out_status(sockdir: str) -> None:
    async with Agent(AgentSettings(name="n0", bind_host="127.0.0.1", port=0, insecure=True,
                                   control_socket=f"{sockdir}/n0.sock")) as agent:
        assert agent.control is not None
        idle = [await hello(agent.control_path) for _ in range(agent.control.max_clients)]
        await wait_for(lambda: agent.control is not None and agent.control.clients == agent.control.max_clients)

        def status() -> dict[str, Any]:
            with ControlClient(agent.control_path, timeout=10) as c:  # what `gossiprec status` does
                return c.status()

        st = await asyncio.to_thread(status)
        assert st["node"] == "n0"
        assert agent.control.counters["clients_evicted"] >= 1
        assert agent.control.counters.get("clients_refused", 0) == 0
        for _, w in idle:
            w.close()
