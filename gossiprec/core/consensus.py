"""Leaderless consensus on the next view: a Fast Paxos fast round, then classic Paxos rounds.

What it decides: one change set per epoch, agreed by a quorum of the *current* view, never by a minority.

Fast round: every member that detects a cut votes for it once. Votes travel as a bitmap over the view's
sorted members, merged by OR and gossiped (one message carries thousands of votes), so the number of
messages stays O(N log N) however many members vote. A proposal with ``fast_quorum = N - floor((N-1)/4)``
votes is decided at once.

Classic rounds: a member that voted (or saw votes) and has not decided after ``fallback_timeout`` plus a
random delay becomes coordinator of round ``r = highest seen + 1`` (rounds are ordered by
``(r, coordinator)``): Prepare to all, Promise from a majority, Accept of the value Fast Paxos allows,
Accepted from a majority, then Decided. Value choice (Lamport, Fast Paxos, section 3.3): among the
promises, the value of the highest classic round if any; else a fast-round value ``v`` voted by at least
``fast_quorum - (N - |promises|)`` of the promisers, which is the only value that may have been chosen
in the fast round; else the most-voted proposal (ties: smallest digest); else the coordinator's own.

A member accepts a fast vote only while it has promised no classic round, so a value chosen in the fast
round is never contradicted. Quorums are counted among the members of the current view only.

What a member stands behind (``backs``; the node passes :func:`keeps_quorum`): it votes for, coordinates
and freely picks only change sets that keep a majority of the view, itself among them (a member does not
vote for its own removal). As an acceptor it refuses only change sets that remove a majority of the view
(:func:`removes_majority`): one that removes it may already be bound (accepted in a classic round, or
possibly chosen in the fast round), and if the members it removes refused it, a bound value whose
backers lost one member could neither be decided nor abandoned, and the epoch would wedge. Since no
member votes for, and no acceptor accepts, a change set removing a majority, none is ever decided (alerts
gathered across a flapping partition that accuse everyone wait, and the watchdog fences).

A coordinator's free choice (no value bound) takes only change sets that keep at least a majority of the
view among its promisers: a value voted by one side of a healed partition that removes the other side,
now answering, is passed over for the cut the alerts show now. A coordinator bound to a value it may not
stand behind abstains rather than pick another (a removed member leaves coordinating to the others; the
members the value keeps form a majority, so one of them coordinates it), and a member that stands behind
no proposal of the epoch starts no round.

Evidence from before a heal (``fresh``: the node passes :meth:`~gossiprec.core.cut.CutDetector.supports`): a
side of a partition may vote, while cut off, to remove part of the other side (a member there that it has
no news of looks reachable), and its coordinators keep asking for promises; healed, one promise from the
other side would make the majority. So a round starts, and a free choice takes a change set, only while
the alerts behind each of its removals still stand and the subject has not come back from the dead since.
A coordinator that gets a promise from a member its SWIM holds suspect or dead (its picture predates a
heal) chooses nothing freely in that round; a value that may have been chosen in the fast round, but that
it no longer backs (or with such a promise in), it does not take while silent members remain: each
further promise leaves fewer that could have voted for it, and with none left it was chosen. The
members a change set removes never voted for it (``backs``), so they do not count among those silent
voters. A member with nothing accepted in a classic round and no change set its evidence stands behind
has no change pending (:meth:`Consensus.change_pending`), so its fence can end after the heal.

Signed ballots (with a :class:`~gossiprec.core.auth.KeyBook`): every vote, prepare, promise, accept and
accepted carries its author's signature and counts only if it checks, so one holder of the cluster key
is at most one faulty member. Fast votes then are each voter's own signed :class:`Vote` (sent alone by
its voter, relayed in :class:`~gossiprec.core.wire.VoteBundle` s that carry each voter's signature, see
:mod:`~gossiprec.core.bundles`; the unsigned bitmaps are ignored), and accepteds are gossiped as well as
sent to their coordinator: every member counts a fast quorum of signed votes, or a majority of signed
accepteds of one round, itself. A ``Decided`` is only a hint that brings the change set (checked against
its digest); it decides nothing without the signed quorum behind it. A member that missed those learns the
next view by catch-up.

Unproven change sets (with a key book): a ``Proposal`` or a ``Decided`` is nobody's signed word, so the
change set it brings is not a proposal of the epoch until a signed word stands behind its digest (a
member's signed vote, a coordinator's signed accept, an acceptor's signed promise or accepted): until
then it waits in :attr:`Consensus.unproven` (at most ``UNPROVEN_MAX``, the oldest dropped first), which
nothing reads but the proof that promotes it. So a forged one arms no round, moves no deadline and makes
no "decision under way" for the watchdog's fence clock (:mod:`~gossiprec.core.fencing`); a real one whose
vote comes after it is taken the moment the vote counts.

Safety needs none of these filters: an acceptor's refusal is a lost message to Paxos, and the coordinator
picks as Fast Paxos says whenever a value may have been chosen; the filters only keep some values from
ever being decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from gossiprec.core import bundles
from gossiprec.core.auth import KeyBook
from gossiprec.core.view import REMOVE, Change, View, changes_digest
from gossiprec.core.wire import (
    BUNDLE_MAX, Accept, Accepted, Decided, Message, Prepare, Promise, Proposal, Vote, VoteBundle, Votes,
)

Rank = tuple[int, str]
ChangeRow = tuple[str, int, str, str, str]
"""A change on the wire: (node, kind, addr, host, rack)."""
FAST: Rank = (0, "")
UNPROVEN_MAX = 64
"""Change sets held while no signed word stands behind their digest (see the module docstring)."""


def removes_majority(view: View, changes: list[Change]) -> bool:
    """Whether ``changes`` leave fewer than a majority of ``view`` (such a change is never decided)."""
    removed = {c.node for c in changes if c.kind == REMOVE and c.node in view}
    return len(view) - len(removed) < view.majority()


def keeps_quorum(view: View, changes: list[Change], me: str) -> bool:
    """Whether member ``me`` may vote for, accept or coordinate ``changes``: they keep a majority of the
    view, and keep ``me`` (a member does not help decide its own removal; the kept majority does)."""
    if removes_majority(view, changes):
        return False
    return not any(c.node == me and c.kind == REMOVE for c in changes)


def change_rows(changes: list[Change]) -> tuple[ChangeRow, ...]:
    return tuple((c.node, c.kind, c.addr, c.host, c.rack) for c in changes)


def changes_from_rows(rows: tuple[ChangeRow, ...]) -> list[Change]:
    return sorted((Change(*r) for r in rows), key=lambda c: (c.node, c.kind))


@dataclass(slots=True)
class Decision:
    digest: bytes
    changes: list[Change]
    fast: bool
    heard: bool


@dataclass(slots=True)
class Consensus:
    """One epoch's agreement state for one member. Sending is done by the callbacks given."""

    view: View
    me: str
    broadcast: Callable[[str, Message], None]
    send_to: Callable[[str, Message], None]
    backs: Callable[[list[Change]], bool] = field(default=lambda changes: True)
    """Whether this member may vote for, accept or coordinate a change set (see the module docstring)."""
    fresh: Callable[[list[Change]], bool] = field(default=lambda changes: True)
    """Whether this member's evidence still stands behind a change set's removals (the node passes
    :meth:`~gossiprec.core.cut.CutDetector.supports`): rounds start for, and a free choice takes, only
    such change sets (see the module docstring)."""
    unheard: Callable[[str], bool] = field(default=lambda name: False)
    """Whether this member's failure detector holds a member suspect or dead: a promise from it shows that
    our evidence is out of date (see :meth:`_choose`)."""
    unstable: Callable[[str, set[str]], bool] = field(default=lambda name, but: False)
    """Whether this member's cut holds a member unstable, not counting the alerts raised by ``but`` (the
    members a change set removes): its promise does not count as one the free choice keeps (see
    :meth:`_kept_promisers`)."""
    proposals: dict[bytes, list[Change]] = field(default_factory=dict)
    votes: dict[bytes, int] = field(default_factory=dict)
    my_vote: bytes | None = None
    promised: Rank = FAST
    accepted_rank: Rank = FAST
    accepted_digest: bytes | None = None
    highest_round: int = 0
    # coordinator
    my_round: Rank | None = None
    promises: dict[str, Promise] = field(default_factory=dict)
    accepts: set[str] = field(default_factory=set)
    accept_value: tuple[bytes, list[Change]] | None = None
    decided: Decision | None = None
    auth: KeyBook | None = None
    """Signed ballots (see the module docstring); None: every ballot is taken on the cluster key's word."""
    my_vote_msg: Vote | None = None
    accepted_by: dict[tuple[int, str, bytes], set[str]] = field(default_factory=dict)
    """Signed accepteds heard, by (round, coordinator, digest): who accepted (every member learns)."""
    vote_sigs: dict[bytes, dict[int, bytes]] = field(default_factory=dict)
    """Signed votes counted: digest -> view index -> the voter's signature (what bundles relay)."""
    chunk: int = BUNDLE_MAX
    """Members per vote bundle (see :func:`~gossiprec.core.bundles.chunk_size`)."""
    unproven: dict[bytes, list[Change]] = field(default_factory=dict)
    """With a key book: change sets brought by a ``Proposal`` or ``Decided`` that no signed word backs yet
    (digest -> changes; bounded, see the module docstring). Nothing acts on them until proven."""

    def _signed(self, author: str, msg: Message) -> bool:
        return self.auth is None or self.auth.check(author, msg)

    def _sign(self, msg: Message) -> Message:
        return msg if self.auth is None else self.auth.sign(msg)

    # ------------------------------------------------------------------ fast round
    def propose(self, changes: list[Change]) -> None:
        """Vote for our own cut (once per epoch)."""
        digest = changes_digest(self.view.epoch, self.view.config_id, changes)
        self._learn(digest, changes)
        if self.my_vote is None and self.promised == FAST and self.backs(changes):
            idx = self.view.index(self.me)
            if idx is None:
                return
            self.my_vote = digest
            self.accepted_digest = digest
            if self.auth is None:
                self._merge_votes(digest, 1 << idx)
                return
            vote = Vote(self.view.epoch, self.view.config_id, digest, self.me)
            self.my_vote_msg = vote
            self.auth.sign(vote)
            self.on_vote(vote)

    def _learn(self, digest: bytes, changes: list[Change]) -> None:
        if digest not in self.proposals:
            self.proposals[digest] = changes
            self.broadcast("p" + digest.hex(), Proposal(self.view.epoch, self.view.config_id, digest,
                                                         change_rows(changes)))

    def on_proposal(self, msg: Proposal) -> bool:
        """A change set on gossip. False: held unproven, or its content does not match its digest."""
        changes = changes_from_rows(msg.changes)
        if changes_digest(self.view.epoch, self.view.config_id, changes) != msg.digest:
            return False  # content does not match its digest: drop
        if not self._hold_unless_proven(msg.digest, changes):
            return False
        self._learn(msg.digest, changes)
        self._check_learned(msg.digest)
        return True

    def _proven(self, digest: bytes) -> bool:
        """Whether a signed word stands behind ``digest`` here (a counted vote, our own vote or accept, a
        signed accepted); without a key book every change set is taken on the cluster key's word."""
        if self.auth is None or digest in self.proposals or self.votes.get(digest, 0):
            return True
        return any(who and k[2] == digest for k, who in self.accepted_by.items())

    def _hold_unless_proven(self, digest: bytes, changes: list[Change]) -> bool:
        """True: ``digest`` is proven (go on). Else its change set waits in :attr:`unproven` (bounded)."""
        if self._proven(digest):
            return True
        if digest not in self.unproven:
            while len(self.unproven) >= UNPROVEN_MAX:
                del self.unproven[next(iter(self.unproven))]
            self.unproven[digest] = changes
        return False

    def _promote(self, digest: bytes) -> None:
        """A signed word now backs ``digest``: a change set held unproven for it becomes a proposal."""
        changes = self.unproven.pop(digest, None)
        if changes is not None:
            self._learn(digest, changes)

    def _check_learned(self, digest: bytes) -> None:
        """A change set just became known: any quorum already counted for its digest decides now."""
        self._check_fast(digest)
        if self.accepted_by:
            for key in [k for k in self.accepted_by if k[2] == digest]:
                self._check_classic(key)

    def on_vote(self, msg: Vote) -> None:
        """One member's signed vote: its bit counts once the signature checks; relayed in a bundle."""
        idx = self.view.index(msg.voter)
        if idx is None:
            return
        old = self.votes.get(msg.digest, 0)
        if self.decided is not None or old >> idx & 1 or not self._signed(msg.voter, msg):
            return
        self._votes_counted(msg.digest, {idx: msg.sig})

    def on_vote_bundle(self, msg: VoteBundle) -> bool:
        """Signed votes for one proposal (see :mod:`~gossiprec.core.bundles`): each voter not counted yet
        for it is checked as its own vote would be. False: a malformed bundle (nothing counted)."""
        v = self.view
        rows = bundles.fresh(msg.first, msg.bitmap, msg.sigs, self.votes.get(msg.digest, 0), len(v))
        if rows is None:
            return False
        if self.decided is not None:
            return True
        new: dict[int, bytes] = {}
        for idx, sig in rows:
            voter = v.members[idx].node
            if self._signed(voter, Vote(v.epoch, v.config_id, msg.digest, voter, sig)):
                new[idx] = sig
        if new:
            self._votes_counted(msg.digest, new)
        return True

    def _votes_counted(self, digest: bytes, new: dict[int, bytes]) -> None:
        bits = 0
        for idx in new:
            bits |= 1 << idx
        self.votes[digest] = self.votes.get(digest, 0) | bits
        sigs = self.vote_sigs.setdefault(digest, {})
        sigs.update(new)
        self._promote(digest)
        for c in bundles.chunks(bits, self.chunk):
            self.broadcast(f"V|{digest.hex()}|{c}", self.vote_bundle(digest, c))
        self._check_fast(digest)

    def vote_bundle(self, digest: bytes, chunk: int) -> VoteBundle:
        """Our bundle of the signed votes for ``digest`` counted in chunk ``chunk``."""
        v = self.view
        first, bitmap, sigs = bundles.gather(chunk, self.chunk, len(v), self.vote_sigs.get(digest, {}).get)
        return VoteBundle(v.epoch, v.config_id, digest, first, bitmap, sigs)

    def on_votes(self, msg: Votes) -> None:
        if self.auth is not None:
            return  # a bitmap is nobody's signed word: only signed votes count
        bits = int.from_bytes(msg.bitmap, "little")
        bits &= (1 << len(self.view)) - 1
        self._merge_votes(msg.digest, bits)

    def _merge_votes(self, digest: bytes, bits: int) -> None:
        old = self.votes.get(digest, 0)
        new = old | bits
        if new == old:
            return
        self.votes[digest] = new
        nbytes = (len(self.view) + 7) // 8
        self.broadcast("v" + digest.hex(), Votes(self.view.epoch, self.view.config_id, digest,
                                                 new.to_bytes(nbytes, "little")))
        self._check_fast(digest)

    def _check_fast(self, digest: bytes) -> None:
        if self.decided is not None:
            return
        if self.votes.get(digest, 0).bit_count() >= self.view.fast_quorum() and digest in self.proposals:
            self._decide(digest, self.proposals[digest], fast=True)

    def vote_count(self) -> int:
        return max((b.bit_count() for b in self.votes.values()), default=0)

    # ------------------------------------------------------------------ classic rounds
    def start_round(self) -> None:
        """Become coordinator of the next round, unless decided or this member stands behind no proposal
        (a member the cut removes leaves coordinating to the members it keeps)."""
        if self.decided is not None or not any(self.backs(c) and self.fresh(c) for c in self.proposals.values()):
            return
        self.highest_round += 1
        self.my_round = (self.highest_round, self.me)
        self.promises = {}
        self.accepts = set()
        self.accept_value = None
        self.resend()

    def resend(self) -> None:
        """(Re)send this coordinator's current phase to members that have not answered."""
        if self.my_round is None or self.decided is not None:
            return
        if self.accept_value is None and not any(self.backs(c) and self.fresh(c) for c in self.proposals.values()):
            # the evidence behind every change set of the epoch is gone (a healed partition's vote): the round
            # ends, or its Prepare would go out every retry_interval until the view changes
            self.my_round = None
            return
        r, me = self.my_round
        v = self.view
        if self.accept_value is None:
            msg: Message = self._sign(Prepare(v.epoch, v.config_id, r, me))
            waiting = set(self.promises)
        else:
            digest, changes = self.accept_value
            msg = self._sign(Accept(v.epoch, v.config_id, r, me, digest, change_rows(changes)))
            waiting = self.accepts
        for m in v.members:
            if m.node not in waiting:
                self.send_to(m.node, msg)

    def on_prepare(self, msg: Prepare) -> None:
        rank = (msg.round, msg.coordinator)
        if self.auth is not None and (msg.coordinator not in self.view or not self.auth.check(msg.coordinator, msg)):
            return  # a forged prepare at a huge round would otherwise outrank every real one
        self.highest_round = max(self.highest_round, msg.round)
        if rank < self.promised:
            return
        self.promised = rank
        self._preempted(rank)
        vdigest = self.accepted_digest
        vchanges = change_rows(self.proposals[vdigest]) if vdigest is not None and vdigest in self.proposals else None
        if vchanges is None:
            vdigest = None
        v = self.view
        self.send_to(msg.coordinator, self._sign(Promise(v.epoch, v.config_id, msg.round, msg.coordinator, self.me,
                                                         self.accepted_rank[0], self.accepted_rank[1], vdigest,
                                                         vchanges)))

    def _preempted(self, rank: Rank) -> None:
        """We promised ``rank``: a round of ours below it can no longer gather this member, nor most
        others (its coordinator's messages reach them as they reached us); it ends here instead of
        re-sending its phase to members that drop it unanswered, and the decider's fallback starts a new
        round only if the round we promised stops moving (see ``Decider._fast_round_moves``)."""
        if self.my_round is not None and rank > self.my_round and rank[1] != self.me:
            self.my_round = None
            self.promises = {}
            self.accepts = set()
            self.accept_value = None

    def on_promise(self, msg: Promise) -> None:
        if self.my_round != (msg.round, msg.coordinator) or self.accept_value is not None:
            return
        if msg.acceptor not in self.view or not self._signed(msg.acceptor, msg):
            return
        self.promises[msg.acceptor] = msg
        if msg.vdigest is not None and msg.vchanges is not None:
            self._learn(msg.vdigest, changes_from_rows(msg.vchanges))
        if len(self.promises) >= self.view.majority():
            self.accept_value = self._choose()
            if self.accept_value is not None:
                self.resend()

    def _choose(self) -> tuple[bytes, list[Change]] | None:
        """The value this coordinator must (or may) propose, or None: nothing to propose, or a value bound
        by an earlier round that this member may not stand behind (it abstains; see the module docstring)."""
        promises = list(self.promises.values())
        classic = [p for p in promises if p.vround > 0 and p.vdigest is not None]
        if classic:
            best = max(classic, key=lambda p: (p.vround, p.vcoordinator))
            assert best.vdigest is not None
            return self._if_mine(best.vdigest)
        # a promise from a member our failure detector holds suspect or dead: a partition has just healed,
        # and our evidence (alerts, votes) is from before it. Nothing is chosen freely in this round.
        stale = any(self.unheard(p) for p in self.promises)
        counts: dict[bytes, int] = {}
        for p in promises:
            if p.vdigest is not None:
                counts[p.vdigest] = counts.get(p.vdigest, 0) + 1
        # a member never votes for its own removal (keeps_quorum), so the silent members a value removes
        # cannot have voted for it in the fast round
        fq = self.view.fast_quorum()
        possible = [d for d, c in counts.items() if c >= fq - self._silent_voters(d)]
        if possible:
            d = min(possible)
            if (stale or not self.fresh(self.proposals[d])) and self._silent_voters(d) > 0:
                # it may have been chosen, but our evidence no longer backs it, or a promise came from a
                # member we hold suspect or dead (a partition just healed, and the silent voters this value
                # needs may be the other side, which did not vote for it): wait. Each promise that comes in
                # leaves fewer silent voters; once none is left, a fast quorum did vote for it: it is taken.
                return None
            return self._if_mine(d)
        # free choice: only among the values this member may stand behind, and that keep a majority of the
        # view among the members that answered (a value one side voted that removes the other, answering
        # now, is passed over; with too few such promisers the choice waits for more promises)
        if stale:
            return None
        majority = self.view.majority()
        ok = [d for d, ch in self.proposals.items()
              if self.backs(ch) and self.fresh(ch) and self._kept_promisers(ch) >= majority]
        voted = [d for d in counts if d in ok]
        if voted:
            d = min(voted, key=lambda x: (-counts[x], x))
            return d, self.proposals[d]
        if self.my_vote is not None and self.my_vote in ok:
            return self.my_vote, self.proposals[self.my_vote]
        if ok:
            d = min(ok)
            return d, self.proposals[d]
        return None

    def _kept_promisers(self, changes: list[Change]) -> int:
        """Promisers the change set keeps, less those our cut holds unstable (their answer shows our
        evidence is out of date, a partition just healed, not that the change set keeps a majority)."""
        removed = {c.node for c in changes if c.kind == REMOVE}
        return sum(1 for p in self.promises if p not in removed and not self.unstable(p, removed))

    def _silent_voters(self, digest: bytes) -> int:
        """Members that did not promise and may have voted for ``digest`` (not those it removes)."""
        changes = self.proposals.get(digest)
        removed = {c.node for c in changes if c.kind == REMOVE} if changes is not None else set()
        return sum(1 for m in self.view.members if m.node not in self.promises and m.node not in removed)

    def change_pending(self) -> bool:
        """Whether a change of this epoch may still be decided: a value accepted in a classic round, a vote
        whose change set is not known here, or a change set this member's evidence stands behind. (A vote
        cast by a side of a healed partition, whose evidence was since retracted, is none of these.)"""
        if self.decided is not None:
            return False
        if self.accepted_rank != FAST or any(d not in self.proposals for d in self.votes):
            return True
        return any(self.fresh(ch) for ch in self.proposals.values())

    def _if_mine(self, digest: bytes) -> tuple[bytes, list[Change]] | None:
        changes = self.proposals[digest]
        return (digest, changes) if self.backs(changes) else None

    def on_accept(self, msg: Accept) -> None:
        rank = (msg.round, msg.coordinator)
        if self.auth is not None and (msg.coordinator not in self.view or not self.auth.check(msg.coordinator, msg)):
            return
        self.highest_round = max(self.highest_round, msg.round)
        if rank < self.promised:
            return
        changes = changes_from_rows(msg.changes)
        if changes_digest(self.view.epoch, self.view.config_id, changes) != msg.digest:
            return
        if removes_majority(self.view, changes):
            return  # never decided (see the module docstring): as if the Accept were lost
        self.promised = rank
        self._preempted(rank)
        self.accepted_rank = rank
        self.accepted_digest = msg.digest
        self._learn(msg.digest, changes)
        v = self.view
        accepted = Accepted(v.epoch, v.config_id, msg.round, msg.coordinator, msg.digest, self.me)
        if self.auth is None:
            self.send_to(msg.coordinator, accepted)
            return
        self.auth.sign(accepted)
        self.send_to(msg.coordinator, accepted)
        self.on_accepted(accepted)  # counted here too, and gossiped: every member learns

    def on_accepted(self, msg: Accepted) -> None:
        if self.auth is not None:
            self._learn_accepted(msg)
            return
        if self.my_round != (msg.round, msg.coordinator) or self.accept_value is None:
            return
        if msg.digest != self.accept_value[0] or msg.acceptor not in self.view:
            return
        self.accepts.add(msg.acceptor)
        if len(self.accepts) >= self.view.majority():
            self._decide(msg.digest, self.accept_value[1], fast=False)

    def _learn_accepted(self, msg: Accepted) -> None:
        """A signed accepted (ours or anyone's): a majority of one round for one digest decides it."""
        if msg.acceptor not in self.view:
            return
        key = (msg.round, msg.coordinator, msg.digest)
        who = self.accepted_by.get(key)
        if who is not None and msg.acceptor in who:
            return
        # checked before anything is kept: forged accepteds under ever new keys would otherwise grow the map
        if not self._signed(msg.acceptor, msg):
            return
        who = self.accepted_by.setdefault(key, set())
        who.add(msg.acceptor)
        self._promote(msg.digest)
        self.broadcast(f"A|{msg.acceptor}|{msg.round}|{msg.coordinator}", msg)
        self._check_classic(key)

    def _check_classic(self, key: tuple[int, str, bytes]) -> None:
        digest = key[2]
        if (self.decided is None and len(self.accepted_by.get(key, ())) >= self.view.majority()
                and digest in self.proposals):
            self._decide(digest, self.proposals[digest], fast=False)

    # ------------------------------------------------------------------ decision
    def on_decided(self, msg: Decided) -> None:
        if self.decided is not None:
            return
        changes = changes_from_rows(msg.changes)
        if changes_digest(self.view.epoch, self.view.config_id, changes) != msg.digest:
            return
        if self.auth is not None:
            # a hint: it brings the change set, but only the signed quorum behind it decides (and with no
            # signed word behind it at all, it is not even a proposal: held unproven)
            if self._hold_unless_proven(msg.digest, changes):
                self._learn(msg.digest, changes)
                self._check_learned(msg.digest)
            return
        self._decide(msg.digest, changes, fast=False, heard=True)

    def _decide(self, digest: bytes, changes: list[Change], fast: bool, heard: bool = False) -> None:
        self.decided = Decision(digest, changes, fast, heard)
        v = self.view
        self.broadcast("d", Decided(v.epoch, v.config_id, digest, change_rows(changes)))
