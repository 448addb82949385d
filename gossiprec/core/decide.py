"""Deciding: when the cut of the current view is proposed, and the consensus rounds that decide it.

What it decides: whether this member proposes (votes for) the change set its cut detector emits, or
withholds it (it removes a majority of the view, or keeps no reachable majority); when a classic round
starts (the fast round timed out, or cannot succeed at all) and when its coordinator re-sends. Inputs:
the cut detector's evaluation, SWIM's view of who is reachable, and the agreement messages of the view
(:mod:`gossiprec.core.consensus` counts them). Once the consensus has decided, the node installs the
view it decided (:meth:`~gossiprec.core.port.NodePort.install_decided`).

Evaluations are armed one at a time (:meth:`Decider.eval_at`): every alert would otherwise arm its own,
and each evaluation reads every tally.
"""

from __future__ import annotations

from gossiprec.core import timers
from gossiprec.core.config import AgreementConfig
from gossiprec.core.consensus import FAST, Consensus, Rank, change_rows, keeps_quorum, removes_majority
from gossiprec.core.cut import CutDetector
from gossiprec.core.membership import Membership
from gossiprec.core.port import NodePort
from gossiprec.core.view import REMOVE, Change, View
from gossiprec.core.wire import ALIVE, Accepted, Decided, Proposal, Vote, VoteBundle, Votes

RESEND_BACKOFF_MAX = 8
"""A coordinator's re-sends within one round and phase back off to at most this many ``retry_interval``."""


