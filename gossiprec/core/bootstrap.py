"""View 0 without a job spec: the agents find each other through seeds and agree on the first view.

Every agent starts as a *candidate*: its name, address, host, local index on the host (by default its
port) and whether it was started as a spare. It says hello to every seed (the same ``--seed`` list on
every agent) until it knows the job's ``expected`` candidates; a seed answers with every candidate it
knows. View 0 is then decided by single-decree Paxos whose acceptors are the seeds: any candidate that
knows enough candidates proposes, the first in rank order at once and the others ``stagger`` seconds
apart after it, so that a dead first candidate costs one stagger and two live ones rarely duel. A
value is decided when a majority of the seeds accepted it at one ballot; Paxos then guarantees that no
other value of view 0 is ever decided, whatever the timing, the losses or the late candidates. A
proposer that hears of an accepted value re-proposes it, so a proposer that died after the decision
loses nothing.

The value is the first ``expected`` candidates in rank order: by host (numbers in host names compared
as numbers, so ``node2`` comes before ``node10``), then local index, then name; candidates started as
spares after all others. The first ``expected - spares`` are trainers with ranks 0, 1, ... in that
order, the rest hot spares. Candidates beyond ``expected`` (late or extra) are not in view 0: they join
the running job as spares, like any joiner. Too few candidates: nothing is decided; :class:`BootProgress`
events say who is known, and the agent gives up after its timeout with that list.

Safety needs only that a majority of the seeds keep their promises for the bootstrap's duration (an
acceptor restarted during the bootstrap forgets them). Liveness needs a majority of the seeds up: give
several (e.g. the first agent of three hosts); any minority of them may be dead at the start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from gossiprec.core.events import BootMismatch, BootProgress, ViewZeroAgreed
from gossiprec.core.records import MemberInfo, RandomSource, Send
from gossiprec.core.topology import SPARE, TRAINER, JobTopology
from gossiprec.core.view import View, ViewMember
from gossiprec.core.wire import (
    BootAccept, BootAccepted, BootDecided, BootHello, BootKnown, BootPrepare, BootPromise, Message, decode_packet,
    encode_packet,
)
from gossiprec.errors import ConfigError, DecodeError

if TYPE_CHECKING:
    from gossiprec.core.election import Plan
    from gossiprec.core.events import CoreEvent
    from gossiprec.core.machine import Machine

INF = float("inf")
Ballot = tuple[int, str]


@dataclass(frozen=True, slots=True)
class Candidate:
    """An agent that may be in view 0."""

    name: str
    addr: str
    host: str = ""
    local: int = 0
    """Its index among the agents of its host (the rank order within a host)."""
    spare: bool = False
    """Started as a spare (``--role spare``): never a trainer of view 0."""

    def row(self) -> tuple[Any, ...]:
        return (self.name, self.addr, self.host, self.local, self.spare)

    @classmethod
    def of(cls, row: tuple[Any, ...] | list[Any]) -> Candidate:
        return cls(str(row[0]), str(row[1]), str(row[2]), int(row[3]), bool(row[4]))


def _natural(text: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def _rows(cands: Iterable[Candidate]) -> tuple[tuple[Any, ...], ...]:
    return tuple(c.row() for c in cands)


def rank_order(c: Candidate) -> tuple[Any, ...]:
    """Sort key of the candidates: spares by flag last, then host (numbers as numbers), local index, name."""
    return (c.spare, _natural(c.host), c.local, c.name)


@dataclass(frozen=True, slots=True)
class BootParams:
    """What every agent of one job is started with (the same values everywhere)."""

    expected: int
    """Members of view 0, spares included (``--nnodes`` x ``--nproc-per-node``)."""
    spares: int
    """How many of them are hot spares (the last in rank order)."""
    seeds: tuple[str, ...]
    """The acceptors: addresses of agents of the job (the same list on every agent)."""
    allow_shrink: bool = False
    """The topology's ``allow_shrink`` (see :class:`~gossiprec.core.topology.JobTopology`)."""
    min_replicas: int = 1
    """The topology's ``min_replicas``."""
    hello_interval: float = 0.2
    """Seconds between two hellos to the seeds (doubling while nothing changes, up to 8x)."""
    stagger: float = 0.1
    """Seconds between the first proposals of two candidates next in rank order."""
    round_timeout: float = 0.5
    """Seconds a Paxos round may take before its proposer tries a higher ballot (plus up to as much
    again at random, so that two proposers do not keep duelling)."""
    progress_interval: float = 5.0
    """Seconds between two :class:`~gossiprec.core.events.BootProgress` events while undecided."""
    linger: float = 30.0
    """Seconds after the decision during which this agent still answers bootstrap messages (a late
    candidate learns the decision instead of waiting for its timeout)."""

    def __post_init__(self) -> None:
        if isinstance(self.expected, bool) or not isinstance(self.expected, int) or self.expected < 1:
            raise ConfigError(f"the job needs at least 1 member, got {self.expected!r}")
        if isinstance(self.spares, bool) or not isinstance(self.spares, int) or not 0 <= self.spares < self.expected:
            raise ConfigError(f"spares must be in [0, {self.expected - 1}] (one member at least trains), "
                              f"got {self.spares!r}")
        if not self.seeds:
            raise ConfigError("a bootstrap without a job spec needs at least one seed (--seed HOST:PORT, "
                              "the same list on every agent; several, so that a minority may be dead)")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"the seed list names an address twice: {', '.join(self.seeds)}")

    @property
    def quorum(self) -> int:
        return len(self.seeds) // 2 + 1

    def topology(self) -> JobTopology:
        return JobTopology.ddp(self.expected - self.spares, allow_shrink=self.allow_shrink,
                               min_replicas=self.min_replicas)


