"""The whole agent core: membership, monitoring overlay, cut detection, consensus, hang detection,
state reports and the recovery plan, as one sans-IO machine.

What it decides: the sequence of views this member installs, whether it must fence (stop its trainer),
and the recovery plan of each view. Inputs and outputs are those of
:class:`~gossiprec.core.membership.Membership` (``receive``, ``tick``, ``next_deadline``, ``take_sends``,
``take_events``), plus :meth:`Node.set_progress` and :meth:`Node.set_state` from the trainer side.

Flow of one failure:

1. Observing: SWIM probes go only to this member's K overlay subjects (round robin) and, every round, to
   subjects under suspicion (*focus*). An observer alerts when its own probes of a subject have failed
   without a single success for ``alert_after`` seconds, when the subject left gracefully, or when the
   subject's training progress has stalled behind the cluster's frontier (a hang, see below). A later
   success retracts the alert.
2. Alerts are gossiped; every member tallies them in its :class:`~gossiprec.core.cut.CutDetector`, which
   emits the same change set everywhere once the alerts have settled.
3. Every member votes for its change set (fast round); a fast quorum decides at once, otherwise classic
   Paxos rounds (:mod:`gossiprec.core.consensus`) with majority quorums decide.
4. Every member applies the decision to its view (:meth:`View.next`): epoch + 1, spares promoted.
5. Holders report their state (committed step, in-flight step, size), aggregated in bitmaps; once all
   holders of the view have reported, every member computes the same plan and publishes its digest.

Hangs: a trainer whose (step, phase) is behind the frontier (the most advanced (step, phase) any
trainer reports) and has not changed for ``max(hang_floor, hang_mult * median step time)`` is hung: the
rank the others wait for in a collective. Its observers alert. The stall is counted from the moment that
(step, phase) began: the rank's own agent sends its age on every ack, so every observer dates it alike
however late it heard of it. Only a rank that answered a probe in the last ``answered_within`` is
judged (hung: alive but stuck; a silent one is the probes' business); it is probed as its threshold
nears. The alert is raised when the threshold passes (an extra timer while someone lags), not at the
next watchdog round. A trainer behind the frontier that still moves is a straggler: reported (event),
not removed, unless ``evict_stragglers``.

Fencing: a member removed from the view, or one that has waited ``fence_after`` seconds for a
change it cannot get decided (no quorum on its side), or that sees fewer than a majority of the view
alive for that long, emits :class:`Fenced`: its trainer must stop sending collectives and state. It then
tries to rejoin through the majority's members.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import statistics
from typing import Any, MutableMapping

from gossiprec.core.config import AgreementConfig, Config
from gossiprec.core.consensus import FAST, Consensus, change_rows, changes_from_rows
from gossiprec.core.cut import CutDetector
from gossiprec.core.election import Plan, StateReport
from gossiprec.core.events import (
    AlertRaised, CoreEvent, Fenced, JobFinished, MemberFailed, MemberJoined, MemberLeft, MemberSuspected, PlanMismatch,
    PlanReady, ProbeResult, Straggler, Unfenced, ViewInstalled,
)
from gossiprec.core.membership import Membership
from gossiprec.core.records import MemberInfo, RandomSource, Send
from gossiprec.core.overlay import Overlay
from gossiprec.core.view import JOIN, REMOVE, View, changes_digest
from gossiprec.core.wire import (
    ALERT_REASONS, ALIVE, DEPARTED, LEFT, HUNG, JOINING, PHASES, UNREACHABLE, Accept, Accepted, Alert, Decided,
    JobDone, JoinRequest, Message, PlanDigest, Prepare, Promise, Proposal, Report, ViewDelta, ViewRequest, ViewState,
    Votes, MAX_DELTA_STEPS,
)
from gossiprec.errors import ConfigError, ProtocolError

PHASE_ORDER = {p: i for i, p in enumerate(PHASES)}
MAX_EARLY = 4096
"""Messages of the next epoch kept until its view is installed (bounded: a flood cannot grow memory)."""
_RECOVERING = PHASE_ORDER["recovering"]
_COMMUNICATE = PHASES.index("communicate")
_CHECKPOINT = PHASE_ORDER["checkpoint"]
_FINISHING = frozenset(PHASE_ORDER[p] for p in ("communicate", "waiting", "optimizer"))
"""Phases in which a trainer may still commit the step it is in (its collective may complete, or has)."""


# timers
_EVAL, _FALLBACK, _RESEND, _WATCH, _JOIN, _HANG, _REPORT = range(7)
WATCH_EARLY = 0.1
"""The watchdog (fencing, hang checks; every ``AgreementConfig.watch_interval``) runs up to this much early
in a tick that happens anyway (the probe timer's), so it seldom needs a wake-up of its own."""


class Node:
    """One member's complete protocol core. ``memo`` may be shared by nodes of a simulation: it caches
    pure functions of views (overlays, transitions, plans), never anything node-specific."""

    def __init__(
        self,
        config: Config,
        name: str,
        addr: str,
        *,
        incarnation: int,
        rng: RandomSource,
        now: float,
        view: View | None,
        agreement: AgreementConfig | None = None,
        host: str = "",
        rack: str = "",
        role: str = "trainer",
        seeds: tuple[str, ...] = (),
        members: MutableMapping[str, MemberInfo] | None = None,
        member_order: tuple[str, ...] | None = None,
        members_live: int | None = None,
        memo: MutableMapping[Any, Any] | None = None,
    ) -> None:
        self.config = config
        self.acfg = agreement or AgreementConfig()
        self.name, self.addr, self.host, self.rack = name, addr, host, rack
        self.rng = rng
        self.memo: MutableMapping[Any, Any] = memo if memo is not None else {}
        self.swim = Membership(config, name, addr, incarnation=incarnation, rng=rng, now=now, role=role,
                               members=members, member_order=member_order, members_live=members_live)
        self.swim.on_other = self._on_message
        self._events: list[CoreEvent] = []
        self._timers: list[tuple[float, int, int, int]] = []
        self._tok = 0
        self._now = now
        self.fenced: str = ""
        self.view: View | None = None
        self.plan: Plan | None = None
        self._reports: dict[tuple, int] = {}
        self._reports_have = 0  # OR of every report bitmap (who has reported)
        self._reports_need: int | None = None  # bitmap of the holders whose reports the plan needs
        self._holders: list[str] = []
        self._plan_hex = ""
        self._next_reagg = 0.0
        self._reagg_gap = 0.0
        self._plan_digests: dict[bytes, int] = {}
        self._state: tuple[int, int | None, int] = (0, None, 0)
        self._held_until: float | None = None
        """This member's state report for the current view waits until then (see ``report_hold``)."""
        self.finished: int | None = None
        """The step at which the job's trainers finished (JobDone), once known."""
        self._streak: dict[str, float] = {}
        """Subjects watched closely (probed every round): when their failure streak began (inf: suspected
        by others, no failure of our own seen yet)."""
        self._refresh: set[str] = set()
        """Subjects probed only to refresh their progress (the hang check): one per round, in turn."""
        self._ready: set[str] = set()
        """Subjects whose streak already lasts ``confirm_after``: they confirm another observer's alert as
        soon as it arrives, not at the next failed probe."""
        self._alerted: dict[str, int] = {}
        self._answered: dict[str, float] = {}
        """When each subject last answered one of our probes (the start of its silence, as we saw it)."""
        self._my_progress: tuple[int, int, int] = (-1, 0, 0)
        self._trouble_since: float | None = None
        self._last_catchup = float("-inf")
        self._pushed_view: dict[str, float] = {}
        self._subjects: tuple[str, ...] = ()
        self._hang_check_at = float("inf")
        """When an extra hang check is armed (a lagging subject's threshold passes then)."""
        self._subject_set: frozenset[str] = frozenset()
        self._hang_sample: list[str] = []
        self._history: dict[tuple[int, str], tuple[str, tuple]] = {}
        """(epoch, config id) of a view we held -> (config id of its successor, the agreed change rows):
        what a :class:`ViewDelta` replays for a member still holding that view (last few only)."""
        self._early: list[Message] = []
        self._departed: set[str] = set()  # members SWIM reported as having left
        self._last_realert = float("-inf")
        self.counters: dict[str, int] = self.swim.counters
        if view is not None:
            self._install(view, now, fast=False, decided_here=False, removed=(), joined=(), initial=True)
        else:
            for addr_ in seeds:
                self.swim.send_addr(addr_, ViewRequest(0, "", name, addr), reliable=True)
            self.swim.join(seeds, now)
            self._at(now + self.acfg.join_retry, _JOIN)
        self._at(now + self.acfg.watch_first, _WATCH)

    # ------------------------------------------------------------------ machine interface
    def receive(self, data: bytes, now: float, reliable: bool = False) -> None:
        self._now = now
        self.swim.receive(data, now, reliable)
        self._drain_swim(now)

    def tick(self, now: float) -> None:
        self._now = now
        self.swim.tick(now)
        self._drain_swim(now)
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, kind, epoch = heapq.heappop(timers)
            if kind in (_EVAL, _FALLBACK, _RESEND) and (self.view is None or epoch != self.view.epoch):
                continue  # armed for an earlier view: that agreement is over
            if kind == _EVAL:
                self._evaluate(now)
            elif kind == _FALLBACK:
                self._fallback(now)
            elif kind == _RESEND:
                self._resend(now)
            elif kind == _WATCH:
                self._watch(now)
            elif kind == _HANG:
                if now >= self._hang_check_at:
                    self._hang_check_at = float("inf")
                self._check_hangs(now)
            elif kind == _JOIN:
                self._join_retry(now)
            elif kind == _REPORT:
                self._maybe_report(now)
        if timers and timers[0][2] == _WATCH and timers[0][0] <= now + WATCH_EARLY:
            # the watchdog rides on this tick rather than waking the process on its own (an idle agent
            # ticks ~10 times a second for its probes; the 4 Hz watchdog was 4 more wake-ups)
            heapq.heappop(timers)
            self._watch(now)

    def next_deadline(self) -> float:
        d = self.swim.next_deadline()
        return min(d, self._timers[0][0]) if self._timers else d

    def take_sends(self) -> list[Send]:
        return self.swim.take_sends()

    def take_events(self) -> list[CoreEvent]:
        out = self._events
        if out:
            self._events = []
        return out

    @property
    def incarnation(self) -> int:
        return self.swim.incarnation

    @property
    def n_live(self) -> int:
        return self.swim.n_live

    def has_heard(self, name: str) -> bool:
        """See :meth:`Membership.has_heard`."""
        return self.swim.has_heard(name)

    def _at(self, when: float, kind: int) -> None:
        """Arm a timer; agreement timers belong to the epoch they were armed in."""
        self._tok += 1
        epoch = self.view.epoch if self.view is not None else -1
        heapq.heappush(self._timers, (when, self._tok, kind, epoch))

    # ------------------------------------------------------------------ trainer side
    def set_progress(self, step: int, phase: int, step_ms: int, now: float) -> None:
        self.swim.set_progress(step, phase, step_ms, now)  # validates: raises before anything is kept
        self._my_progress = (step, phase, step_ms)
        if self._held_until is not None:
            self._at(self._now, _REPORT)  # on the next tick: a state written with this progress lands first

    def set_state(self, committed_step: int, inflight_step: int | None, state_bytes: int) -> None:
        """What this member could serve to a replacement (reported to the plan of each new view)."""
        self._state = (committed_step, inflight_step, state_bytes)
        if self._held_until is not None:
            self._at(self._now, _REPORT)

    def finish(self, step: int, now: float) -> None:
        """This member's trainer finished training at ``step``: tell every member the job is done."""
        self._now = now
        epoch = self.view.epoch if self.view is not None else 0
        self._on_job_done(JobDone(epoch, step, self.name), now)

    def leave(self, now: float) -> None:
        self.swim.leave(now)

    # ------------------------------------------------------------------ the agent's view of the table
    def join(self, seed_addrs: tuple[str, ...] | list[str], now: float) -> None:
        """Join through seeds: SWIM push-pull, and ask them for the current view."""
        self._now = now
        self.swim.join(seed_addrs, now)
        if self.view is None or self.name not in self.view:
            for addr in seed_addrs:
                if addr != self.addr:
                    self.swim.send_addr(addr, self._view_request(), reliable=True)

    def members(self) -> list[MemberInfo]:
        return self.swim.members()

    def progress(self, name: str) -> Any:
        return self.swim.progress(name)

    def health(self) -> int:
        return self.swim.health()

    # ------------------------------------------------------------------ memoised pure functions
    def _overlay(self, view: View) -> Overlay:
        key = ("overlay", view.config_id, self.acfg.k)
        ov = self.memo.get(key)
        if ov is None:
            ov = self.memo[key] = Overlay.build(view.config_id, view.nodes, self.acfg.k)
        return ov  # type: ignore[no-any-return]

    def _next_view(self, view: View, digest: bytes, changes: list) -> View:
        key = ("next", view.config_id, digest)
        nv = self.memo.get(key)
        if nv is None:
            nv = self.memo[key] = view.next(changes)
        return nv  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ views
    def _install(self, view: View, now: float, fast: bool, decided_here: bool, removed: tuple,
                 joined: tuple, initial: bool = False) -> None:
        old = self.view
        self.view = view
        self._installed_at = now
        self._pushed_view = {}
        self.plan = None
        self._reports = {}
        self._reports_have = 0
        self._reports_need = None
        self._next_reagg = now + self.acfg.reaggregate_first
        self._reagg_gap = self.acfg.reaggregate_first
        self._plan_digests = {}
        self._streak = {}
        self._refresh = set()
        self._ready = set()
        self._my_alerts: dict[str, Alert] = {}

        self._ok_since: dict[str, int] = {}
        self._alerted = {}
        self._trouble_since = None
        ov = self._overlay(view)
        mine = self.name in view
        self._subjects = tuple(sorted(ov.subjects(self.name))) if mine else ()  # sorted: the hang check's order
        self._subject_set = frozenset(self._subjects)
        self._answered = {s: t for s, t in self._answered.items() if s in self._subject_set}
        # the hang check's sample: ourselves, our subjects and our observers (K random members each way),
        # trainers only; fixed for the view, so each check costs O(K) without rebuilding it
        sample = sorted({self.name} | self._subject_set | set(ov.observers(self.name))) if mine else []
        self._hang_sample = [n for n in sample if (m := view.member(n)) is not None and m.role == "trainer"]
        self._prev_consensus = getattr(self, "consensus", None)
        self.cut = CutDetector(ov, self.acfg.settle, self.acfg.unstable_timeout, self.acfg.settle_departed)
        self.consensus = Consensus(view, self.name, self._bcast, self._send_to)
        self._fallback_armed = False
        self._early_round = False
        self._resend_armed = False
        if self.name in view:
            self.swim.set_probe_targets(ov.subjects(self.name))
            # subjects that SWIM already holds suspect or dead are not in its round robin: watch them
            # closely from the start, so that this epoch's alerts come without waiting for a new rumour
            for subject in ov.subjects(self.name):
                rec = self.swim.member(subject)
                if rec is None or rec.status != 0:
                    self._streak[subject] = now
            self._refocus()
            # departures announced before this view was installed still count in it
            for node in sorted(self._departed):
                rec = self.swim.member(node)
                if node in view and node != self.name and rec is not None and rec.status == LEFT:
                    self._observe_departure(node, now)
            if self.fenced:
                self.fenced = ""
                self._events.append(Unfenced(view.epoch, now))
        else:
            self.swim.set_probe_targets(None)
        if not initial or old is not None:
            self._events.append(ViewInstalled(view.epoch, view.config_id, view.nodes, removed, joined, fast,
                                              decided_here, now, view.stopped))
        if self.name not in view:
            if old is not None and self.name in old:
                self._fence("removed from the view", now)
                # not at once: the launcher first kills a trainer that was removed as hung (and this
                # agent leaves); a healed minority asks a little later and loses nothing
                self._at(now + self.acfg.rejoin_after, _JOIN)
            else:
                self._at(now, _JOIN)
            return
        self._held_until = None
        if view.basis is not None and view.is_holder(self.name):
            if self._trainer_finishing() and self.acfg.report_hold > 0:
                self._held_until = now + self.acfg.report_hold
                self._at(now + min(self.acfg.report_poll, self.acfg.report_hold), _REPORT)
            else:
                self._report_state(view, now)
        self._maybe_plan(now)
        early, self._early = self._early, []
        for msg in early:
            if self.view is not view:
                break  # a replayed message moved us on again (a decision): the rest is stale
            if getattr(msg, "epoch", None) == view.epoch:
                self._on_message(msg, now)

    def _decided(self, now: float) -> None:
        d = self.consensus.decided
        assert d is not None and self.view is not None
        nv = self._next_view(self.view, d.digest, d.changes)
        self._remember(self.view, nv, change_rows(d.changes))
        removed = tuple(c.node for c in d.changes if c.kind == REMOVE)
        joined = tuple(c.node for c in d.changes if c.kind == JOIN)
        self._install(nv, now, fast=d.fast and not d.heard, decided_here=not d.heard, removed=removed,
                      joined=joined)

    def _fence(self, reason: str, now: float) -> None:
        if not self.fenced:
            self.fenced = reason
            self._events.append(Fenced(self.view.epoch if self.view else -1, reason, now))

    # ------------------------------------------------------------------ sending helpers
    def _bcast(self, key: str, msg: Message) -> None:
        # bitmap aggregates (votes, state reports, plan digests) grow by merging: keep their transmit count
        t = type(msg)
        self.swim.broadcast(key, msg, self._now, merge=t is Votes or t is Report or t is PlanDigest)

    def _send_to(self, node: str, msg: Message) -> None:
        if node == self.name:
            self._on_message(msg, self._now)
            return
        if not self.swim.send_to(node, msg, self._now) and self.view is not None:
            m = self.view.member(node)
            if m is not None:
                self.swim.send_addr(m.addr, msg)

    # ------------------------------------------------------------------ SWIM events -> observations
    def _drain_swim(self, now: float) -> None:
        for ev in self.swim.take_events():
            t = type(ev)
            if t is ProbeResult:
                self._on_probe(ev, now)
                continue
            if t is MemberSuspected or t is MemberFailed:
                # also when the news came by gossip: SWIM stops probing members it holds dead, so an
                # observer that has not alerted yet must keep checking for itself
                self._maybe_focus(ev.name)
            elif t is MemberLeft:
                self._departed.add(ev.name)
                self._observe_departure(ev.name, now)
            elif t is MemberJoined:
                self._departed.discard(ev.name)  # back with a new incarnation
            self._events.append(ev)

    def _is_my_subject(self, subject: str) -> bool:
        return subject in self._subject_set

    def _maybe_focus(self, subject: str) -> None:
        if self._is_my_subject(subject) and subject not in self._streak:
            self._streak[subject] = float("inf")  # focus, no failure seen yet
            self._refresh.discard(subject)
            self._refocus()

    def _refresh_progress(self, subject: str) -> None:
        """Probe ``subject`` soon for its progress (an ack carries it): in turn with other such subjects,
        so a slow training job does not multiply the probe traffic."""
        if subject not in self._streak and subject not in self._refresh:
            self._refresh.add(subject)
            self._refocus()

    def _refocus(self) -> None:
        # subjects that may have failed are probed every round (each failed probe is evidence towards
        # an alert, and the alerts' spread is the view change's tail); progress refreshes take turns
        self.swim.set_focus(self._streak, self._refresh, self._now)

    def _on_probe(self, ev: ProbeResult, now: float) -> None:
        subject = ev.target
        if not self._is_my_subject(subject):
            return
        if ev.ok:
            self._answered[subject] = now
            if subject in self._refresh:
                self._refresh.discard(subject)
                self._refocus()
            if self._alerted.get(subject) == UNREACHABLE:
                # Retract after `retract_after` answers in a row (one when this member is fenced: it
                # was the one cut off); a flapping node (80% loss) rarely answers three times running.
                oks = self._ok_since.get(subject, 0) + 1
                self._ok_since[subject] = oks
                if oks >= (1 if self.fenced else self.acfg.retract_after):
                    del self._alerted[subject]
                    self._ok_since.pop(subject, None)
                    self._alert(subject, REMOVE, UNREACHABLE, now, retract=True)
                return
            if subject in self._streak:
                del self._streak[subject]
                self._ready.discard(subject)
                self._refocus()
            return
        self._ok_since.pop(subject, None)
        start = self._streak.get(subject, float("inf"))
        if start == float("inf"):
            start = self._streak[subject] = now
            self._refresh.discard(subject)
            self._refocus()
        if subject not in self._alerted:
            # A first accusation needs alert_after of failed probes. Confirming another observer's alert
            # about the same subject needs a failed probe and confirm_after of silence since the subject
            # last answered us (it takes H independent observers either way): an observer that probes
            # it rarely confirms at its first failure instead of after a streak of its own.
            # A subject that has not answered us since it became ours (every view change reshuffles
            # the rings) counts as silent since then, not since our first failed probe: a failure
            # soon after a view change is confirmed as fast as any other (the first accusation
            # still needs alert_after of failed probes)
            quiet = now - self._answered.get(subject, self._installed_at)
            if quiet >= self.acfg.confirm_after:
                self._ready.add(subject)
            if now - start >= self.acfg.alert_after or (
                    quiet >= self.acfg.confirm_after and self.cut.count(subject) > 0):
                self._alerted[subject] = UNREACHABLE
                self._alert(subject, REMOVE, UNREACHABLE, now)

    def _observe_departure(self, subject: str, now: float) -> None:
        v = self.view
        if v is not None and self.name in v and self.cut.departed(subject, now):
            if self._trouble_since is None:
                self._trouble_since = now
            self._at(now + self.cut.settle_departed, _EVAL)
        if self._is_my_subject(subject) and self._alerted.get(subject) != DEPARTED:
            self._alerted[subject] = DEPARTED
            self._alert(subject, REMOVE, DEPARTED, now)

    def _alert(self, subject: str, kind: int, reason: int, now: float, retract: bool = False,
               addr: str = "", host: str = "", rack: str = "") -> None:
        v = self.view
        assert v is not None
        msg = Alert(v.epoch, v.config_id, self.name, subject, kind, reason, retract, addr, host, rack)
        if not retract:
            self._events.append(AlertRaised(subject, ALERT_REASONS[reason], now))
        # the other observers check the subject at once and every member counts the H-th alert at about
        # the same moment; sent before it is queued for gossip, so these packets do not carry it twice
        self._one_hop_to_all(msg, skip=subject)
        key = f"a|{self.name}|{subject}|{kind}"
        self._bcast(key, msg)
        if retract:
            self._my_alerts.pop(key, None)
        else:
            self._my_alerts[key] = msg
        self._on_alert(msg, now)

    # ------------------------------------------------------------------ agreement messages
    def _on_message(self, msg: Message, now: float) -> None:
        t = type(msg)
        if t is ViewRequest:
            self._on_view_request(msg, now)  # type: ignore[arg-type]
            return
        if t is ViewState:
            self._on_view_state(msg, now)  # type: ignore[arg-type]
            return
        if t is ViewDelta:
            self._on_view_delta(msg, now)  # type: ignore[arg-type]
            return
        if t is JoinRequest:
            self._on_join_request(msg, now)  # type: ignore[arg-type]
            return
        if t is JobDone:
            self._on_job_done(msg, now)  # type: ignore[arg-type]
            return
        v = self.view
        epoch = getattr(msg, "epoch", None)
        config = getattr(msg, "config", None)
        if v is None or epoch is None:
            self.counters["rx_unexpected"] = self.counters.get("rx_unexpected", 0) + 1
            return
        if epoch != v.epoch or config != v.config_id:
            if epoch > v.epoch:
                if epoch == v.epoch + 1 and len(self._early) < MAX_EARLY:
                    # news of the next view's first moments (reports, digests, alerts) that raced ahead of
                    # its decision: kept and replayed once that view is installed, so nothing is lost
                    self._early.append(msg)
                self._catch_up(now)
            elif epoch < v.epoch and t is Alert:
                self._push_view(msg.observer, epoch, config, now)  # type: ignore[attr-defined]
            self.counters["rx_other_epoch"] = self.counters.get("rx_other_epoch", 0) + 1
            return
        if t is Alert:
            self._on_alert(msg, now)  # type: ignore[arg-type]
        elif t is Report:
            self._on_report(msg, now)  # type: ignore[arg-type]
        elif t is PlanDigest:
            self._on_plan_digest(msg, now)  # type: ignore[arg-type]
        elif self.name not in v:
            if t is Decided:
                self.consensus.on_decided(msg)  # type: ignore[arg-type]
                self._after_consensus(now)
            return
        elif t is Votes:
            self.consensus.on_votes(msg)  # type: ignore[arg-type]
            self._after_consensus(now)
        elif t is Proposal:
            self.consensus.on_proposal(msg)  # type: ignore[arg-type]
            self._after_consensus(now)
        elif t is Decided:
            self.consensus.on_decided(msg)  # type: ignore[arg-type]
            self._after_consensus(now)
        elif t is Prepare:
            self.consensus.on_prepare(msg)  # type: ignore[arg-type]
        elif t is Promise:
            self.consensus.on_promise(msg)  # type: ignore[arg-type]
        elif t is Accept:
            self.consensus.on_accept(msg)  # type: ignore[arg-type]
        elif t is Accepted:
            self.consensus.on_accepted(msg)  # type: ignore[arg-type]
            self._after_consensus(now)

    def _after_consensus(self, now: float) -> None:
        if self.consensus.decided is not None:
            self._decided(now)
            return
        if not self.consensus.votes or self.name not in (self.view or ()):
            return
        if not self._early_round and self._hopeless_fast_coordinator() == self.name:
            # The fast round cannot succeed: start the classic round now instead of after the timeout.
            self._early_round = True
            self._at(now, _FALLBACK)
        elif not self._fallback_armed:
            self._fallback_armed = True
            self._at(now + self.acfg.fallback_timeout + self.rng.random() * self.acfg.fallback_jitter,
                     _FALLBACK)

    def _hopeless_fast_coordinator(self) -> str | None:
        """When our own vote removes so many members that the rest cannot form a fast quorum (any
        failure in a view of 4 or fewer, or several at once in a small view), the fast round can never
        decide. Then the first member of the view that our cut keeps is the coordinator of an immediate
        classic round; every member with the same cut computes the same one. None: the fast round may
        still decide (or we have not voted)."""
        c, v = self.consensus, self.view
        if v is None or c.my_vote is None:
            return None
        changes = c.proposals.get(c.my_vote) or []
        removed = {ch.node for ch in changes if ch.kind == REMOVE}
        if len(v) - len(removed) >= v.fast_quorum():
            return None
        return next((m.node for m in v.members if m.node not in removed), None)

    def _on_alert(self, msg: Alert, now: float) -> None:
        if msg.kind == REMOVE and not msg.retract and msg.observer != self.name:
            subject = msg.subject
            if subject in self._ready and subject not in self._alerted:
                # our own failed probes already span confirm_after: the same evidence that would confirm
                # at our next failed probe confirms now (the confirmations' spread is the tail of a change)
                self._ready.discard(subject)
                self._alerted[subject] = UNREACHABLE
                self._alert(subject, REMOVE, UNREACHABLE, now)
            else:
                self._maybe_focus(subject)  # another observer lost it: check it ourselves right away
        if self.cut.alert(msg.observer, msg.subject, msg.kind, msg.retract, now, msg.addr, msg.host,
                          msg.rack):
            if msg.observer != self.name:  # spread it on (epidemic), once per change
                self._bcast(f"a|{msg.observer}|{msg.subject}|{msg.kind}", msg)
            if self._trouble_since is None:
                self._trouble_since = now
            self._at(now + self.acfg.settle, _EVAL)

    def _evaluate(self, now: float) -> None:
        if self.view is None or self.consensus.decided is not None or self.name not in self.view \
                or self.finished is not None:  # the job is over: its members leave, nothing to agree on
            return
        changes, wake = self.cut.evaluate(now)
        if changes:
            c = self.consensus
            voted = c.my_vote
            c.propose(changes)
            if voted is None and c.my_vote is not None:
                self._send_vote_to_all(c.my_vote)
            self._after_consensus(now)
        elif wake is not None:
            self._at(wake, _EVAL)

    def _one_hop_to_all(self, msg: Message, extra: tuple[Message, ...] = (), skip: str = "") -> None:
        """Views of up to ``direct_votes_max`` members: ``msg`` (and ``extra``) straight to every other
        member but ``skip``, one unicast each, so it arrives in one network hop instead of a few gossip
        rounds. Larger views leave it to gossip (N unicasts per member would be O(N^2))."""
        v = self.view
        assert v is not None
        if len(v) > self.acfg.direct_votes_max:
            return
        for m in v.members:
            if m.node != self.name and m.node != skip:
                self.swim.send_to(m.node, msg, self._now, extra=extra)

    def _send_vote_to_all(self, digest: bytes) -> None:
        """Our vote (with its proposal) to every member of a small view (see :meth:`_one_hop_to_all`), so
        the fast round takes one hop. Merged bitmaps stay on gossip."""
        v, c = self.view, self.consensus
        assert v is not None
        nbytes = (len(v) + 7) // 8
        changes = c.proposals[digest]
        proposal = Proposal(v.epoch, v.config_id, digest, change_rows(changes))
        votes = Votes(v.epoch, v.config_id, digest, c.votes.get(digest, 0).to_bytes(nbytes, "little"))
        self._one_hop_to_all(proposal, extra=(votes,))

    def _fallback(self, now: float) -> None:
        self._fallback_armed = False
        if self.consensus.decided is not None or self.view is None or self.name not in self.view:
            return
        if not self.consensus.votes and not self.consensus.proposals:
            return  # nothing to agree on in this epoch
        self.consensus.start_round()
        if not self._resend_armed:  # one retry chain per epoch, however many rounds we start
            self._resend_armed = True
            self._at(now + self.acfg.retry_interval, _RESEND)
        self._fallback_armed = True
        self._at(now + self.acfg.fallback_timeout * 2 + self.rng.random() * self.acfg.fallback_jitter,
                 _FALLBACK)

    def _resend(self, now: float) -> None:
        c = self.consensus
        if c.decided is None and c.my_round is not None and c.my_round[1] == self.name:
            c.resend()
            self._at(now + self.acfg.retry_interval, _RESEND)
        else:
            self._resend_armed = False

    # ------------------------------------------------------------------ catch-up and joining
    def _catch_up(self, now: float) -> None:
        if now - self._last_catchup < self.acfg.catchup_interval or self.view is None:
            return
        self._last_catchup = now
        # ask two members that SWIM holds alive (a random pick could be the very member that failed);
        # random draws, not a scan of the view: O(1) per catch-up, not O(N)
        members = self.view.members
        asked: set[str] = set()
        for _ in range(4 * len(members) if len(members) <= 16 else 32):
            m = members[self.rng.randrange(0, len(members))]
            if m.node == self.name or m.node in asked:
                continue
            rec = self.swim.member(m.node)
            if rec is None or rec.status != ALIVE:
                continue
            asked.add(m.node)
            self.swim.send_addr(rec.addr, self._view_request())
            if len(asked) == 2:
                break

    def _view_request(self) -> ViewRequest:
        v = self.view
        return ViewRequest(v.epoch if v else 0, v.config_id if v else "", self.name, self.addr)

    def _remember(self, old: View, new: View, rows: tuple) -> None:
        self._history[(old.epoch, old.config_id)] = (new.config_id, rows)
        while len(self._history) > MAX_DELTA_STEPS:
            del self._history[next(iter(self._history))]

    def _view_news(self, epoch: int, config: str) -> ViewDelta | ViewState:
        """What brings a member holding view (epoch, config) up to ours: the change sets since, when we
        remember them all, else the full view."""
        v = self.view
        assert v is not None
        steps = []
        key = (epoch, config)
        while key != (v.epoch, v.config_id):
            step = self._history.get(key)
            if step is None:
                return ViewState(self._view_wire(v))
            steps.append(step)
            key = (key[0] + 1, step[0])
        return ViewDelta(epoch, config, tuple(steps))

    def _push_view(self, node: str, epoch: int, config: str, now: float) -> None:
        """A member still alerting in an older epoch missed the decision: send it the current view (at
        most once per ``catchup_interval`` per member). Also when the decision removed it (a healed
        minority): it learns it is out, and asks to join again."""
        v = self.view
        if v is None or node == self.name:
            return
        # Stale alerts are gossiped to everyone; if everyone pushed an O(N) view to each stale sender,
        # a large view change would cost O(N^2). A deterministic pseudo-random ~2K members push.
        pushers = 2 * self.acfg.k
        if len(v) > pushers and hashlib.blake2b(f"{node}|{self.name}".encode(), digest_size=4).digest()[0] \
                * len(v) >= pushers * 256:
            return
        if now - self._pushed_view.get(node, float("-inf")) < self.acfg.catchup_interval:
            return
        self._pushed_view[node] = now
        rec = self.swim.member(node)
        if rec is not None and rec.addr:
            self.swim.send_addr(rec.addr, self._view_news(epoch, config), reliable=True)

    def _view_wire(self, v: View) -> list:
        """The wire form of a view, built once per view (shared through the memo)."""
        key = ("wire", v.config_id)
        w = self.memo.get(key)
        if w is None:
            w = self.memo[key] = v.to_wire()
        return w  # type: ignore[no-any-return]

    def _on_view_request(self, msg: ViewRequest, now: float) -> None:
        v = self.view
        if v is not None and (v.epoch > msg.epoch or (v.epoch == msg.epoch and v.config_id != msg.config)):
            # (a joiner sends an empty config: no history matches it, so it gets the full view)
            self.swim.send_addr(msg.src_addr, self._view_news(msg.epoch, msg.config), reliable=True)

    def _on_view_delta(self, msg: ViewDelta, now: float) -> None:
        v = self.view
        if v is None or msg.epoch != v.epoch or msg.config != v.config_id or not msg.steps:
            self.counters["rx_stale_view"] = self.counters.get("rx_stale_view", 0) + 1
            return
        views = [v]
        changes: list = []
        for config, rows in msg.steps:
            prev = views[-1]
            changes = changes_from_rows(rows)
            try:
                nv = self._next_view(prev, changes_digest(prev.epoch, prev.config_id, changes), changes)
            except (ProtocolError, ConfigError, ValueError):
                nv = None
            if nv is None or nv.config_id != config:
                self.counters["rx_bad_view"] = self.counters.get("rx_bad_view", 0) + 1
                return
            views.append(nv)
        for (_, rows), old, new in zip(msg.steps, views, views[1:]):
            self._remember(old, new, rows)
        self._install(views[-1], now, fast=False, decided_here=False,  # changes: the last step's
                      removed=tuple(c.node for c in changes if c.kind == REMOVE),
                      joined=tuple(c.node for c in changes if c.kind == JOIN))

    def _on_view_state(self, msg: ViewState, now: float) -> None:
        epoch = msg.view[0] if isinstance(msg.view, (list, tuple)) and msg.view else None
        if self.view is not None and type(epoch) is int and epoch <= self.view.epoch:
            self.counters["rx_stale_view"] = self.counters.get("rx_stale_view", 0) + 1
            return  # not news: skip the O(N) parse (after a change many members push the same view)
        try:
            view = View.from_wire(msg.view)
        except ProtocolError:
            self.counters["rx_bad_view"] = self.counters.get("rx_bad_view", 0) + 1
            return
        if self.view is None or view.epoch > self.view.epoch:
            self._install(view, now, fast=False, decided_here=False, removed=(), joined=())

    def _join_retry(self, now: float) -> None:
        v = self.view
        if v is not None and self.name in v:
            return
        self._at(now + self.acfg.join_retry, _JOIN)
        if v is None:
            return
        for obs in self._overlay(v).joiner_observers(self.name):
            m = v.member(obs)
            if m is not None:
                self.swim.send_addr(m.addr, JoinRequest(self.name, self.addr, self.host, self.rack, v.epoch))

    def _on_join_request(self, msg: JoinRequest, now: float) -> None:
        v = self.view
        if v is None or self.name not in v:
            return
        if msg.epoch != v.epoch or msg.node in v:
            self.swim.send_addr(msg.addr, ViewState(self._view_wire(v)), reliable=True)  # a joiner: all of it
            return
        if self.name in self._overlay(v).joiner_observers(msg.node):
            key = f"join:{msg.node}"
            if key not in self._alerted:
                self._alerted[key] = JOINING
                self._alert(msg.node, JOIN, JOINING, now, addr=msg.addr, host=msg.host, rack=msg.rack)

    # ------------------------------------------------------------------ reports and plan
    def _trainer_finishing(self) -> bool:
        """The trainer is in a step it may still commit (see ``report_hold``)."""
        step, phase, _ = self._my_progress
        return phase in _FINISHING and step > self._state[0]

    def _maybe_report(self, now: float) -> None:
        """The held report goes out once the trainer committed its step or stopped, or at the deadline."""
        v, until = self.view, self._held_until
        if until is None or v is None:
            return
        if self._trainer_finishing() and now < until:
            self._at(min(until, now + self.acfg.report_poll), _REPORT)  # the pump reads the trainer before each tick
            return
        self._held_until = None
        if self._trainer_finishing():
            self.counters["report_hold_expired"] = self.counters.get("report_hold_expired", 0) + 1
        self._report_state(v, now)

    def _report_state(self, v: View, now: float) -> None:
        idx = v.index(self.name)
        assert idx is not None
        committed, inflight, size = self._state
        # our own report straight to every member of a small view (once per view): the plan waits for the
        # last report, and one held for the trainer would otherwise wait for the next gossip round
        bits = (1 << idx).to_bytes((len(v) + 7) // 8, "little")
        self._one_hop_to_all(Report(v.epoch, v.config_id, committed, inflight, size, bits))
        self._merge_report(self._state, 1 << idx, now)

    def _merge_report(self, values: tuple, bits: int, now: float) -> None:
        old = self._reports.get(values, 0)
        new = old | bits
        if new == old:
            return
        self._reports[values] = new
        self._reports_have |= new
        v = self.view
        assert v is not None
        committed, inflight, size = values
        nbytes = (len(v) + 7) // 8
        self._bcast(f"r|{committed}|{inflight}|{size}",
                    Report(v.epoch, v.config_id, committed, inflight, size, new.to_bytes(nbytes, "little")))
        self._maybe_plan(now)

    def _on_report(self, msg: Report, now: float) -> None:
        bits = int.from_bytes(msg.bitmap, "little") & ((1 << len(self.view or ())) - 1)
        if msg.inflight_step is not None and msg.inflight_step <= msg.committed_step:
            return
        self._merge_report((msg.committed_step, msg.inflight_step, msg.state_bytes), bits, now)

    def _maybe_plan(self, now: float) -> None:
        v = self.view
        if v is None or v.basis is None or self.plan is not None or v.stopped or self.finished is not None:
            return
        need = self._reports_need
        if need is None:  # once per view (this runs on every merged report); shared through the memo
            nkey = ("need", v.config_id)
            got = self.memo.get(nkey)
            if got is None:
                holders = v.holders()
                need = 0
                for h in holders:
                    idx = v.index(h)
                    assert idx is not None
                    need |= 1 << idx
                got = self.memo[nkey] = (holders, need)
            self._holders, need = got
            self._reports_need = need
        if self._reports_have & need != need:
            return
        # The plan is a pure function of the view and the holders' reports, which the report bitmaps
        # (masked to the holders) determine: that is the memo key, O(distinct reports), not O(N).
        key = ("plan", v.config_id, tuple(sorted(
            ((vals, bits & need) for vals, bits in self._reports.items() if bits & need), key=repr)))
        got = self.memo.get(key)
        if got is None:
            reports: dict[str, StateReport] = {}
            rank_of = {node: rank for rank, node in v.basis.previous_assignment}
            for (committed, inflight, size), bits in sorted(self._reports.items(), key=repr):
                for h in self._holders:
                    idx = v.index(h)
                    if idx is not None and bits >> idx & 1 and h not in reports:
                        reports[h] = StateReport(h, rank_of.get(h), max(0, committed), inflight, size)
            plan = v.plan(reports)
            got = self.memo[key] = (plan, plan.digest())
        plan, self._plan_hex = got
        self.plan = plan
        digest = bytes.fromhex(self._plan_hex)
        self._events.append(PlanReady(v.epoch, self._plan_hex, plan, now))
        idx = v.index(self.name)
        if idx is not None:
            self._merge_digest(digest, 1 << idx, now)

    def _merge_digest(self, digest: bytes, bits: int, now: float) -> None:
        old = self._plan_digests.get(digest, 0)
        new = old | bits
        if new == old:
            return
        self._plan_digests[digest] = new
        v = self.view
        assert v is not None
        self._bcast(f"g|{digest.hex()}", PlanDigest(v.epoch, v.config_id, digest,
                                                    new.to_bytes((len(v) + 7) // 8, "little")))
        if self.plan is not None and digest.hex() != self._plan_hex:
            self._events.append(PlanMismatch(v.epoch, self._plan_hex, digest.hex(), now))

    def _reaggregate(self, v: View, now: float) -> None:
        """Anti-entropy for the aggregates: while this member lacks the plan, or not every member of the
        view has confirmed the digest it knows, send its merged bitmaps again as fresh broadcasts (a
        merged aggregate is sent a bounded number of times, so a late bit can miss someone)."""
        full = (1 << len(v)) - 1
        if self.plan is not None and all(bits == full for bits in self._plan_digests.values()):
            return
        self._reagg_gap = min(self.acfg.reaggregate_gap_max, self._reagg_gap * 2)
        self._next_reagg = now + self._reagg_gap
        nbytes = (len(v) + 7) // 8
        if v.basis is not None:
            for (committed, inflight, size), bits in self._reports.items():
                self.swim.broadcast(f"r|{committed}|{inflight}|{size}", Report(
                    v.epoch, v.config_id, committed, inflight, size, bits.to_bytes(nbytes, "little")), now)
        for digest, bits in self._plan_digests.items():
            self.swim.broadcast(f"g|{digest.hex()}", PlanDigest(v.epoch, v.config_id, digest,
                                                                bits.to_bytes(nbytes, "little")), now)
        if self.plan is not None and v.basis is not None:
            # A subject of ours that has not confirmed our plan's digest may lack a report: the rounds
            # above reach it only by chance (each re-broadcast goes to a few random members). Its K
            # observers send it the reports directly, so a member that missed a bit gets it within a
            # round (seen in the simulator: one member waited out the whole run for one report).
            confirmed = self._plan_digests.get(bytes.fromhex(self._plan_hex), 0)
            for s in self._subjects:
                idx = v.index(s)
                if idx is not None and not confirmed >> idx & 1:
                    for (committed, inflight, size), bits in self._reports.items():
                        self._send_to(s, Report(v.epoch, v.config_id, committed, inflight, size,
                                                bits.to_bytes(nbytes, "little")))

    def _on_plan_digest(self, msg: PlanDigest, now: float) -> None:
        self._merge_digest(msg.digest, int.from_bytes(msg.bitmap, "little"), now)

    # ------------------------------------------------------------------ watchdog: fencing, hangs
    def _on_job_done(self, msg: JobDone, now: float) -> None:
        """Any epoch's word counts (the job's end does not depend on the view it was seen in); once."""
        if self.finished is not None:
            return
        self.finished = msg.step
        self._held_until = None
        self._events.append(JobFinished(msg.epoch, msg.step, msg.src, now))
        if msg.src == self.name and self.view is not None:
            self._one_hop_to_all(msg)
        self._bcast("done", msg)

    def _watch(self, now: float) -> None:
        self._at(now + self.acfg.watch_interval, _WATCH)
        v = self.view
        if v is None or self.name not in v or self.finished is not None:
            return
        if self._my_alerts and self.consensus.decided is None \
                and now - self._last_realert >= self.acfg.realert_interval:
            # Gossip is best effort (a broadcast is sent a few times, then dropped); an alert that some
            # member missed would stall the change forever, so our own alerts go out again every second
            # until the view changes.
            self._last_realert = now
            for key, msg in self._my_alerts.items():
                self._bcast(key, msg)
        if now >= self._next_reagg and now - self._installed_at <= self.acfg.reaggregate_for:
            self._reaggregate(v, now)
        # suspects count as unreachable here: a side of a partition suspects the other within seconds
        live = self.swim.n_live - self.swim.n_suspect
        # a vote is out (ours or a peer's) but nothing is decided: a cut was ready somewhere, yet no quorum
        # answers (the minority side of a partition; its members do not all see a cut of their own)
        cons = self.consensus
        pending = cons.decided is None and (cons.my_vote is not None or bool(cons.votes) or bool(cons.proposals)
                                            or cons.promised != FAST)
        # every subject we watch is unreachable from here: most likely we are the one cut off (a node
        # that hears nobody; Lifeguard keeps such a node from suspecting, so SWIM's count stays high)
        subjects = self._subjects
        cut_off = len(subjects) >= 2 and all(self._alerted.get(x) == UNREACHABLE for x in subjects)
        if live < v.majority() or pending or cut_off:
            if self._trouble_since is None:
                self._trouble_since = now
            elif now - self._trouble_since >= self.acfg.fence_after:
                self._fence("no quorum: cannot reach a majority of the view" if live < v.majority()
                            else "cut off: no subject answers" if cut_off
                            else "no decision within fence_after", now)
        else:
            self._trouble_since = None
        self._check_hangs(now)

    def _check_hangs(self, now: float) -> None:
        v = self.view
        if v is None or self.name not in v or self.finished is not None:
            return
        if self._my_alerts or (self.consensus.votes and self.consensus.decided is None):
            # A change is under way: every rank waits for the new view, so stalls say nothing about hangs
            # (and an alert now would only start a second change behind the first).
            return
        # The frontier and the typical step time come from a sample: ourselves, our subjects and our
        # observers (K random members each way). In a hang every healthy rank waits at the frontier, so
        # the sample shows it; the cost stays O(K) per check instead of O(N).
        frontier = (-1, 0)
        times = []
        table: dict[str, tuple[int, int, float]] = {}
        for node in self._hang_sample:
            if node == self.name:
                step, phase, ms = self._my_progress
                since = now  # (never judged: only the frontier counts)
            else:
                p = self.swim.progress(node)
                if p is None or now - p.seen_at > self.acfg.progress_stale:
                    continue  # stale (maybe crashed): neither frontier nor judged
                # the stall clock starts when this (step, phase) began (its age came on the wire), not at
                # this check; and never before this view was installed
                step, phase, ms = p.step, p.phase, p.step_ms
                since = max(p.since, self._installed_at)
            if step < 0 or phase == _RECOVERING:
                continue  # a recovering rank waits for its state: the recovery's own timeouts judge it
            table[node] = (step, phase, since)
            if ms > 0:
                times.append(ms)
            frontier = max(frontier, (step, phase))
        if frontier[0] < 0 or not times:
            return
        threshold = max(self.acfg.hang_floor, self.acfg.hang_mult * statistics.median(times) / 1000.0)
        due = float("inf")
        for s in self._subjects:
            row = table.get(s)
            if row is None:
                continue
            step, phase, since = row
            if (step, phase) >= frontier:
                if self._alerted.get(s) == HUNG:
                    del self._alerted[s]
                    self._alert(s, REMOVE, HUNG, now, retract=True)
                continue
            limit = since + (max(threshold, self.acfg.checkpoint_timeout) if phase == _CHECKPOINT else threshold)
            within = self.acfg.answered_within
            if now >= limit - within and now - self._answered.get(s, -math.inf) > within:
                # Judge only a subject that answered us just now (hung: alive but stuck; a crashed one is
                # the probes' business, and its relayed progress must not date a "hang"). Probe it as its
                # threshold nears, so it has answered when due; a rank only briefly behind costs nothing.
                self._refresh_progress(s)
                if now >= limit:
                    continue
            stalled = now >= limit  # the same float as ``due`` below: no re-arm at ``now``
            if stalled and s not in self._alerted:
                self._alerted[s] = HUNG
                self._alert(s, REMOVE, HUNG, now)
            elif not stalled:
                due = min(due, limit)
                if frontier[0] - step >= 2 and f"straggler:{s}" not in self._alerted:
                    self._alerted[f"straggler:{s}"] = HUNG
                    self._events.append(Straggler(s, frontier[0] - step, now))
        # a subject behind the frontier is judged the moment its threshold passes, not at the next
        # watchdog round (up to ``watch_interval`` later): one extra wake-up, only while someone lags
        if now < due < self._hang_check_at and due < now + self.acfg.watch_interval:
            self._hang_check_at = due
            self._at(due, _HANG)
