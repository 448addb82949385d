"""Fencing: whether this member must stop its trainer, and when it may go on again; run by the watchdog.

What it decides: a :class:`~gossiprec.core.events.Fenced` (through ``Node._fence``) or an
:class:`~gossiprec.core.events.Unfenced`. Inputs: the view, SWIM's counts of live and suspect members,
the consensus state, the cut withheld for reachability, and the observer's alerts.

A member fences when, for ``fence_after``, it sees fewer than a majority of the view alive, has a change
it cannot get decided (no quorum on its side, or a cut withheld), or finds every one of its subjects
unreachable (the one cut off). A member removed from the view fences at the install. A fenced member
still in an intact view with a live majority unfences after ``unfence_after``; otherwise it rejoins
through the majority's members (:mod:`~gossiprec.core.catchup`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gossiprec.core.consensus import FAST
from gossiprec.core.events import Unfenced
from gossiprec.core.view import View
from gossiprec.core.wire import ALIVE, UNREACHABLE

if TYPE_CHECKING:
    from gossiprec.core.node import Node

RESTART_FENCE = "restarted: the view still holds this node's previous process, which is being removed"


def watch(node: Node, v: View, now: float) -> None:
    """One watchdog round's fence check (``v``: the view, which holds this member)."""
    acfg = node.acfg
    obs = node.observer
    # suspects count as unreachable here: a side of a partition suspects the other within seconds
    live = node.swim.n_live - node.swim.n_suspect
    # a vote is out (ours or a peer's) but nothing is decided: a cut was ready somewhere, yet no quorum
    # answers (the minority side of a partition; its members do not all see a cut of their own)
    cons = node.consensus
    pending = cons.decided is None and (cons.my_vote is not None or bool(cons.votes) or bool(cons.proposals)
                                        or cons.promised != FAST or node._withheld)
    # every subject we watch is unreachable from here: most likely we are the one cut off (a node
    # that hears nobody; Lifeguard keeps such a node from suspecting, so SWIM's count stays high)
    subjects = obs.subjects
    cut_off = len(subjects) >= 2 and all(obs.alerted.get(x) == UNREACHABLE for x in subjects)
    if live < v.majority() or pending or cut_off:
        node._healthy_since = None
        if node._trouble_since is None:
            node._trouble_since = now
        elif now - node._trouble_since >= acfg.fence_after:
            node._fence("no quorum: cannot reach a majority of the view" if live < v.majority()
                        else "cut off: no subject answers" if cut_off
                        else "the cut leaves no reachable majority of the view: not proposed" if node._withheld
                        else "no decision within fence_after", now)
    else:
        node._trouble_since = None
        # A restart's observers alert at once (each gets its Hello), so their change is proposed within
        # a settle window, and pending keeps the fence until the old place is removed. Alerts that
        # never make a change (one observer's stale record, say) are not a restart: once they have
        # had unstable_timeout to become one, the fence ends as any other does.
        if node.fenced and not node.spec_conflict and (
                node.fenced != RESTART_FENCE or now - node._fenced_at >= acfg.unstable_timeout):
            maybe_unfence(node, v, now)


def maybe_unfence(node: Node, v: View, now: float) -> None:
    """Fenced, still in the view, nothing pending and a live majority by SWIM's count: once the view's
    own members that SWIM holds alive (not suspect) are a majority for ``unfence_after``, unfence.
    Only a new view unfenced before, and after a final heal a member could stay fenced in an intact
    view for good. It first asks two members for newer news: a view that removed it is installed
    (and fences it for that reason) long before it would unfence here."""
    alive = 0
    for m in v.members:
        rec = node.swim.member(m.node)
        if rec is not None and rec.status == ALIVE:
            alive += 1
    if alive < v.majority():
        node._healthy_since = None
        return
    if node._healthy_since is None:
        # the window opens with the question actually sent (catch-ups are rate-limited: one skipped
        # would let the member unfence without having asked); else the next watchdog round asks
        node.catchup.catch_up(now)
        if node.catchup.last_catchup == now:
            node._healthy_since = now
    elif now - node._healthy_since >= node.acfg.unfence_after:
        node._healthy_since = None
        node.fenced = ""
        node._events.append(Unfenced(v.epoch, now))
