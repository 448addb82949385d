"""State reports and the recovery plan of a view: aggregated in bitmaps, the same plan everywhere.

What it decides: this member's state report for the current view (and when it goes out), the plan once
every holder of the view has reported, and whether the members' plan digests agree. Inputs: the
trainer's state (committed step, in-flight step, bytes it could serve) and progress, other members'
:class:`~gossiprec.core.wire.Report` and :class:`~gossiprec.core.wire.PlanDigest` bitmaps.

Aggregation: a report is (committed, in-flight, size) plus a bitmap over the view's sorted members of
who reported exactly that; bitmaps merge by OR and are gossiped (a merged bitmap keeps its transmit
count), so one message carries thousands of reports. Once the OR of all bitmaps covers every holder, the
plan is a pure function of the view and the holders' reports: every member computes the same one and
publishes its digest the same way. A digest other than ours is a :class:`PlanMismatch`.

The report hold: a view installed while the trainer may still commit the step it is in (its collective
in flight, or in the optimizer step) holds our report until the trainer committed that step or stopped,
at most ``report_hold`` (a report made at once would roll every survivor back a step). A trainer that
says which views it has taken in (on its progress page: ``Node.trainer_seen``) is waited for until it has
taken this one in: before then its collective may still complete and its commit drop the step the
report named (see :mod:`gossiprec.local.progress`); ``report_hold_unseen`` counts a hold that expired so.

Signed reports (with a :class:`~gossiprec.core.auth.KeyBook`): a bitmap is nobody's signed word, so a
holder of the cluster key could report in any member's name (every rank at a step nobody holds, a
healthy donor holding nothing) and make every member compute a plan that cannot be carried out. So
each member's report then is its own :class:`~gossiprec.core.wire.StateClaim`, signed by it: sent so by
its author, relayed in :class:`~gossiprec.core.wire.ClaimBundle` s that carry, for one value, each
counted member's signature of its own claim (see :mod:`~gossiprec.core.bundles`). A member's claim
counts once its author's bound key checks it (``rx_state_claim_refused`` otherwise), and unsigned
:class:`Report` bitmaps are ignored (``rx_report_unsigned``). A member's first valid claim for the view
stands (a second, different one is ``rx_state_claim_conflict``). The claims then fill the same
per-value bitmaps as before, locally, so the plan is computed exactly as without signatures. Plan
digests likewise: each member's own signed :class:`~gossiprec.core.wire.PlanConfirm`, relayed in
:class:`~gossiprec.core.wire.ConfirmBundle` s (``rx_plan_confirm_refused``; unsigned :class:`PlanDigest`
bitmaps: ``rx_plan_digest_unsigned``), so no key holder can raise a mismatch in another member's name,
nor end re-aggregation early by claiming that every member confirmed.

Anti-entropy: gossip drops a merged aggregate after a bounded number of sends, so for
``reaggregate_for`` after the install, at doubling intervals from ``reaggregate_first`` (at most
``reaggregate_gap_max``), a member that lacks the plan, or sees members that have not confirmed its
digest, sends its bitmaps (signed: its bundles) again; a subject of ours that has not confirmed gets the
reports directly.
"""

from __future__ import annotations

from typing import Any

from gossiprec.core import bundles, timers
from gossiprec.core.auth import sign_if
from gossiprec.core.config import AgreementConfig
from gossiprec.core.election import Plan, StateReport
from gossiprec.core.events import PlanMismatch, PlanReady
from gossiprec.core.membership import Membership
from gossiprec.core.observer import Observer
from gossiprec.core.port import NodePort
from gossiprec.core.view import View
from gossiprec.core.wire import (
    PHASES, ClaimBundle, ClaimsAsk, ConfirmBundle, Message, PlanConfirm, PlanDigest, Report, StateClaim, encode_message,
)

FINISHING = frozenset(PHASES.index(p) for p in ("communicate", "waiting", "optimizer"))
"""Phases in which a trainer may still commit the step it is in (its collective may complete, or has)."""

UNSEEN_POLL = 0.001
"""Seconds between looks at a trainer that has not taken the view in yet (see :meth:`Aggregates._poll`)."""

