"""State reports are their member's signed word: a holder of the cluster key cannot report for another.

The plan of a view (:mod:`gossiprec.core.election`) is a pure function of the view and the holders'
state reports, so a forged report (every rank at a step nobody holds, a healthy donor holding nothing)
would make every member compute a plan that cannot be carried out. With a key book each member's report
is its own signed :class:`~gossiprec.core.wire.StateClaim` (:mod:`gossiprec.core.aggregate`). Shown
here with signing nodes (pinned keys, the simulator's keyed-digest stand-in) on one virtual clock, on a
view of trainers n0, n1, n2 and spare n3 where n1 leaves (holders n0 and n2):

- honest signed claims give every member the same plan, the one unsigned bitmaps give; no ``Report``
  bitmap is sent; each member verifies each claim once however many copies reach it;
- so they do when gossip dropped every claim at first: re-aggregation (anti-entropy) sends them again;
- a forged report in healthy n2's name, as an unsigned bitmap or as a claim signed with n0's key, sent
  to every member before n2's own, is refused and counted (``rx_report_unsigned``,
  ``rx_state_claim_refused``), is not relayed, and every member computes the honest plan;
- plan digests likewise: each member's is its own signed :class:`~gossiprec.core.wire.PlanConfirm`, and
  a forged one in other members' names (an unsigned bitmap, or a confirm signed with n0's key) raises
  no ``PlanMismatch`` anywhere, is counted (``rx_plan_digest_unsigned``, ``rx_plan_confirm_refused``)
  and is not relayed;
- the cost, at 32 members (one leaves, 30 holders): each member verifies each other holder's claim and
  each other member's confirm once, 29 or 30 plus 30 verifications per member per recovery on top of
  the votes and alerts (``-s`` prints the total; counts, not times, are asserted).
"""

from __future__ import annotations

from typing import Any, Callable

import msgpack
import pytest

from gossiprec.core import wire
from gossiprec.core.auth import KeyBook
from gossiprec.core.node import Node
from gossiprec.core.events import PlanMismatch
from gossiprec.core.wire import PHASES, Message, PlanDigest, Report, decode_packet, encode_packet
from tests.support.signing import pinned_book, pins_of
from tests.test_node import MiniNet

NAMES = ["n0", "n1", "n2", "n3"]
FAR = 10**9
"""A forger's step: one nobody holds."""


def book(name: str, pins: dict[str, bytes]) -> KeyBook:
    return pinned_book(name, pins, counting=True)


class SignedNet(MiniNet):
    """:class:`~tests.test_node.MiniNet` of signing nodes (``signed``); ``drop`` takes (time, message)
    and says whether the network loses it."""

    def __init__(self, names: list[str], spares: int = 1, signed: bool = True,
                 drop: Callable[[float, Message], bool] | None = None, **acfg: Any) -> None:
        pins = pins_of(names)
        super().__init__(names, spares, auth=(lambda n: book(n, pins)) if signed else None, drop=drop, **acfg)

    def deliver_to_all(self, msg: Message) -> None:
        for node in self.nodes.values():
            node.receive(encode_packet([msg]), self.now)
        self._deliver()


def _recovery(net: SignedNet, forge: Callable[[SignedNet], None] | None = None) -> dict[str, str]:
    """n0, n1, n2 in the optimizer step of step 5 (committed 4); n1 leaves, so the survivors hold their
    reports for view 1; ``forge`` runs then; n0 and n2 commit step 5 and report. Returns every member's
    plan digest."""
    net.run(1.0)
    for name in ("n0", "n1", "n2"):
        net.nodes[name].set_state(4, None, 1000)
        net.nodes[name].set_progress(5, PHASES.index("optimizer"), 100, net.now)
    net.nodes["n1"].leave(net.now)
    net.run(1.5)
    assert all(net.nodes[n].view.epoch == 1 for n in ("n0", "n2", "n3"))  # type: ignore[union-attr]
    assert not net.plans()
    if forge is not None:
        forge(net)
    for n in ("n0", "n2"):
        net.nodes[n].set_state(5, None, 1000)
    net.nodes["n2"].set_progress(5, PHASES.index("recovering"), 100, net.now)
    t = net.now
    while len(net.plans()) < 3 and t < 2.5:  # (before a later view: n0's trainer never moves on)
        t = round(t + 0.05, 6)
        net.run(t)
    return {n: p.digest() for n, p in net.plans().items()}


def _honest_plan() -> str:
    (digest,) = set(_recovery(SignedNet(NAMES, signed=False)).values())
    return digest


def _verified(node: Node, kind: type) -> list[bytes]:
    assert node.auth is not None
    return [d for d in node.auth.crypto.verified  # type: ignore[attr-defined]
            if msgpack.unpackb(d)[0] == kind.TYPE]  # type: ignore[attr-defined]


