"""The hang check: which of this member's subjects is hung (alive but stuck) or straggling.

What it decides: a hang alert (or its retraction) about a subject, and when to check again; it runs the
straggler check (:mod:`gossiprec.core.stragglers`) on the same sample. Inputs: the training progress
(step, collectives entered, phase, step time, wait inside collectives, and since when that position is
current) of a sample of members, as SWIM last heard it, and when each subject last answered one of our
probes.

Rule: a rank's *position* is (step, collectives entered in that step, phase): ranks that run the same program
issue the same collectives in the same order, so within a step the count says which collective each rank has
reached. The *frontier* is the most advanced position in the sample (this member, its subjects and its
observers: K random members each way, trainers only; in a hang every healthy rank waits at or near the
frontier, so the sample shows it at O(K) per check instead of O(N)). A subject behind the frontier whose
position has not changed for ``max(hang_floor, hang_mult * median step time)`` (``checkpoint_timeout`` at
least while it saves a checkpoint) *while others were ahead of it* is hung, with two exceptions that keep the
ranks waiting for it out: a rank that reports ``waiting`` (inside a collective that waits on its peers) waits
for someone else, and a rank with another one behind it (a smaller position, not waiting) is not the one the
others wait for. So in a tensor-parallel hang (one rank stalled before collective k, its peer inside k, the
other replica in the gradient all-reduce) only the first is judged: by the counts where the sample holds it,
and where it does not because the others report ``waiting``. The stall is dated from when that position began
(its owner's acks carry its age), but not before the earliest moment a member of the sample is known to have
been past it (when its own current position began), and never before this view's install. So a stall every
rank shares (a slow collective, a file system, a long GC) is no one's hang: when the job resumes, this member
sees its own progress at once and others' only at their next answer, and without the second bound every rank
it had not heard from yet would look stalled since the stall began. A subject is judged only on its own word
heard once its threshold has passed: its answer to one of our probes (an ack carries its position and that
position's age) received after the threshold, within ``answered_within``. Its relayed progress may be stale,
and an earlier answer may predate its moving on (a rank slowed just before a collective, then inside the next
one waiting for a hung peer, still reads as stalled at the first): its own later answer shows it moved or
waits, and clears it. An alert whose subject is then seen to have moved (a newer position, ``waiting``
included) is retracted. Only a live one is judged (a crashed one is the probes' business, and its relayed
progress must not date a "hang"): it is probed as its threshold nears. A rank that is slow but moves is no
hang: synchronous training keeps it within a step of the others, and the straggler check finds it by how long
the others wait for it in their collectives (``wait_ms``), not by its position. Progress older than
``progress_stale`` counts for nothing, and a rank that is recovering is judged by the recovery's own timeouts;
but once a rank of the sample recovers from this view's change, the frontier is past every step: a rank still
in its step did not notice the change (stuck outside any collective) and the new groups wait for it. While a
change is under way nothing is judged: every rank waits for the new view. A rank whose step is ahead of every
other by more than synchronous training allows (one step, plus what the time between the reports and their
possible staleness permit: see ``AgreementConfig.step_floor_ms``), with at least two others to witness it, is
the anomaly, not the ranks waiting for it: it is left out of the frontier, and its observers alert it as
``implausible``.
"""

from __future__ import annotations

import bisect
import math
import statistics
from typing import Callable

from gossiprec.core import timers
from gossiprec.core.config import AgreementConfig
from gossiprec.core.events import Straggler
from gossiprec.core.membership import Membership
from gossiprec.core.observer import Observer
from gossiprec.core.overlay import Overlay
from gossiprec.core.port import NodePort
from gossiprec.core.stragglers import StragglerCheck
from gossiprec.core.view import REMOVE, View
from gossiprec.core.wire import HUNG, IMPLAUSIBLE, PHASES, STRAGGLER

RECOVERING = PHASES.index("recovering")
CHECKPOINT = PHASES.index("checkpoint")
WAITING = PHASES.index("waiting")

Position = tuple[int, int, int]
"""(step, collectives entered in that step, phase): the order in which a rank gets through a step."""
AHEAD: Position = (1 << 63, 0, 0)
"""Where recovering ranks stand: past every position of the step they left."""


