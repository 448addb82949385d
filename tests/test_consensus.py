"""Tests of :mod:`gossiprec.core.consensus`: the Fast Paxos fast round and the classic fallback rounds.

Several :class:`Consensus` objects for the same :class:`View` are wired to an in-memory :class:`Bus`:
``broadcast`` queues a message for every other member, ``send_to`` for one (itself included, as the
agent does). :meth:`Bus.pump` delivers the queue in FIFO order until it is empty, dropping what crosses
a partition or what a test's ``drop`` predicate rejects. No clock is involved: timeouts are the test
calling :meth:`Consensus.start_round` itself.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import pytest

from gossiprec.core.consensus import Consensus, keeps_quorum
from gossiprec.core.topology import JobTopology
from gossiprec.core.view import JOIN, REMOVE, Change, View, ViewMember, changes_digest
from gossiprec.core.wire import (
    Accept, Accepted, Decided, Message, Prepare, Promise, Proposal, Votes,
)

Drop = Callable[[str, str, Message], bool]


def make_view(n: int) -> View:
    members = [ViewMember(f"m{i}", f"addr-m{i}", "trainer", i) for i in range(n)]
    return View.initial(members, JobTopology.ddp(n, allow_shrink=True))


def rows(changes: list[Change]) -> tuple:
    return tuple((c.node, c.kind, c.addr, c.host, c.rack) for c in changes)


@dataclass
class Bus:
    view: View
    nodes: dict[str, Consensus] = field(default_factory=dict)
    queue: deque[tuple[str, str, Message]] = field(default_factory=deque)
    groups: list[set[str]] | None = None
    drop: Drop | None = None
    delivered: int = 0
    sent: list[tuple[str, str, Message]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for m in self.view.members:
            self.nodes[m.node] = Consensus(self.view, m.node, self._bcast(m.node), self._send(m.node))

    def _bcast(self, src: str) -> Callable[[str, Message], None]:
        def bcast(key: str, msg: Message) -> None:
            for dst in self.nodes:
                if dst != src:
                    self.queue.append((src, dst, msg))
        return bcast

    def _send(self, src: str) -> Callable[[str, Message], None]:
        def send(dst: str, msg: Message) -> None:
            self.queue.append((src, dst, msg))
        return send

    def connected(self, a: str, b: str) -> bool:
        if self.groups is None or a == b:
            return True
        return any(a in g and b in g for g in self.groups)

    def pump(self, limit: int = 200_000) -> int:
        n = 0
        while self.queue:
            n += 1
            assert n <= limit, "message storm: the protocol does not quiesce"
            src, dst, msg = self.queue.popleft()
            self.sent.append((src, dst, msg))
            if not self.connected(src, dst) or (self.drop is not None and self.drop(src, dst, msg)):
                continue
            self.delivered += 1
            deliver(self.nodes[dst], msg)
        return n

    def decisions(self) -> dict[str, bytes | None]:
        return {name: (c.decided.digest if c.decided else None) for name, c in self.nodes.items()}


def deliver(c: Consensus, msg: Message) -> None:
    t = type(msg)
    if t is Votes:
        c.on_votes(msg)  # type: ignore[arg-type]
    elif t is Proposal:
        c.on_proposal(msg)  # type: ignore[arg-type]
    elif t is Decided:
        c.on_decided(msg)  # type: ignore[arg-type]
    elif t is Prepare:
        c.on_prepare(msg)  # type: ignore[arg-type]
    elif t is Promise:
        c.on_promise(msg)  # type: ignore[arg-type]
    elif t is Accept:
        c.on_accept(msg)  # type: ignore[arg-type]
    elif t is Accepted:
        c.on_accepted(msg)  # type: ignore[arg-type]
    else:  # pragma: no cover - the bus carries nothing else
        raise AssertionError(f"unexpected {t.__name__}")


A = [Change("m1", REMOVE)]
B = [Change("m1", REMOVE), Change("m2", REMOVE)]
C = [Change("m3", REMOVE)]


def digest(view: View, changes: list[Change]) -> bytes:
    return changes_digest(view.epoch, view.config_id, changes)


def members(bus: Bus, k: int, start: int = 0) -> list[Consensus]:
    return [bus.nodes[f"m{i}"] for i in range(start, start + k)]


# -- fast round ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 4, 5, 8, 9, 16])
def test_fast_quorum_of_identical_votes_decides_everywhere(n: int) -> None:
    bus = Bus(make_view(n))
    qf = bus.view.fast_quorum()
    for c in members(bus, qf):
        c.propose(A if n > 1 else [Change("x", JOIN, "addr-x")])
    bus.pump()
    decided = bus.decisions()
    want = digest(bus.view, A if n > 1 else [Change("x", JOIN, "addr-x")])
    assert set(decided.values()) == {want}, decided  # every member, voter or not
    for c in bus.nodes.values():
        assert c.decided is not None and c.decided.fast
        assert c.decided.changes == (A if n > 1 else [Change("x", JOIN, "addr-x")])


@pytest.mark.parametrize("n", [4, 5, 8, 9, 16])
def test_one_vote_short_of_the_fast_quorum_decides_nothing(n: int) -> None:
    bus = Bus(make_view(n))
    for c in members(bus, bus.view.fast_quorum() - 1):
        c.propose(A)
    bus.pump()
    assert set(bus.decisions().values()) == {None}
    assert all(c.vote_count() == bus.view.fast_quorum() - 1 for c in bus.nodes.values())


def test_votes_are_aggregated_in_bitmaps_not_one_message_per_vote_per_member() -> None:
    bus = Bus(make_view(16))
    for c in bus.nodes.values():
        c.propose(A)
    bus.pump()
    assert set(bus.decisions().values()) == {digest(bus.view, A)}
    # a member re-broadcasts its bitmap only when it grows (at most N times), never on every receipt
    per_src: dict[str, int] = {}
    for src, _, m in bus.sent:
        if isinstance(m, Votes):
            per_src[src] = per_src.get(src, 0) + 1
    assert len(per_src) == 16
    assert all(count % 15 == 0 and count // 15 <= 16 for count in per_src.values()), per_src


def test_a_member_votes_once_per_epoch() -> None:
    bus = Bus(make_view(8))
    c = bus.nodes["m0"]
    c.propose(A)
    c.propose(B)  # a second, different cut from the same member: no second vote
    assert c.my_vote == digest(bus.view, A)
    assert c.votes[digest(bus.view, A)] == 1
    assert digest(bus.view, B) not in c.votes
    assert digest(bus.view, B) in c.proposals  # but the proposal is known and spread


def test_vote_bits_beyond_the_view_are_ignored() -> None:
    view = make_view(8)
    bus = Bus(view)
    c = bus.nodes["m7"]
    d = digest(view, A)
    c.on_proposal(Proposal(view.epoch, view.config_id, d, rows(A)))
    forged = (0b0011_1111 | 0xFF00).to_bytes(2, "little")  # 6 real voters + 8 bits past the view
    c.on_votes(Votes(view.epoch, view.config_id, d, forged))
    assert c.vote_count() == 6
    assert c.decided is None  # fast quorum of 8 is 7


def test_proposal_whose_digest_does_not_match_is_dropped() -> None:
    view = make_view(5)
    c = Bus(view).nodes["m0"]
    c.on_proposal(Proposal(view.epoch, view.config_id, digest(view, A), rows(B)))
    assert c.proposals == {}
    c.on_proposal(Proposal(view.epoch, view.config_id, digest(view, A), rows(A)))
    assert c.proposals == {digest(view, A): A}


def test_votes_without_the_proposal_do_not_decide_until_it_arrives() -> None:
    view = make_view(5)
    c = Bus(view).nodes["m4"]
    d = digest(view, A)
    c.on_votes(Votes(view.epoch, view.config_id, d, bytes([0b1111])))  # 4 = fast quorum of 5
    assert c.decided is None  # cannot decide a value it does not know
    c.on_proposal(Proposal(view.epoch, view.config_id, d, rows(A)))
    assert c.decided is not None and c.decided.digest == d and c.decided.fast


# -- classic rounds -----------------------------------------------------------------------------------


def test_conflicting_proposals_need_a_classic_round_which_decides_one_value() -> None:
    bus = Bus(make_view(8))
    for i, c in enumerate(bus.nodes.values()):
        c.propose(A if i % 2 == 0 else B)
    bus.pump()
    assert set(bus.decisions().values()) == {None}  # 4 / 4: no fast decision
    bus.nodes["m5"].start_round()
    bus.pump()
    decided = set(bus.decisions().values())
    assert len(decided) == 1 and None not in decided
    assert decided <= {digest(bus.view, A), digest(bus.view, B)}
    for c in bus.nodes.values():
        assert c.decided is not None and not c.decided.fast
    coord = bus.nodes["m5"]
    assert len(coord.accepts) >= bus.view.majority()


def test_classic_round_with_a_three_way_split_picks_the_most_voted() -> None:
    bus = Bus(make_view(9))
    for i, c in enumerate(bus.nodes.values()):
        c.propose(A if i < 4 else (B if i < 7 else C))
    bus.pump()
    bus.nodes["m8"].start_round()  # votes C itself
    bus.pump()
    assert set(bus.decisions().values()) == {digest(bus.view, A)}


def test_classic_round_without_any_vote_decides_a_known_proposal() -> None:
    bus = Bus(make_view(5))
    view = bus.view
    # the proposal is known everywhere, but nobody voted (e.g. every vote was lost)
    for c in bus.nodes.values():
        c.on_proposal(Proposal(view.epoch, view.config_id, digest(view, C), rows(C)))
    assert all(c.votes == {} and c.decided is None for c in bus.nodes.values())
    bus.queue.clear()
    bus.nodes["m0"].start_round()
    bus.pump()
    assert set(bus.decisions().values()) == {digest(view, C)}


def test_classic_round_with_nothing_to_propose_decides_nothing() -> None:
    bus = Bus(make_view(5))
    bus.nodes["m0"].start_round()
    bus.pump()
    assert set(bus.decisions().values()) == {None}
    assert bus.nodes["m0"].accept_value is None


def _coordinator_with_promises(n: int, own: list[Change], promised: list[list[Change] | None],
                               classic: dict[int, tuple[int, str]] | None = None) -> tuple[Consensus, list]:
    """A coordinator (m0) that voted ``own``, given hand-made promises: ``promised[i]`` is the value
    acceptor m{i+1} reports (None: no vote); ``classic[i]`` marks it as accepted in that classic round."""
    view = make_view(n)
    out: list[tuple[str, Message]] = []
    c = Consensus(view, "m0", lambda k, m: None, lambda dst, m: out.append((dst, m)))
    c.propose(own)
    c.start_round()
    r, me = c.my_round  # type: ignore[misc]
    own_d = digest(view, own)
    c.on_promise(Promise(view.epoch, view.config_id, r, me, "m0", 0, "", own_d, rows(own)))
    for i, value in enumerate(promised):
        vround, vcoord = (classic or {}).get(i, (0, ""))
        d = digest(view, value) if value is not None else None
        c.on_promise(Promise(view.epoch, view.config_id, r, me, f"m{i + 1}", vround, vcoord, d,
                             rows(value) if value is not None else None))
    return c, out


def _accepts(out: list) -> set[bytes]:
    return {m.digest for _, m in out if isinstance(m, Accept)}


def test_coordinator_picks_the_value_that_may_have_been_chosen_on_the_fast_path() -> None:
    # N = 8: fast quorum 7, majority 5. A got 7 fast votes, but the coordinator hears only a majority:
    # itself (voted B, smallest digest or not) and 4 acceptors that voted A. 4 >= 7 - (8 - 5): A may
    # have been chosen, so A is the only safe value, although the coordinator itself voted B.
    view = make_view(8)
    c, out = _coordinator_with_promises(8, B, [A, A, A, A])
    assert c.accept_value is not None
    assert c.accept_value[0] == digest(view, A)
    assert _accepts(out) == {digest(view, A)}


def test_coordinator_prefers_the_highest_classic_round_over_fast_votes() -> None:
    view = make_view(8)
    # acceptor m3 accepted C in classic round 2 (coordinator m7), m4 accepted B in round 1: C wins
    c, out = _coordinator_with_promises(8, A, [A, A, C, B], classic={2: (2, "m7"), 3: (1, "m9")})
    assert c.accept_value is not None and c.accept_value[0] == digest(view, C)
    assert _accepts(out) == {digest(view, C)}


def test_coordinator_waits_for_a_majority_of_promises() -> None:
    view = make_view(8)
    c, out = _coordinator_with_promises(8, A, [A, A, A])  # 4 promises < majority 5
    assert c.accept_value is None and _accepts(out) == set()
    r, me = c.my_round  # type: ignore[misc]
    # a promise from a non-member or for another round does not count
    c.on_promise(Promise(view.epoch, view.config_id, r, me, "stranger", 0, "", None, None))
    c.on_promise(Promise(view.epoch, view.config_id, r + 1, me, "m6", 0, "", None, None))
    assert c.accept_value is None
    c.on_promise(Promise(view.epoch, view.config_id, r, me, "m6", 0, "", None, None))
    assert c.accept_value is not None and c.accept_value[0] == digest(view, A)


def test_a_minority_never_decides() -> None:
    bus = Bus(make_view(8))
    minority = {f"m{i}" for i in range(4)}  # 4 of 8 < majority 5
    bus.groups = [minority, set(bus.nodes) - minority]
    for name in sorted(minority):
        bus.nodes[name].propose(A)
    bus.pump()
    for _ in range(5):  # coordinators in the minority keep trying, with ever higher rounds
        for name in sorted(minority):
            bus.nodes[name].start_round()
            bus.pump()
    assert set(bus.decisions().values()) == {None}
    # the other half is no majority either, whatever it does
    for name in sorted(set(bus.nodes) - minority):
        bus.nodes[name].propose(B)
    bus.pump()
    bus.nodes["m7"].start_round()
    bus.pump()
    assert set(bus.decisions().values()) == {None}


def test_a_majority_side_decides_and_the_minority_learns_it_after_healing() -> None:
    bus = Bus(make_view(8))
    minority = {"m0", "m1", "m2"}
    bus.groups = [minority, set(bus.nodes) - minority]
    for name in sorted(minority):
        bus.nodes[name].propose(A)
    for name in sorted(set(bus.nodes) - minority):
        bus.nodes[name].propose(B)
    bus.pump()
    assert set(bus.decisions().values()) == {None}  # 5 < fast quorum 7
    bus.nodes["m0"].start_round()  # minority coordinator: no quorum
    bus.nodes["m7"].start_round()  # majority coordinator
    bus.pump()
    d = bus.decisions()
    assert {d[x] for x in minority} == {None}
    assert {d[x] for x in set(bus.nodes) - minority} == {digest(bus.view, B)}
    bus.groups = None
    m7 = bus.nodes["m7"]
    assert m7.decided is not None  # its node gossips the decision again once healed:
    m7.broadcast("d", Decided(bus.view.epoch, bus.view.config_id, m7.decided.digest, rows(m7.decided.changes)))
    bus.pump()
    assert set(bus.decisions().values()) == {digest(bus.view, B)}


def test_competing_coordinators_decide_one_value() -> None:
    bus = Bus(make_view(8))
    for i, c in enumerate(bus.nodes.values()):
        c.propose(A if i < 4 else B)
    bus.pump()
    x, y = bus.nodes["m0"], bus.nodes["m7"]
    y.start_round()
    y.start_round()  # y is at round 2, x at round 1: different rounds, both in flight at once
    x.start_round()
    assert x.my_round == (1, "m0") and y.my_round == (2, "m7")
    bus.pump()
    for _ in range(6):  # the loser retries with a higher round, as the agent's fallback timer does
        if all(v is not None for v in bus.decisions().values()):
            break
        for c in (x, y):
            if c.decided is None:
                c.start_round()
        bus.pump()
    decided = set(bus.decisions().values())
    assert len(decided) == 1 and None not in decided


def test_a_later_coordinator_adopts_a_value_accepted_in_an_earlier_round() -> None:
    """Round 1 (m0, value A) reaches acceptance at a majority, but its Accepted replies are lost, so
    m0 does not decide. Round 2 (m7, which voted B) must find A in the promises and decide A."""
    bus = Bus(make_view(8))
    for i, c in enumerate(bus.nodes.values()):
        c.propose(A if i < 4 else B)
    bus.pump()
    bus.drop = lambda src, dst, m: isinstance(m, Accepted)
    bus.nodes["m0"].start_round()
    bus.pump()
    accepted_a = [c.me for c in bus.nodes.values() if c.accepted_rank == (1, "m0")]
    assert len(accepted_a) >= bus.view.majority()
    assert set(bus.decisions().values()) == {None}
    bus.drop = None
    m7 = bus.nodes["m7"]
    assert m7.my_vote == digest(bus.view, B)
    m7.start_round()
    assert m7.my_round == (2, "m7")
    bus.pump()
    assert set(bus.decisions().values()) == {digest(bus.view, A)}


def test_acceptor_refuses_lower_rounds_after_a_promise() -> None:
    view = make_view(5)
    out: list[tuple[str, Message]] = []
    c = Consensus(view, "m1", lambda k, m: None, lambda dst, m: out.append((dst, m)))
    c.on_prepare(Prepare(view.epoch, view.config_id, 3, "m0"))
    assert [type(m) for _, m in out] == [Promise]
    out.clear()
    c.on_prepare(Prepare(view.epoch, view.config_id, 2, "m4"))
    c.on_accept(Accept(view.epoch, view.config_id, 2, "m4", digest(view, A), rows(A)))
    assert out == []  # no promise, no acceptance for a lower round
    assert c.highest_round == 3
    # fast votes are refused once a classic round is promised
    c.propose(A)
    assert c.my_vote is None
    # an Accept whose content does not match its digest is refused even in the promised round
    c.on_accept(Accept(view.epoch, view.config_id, 3, "m0", digest(view, A), rows(B)))
    assert out == [] and c.accepted_digest is None
    c.on_accept(Accept(view.epoch, view.config_id, 3, "m0", digest(view, A), rows(A)))
    assert [type(m) for _, m in out] == [Accepted]
    assert c.accepted_rank == (3, "m0") and c.accepted_digest == digest(view, A)


# -- decisions ----------------------------------------------------------------------------------------


def test_decided_whose_digest_does_not_match_its_changes_is_ignored() -> None:
    view = make_view(5)
    bus = Bus(view)
    c = bus.nodes["m2"]
    c.on_decided(Decided(view.epoch, view.config_id, digest(view, A), rows(B)))
    assert c.decided is None
    # a digest from another epoch or config does not match either
    other = changes_digest(view.epoch + 1, view.config_id, A)
    c.on_decided(Decided(view.epoch, view.config_id, other, rows(A)))
    assert c.decided is None
    c.on_decided(Decided(view.epoch, view.config_id, digest(view, A), rows(A)))
    assert c.decided is not None and c.decided.heard and not c.decided.fast
    assert c.decided.changes == A


def test_first_decision_sticks() -> None:
    view = make_view(5)
    c = Bus(view).nodes["m2"]
    c.on_decided(Decided(view.epoch, view.config_id, digest(view, A), rows(A)))
    c.on_decided(Decided(view.epoch, view.config_id, digest(view, B), rows(B)))
    assert c.decided is not None and c.decided.digest == digest(view, A)
    c.start_round()
    assert c.my_round is None  # nothing left to coordinate


# -- what a member stands behind (the node's keeps_quorum) ---------------------------------------------

def _backing_bus(n: int) -> Bus:
    """A bus whose members stand behind what the node's rule allows (:func:`keeps_quorum`)."""
    bus = Bus(make_view(n))
    for name, c in bus.nodes.items():
        c.backs = lambda changes, me=name: keeps_quorum(bus.view, changes, me)
    return bus



