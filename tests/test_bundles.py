"""Signed bundles (:mod:`gossiprec.core.bundles`): many members' own signatures of one payload, one message.

Shown on the signing nodes of :mod:`tests.test_report_auth` (view 1 is n0, n2, n3; n1 left), on a bare
:class:`~gossiprec.core.consensus.Consensus` for vote bundles, on the codec, and in the simulator:

- a bundle whose signature for one member is forged counts the others and refuses that one (the same
  counter as a forged single claim), and relays nothing of the forgery;
- a member already counted for the payload is not checked again, whatever signature comes (the
  saving); one not counted yet is, and refused if forged; one counted with another value is checked
  and its first word stands;
- a bundle whose bits and signatures do not pair up counts nothing (``rx_bundle_malformed``);
- one bundle of full-size (Ed25519, 64-byte) signatures fits half a packet at every MTU the config allows;
- the decoder refuses every bundle whose fields exceed their bounds;
- the simulator's signed runs, where votes reach most members only in bundles (views above
  ``direct_votes_max``), agree, and the quorum audit counts bundled votes itself.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from gossiprec.core import bundles
from gossiprec.core.auth import KeyBook
from gossiprec.core.consensus import Consensus
from gossiprec.core.view import REMOVE, Change, View, changes_digest
from gossiprec.core.wire import (
    BUNDLE_MAX, MAX_MEMBERS, PROTOCOL_VERSION, ClaimBundle, ConfirmBundle, Message, Ping, StateClaim, Vote,
    VoteBundle, decode_packet, encode_message, encode_packet,
)
from gossiprec.errors import DecodeError, InvariantViolation
from gossiprec.sim.agree import AgreeParams, run_agreement
from tests.support.signing import pinned_book, pins_of
from tests.test_consensus import make_view
from tests.test_report_auth import NAMES, SignedNet, _honest_plan, _recovery, book

VALUES = (5, None, 1000)
"""What n0 and n2 report for view 1 (see :func:`tests.test_report_auth._recovery`)."""


def _claim_bundle(v: View, signers: dict[str, str], values: tuple[int, int | None, int] = VALUES) -> ClaimBundle:
    """A bundle of ``values`` for each member of ``signers``, its claim signed with the key of the name given."""
    pins = pins_of(NAMES)
    sigs = {}
    for name, key in signers.items():
        idx = v.index(name)
        assert idx is not None
        sigs[idx] = book(key, pins).sign(StateClaim(v.epoch, v.config_id, name, *values)).sig
    first, bitmap, s = bundles.gather(0, BUNDLE_MAX, len(v), sigs.get)
    return ClaimBundle(v.epoch, v.config_id, *values, first, bitmap, s)


def _counting_checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []
    check = KeyBook.check

    def counted(self: KeyBook, author: str, msg: Message) -> bool:
        calls.append((self.me, author))
        return check(self, author, msg)

    monkeypatch.setattr(KeyBook, "check", counted)
    return calls


def test_a_bundle_with_one_forged_signature_counts_the_others_and_refuses_that_one() -> None:
    seen: dict[str, tuple[set[str], int]] = {}

    def forge(net: SignedNet) -> None:
        v = net.nodes["n0"].view
        assert v is not None
        net.deliver_to_all(_claim_bundle(v, {"n0": "n0", "n2": "n0"}))  # n2's claim signed with n0's key
        for name in ("n0", "n2", "n3"):
            node = net.nodes[name]
            seen[name] = (set(node.aggregates.claims), node.counters.get("rx_state_claim_refused", 0))

    net = SignedNet(NAMES)
    plans = _recovery(net, forge)
    for name in ("n0", "n2", "n3"):
        assert seen[name] == ({"n0"}, 1), name  # n0's bit counted, n2's refused
        assert net.nodes[name].counters.get("rx_state_claim_refused") == 1, name  # nobody relayed the forgery
        assert not net.nodes[name].counters.get("rx_state_claim_conflict"), name
    assert set(plans) == {"n0", "n2", "n3"} and set(plans.values()) == {_honest_plan()}


def test_a_member_counted_already_is_not_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    net = SignedNet(NAMES)
    _recovery(net)
    v = net.nodes["n0"].view
    assert v is not None
    calls = _counting_checks(monkeypatch)
    again = _claim_bundle(v, {"n0": "n0", "n2": "n2"})
    assert {net.nodes["n3"].aggregates.claims[n].sig for n in ("n0", "n2")} == set(again.sigs)
    net.deliver_to_all(again)
    assert calls == []  # every bit counted already
    net.deliver_to_all(_claim_bundle(v, {"n0": "n0", "n2": "n0"}))
    assert calls == []  # n2's word for this value is held: whatever signature comes, nothing is learnt
    net.deliver_to_all(_claim_bundle(v, {"n0": "n0", "n3": "n0"}))  # n3 (a spare) claimed nothing
    assert sorted(calls) == [("n0", "n3"), ("n2", "n3"), ("n3", "n3")]  # only the bit not counted yet
    for name in ("n0", "n2", "n3"):
        assert net.nodes[name].counters.get("rx_state_claim_refused") == 1, name
        assert "n3" not in net.nodes[name].aggregates.claims
    net.deliver_to_all(_claim_bundle(v, {"n2": "n2"}, (7, None, 1000)))  # n2 signed another value: checked
    assert sorted(calls[3:]) == [("n0", "n2"), ("n2", "n2"), ("n3", "n2")]
    for name in ("n0", "n2", "n3"):
        assert net.nodes[name].counters.get("rx_state_claim_conflict") == 1, name  # the first stands
        assert net.nodes[name].aggregates.claims["n2"].committed_step == 5


def test_a_bundle_whose_bits_and_signatures_do_not_pair_up_counts_nothing() -> None:
    def forge(net: SignedNet) -> None:
        v = net.nodes["n0"].view
        assert v is not None
        good = _claim_bundle(v, {"n0": "n0", "n2": "n2"})
        net.deliver_to_all(ClaimBundle(good.epoch, good.config, *VALUES, good.first, good.bitmap, good.sigs[:1]))
        for name in ("n0", "n2", "n3"):
            node = net.nodes[name]
            assert node.counters.get("rx_bundle_malformed") == 1 and not node.aggregates.claims, name

    plans = _recovery(SignedNet(NAMES), forge)
    assert set(plans.values()) == {_honest_plan()}


@pytest.mark.parametrize("mtu", [576, 1000, 1400, 9000, 65000])
def test_one_bundle_of_ed25519_signatures_fits_half_a_packet(mtu: int) -> None:
    k = bundles.chunk_size(mtu)
    assert 1 <= k <= BUNDLE_MAX
    sigs = tuple(bytes([i]) * 64 for i in range(k))
    bitmap = ((1 << k) - 1).to_bytes((k + 7) // 8, "little")
    config = "c" * 32
    worst = [ClaimBundle(2**62, config, 2**62, 2**62, 2**62, MAX_MEMBERS, bitmap, sigs),
             ConfirmBundle(2**62, config, b"\xff" * 32, MAX_MEMBERS, bitmap, sigs),
             VoteBundle(2**62, config, b"\xff" * 32, MAX_MEMBERS, bitmap, sigs)]
    for msg in worst:
        assert len(encode_message(msg)) <= mtu // 2, (type(msg).__name__, k)
        ping = Ping(2**64 - 1, "n" * 64, "n" * 64, "a" * 64)  # the other half: what the bundle rides on
        assert len(encode_packet([ping, msg])) <= mtu
        assert decode_packet(encode_packet([msg]), mtu) == [msg]


def test_chunks_and_gather_cover_the_view_by_member_index() -> None:
    assert list(bundles.chunks(0, 9)) == []
    assert list(bundles.chunks(1 | 1 << 20 | 1 << 63, 9)) == [0, 2, 7]
    sigs = {i: bytes([i]) for i in (0, 8, 9, 12, 17, 63)}
    assert bundles.gather(0, 9, 64, sigs.get) == (0, (1 | 1 << 8).to_bytes(2, "little"), (b"\x00", b"\x08"))
    assert bundles.gather(7, 9, 64, sigs.get) == (63, b"\x01\x00", (b"\x3f",))
    first, bitmap, s = bundles.gather(1, 9, 64, sigs.get)
    assert bundles.fresh(first, bitmap, s, 0, 64) == [(9, b"\x09"), (12, b"\x0c"), (17, b"\x11")]
    assert bundles.fresh(first, bitmap, s, 1 << 9 | 1 << 17, 64) == [(12, b"\x0c")]  # counted: skipped
    assert bundles.fresh(first, bitmap, s, 0, 13) == [(9, b"\x09"), (12, b"\x0c")]  # beyond the view: ignored
    assert bundles.fresh(first, bitmap, s[:2], 0, 64) is None
    assert bundles.fresh(first, bitmap, s[:2], (1 << 64) - 1, 64) is None  # malformed, even if all counted


def _raw(*items: Any) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, list(items)], use_bin_type=True)  # type: ignore[no-any-return]


GOOD_SIGS = [b"s" * 64, b"t" * 64]
CFG = "0123456789abcdef"


@pytest.mark.parametrize("tid, head", [(ClaimBundle.TYPE, [3, CFG, 5, None, 1000]),
                                       (ConfirmBundle.TYPE, [3, CFG, b"d" * 32]),
                                       (VoteBundle.TYPE, [3, CFG, b"d" * 32])],
                         ids=["claim", "confirm", "vote"])
@pytest.mark.parametrize("tail, why", [
    ([0, b"\x03\x00", GOOD_SIGS], None),
    ([0, b"\x03\x00", GOOD_SIGS * 9], "17 signatures"),
    ([0, b"\x03\x00", [b"s" * 65, b"t" * 64]], "a 65-byte signature"),
    ([0, b"\x03\x00", ["s" * 64, b"t" * 64]], "a signature as text"),
    ([0, b"\x03\x00\x00", GOOD_SIGS], "a 3-byte bitmap"),
    ([0, "\x03", GOOD_SIGS], "a bitmap as text"),
    ([-1, b"\x03", GOOD_SIGS], "a negative first member"),
    ([MAX_MEMBERS + 1, b"\x03", GOOD_SIGS], "a first member beyond any view"),
    ([0, b"\x03", {"a": 1}], "signatures as a map"),
    ([0, b"\x03"], "a missing field"),
    ([0, b"\x03", GOOD_SIGS, 1], "an extra field"),
])
def test_the_decoder_bounds_every_field_of_a_bundle(tid: int, head: list[Any], tail: list[Any],
                                                    why: str | None) -> None:
    data = _raw([tid, *head, *tail])
    if why is None:
        (msg,) = decode_packet(data, 1 << 16)
        assert msg.sigs == tuple(GOOD_SIGS)  # type: ignore[attr-defined]
        return
    with pytest.raises(DecodeError):
        decode_packet(data, 1 << 16)


def test_a_vote_bundle_counts_each_valid_voter_once(monkeypatch: pytest.MonkeyPatch) -> None:
    view = make_view(8)
    names = [m.node for m in view.members]
    pins = pins_of(names)
    sent: list[tuple[str, Message]] = []
    me = pinned_book("m0", pins)
    c = Consensus(view, "m0", lambda k, m: sent.append((k, m)), lambda to, m: None, auth=me, chunk=4)
    changes = [Change("m7", REMOVE)]
    digest = changes_digest(view.epoch, view.config_id, changes)
    c.proposals[digest] = changes

    def sig(voter: str, key: str) -> bytes:
        return pinned_book(key, pins).sign(Vote(view.epoch, view.config_id, digest, voter)).sig

    votes = {1: sig("m1", "m1"), 2: sig("m2", "m2"), 3: sig("m3", "m1")}  # m3's forged with m1's key
    first, bitmap, s = bundles.gather(0, 4, 8, votes.get)
    assert c.on_vote_bundle(VoteBundle(view.epoch, view.config_id, digest, first, bitmap, s))
    assert c.votes[digest] == 0b0110 and me.counters.get("rx_sig_invalid") == 1
    (key, relayed), = sent
    assert key == f"V|{digest.hex()}|0" and relayed == VoteBundle(
        view.epoch, view.config_id, digest, 0, b"\x06", (votes[1], votes[2]))  # the forgery goes no further
    calls = _counting_checks(monkeypatch)
    assert c.on_vote_bundle(relayed) and calls == [] and len(sent) == 1  # nothing new: nothing checked or sent
    votes = {4: sig("m4", "m4"), 5: sig("m5", "m5")}
    first, bitmap, s = bundles.gather(1, 4, 8, votes.get)
    assert c.on_vote_bundle(VoteBundle(view.epoch, view.config_id, digest, first, bitmap, s))
    assert c.votes[digest] == 0b110110 and sent[-1][0] == f"V|{digest.hex()}|1"
    assert not c.on_vote_bundle(VoteBundle(view.epoch, view.config_id, digest, 0, b"\x03", (votes[4],)))


def test_signed_runs_above_direct_votes_max_agree_on_bundled_votes() -> None:
    # 40 members: each vote goes to every member only by gossip, so only in bundles; the quorum audit
    # (which raises on a fast decision without a fast quorum delivered) counts their bits
    r = run_agreement(AgreeParams(scenario="crash", nodes=40, seed=1, duration=8, signing="digest"))
    assert r["invariant_violations"] == 0 and r["views_decided"] >= 1 and r["fast_path_ratio"] > 0
    assert r["removed"] == r["expected_removed"]


def test_the_quorum_audit_counts_bundled_votes_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """A core that takes any vote bundle for the whole view's votes decides on the first it gets; the
    audit merges the bundles the network delivered and finds no fast quorum behind that decision."""

    def every_bundle_counts_for_all(self: Consensus, msg: VoteBundle) -> bool:
        self.votes[msg.digest] = (1 << len(self.view)) - 1
        self._check_fast(msg.digest)
        return True

    monkeypatch.setattr(Consensus, "on_vote_bundle", every_bundle_counts_for_all)
    with pytest.raises(InvariantViolation, match="on the fast path without a fast quorum"):
        run_agreement(AgreeParams(scenario="crash", nodes=40, seed=1, duration=8, signing="digest"))


def test_odd_bundles_of_the_view_count_nothing_and_raise_nothing() -> None:
    def odd(net: SignedNet) -> None:
        v = net.nodes["n0"].view
        assert v is not None
        full, sigs16 = b"\xff\xff", tuple(bytes([i]) * 16 for i in range(16))
        for first, bitmap, sigs in ((MAX_MEMBERS, full, sigs16), (2, full, sigs16), (0, b"\x07", (b"", b"", b"")),
                                    (0, b"", ()), (1, b"\x01", (b"x" * 64,))):
            net.deliver_to_all(ClaimBundle(v.epoch, v.config_id, *VALUES, first, bitmap, sigs))
            net.deliver_to_all(ConfirmBundle(v.epoch, v.config_id, b"d" * 32, first, bitmap, sigs))
            net.deliver_to_all(VoteBundle(v.epoch, v.config_id, b"d" * 32, first, bitmap, sigs))
        for name in ("n0", "n2", "n3"):
            agg = net.nodes[name].aggregates
            assert not agg.claims and not agg.confirms and not net.nodes[name].consensus.votes, name

    plans = _recovery(SignedNet(NAMES), odd)
    assert set(plans.values()) == {_honest_plan()}
