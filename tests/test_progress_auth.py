"""Training progress is its owner's signed word: a holder of the cluster key cannot forge another member's.

The hang check (:mod:`gossiprec.core.hangs`) judges ranks by the progress SWIM last heard, so a forged
record could freeze a healthy rank's step, put it behind the others, or put it so far ahead that its
observers alert it as ``implausible`` (and evict it). Shown here on the virtual clock, with pinned keys
(the simulator's keyed-digest stand-in):

- honest progress still spreads, relayed and in push-pull rows, each copy carrying its owner's
  signature, and each receiver verifies one version once however many copies reach it;
- a Progress in a healthy member's name, unsigned or signed with another member's key, whether it comes
  as gossip or as a push-pull row, is refused and counted (``rx_progress_unsigned``), moves nobody's
  recorded progress, is not relayed, and raises no alert;
- one from a member whose key is not bound yet is taken and counted (``rx_sig_unbound``), as an Alive is
  (a start-up's first progress must not wait for the key claims);
- a member checks as they arrive only the records it reads (its hang check's sample); any other's news
  waits unchecked, is relayed as it came, and is checked if read after all: a forged one then is refused
  and stops being relayed, and a forged newer version held so never shuts out the owner's own records
  at a member that reads them.
"""

from __future__ import annotations

import random
from typing import Callable

import msgpack
import pytest

from gossiprec.core import antientropy
from gossiprec.core.auth import DigestCrypto, KeyBook
from gossiprec.core.config import AgreementConfig
from gossiprec.core.events import AlertRaised
from gossiprec.core.membership import Membership
from gossiprec.core.node import Node
from gossiprec.core.records import MemberInfo
from gossiprec.core.topology import JobTopology
from gossiprec.core.view import View, ViewMember
from gossiprec.core.wire import ALIVE, PHASES, Ack, Ping, Progress, PushPull, decode_packet, encode_packet
from tests.support.signing import pinned_book, pins_of, sign_all
from tests.test_membership import CFG, Pump, addr, deliver

SEEDS = range(1, 4)
NAMES = ["a", "b", "c"]
PINS = pins_of(NAMES)
COMPUTE = PHASES.index("compute")
FROZEN = 10**6
"""A forger's version: far above the owner's own, so that, taken, it would shut out every honest update."""


def book(name: str, pins: dict[str, bytes] = PINS) -> KeyBook:
    return pinned_book(name, pins, counting=True)


def signed(pump: Pump) -> Pump:
    return sign_all(pump, book)


def progress_verified(m: Membership) -> list[bytes]:
    assert m.auth is not None
    return [d for d in m.auth.crypto.verified if msgpack.unpackb(d)[0] == Progress.TYPE]  # type: ignore[attr-defined]


def honest(seed: int) -> Pump:
    """a, b, c signing; c never probes b (it hears b's progress only relayed); b at step 9 from t = 0."""
    pump = signed(Pump.cluster(NAMES, seed=seed))
    pump.machines["c"].set_probe_targets(["a"])
    pump.machines["b"].set_progress(9, COMPUTE, 100, pump.now)
    pump.run_until(3.0)
    return pump


@pytest.mark.parametrize("seed", SEEDS)
def test_signed_progress_spreads_relayed_with_its_owners_signature_and_is_verified_once(seed: int) -> None:
    pump = honest(seed)
    c = pump.machines["c"]
    p = c.progress("b")
    assert p is not None and (p.step, p.phase) == (9, COMPUTE)
    relayed = [msg for d, msg in pump.sent(Progress, "a") if msg.name == "b"]
    assert relayed and all(book("c").check("b", msg) for msg in relayed)  # b's own word, as it came
    seen = progress_verified(c)
    assert seen and len(seen) == len(set(seen)), "a relayed copy of one Progress was verified twice"
    assert not any(m.counters.get("rx_progress_unsigned") for m in pump.machines.values())


@pytest.mark.parametrize("forgery", ["unsigned", "another-key"])
def test_a_forged_progress_in_a_healthy_members_name_is_refused_and_moves_nothing(forgery: str) -> None:
    pump = honest(1)
    c = pump.machines["c"]
    before = c.progress("b")
    # "b is frozen at step 3" at a version that would shut out b's own updates for good
    forged = Progress("b", 1, FROZEN, 3, COMPUTE, 100)
    if forgery == "another-key":
        forged = book("a").sign(forged)  # a key holder's valid signature, but not b's
    deliver(c, pump.now, forged)
    assert c.progress("b") == before
    assert c.counters["rx_progress_unsigned"] == 1
    assert c.counters["rx_sig_invalid"] == 1  # (KeyBook.check: no valid signature by b's key)
    pump.flush("c")
    pump.machines["b"].set_progress(10, COMPUTE, 100, pump.now)  # b's own word still flows
    pump.run_until(6.0)
    p = c.progress("b")
    assert p is not None and p.step == 10
    assert not [msg for _, msg in pump.sent(Progress) if msg.version == FROZEN]  # never relayed