def _claims_verified(node: Node) -> list[bytes]:
    return _verified(node, wire.StateClaim)


def test_honest_signed_claims_give_every_member_the_plan_unsigned_bitmaps_give() -> None:
    net = SignedNet(NAMES)
    plans = _recovery(net)
    assert set(plans) == {"n0", "n2", "n3"} and set(plans.values()) == {_honest_plan()}
    assert net.plans()["n0"].target_step == 5
    assert not [m for _, _, m in net.sent if isinstance(m, Report)]  # no bitmap: each member's own word
    claims = {m.node for _, _, m in net.sent if isinstance(m, wire.StateClaim)}
    assert claims == {"n0", "n2"}
    for name in ("n0", "n2", "n3"):
        node = net.nodes[name]
        seen = _claims_verified(node)
        assert len(seen) == len(set(seen)) == (1 if name != "n3" else 2)  # once each; its own not at all
        assert not any(node.counters.get(k) for k in ("rx_state_claim_refused", "rx_report_unsigned",
                                                       "rx_state_claim_conflict"))


def _authors(net: SignedNet, m: Message) -> set[str]:
    """Whose claims ``m`` carries: its author's, or a bundle's members'."""
    if isinstance(m, wire.StateClaim):
        return {m.node}
    v = net.nodes["n0"].view
    assert isinstance(m, wire.ClaimBundle) and v is not None
    bits = int.from_bytes(m.bitmap, "little")
    return {v.members[m.first + j].node for j in range(bits.bit_length()) if bits >> j & 1}


def test_claims_that_gossip_dropped_arrive_by_re_aggregation_and_give_the_same_plan() -> None:
    lost = (1.5, 1.7)  # every claim sent in this window is lost: the one-hop sends and gossip's few sends

    def drop(t: float, m: Message) -> bool:
        return isinstance(m, (wire.StateClaim, wire.ClaimBundle)) and lost[0] <= t < lost[1]

    net = SignedNet(NAMES, drop=drop)
    plans = _recovery(net)
    assert set().union(*(_authors(net, m) for t, _, m in net.dropped if t < lost[1])) == {"n0", "n2"}
    assert set(plans) == {"n0", "n2", "n3"} and set(plans.values()) == {_honest_plan()}
    delivered = [t for t, _, m in net.sent if isinstance(m, (wire.StateClaim, wire.ClaimBundle))]
    assert delivered and min(delivered) >= lost[1]  # every claim that arrived was sent again, later
    ready = [t for t, _, e in net.events if type(e).__name__ == "PlanReady"]
    assert min(ready) >= lost[1]  # no plan from what the window let through (nothing)


