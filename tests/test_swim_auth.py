"""SWIM with per-member signatures, on the virtual clock: the honest protocol still works, forgeries do not.

Each machine gets a pinned :class:`~gossiprec.core.auth.KeyBook` (the simulator's keyed-digest stand-in):
a real crash is detected by every survivor, a real accusation is refuted and the refutation taken
everywhere, a joiner learns every member from signed push-pull rows; an Alive, Suspect or observer's
Dead not signed by the member it speaks for is refused and counted (so no forger raises an
incarnation). Live attacks against real agents: ``tests/test_forgery_swim.py``.
"""

from __future__ import annotations

import random

import pytest

from gossiprec.core.auth import KeyBook
from gossiprec.core.events import MemberAlive, MemberFailed, MemberJoined, MemberSuspected, SelfRefuted
from gossiprec.core.membership import Membership
from gossiprec.core.records import MemberInfo
from gossiprec.core.wire import ALIVE, MAX_INCARNATION, SUSPECT, Alive, Dead, Suspect
from tests.support.signing import pinned_book, pins_of, sign_all
from tests.test_membership import CFG, NAMES5, Pump, addr, deliver, table

SEEDS = range(1, 4)
NAMES = [*NAMES5, "j"]
PINS = pins_of(NAMES)
REFUSALS = ("rx_alive_unsigned", "rx_accusation_unsigned", "rx_sig_invalid", "rx_sig_unknown_author")


def book(name: str) -> KeyBook:
    return pinned_book(name, PINS)


def signed(pump: Pump) -> Pump:
    return sign_all(pump, book)


def refusals(pump: Pump) -> dict[str, int]:
    return {f"{n}.{k}": m.counters[k] for n, m in pump.machines.items() for k in REFUSALS if m.counters.get(k)}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_crash_is_detected_by_every_survivor(seed: int) -> None:
    pump = signed(Pump.cluster(NAMES5, seed=seed))
    pump.run_until(1.0)
    pump.crashed.add("e")
    pump.run_until(8.0)
    for s in ("a", "b", "c", "d"):
        assert [type(ev) for ev in pump.member_events(s)] == [MemberSuspected, MemberFailed], s
    assert refusals(pump) == {}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_signed_accusation_is_refuted_and_an_unsigned_one_refused(seed: int) -> None:
    pump = signed(Pump.cluster(["a", "b", "c"], seed=seed))
    pump.run_until(0.5)
    c = pump.machines["c"]
    deliver(c, 0.5, Suspect("b", 1, "a"), Dead("b", 1, "a"), Alive("b", addr("x"), 9, 0))
    assert c.counters["rx_accusation_unsigned"] == 2 and c.counters["rx_alive_unsigned"] == 1
    assert c.take_events() == [] and c.member("b") == MemberInfo("b", addr("b"), 1, ALIVE)
    deliver(c, 0.5, book("a").sign(Suspect("b", 1, "a")))  # a's own word
    pump.flush("c")
    pump.run_until(8.0)
    assert [type(e) for e in pump.member_events("c", "b")] == [MemberSuspected, MemberAlive]
    inc = pump.machines["b"].incarnation
    assert inc == 2 and pump.of_type(SelfRefuted, "b")
    for m in pump.machines.values():
        assert m.member("b") == MemberInfo("b", addr("b"), inc, ALIVE)
    assert not pump.of_type(MemberFailed)


def test_an_unsigned_accusation_at_the_last_incarnation_raises_nothing() -> None:
    pump = signed(Pump.cluster(["a", "b", "c"], seed=1))
    pump.run_until(0.5)
    for m in pump.machines.values():  # refuted, b would sit at the last incarnation: never able to refute again
        deliver(m, 0.5, Suspect("b", MAX_INCARNATION - 1, "a"), Dead("b", MAX_INCARNATION - 1, "a"))
        pump.flush(m.name)
    pump.run_until(3.0)
    assert pump.machines["b"].incarnation == 1
    assert all(m.member("b").incarnation == 1 for m in pump.machines.values())  # type: ignore[union-attr]
    assert all(m.counters["rx_accusation_unsigned"] == 2 for m in pump.machines.values())


def test_a_signed_accusation_above_the_incarnation_a_receiver_knows_is_taken() -> None:
    # c still holds b at view 0's incarnation (b's signed Alive has not reached it) when a, which has it,
    # suspects b: c takes the suspicion (and checks b for itself), so that b's failure is not lost on c
    pump = signed(Pump.cluster(["a", "b", "c"], seed=1))
    pump.run_until(0.5)
    c = pump.machines["c"]
    deliver(c, 0.5, book("a").sign(Suspect("b", 7, "a")))
    assert c.member("b").status == SUSPECT and c.member("b").incarnation == 7  # type: ignore[union-attr]


def _join(pump: Pump) -> Membership:
    """A signing joiner "j" (incarnation 2) joins through "a" at t = 1."""
    j = Membership(CFG, "j", addr("j"), incarnation=2, rng=random.Random(99), now=1.0)
    j.auth = book("j")
    j.auth.counters = j.counters
    pump.add(j)
    j.join([addr("a")], 1.0)
    pump.flush("j")
    return j


@pytest.mark.parametrize("seed", SEEDS)
def test_a_joiner_learns_every_member_from_signed_rows(seed: int) -> None:
    # members at incarnation 2 over a view-0 table at 1: each announces its signed Alive at start,
    # as real agents do (their incarnation is their start time)
    base = table(NAMES5)
    pump = Pump()
    for i, n in enumerate(NAMES5):
        pump.add(Membership(CFG, n, addr(n), incarnation=2, rng=random.Random(seed * 1000 + i), now=0.0,
                            members=base))
    signed(pump)
    pump.run_until(1.0)
    _join(pump)
    pump.run_until(3.0)  # well before anyone's periodic push-pull: the seed's one reply taught j
    assert sorted(e.name for e in pump.member_events("j") if isinstance(e, MemberJoined)) == NAMES5
    for name, m in pump.machines.items():
        assert m.live_members() == sorted(NAMES), name
    assert refusals(pump) == {}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_joiner_learns_members_whose_signature_its_seed_never_got(seed: int) -> None:
    # every member at view 0's incarnation: nobody announced an Alive, so the seed's rows carry no
    # signatures; the joiner knows those members at incarnation 0, probes them, and their acks lift them
    pump = signed(Pump.cluster(NAMES5, seed=seed))
    pump.run_until(1.0)
    j = _join(pump)
    pump.run_until(8.0)
    for name, m in pump.machines.items():
        assert m.live_members() == sorted(NAMES), name
    assert not pump.of_type(MemberSuspected) and refusals(pump) == {}
    assert {j.member(n).incarnation for n in NAMES5} <= {0, 1}  # type: ignore[union-attr]