@pytest.mark.parametrize("forgery", ["unsigned", "another-key"])
def test_a_forged_push_pull_row_with_frozen_progress_changes_nothing(forgery: str) -> None:
    pump = honest(1)
    c, b = pump.machines["c"], pump.machines["b"]
    before = c.progress("b")
    forged = Progress("b", b.incarnation, FROZEN, 3, COMPUTE, 100)
    psig = book("a").sign(forged).sig if forgery == "another-key" else b""
    # b's row at its own incarnation and address (the Alive part tells c nothing new), with frozen progress
    row = ("b", addr("b"), b.incarnation, ALIVE, 0, FROZEN, 3, COMPUTE, 100, 0, 0, b"", psig)
    deliver(c, pump.now, PushPull("a", addr("a"), False, True, (row,)), reliable=True)
    assert c.progress("b") == before and c.member("b").addr == addr("b")  # type: ignore[union-attr]
    assert c.counters["rx_progress_unsigned"] == 1


def test_push_pull_rows_carry_the_owners_progress_signature_and_a_joiner_takes_them() -> None:
    pump = honest(1)
    rows = {r[0]: r for r in antientropy.pushpull(pump.machines["a"], False, True).members}
    name, _, inc, _, _, pver, step, phase, step_ms, coll, wait_ms, _, psig = rows["b"]
    assert book("c").check("b", Progress(name, inc, pver, step, phase, step_ms, coll, wait_ms, psig))
    j = Membership(CFG, "j", addr("j"), incarnation=1, rng=random.Random(7), now=3.0)
    j.auth = book("j")
    j.auth.counters = j.counters
    deliver(j, 3.0, antientropy.pushpull(pump.machines["a"], False, True), reliable=True)
    p = j.progress("b")
    assert p is not None and p.step == 9 and not j.counters.get("rx_progress_unsigned")


def test_progress_of_a_member_whose_key_is_not_bound_yet_is_taken_and_counted() -> None:
    # as an Alive: refusing it would leave the hang check blind at start-up, until the key claims came;
    # trust on first use leaves that name open to any key holder anyway (pinned keys close it)
    c = Membership(CFG, "c", addr("c"), incarnation=1, rng=random.Random(1), now=0.0)
    c.auth = KeyBook("c", DigestCrypto.for_name("c"))
    c.auth.counters = c.counters
    deliver(c, 0.1, Progress("b", 1, 1, 4, COMPUTE, 100))
    p = c.progress("b")
    assert p is not None and p.step == 4 and c.counters["rx_sig_unbound"] == 1
    assert not c.counters.get("rx_progress_unsigned")


# --- the hang check ---------------------------------------------------------------------------------
TRAINERS = [f"n{i}" for i in range(6)]
TRAINER_PINS = pins_of(TRAINERS)

Forge = Callable[[int, int], list[Progress]]
"""(the honest version, the honest step) -> the forger's messages for that moment"""


def _alerts_with_forger(forge: Forge, until: float = 4.0) -> tuple[list[tuple[float, str, str]], Node]:
    """Drive n0 (signing) of a 6-trainer view whose ranks all train at one step per 100 ms; from t = 0.5
    on, a forger adds ``forge``'s records every 50 ms, next to the owners' own signed ones. Every rank
    answers n0's probes. Returns n0's alerts (time, subject, reason), and n0."""
    view = View.initial([ViewMember(n, n, "trainer", i) for i, n in enumerate(TRAINERS)],
                        JobTopology.ddp(len(TRAINERS)))
    base = {n: MemberInfo(n, n, 1) for n in view.nodes}
    acfg = AgreementConfig(alert_after=600.0, confirm_after=600.0, fence_after=600.0, hang_floor=1.0)
    books = {n: KeyBook(n, DigestCrypto.for_name(n), pinned=TRAINER_PINS, claims=False) for n in TRAINERS}
    node = Node(CFG, "n0", "n0", incarnation=1, rng=random.Random(3), now=0.0, view=view, members=base,
                member_order=view.nodes, agreement=acfg, auth=books["n0"])

    def step_at(t: float) -> int:
        return 5 + int(t / 0.1 + 1e-9)

    t, version, alerts = 0.0, 0, []
    while t < until:
        version += 1
        step = step_at(t)
        node.set_progress(step, COMPUTE, 100, t)
        honest_msgs = [books[n].sign(Progress(n, 1, version, step, COMPUTE, 100)) for n in TRAINERS[1:]]
        node.receive(encode_packet(honest_msgs), t)
        if t >= 0.5:
            node.receive(encode_packet(forge(version, step)), t)
        end = round(t + 0.05, 6)
        while node.next_deadline() <= end:
            now = node.next_deadline()
            node.tick(now)
            for send in node.take_sends():
                for m in decode_packet(send.payload, 1 << 20):
                    if isinstance(m, Ping):
                        node.receive(encode_packet([Ack(m.seq, m.target, 1, step_at(now), COMPUTE, 100)]), now)
            alerts += [(now, e.subject, e.reason) for e in node.take_events() if isinstance(e, AlertRaised)]
        t = end
    return alerts, node


