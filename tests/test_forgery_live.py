"""A holder of the cluster key, forging other members' words against four real keyed agents.

The forger (:class:`gossiprec.bench.hostile.KeyHolder`) seals whatever it likes with the cluster key,
so the transport accepts every packet; what must refuse them is the per-member signature check
(:mod:`gossiprec.core.auth`). Each test forges one kind of message, waits until every agent has
counted the forgery as refused (an event, not a sleep), lets the agents exchange more traffic, and
checks that no view changed and nobody was evicted, suspected or fenced.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from gossiprec.bench.hostile import KeyHolder
from gossiprec.core.consensus import FAST
from gossiprec.core.view import REMOVE, Change, View, changes_digest
from gossiprec.core.wire import (
    UNREACHABLE, Accept, Accepted, Alert, Dead, Decided, JobDone, Prepare, Proposal, ViewDelta, ViewState, Vote,
    Votes,
)
from gossiprec.agent.pump import Agent
from tests.test_security_live import KEY_A, N, _view, bad_events, keyed_cluster, traffic_flows, workdir

__all__ = ["workdir"]


def _count(a: Agent, *names: str) -> int:
    m = a.machine
    assert m is not None
    return sum(m.counters.get(n, 0) for n in names)


async def _refused_by_all(agents: list[Agent], before: list[int], *names: str) -> None:
    for a, b in zip(agents, before):
        await a.wait_until(lambda a=a, b=b: _count(a, *names) > b, 10)


async def _keys_known(agents: list[Agent]) -> None:
    """Every agent has bound every member's key (claims gossiped since the start)."""
    for a in agents:
        await a.wait_until(lambda a=a: len(a.machine.auth.keys) == len(agents), 10)  # type: ignore[union-attr]


def _addrs(agents: list[Agent], but: str = "") -> list[str]:
    return [a.addr for a in agents if a.name != but]


def _held(a: Agent) -> View:
    v = a.machine.view  # type: ignore[union-attr]
    assert v is not None
    return v


@asynccontextmanager
async def _cluster(workdir: str) -> AsyncIterator[tuple[list[Agent], Any, list[Any], View]]:
    """The four keyed agents once each holds every member's key: (agents, their view as `_view` reads
    it, a subscription to each, the view itself)."""
    async with keyed_cluster(workdir) as (agents, _):
        await _keys_known(agents)
        yield agents, _view(agents[0]), [a.subscribe() for a in agents], _held(agents[0])


def _removal(v: View, victim: str) -> tuple[bytes, tuple[tuple[str, int, str, str, str], ...]]:
    """The digest and change rows of a view change that removes ``victim`` from ``v``."""
    return changes_digest(v.epoch, v.config_id, [Change(victim, REMOVE)]), ((victim, REMOVE, "", "", ""),)


async def _unchanged(agents: list[Agent], subs: list[Any], view: Any) -> None:
    await traffic_flows(agents, 3 * N)
    assert bad_events(subs) == []
    assert [_view(a) for a in agents] == [view] * len(agents)


async def test_a_forged_leave_in_another_members_name_evicts_nobody(workdir: str) -> None:
    async with _cluster(workdir) as (agents, view, subs, _):
        victim = agents[2]
        forger = KeyHolder(KEY_A)
        others = [a for a in agents if a is not victim]
        before = [_count(a, "rx_leave_unsigned") for a in others]
        inc = victim.machine.incarnation  # type: ignore[union-attr]
        # unsigned, and with a signature that is not the victim's
        forger.send([Dead(victim.name, inc, victim.name)], _addrs(agents, victim.name))
        forger.send([Dead(victim.name, inc, victim.name, bytes(64))], _addrs(agents, victim.name))
        await _refused_by_all(others, before, "rx_leave_unsigned")
        await _unchanged(agents, subs, view)


async def test_forged_alerts_in_every_observers_name_evict_nobody(workdir: str) -> None:
    async with _cluster(workdir) as (agents, view, subs, v):
        victim = agents[1]
        epoch, config = v.epoch, v.config_id
        forger = KeyHolder(KEY_A)
        names = ("rx_sig_invalid", "rx_sig_unknown_author")
        before = [_count(a, *names) for a in agents]
        alerts = [Alert(epoch, config, a.name, victim.name, REMOVE, UNREACHABLE, False, "", "", "", sig=sig)
                  for a in agents if a is not victim for sig in (b"", bytes(64))]
        forger.send(alerts, _addrs(agents))
        await _refused_by_all(agents, before, *names)
        await _unchanged(agents, subs, view)