def test_a_bound_value_whose_backers_lost_one_member_is_still_decided() -> None:
    # N = 16 cut 9 | 7: side A (m0..m8) votes V = "remove B" (9 votes, short of the fast quorum 13; B
    # learns V but does not vote for its own removal). Round 1's Accept reaches only m1, then m8
    # crashes: V is bound (accepted in a classic round) and only 8 of its backers are left, one short of
    # a majority. The members V removes accept it (it keeps a majority), so a later round decides it;
    # had they refused it, no round could decide V nor abandon it, and the epoch would wedge.
    bus = _backing_bus(16)
    side_b = [f"m{i}" for i in range(9, 16)]
    v = [Change(m, REMOVE) for m in side_b]
    for c in bus.nodes.values():
        c.propose(v)
    assert bus.nodes["m9"].my_vote is None and bus.nodes["m0"].my_vote == digest(bus.view, v)
    bus.nodes["m0"].start_round()
    bus.drop = lambda src, dst, msg: isinstance(msg, Accept) and dst != "m1"
    bus.pump()
    assert bus.nodes["m1"].accepted_rank == (1, "m0") and bus.nodes["m0"].decided is None
    bus.drop = lambda src, dst, msg: "m8" in (src, dst)
    bus.nodes["m2"].start_round()
    bus.pump()
    decided = {name: d for name, d in bus.decisions().items() if name != "m8"}
    assert set(decided.values()) == {digest(bus.view, v)}


