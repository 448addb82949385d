"""A holder of the cluster key, forging other members' words against four real keyed agents.

The forger (:class:`gossiprec.bench.hostile.KeyHolder`) seals whatever it likes with the cluster key,
so the transport accepts every packet; what must refuse them is the per-member signature check
(:mod:`gossiprec.core.auth`). Each test forges one kind of message, waits until every agent has
counted the forgery as refused (an event, not a sleep), lets the agents exchange more traffic, and
checks that no view changed and nobody was evicted, suspected or fenced.
"""

from __future__ import annotations

from typing import Any

from gossiprec.bench.hostile import KeyHolder
from gossiprec.core.view import REMOVE
from gossiprec.core.wire import UNREACHABLE, Alert, Dead
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


def _addrs(agents: list[Agent], but: str = "") -> list[str]:
    return [a.addr for a in agents if a.name != but]


async def _unchanged(agents: list[Agent], subs: list[Any], view: Any) -> None:
    await traffic_flows(agents, 3 * N)
    assert bad_events(subs) == []
    assert [_view(a) for a in agents] == [view] * len(agents)


async def test_a_forged_leave_in_another_members_name_evicts_nobody(workdir: str) -> None:
    async with keyed_cluster(workdir) as (agents, _):
        victim = agents[2]
        view = _view(agents[0])
        subs = [a.subscribe() for a in agents]
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
    async with keyed_cluster(workdir) as (agents, _):
        victim = agents[1]
        view = _view(agents[0])
        assert view is not None
        epoch, config, _ = view
        subs = [a.subscribe() for a in agents]
        forger = KeyHolder(KEY_A)
        names = ("rx_sig_invalid", "rx_sig_unknown_author")
        before = [_count(a, *names) for a in agents]
        alerts = [Alert(epoch, config, a.name, victim.name, REMOVE, UNREACHABLE, False, "", "", "", sig)
                  for a in agents if a is not victim for sig in (b"", bytes(64))]
        forger.send(alerts, _addrs(agents))
        await _refused_by_all(agents, before, *names)
        await _unchanged(agents, subs, view)
