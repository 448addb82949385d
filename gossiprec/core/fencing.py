"""Fencing: whether this member must stop its trainer, and when it may go on again; run by the watchdog.

What it decides: a :class:`~gossiprec.core.events.Fenced` or an :class:`~gossiprec.core.events.Unfenced`,
and why this member is fenced (:attr:`Fencing.reason`). Inputs: the view, SWIM's counts of live and
suspect members, the consensus state, the cut withheld for reachability, the observer's alerts, and
since when this member waits for a change it cannot get decided (:meth:`Fencing.trouble`).

A member fences when, for ``fence_after``, it sees fewer than a majority of the view alive, has a change
it cannot get decided (no quorum on its side, or a cut withheld), or finds every one of its subjects
unreachable (the one cut off). A member removed from the view fences at the install. A fenced member
still in an intact view with a live majority unfences after ``unfence_after``; otherwise it rejoins
through the majority's members (:mod:`~gossiprec.core.catchup`). A member whose view 0 differs from
another's is fenced for good (:meth:`Fencing.spec_mismatch`).
"""

from __future__ import annotations

from gossiprec.core.catchup import CatchUp
from gossiprec.core.config import AgreementConfig
from gossiprec.core.events import Fenced, JobSpecMismatch, Unfenced
from gossiprec.core.membership import Membership
from gossiprec.core.observer import Observer
from gossiprec.core.port import NodePort
from gossiprec.core.view import View
from gossiprec.core.wire import ALIVE, UNREACHABLE

RESTART_FENCE = "restarted: the view still holds this node's previous process, which is being removed"
SPEC_FENCE = "job spec mismatch"
SPEC_SEEN_MAX = 64
"""Distinct unproven spec claims reported (each once) before the rest are only counted."""


