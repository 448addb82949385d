"""Control socket: handshake, requests, progress reports reaching peers, the event stream (generic
event encoding), garbage handling, permissions, and the blocking client used by training loops. The
tests that wait for the protocol (peers, events, timeouts) run on an in-memory network in virtual time."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack
import pytest

from gossiprec.errors import ConfigError
from gossiprec.agent.jobspec import node_factory
from gossiprec.agent.pump import Agent
from gossiprec.local.client import AsyncControlClient, ControlClient
from gossiprec.local.protocol import CONTROL_VERSION, MAX_REQUEST_FRAME, ControlError, encode_frame, event_to_dict
from gossiprec.local.server import bind_unix_socket
from gossiprec.agent.settings import AgentSettings
from gossiprec.local.launch import control_path_from_env
from tests.support.memnet import MemNetwork
from tests.support.vtime import virtual_time

FAST = (("suspicion_floor", 0.5),)


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="gr", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def settings(sockdir: str, i: int, seeds: tuple[str, ...] = ()) -> AgentSettings:
    return AgentSettings(name=f"n{i}", bind_host="127.0.0.1", port=0, seeds=seeds, insecure=True,
                         control_socket=f"{sockdir}/n{i}.sock", protocol=FAST)


async def raw_connect(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_unix_connection(path)


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    head = await reader.readexactly(4)
    return msgpack.unpackb(await reader.readexactly(int.from_bytes(head, "big")), raw=False)


async def hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> dict[str, Any]:
    writer.write(encode_frame({"op": "hello", "version": CONTROL_VERSION}))
    return await read_frame(reader)


async def expect_error_then_eof(reader: asyncio.StreamReader, code: str) -> None:
    async with asyncio.timeout(5):
        frame = await read_frame(reader)
        assert frame["ok"] is False and frame["error"] == code, frame
        assert await reader.read() == b""  # disconnected


# --- handshake and requests ------------------------------------------------------------------------
async def test_handshake_and_requests(sockdir: str) -> None:
    async with Agent(settings(sockdir, 0)) as agent:
        mode = stat.S_IMODE(os.stat(agent.control_path).st_mode)
        assert mode == 0o600
        reader, writer = await raw_connect(agent.control_path)
        assert (await hello(reader, writer))["node"] == "n0"
        writer.write(encode_frame({"op": "ping", "id": "x"}))  # string ids are echoed
        assert await read_frame(reader) == {"ok": True, "id": "x", "pong": True}
        writer.write(encode_frame({"op": "ping", "noreply": True}))
        writer.write(encode_frame({"op": "ping", "id": 2}))
        assert (await read_frame(reader))["id"] == 2  # the noreply request was not answered
        writer.close()
        async with await AsyncControlClient.connect(agent.control_path) as c:
            assert c.node == "n0"
            pong = await c.request("ping", id="x")  # the client numbers its own requests
            assert pong["pong"] is True and isinstance(pong["id"], int)
            await c.report(step=41, phase="optimizer", step_ms=12.6)
            rows = await c.members()
            me = [r for r in rows if r["self"]][0]
            assert (me["name"], me["step"], me["phase"], me["step_ms"]) == ("n0", 41, "optimizer", 13)
            status = await c.status()
            assert status["node"] == "n0" and status["live"] == 1 and status["state"] == "running"
            await c.request("register_layout", layout={"world": 4, 0: "host-a"})
            assert (await c.request("get_layout"))["layout"] == {"world": 4, 0: "host-a"}
            assert agent.layout == {"world": 4, 0: "host-a"}
            with pytest.raises(ControlError) as exc:
                await c.report(step="ten")  # type: ignore[arg-type]
            assert exc.value.code == "bad_args"
            with pytest.raises(ControlError, match="phase must be one of"):
                await c.report(step=1, phase="lunch")
            assert (await c.request("ping"))["ok"]  # bad arguments do not disconnect
    assert not os.path.exists(agent.control_path)  # removed on close


@virtual_time
async def test_report_reaches_peers(sockdir: str) -> None:
    net = MemNetwork()
    async with net.agent(settings(sockdir, 0)) as a:
        async with net.agent(settings(sockdir, 1, (a.addr,))) as b:
            async with await AsyncControlClient.connect(a.control_path) as c:
                await c.report(step=1234, phase="communicate", step_ms=250)

            def seen() -> bool:
                assert b.machine is not None
                p = b.machine.progress("n0")
                return p is not None and p.step == 1234

            await b.wait_until(seen, 10)  # carried on acks / piggybacked progress
            row = [r for r in b.control_members() if r["name"] == "n0"][0]
            assert row["step"] == 1234 and row["phase"] == "communicate" and row["step_ms"] == 250


# --- garbage ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("payload", "code", "handshake"),
    [
        (b"\x00\x00\x00\x00", "bad_frame", False),                                    # zero length
        ((MAX_REQUEST_FRAME + 1).to_bytes(4, "big") + b"x", "bad_frame", True),      # oversized
        (b"\x00\x00\x00\x02\xc1\xc1", "bad_msgpack", True),                           # 0xc1 is never valid
        (encode_frame([1, 2]), "bad_request", True),                                  # type: ignore[arg-type]
        (encode_frame({"op": 7}), "bad_request", True),
        (encode_frame({"op": "teleport"}), "unknown_op", True),
        (encode_frame({"op": "members"}), "bad_handshake", False),                   # no hello first
        (encode_frame({"op": "hello", "version": 99}), "unsupported_version", False),
    ],
)
async def test_garbage_gets_an_error_and_a_disconnect(sockdir: str, payload: bytes, code: str,
                                                      handshake: bool) -> None:
    async with Agent(settings(sockdir, 0)) as agent:
        reader, writer = await raw_connect(agent.control_path)
        try:
            if handshake:
                assert (await hello(reader, writer))["ok"]
            writer.write(payload)
            await expect_error_then_eof(reader, code)
        finally:
            writer.close()
        # the agent still serves
        async with await AsyncControlClient.connect(agent.control_path) as c:
            assert (await c.request("ping"))["pong"]
        assert agent.control is not None and agent.control.counters[f"refused_{code}"] == 1


async def test_the_bad_handshake_hint_is_a_hello_this_agent_accepts(sockdir: str) -> None:
    """The hint names the version the agent speaks (CONTROL_VERSION), not a stale literal: the hello it
    spells out, sent as is, is accepted."""
    import json
    import re

    async with Agent(settings(sockdir, 0)) as agent:
        reader, writer = await raw_connect(agent.control_path)
        try:
            writer.write(encode_frame({"op": "members"}))
            async with asyncio.timeout(5):
                frame = await read_frame(reader)
        finally:
            writer.close()
        assert frame["error"] == "bad_handshake", frame
        found = re.search(r"\{.*\}", frame["message"])
        assert found is not None, frame
        hinted = json.loads(found.group(0))
        assert hinted == {"op": "hello", "version": CONTROL_VERSION}, frame
        reader, writer = await raw_connect(agent.control_path)
        try:
            writer.write(encode_frame(hinted))
            async with asyncio.timeout(5):
                assert (await read_frame(reader))["ok"] is True
        finally:
            writer.close()


@virtual_time
async def test_handshake_timeout_and_client_vanishing(sockdir: str) -> None:
    async with MemNetwork().agent(settings(sockdir, 0)) as agent:
        assert agent.control is not None
        agent.control.hello_timeout = 0.05
        reader, writer = await raw_connect(agent.control_path)
        await expect_error_then_eof(reader, "timeout")
        writer.close()
        # half a frame, then gone
        reader, writer = await raw_connect(agent.control_path)
        await hello(reader, writer)
        writer.write(b"\x00\x00\x01\x00abc")
        writer.close()
        async with await AsyncControlClient.connect(agent.control_path) as c:
            assert (await c.request("ping"))["pong"]
            await agent.wait_until(lambda: agent.control is not None and agent.control.clients == 1, 5)


# --- events ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Member:
    name: str
    rank: int


@dataclass(frozen=True, slots=True)
class ViewInstalled:
    """Stands in for the agreement layer's events: nested dataclasses, tuples, sets, bytes."""

    epoch: int
    members: tuple[Member, ...]
    tags: frozenset[str]
    digest: bytes
    at: float


