"""The observer: how one member turns its own probes of its subjects into alerts, and takes them back.

What it decides: which of its K overlay subjects this member alerts about (unreachable, departed, a
joiner knocking) or retracts, and which subjects SWIM probes every round (*focus*) or one per round in
turn (progress refreshes for the hang check). Inputs: the outcome of each of our probes
(:class:`~gossiprec.core.events.ProbeResult`), SWIM's news (a subject suspected, failed or left), other
observers' alerts about the same subjects, and joiners' requests; all in the current view.

Rules:

- A subject in focus (it may have failed: our probe failed, or SWIM or another observer suspects it) is
  probed every round: each failed probe is evidence, and the spread of the alerts is the tail of the view
  change. A success ends the focus.
- A first accusation needs ``alert_after`` of failed probes without a single success. Confirming another
  observer's alert needs one failed probe and ``confirm_after`` of silence since the subject last answered
  us, or since the view was installed if it never did (every view change reshuffles the rings). A subject
  whose silence already spans ``confirm_after`` is *ready*: it confirms the moment another alert arrives.
- ``retract_after`` answers in a row (one when this member is fenced: it was the one cut off) withdraw an
  unreachable alert; a flapping node rarely answers three times running.
- A subject that announced its departure is alerted as departed at once; one whose new process said hello
  while we had answers from an older one, as restarted (see :mod:`~gossiprec.core.catchup`).

Every alert of ours goes to the node (:meth:`~gossiprec.core.port.NodePort.count_alert`), which tallies it in
the cut detector like anyone else's, and to the other members (one hop in a small view, and gossip).
"""

from __future__ import annotations

from gossiprec.core.config import AgreementConfig
from gossiprec.core.events import AlertRaised, ProbeResult
from gossiprec.core.membership import Membership
from gossiprec.core.overlay import Overlay
from gossiprec.core.port import NodePort
from gossiprec.core.view import JOIN, REMOVE, View
from gossiprec.core.wire import ALERT_REASONS, DEPARTED, JOINING, RESTARTED, UNREACHABLE, Alert, JoinRequest

_INF = float("inf")


