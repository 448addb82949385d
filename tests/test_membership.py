"""State-machine tests of :class:`gossiprec.core.membership.Membership` (SWIM + Lifeguard).

Everything runs on a virtual clock: :class:`Pump` holds 1-5 machines, delivers the payloads of their
``take_sends()`` to the machine whose *address* matches after a fixed latency (optionally dropping some),
ticks each machine exactly at its ``next_deadline()`` and records every event with its time. Crashes,
pauses and restarts are pump operations. Nothing sleeps; a run of ten virtual seconds takes milliseconds.

Addresses differ from names (``addr-<name>``) so that a mix-up between the two cannot pass unnoticed.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import pytest

from gossiprec.core.config import Config, remaining_suspicion
from gossiprec.core.events import (
    MemberAlive, MemberFailed, MemberJoined, MemberLeft, MemberSuspected, ProbeResult, SelfRefuted,
)
from gossiprec.core.membership import Membership
from gossiprec.core.records import MemberInfo
from gossiprec.core.wire import (
    ALIVE, DEAD, LEFT, MAX_U64, PHASES, PROTOCOL_VERSION, SUSPECT, Ack, Alive, Dead, IndirectPing, Message, Nack,
    Ping, Progress, PushPull, Suspect, decode_packet, encode_packet,
)
from gossiprec.errors import ConfigError, ProtocolError

CFG = Config.profile("lan")
LATENCY = 0.0005
BIG = 64 * 1024 * 1024
MEMBER_EVENTS = (MemberJoined, MemberSuspected, MemberAlive, MemberFailed, MemberLeft)


def addr(name: str) -> str:
    return f"addr-{name}"


def table(names: list[str], incarnation: int = 1) -> dict[str, MemberInfo]:
    return {n: MemberInfo(n, addr(n), incarnation) for n in names}


def machine(name: str, names: list[str] | None, seed: int, *, now: float = 0.0, incarnation: int = 1,
            cfg: Config = CFG) -> Membership:
    members = table(names) if names is not None else None
    return Membership(cfg, name, addr(name), incarnation=incarnation, rng=random.Random(seed), now=now,
                      members=members)


class Delivery(NamedTuple):
    at: float
    src: str
    dst: str
    msgs: list[Message]
    reliable: bool


@dataclass
class Pump:
    """Virtual clock and hand delivery between machines. ``drop(src, dst, msgs, reliable)`` may drop a
    datagram; crashed machines receive nothing and do not tick; paused ones queue their input and run
    their (then overdue) timers when they resume."""

    machines: dict[str, Membership] = field(default_factory=dict)
    now: float = 0.0
    drop: Callable[[str, str, list[Message], bool], bool] | None = None
    crashed: set[str] = field(default_factory=set)
    paused_until: dict[str, float] = field(default_factory=dict)
    backlog: dict[str, list[tuple[bytes, bool]]] = field(default_factory=dict)
    events: list[tuple[str, Any]] = field(default_factory=list)
    log: list[Delivery] = field(default_factory=list)
    _heap: list[tuple[float, int, str, str, bytes, bool]] = field(default_factory=list)
    _seq: int = 0

    @classmethod
    def cluster(cls, names: list[str], seed: int = 1, cfg: Config = CFG) -> "Pump":
        base = table(names)  # one shared, read-only table, as the simulator does
        pump = cls()
        for i, n in enumerate(names):
            pump.add(Membership(cfg, n, addr(n), incarnation=1, rng=random.Random(seed * 1000 + i), now=0.0,
                                members=base))
        return pump

    def add(self, m: Membership) -> None:
        self.machines[m.name] = m
        self.crashed.discard(m.name)
        self.flush(m.name)

    def flush(self, name: str) -> None:
        m = self.machines[name]
        self.events.extend((name, ev) for ev in m.take_events())
        for send in m.take_sends():
            msgs = decode_packet(send.payload, BIG)  # everything a machine sends must decode
            dst = next((n for n, x in self.machines.items() if x.addr == send.addr), None)
            self.log.append(Delivery(self.now, name, dst or send.addr, msgs, send.reliable))
            if dst is None or (self.drop is not None and self.drop(name, dst, msgs, send.reliable)):
                continue
            self._seq += 1
            heapq.heappush(self._heap, (self.now + LATENCY, self._seq, name, dst, send.payload, send.reliable))

    def pause(self, name: str, duration: float) -> None:
        self.paused_until[name] = self.now + duration
        self.backlog[name] = []

    def run_until(self, t_end: float) -> None:
        while True:
            t_msg = self._heap[0][0] if self._heap else math.inf
            t_timer, who = math.inf, ""
            for name, m in self.machines.items():
                if name not in self.crashed and name not in self.paused_until:
                    d = m.next_deadline()
                    assert not math.isnan(d) and d >= 0
                    if d < t_timer:
                        t_timer, who = d, name
            t_resume, resumer = min(((t, n) for n, t in self.paused_until.items()), default=(math.inf, ""))
            t_next = min(t_msg, t_timer, t_resume)
            if t_next > t_end:
                break
            self.now = max(self.now, t_next)
            if t_resume == t_next:
                del self.paused_until[resumer]
                m = self.machines[resumer]
                for payload, reliable in self.backlog.pop(resumer, []):
                    m.receive(payload, self.now, reliable)
                m.tick(self.now)
                self.flush(resumer)
            elif t_msg == t_next:
                _, _, _src, dst, payload, reliable = heapq.heappop(self._heap)
                if dst in self.crashed:
                    continue
                if dst in self.paused_until:
                    self.backlog[dst].append((payload, reliable))
                    continue
                self.machines[dst].receive(payload, self.now, reliable)
                self.flush(dst)
            else:
                self.machines[who].tick(self.now)
                self.flush(who)
        self.now = t_end

    # --- queries ------------------------------------------------------------------------------
    def member_events(self, observer: str, about: str | None = None) -> list[Any]:
        return [ev for who, ev in self.events if who == observer and isinstance(ev, MEMBER_EVENTS)
                and (about is None or ev.name == about)]

    def of_type(self, kind: type, observer: str | None = None) -> list[Any]:
        return [ev for who, ev in self.events if isinstance(ev, kind) and (observer is None or who == observer)]

    def sent(self, kind: type, src: str | None = None, since: float = -1.0) -> list[tuple[Delivery, Any]]:
        return [(d, m) for d in self.log if d.at >= since and (src is None or d.src == src)
                for m in d.msgs if isinstance(m, kind)]


def deliver(m: Membership, now: float, *msgs: Message, reliable: bool = False) -> None:
    m.receive(encode_packet(list(msgs)), now, reliable)


def sent_msgs(m: Membership) -> list[tuple[str, Message]]:
    return [(s.addr, msg) for s in m.take_sends() for msg in decode_packet(s.payload, BIG)]


def run_alone(m: Membership, until: float, late_by: float = 0.0,
              sends: list[tuple[float, str, Message]] | None = None) -> list[Any]:
    """Tick a machine nobody answers at each deadline (+ ``late_by``) up to ``until``; return its events
    (and append ``(time, addr, message)`` for what it sent to ``sends``). Callers keep time monotone:
    run a machine up to ``t`` before delivering anything to it at ``t``."""
    events: list[Any] = []
    while True:
        d = m.next_deadline()
        assert math.isfinite(d)
        if d + late_by > until:
            break
        m.tick(d + late_by)
        out = sent_msgs(m)
        if sends is not None:
            sends.extend((d + late_by, a, msg) for a, msg in out)
        events.extend(m.take_events())
    return events


NAMES4 = ["a", "b", "c", "d"]
NAMES5 = ["a", "b", "c", "d", "e"]
SEEDS = (1, 2, 3)  # every pump scenario runs with each; all randomness derives from the seed


# --- ping / ack / progress ------------------------------------------------------------------------
def test_ping_is_answered_with_ack_carrying_progress() -> None:
    b = machine("b", ["a", "b"], seed=1)
    b.take_sends()
    b.set_progress(42, 2, 250, 0.0)
    deliver(b, 0.01, Ping(7, "b", "a", addr("a")))
    out = sent_msgs(b)
    assert out[0] == (addr("a"), Ack(7, "b", 1, 42, 2, 250, 10))  # (step, phase) current for 10 ms
    assert (addr("a"), Progress("b", 1, 1, 42, 2, 250)) in out  # own progress piggybacked too
    assert {a for a, _ in out} == {addr("a")}


def test_a_view_request_goes_without_progress_records_a_hello_with() -> None:
    # a datagram sent by address (a view request, ``send_addr``) goes without progress records (three per
    # datagram: a new process asks for the view every 0.5 s while it says hello); a hello to the observers
    # (``progress=True``: they read them) and a message to a member (``send_to``) still carry ours
    b = machine("b", ["a", "b", "c"], seed=1)
    b.take_sends()
    b.set_progress(42, 2, 250, 0.0)
    deliver(b, 0.01, Progress("c", 1, 3, 41, 2, 250))  # another member's record, to relay in turn
    b.take_sends()
    mine = Progress("b", 1, 1, 42, 2, 250)
    request = Nack(5, "b")  # any message: what rides with it matters
    b.send_addr(addr("c"), request)
    assert sent_msgs(b) == [(addr("c"), request)]
    b.send_addr(addr("c"), request, progress=True)
    out = sent_msgs(b)
    assert out[0] == (addr("c"), request) and (addr("c"), mine) in out
    assert b.send_to("a", request, 0.02)
    out = sent_msgs(b)
    assert out[0] == (addr("a"), request) and (addr("a"), mine) in out


def test_ping_for_someone_else_is_counted_not_answered() -> None:
    b = machine("b", ["a", "b"], seed=1)
    b.take_sends()
    deliver(b, 0.01, Ping(7, "c", "a", addr("a")))
    assert b.take_sends() == []
    assert b.counters.get("rx_misdirected_ping") == 1


@pytest.mark.parametrize("seed", SEEDS)
def test_ping_ack_round_trip_carries_progress_to_the_pinger(seed: int) -> None:
    pump = Pump.cluster(["a", "b"], seed=seed)
    pump.machines["b"].set_progress(42, 2, 250, pump.now)
    pump.run_until(1.0)
    oks = [ev for ev in pump.of_type(ProbeResult, "a") if ev.target == "b"]
    assert len(oks) >= 5 and all(ev.ok for ev in oks)
    p = pump.machines["a"].progress("b")
    assert p is not None and (p.step, p.phase, p.step_ms) == (42, 2, 250)
    assert 0.0 < p.seen_at <= 1.0
    # the stall clock is dated by b's own age of (42, 2) on the wire, not by when a first heard it
    assert 0.0 <= p.since < 0.005, p
    # a newer report replaces it within a probe round or two
    pump.machines["b"].set_progress(43, 3, 260, pump.now)
    pump.run_until(1.5)
    p = pump.machines["a"].progress("b")
    assert p is not None and (p.step, p.phase, p.step_ms) == (43, 3, 260)
    assert 1.0 <= p.since < 1.005, p
    assert pump.machines["a"].progress("a") is None and pump.machines["a"].progress("zz") is None
    assert not pump.of_type(MemberSuspected)


@pytest.mark.parametrize("seed", SEEDS)
def test_progress_spreads_to_members_that_never_probe_the_owner(seed: int) -> None:
    pump = Pump.cluster(["a", "b", "c"], seed=seed)
    pump.machines["c"].set_probe_targets(["a"])  # c never pings b: it learns b's step by piggyback
    pump.machines["b"].set_progress(9, 1, 100, pump.now)
    pump.run_until(3.0)
    p = pump.machines["c"].progress("b")
    assert p is not None and (p.step, p.phase, p.step_ms) == (9, 1, 100)
    # gossip carries no age (its records stay byte-identical as they spread): the stall clock starts
    # when c first heard of it; an ack from b would date it exactly
    assert p.since == p.seen_at, p
    assert not [d for d, m in pump.sent(Ping, "c") if m.target == "b"]


# --- indirect probes ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_lost_direct_ping_is_rescued_by_indirect_probe(seed: int) -> None:
    pump = Pump.cluster(NAMES4, seed=seed)
    # every datagram from a to b that carries a Ping is lost; all other paths work
    pump.drop = lambda s, d, msgs, rel: s == "a" and d == "b" and any(isinstance(m, Ping) for m in msgs)
    pump.run_until(5.0)
    probes_of_b = [ev for ev in pump.of_type(ProbeResult, "a") if ev.target == "b"]
    assert len(probes_of_b) >= 5 and all(ev.ok for ev in probes_of_b)
    relays = [m for _, m in pump.sent(IndirectPing, "a") if m.target == "b"]
    assert relays and all(m.target_addr == addr("b") and m.src_addr == addr("a") for m in relays)
    forwarded = [(d, m) for d, m in pump.sent(Ack) if d.dst == "a" and d.src != "b" and m.src == "b"]
    assert forwarded, "a helper forwards b's ack to a"
    assert not pump.of_type(MemberSuspected) and not pump.of_type(MemberFailed)
    assert all(m.member("b").status == ALIVE for m in pump.machines.values())  # type: ignore[union-attr]
    assert pump.machines["a"].health() == 0


def test_helper_answers_nack_when_target_is_silent() -> None:
    h = machine("h", ["a", "h", "t"], seed=2)
    h.take_sends()
    deliver(h, 1.0, IndirectPing(55, "t", addr("t"), "a", addr("a"), True))
    pings = [(a, m) for a, m in sent_msgs(h) if isinstance(m, Ping)]
    assert len(pings) == 1 and pings[0][0] == addr("t") and pings[0][1].target == "t"
    assert pings[0][1].src == "h" and pings[0][1].seq != 55
    relay_seq = pings[0][1].seq
    t_nack = 1.0 + CFG.nack_fraction * CFG.probe_timeout
    h.tick(t_nack - 1e-6)
    assert not [m for _, m in sent_msgs(h) if isinstance(m, Nack)]
    h.tick(t_nack)
    assert (addr("a"), Nack(55, "h")) in sent_msgs(h)
    # an ack arriving after the nack was sent is not forwarded any more
    deliver(h, t_nack + 0.01, Ack(relay_seq, "t", 1, -1, 0, 0))
    assert not [m for _, m in sent_msgs(h) if isinstance(m, Ack)]


def test_helper_forwards_target_ack_under_the_requesters_seq() -> None:
    h = machine("h", ["a", "h", "t"], seed=2)
    h.take_sends()
    deliver(h, 1.0, IndirectPing(55, "t", addr("t"), "a", addr("a"), True))
    relay = [m for _, m in sent_msgs(h) if isinstance(m, Ping)][0]
    deliver(h, 1.01, Ack(relay.seq, "t", 3, 12, 1, 40))
    assert (addr("a"), Ack(55, "t", 3, 12, 1, 40)) in sent_msgs(h)
    deliver(h, 1.02, Ack(relay.seq, "t", 3, 12, 1, 40))  # duplicate: forwarded once only
    assert not sent_msgs(h)
    h.tick(1.0 + CFG.nack_fraction * CFG.probe_timeout)
    assert not [m for _, m in sent_msgs(h) if isinstance(m, Nack)]


# --- failure detection ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_silent_member_is_suspected_then_declared_dead(seed: int) -> None:
    pump = Pump.cluster(NAMES5, seed=seed)
    pump.run_until(1.0)
    pump.crashed.add("e")
    pump.run_until(8.0)
    survivors = ["a", "b", "c", "d"]
    n = 5
    for s in survivors:
        evs = pump.member_events(s)
        assert [type(ev) for ev in evs] == [MemberSuspected, MemberFailed], (s, evs)
        susp, failed = evs
        assert susp.name == failed.name == "e" and susp.incarnation == failed.incarnation == 1
        assert failed.by in survivors
        # first accusation needs a direct + indirect timeout; death needs at least suspicion_min
        assert susp.at >= 1.0 + CFG.probe_timeout + CFG.indirect_timeout - 1e-9
        assert failed.at >= susp.at
        assert failed.at - 1.0 >= CFG.suspicion_min(n) + CFG.probe_timeout + CFG.indirect_timeout - 1e-9
        # and at most: a full probe round, the unconfirmed timeout and the verification
        assert failed.at - 1.0 <= 4 * CFG.probe_interval + 0.2 + CFG.suspicion_max(n) + 0.2
        m = pump.machines[s]
        assert m.member("e").status == DEAD  # type: ignore[union-attr]
        assert m.n_live == 4 and m.live_members() == survivors
    # the accuser of the first suspicion really had probed e and failed
    fails = [ev for who, ev in pump.events if isinstance(ev, ProbeResult) and ev.target == "e" and not ev.ok]
    assert fails
    # verification: before declaring, the declarer probed e itself after its timer ran out
    first_dead = min((ev.at, who) for who, ev in pump.events if isinstance(ev, MemberFailed))
    declarer = first_dead[1]
    assert any(m.target == "e" and d.at > 1.0 + CFG.suspicion_min(n) for d, m in pump.sent(Ping, declarer))


@pytest.mark.parametrize("confirmations, extra_delay", [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0), (3, 0.5),
                                                        (4, 0.0)])
def test_suspicion_timeout_shrinks_with_independent_confirmations(confirmations: int, extra_delay: float) -> None:
    # One observer o; the suspect x and the accusers never answer anything. o probes nobody itself
    # (empty probe target set), so its only suspicion is the one we hand it.
    names = ["o", "x", "p", "q", "r", "s"]
    o = machine("o", names, seed=11)
    o.set_probe_targets([])
    n = o.n_live
    k = min(CFG.suspicion_confirmations, n - 2)
    t0 = 1.0
    run_alone(o, t0)  # its own timers on time: health stays 0
    assert o.health() == 0
    deliver(o, t0, Suspect("x", 1, "p"))
    for accuser in ["q", "r", "s", "p"][:confirmations]:
        deliver(o, t0 + extra_delay, Suspect("x", 1, accuser))
    deliver(o, t0 + extra_delay, Suspect("x", 1, "q" if confirmations else "p"))  # repeat: not independent
    sends: list[tuple[float, str, Message]] = []
    events = o.take_events() + run_alone(o, 10.0, sends=sends)
    assert [type(e) for e in events if isinstance(e, MEMBER_EVENTS)] == [MemberSuspected, MemberFailed]
    failed = [e for e in events if isinstance(e, MemberFailed)][0]
    effective = min(confirmations, k)
    timeout = remaining_suspicion(effective, k, 0.0, CFG.suspicion_min(n), CFG.suspicion_max(n))
    # counted from the first suspicion; o only heard of it (it is no accuser), so it leaves the accusers
    # verify_defer to deliver their verdict, then verifies for verify_timeout before declaring
    timeout += CFG.verify_defer
    assert failed.at == pytest.approx(t0 + timeout + CFG.verify_timeout, abs=1e-9)
    assert failed.by == "o" and o.member("x").status == DEAD  # type: ignore[union-attr]
    # the verification: a ping to x (carrying the suspicion) and indirect requests, when the timer ran out
    verify = [(t, a, m) for t, a, m in sends if t == pytest.approx(t0 + timeout)]
    assert [a for _, a, m in verify if isinstance(m, Ping) and m.target == "x"] == [addr("x")]
    assert (addr("x"), Suspect("x", 1, "o")) in [(a, m) for _, a, m in verify]
    assert {a for _, a, m in verify if isinstance(m, IndirectPing) and m.target == "x"} <= {
        addr(h) for h in names if h not in ("o", "x")}
    assert len([m for _, _, m in verify if isinstance(m, IndirectPing)]) == CFG.indirect_checks


def test_suspect_that_answers_verification_is_not_declared_dead() -> None:
    # o's timer runs out, it verifies with a ping; x acks: no death, the suspicion is re-armed.
    o = machine("o", ["o", "x", "p", "q"], seed=4)
    o.set_probe_targets([])
    run_alone(o, 1.0)
    deliver(o, 1.0, Suspect("x", 1, "p"))
    o.take_events()
    o.take_sends()
    while True:
        d = o.next_deadline()
        o.tick(d)
        pings = [m for a, m in sent_msgs(o) if isinstance(m, Ping) and m.target == "x"]
        if pings:
            break
        assert d < 10
    deliver(o, d + 0.001, Ack(pings[0].seq, "x", 1, -1, 0, 0))
    events = o.take_events() + run_alone(o, d + CFG.verify_timeout * 2)
    assert not [e for e in events if isinstance(e, MemberFailed)]
    assert o.member("x").status == SUSPECT  # type: ignore[union-attr]


# --- refutation -----------------------------------------------------------------------------------
def test_suspected_node_refutes_with_higher_incarnation() -> None:
    b = machine("b", ["a", "b", "c"], seed=1)
    b.take_sends()
    deliver(b, 0.5, Suspect("b", 1, "a"))
    assert b.incarnation == 2
    assert b.take_events() == [SelfRefuted(2, "a", 0.5)]
    assert b.health() == 1
    assert b.member("b") == MemberInfo("b", addr("b"), 2, ALIVE)
    out = sent_msgs(b)
    assert (addr("a"), Alive("b", addr("b"), 2, 0)) in out  # the accuser is told at once
    # a declared-dead node refutes as well, above the accused incarnation
    deliver(b, 0.6, Dead("b", 5, "c"))
    assert b.incarnation == 6 and isinstance(b.take_events()[0], SelfRefuted)


@pytest.mark.parametrize("seed", SEEDS)
def test_refutation_spreads_and_suspecters_see_member_alive(seed: int) -> None:
    pump = Pump.cluster(["a", "b", "c"], seed=seed)
    pump.run_until(0.5)
    deliver(pump.machines["c"], 0.5, Suspect("b", 1, "a"))  # c hears an accusation of b by a
    pump.flush("c")
    pump.run_until(8.0)
    assert [type(e) for e in pump.member_events("c", "b")] == [MemberSuspected, MemberAlive]
    refuted = pump.of_type(SelfRefuted, "b")
    assert refuted and refuted[0].incarnation == 2 and refuted[0].accuser in ("a", "c")
    # (how many times b refutes one accusation: see test_stale_accusation_is_not_refuted_again)
    inc = pump.machines["b"].incarnation
    assert pump.member_events("c", "b")[1].incarnation >= 2
    for m in pump.machines.values():
        assert m.member("b") == MemberInfo("b", addr("b"), inc, ALIVE)
    assert not pump.of_type(MemberFailed)
    # a hears either the refutation first (an incarnation bump, no event) or the rumour, then the refutation
    assert [type(e) for e in pump.member_events("a", "b")] in ([], [MemberSuspected, MemberAlive])


def test_stale_accusation_is_not_refuted_again() -> None:
    # The probe of a suspect carries the suspicion (buddy system) and the same packet often carries the
    # gossiped original accusation too; the second copy is about an incarnation b has already refuted.
    b = machine("b", ["a", "b", "c"], seed=1)
    deliver(b, 0.5, Ping(9, "b", "c", addr("c")), Suspect("b", 1, "c"), Suspect("b", 1, "a"))
    assert b.incarnation == 2, "one accusation, one refutation"
    assert len([e for e in b.take_events() if isinstance(e, SelfRefuted)]) == 1
    assert b.health() == 1
    deliver(b, 0.6, Dead("b", 1, "a"))  # a late copy of an old death rumour
    assert b.incarnation == 2 and not b.take_events()


def test_alive_with_same_or_older_incarnation_does_not_clear_suspicion() -> None:
    o = machine("o", ["o", "x", "p"], seed=3)
    deliver(o, 1.0, Suspect("x", 3, "p"))
    deliver(o, 1.1, Alive("x", addr("x"), 3, 0), Alive("x", addr("x"), 2, 0))
    assert o.member("x").status == SUSPECT  # type: ignore[union-attr]
    deliver(o, 1.2, Alive("x", addr("x"), 4, 0))
    assert o.member("x") == MemberInfo("x", addr("x"), 4, ALIVE)
    assert [type(e) for e in o.take_events()] == [MemberSuspected, MemberAlive]


# --- paused / starved nodes (Lifeguard) -----------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_paused_node_does_not_accuse_and_raises_its_health(seed: int) -> None:
    pump = Pump.cluster(NAMES4, seed=seed)
    pump.run_until(1.0)
    assert pump.machines["a"].health() == 0
    pump.pause("a", 0.6)
    pump.run_until(1.6 + 1e-9)  # a resumes at 1.6: backlog, then its overdue timers fire late
    a = pump.machines["a"]
    assert a.counters.get("timers_late", 0) >= 1
    assert a.health() >= 2
    pump.run_until(8.0)
    # a accused nobody; nobody died; a's health recovered through successful probes
    assert not [e for e in pump.of_type(MemberSuspected, "a")]
    assert not [(d, m) for d, m in pump.sent(Suspect, "a") if m.src == "a"]
    assert not pump.of_type(MemberFailed)
    assert a.health() == 0
    assert sorted(a.live_members()) == NAMES4


def test_starved_node_withholds_accusations() -> None:
    # a's peers never answer. While its timers fire late (a starved process), its failed probes are
    # blamed on itself; once its health score reaches accuse_health_limit, on-time failures are not
    # turned into suspicions either (counted as accusations_withheld).
    a = machine("a", NAMES4, seed=9)
    starved = run_alone(a, 3.0, late_by=CFG.starve_slack * 2)
    assert a.counters.get("timers_late", 0) >= 3
    assert a.health() == CFG.awareness_max - 1
    on_time = run_alone(a, 20.0)
    assert not [e for e in starved + on_time if isinstance(e, (MemberSuspected, MemberFailed))]
    assert a.counters.get("accusations_withheld", 0) >= 3
    assert [e for e in on_time if isinstance(e, ProbeResult) and not e.ok]
    assert a.n_live == 4


def test_healthy_node_with_silent_peer_does_accuse() -> None:
    # the control for the test above: same machine, timers on time, peers silent -> it suspects
    a = machine("a", NAMES4, seed=9)
    events = run_alone(a, 3.0)
    first_fail = next(i for i, e in enumerate(events) if isinstance(e, ProbeResult) and not e.ok)
    first_susp = next(i for i, e in enumerate(events) if isinstance(e, MemberSuspected))
    assert first_susp == first_fail + 1, "the first failed probe of a healthy node is an accusation"
    assert events[first_susp].by == "a" and events[first_susp].name == events[first_fail].target


def test_late_timer_during_suspicion_rearms_instead_of_killing() -> None:
    o = machine("o", ["o", "x", "p", "q"], seed=4)
    o.set_probe_targets([])
    run_alone(o, 1.0)
    deliver(o, 1.0, Suspect("x", 1, "p"))
    o.take_events()
    assert o.health() == 0
    deadline = 1.0 + CFG.suspicion_max(o.n_live)
    o.tick(deadline + 1.0)  # we slept through the refutation window
    assert not [e for e in o.take_events() if isinstance(e, MemberFailed)]
    assert o.member("x").status == SUSPECT  # type: ignore[union-attr]
    assert o.health() >= 2
    later = run_alone(o, deadline + 1.0 + 2 * CFG.suspicion_max(o.n_live) * CFG.awareness_max)
    assert [e for e in later if isinstance(e, MemberFailed)], "declared once the node runs on time again"


# --- join / leave / restart -----------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_join_through_a_seed_from_an_empty_table(seed: int) -> None:
    pump = Pump.cluster(["s1", "s2", "s3"], seed=seed)
    pump.run_until(0.5)
    j = machine("j", None, seed=99, now=0.5)
    assert j.live_members() == ["j"] and j.n_live == 1
    pump.add(j)
    j.join([addr("j"), addr("s1")], 0.5)  # its own address is skipped
    pump.flush("j")
    first = [d for d in pump.log if d.src == "j"]
    assert first and first[0].dst == "s1" and first[0].reliable
    pp = first[0].msgs[0]
    assert isinstance(pp, PushPull) and pp.join and not pp.reply and pp.src == "j"
    assert [r[0] for r in pp.members] == ["j"]
    assert not [d for d in pump.log if d.src == "j" and d.dst == "j"]
    pump.run_until(4.0)
    everyone = ["j", "s1", "s2", "s3"]
    for name, m in pump.machines.items():
        assert m.live_members() == everyone, name
        assert m.n_live == 4
    assert sorted(e.name for e in pump.member_events("j")) == ["s1", "s2", "s3"]
    assert all(isinstance(e, MemberJoined) for e in pump.member_events("j"))
    for s in ("s1", "s2", "s3"):
        assert [(type(e), e.incarnation) for e in pump.member_events(s)] == [(MemberJoined, 1)]
    assert not pump.of_type(MemberSuspected)


def test_pushpull_reply_goes_back_on_the_stream() -> None:
    s = machine("s", ["s", "t"], seed=1)
    s.take_sends()
    row = ("j", addr("j"), 3, ALIVE, 1, 0, -1, 0, 0, 0, 0, b"", b"")
    deliver(s, 1.0, PushPull("j", addr("j"), True, False, (row,)), reliable=True)
    replies = [x for x in s.take_sends() if x.addr == addr("j")]
    assert replies and replies[0].reliable
    reply = decode_packet(replies[0].payload, BIG)[0]
    assert isinstance(reply, PushPull) and reply.reply and reply.join
    assert sorted(r[0] for r in reply.members) == ["s", "t"]  # its state before merging the joiner's
    assert s.member("j") == MemberInfo("j", addr("j"), 3, ALIVE, 1)
    assert s.take_events() == [MemberJoined("j", addr("j"), 3, "spare", 1.0)]
    # a reply is not answered again
    deliver(s, 1.1, PushPull("j", addr("j"), False, True, ()), reliable=True)
    assert not [x for x in s.take_sends() if x.reliable]


@pytest.mark.parametrize("seed", SEEDS)
def test_graceful_leave_is_member_left_not_failed(seed: int) -> None:
    pump = Pump.cluster(NAMES4, seed=seed)
    pump.run_until(1.0)
    b = pump.machines["b"]
    b.leave(1.0)
    pump.flush("b")
    assert b.left and b.member("b").status == LEFT  # type: ignore[union-attr]
    pump.run_until(8.0)
    for s in ("a", "c", "d"):
        assert [type(e) for e in pump.member_events(s, "b")] == [MemberLeft], s
        assert pump.machines[s].member("b").status == LEFT  # type: ignore[union-attr]
        assert pump.machines[s].live_members() == ["a", "c", "d"]
    assert not pump.of_type(MemberFailed) and not pump.of_type(MemberSuspected)
    assert not pump.sent(Ping, "b", since=1.0 + 1e-9), "a node that left probes nobody"
    assert not [d for d, m in pump.sent(Ping) if m.target == "b" and d.at > 2.0]


@pytest.mark.parametrize("seed", SEEDS)
def test_restart_with_higher_incarnation_after_death_joins_again(seed: int) -> None:
    pump = Pump.cluster(NAMES4, seed=seed)
    pump.run_until(0.5)
    pump.crashed.add("d")
    pump.run_until(7.0)
    for s in ("a", "b", "c"):
        assert [type(e) for e in pump.member_events(s, "d")] == [MemberSuspected, MemberFailed]
    d2 = machine("d", None, seed=123, now=7.0, incarnation=7)
    pump.add(d2)
    d2.join([addr("a")], 7.0)
    pump.flush("d")
    pump.run_until(12.0)
    for s in ("a", "b", "c"):
        evs = pump.member_events(s, "d")
        assert [type(e) for e in evs] == [MemberSuspected, MemberFailed, MemberJoined], s
        assert evs[2].incarnation >= 7 and evs[2].at >= 7.0
        assert pump.machines[s].member("d") == MemberInfo("d", addr("d"), d2.incarnation, ALIVE)
    assert d2.live_members() == NAMES4
    # news of d's return is spent on the members that did not know it: none of it goes to d itself
    assert not [m for dl in pump.log if dl.dst == "d" and dl.at >= 7.0 for m in dl.msgs
                if isinstance(m, Alive) and m.name == "d"]
    assert [e.name for e in pump.member_events("d")] == ["a", "b", "c"]


def test_dead_member_with_same_incarnation_stays_dead() -> None:
    o = machine("o", ["o", "x"], seed=1)
    deliver(o, 1.0, Dead("x", 1, "p"))
    deliver(o, 1.1, Alive("x", addr("x"), 1, 0), Suspect("x", 1, "p"))
    assert o.member("x").status == DEAD  # type: ignore[union-attr]
    assert [type(e) for e in o.take_events()] == [MemberFailed]
    deliver(o, 1.2, Alive("x", addr("x"), 2, 0))
    assert o.take_events() == [MemberJoined("x", addr("x"), 2, "trainer", 1.2)]


def test_dead_record_is_reaped_after_dead_reap() -> None:
    cfg = Config(dead_reap=5.0)
    o = Membership(cfg, "o", addr("o"), incarnation=1, rng=random.Random(1), now=0.0, members=table(["o", "x"]))
    o.set_probe_targets([])
    run_alone(o, 1.0)
    deliver(o, 1.0, Dead("x", 1, "p"))
    run_alone(o, 5.9)
    assert o.member("x") is not None
    run_alone(o, 6.1)
    assert o.member("x") is None and o.live_members() == ["o"]


# --- robustness -----------------------------------------------------------------------------------
BAD_DATAGRAMS = [
    (b"", "rx_dropped_truncated"),
    (b"\xc1garbage", "rx_dropped_malformed"),
    (bytes((0x92, PROTOCOL_VERSION + 1)) + b"\x91\x93\x04\x01\xa1a", "rx_dropped_bad_version"),  # a newer peer
    (encode_packet([Nack(1, "a")])[:-2], "rx_dropped_malformed"),
    (bytes((0x92, PROTOCOL_VERSION)) + b"\x91\x91\x63", "rx_dropped_unknown_type"),
    (bytes((0x92, PROTOCOL_VERSION)) + b"\x91\x93\x01\x01\xa1a", "rx_dropped_bad_message"),
    (bytes((0x92, PROTOCOL_VERSION)) + b"\x91\x93\x04\xff\xa1a", "rx_dropped_bad_field"),
    (b"\x00" * (CFG.mtu + 1), "rx_dropped_oversized"),
]


@pytest.mark.parametrize("data, counter", BAD_DATAGRAMS, ids=[c for _, c in BAD_DATAGRAMS])
def test_malformed_datagram_is_counted_and_dropped(data: bytes, counter: str) -> None:
    m = machine("a", NAMES4, seed=1)
    m.take_sends()
    before = m.members()
    m.receive(data, 0.01)
    m.receive(data, 0.02)
    assert m.counters[counter] == 2
    assert m.take_sends() == [] and m.take_events() == [] and m.members() == before


def test_stream_messages_may_exceed_the_mtu_but_datagrams_may_not() -> None:
    rows = tuple((f"m{i:04d}", addr(f"m{i:04d}"), 1, ALIVE, 0, 0, -1, 0, 0, 0, 0, b"", b"") for i in range(100))
    data = encode_packet([PushPull("m0000", addr("m0000"), False, True, rows)])
    assert len(data) > CFG.mtu
    m = machine("a", ["a"], seed=1)
    m.receive(data, 0.1)
    assert m.counters["rx_dropped_oversized"] == 1 and m.n_live == 1
    m.receive(data, 0.2, reliable=True)
    assert m.n_live == 101


@pytest.mark.parametrize("seed", SEEDS)
def test_random_valid_messages_never_crash_and_keep_the_table_consistent(seed: int) -> None:
    rng = random.Random(seed)
    pool = ["a", "b", "c", "x", "y"]
    m = machine("a", ["a", "b", "c"], seed=5)
    now = 0.0
    last_inc = m.incarnation

    def name() -> str:
        return rng.choice(pool)

    def inc() -> int:
        return rng.choice([0, 1, 1, 2, 3, 7, 2**40])

    makers: list[Callable[[], Message]] = [
        lambda: Ping(rng.randrange(2**32), name(), name(), addr(name())),
        lambda: IndirectPing(rng.randrange(2**32), name(), addr(name()), name(), addr(name()), rng.random() < 0.5),
        lambda: Ack(rng.randrange(2**32), name(), inc(), rng.randrange(-1, 50), rng.randrange(6), rng.randrange(999)),
        lambda: Nack(rng.randrange(2**32), name()),
        lambda: Alive(name(), addr(name()), inc(), rng.randrange(2)),
        lambda: Suspect(name(), inc(), name()),
        lambda: Dead(name(), inc(), name()),
        lambda: Progress(name(), inc(), rng.randrange(9), rng.randrange(-1, 50), rng.randrange(6), 5),
        lambda: PushPull(name(), addr(name()), rng.random() < 0.5, rng.random() < 0.5, tuple(
            (name(), addr(name()), inc(), rng.randrange(4), rng.randrange(2), rng.randrange(3), 1, 0, 0, 0, 0, b"", b"")
            for _ in range(rng.randrange(4)))),
    ]
    for _ in range(3000):
        now += rng.choice([0.0, 0.001, 0.01, 0.05])
        if rng.random() < 0.2:
            if rng.random() < 0.5:
                now = max(now, m.next_deadline())
            m.tick(now)
        else:
            msgs = [rng.choice(makers)() for _ in range(rng.randrange(1, 4))]
            m.receive(encode_packet(msgs), now, reliable=rng.random() < 0.2)
        for s in m.take_sends():
            decode_packet(s.payload, BIG if s.reliable else CFG.mtu)  # all output decodes, fits
        m.take_events()
        assert m.incarnation >= last_inc
        last_inc = m.incarnation
        me = m.member("a")
        assert me is not None and me.status == ALIVE and me.incarnation == m.incarnation
        assert m.n_live == len(m.live_members())
        assert math.isfinite(m.next_deadline())


@pytest.mark.parametrize("msg", [Suspect("b", MAX_U64, "a"), Dead("b", MAX_U64, "a"),
                                 Alive("b", addr("b"), MAX_U64, 0)], ids=["suspect", "dead", "alive"])
def test_accusation_at_max_incarnation_does_not_crash(msg: Message) -> None:
    b = machine("b", ["a", "b"], seed=1)
    deliver(b, 0.1, msg)  # a valid datagram: it must be handled or counted, never raise
    for s in b.take_sends():
        decode_packet(s.payload, BIG)


@pytest.mark.parametrize("step, phase, step_ms, refused", [
    (5, 1, -3, "step_ms must be a non-negative integer"), (-2, 1, 10, "step must be an integer -1..2")])
def test_set_progress_refuses_what_the_wire_cannot_carry(step: int, phase: int, step_ms: int, refused: str) -> None:
    b = machine("b", ["a", "b"], seed=1)
    with pytest.raises(ProtocolError, match=refused):
        b.set_progress(step, phase, step_ms, 0.05)


@pytest.mark.parametrize("step, phase, step_ms, acked_ms", [
    (5, 1, 2**31, 2**31 - 1),  # clamped to the wire's field
    (5, len(PHASES) - 1, 10, 10),  # the last phase
])
def test_set_progress_acks_carry_what_the_wire_can(step: int, phase: int, step_ms: int, acked_ms: int) -> None:
    b = machine("b", ["a", "b"], seed=1)
    b.take_sends()
    b.set_progress(step, phase, step_ms, 0.05)
    deliver(b, 0.1, Ping(1, "b", "a", addr("a")))
    acks = [m for s in b.take_sends() for m in decode_packet(s.payload, CFG.mtu) if isinstance(m, Ack)]
    assert [(a.step, a.phase, a.step_ms) for a in acks] == [(step, phase, acked_ms)]


def test_addr_too_long_for_the_wire_is_refused() -> None:
    with pytest.raises(ProtocolError, match="address must be at most 300 bytes, got 301"):
        Membership(CFG, "z", "x" * 301, incarnation=1, rng=random.Random(1), now=0.0, members=table(["a", "z"]))
    # the longest address the wire carries is accepted, and peers decode its packets
    m = Membership(CFG, "z", "x" * 300, incarnation=1, rng=random.Random(1), now=0.0, members=table(["a", "z"]))
    m.tick(m.next_deadline())
    sends = m.take_sends()
    assert sends and all(decode_packet(s.payload, BIG) for s in sends)


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ProtocolError, match="role"):
        Membership(CFG, "a", "x", incarnation=1, rng=random.Random(1), now=0.0, role="boss")
    with pytest.raises(ProtocolError, match="name"):
        Membership(CFG, "", "x", incarnation=1, rng=random.Random(1), now=0.0)
    with pytest.raises(ProtocolError, match="name"):
        Membership(CFG, "\u00e9" * 65, "x", incarnation=1, rng=random.Random(1), now=0.0)


# --- probe targets and deadlines ------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_set_probe_targets_restricts_who_gets_pinged(seed: int) -> None:
    pump = Pump.cluster(NAMES5, seed=seed)
    a = pump.machines["a"]
    a.set_probe_targets(["c", "a", "zz"])  # self and unknown names are ignored
    pump.run_until(3.0)
    targets = [m.target for _, m in pump.sent(Ping, "a")]
    assert set(targets) == {"c"} and len(targets) >= 25
    a.set_probe_targets(None)
    t = pump.now
    pump.run_until(6.0)
    assert {m.target for _, m in pump.sent(Ping, "a", since=t)} == {"b", "c", "d", "e"}
    assert not pump.of_type(MemberSuspected)


@pytest.mark.parametrize("seed", SEEDS)
def test_round_robin_probes_everyone_once_per_round(seed: int) -> None:
    pump = Pump.cluster(NAMES5, seed=seed)
    pump.run_until(4.0)
    targets = [m.target for _, m in pump.sent(Ping, "b")]
    assert len(targets) >= 30
    rounds = [targets[i:i + 4] for i in range(0, len(targets) - 3, 4)]
    assert all(sorted(r) == ["a", "c", "d", "e"] for r in rounds), rounds
    assert len(set(map(tuple, rounds))) > 1, "the order is reshuffled between rounds"


def _rounds(pump: Pump, src: str, since: float = 0.0) -> list[tuple[float, list[str]]]:
    """(start, targets) of each probe round of ``src``: its pings grouped by send time."""
    rounds: dict[float, list[str]] = {}
    for d, m in pump.sent(Ping, src, since=since):
        rounds.setdefault(round(d.at, 9), []).append(m.target)
    return sorted(rounds.items())


def test_idle_rounds_probe_a_batch_and_a_focus_brings_back_short_rounds() -> None:
    """While nothing is in focus, a round probes probe_batch targets and rounds are probe_batch
    intervals apart (the same probes per second, half the wake-ups); a member put in focus brings the
    next round forward to one interval after the last, and rounds stay one interval apart, each
    probing the focus member, until the focus is cleared."""
    assert CFG.probe_batch == 2
    step = CFG.probe_interval
    pump = Pump.cluster(NAMES5, seed=4)
    a = pump.machines["a"]
    pump.run_until(2.0)
    idle = _rounds(pump, "a", since=0.5)
    assert len(idle) >= 6
    for (t0, targets), (t1, _) in zip(idle, idle[1:]):
        assert len(targets) == 2 and len(set(targets)) == 2, targets
        assert t1 - t0 == pytest.approx(2 * step, abs=1e-9)
    probes = sum(len(t) for _, t in idle)
    assert probes / (idle[-1][0] - idle[0][0] + 2 * step) == pytest.approx(1 / step, rel=0.01)
    last = idle[-1][0]
    t_focus = last + 0.3 * step  # mid-round: the next round was due at last + 2 steps
    pump.run_until(t_focus)
    a.set_focus(["c"])
    pump.run_until(t_focus + 1.0)
    busy = _rounds(pump, "a", since=last + 1e-6)
    assert busy[0][0] == pytest.approx(last + step, abs=1e-9)  # brought forward
    for (t0, targets), (t1, _) in zip(busy, busy[1:]):
        assert "c" in targets and len(set(targets) - {"c"}) <= 1, targets
        assert t1 - t0 == pytest.approx(step, abs=1e-9)
    a.set_focus([])
    t_clear = pump.now
    pump.run_until(t_clear + 1.0)
    again = _rounds(pump, "a", since=t_clear + 2 * step + 1e-6)
    assert len(again) >= 3 and all(len(t) == 2 for _, t in again)
    assert all(t1 - t0 == pytest.approx(2 * step, abs=1e-9) for (t0, _), (t1, _) in zip(again, again[1:]))
    assert not pump.of_type(MemberSuspected)


def test_a_single_target_is_probed_every_interval_despite_the_batch() -> None:
    """A round robin of fewer targets than probe_batch does not slow each target's probes down."""
    pump = Pump.cluster(NAMES4, seed=2)
    pump.machines["a"].set_probe_targets(["b"])
    pump.run_until(3.0)
    rounds = _rounds(pump, "a", since=1.0)
    assert all(t == ["b"] for _, t in rounds)
    assert len(rounds) == pytest.approx(2.0 / CFG.probe_interval, abs=1)