CLAIM_ASKS = 2
"""Members a member without the plan asks for the claims it lacks, each anti-entropy round."""

CLAIM_ANSWER_PACKETS = 64
"""At most this many datagrams of claims to one member at once (an answer to its ask, or an observer's push):
a stock Linux receive buffer (212 KB, doubled) holds about 180 datagrams of an MTU's size, and two answers
may arrive together. A larger answer sends a random run of its packets; the rest comes with later asks."""

RECONFIRM_ASKS = 4
"""At most this many members whose confirm is missing are asked for it directly in each anti-entropy round."""

StateValues = tuple[int, int | None, int]
"""(committed step, in-flight step or None, state bytes): what one report says."""


class Aggregates:
    """The reports and plan digests of one :class:`~gossiprec.core.node.Node`'s current view."""

    __slots__ = ("node", "swim", "observer", "acfg", "view", "plan", "reports", "have", "need", "holders", "plan_hex",
                 "next_reagg", "reagg_gap", "digests", "held_until", "claims", "confirms", "chunk", "planned_at",
                 "reconfirmed", "answered")

    def __init__(self, node: NodePort, swim: Membership, observer: Observer, acfg: AgreementConfig) -> None:
        self.node = node
        self.swim = swim
        self.observer = observer
        self.acfg = acfg
        self.view: View | None = None
        """The view aggregated: the newest view that changed a group (see ``View.group_epoch``); a view that
        left every group as it was does not start a new aggregation, so that view's plan still completes."""
        self.plan: Plan | None = None
        """The view's recovery plan, once every holder has reported."""
        self.reports: dict[StateValues, int] = {}
        """Report values -> bitmap of the members that reported them."""
        self.have = 0
        """OR of every report bitmap (who has reported)."""
        self.need: int | None = None
        """Bitmap of the holders whose reports the plan needs (once computed for the view)."""
        self.holders: list[str] = []
        self.plan_hex = ""
        self.next_reagg = 0.0
        self.reagg_gap = 0.0
        self.digests: dict[bytes, int] = {}
        """Plan digest -> bitmap of the members that computed it."""
        self.held_until: float | None = None
        """This member's state report for the current view waits until then (see ``report_hold``)."""
        self.claims: dict[str, StateClaim] = {}
        """With a key book: each member's own signed report for the view, as it came (what is relayed)."""
        self.confirms: dict[str, PlanConfirm] = {}
        """With a key book: each member's own signed plan digest for the view, as it came."""
        self.chunk = bundles.chunk_size(swim.config.mtu)
        """Members per signed bundle (see :mod:`~gossiprec.core.bundles`)."""
        self.planned_at: float | None = None
        self.answered: dict[str, float] = {}
        """When each member's last :class:`ClaimsAsk` was answered (one answer per member per round)."""
        self.reconfirmed = False
        """Whether our own confirm went straight to every member again, for a bundle that lacked it."""

    def start_view(self, view: View, now: float) -> None:
        self.view = view
        self.plan = None
        self.planned_at = None
        self.answered = {}
        self.reconfirmed = False
        self.held_until = None  # a report held for the last view is moot
        self.reports = {}
        self.claims = {}
        self.confirms = {}
        self.have = 0
        self.need = None
        self.next_reagg = now + self.acfg.reaggregate_first
        self.reagg_gap = self.acfg.reaggregate_first
        self.digests = {}

    def report_or_hold(self, view: View, now: float) -> None:
        """Our report for the view just installed (a member's): at once, or held for the trainer."""
        self.held_until = None
        if view.basis is not None and view.group_epoch == view.epoch and view.is_holder(self.node.name):
            if self.trainer_finishing(view) and self.acfg.report_hold > 0:
                self.held_until = now + self.acfg.report_hold
                self.node.set_timer(now + min(self._poll(view), self.acfg.report_hold), timers.REPORT)
            else:
                self.report_state(view, now)
        self.maybe_plan(now)

    # ------------------------------------------------------------------ our report
    def trainer_finishing(self, view: View) -> bool:
        """The trainer may still commit the step it is in, unknowing of ``view`` (see ``report_hold``)."""
        node = self.node
        if self._unseen(view):
            return True
        step, phase, _ = node.my_progress
        return phase in FINISHING and step > node.trainer_state[0]

    def _unseen(self, view: View) -> bool:
        seen = self.node.trainer_seen
        return seen is not None and seen < view.group_epoch

    def _poll(self, view: View) -> float:
        """How soon to look at the trainer again: its follower takes a view in within a millisecond or
        so (then the poll is what the report waits), a step takes longer."""
        return min(self.acfg.report_poll, UNSEEN_POLL) if self._unseen(view) else self.acfg.report_poll

    def maybe_report(self, now: float) -> None:
        """The held report goes out once the trainer committed its step or stopped, or at the deadline."""
        v, until = self.view, self.held_until
        if until is None or v is None or v.basis is None or not v.is_holder(self.node.name):
            self.held_until = None  # no longer ours to report (removed from the view, say)
            return
        if self.trainer_finishing(v) and now < until:
            # the pump reads the trainer before each tick
            self.node.set_timer(min(until, now + self._poll(v)), timers.REPORT)
            return
        self.held_until = None
        if self.trainer_finishing(v):
            counters = self.node.counters
            key = "report_hold_unseen" if self._unseen(v) else "report_hold_expired"
            counters[key] = counters.get(key, 0) + 1
        self.report_state(v, now)

    def report_state(self, v: View, now: float) -> None:
        node = self.node
        idx = v.index(node.name)
        assert idx is not None
        committed, inflight, size = node.trainer_state
        if node.auth is not None:  # our own signed word, straight to every member of a small view (below)
            claim = sign_if(node.auth, StateClaim(v.epoch, v.config_id, node.name, committed, inflight, size))
            node.one_hop_to_all(claim)
            self.on_state_claim(claim, now)
            return
        # our own report straight to every member of a small view (once per view): the plan waits for the
        # last report, and one held for the trainer would otherwise wait for the next gossip round
        bits = (1 << idx).to_bytes((len(v) + 7) // 8, "little")
        node.one_hop_to_all(Report(v.epoch, v.config_id, committed, inflight, size, bits))
        self.merge_report(node.trainer_state, 1 << idx, now)

    # ------------------------------------------------------------------ everyone's reports
    def _add(self, values: StateValues, bits: int) -> int:
        """Count ``bits`` as reporting ``values``; returns the merged bitmap, 0 when nothing is new."""
        old = self.reports.get(values, 0)
        new = old | bits
        if new == old:
            return 0
        self.reports[values] = new
        self.have |= new
        return new

    def merge_report(self, values: StateValues, bits: int, now: float) -> None:
        new = self._add(values, bits)
        if not new:
            return
        v = self.view
        assert v is not None
        committed, inflight, size = values
        nbytes = (len(v) + 7) // 8
        self.node.broadcast(f"r|{committed}|{inflight}|{size}",
                         Report(v.epoch, v.config_id, committed, inflight, size, new.to_bytes(nbytes, "little")))
        self.maybe_plan(now)

    def on_report(self, msg: Report, now: float) -> None:
        if self.node.auth is not None:
            counters = self.node.counters  # a bitmap is nobody's signed word: only signed claims count
            counters["rx_report_unsigned"] = counters.get("rx_report_unsigned", 0) + 1
            return
        bits = int.from_bytes(msg.bitmap, "little") & ((1 << len(self.view or ())) - 1)
        if msg.inflight_step is not None and msg.inflight_step <= msg.committed_step:
            return
        self.merge_report((msg.committed_step, msg.inflight_step, msg.state_bytes), bits, now)

    def on_state_claim(self, msg: StateClaim, now: float) -> None:
        """One member's own report: its bit counts once its signature checks; relayed in a bundle."""
        v = self.view
        idx = v.index(msg.node) if v is not None else None
        if idx is None or (msg.inflight_step is not None and msg.inflight_step <= msg.committed_step):
            return
        if self._take_claim(msg):
            self._claims_counted((msg.committed_step, msg.inflight_step, msg.state_bytes), 1 << idx, now)

    def on_claim_bundle(self, msg: ClaimBundle, now: float) -> None:
        """Claims of one value (see :mod:`~gossiprec.core.bundles`): each member not counted for it yet
        is checked as its own claim would be."""
        v = self.view
        if v is None or (msg.inflight_step is not None and msg.inflight_step <= msg.committed_step):
            return
        values = (msg.committed_step, msg.inflight_step, msg.state_bytes)
        rows = bundles.fresh(msg.first, msg.bitmap, msg.sigs, self.reports.get(values, 0), len(v))
        if rows is None:
            self.node.counters["rx_bundle_malformed"] = self.node.counters.get("rx_bundle_malformed", 0) + 1
            return
        new = 0
        for idx, sig in rows:
            if self._take_claim(StateClaim(v.epoch, v.config_id, v.members[idx].node, *values, sig)):
                new |= 1 << idx
        if new:
            self._claims_counted(values, new, now)

    def _take_claim(self, msg: StateClaim) -> bool:
        """Whether ``msg`` (of a member of the view) counts now: signed by its author, and its first."""
        node = self.node
        have = self.claims.get(msg.node)
        if have == msg:
            return False  # a copy of what counts already (verified once)
        auth = node.auth
        # ``check``, not ``vouched``: a claim is made after the view is installed, by one of its members,
        # whose key is bound by then (pinned, or claimed ahead of its messages); taking an unbound author's
        # word would let a forger's claim arrive first and stand for the view. A claim refused for want of
        # a key only waits: anti-entropy sends the author's claim again, and its key claim comes too.
        if auth is not None and not auth.check(msg.node, msg):
            node.counters["rx_state_claim_refused"] = node.counters.get("rx_state_claim_refused", 0) + 1
            return False
        if have is not None:  # its author said two things: the first stands here
            node.counters["rx_state_claim_conflict"] = node.counters.get("rx_state_claim_conflict", 0) + 1
            return False
        self.claims[msg.node] = msg
        return True

    def _claims_counted(self, values: StateValues, bits: int, now: float) -> None:
        for c in bundles.chunks(bits, self.chunk):
            self.node.broadcast(self._claim_key(values, c), self._claim_bundle(values, c))
        if self._add(values, bits):
            self.maybe_plan(now)

    @staticmethod
    def _claim_key(values: StateValues, chunk: int) -> str:
        return f"S|{values[0]}|{values[1]}|{values[2]}|{chunk}"

    def _claim_bundle(self, values: StateValues, chunk: int) -> ClaimBundle:
        """Our bundle of chunk ``chunk``: every claim counted there that says ``values``."""
        v = self.view
        assert v is not None
        claims, ms = self.claims, v.members

        def sig_of(i: int) -> bytes | None:
            c = claims.get(ms[i].node)
            if c is None or (c.committed_step, c.inflight_step, c.state_bytes) != values:
                return None
            return c.sig

        first, bitmap, sigs = bundles.gather(chunk, self.chunk, len(v), sig_of)
        return ClaimBundle(v.epoch, v.config_id, *values, first, bitmap, sigs)

    def maybe_plan(self, now: float) -> None:
        node = self.node
        v = self.view
        if v is None or v.basis is None or self.plan is not None or v.stopped or node.finished is not None:
            return
        if v.group_epoch != v.epoch:
            return  # a view that left the groups as they were has no plan of its own (see ``view``)
        memo = node.memo
        need = self.need
        if need is None:  # once per view (this runs on every merged report); shared through the memo
            nkey = ("need", v.config_id)
            got: Any = memo.get(nkey)
            if got is None:
                holders = v.holders()
                need = 0
                for h in holders:
                    idx = v.index(h)
                    assert idx is not None
                    need |= 1 << idx
                got = memo[nkey] = (holders, need)
            self.holders, need = got
            self.need = need
        if self.have & need != need:
            return
        # The plan is a pure function of the view and the holders' reports, which the report bitmaps
        # (masked to the holders) determine: that is the memo key, O(distinct reports), not O(N).
        key = ("plan", v.config_id, tuple(sorted(
            ((vals, bits & need) for vals, bits in self.reports.items() if bits & need), key=repr)))
        got = memo.get(key)
        if got is None:
            reports: dict[str, StateReport] = {}
            rank_of = {name: rank for rank, name in v.basis.previous_assignment}
            for (committed, inflight, size), bits in sorted(self.reports.items(), key=repr):
                for h in self.holders:
                    idx = v.index(h)
                    if idx is not None and bits >> idx & 1 and h not in reports:
                        reports[h] = StateReport(h, rank_of.get(h), max(0, committed), inflight, size)
            plan = v.plan(reports)
            got = memo[key] = (plan, plan.digest())
        plan, self.plan_hex = got
        self.plan = plan
        self.planned_at = now
        digest = bytes.fromhex(self.plan_hex)
        node.emit(PlanReady(v.epoch, self.plan_hex, plan, now))
        idx = v.index(node.name)
        if idx is not None and node.auth is not None:
            self.on_plan_confirm(sign_if(node.auth, PlanConfirm(v.epoch, v.config_id, node.name, digest)), now)
        elif idx is not None:
            self.merge_digest(digest, 1 << idx, now)

    # ------------------------------------------------------------------ plan digests
    def merge_digest(self, digest: bytes, bits: int, now: float, signed: bool = False) -> None:
        """``bits`` computed ``digest``; ``signed``: from a checked claim (then nothing is broadcast here)."""
        old = self.digests.get(digest, 0)
        new = old | bits
        if new == old:
            return
        self.digests[digest] = new
        node = self.node
        v = self.view
        assert v is not None
        if not signed:
            node.broadcast(f"g|{digest.hex()}", PlanDigest(v.epoch, v.config_id, digest,
                                                        new.to_bytes((len(v) + 7) // 8, "little")))
        if self.plan is not None and digest.hex() != self.plan_hex:
            node.emit(PlanMismatch(v.epoch, self.plan_hex, digest.hex(), now))

    def on_plan_digest(self, msg: PlanDigest, now: float) -> None:
        if self.node.auth is not None:
            counters = self.node.counters  # a bitmap is nobody's signed word: only signed confirms count
            counters["rx_plan_digest_unsigned"] = counters.get("rx_plan_digest_unsigned", 0) + 1
            return
        self.merge_digest(msg.digest, int.from_bytes(msg.bitmap, "little"), now)

    def on_plan_confirm(self, msg: PlanConfirm, now: float) -> None:
        """One member's own plan digest: counts once its signature checks (``check``, as for a claim);
        relayed in a bundle."""
        v = self.view
        idx = v.index(msg.node) if v is not None else None
        if idx is not None and self._take_confirm(msg):
            self._confirms_counted(msg.digest, 1 << idx, now)

    def on_confirm_bundle(self, msg: ConfirmBundle, now: float) -> None:
        """Confirms of one digest (as :meth:`on_claim_bundle`)."""
        v = self.view
        if v is None:
            return
        rows = bundles.fresh(msg.first, msg.bitmap, msg.sigs, self.digests.get(msg.digest, 0), len(v))
        if rows is None:
            self.node.counters["rx_bundle_malformed"] = self.node.counters.get("rx_bundle_malformed", 0) + 1
            return
        new = 0
        for idx, sig in rows:
            if self._take_confirm(PlanConfirm(v.epoch, v.config_id, v.members[idx].node, msg.digest, sig)):
                new |= 1 << idx
        if new:
            self._confirms_counted(msg.digest, new, now)
        self._lacks_ours(msg, now)

    def _lacks_ours(self, msg: ConfirmBundle, now: float) -> None:
        """A bundle of our digest, sent well after our confirm, that lacks it: some member still misses
        it (gossip gave up on it, and anti-entropy only re-sends what a member holds). Our confirm goes
        straight to every member once more (small views: see ``one_hop_to_all``)."""
        node, v = self.node, self.view
        mine = self.confirms.get(node.name)
        if (self.reconfirmed or mine is None or mine.digest != msg.digest or v is None or self.planned_at is None
                or now - self.planned_at < 2 * self.acfg.reaggregate_first):
            return
        idx = v.index(node.name)
        if idx is None or not msg.first <= idx < msg.first + self.chunk:
            return
        if int.from_bytes(msg.bitmap, "little") >> (idx - msg.first) & 1:
            return
        self.reconfirmed = True
        node.counters["plan_reconfirmed"] = node.counters.get("plan_reconfirmed", 0) + 1
        node.one_hop_to_all(mine)

    def _take_confirm(self, msg: PlanConfirm) -> bool:
        node = self.node
        have = self.confirms.get(msg.node)
        if have == msg:
            return False
        if node.auth is not None and not node.auth.check(msg.node, msg):
            node.counters["rx_plan_confirm_refused"] = node.counters.get("rx_plan_confirm_refused", 0) + 1
            return False
        if have is not None:
            node.counters["rx_plan_confirm_conflict"] = node.counters.get("rx_plan_confirm_conflict", 0) + 1
            return False
        self.confirms[msg.node] = msg
        return True

    def _confirms_counted(self, digest: bytes, bits: int, now: float) -> None:
        for c in bundles.chunks(bits, self.chunk):
            self.node.broadcast(f"G|{digest.hex()}|{c}", self._confirm_bundle(digest, c))
        self.merge_digest(digest, bits, now, signed=True)

    def _confirm_bundle(self, digest: bytes, chunk: int) -> ConfirmBundle:
        v = self.view
        assert v is not None
        confirms, ms = self.confirms, v.members

        def sig_of(i: int) -> bytes | None:
            c = confirms.get(ms[i].node)
            return c.sig if c is not None and c.digest == digest else None

        first, bitmap, sigs = bundles.gather(chunk, self.chunk, len(v), sig_of)
        return ConfirmBundle(v.epoch, v.config_id, digest, first, bitmap, sigs)

    # ------------------------------------------------------------------ anti-entropy
    def reaggregate(self, v: View, now: float) -> None:
        """Anti-entropy for the aggregates: while this member lacks the plan, or not every member of the
        view has confirmed the digest it knows, send its merged bitmaps again as fresh broadcasts (a
        merged aggregate is sent a bounded number of times, so a late bit can miss someone)."""
        node = self.node
        full = (1 << len(v)) - 1
        if self.plan is not None and all(bits == full for bits in self.digests.values()):
            return
        self.reagg_gap = min(self.acfg.reaggregate_gap_max, self.reagg_gap * 2)
        self.next_reagg = now + self.reagg_gap
        nbytes = (len(v) + 7) // 8
        signed = node.auth is not None
        if v.basis is not None and signed:
            for values, bits in self.reports.items():
                for c in bundles.chunks(bits, self.chunk):
                    self.swim.broadcast(self._claim_key(values, c), self._claim_bundle(values, c), now)
            if self.plan is None:
                self._ask_claims(v)
        elif v.basis is not None:
            for (committed, inflight, size), bits in self.reports.items():
                self.swim.broadcast(f"r|{committed}|{inflight}|{size}", Report(
                    v.epoch, v.config_id, committed, inflight, size, bits.to_bytes(nbytes, "little")), now)
        if signed:
            for digest, bits in self.digests.items():
                for c in bundles.chunks(bits, self.chunk):
                    self.swim.broadcast(f"G|{digest.hex()}|{c}", self._confirm_bundle(digest, c), now)
            if self.plan is not None:
                # A member whose confirm we lack (gossip gave up on it) gets our bundle of its chunk: one
                # that lacks its own confirm, which it answers by sending its confirm again (_lacks_ours).
                # A few per round (the rounds' gaps double), so a large view's gossip still does the bulk.
                digest = bytes.fromhex(self.plan_hex)
                lacking = full & ~self.digests.get(digest, 0)
                asks = 0
                while lacking and asks < RECONFIRM_ASKS:
                    low = lacking & -lacking
                    lacking ^= low
                    at = low.bit_length() - 1
                    if v.members[at].node != node.name:
                        node.send_to(v.members[at].node, self._confirm_bundle(digest, at // self.chunk))
                        asks += 1
        else:
            for digest, bits in self.digests.items():
                self.swim.broadcast(f"g|{digest.hex()}", PlanDigest(v.epoch, v.config_id, digest,
                                                                    bits.to_bytes(nbytes, "little")), now)
        if self.plan is not None and v.basis is not None:
            # A subject of ours that has not confirmed our plan's digest may lack a report: the rounds
            # above reach it only by chance (each re-broadcast goes to a few random members). Its K
            # observers send it the reports directly, so a member that missed a bit gets it within a
            # round instead of waiting, perhaps for good, for a lucky re-broadcast.
            confirmed = self.digests.get(bytes.fromhex(self.plan_hex), 0)
            for s in self.observer.subjects:
                idx = v.index(s)
                if idx is not None and not confirmed >> idx & 1 and signed:
                    self._send_claims(s)
                elif idx is not None and not confirmed >> idx & 1:
                    for (committed, inflight, size), bits in self.reports.items():
                        node.send_to(s, Report(v.epoch, v.config_id, committed, inflight, size,
                                                bits.to_bytes(nbytes, "little")))

    def _ask_claims(self, v: View) -> None:
        """Ask a few random members for the claims we lack (a large view's gossip brings each member its
        N claims a few bundles per packet, about linearly slower with N; an answer brings them at once)."""
        node = self.node
        have = 0
        for bits in self.reports.values():
            have |= bits
        n = len(v)
        if have == (1 << n) - 1 or n < 2:
            return
        ask = sign_if(node.auth, ClaimsAsk(v.epoch, v.config_id, node.name, have.to_bytes((n + 7) // 8, "little")))
        me = v.index(node.name)
        for idx in node.rng.sample(range(n), min(n, CLAIM_ASKS + 1)):
            if idx != me:
                node.send_to(v.members[idx].node, ask)
        node.counters["claims_asked"] = node.counters.get("claims_asked", 0) + 1

    def on_claims_ask(self, msg: ClaimsAsk, now: float) -> None:
        """The claims we hold that ``msg.src`` lacks, in bundles (once per asker per ``reaggregate_first``)."""
        v = self.view
        if v is None or v.index(msg.src) is None or self.node.auth is None:
            return
        last = self.answered.get(msg.src)
        if last is not None and now - last < self.acfg.reaggregate_first:
            return
        if not self.node.auth.check(msg.src, msg):
            counters = self.node.counters
            counters["rx_claims_ask_refused"] = counters.get("rx_claims_ask_refused", 0) + 1
            return
        self.answered[msg.src] = now
        counters = self.node.counters
        counters["claims_answered"] = counters.get("claims_answered", 0) + 1
        self._send_claims(msg.src, ~int.from_bytes(msg.have, "little"))

    def _send_claims(self, to: str, only: int = -1) -> None:
        """The signed claims we hold (of the members in ``only``: a bitmap, default all), to member ``to``,
        in bundles, as few packets as fit the MTU, at most :data:`CLAIM_ANSWER_PACKETS` of them."""
        budget = self.swim.config.mtu // 2  # room left for piggybacked news
        batches: list[list[Message]] = []
        batch: list[Message] = []
        size = 0
        for values, bits in self.reports.items():
            for c in bundles.chunks(bits & only, self.chunk):
                bundle = self._claim_bundle(values, c)
                n = len(encode_message(bundle))
                if batch and size + n > budget:
                    batches.append(batch)
                    batch, size = [], 0
                batch.append(bundle)
                size += n
        if batch:
            batches.append(batch)
        if len(batches) > CLAIM_ANSWER_PACKETS:
            # a random run (wrapping around): two members answering one ask send mostly different claims
            start = self.node.rng.randrange(len(batches))
            batches = (batches[start:] + batches[:start])[:CLAIM_ANSWER_PACKETS]
            counters = self.node.counters
            counters["claims_answer_cut"] = counters.get("claims_answer_cut", 0) + 1
        for b in batches:
            self._send_batch(to, b)

    def _send_batch(self, to: str, batch: list[Message]) -> None:
        if self.node.spec_conflict:
            return  # (as NodePort.send_to: nothing of this view goes out)
        if not self.swim.send_to(to, batch[0], self.node.now, extra=tuple(batch[1:])):
            for claim in batch:
                self.node.send_to(to, claim)