def test_acceptors_refuse_only_values_that_remove_a_majority() -> None:
    view = make_view(8)
    half = [Change(f"m{i}", REMOVE) for i in range(1, 4)]  # keeps 5 = majority, removes m1
    most = [Change(f"m{i}", REMOVE) for i in range(1, 5)]  # keeps 4 < majority
    for changes, accepted in ((half, True), (most, False)):
        out: list[tuple[str, Message]] = []
        c = Consensus(view, "m1", lambda k, m: None, lambda dst, m, out=out: out.append((dst, m)),
                      lambda ch: keeps_quorum(view, ch, "m1"))
        d = digest(view, changes)
        c.on_accept(Accept(view.epoch, view.config_id, 1, "m0", d, rows(changes)))
        assert any(isinstance(m, Accepted) for _, m in out) is accepted
        c.propose(changes)
        assert c.my_vote is None  # voting keeps the "keeps me" rule


def test_free_choice_passes_over_a_value_that_removes_answering_promisers() -> None:
    # N = 16, majority 9, fast quorum 13. The coordinator m0 voted V = "remove m9..m15" (one side of a
    # healed partition); m9..m15 answer its Prepare now. Of the first 9 promisers only 2 voted V
    # (fewer than 13 - 7): V was not chosen in the fast round, and the choice is free. V keeps only 2 of
    # the promisers: the coordinator picks the cut the alerts show now (remove the crashed m8).
    view = make_view(16)
    out: list[tuple[str, Message]] = []
    c = Consensus(view, "m0", lambda k, m: None, lambda dst, m: out.append((dst, m)),
                  lambda ch: keeps_quorum(view, ch, "m0"))
    v = [Change(f"m{i}", REMOVE) for i in range(9, 16)]
    now = [Change("m8", REMOVE)]
    c.propose(v)
    c.propose(now)  # learned; m0 voted already
    c.start_round()
    r, me = c.my_round  # type: ignore[misc]
    vd = digest(view, v)
    for acceptor in ["m0", *(f"m{i}" for i in range(9, 16)), "m1"]:
        voted = acceptor in ("m0", "m1")
        c.on_promise(Promise(view.epoch, view.config_id, r, me, acceptor, 0, "", vd if voted else None,
                             rows(v) if voted else None))
    assert c.accept_value is not None and c.accept_value[0] == digest(view, now)
    assert _accepts(out) == {digest(view, now)}


