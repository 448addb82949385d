"""A holder of the cluster key, forging SWIM's rumours in other members' names against four real agents.

SWIM's own messages name their author too: an Alive speaks for its member (its address and
incarnation), a Suspect or an observer's Dead for the accuser, a push-pull row for the member it
describes, a Progress record for the member whose training progress it reports (what the hang check
judges; on the virtual clock: ``tests/test_progress_auth.py``). Each test forges one kind (see
:mod:`gossiprec.core.membership` for which are signed and why), waits until every agent counted it
refused (an event), lets the agents exchange more traffic, and checks that no member was suspected,
failed or moved, and that no incarnation was raised (nor, for progress, the forged record kept).
"""

from __future__ import annotations

from typing import Any

from gossiprec.agent.pump import Agent
from gossiprec.bench.hostile import KeyHolder
from gossiprec.core.wire import ALIVE, DEAD, MAX_INCARNATION, PHASES, Alive, Dead, Progress, PushPull, Suspect
from tests.test_forgery_live import _addrs, _count, _keys_known, _refused_by_all, _unchanged
from tests.test_security_live import KEY_A, _view, keyed_cluster, workdir

__all__ = ["workdir"]


def _record(a: Agent, name: str) -> tuple[str, int, int]:
    rec = a.machine.swim.member(name)  # type: ignore[union-attr]
    assert rec is not None
    return rec.addr, rec.incarnation, rec.status


def _records(agents: list[Agent], name: str) -> list[tuple[str, int, int]]:
    return [_record(a, name) for a in agents if a.name != name]


def _inc(a: Agent) -> int:
    return a.machine.incarnation  # type: ignore[union-attr, no-any-return]


async def _setup(agents: list[Agent]) -> tuple[Any, list[Any]]:
    await _keys_known(agents)
    for a in agents:  # every member holds every other's own incarnation (its signed Alive arrived)
        await a.wait_until(lambda a=a: all(_record(a, b.name)[1] == _inc(b) for b in agents if b is not a), 10)
    return _view(agents[0]), [a.subscribe() for a in agents]


async def test_a_forged_alive_moves_no_member_and_raises_no_incarnation(workdir: str) -> None:
    async with keyed_cluster(workdir) as (agents, _):
        view, subs = await _setup(agents)
        victim = agents[2]
        before_records, before_inc = _records(agents, victim.name), _inc(victim)
        # "victim now lives at the forger's address" (probes of it would go nowhere: suspected, evicted);
        # and, to the victim itself, "your incarnation is far above yours" (it would refute up to it)
        forged = Alive(victim.name, "127.0.0.1:9", before_inc + 1000, 0)
        before = [_count(a, "rx_alive_unsigned") for a in agents]
        forger = KeyHolder(KEY_A)
        forger.send([forged], _addrs(agents))
        forger.send([Alive(victim.name, "127.0.0.1:9", before_inc + 1001, 0, bytes(64))], _addrs(agents))
        await _refused_by_all(agents, before, "rx_alive_unsigned")
        await _unchanged(agents, subs, view)
        assert _records(agents, victim.name) == before_records and _inc(victim) == before_inc


async def test_forged_accusations_suspect_nobody(workdir: str) -> None:
    async with keyed_cluster(workdir) as (agents, _):
        view, subs = await _setup(agents)
        victim, accuser = agents[1], agents[3]
        inc = _inc(victim)
        forged = [Suspect(victim.name, inc, accuser.name), Suspect(victim.name, inc, accuser.name, bytes(64)),
                  Dead(victim.name, inc, accuser.name), Dead(victim.name, inc, accuser.name, bytes(64))]
        before = [_count(a, "rx_accusation_unsigned") for a in agents]
        KeyHolder(KEY_A).send(forged, _addrs(agents, accuser.name))
        await _refused_by_all([a for a in agents if a is not accuser],
                              [b for a, b in zip(agents, before) if a is not accuser], "rx_accusation_unsigned")
        await _unchanged(agents, subs, view)
        assert _inc(victim) == inc and {r[2] for r in _records(agents, victim.name)} == {ALIVE}


async def test_a_forged_accusation_at_the_last_incarnation_raises_nothing(workdir: str) -> None:
    async with keyed_cluster(workdir) as (agents, _):
        view, subs = await _setup(agents)
        victim, accuser = agents[0], agents[2]
        inc = _inc(victim)
        # refuted, it would leave the victim at the last incarnation there is: never able to refute again
        forged = [Suspect(victim.name, MAX_INCARNATION - 1, accuser.name),
                  Dead(victim.name, MAX_INCARNATION - 1, accuser.name)]
        before = [_count(a, "rx_accusation_unsigned") for a in agents]
        KeyHolder(KEY_A).send(forged, _addrs(agents, accuser.name))
        await _refused_by_all([a for a in agents if a is not accuser],
                              [b for a, b in zip(agents, before) if a is not accuser], "rx_accusation_unsigned")
        await _unchanged(agents, subs, view)
        assert _inc(victim) == inc


async def test_forged_push_pull_rows_move_and_kill_nobody(workdir: str) -> None:
    async with keyed_cluster(workdir) as (agents, _):
        view, subs = await _setup(agents)
        moved, killed, src = agents[1], agents[2], agents[3]
        rows = ((moved.name, "127.0.0.1:9", _inc(moved) + 1000, ALIVE, 0, 0, -1, 0, 0, 0, 0, b"", b""),
                (killed.name, killed.addr, _inc(killed), DEAD, 0, 0, -1, 0, 0, 0, 0, b"", b""))
        before_moved, before_killed = _records(agents, moved.name), _records(agents, killed.name)
        msg = PushPull(src.name, src.addr, False, True, rows)
        before = [_count(a, "rx_alive_unsigned") for a in agents]
        forger = KeyHolder(KEY_A)
        targets = [a for a in agents if a is not moved]
        for a in targets:
            await forger.stream([msg], a.addr)
        await _refused_by_all(targets, [b for a, b in zip(agents, before) if a is not moved], "rx_alive_unsigned")
        await _unchanged(agents, subs, view)
        assert _records(agents, moved.name) == before_moved and _records(agents, killed.name) == before_killed


async def test_forged_progress_in_a_healthy_members_name_is_refused_everywhere(workdir: str) -> None:
    async with keyed_cluster(workdir) as (agents, _):
        view, subs = await _setup(agents)
        victim = agents[1]
        # "victim is frozen at step 3", at a version that would shut out its own reports for good: taken,
        # the hang check would judge a healthy rank by it (unsigned, and with a signature not its own)
        frozen = 10**9
        forged = [Progress(victim.name, _inc(victim), frozen, 3, PHASES.index("compute"), 100),
                  Progress(victim.name, _inc(victim), frozen + 1, 3, PHASES.index("compute"), 100, 0, 0, bytes(64))]
        targets = [a for a in agents if a is not victim]
        before = [_count(a, "rx_progress_unsigned") for a in targets]
        KeyHolder(KEY_A).send(forged, _addrs(agents, victim.name))
        await _refused_by_all(targets, before, "rx_progress_unsigned")
        await _unchanged(agents, subs, view)
        for a in targets:
            p = a.machine.swim.progress(victim.name)  # type: ignore[union-attr]
            assert p is None or p.version < frozen, (a.name, p)