def test_event_to_dict_is_generic() -> None:
    ev = ViewInstalled(3, (Member("a", 0), Member("b", 1)), frozenset({"y", "x"}), b"\x01", 1.5)
    d = event_to_dict(ev)
    assert d == {"event": "ViewInstalled", "epoch": 3, "members": [{"name": "a", "rank": 0},
                 {"name": "b", "rank": 1}], "tags": ["x", "y"], "digest": b"\x01", "at": 1.5}
    msgpack.packb(d, use_bin_type=True)
    assert event_to_dict({"event": "Custom", "n": (1, 2)}) == {"event": "Custom", "n": [1, 2]}


@virtual_time
async def test_subscribe_streams_machine_events_generically(sockdir: str) -> None:
    """A factory whose machine emits an extra event type: it reaches control clients unchanged."""
    net = MemNetwork()

    make = node_factory(settings(sockdir, 0))

    def factory(*args: Any, **kw: Any) -> Any:
        machine = make(*args, **kw)
        real = machine.take_events

        def take_events() -> list[Any]:
            out = real()
            if any(type(e).__name__ == "MemberJoined" for e in out):
                out.append(ViewInstalled(7, (Member("n0", 0), Member("n1", 1)), frozenset({"v"}), b"", 0.0))
            return out

        machine.take_events = take_events  # type: ignore[method-assign]
        return machine

    async with net.agent(settings(sockdir, 0), machine_factory=factory) as a:
        async with await AsyncControlClient.connect(a.control_path) as c:
            await c.subscribe()
            async with net.agent(settings(sockdir, 1, (a.addr,))):
                async with asyncio.timeout(10):
                    joined = await c.next_event()
                    while joined["event"] != "MemberJoined":
                        joined = await c.next_event()
                    view = await c.next_event()
                    while view["event"] != "ViewInstalled":
                        view = await c.next_event()
                    assert joined["name"] == "n1" and joined["role"] == "trainer"
                    assert view["epoch"] == 7 and view["members"][1] == {"name": "n1", "rank": 1}
                    # requests still work on a subscribed connection, events are kept aside
                    assert (await c.request("ping"))["pong"]
            async with asyncio.timeout(10):
                ev = await c.next_event()
                while ev["event"] not in ("MemberLeft", "MemberFailed"):
                    ev = await c.next_event()
                assert ev == {"event": "MemberLeft", "name": "n1", "incarnation": ev["incarnation"],
                              "at": ev["at"]}


