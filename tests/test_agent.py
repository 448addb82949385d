"""The asyncio agent: cluster formation, crash and leave detection and contained machine errors on an
in-memory network in virtual time (tests.support.memnet, .vtime); sealing, refusal counting, bind
conflicts and keyring reload on real loopback sockets; the timer strategies; and the settings loader
(flags > env > file > defaults)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import pytest

from gossiprec.core.machine import Machine
from gossiprec.core.events import MemberFailed, MemberJoined, MemberLeft
from gossiprec.core.auth import KeyBook
from gossiprec.core.wire import Alive, KeyClaim, encode_packet
from gossiprec.errors import ConfigError
from gossiprec.agent.hub import AgentLeaving
from gossiprec.agent.jobspec import node_factory
from gossiprec.agent.pump import Agent
from gossiprec.agent.timers import AlignedTimer, PlainTimer, loop_timer
from gossiprec.security.crypto import Sealer
from gossiprec.security.keyring import Keyring
from gossiprec.security.signing import Ed25519Crypto
from gossiprec.agent.settings import (
    DEFAULT_PORT, AgentSettings, add_agent_arguments, load_settings, settings_from_args, split_host_port,
)
from tests.support.memnet import MemNetwork
from tests.support.vtime import virtual_time

FAST = (("suspicion_floor", 0.5),)
"""Shorter suspicion for tests (the lan default is 1.2 s); probing stays at production timings."""
KEY_A = bytes(range(32))
KEY_B = bytes(range(1, 33))


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="gr", dir="/tmp")  # Unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def node_settings(sockdir: str, i: int, seeds: tuple[str, ...] = (), **kw: object) -> AgentSettings:
    base: dict[str, object] = dict(name=f"n{i}", bind_host="127.0.0.1", port=0, seeds=seeds, insecure=True,
                                   control_socket=f"{sockdir}/n{i}.sock", protocol=FAST)
    base.update(kw)
    return AgentSettings(**base)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def cluster(sockdir: str, n: int, net: MemNetwork | None = None, **kw: object) -> AsyncIterator[list[Agent]]:
    """``n`` agents in this event loop, joined through the first; yields once all see ``n`` live. On
    ``net`` (in memory, the loop's clock) when given, else on loopback sockets."""
    make = Agent if net is None else net.agent
    agents: list[Agent] = []
    try:
        first = make(node_settings(sockdir, 0, **kw))  # type: ignore[arg-type]
        await first.start()
        agents.append(first)
        for i in range(1, n):
            a = make(node_settings(sockdir, i, (first.addr,), **kw))  # type: ignore[arg-type]
            await a.start()
            agents.append(a)
        for a in agents:
            try:
                await a.wait_until(lambda a=a: a.live_count() == n, 10)
            except TimeoutError:
                seen = {x.name: sorted(m.name for m in x.machine.members() if m.live) if x.machine else None
                        for x in agents}
                raise AssertionError(f"{a.name} did not see {n} live members within 10 s; live as seen by each: "
                                     f"{seen}; counters of {a.name}: {a.control_status()['machine']}") from None
        yield agents
    finally:
        for a in reversed(agents):
            a.abort()
        for a in reversed(agents):
            await a.aclose()


def live_names(agent: Agent) -> set[str]:
    assert agent.machine is not None
    return {m.name for m in agent.machine.members() if m.live}


# --- cluster behaviour (in memory, virtual time) -----------------------------------------------------
@virtual_time
async def test_cluster_forms_through_seeds(sockdir: str) -> None:
    async with cluster(sockdir, 4, MemNetwork()) as agents:
        names = {a.name for a in agents}
        for a in agents:
            assert live_names(a) == names
            assert a.member_status("n3") == "alive"
        for a in agents:  # every member is known to every other under the incarnation it holds
            assert a.machine is not None and a.machine.incarnation >= a.incarnation > 0
            for b in agents:
                assert b.machine is not None
                assert {m.name: m.incarnation for m in b.machine.members()}[a.name] == a.machine.incarnation
        # incarnations are wall-clock milliseconds taken at start: a later start (a restart) is never older
        incarnations = [a.incarnation for a in agents]
        assert incarnations == sorted(incarnations)
        assert abs(agents[0].incarnation - time.time() * 1000) < 60_000


@virtual_time
async def test_abrupt_stop_is_detected_as_failure(sockdir: str) -> None:
    clock = asyncio.get_running_loop().time
    async with cluster(sockdir, 4, MemNetwork()) as agents:
        victim, survivors = agents[3], agents[:3]
        subs = [a.subscribe() for a in survivors]
        victim.abort()  # sockets closed, no leave: a crash
        t0 = clock()
        for a, sub in zip(survivors, subs):
            ev = await a.wait_for_event(lambda e: isinstance(e, (MemberFailed, MemberLeft)) and e.name == "n3",
                                        15, sub)
            assert isinstance(ev, MemberFailed), ev
        detect = clock() - t0
        assert detect < 15
        for a in survivors:
            assert a.member_status("n3") == "dead"
            assert live_names(a) == {"n0", "n1", "n2"}


@virtual_time
async def test_graceful_stop_is_seen_as_left(sockdir: str) -> None:
    async with cluster(sockdir, 3, MemNetwork()) as agents:
        leaver, stay = agents[2], agents[:2]
        subs = [a.subscribe() for a in stay]
        own = leaver.subscribe()
        t0 = leaver.clock()
        await leaver.aclose()  # graceful: leave, drain a few gossip intervals, close
        assert isinstance(own.get_nowait(), AgentLeaving)
        for a, sub in zip(stay, subs):
            ev = await a.wait_for_event(lambda e: isinstance(e, (MemberFailed, MemberLeft)) and e.name == "n2",
                                        5, sub)
            assert isinstance(ev, MemberLeft), ev
            assert ev.at - t0 < 0.5  # the leave went out at once, not after a probe timeout
            assert a.member_status("n2") == "left"


@virtual_time
async def test_stop_makes_run_leave_and_return(sockdir: str) -> None:
    net = MemNetwork()
    async with cluster(sockdir, 2, net) as agents:
        sub = agents[0].subscribe()
        extra = net.agent(node_settings(sockdir, 9, (agents[0].addr,)))
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(extra.run())
            await agents[0].wait_for_event(lambda e: isinstance(e, MemberJoined) and e.name == "n9", 10, sub)
            await extra.wait_until(lambda: extra.live_count() == 3, 10)  # it knows whom to tell
            extra.stop()
            ev = await agents[0].wait_for_event(lambda e: isinstance(e, MemberLeft) and e.name == "n9", 5, sub)
        assert task.done() and ev.name == "n9"


# --- sealing and refusals (loopback sockets) -----------------------------------------------------------
def keyring_file(directory: str, key: bytes, name: str = "keys.json") -> str:
    path = os.path.join(directory, name)
    ring = Keyring([key])
    ring.save(path)
    return path


async def test_secure_cluster_counts_and_ignores_bad_datagrams(sockdir: str) -> None:
    path = keyring_file(sockdir, KEY_A)
    async with cluster(sockdir, 2, insecure=False, keyring=path) as agents:
        target = agents[0]
        assert target.transport is not None
        host, port = split_host_port(target.addr, 0)
        rejects = target.transport.rejects
        before = dict(rejects)
        evil = KeyBook("evil", Ed25519Crypto.generate())  # a newcomer: its key claim, then its own signed Alive
        forged = encode_packet([KeyClaim("evil", evil.crypto.public_key),
                                evil.sign(Alive("evil", "127.0.0.1:9", 5, 0))])
        right = Sealer(Keyring([KEY_A]), "gossiprec")
        wrong = Sealer(Keyring([KEY_B]), "gossiprec")
        plain = Sealer(None, "gossiprec", insecure=True)
        good = right.seal(forged, target.addr)
        tampered = bytearray(good)
        tampered[-1] ^= 0x01
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(bytes(tampered), (host, port))         # auth_failed
            s.sendto(wrong.seal(forged, target.addr), (host, port))  # unknown_key (not in the keyring)
            s.sendto(right.seal(forged, agents[1].addr), (host, port))  # wrong_receiver (for n1)
            s.sendto(plain.seal(forged), (host, port))      # bad_magic (plain kind to a keyed node)
            s.sendto(b"\x00" * 10, (host, port))            # truncated
            s.sendto(b"x" * 5000, (host, port))             # too_large
            s.sendto(good, (host, port))                    # authentic: must be accepted...
            s.sendto(good, (host, port))                    # ...once: replay
        await target.wait_until(lambda: target.member_status("evil") is not None
                                and rejects["replay"] > before["replay"], 5)
        for reason in ("auth_failed", "unknown_key", "bad_magic", "truncated", "too_large", "replay",
                       "wrong_receiver"):
            assert rejects[reason] == before[reason] + 1, (reason, dict(rejects))
        # the only member added is the one from the authentic packet
        assert target.member_status("evil") == "alive"
        assert live_names(agents[1]) >= {"n0", "n1"}
        assert target.control_status()["transport"]["rejects"]["auth_failed"] >= 1


async def test_node_with_another_key_cannot_join(sockdir: str) -> None:
    good = keyring_file(sockdir, KEY_A, "a.json")
    bad = keyring_file(sockdir, KEY_B, "b.json")
    async with cluster(sockdir, 2, insecure=False, keyring=good) as agents:
        outsider = Agent(node_settings(sockdir, 7, (agents[0].addr,), insecure=False, keyring=bad),
                         join_retry_s=0.2)
        async with outsider:
            t = agents[0].transport
            assert t is not None
            await agents[0].wait_until(lambda: t.rejects["unknown_key"] >= 1, 5)
            assert agents[0].member_status("n7") is None
            assert outsider.live_count() == 1


async def test_keyring_rotation_is_picked_up(sockdir: str) -> None:
    path = keyring_file(sockdir, KEY_A)
    agent = Agent(node_settings(sockdir, 0, insecure=False, keyring=path), keyring_check_s=3600)
    async with agent:
        assert agent.reload_keyring() is False  # unchanged file: one stat, nothing reloaded
        ring = Keyring.load(path)
        ring.install(KEY_B)
        ring.use(KEY_B)
        ring.save(path)
        assert agent.reload_keyring() is True
        assert agent.keyring is not None and agent.keyring.primary == KEY_B
        Path(path).write_text("{not json")
        os.chmod(path, 0o600)
        assert agent.reload_keyring(force=True) is False  # a broken file keeps the keys in memory
        assert agent.keyring.primary == KEY_B
        assert agent.counters["keyring_errors"] == 1


@virtual_time
async def test_machine_errors_are_contained(sockdir: str) -> None:
    net = MemNetwork()
    calls = {"n": 0}
    s = node_settings(sockdir, 0)
    make = node_factory(s)

    def fragile(*args: Any, **kw: Any) -> Machine:
        machine = make(*args, **kw)
        real = machine.receive

        def receive(data: bytes, now: float, reliable: bool = False) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("bug in the machine")
            real(data, now, reliable)

        machine.receive = receive  # type: ignore[method-assign]
        return machine

    a = net.agent(s, machine_factory=fragile)
    async with a:
        b = net.agent(node_settings(sockdir, 1, (a.addr,)), join_retry_s=0.1)
        async with b:
            await a.wait_until(lambda: a.live_count() == 2, 10)
        assert a.counters["machine_errors"] == 1


async def test_bind_conflict_is_a_config_error(sockdir: str) -> None:
    async with cluster(sockdir, 1) as agents:
        port = split_host_port(agents[0].addr, 0)[1]
        clash = Agent(node_settings(sockdir, 5, port=port))
        with pytest.raises(ConfigError, match="another --port"):
            await clash.start()


# --- settings ---------------------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_agent_arguments(p)
    return p.parse_args(argv)


def test_settings_precedence_flags_env_file_defaults(tmp_path: Path) -> None:
    toml = tmp_path / "agent.toml"
    toml.write_text('port = 7001\nrole = "spare"\nseeds = ["a:1", "b"]\ncluster = "filec"\ninsecure = true\n'
                    '[protocol]\nprobe_interval = 0.2\n')
    env = {"GOSSIPREC_CONFIG": str(toml), "GOSSIPREC_PORT": "7002", "GOSSIPREC_RANK": "3"}
    s = settings_from_args(parse(["--port", "7003", "--protocol", "probe_timeout=0.3"]), env)
    assert s.port == 7003  # flag beats env beats file
    assert s.rank == 3  # env
    assert s.role == "spare" and s.cluster == "filec"  # file
    assert s.seed_addrs() == ("a:1", f"b:{DEFAULT_PORT}")
    cfg = s.protocol_config()
    assert cfg.probe_interval == 0.2 and cfg.probe_timeout == 0.3 and cfg.cluster == "filec"
    s2 = settings_from_args(parse([]), {"GOSSIPREC_CONFIG": str(toml), "GOSSIPREC_PORT": "7002"})
    assert s2.port == 7002
    s3 = settings_from_args(parse(["--insecure"]), {})
    assert s3.port == DEFAULT_PORT and s3.role == "trainer" and s3.profile == "lan"


def test_settings_report_every_bad_value_with_its_source(tmp_path: Path) -> None:
    env = {"GOSSIPREC_ROLE": "boss", "GOSSIPREC_PROFILE": "moon", "GOSSIPREC_INSECURE": "1"}
    with pytest.raises(ConfigError) as exc:
        settings_from_args(parse(["--port", "70000", "--seed", "h:xx"]), env)
    msg = str(exc.value)
    for part in ("--port: expected a port number", "GOSSIPREC_ROLE: expected one of trainer, spare",
                 "GOSSIPREC_PROFILE", "port 'xx' is not a number"):
        assert part in msg, msg
    with pytest.raises(ConfigError, match="GOSSIPREC_RANK: expected an integer"):
        load_settings({}, {"GOSSIPREC_RANK": "three", "GOSSIPREC_INSECURE": "yes"})
    with pytest.raises(ConfigError, match="no keyring"):
        load_settings({}, {"XDG_CONFIG_HOME": str(tmp_path)})
    with pytest.raises(ConfigError, match="exclude each other"):
        load_settings({"insecure": True, "keyring": "/x"}, {})
    with pytest.raises(ConfigError, match="unknown protocol setting 'probe_intervall'"):
        settings_from_args(parse(["--insecure", "--protocol", "probe_intervall=1"]), {})
    bad = tmp_path / "bad.toml"
    bad.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="unknown setting"):
        load_settings({}, {"GOSSIPREC_CONFIG": str(bad)})
    bad.write_text("port = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings({}, {"GOSSIPREC_CONFIG": str(bad)})
    with pytest.raises(ConfigError, match="wildcard"):
        AgentSettings(insecure=True, advertise="0.0.0.0:1")
    with pytest.raises(ConfigError, match="suspicion_floor"):
        AgentSettings(insecure=True, protocol=(("suspicion_floor", -1.0),))


def test_protocol_table_sets_agreement_fields_too(tmp_path: Path) -> None:
    toml = tmp_path / "agent.toml"
    toml.write_text('insecure = true\n[protocol]\nprobe_interval = 0.2\nhang_floor = 0.5\nevict_stragglers = true\n')
    s = settings_from_args(parse(["--protocol", "fence_after=5", "--protocol", "k=6"]),
                           {"GOSSIPREC_CONFIG": str(toml)})
    agreement = s.agreement_config()
    assert (agreement.hang_floor, agreement.evict_stragglers, agreement.fence_after, agreement.k) == (0.5, True, 5.0, 6)
    assert agreement.hang_mult == 3.0  # untouched fields keep their defaults
    assert s.protocol_config().probe_interval == 0.2  # and the detection fields still reach Config
    with pytest.raises(ConfigError, match="hang_floor must be a finite number >= 0"):
        settings_from_args(parse(["--insecure", "--protocol", "hang_floor=-1"]), {})
    with pytest.raises(ConfigError, match="hang_floor must be > 0"):
        settings_from_args(parse(["--insecure", "--protocol", "hang_floor=0"]), {})
    with pytest.raises(ConfigError, match="k must be an integer >= 1"):
        settings_from_args(parse(["--insecure", "--protocol", "k=0"]), {})
    # the agent's machine (joining without a job spec here) runs with exactly these parameters
    import random

    machine = node_factory(s)(s.protocol_config(), "n1", "127.0.0.1:1", incarnation=1, role="spare", now=0.0,
                              rng=random.Random(1), seeds=())
    assert machine.acfg == agreement


def test_timer_alignment_and_exit_bell_switches(tmp_path: Path) -> None:
    on = settings_from_args(parse(["--insecure"]), {})
    assert on.align_timers is True and on.exit_bell is True  # both on by default
    off = settings_from_args(parse(["--insecure", "--no-align-timers", "--no-exit-bell"]), {})
    assert off.align_timers is False and off.exit_bell is False
    env = settings_from_args(parse(["--insecure"]), {"GOSSIPREC_ALIGN_TIMERS": "0", "GOSSIPREC_EXIT_BELL": "no"})
    assert env.align_timers is False and env.exit_bell is False
    toml = tmp_path / "agent.toml"
    toml.write_text("insecure = true\nalign_timers = false\nexit-bell = false\n")
    f = load_settings({}, {"GOSSIPREC_CONFIG": str(toml)})
    assert f.align_timers is False and f.exit_bell is False
    with pytest.raises(ConfigError, match="GOSSIPREC_EXIT_BELL: expected a boolean"):
        load_settings({}, {"GOSSIPREC_INSECURE": "1", "GOSSIPREC_EXIT_BELL": "maybe"})


@pytest.mark.parametrize(("align", "ms_clock", "deadline", "now", "tick_at"), [
    (False, False, 10.0, 10.0, 10.0),      # due: tick now
    (False, False, 10.001, 10.0, None),    # a plain timer that fired early is set again
    (True, True, 10.001, 10.0, "slept"),   # an aligned one sleeps the fraction out, then ticks
    (True, True, 10.5, 10.0, None),        # a deadline that moved later: set again
    (True, False, 9.0, 10.0, 10.0),        # overdue: tick now
])
def test_the_loop_timer_ticks_when_due(align: bool, ms_clock: bool, deadline: float, now: float,
                                       tick_at: object) -> None:
    clock = iter([10.0015])
    timer = AlignedTimer(lambda: next(clock), ms_clock) if align else PlainTimer(lambda: next(clock))
    got = timer.settle(deadline, now)
    assert got == (10.0015 if tick_at == "slept" else tick_at)


@virtual_time
async def test_the_loop_timer_follows_the_loop(sockdir: str) -> None:
    loop = asyncio.get_running_loop()
    assert isinstance(loop_timer(loop, loop.time, False), PlainTimer)
    aligned = loop_timer(loop, loop.time, True)
    assert isinstance(aligned, AlignedTimer) and aligned.ms_clock is False  # not uvloop: no ms rounding
    fired = asyncio.Event()
    aligned.arm(loop, loop.time() + 0.001, fired.set)
    await asyncio.wait_for(fired.wait(), 5)
    net = MemNetwork()
    for align in (True, False):  # an agent with either timer ticks when its machine's deadline comes
        agent = net.agent(node_settings(sockdir, 0, align_timers=align))
        async with agent:
            assert isinstance(agent._loop_timer, AlignedTimer) is align
            m = agent.machine
            assert m is not None
            first = m.next_deadline()
            await agent.wait_until(lambda m=m, first=first: m.next_deadline() > first, 5)  # a tick moved it on


def test_settings_default_keyring_and_addresses(tmp_path: Path) -> None:
    keyring = tmp_path / "gossiprec" / "keyring.json"
    keyring.parent.mkdir()
    keyring.write_text("{}")
    s = load_settings({}, {"XDG_CONFIG_HOME": str(tmp_path)})
    assert s.keyring == str(keyring)
    assert split_host_port("[::1]:80", 1) == ("::1", 80)
    assert split_host_port("::1", 7) == ("::1", 7)
    assert split_host_port("host", 7) == ("host", 7)
    with pytest.raises(ConfigError):
        split_host_port("host:0", 7)


def test_insecure_from_the_environment_does_not_override_an_existing_keyring(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keyring = tmp_path / "gossiprec" / "keyring.json"
    keyring.parent.mkdir()
    keyring.write_text("{}")
    env = {"XDG_CONFIG_HOME": str(tmp_path), "GOSSIPREC_INSECURE": "1"}
    with pytest.raises(ConfigError, match="GOSSIPREC_INSECURE asks for insecure mode, but this user has a "
                                          "keyring") as exc:
        load_settings({}, env)
    assert "pass --insecure on the command line" in str(exc.value)
    conf = tmp_path / "agent.toml"
    conf.write_text("insecure = true\n")
    with pytest.raises(ConfigError, match="asks for insecure mode"):
        load_settings({}, {"XDG_CONFIG_HOME": str(tmp_path)}, str(conf))
    with caplog.at_level(logging.WARNING, logger="gossiprec.agent.settings"):
        s = load_settings({"insecure": True}, env)  # explicit on the command line: allowed, with a warning
    assert s.insecure and s.keyring is None
    assert any("keyring exists" in r.getMessage() for r in caplog.records)
    # without a keyring on disk the variable still works as before
    assert load_settings({}, {"XDG_CONFIG_HOME": str(tmp_path / "none"), "GOSSIPREC_INSECURE": "1"}).insecure