def test_next_deadline_is_finite_and_moves_forward() -> None:
    m = machine("a", NAMES5, seed=13)  # nobody answers: probes fail, suspicions and gossip run
    assert math.isfinite(m.next_deadline()) and 0.0 <= m.next_deadline() <= CFG.probe_interval
    prev = 0.0
    for _ in range(400):
        d = m.next_deadline()
        assert math.isfinite(d)
        assert d >= prev
        assert d - prev <= CFG.pushpull_period(5) * 1.5
        m.tick(d)
        m.take_sends()
        m.take_events()
        assert m.next_deadline() > d, "tick(now) runs every timer due at or before now"
        prev = d
    assert prev > 5.0


def test_tick_before_the_deadline_does_nothing() -> None:
    m = machine("a", NAMES4, seed=14)
    m.take_sends()
    d = m.next_deadline()
    m.tick(d - 1e-6)
    assert m.take_sends() == [] and m.take_events() == [] and m.next_deadline() == d


# --- determinism of the simulator -----------------------------------------------------------------
def test_simulation_is_deterministic_for_a_seed() -> None:
    from gossiprec.sim.run import SimParams, run_membership

    params = SimParams(nodes=30, crash=2, loss=0.02, duration=8, seed=17)

    def strip(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if k not in ("wall_s", "events_per_wall_s", "cpu_s", "events_per_cpu_s")}

    first, second = run_membership(params), run_membership(params)
    assert strip(first) == strip(second)
    assert first["crashed"] == 2 and first["detected_pairs"] > 0
    other = run_membership(SimParams(nodes=30, crash=2, loss=0.02, duration=8, seed=18))
    assert strip(other) != strip(first)


