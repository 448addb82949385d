"""Outsiders against real agents: what someone who never held the cluster key can cost an agent through
its TCP and UDP ports.

A TCP garbage flood (64 connections, each declaring and sending a multi-MiB frame) against an agent
process leaves its resident set where it was; connections that never send a byte are evicted, so a
spare joining through the seed they hold gets in; forgeries under the cluster's clear-text key id cost
a bounded number of subkey derivations and the members keep their view. The attack code is the
bench's (:mod:`gossiprec.bench.hostile`), which reports the same attacks as figures. Every wait is for a
counter or a state; the memory margins are wide (an agent that buffered declared frames would grow by
the whole declared size, 256 MiB a round).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
from typing import AsyncIterator, Iterator

import pytest

from gossiprec.agent.pump import Agent
from gossiprec.agent.settings import AgentSettings
from gossiprec.agent.transport import TransportLimits
from gossiprec.bench.hostile import (
    TREE, IdleConnections, agents, copied_stream_header, forged_datagrams, tcp_garbage_round, write_keyring,
)
from gossiprec.harness.ports import free_ports

MIB = 1024 * 1024


@pytest.fixture
def workdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="grh", dir="/tmp")  # Unix socket paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_tcp_garbage_flood_leaves_the_agent_rss_flat() -> None:
    with agents(TREE, 1) as (a,):
        before = a.memory_kib()["rss"]
        header = copied_stream_header()
        rounds = []
        for r in range(3):  # random bytes, then a real header copied from the wire, then random again
            ended = asyncio.run(tcp_garbage_round(a.port, 64, 4 * MIB, header if r % 2 else b""))
            assert sum(ended.values()) == 64
            rounds.append(a.memory_kib()["rss"])
        st = a.status()["transport"]
        peak = a.memory_kib()["hwm"]
    grown_mib = (max(rounds) - before) / 1024
    # 64 x 4 MiB declared per round: buffering whole frames would add ~256 MiB a round
    assert grown_mib < 48, (before, rounds)
    assert (peak - before) / 1024 < 64, (before, peak)
    refused = st["rejects"]["bad_magic"] + st["rejects"]["too_large"]
    closed = sum(st["counters"].get(k, 0) for k in ("rx_streams_evicted", "rx_streams_backoff"))
    assert refused + closed >= 3 * 64, st
    assert st["inbound_buffered"] == 0 and st["pending_streams"] == 0, st


@contextlib.asynccontextmanager
async def seed_agent(workdir: str, limits: TransportLimits | None = None) -> AsyncIterator[Agent]:
    s = AgentSettings(name="seed", bind_host="127.0.0.1", port=free_ports(1)[0],
                      keyring=write_keyring(f"{workdir}/keys.json"), control_socket=f"{workdir}/seed.sock")
    a = Agent(s, limits=limits)
    await a.start()
    try:
        yield a
    finally:
        a.abort()
        await a.aclose()


async def test_idle_connections_are_evicted_and_a_join_through_them_completes(workdir: str) -> None:
    async with seed_agent(workdir) as seed:
        t = seed.transport
        assert t is not None
        lim = t.limits
        async with IdleConnections(t.port, lim.max_inbound_streams, max_opens=100_000) as idle:
            # every slot taken by a connection that never sends a byte
            await seed.wait_until(lambda: t.stats()["inbound_streams"] >= lim.max_inbound_streams, 30)
            s = AgentSettings(name="spare", bind_host="127.0.0.1", port=0, seeds=(seed.addr,), role="spare",
                              keyring=f"{workdir}/keys.json", control_socket=f"{workdir}/spare.sock")
            spare = Agent(s)
            await spare.start()
            try:
                await spare.wait_until(lambda: spare.live_count() > 1, 60)
                await seed.wait_until(lambda: seed.live_count() > 1, 60)
            finally:
                spare.abort()
                await spare.aclose()
            c = t.stats()["counters"]
            assert c.get("rx_streams_evicted", 0) >= 1, c  # the spare's connection evicted an idle one
            assert c.get("rx_streams", 0) >= 1, c
            # idle connections do not hold a slot past the first-frame deadline either
            await seed.wait_until(lambda: t.counters.get("rx_streams_idle", 0) >= 1, 30)
            assert idle.closed_by_agent >= 1
            assert t.stats()["pending_streams"] <= lim.max_inbound_streams


async def test_one_source_holds_at_most_its_share_of_pending_connections(workdir: str) -> None:
    limits = TransportLimits(max_pending_per_source=8, first_frame_timeout=600)
    async with seed_agent(workdir, limits) as seed:
        t = seed.transport
        assert t is not None
        async with IdleConnections(t.port, 20, sources=("127.0.0.2",), max_opens=20):
            # past its share, each new one evicts the source's oldest or, in its backoff, is refused
            await seed.wait_until(lambda: t.counters.get("rx_streams_evicted", 0)
                                  + t.counters.get("rx_streams_backoff", 0) >= 12, 30)
            assert t.stats()["pending_streams"] == 8
            async with IdleConnections(t.port, 4, sources=("127.0.0.3",), max_opens=4):
                # another source is not crowded out by the first one's
                await seed.wait_until(lambda: t.stats()["pending_streams"] == 12, 30)
            assert t.counters.get("rx_streams_refused", 0) == 0


async def test_forgeries_under_the_clear_text_key_id_cost_bounded_derivations(workdir: str) -> None:
    limits = TransportLimits(new_sender_rate=50.0, new_sender_burst=100)
    async with seed_agent(workdir, limits) as seed:
        t = seed.transport
        assert t is not None
        packets = forged_datagrams(seed.addr, 5000)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for i, p in enumerate(packets):
                s.sendto(p, ("127.0.0.1", t.port))
                if i % 200 == 199:
                    await asyncio.sleep(0)  # let the agent read (the socket buffer is bounded)
        await seed.wait_until(lambda: t.rejects["auth_failed"] + t.rejects["throttled"] >= 1000, 30)
        elapsed = loop.time() - started
        derived = t.stats()["counters"]["rx_subkey_derivations"]
        assert derived == t.rejects["auth_failed"] <= 100 + 50 * elapsed + 1, (derived, elapsed)
        assert t.rejects["throttled"] >= 1000 - derived > 0


async def test_reconnecting_slow_connections_are_bounded_at_accept_and_a_join_completes(workdir: str) -> None:
    limits = TransportLimits(waste_rate=200.0, waste_burst=50)
    async with seed_agent(workdir, limits) as seed:
        t = seed.transport
        assert t is not None
        # more than two sources' share of pending connections: evicted as fast as they reconnect
        async with IdleConnections(t.port, 2 * limits.max_pending_per_source + 8, max_opens=10**9,
                                   trickle=1.0) as holder:
            await asyncio.sleep(0.5)
            c0, opens0 = dict(t.counters), holder.opens
            await asyncio.sleep(2.0)
            c1, opens1 = dict(t.counters), holder.opens
            accepted = sum(c1.get(k, 0) - c0.get(k, 0) for k in ("rx_streams_evicted", "rx_streams_backoff",
                                                                  "rx_streams_idle"))
            # what the agent spent on them in 2 s is what its budget allows, whatever the attacker opens
            assert accepted <= 2.0 * limits.waste_rate + limits.waste_burst + 20, (c0, c1)
            assert c1.get("rx_streams_backoff", 0) > 0 and c1.get("rx_accept_paused", 0) > 0, c1
            assert opens1 - opens0 <= accepted + 100, (opens0, opens1, accepted)
            s = AgentSettings(name="spare", bind_host="127.0.0.1", port=0, seeds=(seed.addr,), role="spare",
                              keyring=f"{workdir}/keys.json", control_socket=f"{workdir}/spare.sock")
            spare = Agent(s)
            await spare.start()
            try:
                await spare.wait_until(lambda: spare.live_count() > 1, 30)
                await seed.wait_until(lambda: seed.live_count() > 1, 30)
            finally:
                spare.abort()
                await spare.aclose()