def test_free_choice_waits_for_more_promises_when_no_value_keeps_a_majority_of_them() -> None:
    view = make_view(8)
    out: list[tuple[str, Message]] = []
    c = Consensus(view, "m0", lambda k, m: None, lambda dst, m: out.append((dst, m)),
                  lambda ch: keeps_quorum(view, ch, "m0"))
    c.propose(A)  # removes m1
    c.start_round()
    r, me = c.my_round  # type: ignore[misc]
    for acceptor in ("m0", "m1", "m2", "m3", "m4"):  # majority 5, but A keeps only 4 of them
        c.on_promise(Promise(view.epoch, view.config_id, r, me, acceptor, 0, "", None, None))
    assert c.accept_value is None
    c.on_promise(Promise(view.epoch, view.config_id, r, me, "m5", 0, "", None, None))
    assert c.accept_value is not None and c.accept_value[0] == digest(view, A)


def test_a_member_that_backs_no_proposal_starts_no_round() -> None:
    view = make_view(8)
    out: list[tuple[str, Message]] = []
    c = Consensus(view, "m1", lambda k, m: None, lambda dst, m: out.append((dst, m)),
                  lambda ch: keeps_quorum(view, ch, "m1"))
    c.propose(A)  # removes m1 itself: learned, not voted
    c.start_round()
    assert c.my_round is None and out == []
    c.propose(C)
    c.start_round()
    assert c.my_round is not None and any(isinstance(m, Prepare) for _, m in out)