def test_member_reaped_and_rejoined_is_probed_as_often_as_the_others() -> None:
    cfg = Config(dead_reap=1.0)
    pump = Pump.cluster(["o", "x", "y"], seed=4, cfg=cfg)
    for cycle in range(2):  # x dies, is forgotten (reaped), and comes back with a newer incarnation
        t = pump.now
        pump.crashed.add("x")
        pump.run_until(t + 7.0)
        assert pump.machines["o"].member("x") is None, "reaped"
        x = machine("x", None, seed=50 + cycle, now=pump.now, incarnation=10 + cycle, cfg=cfg)
        pump.add(x)
        x.join([addr("o")], pump.now)
        pump.flush("x")
        pump.run_until(pump.now + 2.0)
        assert pump.machines["o"].live_members() == ["o", "x", "y"]
    t = pump.now
    pump.run_until(t + 4.0)
    targets = [m.target for _, m in pump.sent(Ping, "o", since=t)]
    counts = {n: targets.count(n) for n in ("x", "y")}
    assert abs(counts["x"] - counts["y"]) <= 2, f"o's probes per member over 4 s: {counts}"


def test_focus_members_are_probed_every_round_and_turns_one_per_round() -> None:
    """Members that may have failed (focus) are probed every round, each failed probe being evidence
    towards an alert; members probed only to refresh their progress take turns, one per round."""
    names = ["o", "a", "b", "c", "d", "e", "f"]
    o = Membership(CFG, "o", addr("o"), incarnation=1, rng=random.Random(5), now=0.0, members=table(names))
    o.set_probe_targets(["a"])  # the round robin: only a
    o.set_focus(["b", "c", "o"], turns=["d", "e", "b"])  # o itself and b (already focused) are dropped
    sends: list[tuple[float, str, Message]] = []
    run_alone(o, 1.0, sends=sends)
    rounds: dict[float, set[str]] = {}
    for t, _, m in sends:
        if isinstance(m, Ping):
            rounds.setdefault(round(t, 6), set()).add(m.target)
    starts = sorted(t for t, targets in rounds.items() if "a" in targets)  # a probe round begins
    assert len(starts) >= 3, rounds  # nobody answers: a starved prober slows down (Lifeguard)
    turns = []
    for t in starts:
        targets = rounds[t]
        assert {"b", "c"} <= targets, (t, targets)  # focus: every round
        assert "o" not in targets and "f" not in targets
        turn = targets & {"d", "e"}
        assert len(turn) == 1, (t, targets)  # one turn per round
        turns.append(turn.pop())
    assert all(x != y for x, y in zip(turns, turns[1:])), turns  # d and e alternate