def _forged_bitmap(net: SignedNet) -> None:
    v = net.nodes["n0"].view
    assert v is not None
    everyone = ((1 << len(v)) - 1).to_bytes((len(v) + 7) // 8, "little")
    net.deliver_to_all(Report(v.epoch, v.config_id, FAR, None, 1000, everyone))  # "all of us hold step 10^9"
    net.deliver_to_all(Report(v.epoch, v.config_id, 0, None, 0, everyone))  # "and none of us holds a byte"


def _forged_claim(net: SignedNet) -> None:
    v = net.nodes["n0"].view
    assert v is not None
    pins = pins_of(NAMES)
    for values in ((FAR, None, 1000), (0, None, 0)):  # n2 holds step 10^9; n2 holds nothing
        net.deliver_to_all(book("n0", pins).sign(wire.StateClaim(v.epoch, v.config_id, "n2", *values)))


@pytest.mark.parametrize("forgery", ["unsigned-bitmap", "another-key"])
def test_a_forged_report_in_a_healthy_members_name_is_refused_and_the_plan_is_the_honest_one(
        forgery: str) -> None:
    net = SignedNet(NAMES)
    counter = "rx_report_unsigned" if forgery == "unsigned-bitmap" else "rx_state_claim_refused"
    plans = _recovery(net, _forged_bitmap if forgery == "unsigned-bitmap" else _forged_claim)
    assert set(plans) == {"n0", "n2", "n3"} and set(plans.values()) == {_honest_plan()}
    assert net.plans()["n3"].target_step == 5
    for name in ("n0", "n2", "n3"):
        assert net.nodes[name].counters.get(counter) == 2, name
        assert not net.nodes[name].counters.get("rx_state_claim_conflict")
    relayed = [m for _, _, m in net.sent if isinstance(m, (Report, wire.StateClaim, wire.ClaimBundle))]
    assert all(m.committed_step == 5 for m in relayed)  # the forgeries went no further


def test_at_32_members_each_member_verifies_each_claim_and_each_confirm_once() -> None:
    # the cost of signed reports: one verification per holder per member per recovery (printed with -s;
    # the counts, not times, are asserted)
    names = [f"n{i:02d}" for i in range(32)]
    net = SignedNet(names, spares=1)
    net.run(1.0)
    before = {n: len(node.auth.crypto.verified) for n, node in net.nodes.items()}  # type: ignore[union-attr, attr-defined]
    net.nodes["n01"].leave(net.now)
    t = net.now
    while len(net.plans()) < 31 and t < 3.0:
        t = round(t + 0.05, 6)
        net.run(t)
    assert len(net.plans()) == 31 and len({p.digest() for p in net.plans().values()}) == 1
    live = [n for n in names if n != "n01"]
    while not all(len(net.nodes[n].aggregates.confirms) == 31 for n in live) and t < 3.0:
        t = round(t + 0.05, 6)
        net.run(t)
    assert all(len(net.nodes[n].aggregates.confirms) == 31 for n in live)  # each member's own digest
    holders = set(net.nodes["n00"].view.holders())  # type: ignore[union-attr]
    assert len(holders) == 30
    counts = []
    for name, node in net.nodes.items():
        if name != "n01":
            seen = _claims_verified(node)
            assert len(seen) == len(set(seen)) == len(holders - {name}), name
            confirms = _verified(node, wire.PlanConfirm)
            assert len(confirms) == len(set(confirms)) == 30, name  # every other member's, once
            counts.append(len(node.auth.crypto.verified) - before[name])  # type: ignore[union-attr, attr-defined]
    print(f"signatures verified per member from the leave to every plan confirmed (32 members): "
          f"min {min(counts)}, max {max(counts)}, of which state claims {len(holders) - 1} or "
          f"{len(holders)} and plan confirms 30")


def _confirmed(net: SignedNet, until: float = 2.0) -> None:
    """Run on until every member holds every member's plan confirm (well before any later view)."""
    t = net.now
    while not all(len(net.nodes[n].aggregates.confirms) == 3 for n in ("n0", "n2", "n3")) and t < until:
        t = round(t + 0.05, 6)
        net.run(t)


def test_each_members_plan_digest_is_its_own_signed_confirm() -> None:
    net = SignedNet(NAMES)
    plans = _recovery(net)
    _confirmed(net)
    (digest,) = set(plans.values())
    for name in ("n0", "n2", "n3"):
        agg = net.nodes[name].aggregates
        assert set(agg.confirms) == {"n0", "n2", "n3"}, name
        assert agg.digests == {bytes.fromhex(digest): 0b111}, name  # all of view 1: n0, n2, n3
    assert not [m for _, _, m in net.sent if isinstance(m, PlanDigest)]
    assert not [e for _, _, e in net.events if isinstance(e, PlanMismatch)]


@pytest.mark.parametrize("forgery", ["unsigned-bitmap", "another-key"])
def test_a_forged_plan_digest_in_other_members_names_raises_no_mismatch(forgery: str) -> None:
    net = SignedNet(NAMES)
    plans = _recovery(net)
    v = net.nodes["n0"].view
    assert v is not None
    other = bytes(32)  # "they computed another plan" (every member would log a mismatch)
    if forgery == "unsigned-bitmap":
        everyone = ((1 << len(v)) - 1).to_bytes((len(v) + 7) // 8, "little")
        net.deliver_to_all(PlanDigest(v.epoch, v.config_id, other, everyone))
        counter = "rx_plan_digest_unsigned"
    else:
        pins = pins_of(NAMES)
        net.deliver_to_all(book("n0", pins).sign(wire.PlanConfirm(v.epoch, v.config_id, "n2", other)))
        counter = "rx_plan_confirm_refused"
    assert not [e for _, _, e in net.events if isinstance(e, PlanMismatch)]
    _confirmed(net)
    assert not [e for _, _, e in net.events if isinstance(e, PlanMismatch)]
    for name in ("n0", "n2", "n3"):
        assert net.nodes[name].counters.get(counter) == 1, name
        assert set(net.nodes[name].aggregates.digests) == {bytes.fromhex(plans[name])}, name
    assert not [m for _, _, m in net.sent if getattr(m, "digest", None) == other]  # not relayed


def test_a_member_without_the_plan_asks_for_the_claims_it_lacks_and_gets_only_those() -> None:
    # a large view's gossip brings each member its N claims a few bundles per packet: a member still without
    # the plan at an anti-entropy round asks a few members (ClaimsAsk: the bitmap of claims it holds) and
    # each answers at once with the bundles of the claims it lacks (at most once per asker per round); an ask
    # is its asker's signed word, so a key holder cannot point every member's answers at another member
    from tests.test_node import sent_messages

    net = SignedNet(NAMES)
    _recovery(net)
    n0 = net.nodes["n0"]
    v = n0.view
    assert v is not None and n0.aggregates.claims.keys() == {"n0", "n2"}
    have = (1 << v.index("n0")).to_bytes(1, "little")  # type: ignore[operator]
    from gossiprec.core.auth import sign_if

    forged = sign_if(net.nodes["n2"].auth, wire.ClaimsAsk(v.epoch, v.config_id, "n3", have))  # n2's key, n3's name
    n0.receive(encode_packet([forged]), net.now)
    assert n0.counters["rx_claims_ask_refused"] == 1
    ask = sign_if(net.nodes["n3"].auth, wire.ClaimsAsk(v.epoch, v.config_id, "n3", have))
    n0.take_sends()
    before = n0.counters.get("claims_answered", 0)  # (the members' own asks during the recovery)
    n0.receive(encode_packet([ask]), net.now)
    answers = [m for a, m in sent_messages(n0) if a == "n3" and isinstance(m, wire.ClaimBundle)]
    assert answers and set().union(*(_authors(net, m) for m in answers)) >= {"n2"}, answers
    assert n0.counters["claims_answered"] == before + 1
    n0.receive(encode_packet([ask]), net.now + 0.01)  # the same round: not again
    everyone = (1 << len(v)) - 1
    n0.receive(encode_packet([wire.ClaimsAsk(v.epoch, v.config_id, "x9", b"\x00")]), net.now + 0.02)  # not a member
    full = sign_if(net.nodes["n2"].auth, wire.ClaimsAsk(v.epoch, v.config_id, "n2", everyone.to_bytes(1, "little")))
    n0.receive(encode_packet([full]), net.now + 0.5)  # lacks nothing: answered with nothing
    assert n0.counters["claims_answered"] == before + 2
    assert not [m for a, m in sent_messages(n0) if isinstance(m, wire.ClaimBundle) and a in ("n3", "x9", "n2")]


def test_claims_gossip_lost_for_one_member_reach_it_by_its_asks() -> None:
    # every claim on its way to the spare n3 is lost until 1.9 s, then only those answering its asks pass:
    # it still gets the plan, from the answers
    asked: set[str] = set()

    def lose(src: str, dst: str, m: Message) -> bool:
        if isinstance(m, wire.ClaimsAsk):
            asked.add(dst)
        return dst == "n3" and isinstance(m, (wire.StateClaim, wire.ClaimBundle)) and src not in asked

    net = SignedNet(NAMES)
    net.lose = lose
    plans = _recovery(net)
    assert set(plans) == {"n0", "n2", "n3"} and set(plans.values()) == {_honest_plan()}
    assert net.nodes["n3"].counters.get("claims_asked", 0) >= 1 and asked


def test_an_answer_of_claims_is_bounded_in_packets(monkeypatch: pytest.MonkeyPatch) -> None:
    # an answer is a burst of datagrams: at 4,800 members every claim a member lacks would be ~270 of them,
    # more than a stock receive buffer holds; it sends at most CLAIM_ANSWER_PACKETS (here 1), a random run
    from gossiprec.core import aggregate
    from gossiprec.core.auth import sign_if

    net = SignedNet(NAMES)
    _recovery(net)
    n0 = net.nodes["n0"]
    v = n0.view
    assert v is not None and n0.aggregates.claims.keys() == {"n0", "n2"}
    monkeypatch.setattr(n0.aggregates, "chunk", 1)  # a bundle per member
    monkeypatch.setattr(aggregate, "encode_message", lambda m: bytes(1 << 16))  # (sized: a packet per bundle)
    packets: list[set[str]] = []
    for k in range(12):  # unbounded: two packets, each of one member's claim; bounded: one, either
        monkeypatch.setattr(aggregate, "CLAIM_ANSWER_PACKETS", 2 if k == 0 else 1)
        ask = sign_if(net.nodes["n3"].auth, wire.ClaimsAsk(v.epoch, v.config_id, "n3", b"\x00"))
        n0.take_sends()
        n0.receive(encode_packet([ask]), net.now + k)  # a round apart: answered each time
        sends = [s for s in n0.take_sends() if s.addr == "n3"]
        claims = [decode_packet(s.payload, 1 << 20)[0] for s in sends]  # (then piggybacked news, perhaps claims)
        packets.append(set().union(*(_authors(net, m) for m in claims)))
        assert len(sends) == (2 if k == 0 else 1), (k, sends)
    assert packets[0] == {"n0", "n2"}
    assert {frozenset(p) for p in packets[1:]} == {frozenset({"n0"}), frozenset({"n2"})}  # random runs: both
    assert n0.counters["claims_answer_cut"] == 11