class HangCheck:
    """The hang check of one :class:`~gossiprec.core.node.Node` (run by its watchdog, by an extra timer
    when a lagging subject's threshold passes between two watchdog rounds, and when a subject past its
    threshold answers our probe)."""

    __slots__ = ("node", "observer", "swim", "acfg", "sample", "check_at", "judged", "awaiting", "stragglers")

    def __init__(self, node: NodePort, observer: Observer, swim: Membership, acfg: AgreementConfig) -> None:
        self.node = node
        self.observer = observer
        self.swim = swim
        self.acfg = acfg
        self.sample: list[str] = []
        """Whose progress the frontier and the typical step time come from (fixed for the view)."""
        self.check_at = float("inf")
        """When an extra hang check is armed (a lagging subject's threshold passes then)."""
        self.judged: dict[str, Position] = {}
        """Subjects we alerted as hung in this view, and the position they were stalled at."""
        self.awaiting: set[str] = set()
        """Subjects whose threshold has passed, waiting for their answer to a probe (their own word) to be
        judged: the check runs again when one answers (see :meth:`answered`)."""
        self.stragglers = StragglerCheck(acfg)
        """The straggler check, on the same sample (see :mod:`gossiprec.core.stragglers`)."""

    def start_view(self, view: View, ov: Overlay) -> None:
        # ourselves, our subjects and our observers (K random members each way), trainers only; fixed for
        # the view, so each check costs O(K) without rebuilding it
        me = self.node.name
        sample = sorted({me} | self.observer.subject_set | set(ov.observers(me))) if me in view else []
        self.sample = [n for n in sample if (m := view.member(n)) is not None and m.role == "trainer"]
        self.stragglers.start_view()
        self.swim.read_progress_of(frozenset(self.sample))  # the records checked as they come (see progress)
        self.judged = {}
        self.awaiting = set()

    def answered(self, subject: str, now: float) -> None:
        """``subject`` answered one of our probes (its ack's progress is on record): judged now if its
        threshold has passed, not at the next watchdog round."""
        if subject in self.awaiting:
            self.run(now)

    def on_timer(self, now: float) -> None:
        """The extra check's timer."""
        if now >= self.check_at:
            self.check_at = float("inf")
        self.run(now)

    def run(self, now: float) -> None:
        node, obs, acfg = self.node, self.observer, self.acfg
        v = node.view
        self.awaiting.clear()
        if v is None or node.name not in v or node.finished is not None:
            return
        if self.judged:
            self._reconsider(now)
        if obs.my_alerts or (node.consensus.votes and node.consensus.decided is None):
            # A change is under way: every rank waits for the new view, so stalls say nothing about hangs
            # (and an alert now would only start a second change behind the first).
            return
        frontier: Position = (-1, 0, 0)
        times = []
        recovering: list[float] = []
        """When each recovering rank of the sample began recovering (never before this view's install)."""
        table: dict[str, tuple[int, int, int, float]] = {}
        """name -> (step, collectives, phase, since): its position and since when it is current"""
        seen: dict[str, tuple[float, float]] = {}
        """name -> (when its record was heard, when its position began): for the plausibility check"""
        waits: dict[str, tuple[int, int, int]] = {}
        """name -> (step, step time, wait per step in collectives): for the straggler check"""
        for name in self.sample:
            if name == node.name:
                step, phase, ms = node.my_progress
                mine = self.swim.my_progress
                coll, wait = mine.coll, mine.wait_ms
                # (never judged: only the frontier, and when it was reached, count)
                since = max(self.swim.progress_since, node.installed_at)
                seen_at, began = now, self.swim.progress_since
            else:
                p = self.swim.progress(name)
                if p is None or now - p.seen_at > acfg.progress_stale:
                    continue  # stale (maybe crashed): neither frontier nor judged
                # the stall clock starts when this position began (its age came on the wire), not at this
                # check; and never before this view was installed
                step, phase, ms, coll, wait = p.step, p.phase, p.step_ms, p.coll, p.wait_ms
                since = max(p.since, node.installed_at)
                seen_at, began = p.seen_at, p.since
            if step < 0:
                continue
            if phase == RECOVERING:
                # a recovering rank waits for its state (the recovery's own timeouts judge it), and it has
                # left the step it was in: see ``moved_on`` below
                recovering.append(since)
                continue
            table[name] = (step, coll, phase, since)
            seen[name] = (seen_at, began)
            waits[name] = (step, ms, wait)
            if ms > 0:
                times.append(ms)
            frontier = max(frontier, (step, coll, phase))
        if frontier[0] < 0 or not times:
            return
        median_s = statistics.median(times) / 1000.0
        threshold = max(acfg.hang_floor, acfg.hang_mult * median_s)
        bogus = _implausible(table, seen, max(acfg.step_floor_ms / 1000.0, median_s), acfg.progress_stale)
        if bogus is not None:
            # a rank ahead of every other by more than synchronous training allows (a counter gone wrong)
            # is the anomaly, not the ranks that wait for it: out of the frontier, and alerted if ours
            del table[bogus]
            del waits[bogus]
            frontier = max((step, coll, phase) for step, coll, phase, _ in table.values())
            if bogus in obs.subject_set and bogus not in obs.alerted:
                obs.alerted[bogus] = IMPLAUSIBLE
                obs.alert(bogus, REMOVE, IMPLAUSIBLE, now)
        moved_on = min(recovering, default=None)
        if moved_on is not None:
            # Ranks recovering from this view's change have left their step; a rank still in it did not
            # notice the change (stuck outside any collective: an abort reaches only a waiting one), and
            # the new groups wait for it. It is behind them, from when they began to recover.
            frontier = AHEAD
        passed: Callable[[Position], float] | None = None
        lowest: Position | None = None
        due = float("inf")
        alerted = obs.alerted
        for s in obs.subjects:
            row = table.get(s)
            if row is None or alerted.get(s) == IMPLAUSIBLE:
                continue
            step, coll, phase, since = row
            pos = (step, coll, phase)
            if pos >= frontier:
                if alerted.get(s) == HUNG:
                    del alerted[s]
                    self.judged.pop(s, None)
                    obs.alert(s, REMOVE, HUNG, now, retract=True)
                continue
            if passed is None:
                passed = _passed_since(table, moved_on)  # (built once, only when someone is behind)
                lowest = _lowest(table, frontier)
            since = max(since, passed(pos))  # behind only since someone got past it
            limit = since + (max(threshold, acfg.checkpoint_timeout) if phase == CHECKPOINT else threshold)
            if moved_on is not None:
                limit += threshold  # the new view must reach its agent before the rank can notice it
            within = acfg.answered_within
            heard = obs.answered.get(s, -math.inf)
            if now >= limit - within and now - heard > within:
                # Probe it as its threshold nears (a rank only briefly behind costs nothing): an answer
                # that shows it moved on or waits clears it before it is due.
                obs.refresh_progress(s)
            stalled = now >= limit  # the same float as ``due`` below: no re-arm at ``now``
            if stalled and (phase == WAITING or (lowest is not None and lowest < pos)):
                # Inside a collective that waits on its peers, or with another rank behind it outside
                # any collective: not the rank the others wait for (that one is judged on its own).
                continue
            if stalled and s not in alerted and (heard < limit or now - heard > within):
                # Judge only on its own word heard since the threshold passed, just now (hung: alive but
                # stuck; a crashed one is the probes' business). Its relayed progress, or an answer from
                # before, may date from before it moved on (into a collective where it waits for the
                # rank that is hung): its answer to a probe sent now says where it is.
                obs.refresh_progress(s)
                self.awaiting.add(s)
                continue
            if stalled and s not in alerted:
                alerted[s] = HUNG
                self.judged[s] = pos
                obs.alert(s, REMOVE, HUNG, now)
            elif not stalled:
                due = min(due, limit)
        if moved_on is None:
            self._stragglers(waits, now)
        # a subject behind the frontier is judged the moment its threshold passes, not at the next
        # watchdog round (up to ``watch_interval`` later): one extra wake-up, only while someone lags
        if now < due < self.check_at and due < now + acfg.watch_interval:
            self.check_at = due
            node.set_timer(due, timers.HANG)

    def _reconsider(self, now: float) -> None:
        """Retract our hang alert about a subject seen to have moved since (a newer position, ``waiting``
        included: it was not the rank the others wait for, or it got going again)."""
        obs = self.observer
        for s, pos in list(self.judged.items()):
            if obs.alerted.get(s) != HUNG:
                del self.judged[s]
                continue
            p = self.swim.progress(s)
            if p is not None and (p.step, p.coll, p.phase) != pos:
                del self.judged[s]
                del obs.alerted[s]
                obs.alert(s, REMOVE, HUNG, now, retract=True)

    def _stragglers(self, waits: dict[str, tuple[int, int, int]], now: float) -> None:
        """Run the straggler check on the sample's fresh rows; report, alert or retract as it says."""
        obs, alerted = self.observer, self.observer.alerted
        judged = [s for s in obs.subjects if alerted.get(s, STRAGGLER) == STRAGGLER]
        for v in self.stragglers.judge(waits, judged):
            if v.kind == "report":
                self.node.emit(Straggler(v.subject, v.behind_ms, v.step, now))
            elif v.kind == "evict" and v.subject not in alerted:
                alerted[v.subject] = STRAGGLER
                obs.alert(v.subject, REMOVE, STRAGGLER, now)
            elif v.kind == "retract" and alerted.get(v.subject) == STRAGGLER:
                del alerted[v.subject]
                obs.alert(v.subject, REMOVE, STRAGGLER, now, retract=True)