async def test_a_forged_decision_removing_a_healthy_member_decides_nothing(workdir: str) -> None:
    async with _cluster(workdir) as (agents, view, subs, v):
        victim = agents[3].name
        digest, rows = _removal(v, victim)
        before = [_count(a, "rx_decided_unproven") for a in agents]
        KeyHolder(KEY_A).send([Decided(v.epoch, v.config_id, digest, rows)], _addrs(agents, victim))
        await _refused_by_all([a for a in agents if a.name != victim],
                              [b for a, b in zip(agents, before) if a.name != victim], "rx_decided_unproven")
        await _unchanged(agents, subs, view)


async def test_forged_votes_of_every_member_reach_no_quorum(workdir: str) -> None:
    async with _cluster(workdir) as (agents, view, subs, v):
        victim = agents[2].name
        digest, rows = _removal(v, victim)
        full = bytes([(1 << len(v)) - 1])
        forged = [Proposal(v.epoch, v.config_id, digest, rows), Votes(v.epoch, v.config_id, digest, full)]
        forged += [Vote(v.epoch, v.config_id, digest, a.name, bytes(64)) for a in agents if a.name != victim]
        names = ("rx_votes_unsigned", "rx_sig_invalid")
        before = [_count(a, *names) for a in agents]
        KeyHolder(KEY_A).send(forged, _addrs(agents, victim))
        others = [a for a in agents if a.name != victim]
        await _refused_by_all(others, [b for a, b in zip(agents, before) if a.name != victim], *names)
        for a in others:
            assert a.machine.consensus.votes.get(digest, 0) == 0  # type: ignore[union-attr]
        await _unchanged(agents, subs, view)


async def test_forged_classic_rounds_neither_block_nor_decide(workdir: str) -> None:
    async with _cluster(workdir) as (agents, view, subs, v):
        coord, victim = agents[0].name, agents[3].name
        digest, rows = _removal(v, victim)
        top = 2**31
        forged = [Prepare(v.epoch, v.config_id, top, coord, bytes(64)),    # outrank every real round
                  Accept(v.epoch, v.config_id, top, coord, digest, rows, bytes(64))]
        forged += [Accepted(v.epoch, v.config_id, top, coord, digest, a.name, bytes(64)) for a in agents]
        forged += [JobDone(v.epoch, 10, agents[1].name, bytes(64))]          # "training is over"
        before = [_count(a, "rx_sig_invalid") for a in agents]
        KeyHolder(KEY_A).send(forged, _addrs(agents))
        await _refused_by_all(agents, [b + len(forged) - 1 for b in before], "rx_sig_invalid")
        for a in agents:
            c = a.machine.consensus  # type: ignore[union-attr]
            assert c.promised == FAST and c.decided is None and a.machine.finished is None  # type: ignore[union-attr]
        await _unchanged(agents, subs, view)


async def test_forged_views_are_not_installed(workdir: str) -> None:
    async with _cluster(workdir) as (agents, view, subs, v):
        victim = agents[2].name
        far = v.to_wire()
        far[0] = 2**62  # the wire's last epoch: the next real view could never be encoded
        nv = v.next([Change(victim, REMOVE)])
        delta = ViewDelta(v.epoch, v.config_id, ((nv.config_id, ((victim, REMOVE, "", "", ""),)),))
        forger = KeyHolder(KEY_A)
        before = [_count(a, "rx_view_untrusted") for a in agents]
        for a in agents:
            for msg in (ViewState(far), ViewState(far, agents[1].name, bytes(64)),
                        delta, ViewDelta(delta.epoch, delta.config, delta.steps, agents[1].name, bytes(64))):
                await forger.stream([msg], a.addr)
        await _refused_by_all(agents, [b + 3 for b in before], "rx_view_untrusted")
        await _unchanged(agents, subs, view)