class Fencing:
    """The fencing part of one node: whether it is fenced, why, and since when it is in trouble."""

    __slots__ = ("node", "swim", "observer", "catchup", "acfg", "reason", "spec_conflict", "fenced_at",
                 "trouble_since", "healthy_since", "spec_seen")

    def __init__(self, node: NodePort, swim: Membership, observer: Observer, catchup: CatchUp,
                 acfg: AgreementConfig, now: float) -> None:
        self.node = node
        self.swim = swim
        self.observer = observer
        self.catchup = catchup
        self.acfg = acfg
        self.reason = ""
        """Why this member is fenced ("" when it is not)."""
        self.spec_conflict = ""
        """Set when a member of view 0 holds another view 0: fenced for good, out of agreement."""
        self.fenced_at = now
        self.trouble_since: float | None = None
        """Since when this member waits for a change it cannot get decided (see :meth:`watch`)."""
        self.healthy_since: float | None = None
        """Since when this fenced member (still in its view) reaches a majority with nothing pending."""
        self.spec_seen: set[tuple[str, str, bool, bool]] = set()

    def start_view(self) -> None:
        self.trouble_since = None
        self.healthy_since = None

    def trouble(self, now: float) -> None:
        """A change is under way: trouble from now, unless it began earlier."""
        if self.trouble_since is None:
            self.trouble_since = now

    def fence(self, reason: str, now: float) -> None:
        if not self.reason:
            self.reason = reason
            self.fenced_at = now
            v = self.node.view
            self.node.emit(Fenced(v.epoch if v else -1, reason, now))

    def member_again(self, epoch: int, now: float) -> None:
        """A view that holds this member is installed: a fence ends (but not a spec conflict's)."""
        if self.reason and not self.spec_conflict:
            self.reason = ""
            self.node.emit(Unfenced(epoch, now))

    def spec_mismatch(self, peer: str, theirs: str, other: View | None, now: float, proven: bool = True) -> None:
        """Another view 0 than ours (``other``, when it arrived): fence for good and take no part in
        agreement from here on (neither side may decide a view that the other would not). Not ``proven``
        (with signatures on, not the signed word of a member of our view 0; see
        :meth:`~gossiprec.core.catchup.CatchUp._spec_claim`): reported and counted, nothing fenced."""
        node = self.node
        v = node.view
        assert v is not None
        key = (peer, theirs, other is not None, proven)
        if not proven:
            node.counters["rx_spec_claim_unproven"] = node.counters.get("rx_spec_claim_unproven", 0) + 1
            if len(self.spec_seen) >= SPEC_SEEN_MAX:
                return  # (names and digests a key holder may make up freely: reported a bounded number of times)
        if key in self.spec_seen:
            return
        self.spec_seen.add(key)
        only_ours: tuple[str, ...] = ()
        only_theirs: tuple[str, ...] = ()
        differ: tuple[str, ...] = ()
        if other is not None:
            mine = {m.node: (m.addr, m.role, m.rank) for m in v.members}
            them = {m.node: (m.addr, m.role, m.rank) for m in other.members}
            only_ours = tuple(sorted(set(mine) - set(them)))
            only_theirs = tuple(sorted(set(them) - set(mine)))
            differ = tuple(sorted(n for n in set(mine) & set(them) if mine[n] != them[n]))
        node.counters["spec_mismatch"] = node.counters.get("spec_mismatch", 0) + 1
        node.emit(JobSpecMismatch(peer, v.config_id, theirs, only_ours, only_theirs, differ, now))
        if proven and not self.spec_conflict:
            self.spec_conflict = (f"{SPEC_FENCE}: this node's view 0 is {v.config_id}, "
                                  f"{peer or 'another member'}'s is {theirs}")
            self.reason = ""  # this reason replaces any other
            self.fence(self.spec_conflict, now)

    def watch(self, v: View, now: float) -> None:
        """One watchdog round's fence check (``v``: the view, which holds this member)."""
        acfg = self.acfg
        obs = self.observer
        # suspects count as unreachable here: a side of a partition suspects the other within seconds
        live = self.swim.n_live - self.swim.n_suspect
        # a vote is out (ours or a peer's) but nothing is decided: a cut was ready somewhere, yet no quorum
        # answers (the minority side of a partition; its members do not all see a cut of their own)
        cons = self.node.consensus
        withheld = self.node.withheld
        # (a vote that a healed partition left behind, whose removals the alerts no longer back, is not)
        pending = cons.decided is None and (withheld or cons.change_pending())
        # every subject we watch is unreachable from here: most likely we are the one cut off (a node
        # that hears nobody; Lifeguard keeps such a node from suspecting, so SWIM's count stays high)
        subjects = obs.subjects
        cut_off = len(subjects) >= 2 and all(obs.alerted.get(x) == UNREACHABLE for x in subjects)
        if live < v.majority() or pending or cut_off:
            self.healthy_since = None
            if self.trouble_since is None:
                self.trouble_since = now
            elif now - self.trouble_since >= acfg.fence_after:
                self.fence("no quorum: cannot reach a majority of the view" if live < v.majority()
                           else "cut off: no subject answers" if cut_off
                           else "the cut leaves no reachable majority of the view: not proposed" if withheld
                           else "no decision within fence_after", now)
        else:
            self.trouble_since = None
            # A restart's observers alert at once (each gets its Hello), so their change is proposed within
            # a settle window, and pending keeps the fence until the old place is removed. Alerts that
            # never make a change (one observer's stale record, say) are not a restart: once they have
            # had unstable_timeout to become one, the fence ends as any other does.
            if self.reason and not self.spec_conflict and (
                    self.reason != RESTART_FENCE or now - self.fenced_at >= acfg.unstable_timeout):
                self.maybe_unfence(v, now)

    def maybe_unfence(self, v: View, now: float) -> None:
        """Fenced, still in the view, nothing pending and a live majority by SWIM's count: once the view's
        own members that SWIM holds alive (not suspect) are a majority for ``unfence_after``, unfence.
        Only a new view unfenced before, and after a final heal a member could stay fenced in an intact
        view for good. It first asks two members for newer news: a view that removed it is installed
        (and fences it for that reason) long before it would unfence here."""
        alive = 0
        for m in v.members:
            rec = self.swim.member(m.node)
            if rec is not None and rec.status == ALIVE:
                alive += 1
        if alive < v.majority():
            self.healthy_since = None
            return
        if self.healthy_since is None:
            # the window opens with the question actually sent (catch-ups are rate-limited: one skipped
            # would let the member unfence without having asked); else the next watchdog round asks
            self.catchup.catch_up(now)
            if self.catchup.last_catchup == now:
                self.healthy_since = now
        elif now - self.healthy_since >= self.acfg.unfence_after:
            self.healthy_since = None
            self.reason = ""
            self.node.emit(Unfenced(v.epoch, now))