# -- a vote cast by one side of a partition, after the heal -----------------------------------------------

def _side_promises(c: Consensus, view: View, v: list[Change], others: list[str]) -> None:
    """Promises to ``c``'s round from m0..m7 (one side, all voted ``v``), then from ``others`` (no vote)."""
    r, me = c.my_round  # type: ignore[misc]
    vd = digest(view, v)
    for i in range(8):
        c.on_promise(Promise(view.epoch, view.config_id, r, me, f"m{i}", 0, "", vd, rows(v)))
    for acceptor in others:
        c.on_promise(Promise(view.epoch, view.config_id, r, me, acceptor, 0, "", None, None))


def _side_coordinator(view: View, v: list[Change], **kw: Callable) -> tuple[Consensus, list]:
    out: list[tuple[str, Message]] = []
    c = Consensus(view, "m0", lambda k, m: None, lambda dst, m: out.append((dst, m)),
                  lambda ch: keeps_quorum(view, ch, "m0"), **kw)
    c.propose(v)
    c.start_round()
    return c, out


def test_the_members_a_value_removes_are_not_counted_as_its_silent_fast_voters() -> None:
    # N = 16, majority 9, fast quorum 13. m0..m7 voted V = "remove m8..m11" while cut off; healed, m8
    # promises too. Counting every silent member, V had 8 >= 13 - 7 votes and might have been chosen; but
    # m9..m11 never vote for their own removal, so at most 8 + 4 < 13: the choice is free, and V keeps
    # only 8 of the 9 promisers
    view = make_view(16)
    v = [Change(f"m{i}", REMOVE) for i in range(8, 12)]
    c, out = _side_coordinator(view, v)
    _side_promises(c, view, v, ["m8"])
    assert c.accept_value is None and _accepts(out) == set()