async def test_slow_subscriber_is_disconnected_on_overflow(sockdir: str) -> None:
    async with Agent(settings(sockdir, 0)) as agent:
        reader, writer = await raw_connect(agent.control_path)
        await hello(reader, writer)
        writer.write(encode_frame({"op": "subscribe", "id": 1}))
        assert (await read_frame(reader))["ok"]
        sub = next(iter(agent.hub._subs))
        sub._maxsize = 3
        for i in range(10):  # published faster than anyone reads
            agent.hub.publish(Member(f"m{i}", i))
        async with asyncio.timeout(5):
            frames = []
            while True:
                f = await read_frame(reader)
                frames.append(f)
                if f.get("error") == "overflow":
                    break
        assert await reader.read() == b""
        writer.close()
        assert agent.control is not None and agent.control.counters["overflows"] == 1


# --- socket file -----------------------------------------------------------------------------------
def test_stale_socket_is_replaced_and_live_one_refused(sockdir: str) -> None:
    path = f"{sockdir}/c.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # file left behind, nobody listening
    live, _ = bind_unix_socket(path)
    try:
        with pytest.raises(ConfigError, match="another agent"):
            bind_unix_socket(path)
    finally:
        live.close()
    open(f"{sockdir}/plain", "w").close()
    with pytest.raises(ConfigError, match="not a socket"):
        bind_unix_socket(f"{sockdir}/plain")
    with pytest.raises(ConfigError, match="longer than 107"):
        bind_unix_socket("/tmp/" + "x" * 120)
    shared = f"{sockdir}/shared"
    os.mkdir(shared)
    os.chmod(shared, 0o777)  # anyone could swap the socket file
    with pytest.raises(ConfigError, match="writable by others without the sticky bit"):
        bind_unix_socket(f"{shared}/c.sock")
    os.chmod(shared, 0o1777)  # like /tmp: allowed
    sock, _ = bind_unix_socket(f"{shared}/c.sock")
    sock.close()