def test_startup_grace_spares_members_not_heard_from_yet() -> None:
    from dataclasses import replace

    cfg = replace(CFG, startup_grace=5.0)
    o = Membership(cfg, "o", addr("o"), incarnation=1, rng=random.Random(3), now=0.0,
                   members=table(["o", "x", "y"]))
    run_alone(o, 0.05)
    assert o.has_heard("o") and not o.has_heard("y")
    deliver(o, 0.05, Ping(7, "o", "y", addr("y")))  # y's agent is up: it pinged us
    assert o.has_heard("y") and not o.has_heard("x")
    sends: list[tuple[float, str, Message]] = []
    events = run_alone(o, 4.9, sends=sends)
    pinged = {m.target for _, _, m in sends if isinstance(m, Ping)}
    # x, never heard from, is probed (an answer would prove it up), but its silence is not judged:
    # no failed probe reported, no suspicion, no indirect probes on its behalf; y's silence is
    assert pinged == {"x", "y"}
    assert not [e for e in events if isinstance(e, (MemberSuspected, MemberFailed, ProbeResult)) and
                getattr(e, "name", getattr(e, "target", None)) == "x"]
    assert [e for e in events if isinstance(e, ProbeResult) and e.target == "y" and not e.ok]
    assert not [m for _, _, m in sends if isinstance(m, IndirectPing) and m.target == "x"]
    assert o.counters["probes_unanswered_in_grace"] > 0
    events = run_alone(o, 9.0)
    assert o.has_heard("x")
    # grace over: x's silence is reported like anyone's (whether o accuses depends on its own health)
    assert [e for e in events if isinstance(e, ProbeResult) and e.target == "x" and not e.ok]
    with pytest.raises(ConfigError, match="startup_grace"):
        Config(startup_grace=-1.0)


