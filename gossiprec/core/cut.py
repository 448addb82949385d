"""Multi-node cut detection (Rapid): turn observers' alerts into one proposal per view change.

What it decides: *when* to propose a view change, and *which* changes it contains. Inputs are alerts
``(observer, subject, kind)`` gossiped in the current epoch (and their retractions); the output is a sorted
change set, or nothing yet.

Rule: a subject with at least H alerts is *stable*; with at least L but fewer than H it is *unstable*.
A proposal is emitted when at least one subject is stable, no subject is unstable (an unstable subject
stops blocking after ``unstable_timeout``: a flaky observer cannot stall the cluster forever), and no
alert arrived during the last ``settle`` seconds (the alerts of a correlated failure arrive within a
short window; waiting for it to close lands them in one view change).

Implicit alerts: while some subjects are stable or unstable, an observer of a subject that is itself in
that set counts as alerting it (it cannot speak for itself: the failed rack observes its own members),
once the subject has real alerts close to L from observers outside that set.

Doubt: while a member that SWIM suspected during this view (it may have failed with the others; its
observers' first accusations are still on their way) has too few alerts to be unstable, no proposal is
made, for at most ``doubt_timeout`` since this member heard of it (the probes of a failed rack's members
start over a probe round, and the alerts of a node on a lossy link come later still).

Discounted witnesses: alerts raised by an observer that is itself stable for removal do not count
against other subjects (an isolated node accuses everyone; its own observers all accuse it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gossiprec.core.overlay import Overlay, watermarks
from gossiprec.core.view import JOIN, REMOVE, Change


@dataclass(slots=True)
class _Tally:
    kind: int
    observers: set[str] = field(default_factory=set)
    addr: str = ""
    host: str = ""
    rack: str = ""
    unstable_since: float | None = None
    departed: bool = False  # the subject announced its own departure (graceful leave / process exit)
    alerted_at: float = float("-inf")
    """When the last alert about the subject arrived (a repeat too): see :meth:`CutDetector.supports`."""


@dataclass(slots=True)
class CutDetector:
    overlay: Overlay
    settle: float
    unstable_timeout: float
    settle_departed: float = 0.005
    _tallies: dict[tuple[str, int], _Tally] = field(default_factory=dict)
    last_change: float = float("-inf")
    last_departure: float = float("-inf")
    doubt_timeout: float = 0.0
    _doubt: dict[str, float] = field(default_factory=dict)
    """Members of the view that SWIM suspected (or held dead) during it -> since when this member knows."""
    _version: int = 0
    """Bumped by every change of the tallies (what the counts below are a pure function of)."""
    _counted: tuple[int, dict[tuple[str, int], int]] | None = None
    """(version, counts with implicit alerts): evaluate runs again at every settle and unstable timer while
    the tallies stay as they were, and counting is the costly part (a partition's tallies are large)."""
    _seqs: dict[tuple[str, str, int], int] = field(default_factory=dict)
    """(observer, subject, kind) -> the number of the newest alert or retraction counted (see :meth:`fresh`)."""
    _marks: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    """(subject, kind) -> its (H, L): a pure function of the overlay, computed once per view (evaluate
    reads it for every tally, and a partition or a hang storm evaluates often)."""
    _returned: dict[str, float] = field(default_factory=dict)
    """Members SWIM held suspect or dead that came back (a newer incarnation) -> when, last."""

    def fresh(self, observer: str, subject: str, kind: int, seq: int) -> bool:
        """Whether an alert (or retraction) numbered ``seq`` is newer than every one of ``observer``'s
        about (``subject``, ``kind``) counted so far; it is then the one that counts."""
        key = (observer, subject, kind)
        if seq <= self._seqs.get(key, -1):
            return False
        self._seqs[key] = seq
        return True

    def alert(self, observer: str, subject: str, kind: int, retract: bool, now: float,
              addr: str = "", host: str = "", rack: str = "") -> bool:
        """Record an alert (or its retraction). Returns True when the tally changed."""
        key = (subject, kind)
        tally = self._tallies.get(key)
        if retract:
            if tally is None or observer not in tally.observers:
                return False
            tally.observers.discard(observer)
            self._version += 1
        else:
            if kind == REMOVE and observer not in self.overlay.observers(subject):
                return False  # only a subject's own observers speak for it
            if kind == JOIN and observer not in self.overlay.joiner_observers(subject):
                return False
            if tally is None:
                tally = self._tallies[key] = _Tally(kind, addr=addr, host=host, rack=rack)
            tally.alerted_at = now
            if observer in tally.observers:
                return False
            stable = not tally.departed and len(tally.observers) >= self._thresholds(subject, kind)[0]
            tally.observers.add(observer)
            self._version += 1
            if stable:
                # one more voice about a stable subject changes no proposal: it is counted (and spread
                # on) but does not hold the settle window open
                return True
        self.last_change = now
        return True

    def departed(self, subject: str, now: float) -> bool:
        """The subject announced that it leaves (its own authenticated word, not an observation): it is
        stable at once, without waiting for H observers, and only a short ``settle_departed`` window
        batches departures that come together. Returns True when this is news."""
        if not self.overlay.observers(subject):
            return False  # not a member of this view
        key = (subject, REMOVE)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = _Tally(REMOVE)
        if tally.departed:
            return False
        tally.departed = True
        self._version += 1
        self.last_departure = now
        return True

    def announced(self, subject: str) -> bool:
        """Whether ``subject`` announced its own departure in this view (see :meth:`departed`)."""
        tally = self._tallies.get((subject, REMOVE))
        return tally is not None and tally.departed

    def doubt(self, subject: str, now: float) -> None:
        """SWIM suspects ``subject`` (or holds it dead): its observers' alerts may be on their way. Kept
        through a refutation: a node on a lossy link refutes every suspicion, yet its observers' alerts
        come (each first accusation waits ``alert_after`` from its observer's own first failed probe)."""
        if subject not in self._doubt and self.overlay.observers(subject):
            self._doubt[subject] = now

    def returned(self, subject: str, now: float) -> None:
        """SWIM held ``subject`` dead, and it is alive again (a newer incarnation)."""
        if self.overlay.observers(subject):
            self._returned[subject] = now

    def supports(self, changes: list[Change], now: float) -> bool:
        """Whether the alerts counted here still stand behind every removal in ``changes``: the subject
        announced its departure, or it has at least L alerts (implicit ones included) and has not come
        back from the dead after the last of them within ``unstable_timeout``.

        Why: a side of a partition votes on what it saw while cut off. After the heal, the members it
        removes answer again: SWIM has them back at once, their observers retract within a few probes,
        and until then that vote must not become a decision (see :mod:`~gossiprec.core.consensus`). A
        restarted process comes back *before* its observers' alerts, a crashed one never, and a flapping
        one whose observers keep their alerts stands again once the window is over."""
        counts: dict[tuple[str, int], int] | None = None
        for c in changes:
            if c.kind != REMOVE:
                continue
            t = self._tallies.get((c.node, REMOVE))
            if t is None:
                return False
            if t.departed:
                continue
            back = self._returned.get(c.node)
            if back is not None and back > t.alerted_at and now < back + self.unstable_timeout:
                return False
            if counts is None:
                counted = self._counted
                counts = counted[1] if counted is not None and counted[0] == self._version else self._count_all()
                self._counted = (self._version, counts)
            if counts.get((c.node, REMOVE), 0) < self._thresholds(c.node, REMOVE)[1]:
                return False
        return True

    def count(self, subject: str, kind: int = REMOVE) -> int:
        tally = self._tallies.get((subject, kind))
        return len(tally.observers) if tally else 0

    def unstable(self, subject: str, but: frozenset[str] | set[str] = frozenset()) -> bool:
        """Whether ``subject`` has at least L alerts for its removal (stable or unstable), not counting
        those raised by ``but`` (members on their way out: their word is discounted, as in the counts)."""
        tally = self._tallies.get((subject, REMOVE))
        return tally is not None and len(tally.observers - but) >= self._thresholds(subject, REMOVE)[1]

    def _thresholds(self, subject: str, kind: int) -> tuple[int, int]:
        key = (subject, kind)
        marks = self._marks.get(key)
        if marks is None:
            ov = self.overlay
            d = len(ov.joiner_observers(subject) if kind == JOIN else ov.observers(subject))
            marks = self._marks[key] = watermarks(d)
        return marks

    def _count_all(self) -> dict[tuple[str, int], int]:
        """Each tally's count: its real alerts (less discounted witnesses) plus its implicit ones."""
        # Witnesses on their way out do not testify: alerts from an observer that is itself stable for
        # removal are not counted against others (a node that hears nobody accuses everyone, and is
        # itself accused by all its observers; only it should go).
        stable_out = {s for (s, kind), t in self._tallies.items() if kind == REMOVE and (
            t.departed or len(t.observers) >= self._thresholds(s, kind)[0])}
        counts: dict[tuple[str, int], int] = {}
        for k, t in self._tallies.items():
            if t.departed:
                counts[k] = self._thresholds(*k)[0]
            elif stable_out and k[1] == REMOVE and k[0] not in stable_out:
                counts[k] = sum(1 for o in t.observers if o not in stable_out)
            else:
                counts[k] = len(t.observers)
        real = dict(counts)
        # Implicit alerts, to a fixpoint: an observer that is itself on its way out (at or above its L)
        # cannot alert about its subjects, so it counts as alerting for subjects that already have
        # real alerts close to L (a partition or a failed rack watches itself).
        removes = [key for key in self._tallies if key[1] == REMOVE]
        marks = {key: self._thresholds(*key) for key in removes}
        # the tallies that may gain implicit alerts (enough real ones): their fixed parts, computed once
        cands = []
        for key in removes:
            need = max(1, marks[key][1] - 1)
            if real[key] >= need:
                cands.append((key, need, self._tallies[key].observers, self.overlay.observers(key[0])))
        troubled = {key[0] for key in removes if counts[key] >= marks[key][1]}
        for _ in range(8):
            if not troubled or not cands:
                break
            changed = False
            for key, need, alerted, observers in cands:
                if sum(1 for o in alerted if o not in troubled and o not in stable_out) < need:
                    # only alerts from observers not themselves on their way out seed implicit ones: a node
                    # on a lossy link accuses its subjects, and with a failed rack among their observers
                    # its word alone would otherwise take a healthy one out with it
                    continue
                c = real[key] + sum(1 for o in observers if o in troubled and o not in alerted)
                if c != counts[key]:
                    counts[key] = c
                    changed = True
            if not changed:
                break
            troubled = {key[0] for key in removes if counts[key] >= marks[key][1]}
        return counts

    def evaluate(self, now: float) -> tuple[list[Change], float | None]:
        """(proposal, next time worth re-evaluating). The proposal is empty while not ready."""
        if not self._tallies:
            return [], None
        counted = self._counted
        if counted is not None and counted[0] == self._version:
            counts = counted[1]
        else:
            counts = self._count_all()
            self._counted = (self._version, counts)
        stable: list[tuple[str, int]] = []
        blocking = False
        wake: float | None = None
        for key, t in sorted(self._tallies.items()):
            h, low = self._thresholds(*key)
            c = counts[key]
            if c >= h:
                stable.append(key)
                t.unstable_since = None
            elif c >= low:
                if t.unstable_since is None:
                    t.unstable_since = now
                until = t.unstable_since + self.unstable_timeout
                if now < until:
                    blocking = True
                    wake = until if wake is None else min(wake, until)
            else:
                t.unstable_since = None
        if not stable:
            return [], wake
        if self._doubt:
            # a member SWIM suspects, with too few alerts to be unstable yet, is likely one more failure of
            # the same event whose observers' alerts are still on their way (their first accusation waits
            # alert_after from their own first failed probe, and probes of a rack's members start over a
            # probe round or more): wait a bounded time so it lands in the same view change
            stable_set = {s for s, kind in stable if kind == REMOVE}
            for s, since in self._doubt.items():
                if s in stable_set:
                    continue
                key = (s, REMOVE)
                if key in counts and counts[key] >= self._thresholds(s, REMOVE)[1]:
                    continue  # unstable: the rule above governs it
                until = since + self.doubt_timeout
                if now < until:
                    blocking = True
                    wake = until if wake is None else min(wake, until)
        if all(t.departed or not t.observers for t in self._tallies.values()):
            # nothing but announced departures (their observers' alerts add no news): short window
            settled_at = self.last_departure + self.settle_departed
        else:
            settled_at = max(self.last_change + self.settle, self.last_departure + self.settle_departed)
        if now < settled_at:
            return [], settled_at if wake is None else min(wake, settled_at)
        if blocking:
            return [], wake
        changes = []
        for subject, kind in stable:
            t = self._tallies[(subject, kind)]
            changes.append(Change(subject, kind, t.addr if kind == JOIN else "", t.host, t.rack))
        return sorted(changes, key=lambda c: (c.node, c.kind)), None
