"""The whole agent core: membership, monitoring overlay, cut detection, consensus, hang detection,
state reports and the recovery plan, as one sans-IO machine (:class:`~gossiprec.core.machine.Machine`).

What it decides: the sequence of views this member installs, whether it must fence (stop its trainer),
and the recovery plan of each view. Inputs: datagrams and timer expiries (``receive``, ``tick``), the
trainer's progress and state (``set_progress``, ``set_state``, ``finish``); outputs: ``take_sends``,
``take_events``, ``next_deadline``.

Flow of one failure:

1. Observing (:mod:`~gossiprec.core.observer`, :mod:`~gossiprec.core.hangs`): SWIM probes go only to
   this member's K overlay subjects and, every round, to subjects that may have failed. An observer
   alerts when its probes of a subject failed without a success for ``alert_after``, when the subject
   left, or when its training stalled behind the cluster's frontier (a hang); a later success retracts.
2. Alerts are gossiped; every member tallies them in its :class:`~gossiprec.core.cut.CutDetector`, which
   emits the same change set everywhere once the alerts have settled.
3. Every member votes for its change set (fast round; :mod:`~gossiprec.core.decide`); a fast quorum
   decides at once, otherwise classic Paxos rounds (:mod:`gossiprec.core.consensus`) with majority
   quorums decide.
4. Every member applies the decision to its view (:meth:`View.next`): epoch + 1, spares promoted. One
   that missed decisions catches up from its peers (:mod:`~gossiprec.core.catchup`).
5. Holders report their state, aggregated in bitmaps; once all holders of the view have reported, every
   member computes the same plan and publishes its digest (:mod:`~gossiprec.core.aggregate`).

This module is the composition: the machine interface, installing a view, the watchdog, and the
dispatch of each agreement message type to its handler. Its parts see it through its port
(:class:`~gossiprec.core.port.NodePort`) and keep their own state.

Fencing (:mod:`~gossiprec.core.fencing`): a member that cannot be part of a decision emits
:class:`Fenced`: its trainer must stop sending collectives and state.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Iterable, MutableMapping

from gossiprec.core import timers
from gossiprec.core.aggregate import Aggregates
from gossiprec.core.auth import CLAIM_EVERY, CLAIM_SOON, CLAIM_SOON_FOR, KeyBook, claims_of
from gossiprec.core.bundles import MERGED
from gossiprec.core.catchup import CatchUp
from gossiprec.core.config import AgreementConfig, Config
from gossiprec.core.consensus import Consensus, change_rows
from gossiprec.core.cut import CutDetector
from gossiprec.core.decide import Decider
from gossiprec.core.election import Plan
from gossiprec.core.fencing import RESTART_FENCE, Fencing
from gossiprec.core.events import (
    CoreEvent, JobFinished, MemberAlive, MemberFailed, MemberJoined, MemberLeft, MemberSuspected, ProbeResult,
    ViewInstalled,
)
from gossiprec.core.hangs import RECOVERING, HangCheck
from gossiprec.core.membership import Membership
from gossiprec.core.observer import Observer
from gossiprec.core.overlay import Overlay
from gossiprec.core.records import MemberInfo, ProgressInfo, RandomSource, Send
from gossiprec.core.view import JOIN, REMOVE, Change, View
from gossiprec.core.wire import (
    ALIVE, LEFT, RESTARTED, Accept, Accepted, Alert, ClaimBundle, ClaimsAsk, ConfirmBundle, Decided, Hello, JobDone,
    JoinRequest, KeyClaim, Message, PlanConfirm, PlanDigest, Prepare, Promise, Proposal, Report, StateClaim,
    ViewDelta, ViewRequest, ViewState, Vote, VoteBundle, Votes,
)
from gossiprec.errors import ProtocolError

MAX_EARLY = 4096
"""Messages of the next epoch kept until its view is installed (bounded: a flood cannot grow memory)."""
WATCH_EARLY = 0.1
"""The watchdog (fencing, hang checks; every ``AgreementConfig.watch_interval``) runs up to this much early
in a tick that happens anyway (the probe timer's), so it seldom needs a wake-up of its own."""


class Node:
    """One member's complete protocol core. ``memo`` may be shared by nodes of a simulation: it caches
    pure functions of views (overlays, transitions, plans), never anything node-specific.

    Its parts (:attr:`observer`, :attr:`hangs`, :attr:`aggregates`, :attr:`catchup`, :attr:`fencing`,
    :attr:`decider`) read the node's view, clock and trainer state and send through its port; the node
    owns the timers and the event list."""

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
        auth: KeyBook | None = None,
    ) -> None:
        self.config = config
        self.acfg = acfg = agreement or AgreementConfig()
        self.name, self.addr, self.host, self.rack = name, addr, host, rack
        self.rng = rng
        self.memo: MutableMapping[Any, Any] = memo if memo is not None else {}
        self.swim = swim = Membership(config, name, addr, incarnation=incarnation, rng=rng, now=now, role=role,
                                      members=members, member_order=member_order, members_live=members_live)
        swim.on_other = self._on_message
        self._events: list[CoreEvent] = []
        self._timers: list[tuple[float, int, int, int]] = []
        self._tok = 0
        self.now = now
        """The time of the latest input."""
        self.installed_at = now
        """When the current view was installed."""
        self.view: View | None = None
        self.finished: int | None = None
        """The step at which the job's trainers finished (JobDone), once known."""
        self.trainer_state: tuple[int, int | None, int] = (0, None, 0)
        """What the trainer could serve (committed step, in-flight step, bytes): see :meth:`set_state`."""
        self.my_progress: tuple[int, int, int] = (-1, 0, 0)
        """The trainer's (step, phase, step time in ms): see :meth:`set_progress`."""
        self.trainer_seen: int | None = None
        """The newest group epoch the trainer has taken in: see :meth:`set_trainer_seen`."""
        self._early: list[Message] = []
        self._departed: set[str] = set()  # members SWIM reported as having left
        self._last_realert = float("-inf")
        self.counters: dict[str, int] = swim.counters
        self.auth = auth
        """This member's key and the keys bound to other members (None: nothing is signed or checked)."""
        self._claim_at = now
        self._started_at = now
        if auth is not None:
            auth.counters = self.counters
            swim.auth = auth
            if auth.claims:
                self._claim(now)
        self.start_incarnation = incarnation
        """The incarnation this process started at (its Hello says so: refuting suspicion raises the
        current one, and an observer comparing with that would take a healthy process for a new one)."""
        self.observer: Observer = Observer(self, swim, acfg)
        obs = self.observer
        self.hangs: HangCheck = HangCheck(self, obs, swim, acfg)
        self.aggregates: Aggregates = Aggregates(self, swim, obs, acfg)
        self.catchup: CatchUp = CatchUp(self, swim, obs, acfg, now, group_view=lambda: self.aggregates.view)
        self.fencing: Fencing = Fencing(self, swim, obs, self.catchup, acfg, now)
        self.decider: Decider = Decider(self, swim, acfg)
        if view is not None:
            self.install(view, now, fast=False, decided_here=False, removed=(), joined=(), initial=True)
        else:
            for addr_ in seeds:
                swim.send_addr(addr_, ViewRequest(0, "", name, addr), reliable=True)
            swim.join(seeds, now)
            self.set_timer(now + acfg.join_retry, timers.JOIN)
        self.set_timer(now + acfg.watch_first, timers.WATCH)
        self.catchup.hello(now, seeds if view is not None else ())

    # ------------------------------------------------------------------ machine interface
    def receive(self, data: bytes, now: float, reliable: bool = False) -> None:
        self.now = now
        self.swim.receive(data, now, reliable)
        self._drain_swim(now)

    def tick(self, now: float) -> None:
        self.now = now
        self.swim.tick(now)
        self._drain_swim(now)
        heap = self._timers
        while heap and heap[0][0] <= now:
            _, _, kind, epoch = heapq.heappop(heap)
            if kind in timers.AGREEMENT and (self.view is None or epoch != self.view.epoch):
                continue  # armed for an earlier view: that agreement is over
            _TIMER_HANDLERS[kind](self, now)
        if heap and heap[0][2] == timers.WATCH and heap[0][0] <= now + WATCH_EARLY:
            # the watchdog rides on this tick rather than waking the process on its own: an idle agent
            # ticks for its probes anyway, and every wake-up of its own costs CPU
            heapq.heappop(heap)
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

    @property
    def fenced(self) -> str:
        """Why this member is fenced ("" when it is not): see :class:`~gossiprec.core.fencing.Fencing`."""
        return self.fencing.reason

    @property
    def spec_conflict(self) -> str:
        """Set when a member of view 0 holds another view 0: fenced for good, out of agreement."""
        return self.fencing.spec_conflict

    @property
    def plan(self) -> Plan | None:
        """The current view's recovery plan, once computed (see :mod:`~gossiprec.core.aggregate`)."""
        return self.aggregates.plan

    @property
    def consensus(self) -> Consensus:
        """The current view's agreement (see :class:`~gossiprec.core.decide.Decider`)."""
        return self.decider.consensus

    @property
    def withheld(self) -> bool:
        return self.decider.withheld

    def emit(self, event: CoreEvent) -> None:
        self._events.append(event)

    def alerts_about(self, subject: str) -> int:
        return self.cut.count(subject)

    def set_timer(self, when: float, kind: int) -> None:
        """Arm a timer (a kind of :mod:`gossiprec.core.timers`); agreement timers belong to the epoch they
        were armed in."""
        self._tok += 1
        epoch = self.view.epoch if self.view is not None else -1
        heapq.heappush(self._timers, (when, self._tok, kind, epoch))

    # ------------------------------------------------------------------ trainer side
    def set_progress(self, step: int, phase: int, step_ms: int, now: float, coll: int = 0,
                     wait_ms: int = 0) -> None:
        """The trainer's progress (``coll``: collectives entered in ``step``; ``wait_ms``: its mean wait per
        step inside collectives, for the straggler check); a report that jumps further
        ahead of the previous one than synchronous training can go in the time between them (see
        ``AgreementConfig.step_floor_ms``) raises :class:`~gossiprec.errors.ProtocolError`, nothing kept."""
        prev, prev_phase, prev_ms = self.my_progress
        if prev >= 0 and prev_phase != RECOVERING and isinstance(step, int) and step > prev + 2:
            # (out of recovering a rank may land at any step: the state it received)
            elapsed = max(0.0, now - self.swim.progress_since)
            per_step = max(self.acfg.step_floor_ms, min(prev_ms, step_ms if isinstance(step_ms, int) else 0)) / 1000
            if step - prev > 2 + 2 * elapsed / per_step:
                raise ProtocolError(f"step jumped from {prev} to {step} in {elapsed:.3f} s, more than synchronous "
                                    "training can do: report each step as it begins (a step counter gone wrong?)")
        self.swim.set_progress(step, phase, step_ms, now, coll, wait_ms)  # validates: raises before anything is kept
        self.my_progress = (step, phase, step_ms)
        if self.aggregates.held_until is not None:
            self.set_timer(self.now, timers.REPORT)  # on the next tick: a state written with this progress lands first

    def set_state(self, committed_step: int, inflight_step: int | None, state_bytes: int) -> None:
        """What this member could serve to a replacement (reported to the plan of each new view)."""
        self.trainer_state = (committed_step, inflight_step, state_bytes)
        if self.aggregates.held_until is not None:
            self.set_timer(self.now, timers.REPORT)

    def set_trainer_seen(self, group_epoch: int) -> None:
        """The newest group epoch the trainer has taken in (-1: none yet), as its progress page says.
        Never called for a trainer without a page: its state report for a view then waits only for
        the step it is finishing (see :mod:`~gossiprec.core.aggregate`)."""
        self.trainer_seen = group_epoch
        if self.aggregates.held_until is not None:
            self.set_timer(self.now, timers.REPORT)

    def finish(self, step: int, now: float) -> None:
        """This member's trainer finished training at ``step``: tell every member the job is done."""
        self.now = now
        epoch = self.view.epoch if self.view is not None else 0
        msg = JobDone(epoch, step, self.name)
        self._on_job_done(self.auth.sign(msg) if self.auth is not None else msg, now)  # type: ignore[arg-type]

    def leave(self, now: float) -> None:
        self.swim.leave(now)

    # ------------------------------------------------------------------ the agent's view of the table
    def join(self, seed_addrs: Iterable[str], now: float) -> None:
        """Join through seeds: SWIM push-pull, and ask them for the current view."""
        self.now = now
        seed_addrs = tuple(seed_addrs)
        self.swim.join(seed_addrs, now)
        if self.view is None or self.name not in self.view:
            for addr in seed_addrs:
                if addr != self.addr:
                    self.swim.send_addr(addr, self.catchup.view_request(), reliable=True)

    def members(self) -> list[MemberInfo]:
        return self.swim.members()

    def progress(self, name: str) -> ProgressInfo | None:
        return self.swim.progress(name)

    def behind(self) -> dict[str, int]:
        """The straggler magnitude (ms per step the others wait for it) of each subject the straggler check
        sampled in this view (see :mod:`gossiprec.core.stragglers`)."""
        return dict(self.hangs.stragglers.behind)

    def health(self) -> int:
        return self.swim.health()

    # ------------------------------------------------------------------ memoised pure functions
    def overlay(self, view: View) -> Overlay:
        key = ("overlay", view.config_id, self.acfg.k)
        ov = self.memo.get(key)
        if ov is None:
            ov = self.memo[key] = Overlay.build(view.config_id, view.nodes, self.acfg.k)
        return ov

    def next_view(self, view: View, digest: bytes, changes: list[Change]) -> View:
        key = ("next", view.config_id, digest)
        nv = self.memo.get(key)
        if nv is None:
            nv = self.memo[key] = view.next(changes)
        return nv

    # ------------------------------------------------------------------ views
    def install(self, view: View, now: float, fast: bool, decided_here: bool, removed: tuple[str, ...],
                 joined: tuple[str, ...], initial: bool = False) -> None:
        old = self.view
        self.view = view
        self.installed_at = now
        self.catchup.start_view()
        agg = self.aggregates
        # a view that left every group as it was keeps aggregating the group view's plan (its trainers may
        # still wait for it); anything else, or a group view this agent never installed, starts afresh
        kept = view.group_epoch != view.epoch and agg.view is not None and agg.view.epoch == view.group_epoch
        if not kept:
            agg.start_view(view, now)
        self.fencing.start_view()
        for node in removed:
            self.swim.forget_acked(node)  # its old process's place is settled; a new one starts afresh
        if old is not None:
            gone = set(old.nodes) - set(view.nodes)
            for node in gone:
                self.swim.unlearn(node, now)  # known from a view only: it goes with its place
            if self.auth is not None:
                # a removed member's key goes with it: a new process of that name (a new key) can rejoin
                self.auth.forget(gone)
        ov = self.overlay(view)
        obs = self.observer
        obs.start_view(view, ov)
        self.hangs.start_view(view, ov)
        acfg = self.acfg
        self.cut: CutDetector = CutDetector(ov, acfg.settle, acfg.unstable_timeout, acfg.settle_departed,
                                            doubt_timeout=acfg.unstable_timeout)
        in_view = self.name in view
        swim = self.swim
        for m in view.members:  # (one pass: O(N) per install, on every node of a large simulation)
            rec = swim.member(m.node)
            if rec is None:
                # agreed, yet unknown here (its Alive's gossip missed us): SWIM takes it from the view
                swim.learn(m.node, m.addr, m.role, now)
            elif in_view and rec.status != ALIVE and m.node != self.name:
                self.cut.doubt(m.node, now)  # SWIM doubts it already (not ALIVE): see CutDetector.doubt
        self.decider.start_view(view, self.cut, self.aggregates.chunk)
        if self.name in view:
            obs.watch(ov, now)
            # departures announced before this view was installed still count in it
            for node in sorted(self._departed):
                rec = self.swim.member(node)
                if node in view and node != self.name and rec is not None and rec.status == LEFT:
                    self._observe_departure(node, now)
            self.fencing.member_again(view.epoch, now)
        else:
            self.swim.set_probe_targets(None)
        if not initial or old is not None:
            self._events.append(ViewInstalled(view.epoch, view.config_id, view.nodes, removed, joined, fast,
                                              decided_here, now, view.stopped, view.group_epoch))
        if self.name not in view:
            if old is not None and self.name in old:
                self.fencing.fence("removed from the view", now)
                if now < self.catchup.hello_until:
                    # a new process (restarted, say): its trainer is new too, nothing to stop first
                    self.catchup.hello_until = now
                    self.set_timer(now, timers.JOIN)
                else:
                    # not at once, and not before the trainer dropped its state (see catchup): a trainer
                    # removed as hung is killed by the launcher, and this agent leaves
                    self.catchup.after_removal = True
                    self.set_timer(now + acfg.rejoin_after, timers.JOIN)
            else:
                self.set_timer(now, timers.JOIN)
            return
        if not kept:
            agg.report_or_hold(view, now)
        early, self._early = self._early, []
        for msg in early:
            if self.view is not view:
                break  # a replayed message moved us on again (a decision): the rest is stale
            if getattr(msg, "epoch", None) == view.epoch:
                self._on_message(msg, now)

    def install_decided(self, now: float) -> None:
        """Install the view the current view's consensus decided."""
        d = self.consensus.decided
        assert d is not None and self.view is not None
        nv = self.next_view(self.view, d.digest, d.changes)
        self.catchup.remember(self.view, nv, change_rows(d.changes))
        removed = tuple(c.node for c in d.changes if c.kind == REMOVE)
        joined = tuple(c.node for c in d.changes if c.kind == JOIN)
        self.install(nv, now, fast=d.fast and not d.heard, decided_here=not d.heard, removed=removed,
                      joined=joined)

    def spec_mismatch(self, peer: str, theirs: str, other: View | None, now: float, proven: bool = True) -> None:
        """See :meth:`Fencing.spec_mismatch`."""
        self.fencing.spec_mismatch(peer, theirs, other, now, proven)

    # ------------------------------------------------------------------ sending helpers
    def broadcast(self, key: str, msg: Message) -> None:
        # bitmap aggregates and signed bundles grow by merging: keep their transmit count
        t = type(msg)
        if self.spec_conflict and t in _THIS_VIEW:
            return
        self.swim.broadcast(key, msg, self.now, merge=t in MERGED)

    def send_to(self, node: str, msg: Message) -> None:
        if self.spec_conflict and type(msg) in _THIS_VIEW:
            return
        if node == self.name:
            self._on_message(msg, self.now)
            return
        if not self.swim.send_to(node, msg, self.now) and self.view is not None:
            m = self.view.member(node)
            if m is not None:
                self.swim.send_addr(m.addr, msg)

    def one_hop_to_all(self, msg: Message, extra: tuple[Message, ...] = (), skip: str = "") -> None:
        """Views of up to ``direct_votes_max`` members: ``msg`` (and ``extra``) straight to every other
        member but ``skip``, one unicast each, so it arrives in one network hop instead of a few gossip
        rounds. Larger views leave it to gossip (N unicasts per member would be O(N^2))."""
        v = self.view
        assert v is not None
        if len(v) > self.acfg.direct_votes_max:
            return
        msgs: tuple[Message, ...] = (*self.key_claim(), msg, *extra)  # our key first: it checks what follows
        first, more = msgs[0], msgs[1:]
        for m in v.members:
            if m.node != self.name and m.node != skip:
                self.swim.send_to(m.node, first, self.now, extra=more)

    # ------------------------------------------------------------------ SWIM events -> observations
    def _drain_swim(self, now: float) -> None:
        obs = self.observer
        answered = None
        for ev in self.swim.take_events():
            t = type(ev)
            if t is ProbeResult:
                obs.on_probe(ev, now)  # type: ignore[arg-type]
                if ev.ok and ev.target in self.hangs.awaiting:  # type: ignore[union-attr]
                    answered = ev.target  # type: ignore[union-attr]
                continue
            if t is MemberSuspected or t is MemberFailed:
                # also when the news came by gossip: SWIM stops probing members it holds dead, so an
                # observer that has not alerted yet must keep checking for itself
                obs.maybe_focus(ev.name)  # type: ignore[union-attr]
                if self.view is not None:  # (in this view; a refutation does not undo it, see CutDetector)
                    self.cut.doubt(ev.name, now)  # type: ignore[union-attr]
            elif t is MemberLeft:
                self._departed.add(ev.name)  # type: ignore[union-attr]
                self._observe_departure(ev.name, now)  # type: ignore[union-attr]
            elif t is MemberJoined:
                self._departed.discard(ev.name)  # type: ignore[union-attr]  # back with a new incarnation
                if self.view is not None:  # (held dead, answering again: see CutDetector.supports)
                    self.cut.returned(ev.name, now)  # type: ignore[union-attr]
                    obs.back(ev.name)  # type: ignore[union-attr]
            elif t is MemberAlive:
                if self.view is not None:
                    obs.back(ev.name)  # type: ignore[union-attr]
            self._events.append(ev)
        if answered is not None:
            # a subject past its hang threshold answered (its own word): judged now, once the rest is in
            self.hangs.answered(answered, now)

    def _observe_departure(self, subject: str, now: float) -> None:
        """A member announced it leaves: stable at once in the cut (a short settle), and our alert if it is
        our subject."""
        v = self.view
        if v is not None and self.name in v and self.cut.departed(subject, now):
            self.fencing.trouble(now)
            self.decider.eval_at(now + self.cut.settle_departed)
        self.observer.departed(subject, now)

    # ------------------------------------------------------------------ agreement messages
    def _on_message(self, msg: Message, now: float) -> None:
        """Every message SWIM does not handle itself. View news, join requests and the job's end count in
        any epoch; the rest only in the view they name (later epochs: kept for when it is installed, and
        we catch up; earlier ones: a stale alert's sender gets our view)."""
        t = type(msg)
        handler = _ANY_VIEW.get(t)
        if handler is not None:
            handler(self, msg, now)
            return
        v = self.view
        epoch = getattr(msg, "epoch", None)
        config = getattr(msg, "config", None)
        if v is None or epoch is None:
            self.counters["rx_unexpected"] = self.counters.get("rx_unexpected", 0) + 1
            return
        agg = self.aggregates.view
        if agg is not v and agg is not None and t in _AGGREGATE and epoch == agg.epoch and config == agg.config_id:
            # the plan of the group view, still aggregated after views that left every group as it was
            if not self.spec_conflict:
                _THIS_VIEW[t][0](self, msg, now)
            return
        if epoch != v.epoch or config != v.config_id:
            if epoch > v.epoch:
                if epoch == v.epoch + 1 and len(self._early) < MAX_EARLY:
                    # news of the next view's first moments (reports, digests, alerts) that raced ahead of
                    # its decision: kept and replayed once that view is installed, so nothing is lost
                    self._early.append(msg)
                self.catchup.catch_up(now)
            elif epoch < v.epoch and isinstance(msg, Alert):
                self.catchup.push_view(msg.observer, epoch, msg.config, now)
            self.counters["rx_other_epoch"] = self.counters.get("rx_other_epoch", 0) + 1
            return
        entry = _THIS_VIEW.get(t)
        if self.spec_conflict and entry is not None:
            self.counters["rx_spec_conflict"] = self.counters.get("rx_spec_conflict", 0) + 1
            return
        if entry is not None and (entry[1] or self.name in v):
            entry[0](self, msg, now)

    def count_alert(self, msg: Alert, now: float) -> None:
        if self.auth is not None and not self.auth.check(msg.observer, msg):
            return  # not the observer's own word (counted by the key book; a forgery may name us)
        if not self.cut.fresh(msg.observer, msg.subject, msg.kind, msg.seq):
            # an older copy (late, or a relay's echo of what a retraction has since withdrawn): counting it
            # would bring back an alert its observer retracted, and keep a healthy member in the cut
            self.counters["rx_alert_stale"] = self.counters.get("rx_alert_stale", 0) + 1
            return
        if msg.kind == REMOVE and not msg.retract and msg.observer != self.name:
            if msg.subject == self.name and msg.reason == RESTARTED:
                # our observers knew an older process of ours: its place (and its trainer's rank) is being
                # removed; this process's trainer must not take it over meanwhile
                self.fencing.fence(RESTART_FENCE, now)
            self.observer.on_alert(msg, now)
        if self.cut.alert(msg.observer, msg.subject, msg.kind, msg.retract, now, msg.addr, msg.host,
                          msg.rack):
            if msg.observer != self.name:  # spread it on (epidemic), once per change
                self.broadcast(f"a|{msg.observer}|{msg.subject}|{msg.kind}", msg)
            self.fencing.trouble(now)
            self.decider.eval_at(now + self.acfg.settle)

    # ------------------------------------------------------------------ the job's end, the watchdog
    def _on_job_done(self, msg: JobDone, now: float) -> None:
        """A trainer of the view we hold says training is over: once, whatever epoch it names (the job's
        end does not depend on the view it was seen in). Anyone else's word is counted and dropped."""
        if self.finished is not None:
            return
        v = self.view
        src = v.member(msg.src) if v is not None else None
        if src is None or src.role != "trainer":
            self.counters["rx_job_done_not_a_trainer"] = self.counters.get("rx_job_done_not_a_trainer", 0) + 1
            return
        if self.auth is not None and not self.auth.check(msg.src, msg):
            return  # not that trainer's own word (ours too: a forgery may name us)
        self.finished = msg.step
        self.aggregates.held_until = None
        self._events.append(JobFinished(msg.epoch, msg.step, msg.src, now))
        if msg.src == self.name and self.view is not None:
            self.one_hop_to_all(msg)
        self.broadcast("done", msg)

    def _claim(self, now: float) -> None:
        """Gossip our signing key (see :mod:`gossiprec.core.auth`), again every ``CLAIM_EVERY``."""
        assert self.auth is not None
        # soon again after this process started (its first claims went out before the other agents
        # listened), then every CLAIM_EVERY: an idle member's claims cost wake-ups
        self._claim_at = now + (CLAIM_SOON if now - self._started_at < CLAIM_SOON_FOR else CLAIM_EVERY)
        self.swim.broadcast("k|" + self.name, KeyClaim(self.name, self.auth.crypto.public_key), now)

    def key_claim(self) -> tuple[Message, ...]:
        """Our key claim, ahead of a message signed with it (see :func:`~gossiprec.core.auth.claims_of`)."""
        return claims_of(self.auth)

    def _on_key_claim(self, msg: KeyClaim, now: float) -> None:
        if self.auth is not None and self.auth.bind(msg.node, msg.key):
            self.swim.broadcast("k|" + msg.node, msg, now)  # news: spread it on

    def _watch(self, now: float) -> None:
        acfg = self.acfg
        self.set_timer(now + acfg.watch_interval, timers.WATCH)
        if self.auth is not None and self.auth.claims and now >= self._claim_at:
            self._claim(now)
        v = self.view
        if v is None or self.name not in v or self.finished is not None:
            return
        obs = self.observer
        if obs.my_alerts and self.consensus.decided is None and now - self._last_realert >= acfg.realert_interval:
            # Gossip is best effort (a broadcast is sent a few times, then dropped); an alert that some
            # member missed would stall the change forever, so our own alerts go out again every
            # realert_interval until the view changes.
            self._last_realert = now
            for key, msg in obs.my_alerts.items():
                self.broadcast(key, msg)
        if self.withheld and self.consensus.decided is None:
            self.decider.evaluate(now)  # a cut held back for reachability waits on SWIM too, which arms nothing
        agg = self.aggregates
        if now >= agg.next_reagg and now - self.installed_at <= acfg.reaggregate_for and agg.view is not None:
            agg.reaggregate(agg.view, now)
        self.fencing.watch(v, now)
        self.hangs.run(now)