def test_startup_grace_ends_for_a_member_another_member_found_silent() -> None:
    """A suspicion from another member (which judges only members it heard from) proves the member was
    up: its silence is judged at once here too, grace or not."""
    from dataclasses import replace

    cfg = replace(CFG, startup_grace=30.0)
    o = Membership(cfg, "o", addr("o"), incarnation=1, rng=random.Random(3), now=0.0,
                   members=table(["o", "x", "y"]))
    events = run_alone(o, 1.0)
    assert not [e for e in events if isinstance(e, ProbeResult) and e.target == "x"]
    assert not o.has_heard("x")
    deliver(o, 1.0, Suspect("x", 1, "y"))
    assert o.has_heard("x")
    events = run_alone(o, 3.0)
    assert [e for e in events if isinstance(e, ProbeResult) and e.target == "x" and not e.ok]


def test_startup_grace_members_that_answer_are_judged_at_once() -> None:
    """Two agents that learned of each other only through the job spec probe each other during the grace,
    so each hears the other; a crash right after that is judged without waiting for the grace to end."""
    from dataclasses import replace

    cfg = replace(CFG, startup_grace=30.0)
    pump = Pump.cluster(["o", "x", "y"], seed=6, cfg=cfg)
    pump.run_until(1.0)
    pump.crashed.add("x")
    t = pump.now
    pump.run_until(t + 5.0)
    assert pump.machines["o"].member("x").status != ALIVE  # suspected or dead well within the 30 s grace