def view_zero(value: Iterable[Candidate], params: BootParams) -> View:
    """View 0 of a decided value: trainers ranked in rank order, then the spares."""
    order = sorted(value, key=rank_order)
    trainers = params.expected - params.spares
    members = [ViewMember(c.name, c.addr, TRAINER if i < trainers else SPARE, i if i < trainers else None, c.host)
               for i, c in enumerate(order)]
    return View.initial(members, params.topology())


def choose(known: Iterable[Candidate], params: BootParams) -> tuple[Candidate, ...] | None:
    """The value a proposer proposes: the first ``expected`` candidates, or None while there are too few
    (or too few not started as spares to fill the trainers' places)."""
    order = sorted(known, key=rank_order)
    if len(order) < params.expected or sum(1 for c in order if not c.spare) < params.expected - params.spares:
        return None
    return tuple(order[:params.expected])


class Bootstrap:
    """One agent's part in agreeing on view 0: candidate, proposer and (when asked) acceptor."""

    def __init__(self, params: BootParams, me: Candidate, now: float, rng: RandomSource) -> None:
        self.params = params
        self.me = me
        self.rng = rng
        self.known: dict[str, Candidate] = {me.name: me}
        self.decided: tuple[Candidate, ...] | None = None
        self.decided_at: float | None = None
        self.counters: dict[str, int] = {}
        self.events: list[CoreEvent] = []
        self._out: list[tuple[str, Message, bool]] = []
        # acceptor
        self._promised: Ballot = (0, "")
        self._accepted: tuple[Ballot, tuple[Candidate, ...]] | None = None
        # proposer
        self._ballot: Ballot = (0, me.name)
        self._highest = 0
        self._phase = ""  # "", "prepare", "accept"
        self._promises: dict[str, BootPromise] = {}
        self._accepts: set[str] = set()
        self._value: tuple[Candidate, ...] = ()
        self._round_due = INF
        self._propose_due = INF
        self._hello_due = now
        self._hello_gap = params.hello_interval
        self._progress_due = now + params.progress_interval
        self._mismatched: set[str] = set()
        self._arm_proposal(now)  # a job of one: nothing to wait for

    # ------------------------------------------------------------------ inputs
    def on_message(self, msg: Message, now: float) -> bool:
        """Handle a bootstrap message (False: not one)."""
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            return False
        self.counters["boot_rx"] = self.counters.get("boot_rx", 0) + 1
        handler(self, msg, now)
        return True

    def tick(self, now: float) -> None:
        if self.decided is not None:
            return
        if now >= self._hello_due:
            hello = BootHello(self.me.row(), self.params.expected, self.params.spares, len(self.known))
            for seed in self.params.seeds:
                # streams, not datagrams: a seed may be named by an address it does not advertise, and a
                # datagram is sealed for the receiver's own advertised address
                self._send(seed, hello, True)
            self._hello_due = now + self._hello_gap
            self._hello_gap = min(self._hello_gap * 2, self.params.hello_interval * 8)
        if now >= self._propose_due or now >= self._round_due:
            self._prepare(now)
        if now >= self._progress_due:
            self._progress(now)
            self._progress_due = now + self.params.progress_interval

    def next_deadline(self) -> float:
        if self.decided is not None:
            return INF
        return min(self._hello_due, self._propose_due, self._round_due, self._progress_due)

    def take(self) -> list[tuple[str, Message, bool]]:
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------------ candidates
    def _learn(self, rows: Iterable[Any], now: float) -> None:
        before = len(self.known)
        for row in rows:
            c = Candidate.of(row)
            if c.name not in self.known:
                self.known[c.name] = c
            elif self.known[c.name] != c:
                self.counters["boot_conflicts"] = self.counters.get("boot_conflicts", 0) + 1
        if len(self.known) != before:
            self._hello_gap = self.params.hello_interval  # news: keep the seeds up to date quickly
            self._arm_proposal(now)

    def _arm_proposal(self, now: float) -> None:
        if self.decided is not None or self._phase or self._propose_due != INF:
            return
        value = choose(self.known.values(), self.params)
        if value is None:
            return
        order = sorted(self.known.values(), key=rank_order)
        position = order.index(self.me)
        self._propose_due = now + position * self.params.stagger

    def _progress(self, now: float) -> None:
        names = sorted(self.known)
        self.events.append(BootProgress(len(names), self.params.expected, tuple(names), now))

    # ------------------------------------------------------------------ seed (registrar + acceptor)
    def _on_hello(self, msg: BootHello, now: float) -> None:
        c = Candidate.of(msg.candidate)
        if (msg.expected, msg.spares) != (self.params.expected, self.params.spares):
            if c.name not in self._mismatched:
                self._mismatched.add(c.name)
                self.events.append(BootMismatch(c.name, c.addr, msg.expected, msg.spares, self.params.expected,
                                                self.params.spares, now))
                # our own hello back, so that the candidate sees the mismatch too and says so
                self._send(c.addr, BootHello(self.me.row(), self.params.expected, self.params.spares, 0), True)
            self.counters["boot_mismatch"] = self.counters.get("boot_mismatch", 0) + 1
            return
        self._learn([msg.candidate], now)
        if self.decided is not None:
            self._send(c.addr, BootDecided(_rows(self.decided)), True)
        elif msg.known != len(self.known):
            self._send(c.addr, BootKnown(_rows(self.known.values())), True)

    def _on_known(self, msg: BootKnown, now: float) -> None:
        self._learn(msg.candidates, now)

    def _on_prepare(self, msg: BootPrepare, now: float) -> None:
        ballot = (msg.round, msg.proposer)
        ok = ballot > self._promised
        if ok:
            self._promised = ballot
        (a_round, a_prop), value = self._accepted if self._accepted is not None else ((0, ""), ())
        reply = BootPromise(msg.to, ok, *(ballot if ok else self._promised), a_round, a_prop,
                            _rows(value), _rows(self.known.values()))
        self._send(msg.reply_to, reply, True)

    def _on_accept(self, msg: BootAccept, now: float) -> None:
        ballot = (msg.round, msg.proposer)
        ok = ballot >= self._promised
        if ok:
            value = tuple(Candidate.of(r) for r in msg.value)
            if len(value) != self.params.expected:
                self.counters["boot_bad_value"] = self.counters.get("boot_bad_value", 0) + 1
                return
            self._promised = ballot
            self._accepted = (ballot, value)
            self._learn(msg.value, now)
        self._send(msg.reply_to, BootAccepted(msg.to, ok, *(ballot if ok else self._promised)), True)

    # ------------------------------------------------------------------ proposer
    def _prepare(self, now: float) -> None:
        self._propose_due = INF
        self._highest = max(self._highest, self._ballot[0])
        self._ballot = (self._highest + 1, self.me.name)
        self._phase = "prepare"
        self._promises.clear()
        self._accepts.clear()
        self._round_due = now + self.params.round_timeout * (1.0 + self.rng.random())
        self.counters["boot_rounds"] = self.counters.get("boot_rounds", 0) + 1
        for seed in self.params.seeds:
            self._send(seed, BootPrepare(self._ballot[0], self.me.name, seed, self.me.addr), True)

    def _on_promise(self, msg: BootPromise, now: float) -> None:
        self._learn(msg.known, now)
        self._learn(msg.accepted, now)
        self._highest = max(self._highest, msg.round, msg.accepted_round)
        if self._phase != "prepare" or msg.acceptor not in self.params.seeds:
            return
        if not msg.ok:
            self._beaten(msg, now)
            return
        if (msg.round, msg.proposer) != self._ballot:
            return  # an answer to an earlier round of ours
        self._promises[msg.acceptor] = msg
        if len(self._promises) < self.params.quorum:
            return
        prior = max(self._promises.values(), key=lambda p: (p.accepted_round, p.accepted_proposer))
        if prior.accepted:
            value: tuple[Candidate, ...] | None = tuple(Candidate.of(r) for r in prior.accepted)
        else:
            value = choose(self.known.values(), self.params)
        if value is None:
            self._phase = ""
            self._round_due = INF
            return  # the quorum's candidates are still too few: wait for more hellos
        self._value = value
        self._phase = "accept"
        rows = _rows(value)
        for seed in self.params.seeds:
            self._send(seed, BootAccept(self._ballot[0], self.me.name, seed, self.me.addr, rows), True)

    def _on_accepted(self, msg: BootAccepted, now: float) -> None:
        self._highest = max(self._highest, msg.round)
        if self._phase != "accept" or msg.acceptor not in self.params.seeds:
            return
        if not msg.ok:
            self._beaten(msg, now)
            return
        if (msg.round, msg.proposer) != self._ballot:
            return
        self._accepts.add(msg.acceptor)
        if len(self._accepts) >= self.params.quorum:
            self._decide(self._value, now)
            rows = _rows(self._value)
            for addr in {*self.params.seeds, *(c.addr for c in self.known.values())}:
                self._send(addr, BootDecided(rows), True)

    def _beaten(self, msg: BootPromise | BootAccepted, now: float) -> None:
        """An acceptor holds a higher ballot: let its proposer finish, try again a round later if not."""
        if (msg.round, msg.proposer) > self._ballot:
            self._phase = ""
            self._round_due = now + self.params.round_timeout * (1.0 + self.rng.random())

    def _on_decided(self, msg: BootDecided, now: float) -> None:
        value = tuple(Candidate.of(r) for r in msg.value)
        if len(value) != self.params.expected:
            self.counters["boot_bad_value"] = self.counters.get("boot_bad_value", 0) + 1
            return
        if self.decided is not None:
            if value != self.decided:  # cannot happen with honest seeds: counted, never installed
                self.counters["boot_conflicting_decision"] = self.counters.get("boot_conflicting_decision", 0) + 1
            return
        self._decide(value, now)

    def _decide(self, value: tuple[Candidate, ...], now: float) -> None:
        if self.decided is not None:
            return
        self.decided, self.decided_at = value, now
        self._phase, self._round_due, self._propose_due = "", INF, INF
        self.events.append(ViewZeroAgreed(tuple(c.name for c in sorted(value, key=rank_order)),
                                          any(c.name == self.me.name for c in value), now))

    def _send(self, addr: str, msg: Message, reliable: bool) -> None:
        self._out.append((addr, msg, reliable))