# --- blocking client -------------------------------------------------------------------------------
async def test_blocking_client_from_a_training_thread(sockdir: str) -> None:
    async with Agent(settings(sockdir, 0)) as a:
        def trainer() -> dict[str, Any]:
            os.environ["GOSSIPREC_CONTROL"] = a.control_path
            try:
                assert control_path_from_env() == a.control_path
                with ControlClient.from_env(timeout=5) as c:
                    assert c.node == "n0"
                    rtt = c.ping()
                    c.subscribe()
                    for step in range(50):
                        c.report(step, "compute", 10, wait=False)
                    c.report(50, "optimizer", 11)
                    c.notify("report", step="bad")
                    with pytest.raises(ControlError, match="bad_args"):
                        c.request("report", step=-5)
                    c.register_layout({"ranks": [0, 1]})
                    me = [r for r in c.members() if r["self"]][0]
                    ev = c.next_event(timeout=0)
                    return {"rtt": rtt, "me": me, "layout": c.layout(), "ev": ev,
                            "last_error": c.last_error, "status": c.status()}
            finally:
                del os.environ["GOSSIPREC_CONTROL"]

        out = await asyncio.to_thread(trainer)
        assert out["me"]["step"] == 50 and out["me"]["phase"] == "optimizer"
        assert out["layout"] == {"ranks": [0, 1]}
        assert out["last_error"] is not None and out["last_error"].code == "bad_args"
        assert out["status"]["control"]["op_report"] == 53
        assert 0 < out["rtt"] < 1.0
        assert out["ev"] is None or "event" in out["ev"]
    with pytest.raises(ControlError) as exc:
        ControlClient(a.control_path, timeout=1)
    assert exc.value.code == "unavailable"
    with pytest.raises(ConfigError, match="GOSSIPREC_CONTROL is not set"):
        control_path_from_env({})


async def test_blocking_client_sees_disconnect_when_agent_stops(sockdir: str) -> None:
    a = Agent(settings(sockdir, 0))
    await a.start()
    c = await asyncio.to_thread(ControlClient, a.control_path)
    try:
        await a.aclose()
        with pytest.raises(ControlError) as exc:
            await asyncio.to_thread(c.request, "ping")
        assert exc.value.code == "disconnected"
    finally:
        c.close()


async def test_a_write_to_a_closed_client_is_a_disconnect_not_an_error(sockdir: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    class ClosedWriter:
        """What uvloop's transport does once closed (a trainer that exited while events flowed)."""

        def write(self, data: bytes) -> None:
            raise RuntimeError("unable to perform operation on <UnixTransport closed=True>; the handler is closed")

        async def drain(self) -> None:
            pass

        def close(self) -> None:
            pass

    async with Agent(settings(sockdir, 0)) as agent:
        server = agent.control
        assert server is not None
        reader = asyncio.StreamReader()
        reader.feed_data(encode_frame({"op": "hello", "version": CONTROL_VERSION}))
        reader.feed_eof()
        with caplog.at_level(logging.ERROR):
            await server.serve_stream(reader, ClosedWriter())  # type: ignore[arg-type]
        assert server.counters.get("errors", 0) == 0 and server.counters["disconnects"] >= 1
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records
