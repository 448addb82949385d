"""A holder of the cluster key (no member's signing key) sends forged agreement and catch-up messages of
every kind to real keyed agents: an unsigned ``Decided([remove n2])``, a ``Proposal`` with a ``Votes``
bitmap of every member, forged votes, rounds, views, spec claims and a phantom's join request. Nothing
of it is any member's signed word: for 8 s no agent fences, alerts or changes its view (the fence
clock is 3 s), and a real crash afterwards (an agent aborted: every socket closed, no leave, as a
SIGKILL leaves it) is agreed as fast as in the same cluster without the forgery."""

from __future__ import annotations

import asyncio
import os
import time

from gossiprec.agent.pump import Agent
from gossiprec.bench.hostile import KeyHolder
from gossiprec.core.events import MemberSuspected
from gossiprec.core.wire import ViewDelta, ViewState
from tests.test_forged_agreement_core import _forgeries
from tests.test_forgery_live import _cluster, _count
from tests.test_security_live import KEY_A, bad_events, workdir

__all__ = ["workdir"]

QUIET_S = 8.0
"""How long after the forgery nothing may happen (fence_after is 3 s)."""
REASONS = ("rx_decided_unproven", "rx_proposal_unproven", "rx_votes_unsigned", "rx_spec_claim_unproven")


async def _agreed_after_crash(agents: list[Agent], victim: Agent) -> float:
    """Abort ``victim``; seconds until every other agent holds a view without it."""
    t0 = time.monotonic()
    victim.abort()
    for a in agents:
        if a is not victim:
            await a.wait_until(lambda a=a: victim.name not in (a.machine.view or ()), 20)  # type: ignore[union-attr]
    return time.monotonic() - t0


async def _run(workdir: str, forge: bool) -> float:
    async with _cluster(workdir) as (agents, view, subs, v):
        if forge:
            forger = KeyHolder(KEY_A)
            sink = "127.0.0.1:9"  # where the made-up names say they listen (discard)
            msgs = _forgeries(v, agents[2].name, sink)
            before = [[_count(a, r) for r in REASONS] for a in agents]
            for a in agents:
                for m in msgs:  # one datagram each; views on the stream, as catch-up sends them
                    if isinstance(m, (ViewState, ViewDelta)):
                        await forger.stream([m], a.addr)
                    else:
                        forger.send([m], [a.addr])
            for a, b in zip(agents, before):  # every agent saw and counted each kind's refusal
                for r, n in zip(REASONS, b):
                    await a.wait_until(lambda a=a, r=r, n=n: _count(a, r) > n, 10)
            await asyncio.sleep(QUIET_S)
            # no fence, alert, failure or view change. A suspicion alone is SWIM's (forged agreement messages
            # never reach it): four agents share this process's event loop, which a loaded machine starves
            # now and then past a probe's timeout (seen at load 7 on 2 cores, with and without the forgery)
            assert [e for e in bad_events(subs) if not isinstance(e, MemberSuspected)] == []
            for a in agents:
                m = a.machine
                assert m is not None and m.fenced == "" and m.view is not None and m.view.epoch == v.epoch
                assert m.consensus.proposals == {} and m.fencing.trouble_since is None
        return await _agreed_after_crash(agents, agents[3])


async def test_forged_agreement_fences_nobody_and_a_crash_is_agreed_as_fast(workdir: str) -> None:
    for sub in ("a", "b"):
        os.mkdir(os.path.join(workdir, sub))
    base = await _run(os.path.join(workdir, "a"), forge=False)
    forged = await _run(os.path.join(workdir, "b"), forge=True)
    print(f"crash -> agreed: {base:.2f} s without forgery, {forged:.2f} s after it")
    assert forged <= base + 1.5, (base, forged)