def _implausible(table: dict[str, tuple[int, int, int, float]], seen: dict[str, tuple[float, float]],
                 step_s: float, stale_s: float) -> str | None:
    """The one rank whose step is ahead of every other's by more than synchronous training allows: the
    next one's, plus what it may have advanced from when its step began to when the leader's report was
    heard, plus what a report still counted fresh may hide (``stale_s``: an agent starved or stopped
    behind its own trainer reports a position that old; relayed records are older than they look), so
    ``2 + 2 * (dt + stale_s) / step_s`` steps; or None. Only with two others behind it: one rank against
    one other cannot tell a counter gone wrong from the other's report lagging (an agent stopped a few
    steps behind its trainer)."""
    top = second = ""
    best = nxt = -1
    for name, row in table.items():  # (one pass: the hang check runs often in a hang storm)
        step = row[0]
        if step > best:
            top, second, best, nxt = name, top, step, best
        elif step > nxt:
            second, nxt = name, step
    lead = best - nxt
    if len(table) < 3 or lead <= 2:
        return None
    dt = max(0.0, seen[top][0] - seen[second][1])
    return top if lead > 2 + 2 * (dt + stale_s) / step_s else None


def _passed_since(table: dict[str, tuple[int, int, int, float]],
                  moved_on: float | None = None) -> Callable[[Position], float]:
    """For the sample's rows (step, collectives, phase, since), a function of a position: the earliest
    ``since`` among the rows ahead of it (a member ahead got past it no later than its current position
    began). ``moved_on``: when the first recovering rank began to recover (ahead of every position)."""
    rows = sorted(((step, coll, phase), since) for step, coll, phase, since in table.values())
    if moved_on is not None:
        rows.append((AHEAD, moved_on))
    # suffix minima: best[i] = min since over rows[i:]
    best = [0.0] * len(rows)
    low = math.inf
    for i in range(len(rows) - 1, -1, -1):
        low = min(low, rows[i][1])
        best[i] = low
    positions = [pos for pos, _ in rows]

    def passed(pos: Position) -> float:
        i = bisect.bisect_right(positions, pos)
        return best[i] if i < len(best) else math.inf

    return passed


def _lowest(table: dict[str, tuple[int, int, int, float]], frontier: Position) -> Position:
    """The smallest position among the sample's rows behind the frontier that are not waiting inside a
    collective: only a rank there can be the one the others wait for (one further ahead waits for it,
    or for a collective that it has not entered yet)."""
    return min(((step, coll, phase) for step, coll, phase, _ in table.values()
                if phase != WAITING and (step, coll, phase) < frontier), default=frontier)