_HANDLERS: dict[type, Callable[[Bootstrap, Any, float], None]] = {
    BootHello: Bootstrap._on_hello, BootKnown: Bootstrap._on_known, BootPrepare: Bootstrap._on_prepare,
    BootPromise: Bootstrap._on_promise, BootAccept: Bootstrap._on_accept, BootAccepted: Bootstrap._on_accepted,
    BootDecided: Bootstrap._on_decided,
}
BOOT_TYPES = frozenset(_HANDLERS)


class Booting:
    """The machine of an agent started without a job spec: a :class:`Bootstrap` until view 0 is decided,
    then the node ``make_node(view, now)`` builds (``view`` None: not in view 0, it joins as a spare),
    which it passes everything on to. Bootstrap messages that still arrive are answered for
    ``linger`` seconds (a late candidate learns the decision) and dropped after."""

    def __init__(self, boot: Bootstrap, make_node: Callable[[View | None, float], Machine],
                 join_seeds: tuple[str, ...], incarnation: int, max_packet: int) -> None:
        self.boot = boot
        self._make_node = make_node
        self._join_seeds = join_seeds
        self._incarnation = incarnation
        self._max_packet = max_packet
        self.node: Machine | None = None
        self._counters: dict[str, int] = {}
        self._pending: list[tuple[str, Any]] = []  # trainer inputs before the node exists
        self._left = False

    # ------------------------------------------------------------------ Machine: state
    @property
    def counters(self) -> dict[str, int]:
        if self.node is None:
            return {**self._counters, **self.boot.counters}
        return self.node.counters

    @property
    def view(self) -> View | None:
        return self.node.view if self.node is not None else None

    @property
    def plan(self) -> Plan | None:
        return self.node.plan if self.node is not None else None

    @property
    def fenced(self) -> str:
        return self.node.fenced if self.node is not None else ""

    @property
    def finished(self) -> int | None:
        return self.node.finished if self.node is not None else None

    @property
    def incarnation(self) -> int:
        return self._incarnation

    @property
    def n_live(self) -> int:
        return self.node.n_live if self.node is not None else len(self.boot.known)

    # ------------------------------------------------------------------ Machine: inputs
    def receive(self, data: bytes, now: float, reliable: bool = False) -> None:
        node = self.node
        if node is not None and (self.boot.decided_at is None
                                 or now > self.boot.decided_at + self.boot.params.linger):
            node.receive(data, now, reliable)
            return
        try:
            msgs = decode_packet(data, self._max_packet)
        except DecodeError:
            if node is not None:
                node.receive(data, now, reliable)  # the node counts it under its reason
            else:
                self._count("boot_rx_malformed")
            return
        if any(type(m) in BOOT_TYPES for m in msgs):
            for m in msgs:
                self.boot.on_message(m, now)
            self._after(now)
        elif node is not None:
            node.receive(data, now, reliable)
        else:
            self._count("boot_rx_early")  # the job's protocol before view 0: nothing to do with it yet

    def tick(self, now: float) -> None:
        self.boot.tick(now)
        self._after(now)
        if self.node is not None:
            self.node.tick(now)

    def join(self, seed_addrs: Iterable[str], now: float) -> None:
        if self.node is not None:
            self.node.join(seed_addrs, now)

    def leave(self, now: float) -> None:
        self._left = True
        if self.node is not None:
            self.node.leave(now)

    def set_progress(self, step: int, phase: int, step_ms: int, now: float, coll: int = 0) -> None:
        self._input("set_progress", (step, phase, step_ms, now, coll))

    def set_state(self, committed_step: int, inflight_step: int | None, state_bytes: int) -> None:
        self._input("set_state", (committed_step, inflight_step, state_bytes))

    def finish(self, step: int, now: float) -> None:
        self._input("finish", (step, now))

    # ------------------------------------------------------------------ Machine: outputs
    def next_deadline(self) -> float:
        d = self.boot.next_deadline()
        return min(d, self.node.next_deadline()) if self.node is not None else d

    def take_sends(self) -> list[Send]:
        out = [Send(addr, encode_packet([msg]), reliable) for addr, msg, reliable in self.boot.take()]
        if self.node is not None:
            out.extend(self.node.take_sends())
        return out

    def take_events(self) -> list[CoreEvent]:
        out, self.boot.events = self.boot.events, []
        if self.node is not None:
            out.extend(self.node.take_events())
        return out

    # ------------------------------------------------------------------ Machine: what it knows
    def has_heard(self, name: str) -> bool:
        return self.node.has_heard(name) if self.node is not None else name in self.boot.known

    def members(self) -> list[MemberInfo]:
        if self.node is not None:
            return self.node.members()
        return [MemberInfo(c.name, c.addr, 0) for c in self.boot.known.values()]

    def progress(self, name: str) -> Any:
        return self.node.progress(name) if self.node is not None else None

    def health(self) -> int:
        return self.node.health() if self.node is not None else 0

    # ------------------------------------------------------------------ inside
    def _after(self, now: float) -> None:
        # messages to ourselves (we may be a seed) go through the network like any other: what a quorum
        # accepted is then always on the wire, where the simulator's checker reads it
        boot = self.boot
        if self.node is None and boot.decided is not None and not self._left:
            me = boot.me.name
            view = view_zero(boot.decided, boot.params) if any(c.name == me for c in boot.decided) else None
            self.node = self._make_node(view, now)
            if view is None:
                self.node.join(self._join_seeds, now)
            for kind, args in self._pending:
                getattr(self.node, kind)(*args)
            self._pending.clear()

    def _input(self, kind: str, args: tuple[Any, ...]) -> None:
        if self.node is not None:
            getattr(self.node, kind)(*args)
        else:
            self._pending = [p for p in self._pending if p[0] != kind] + [(kind, args)]

    def _count(self, key: str) -> None:
        self._counters[key] = self._counters.get(key, 0) + 1