def test_healthy_signed_ranks_raise_no_alert() -> None:
    alerts, node = _alerts_with_forger(lambda version, step: [])
    assert alerts == [] and not node.counters.get("rx_progress_unsigned")


@pytest.mark.parametrize("forgery", ["unsigned", "another-key"])
def test_forged_progress_raises_no_alert_against_healthy_ranks(forgery: str) -> None:
    # n3 "far ahead" (alone past every other by 50 steps: alerted implausible, before this change) and
    # n5 "frozen at step 5" (behind the others), both at versions that would shut out the owners' own
    def forge(version: int, step: int) -> list[Progress]:
        msgs = [Progress("n3", 1, FROZEN + version, step + 50, COMPUTE, 100),
                Progress("n5", 1, FROZEN + version, 5, COMPUTE, 100)]
        signer = KeyBook("n1", DigestCrypto.for_name("n1"), pinned=TRAINER_PINS, claims=False)
        return [signer.sign(m) for m in msgs] if forgery == "another-key" else msgs

    alerts, node = _alerts_with_forger(forge)
    assert alerts == []
    assert node.counters["rx_progress_unsigned"] == 2 * 70  # two forgeries every 50 ms from 0.5 to 4.0 s
    for name in ("n3", "n5"):
        p = node.progress(name)
        assert p is not None and p.version < FROZEN and p.step >= 40, (name, p)  # the owner's word


# --- records this member does not read ----------------------------------------------------------------
def _reading_only_a(seed: int = 1) -> tuple[Pump, Membership]:
    """``honest``, but c reads only a's records (as a hang check whose sample lacks b would set it)."""
    pump = signed(Pump.cluster(NAMES, seed=seed))
    c = pump.machines["c"]
    c.set_probe_targets(["a"])
    c._book.read = frozenset({"a"})
    pump.machines["b"].set_progress(9, COMPUTE, 100, pump.now)
    pump.run_until(3.0)
    return pump, c


def test_news_of_a_member_not_read_is_relayed_as_it_came_and_checked_only_when_read() -> None:
    pump, c = _reading_only_a()
    assert not progress_verified(c), "c checked b's records although it does not read them"
    relayed = [msg for _, msg in pump.sent(Progress, "c") if msg.name == "b"]
    assert relayed and all(book("a").check("b", msg) for msg in relayed)  # b's own word, signature and all
    p = c.progress("b")  # read after all (a status query): checked now, once
    assert p is not None and (p.step, p.phase) == (9, COMPUTE)
    assert len(progress_verified(c)) == 1 and not c.counters.get("rx_progress_unsigned")
    assert c.progress("b") == p and len(progress_verified(c)) == 1


@pytest.mark.parametrize("forgery", ["unsigned", "another-key"])
def test_forged_news_held_unchecked_is_refused_when_read_and_not_relayed_after(forgery: str) -> None:
    pump, c = _reading_only_a()
    pump.flush("c")
    before = c.progress("b")  # b's own record, checked (a status query)
    assert before is not None and before.step == 9
    forged = Progress("b", 1, FROZEN, 3, COMPUTE, 100)
    if forgery == "another-key":
        forged = book("a").sign(forged)
    deliver(c, pump.now, forged)
    assert not c.counters.get("rx_progress_unsigned")  # held, not checked yet
    assert c.progress("b") == before  # refused when read: the owner's word stands
    assert c.counters["rx_progress_unsigned"] == 1
    since = pump.now
    pump.machines["b"].set_progress(10, COMPUTE, 100, pump.now)
    pump.run_until(6.0)
    assert not [m for _, m in pump.sent(Progress, "c", since=since) if m.version == FROZEN]
    p = c.progress("b")
    assert p is not None and p.step == 10, p  # b's later records reach c again


def test_a_member_that_reads_a_record_checks_it_on_arrival_so_a_forged_newer_one_shuts_nothing_out() -> None:
    pump, c = _reading_only_a()
    c._book.read = frozenset({"a", "b"})  # b joins c's sample; its news held from before is checked now
    pump.flush("c")
    for step in (10, 11, 12):
        pump.machines["b"].set_progress(step, COMPUTE, 100, pump.now)
        pump.run_until(pump.now + 1.0)
        # a forger's newer version, right behind each of b's own: refused as it comes
        deliver(c, pump.now, Progress("b", 1, FROZEN + step, 3, COMPUTE, 100))
        pump.machines["b"].set_progress(step, COMPUTE, 101, pump.now)  # a new version at the same step
        pump.run_until(pump.now + 1.0)
        p = c.progress("b")
        assert p is not None and p.step == step and p.version < FROZEN, (step, p)
    assert c.counters["rx_progress_unsigned"] == 3


def test_the_hang_check_reads_its_sample() -> None:
    alerts, node = _alerts_with_forger(lambda version, step: [])
    assert node.swim._book.read == frozenset(node.hangs.sample) and node.hangs.sample