class Observer:
    """The observer part of one :class:`~gossiprec.core.node.Node` (its state lives for one view)."""

    __slots__ = ("node", "swim", "acfg", "subjects", "subject_set", "streak", "refresh", "ready", "alerted",
                 "answered", "ok_since", "my_alerts", "my_retractions", "knocking", "alert_seq")

    def __init__(self, node: NodePort, swim: Membership, acfg: AgreementConfig) -> None:
        self.node = node
        self.swim = swim
        self.acfg = acfg
        self.subjects: tuple[str, ...] = ()
        """This member's subjects in the current view, sorted (the hang check's order)."""
        self.subject_set: frozenset[str] = frozenset()
        self.streak: dict[str, float] = {}
        """Subjects watched closely (probed every round): when their failure streak began (inf: suspected
        by others, no failure of our own seen yet)."""
        self.refresh: set[str] = set()
        """Subjects probed only to refresh their progress (the hang check): one per round, in turn."""
        self.ready: set[str] = set()
        """Subjects whose streak already lasts ``confirm_after``: they confirm another observer's alert as
        soon as it arrives, not at the next failed probe."""
        self.alerted: dict[str, int] = {}
        """What we alerted about in this view: subject -> reason; ``join:<node>`` keys record a joiner
        admitted."""
        self.answered: dict[str, float] = {}
        """When each subject last answered one of our probes (the start of its silence, as we saw it)."""
        self.ok_since: dict[str, int] = {}
        """Answers in a row from a subject we alerted as unreachable."""
        self.my_alerts: dict[str, Alert] = {}
        """Our own alerts of this view, by broadcast key (re-sent by the watchdog until the view changes)."""
        self.my_retractions: dict[str, Alert] = {}
        """Our own retractions of this view, by broadcast key (see :meth:`back`)."""
        self.alert_seq = 0
        """The number of our last alert or retraction in this view (see :class:`~gossiprec.core.wire.Alert`)."""
        self.knocking: dict[str, JoinRequest] = {}
        """Joiners that asked us (one of their joiner observers) to be admitted, waiting for an answer to
        our probe before we alert."""

    # ------------------------------------------------------------------ a new view
    def start_view(self, view: View, ov: Overlay) -> None:
        """Forget the last view's observations; take this view's subjects."""
        self.streak = {}
        self.refresh = set()
        self.ready = set()
        self.my_alerts = {}
        self.my_retractions = {}
        self.ok_since = {}
        self.alert_seq = 0
        self.alerted = {}
        self.knocking = {}
        me = self.node.name
        self.subjects = tuple(sorted(ov.subjects(me))) if me in view else ()
        self.subject_set = frozenset(self.subjects)
        self.answered = {s: t for s, t in self.answered.items() if s in self.subject_set}

    def watch(self, ov: Overlay, now: float) -> None:
        """As a member of the new view: probe our subjects, those SWIM already holds suspect or dead
        closely from the start (they are not in its round robin), so this epoch's alerts come without
        waiting for a new rumour."""
        subjects = ov.subjects(self.node.name)
        self.swim.set_probe_targets(subjects)
        for subject in subjects:
            rec = self.swim.member(subject)
            if rec is None or rec.status != 0:
                self.streak[subject] = now
        self.refocus()

    # ------------------------------------------------------------------ focus
    def maybe_focus(self, subject: str) -> None:
        if subject in self.subject_set and subject not in self.streak:
            self.streak[subject] = _INF  # focus, no failure seen yet
            self.refresh.discard(subject)
            self.refocus()

    def refresh_progress(self, subject: str) -> None:
        """Probe ``subject`` soon for its progress (an ack carries it): in turn with other such subjects,
        so a slow training job does not multiply the probe traffic."""
        if subject not in self.streak and subject not in self.refresh:
            self.refresh.add(subject)
            self.refocus()

    def refocus(self) -> None:
        # subjects that may have failed are probed every round (each failed probe is evidence towards
        # an alert, and the alerts' spread is the view change's tail); progress refreshes take turns
        focus = self.streak.keys() | self.knocking.keys() if self.knocking else self.streak
        self.swim.set_focus(focus, self.refresh, self.node.now)

    # ------------------------------------------------------------------ evidence
    def on_probe(self, ev: ProbeResult, now: float) -> None:
        subject = ev.target
        if subject in self.knocking:
            self._knocked(subject, ev.ok, now)
        if subject not in self.subject_set:
            return
        alerted = self.alerted
        if ev.ok:
            self.answered[subject] = now
            if subject in self.refresh:
                self.refresh.discard(subject)
                self.refocus()
            if alerted.get(subject) == UNREACHABLE:
                # Retract after `retract_after` answers in a row (one when this member is fenced: it
                # was the one cut off); a flapping node (80% loss) rarely answers three times running.
                oks = self.ok_since.get(subject, 0) + 1
                self.ok_since[subject] = oks
                if oks >= (1 if self.node.fenced else self.acfg.retract_after):
                    del alerted[subject]
                    self.ok_since.pop(subject, None)
                    self.alert(subject, REMOVE, UNREACHABLE, now, retract=True)
                return
            if subject in self.streak:
                del self.streak[subject]
                self.ready.discard(subject)
                self.refocus()
            return
        self.ok_since.pop(subject, None)
        start = self.streak.get(subject, _INF)
        if start == _INF:
            start = self.streak[subject] = now
            self.refresh.discard(subject)
            self.refocus()
        if subject not in alerted:
            # A first accusation needs alert_after of failed probes. Confirming another observer's alert
            # about the same subject needs a failed probe and confirm_after of silence since the subject
            # last answered us (it takes H independent observers either way): an observer that probes
            # it rarely confirms at its first failure instead of after a streak of its own.
            # A subject that has not answered us since it became ours (every view change reshuffles
            # the rings) counts as silent since then, not since our first failed probe: a failure
            # soon after a view change is confirmed as fast as any other (the first accusation
            # still needs alert_after of failed probes)
            node = self.node
            quiet = now - self.answered.get(subject, node.installed_at)
            if quiet >= self.acfg.confirm_after:
                self.ready.add(subject)
            if now - start >= self.acfg.alert_after or (
                    quiet >= self.acfg.confirm_after and node.alerts_about(subject) > 0):
                alerted[subject] = UNREACHABLE
                self.alert(subject, REMOVE, UNREACHABLE, now)

    def on_alert(self, msg: Alert, now: float) -> None:
        """Another observer's alert about ``msg.subject``: confirm it at once if our own silence already
        suffices, else check the subject ourselves right away."""
        subject = msg.subject
        if subject in self.ready and subject not in self.alerted:
            # our own failed probes already span confirm_after: the same evidence that would confirm
            # at our next failed probe confirms now (the confirmations' spread is the tail of a change)
            self.ready.discard(subject)
            self.alerted[subject] = UNREACHABLE
            self.alert(subject, REMOVE, UNREACHABLE, now)
        else:
            self.maybe_focus(subject)  # another observer lost it: check it ourselves right away

    def departed(self, subject: str, now: float) -> None:
        """``subject`` announced its departure (SWIM reported it left)."""
        if subject in self.subject_set and self.alerted.get(subject) != DEPARTED:
            self.alerted[subject] = DEPARTED
            self.alert(subject, REMOVE, DEPARTED, now)

    def restarted(self, subject: str, now: float) -> None:
        """A new process of ``subject`` said hello, and we had answers from an older one: its place goes."""
        if subject in self.subject_set and self.alerted.get(subject) != RESTARTED:
            self.alerted[subject] = RESTARTED  # (not retracted by the new process's answers)
            self.alert(subject, REMOVE, RESTARTED, now)

    def joining(self, msg: JoinRequest, ov: Overlay, now: float) -> None:
        """A joiner asked to be admitted: its joiner observers alert (once per view), each once its
        joiner answered one of their probes in time. Admission asks for the evidence whose absence would
        remove the joiner again at once (a node whose every packet is late would otherwise be removed and
        readmitted over and over, each time a recovery of the job)."""
        if self.node.name not in ov.joiner_observers(msg.node) or f"join:{msg.node}" in self.alerted:
            return
        if self.swim.member(msg.node) is None and self.node.auth is not None:
            # A join request is nobody's signed word: one datagram under a fresh name would otherwise admit
            # a phantom (a view change, and another to remove it). A real joiner's push-pull makes it
            # known to SWIM within a gossip round, and it asks again every join_retry: then it is probed.
            counters = self.node.counters
            counters["rx_join_unknown"] = counters.get("rx_join_unknown", 0) + 1
        elif self.swim.member(msg.node) is None:
            self._admit(msg, now)  # not known to SWIM yet (nothing to probe): its first view is the test
        elif msg.node not in self.knocking:
            self.knocking[msg.node] = msg
            self.refocus()  # probed every round until it answers or misses once

    def _knocked(self, joiner: str, ok: bool, now: float) -> None:
        msg = self.knocking.pop(joiner)
        self.refocus()
        if ok:
            self._admit(msg, now)
        # a missed probe: nothing until the joiner asks again (every join_retry), so a joiner that never
        # answers in time costs one probe per retry

    def _admit(self, msg: JoinRequest, now: float) -> None:
        self.alerted[f"join:{msg.node}"] = JOINING
        self.alert(msg.node, JOIN, JOINING, now, addr=msg.addr, host=msg.host, rack=msg.rack)

    # ------------------------------------------------------------------ output
    def alert(self, subject: str, kind: int, reason: int, now: float, retract: bool = False,
              addr: str = "", host: str = "", rack: str = "") -> None:
        """Raise (or retract) our alert about ``subject``: to every member, and to our own tally."""
        node = self.node
        v = node.view
        assert v is not None
        # numbered in the view, and never below the clock in ms, so a restarted process's alerts are not
        # taken for stale copies of its predecessor's
        self.alert_seq = max(self.alert_seq + 1, int(now * 1000))
        msg = Alert(v.epoch, v.config_id, node.name, subject, kind, reason, retract, addr, host, rack,
                    self.alert_seq)
        if node.auth is not None:
            node.auth.sign(msg)
        if not retract:
            node.emit(AlertRaised(subject, ALERT_REASONS[reason], now))
        # the other observers check the subject at once and every member counts the H-th alert at about
        # the same moment; sent before it is queued for gossip, so these packets do not carry it twice
        node.one_hop_to_all(msg, skip=subject)
        key = f"a|{node.name}|{subject}|{kind}"
        node.broadcast(key, msg)
        if retract:
            self.my_alerts.pop(key, None)
            self.my_retractions[key] = msg
        else:
            self.my_alerts[key] = msg
            self.my_retractions.pop(key, None)
        node.count_alert(msg, now)

    def back(self, member: str) -> None:
        """SWIM held ``member`` suspect or dead, and it answers again: cut off, it may have missed our
        retractions (gossip sends each a few times, then drops it), and would count the alerts we withdrew
        for good (a member of a healed partition that kept them stayed fenced). They go to it once more."""
        for msg in self.my_retractions.values():
            self.node.send_to(member, msg)