def test_a_promise_from_a_member_held_dead_holds_a_value_that_may_have_been_chosen() -> None:
    # V = "remove m12, m13": with 9 promises, 8 >= 13 - (7 - 2), so V may have been chosen in the fast
    # round and a coordinator whose evidence is current takes it. One whose SWIM holds the promiser dead
    # (a partition just healed) waits: each further promise leaves fewer silent voters.
    view = make_view(16)
    v = [Change("m12", REMOVE), Change("m13", REMOVE)]
    current, out = _side_coordinator(view, v)
    _side_promises(current, view, v, ["m8"])
    assert _accepts(out) == {digest(view, v)}  # the Fast Paxos rule, as before
    healed, out = _side_coordinator(view, v, unheard=lambda name: name not in {f"m{i}" for i in range(8)})
    _side_promises(healed, view, v, ["m8", "m9", "m10", "m11"])
    assert healed.accept_value is None and _accepts(out) == set()


def test_no_round_and_no_free_choice_for_a_change_set_the_evidence_no_longer_backs() -> None:
    view = make_view(16)
    v = [Change("m12", REMOVE), Change("m13", REMOVE)]
    others = ["m8", "m9", "m14", "m15"]  # 12 promises: 8 < 13 - (4 - 2), the choice is free
    backed, out = _side_coordinator(view, v)
    _side_promises(backed, view, v, others)
    assert _accepts(out) == {digest(view, v)}
    stale = {"yes": False}
    c, out = _side_coordinator(view, v, fresh=lambda ch: not stale["yes"])
    assert c.change_pending()
    stale["yes"] = True  # m12 and m13 came back, their alerts were retracted
    _side_promises(c, view, v, others)
    assert c.accept_value is None and _accepts(out) == set()
    assert not c.change_pending()  # a fence may end
    c.my_round = None
    c.start_round()
    assert c.my_round is None


