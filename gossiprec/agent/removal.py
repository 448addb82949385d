"""When this node leaves the agreed view, and whether it was fenced before: one reading for every launcher.

``gossiprec run`` and the torchrun rendezvous both act on their training processes when the agents
remove this node (the others have replaced it; a stopped or stuck trainer must not wake up later with
stale state). Both read that moment from the agent's event stream in the same way, here:

- a :class:`~gossiprec.core.events.ViewInstalled` without this node, while it was a member, is a
  removal; one while it was not (a joiner waiting for admission) is not;
- the agent's own ``Fenced`` whose reason starts with "removed" is the same removal told again unless
  no view said so first (then it is the removal);
- any other ``Fenced`` (no quorum, a spec mismatch) is remembered until ``Unfenced`` or readmission:
  a node fenced before it was removed was cut off, not replaced while running, so its trainer dropped
  its state and may wait as a spare;
- a view with this node again is a readmission;
- the agent's own departure (:class:`~gossiprec.agent.hub.AgentLeaving`) ends the stream: a leaving
  agent sees no more views, so a launcher must act on it then (a stopped trainer is not left behind).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterable, AsyncIterator

from gossiprec.agent.hub import AgentLeaving
from gossiprec.core.events import Fenced, Unfenced, ViewInstalled


@dataclass(frozen=True, slots=True)
class Removed:
    """This node left the agreed view."""

    reason: str
    fenced_first: str  # why the node was fenced before the removal; "" if it was not


@dataclass(frozen=True, slots=True)
class Readmitted:
    """This node is in the agreed view again (of ``epoch``)."""

    epoch: int


@dataclass(frozen=True, slots=True)
class Leaving:
    """This node's agent is leaving the job (the last change told)."""

    reason: str
    failed: bool


Change = Removed | Readmitted | Leaving


async def membership_changes(agent: Any, events: AsyncIterable[object]) -> AsyncIterator[Change]:
    """Each removal of ``agent``'s node and each readmission after one, in order, from ``events``
    (the agent's subscription), then its departure if it leaves; ends when the subscription does."""
    view = agent.machine.view if agent.machine is not None else None
    member = view is not None and agent.name in view
    fenced_first = ""
    told = False  # this removal was reported already (a view without us, then the agent's fence)
    async for ev in events:
        if isinstance(ev, ViewInstalled):
            if agent.name in ev.members:
                if not member or told:
                    yield Readmitted(ev.epoch)
                member, fenced_first, told = True, "", False
                continue
            if not member:
                continue  # a joiner is outside the view until admitted
            reason = f"removed from the view of epoch {ev.epoch}"
        elif isinstance(ev, Fenced) and ev.reason.startswith("removed"):
            if told:
                continue
            reason = f"{ev.reason} (epoch {ev.epoch})"
        elif isinstance(ev, Fenced):
            fenced_first = ev.reason
            continue
        elif isinstance(ev, Unfenced):
            fenced_first = ""
            continue
        elif isinstance(ev, AgentLeaving) and ev.name == agent.name:
            yield Leaving(ev.reason, ev.failed)
            return
        else:
            continue
        member, told = False, True
        yield Removed(reason, fenced_first)