class Decider:
    """The proposing and deciding part of one node, for its current view."""

    __slots__ = ("node", "swim", "acfg", "cut", "consensus", "withheld", "_fallback_armed", "_early_round",
                 "_resend_armed", "_eval_due", "_mark", "_resend_gap", "_resend_phase")

    cut: CutDetector
    consensus: Consensus

    def __init__(self, node: NodePort, swim: Membership, acfg: AgreementConfig) -> None:
        self.node = node
        self.swim = swim
        self.acfg = acfg
        self.withheld = False
        """The cut is ready but removes a majority of the view: it is not proposed (trouble, as a vote
        that no quorum answers is)."""
        self._fallback_armed = False
        self._early_round = False
        self._resend_armed = False
        self._resend_gap = 1
        """The next re-send's delay in ``retry_interval`` s (doubles within one round and phase)."""
        self._resend_phase: tuple[Rank, bool] | None = None
        """The round and phase (accept or not) the last re-send was of."""
        self._eval_due: float | None = None
        self._mark: tuple[int, Rank] = (0, FAST)
        """The fast round's leading vote count and the highest round promised when the fallback was armed
        (see :meth:`_fast_round_moves`)."""

    def start_view(self, view: View, cut: CutDetector, chunk: int) -> None:
        """A new view: its cut detector, and a consensus of its own (``chunk``: members per vote bundle)."""
        node = self.node
        me = node.name

        def allowed(changes: list[Change]) -> bool:
            return keeps_quorum(view, changes, me)

        swim = self.swim

        def unheard(name: str) -> bool:
            rec = swim.member(name)
            return name != me and (rec is None or rec.status != ALIVE)

        def fresh(changes: list[Change]) -> bool:
            return cut.supports(changes, node.now)

        self.cut = cut
        self.consensus = Consensus(view, me, node.broadcast, node.send_to, allowed, fresh, unheard, cut.unstable,
                                   auth=node.auth, chunk=chunk)
        self._fallback_armed = False
        self._early_round = False
        self._resend_armed = False
        self._resend_gap = 1
        self._resend_phase = None
        self._eval_due = None
        self._mark = (0, FAST)
        self.withheld = False

    # ------------------------------------------------------------------ agreement messages
    def on_votes(self, msg: Votes, now: float) -> None:
        counters = self.node.counters
        if self.node.auth is not None:
            counters["rx_votes_unsigned"] = counters.get("rx_votes_unsigned", 0) + 1
        self.consensus.on_votes(msg)
        self.after_consensus(now)

    def on_vote(self, msg: Vote, now: float) -> None:
        self.consensus.on_vote(msg)
        self.after_consensus(now)

    def on_vote_bundle(self, msg: VoteBundle, now: float) -> None:
        if not self.consensus.on_vote_bundle(msg):
            counters = self.node.counters
            counters["rx_bundle_malformed"] = counters.get("rx_bundle_malformed", 0) + 1
        self.after_consensus(now)

    def on_proposal(self, msg: Proposal, now: float) -> None:
        if not self.consensus.on_proposal(msg) and self.node.auth is not None:
            # no signed word behind it (yet): held unproven, nothing armed (see Consensus.unproven)
            counters = self.node.counters
            counters["rx_proposal_unproven"] = counters.get("rx_proposal_unproven", 0) + 1
            return
        self.after_consensus(now)

    def on_decided(self, msg: Decided, now: float) -> None:
        self.consensus.on_decided(msg)
        if self.node.auth is not None and self.consensus.decided is None:
            # no signed quorum behind it (yet): a hint only, nothing decided
            counters = self.node.counters
            counters["rx_decided_unproven"] = counters.get("rx_decided_unproven", 0) + 1
        self.after_consensus(now)

    def on_accepted(self, msg: Accepted, now: float) -> None:
        self.consensus.on_accepted(msg)
        self.after_consensus(now)

    # ------------------------------------------------------------------ rounds
    def after_consensus(self, now: float) -> None:
        """After any input to the consensus: install what it decided, or see that a round will start."""
        node = self.node
        if self.consensus.decided is not None:
            node.install_decided(now)
            return
        if not self.consensus.votes or node.name not in (node.view or ()):
            return
        if not self._early_round and self._hopeless_fast_coordinator() == node.name:
            # The fast round cannot succeed: start the classic round now instead of after the timeout.
            self._early_round = True
            node.set_timer(now, timers.FALLBACK)
        elif not self._fallback_armed:
            self._arm_fallback(now, self.acfg.fallback_timeout)

    def _arm_fallback(self, now: float, after: float) -> None:
        c, node = self.consensus, self.node
        self._fallback_armed = True
        self._mark = (c.vote_count(), c.promised)
        node.set_timer(now + after + node.rng.random() * self.acfg.fallback_jitter, timers.FALLBACK)

    def _fast_round_moves(self) -> bool:
        """Whether a classic round of ours is not needed yet: since the fallback was armed, another member
        began coordinating a round (we promised it: it is under way, and a second coordinator would only
        compete with it), or the fast round's leading proposal gained signed votes and can still reach the
        fast quorum (members that have voted for nothing yet remain). At N = 1,024 the votes take longer
        than the timeout to reach everyone and be checked, and some 40 members each ran a round that the
        fast path made moot, every member signing a promise to each. Deferring a round only delays it:
        the vote count is bounded, and a round that stops moving leaves the promise where it is."""
        c = self.consensus
        lead, promised = self._mark
        if c.my_round is None and c.promised != promised and c.promised[1] != self.node.name:
            return True
        count = c.vote_count()
        if count <= lead:
            return False
        voted = 0
        for bits in c.votes.values():
            voted |= bits
        return count + len(c.view) - voted.bit_count() >= c.view.fast_quorum()

    def _hopeless_fast_coordinator(self) -> str | None:
        """When our own vote removes so many members that the rest cannot form a fast quorum (any
        failure in a view of 4 or fewer, or several at once in a small view), the fast round can never
        decide. Then the first member of the view that our cut keeps is the coordinator of an immediate
        classic round; every member with the same cut computes the same one. Likewise when the votes
        split between announced departures (see :meth:`_split_departures`). None: the fast round may
        still decide (or we have not voted)."""
        c, v = self.consensus, self.node.view
        if v is None or c.my_vote is None:
            return None
        changes = c.proposals.get(c.my_vote) or []
        removed = {ch.node for ch in changes if ch.kind == REMOVE}
        if len(v) - len(removed) >= v.fast_quorum():
            removed = self._split_departures()
            if not removed:
                return None
        return next((m.node for m in v.members if m.node not in removed), None)

    def _split_departures(self) -> set[str]:
        """Members that heard of a batch of departures in part (one came as their short settle window
        closed) vote different cuts; once the votes counted leave no cut a fast quorum, waiting out
        ``fallback_timeout`` gains nothing. Only for cuts made of announced departures alone (certain,
        each its member's signed word), so alert-driven cuts keep their timeout. Returns every member
        some voted cut removes (the coordinator is the first member of the view outside them, the same
        on every member that counted the same votes), or nothing while the fast round may still decide."""
        c, v, cut = self.consensus, self.node.view, self.cut
        assert v is not None
        if len(c.votes) < 2:
            return set()
        removed: set[str] = set()
        by_all: set[str] | None = None
        voted = best = 0
        for digest, bits in c.votes.items():
            changes = c.proposals.get(digest)
            if changes is None or not all(ch.kind == REMOVE and cut.announced(ch.node) for ch in changes):
                return set()
            gone = {ch.node for ch in changes}
            removed |= gone
            by_all = gone if by_all is None else by_all & gone
            voted |= bits
            best = max(best, bits.bit_count())
        # a member votes for no cut that removes it: those every cut removes will never vote
        may_vote = sum(1 for i, m in enumerate(v.members) if not voted >> i & 1 and m.node not in (by_all or ()))
        return removed if best + may_vote < v.fast_quorum() else set()

    def eval_at(self, when: float) -> None:
        """Evaluate the cut at ``when``, or sooner if an evaluation is armed already: one armed at a time.
        Every alert would otherwise arm its own, and each evaluation reads every tally (quadratic in the
        alerts of a partition or a hang storm); the settle window it finds still open re-arms it."""
        due = self._eval_due
        if due is not None and due <= when:
            return
        self._eval_due = when
        self.node.set_timer(when, timers.EVAL)

    def on_eval_timer(self, now: float) -> None:
        due = self._eval_due
        if due is None or now < due:
            return  # superseded by a sooner evaluation (which re-armed what it still needed)
        self._eval_due = None
        self.evaluate(now)

    def evaluate(self, now: float) -> None:
        """Evaluate the cut now: propose the change set it emits (or withhold it), or re-arm."""
        node = self.node
        v = node.view
        counters = node.counters
        if v is None or self.consensus.decided is not None or node.name not in v \
                or node.finished is not None:  # the job is over: its members leave, nothing to agree on
            return
        changes, wake = self.cut.evaluate(now)
        if changes and removes_majority(v, changes):
            # Alerts gathered across a flapping partition (or a heal) can accuse most of the view at once;
            # no such change is ever proposed: it waits for the alerts to change (retractions re-evaluate)
            # and, if nothing does, the watchdog fences (see :func:`keeps_quorum`).
            counters["cut_withheld_majority"] = counters.get("cut_withheld_majority", 0) + 1
            self.withheld = True
        elif changes and not self._keeps_reachable_majority(changes):
            # The members the cut keeps that look reachable (SWIM holds them alive and they have fewer
            # than L alerts) are no majority: a side of a partition whose cut dropped the other side's
            # members that stayed unstable too long. No quorum can answer, and a vote left standing would
            # be decided the moment the partition heals, removing the healthy other side. It waits, as
            # above.
            counters["cut_withheld_unreachable"] = counters.get("cut_withheld_unreachable", 0) + 1
            self.withheld = True
        elif changes:
            self.withheld = False
            c = self.consensus
            voted = c.my_vote
            c.propose(changes)
            if voted is None and c.my_vote is not None:
                self._send_vote_to_all(c.my_vote)
            self.after_consensus(now)
        elif wake is not None:
            self.eval_at(wake)
        else:
            self.withheld = False  # nothing stable left (the accusations were retracted)

    def _keeps_reachable_majority(self, changes: list[Change]) -> bool:
        v = self.node.view
        assert v is not None
        removed = {c.node for c in changes if c.kind == REMOVE}
        reachable = 0
        cut, me = self.cut, self.node.name
        for m in v.members:
            if m.node not in removed:
                rec = self.swim.member(m.node)
                # alerts raised by the members this cut removes do not count: a node stopped (or cut off)
                # right after it accused a live one can never retract, and would keep that one
                # "unreachable" here for good, so the healthy side fenced instead of removing it
                if m.node == me or (rec is not None and rec.status == ALIVE
                                    and not cut.unstable(m.node, but=removed)):
                    reachable += 1
        return reachable >= v.majority()

    def _send_vote_to_all(self, digest: bytes) -> None:
        """Our vote (with its proposal) to every member of a small view (see :meth:`NodePort.one_hop_to_all`), so
        the fast round takes one hop. Merged bitmaps stay on gossip."""
        v, c = self.node.view, self.consensus
        assert v is not None
        nbytes = (len(v) + 7) // 8
        changes = c.proposals[digest]
        proposal = Proposal(v.epoch, v.config_id, digest, change_rows(changes))
        if c.my_vote_msg is not None:
            self.node.one_hop_to_all(proposal, extra=(c.my_vote_msg,))
            return
        votes = Votes(v.epoch, v.config_id, digest, c.votes.get(digest, 0).to_bytes(nbytes, "little"))
        self.node.one_hop_to_all(proposal, extra=(votes,))

    def fallback(self, now: float) -> None:
        """The fast round's time is up: start a classic round (and, once per epoch, its re-sends)."""
        node = self.node
        v = node.view
        self._fallback_armed = False
        if self.consensus.decided is not None or v is None or node.name not in v:
            return
        if not self.consensus.votes and not self.consensus.proposals:
            return  # nothing to agree on in this epoch
        if self.consensus.my_round is None and not self._early_round and self._fast_round_moves():
            self._arm_fallback(now, self.acfg.fallback_timeout)
            return
        self.consensus.start_round()
        if not self._resend_armed:  # one retry chain per epoch, however many rounds we start
            self._resend_armed = True
            node.set_timer(now + self.acfg.retry_interval, timers.RESEND)
        self._arm_fallback(now, self.acfg.fallback_timeout * 2)

    def resend(self, now: float) -> None:
        """The coordinator's phase again, while its round is undecided: after ``retry_interval``, then
        twice as long each time within one round and phase, at most ``RESEND_BACKOFF_MAX`` times it: the
        members that have not answered by then are lost, partitioned or overloaded, a coordinator needs
        only a majority, and re-sending to every one of them 10 times a second for as long as the round
        lasts only adds to an overload."""
        c = self.consensus
        if c.decided is None and c.my_round is not None and c.my_round[1] == self.node.name:
            c.resend()
            phase = (c.my_round, c.accept_value is not None)
            self._resend_gap = min(self._resend_gap * 2, RESEND_BACKOFF_MAX) if phase == self._resend_phase else 1
            self._resend_phase = phase
            self.node.set_timer(now + self.acfg.retry_interval * self._resend_gap, timers.RESEND)
        else:
            self._resend_armed = False