# -- re-sends -----------------------------------------------------------------------------------------


def test_a_coordinator_preempted_by_a_higher_round_stops_resending_its_phase() -> None:
    """m0 coordinates round 1; m4's round 2 reaches it first (and most members): m0 promises it and its
    own round ends, so its re-sends stop (acceptors that promised round 2 would drop them unanswered;
    under load such re-sends to the whole view kept 128 agents saturated). Round 2 still decides."""
    bus = Bus(make_view(5))
    for c in bus.nodes.values():
        c.propose(A)
    bus.queue.clear()  # the fast round's votes are lost: a classic round must decide
    m0, m4 = bus.nodes["m0"], bus.nodes["m4"]
    m0.start_round()
    assert m0.my_round == (1, "m0")
    bus.queue.clear()  # its Prepares are lost too
    m4.start_round()
    m4.start_round()  # round 2
    assert m4.my_round == (2, "m4")
    bus.pump()
    assert m0.my_round is None and m0.promises == {} and m0.accept_value is None
    sent = len(bus.sent)
    m0.resend()
    assert len(bus.sent) == sent and not bus.queue  # nothing re-sent
    assert set(bus.decisions().values()) == {digest(bus.view, A)}
    # a lower round never ends a higher one of ours
    c = Consensus(bus.view, "m1", lambda k, m: None, lambda dst, m: None)
    c.propose(A)
    c.start_round()
    c.start_round()
    c.start_round()
    assert c.my_round == (3, "m1")
    c.on_prepare(Prepare(bus.view.epoch, bus.view.config_id, 2, "m0"))
    assert c.my_round == (3, "m1")