Handler = Callable[[Node, Any, float], None]

_ANY_VIEW: dict[type, Handler] = {
    ViewRequest: lambda n, m, now: n.catchup.on_view_request(m, now),
    ViewState: lambda n, m, now: n.catchup.on_view_state(m, now),
    ViewDelta: lambda n, m, now: n.catchup.on_view_delta(m, now),
    JoinRequest: lambda n, m, now: n.catchup.on_join_request(m, now),
    Hello: lambda n, m, now: n.catchup.on_hello(m, now),
    JobDone: Node._on_job_done,
    KeyClaim: Node._on_key_claim,
}
"""Messages handled whatever view they name."""

_THIS_VIEW: dict[type, tuple[Handler, bool]] = {
    Alert: (Node.count_alert, True),
    Report: (lambda n, m, now: n.aggregates.on_report(m, now), True),
    StateClaim: (lambda n, m, now: n.aggregates.on_state_claim(m, now), True),
    PlanDigest: (lambda n, m, now: n.aggregates.on_plan_digest(m, now), True),
    PlanConfirm: (lambda n, m, now: n.aggregates.on_plan_confirm(m, now), True),
    ClaimBundle: (lambda n, m, now: n.aggregates.on_claim_bundle(m, now), True),
    ClaimsAsk: (lambda n, m, now: n.aggregates.on_claims_ask(m, now), False),
    ConfirmBundle: (lambda n, m, now: n.aggregates.on_confirm_bundle(m, now), True),
    Decided: (lambda n, m, now: n.decider.on_decided(m, now), True),  # (then a member outside asks to join)
    Votes: (lambda n, m, now: n.decider.on_votes(m, now), False),
    Vote: (lambda n, m, now: n.decider.on_vote(m, now), False),
    VoteBundle: (lambda n, m, now: n.decider.on_vote_bundle(m, now), False),
    Proposal: (lambda n, m, now: n.decider.on_proposal(m, now), False),
    Prepare: (lambda n, m, now: n.consensus.on_prepare(m), False),
    Promise: (lambda n, m, now: n.consensus.on_promise(m), False),
    Accept: (lambda n, m, now: n.consensus.on_accept(m), False),
    Accepted: (lambda n, m, now: n.decider.on_accepted(m, now), False),
}
"""Messages of the current view: (handler, whether a member outside that view handles it too)."""

_AGGREGATE = frozenset((Report, StateClaim, PlanDigest, PlanConfirm, ClaimBundle, ClaimsAsk, ConfirmBundle))
"""Messages of the view aggregated (see :attr:`Aggregates.view <gossiprec.core.aggregate.Aggregates.view>`)."""

_TIMER_HANDLERS: dict[int, Callable[[Node, float], None]] = {
    timers.EVAL: lambda n, now: n.decider.on_eval_timer(now),
    timers.FALLBACK: lambda n, now: n.decider.fallback(now),
    timers.RESEND: lambda n, now: n.decider.resend(now),
    timers.WATCH: lambda n, now: n._watch(now),
    timers.HANG: lambda n, now: n.hangs.on_timer(now),
    timers.JOIN: lambda n, now: n.catchup.join_retry(now),
    timers.REPORT: lambda n, now: n.aggregates.maybe_report(now),
    timers.HELLO: lambda n, now: n.catchup.hello(now),
}
"""What each timer kind runs."""
