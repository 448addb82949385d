"""One member's hang check on a virtual clock: n0 of a trainer-only view hears the others' progress every
50 ms and has its probes answered as the caller says; the alerts it raises for ``hung`` are returned.
Shared by tests/test_node.py and tests/test_hang_collectives.py."""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

from gossiprec.core.config import AgreementConfig, Config
from gossiprec.core.events import AlertRaised
from gossiprec.core.node import Node
from gossiprec.core.records import MemberInfo
from gossiprec.core.topology import JobTopology
from gossiprec.core.view import View, ViewMember
from gossiprec.core.wire import Ack, Ping, Progress, decode_packet, encode_packet

CFG = Config.profile("lan")
ROUND = 0.05
"""Seconds between the gossip rounds that bring n0 the others' progress."""


def hang_observer(names: Sequence[str], **agreement: Any) -> Node:
    """n0 of a view of ``names`` (all trainers), with unreachable alerts and fencing out of the way and a
    1 s hang floor unless ``agreement`` says otherwise (the tests' times are worked out for it)."""
    view = View.initial([ViewMember(n, n, "trainer", i) for i, n in enumerate(names)], JobTopology.ddp(len(names)))
    agreement.setdefault("hang_floor", 1.0)
    acfg = AgreementConfig(alert_after=600.0, confirm_after=600.0, fence_after=600.0, **agreement)
    return Node(CFG, "n0", "n0", incarnation=1, rng=random.Random(3), now=0.0, view=view,
                members={n: MemberInfo(n, n, 1) for n in view.nodes}, member_order=view.nodes, agreement=acfg)


def hung_alerts_of(node: Node, until: float, gossip: Callable[[float, int], list[Progress]],
                   answer: Callable[[Ping, float], Ack | None],
                   own: Callable[[float], None] | None = None) -> list[tuple[float, str]]:
    """Drive ``node`` to ``until``: each round, ``own(t)`` (its trainer's report, if any) and the packet of
    ``gossip(t, version)``; every probe it sends is answered with ``answer(ping, now)`` (None: silence).
    Returns (time, subject) of its ``hung`` alerts."""
    t, version, alerts = 0.0, 0, []
    while t < until:
        version += 1
        if own is not None:
            own(t)
        msgs = gossip(t, version)
        if msgs:
            node.receive(encode_packet(msgs), t)
        step_end = round(t + ROUND, 6)
        while node.next_deadline() <= step_end:
            now = node.next_deadline()
            node.tick(now)
            for send in node.take_sends():  # members answer its probes (a hang is judged on live ranks)
                for m in decode_packet(send.payload, 1 << 20):
                    if isinstance(m, Ping) and (ack := answer(m, now)) is not None:
                        node.receive(encode_packet([ack]), now)
            alerts += [(now, e.subject) for e in node.take_events()
                       if isinstance(e, AlertRaised) and e.reason == "hung"]
        t = step_end
    return alerts