def test_a_coordinators_resends_back_off_within_a_round_and_phase() -> None:
    """The decider re-sends its round's phase after retry_interval, then 2, 4, 8 times it, at most 8
    times it; a new round starts again at 1."""
    from types import SimpleNamespace

    from gossiprec.core.config import AgreementConfig
    from gossiprec.core.decide import RESEND_BACKOFF_MAX, Decider

    view = make_view(5)
    timers: list[float] = []
    sent: list[tuple[str, Message]] = []
    node = SimpleNamespace(name="m0", view=view, auth=None, counters={}, now=0.0,
                           broadcast=lambda key, msg: None, send_to=lambda dst, msg: sent.append((dst, msg)),
                           set_timer=lambda at, kind: timers.append(at))
    cut = SimpleNamespace(supports=lambda changes, now: True, unstable=lambda name, but: False)
    swim = SimpleNamespace(member=lambda name: None)
    acfg = AgreementConfig()
    d = Decider(node, swim, acfg)  # type: ignore[arg-type]
    d.start_view(view, cut, 9)  # type: ignore[arg-type]
    d.consensus.propose(A)
    d.consensus.start_round()
    gaps = []
    for i in range(6):
        before = len(sent)
        d.resend(float(i))
        assert len(sent) - before == len(view.members)  # nobody answered: the Prepare to every member
        gaps.append(round(timers[-1] - i, 6))
    r = acfg.retry_interval
    assert gaps == [r, 2 * r, 4 * r, 8 * r, 8 * r, 8 * r] and RESEND_BACKOFF_MAX == 8, gaps
    d.consensus.start_round()  # a new round: from retry_interval again
    d.resend(10.0)
    assert round(timers[-1] - 10.0, 6) == r
