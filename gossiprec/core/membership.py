"""SWIM membership with the Lifeguard extensions, as a sans-IO state machine.

What it decides: for every known member, whether it is alive, suspect, dead or left, at which
incarnation; and this node's own liveness claims. Inputs, each with the current time ``now``:

- :meth:`Membership.receive` (a datagram or stream message from the network),
- :meth:`Membership.tick` (called at or after :meth:`Membership.next_deadline`),
- :meth:`Membership.join`, :meth:`Membership.leave`, :meth:`Membership.set_progress`,
  :meth:`Membership.set_probe_targets` (from the agent).

Outputs are data: :meth:`take_sends` gives ``Send(addr, payload, reliable)`` to transmit,
:meth:`take_events` gives membership events, :meth:`next_deadline` the time to call :meth:`tick` again.

Protocol (SWIM, Das et al. 2002; Lifeguard, Dadgar et al. 2018):

1. Every ``probe_interval * (health + 1)`` the node pings the next target of a shuffled round robin
   (while no member is in focus, ``probe_batch`` targets every ``probe_batch`` such intervals).
   No ack within ``probe_timeout * (health + 1)``: ``indirect_checks`` helpers ping it for us and answer
   ack or nack. No ack by the end of the indirect window: the target becomes *suspect*, unless this node's
   own health is poor (missing nacks mean our side is the problem), or the timer fired late (we were
   paused): then the node blames itself and raises its health score instead.
2. Suspicion is broadcast. Every member that learns of it runs its own timer, which starts at
   ``suspicion_max`` and shrinks logarithmically towards ``suspicion_min`` with each *independent*
   confirmation (a Suspect from another accuser).
3. When the timer runs out, the member checks for itself (a direct and ``indirect_checks`` indirect
   probes during ``verify_timeout``) before declaring the suspect dead: a process that was paused and has
   just resumed answers, and is not killed by a rumour that its refutation had not yet overtaken.
4. A suspected member refutes by raising its incarnation and broadcasting Alive; the accuser is also told
   directly. Probes of a suspect carry the suspicion (buddy system), so it learns at once.
5. Updates ride on every packet (piggyback) from a transmit-limited queue, plus gossip rounds to
   ``gossip_nodes`` random members while the queue is not empty, plus a periodic push-pull exchange of the
   full state (anti-entropy), whose period grows with N so that the load per node stays flat.
6. Progress: acks carry the acker's training step, phase and step time; pings and acks also carry a few
   progress records of other members, round robin, and push-pull carries them all.
7. Signatures (with the node's :class:`~gossiprec.core.auth.KeyBook`): Alive, Suspect and an observer's Dead
   are their author's signed word (:mod:`~gossiprec.core.auth` says why). Pings, acks and nacks are not: an
   ack or nack counts only as the answer to a probe of ours (its sequence number), and only here. A
   gossiped Progress record (and a push-pull row's progress) is its owner's signed word too, checked
   when it is news (:mod:`~gossiprec.core.progress`): a forged one would mislead the hang rule.

Parts: the member table (:mod:`~gossiprec.core.members`, layered so that a simulated cluster shares one
base), the probe schedule and records (:mod:`~gossiprec.core.probing`), the probe protocol
(:mod:`~gossiprec.core.prober`), one suspicion's timer (:mod:`~gossiprec.core.suspicion`), others'
progress (:mod:`~gossiprec.core.progress`), our own progress and signed words
(:mod:`~gossiprec.core.own_words`), the broadcast queue (:mod:`~gossiprec.core.broadcast`) and push-pull
(:mod:`~gossiprec.core.antientropy`); this class is the protocol between them. Its parts see it through
its port (:class:`~gossiprec.core.member_port.MembershipPort`).
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Iterable, Mapping

from gossiprec.core import antientropy
from gossiprec.core.auth import KeyBook, sign_if
from gossiprec.core.awareness import Awareness
from gossiprec.core.broadcast import BroadcastQueue
from gossiprec.core.config import Config
from gossiprec.core.events import (
    MemberAlive, MemberEvent, MemberFailed, MemberJoined, MemberLeft, MemberSuspected, SelfRefuted,
)
from gossiprec.core.member_port import DIRECT, GOSSIP, INDIRECT_END, PROBE, PUSHPULL, REAP, RELAY_NACK, SUSPICION
from gossiprec.core.members import GONE, MemberTable
from gossiprec.core.own_words import OwnWords
from gossiprec.core.prober import Prober
from gossiprec.core.progress import ProgressBook
from gossiprec.core.records import MemberInfo, ProgressInfo, RandomSource, Send
from gossiprec.core.suspicion import Suspicion
from gossiprec.core.wire import (
    ALIVE, DEAD, LEFT, MAX_ADDR, MAX_INCARNATION, PACKET_OVERHEAD, ROLES, SUSPECT, Ack, Alive, Dead,
    IndirectPing, Message, Nack, Ping, Progress, PushPull, Suspect, decode_packet, encode_message, encode_packet,
    encode_parts,
)
from gossiprec.errors import DecodeError, ProtocolError



class Membership:
    """One node's SWIM/Lifeguard state machine. Not thread-safe; drive it from one task."""

    def __init__(
        self,
        config: Config,
        name: str,
        addr: str,
        *,
        incarnation: int,
        rng: RandomSource,
        now: float,
        role: str = "trainer",
        members: Mapping[str, MemberInfo] | None = None,
        member_order: tuple[str, ...] | None = None,
        members_live: int | None = None,
    ) -> None:
        if role not in ROLES:
            raise ProtocolError(f"role must be one of {ROLES}, got {role!r}")
        if not name or len(name.encode()) > config.max_name:
            raise ProtocolError(f"node name must be 1..{config.max_name} bytes")
        if len(addr.encode()) > MAX_ADDR:
            raise ProtocolError(f"address must be at most {MAX_ADDR} bytes, got {len(addr.encode())}")
        self.config = config
        self.name = name
        self.addr = addr
        self.role = ROLES.index(role)
        self.incarnation = incarnation
        self.rng = rng
        self.awareness = Awareness(config.awareness_max)
        self.left = False
        self._table = table = MemberTable(MemberInfo(name, addr, incarnation, ALIVE, self.role), members,
                                          member_order, members_live)
        self.member = table.member
        self._book = ProgressBook()  # others' progress
        self.words = OwnWords(self, now)
        """Our progress record and key book."""
        # protocol state
        self._queue = BroadcastQueue()
        self._suspicions: dict[str, Suspicion] = {}
        self._token = 0
        self._timers: list[tuple[float, int, int, object]] = []
        self._cancelled: set[int] = set()
        self._alives: dict[str, Alive] = {}  # each member's own signed Alive, latest (push-pull rows carry it)
        self.on_other: Callable[[Message, float], None] | None = None
        """Receives every decoded message that is not SWIM's own (the agreement layer's)."""
        self._limit_n = -1
        self._limit = 1
        self._gossip_armed = False
        self._now = now
        self._sends: list[Send] = []
        self._events: list[MemberEvent] = []
        self.counters: dict[str, int] = {}
        self._grace_until = now + config.startup_grace
        self._heard: set[str] | None = set() if config.startup_grace > 0 else None
        """Members heard from directly or by an Alive of theirs, while the startup grace lasts (else None)."""
        self.prober = Prober(self, now)  # (draws from rng: its place among the draws is fixed)
        known = table.base.get(name)
        if known is None or known.incarnation != incarnation or known.addr != addr:
            self._broadcast(name, self.words.alive())
        self.set_timer(now + (0.5 + rng.random()) * config.pushpull_period(self.n_live), PUSHPULL, None)

    @property
    def auth(self) -> KeyBook | None:
        """Per-member signatures (set by the node; None: nothing signed or checked)."""
        return self.words.book

    @auth.setter
    def auth(self, book: KeyBook | None) -> None:
        self.words.use_book(book)

    # ------------------------------------------------------------------ table access
    member: Callable[[str], MemberInfo | None]
    """The record of a member (None if unknown or forgotten): the table's own lookup, bound once (it runs
    for nearly every message)."""

    @property
    def n_live(self) -> int:
        """Members believed alive or suspect, including this node."""
        return self._table.n_live

    def members(self) -> list[MemberInfo]:
        """Every known member record (sorted by name)."""
        return self._table.records()

    def has_heard(self, name: str) -> bool:
        """Whether this node judges ``name``'s silence: once it heard from that member (or another judged it),
        and for everyone once the startup grace (``Config.startup_grace``) is over."""
        heard = self._heard
        return heard is None or name == self.name or name in heard or self._now >= self._grace_until

    @property
    def n_suspect(self) -> int:
        """Members currently under suspicion (counted in n_live)."""
        return len(self._suspicions)

    def live_members(self) -> list[str]:
        return [m.name for m in self.members() if m.live]

    def progress(self, name: str) -> ProgressInfo | None:
        return self._book.get(name)

    def health(self) -> int:
        return self.awareness.score

    def first_acked(self, name: str) -> int | None:
        """The lowest incarnation at which ``name`` answered one of our probes (None: never, or forgotten)."""
        return self.prober.first_acked.get(name)

    @property
    def table(self) -> MemberTable:
        return self._table

    def cancel_timer(self, token: int) -> None:
        self._cancelled.add(token)

    def emit(self, event: MemberEvent) -> None:
        self._events.append(event)

    def forget_acked(self, name: str) -> None:
        """Forget ``name``'s answers (its old process's place in the view is settled)."""
        self.prober.first_acked.pop(name, None)

    @property
    def my_progress(self) -> Progress:
        """This node's own progress record (see :meth:`set_progress`)."""
        return self.words.progress

    def signed_progress(self) -> Progress:
        """Our progress record as it goes out (see :meth:`OwnWords.signed_progress`)."""
        return self.words.signed_progress()

    @property
    def now(self) -> float:
        """The time of this machine's latest input."""
        return self._now

    def random_peers(self, n: int) -> list[str]:
        """Up to ``n`` random live members other than this one."""
        return self._table.random_live(self.rng, n, self.name, None)

    def signed_alive(self, name: str) -> Alive | None:
        """The latest Alive of ``name`` kept (push-pull rows carry its signature)."""
        return self._alives.get(name)

    def keep_alive(self, alive: Alive) -> None:
        self._alives[alive.name] = alive

    def said(self, name: str) -> Progress | None:
        """``name``'s latest progress as its owner said it (what is relayed)."""
        return self._book.said.get(name)

    def pending(self, key: str) -> Message | None:
        """The broadcast queued under ``key``, if any."""
        return self._queue.pending(key)

    def set_progress_check(self, check: Callable[[Progress], bool] | None) -> None:
        """Whether a gossiped progress record is its owner's own word (see :class:`ProgressBook`)."""
        self._book.vouch = check

    def read_progress_of(self, names: frozenset[str]) -> None:
        """The members whose gossiped progress this node reads (checked as it arrives: see
        :attr:`~gossiprec.core.progress.ProgressBook.read`)."""
        self._book.read = names

    @property
    def progress_since(self) -> float:
        """When this node's own (step, phase) became current (see :meth:`set_progress`)."""
        return self.words.since

    # ------------------------------------------------------------------ outputs
    def take_sends(self) -> list[Send]:
        out = self._sends
        if out:
            self._sends = []
        return out

    def take_events(self) -> list[MemberEvent]:
        out = self._events
        if out:
            self._events = []
        return out

    def next_deadline(self) -> float:
        timers, cancelled = self._timers, self._cancelled
        if cancelled:
            while timers and timers[0][1] in cancelled:
                cancelled.discard(heapq.heappop(timers)[1])
        d = self.prober.next_direct()
        t = timers[0][0] if timers else math.inf
        if d is not None:
            return d if d < t else t  # min(t, d), which returns t on a tie
        return t

    # ------------------------------------------------------------------ inputs from the agent
    def join(self, seed_addrs: Iterable[str], now: float) -> None:
        """Ask seeds for their full state (push-pull with ``join=True``)."""
        self._now = now
        antientropy.join(self, seed_addrs)

    def leave(self, now: float) -> None:
        """Graceful leave: others record LEFT, not a failure. Keep ticking briefly to drain gossip."""
        self._now = now
        self.left = True
        self._table.set(MemberInfo(self.name, self.addr, self.incarnation, LEFT, self.role), now)
        dead = sign_if(self.auth, Dead(self.name, self.incarnation, self.name))
        self._broadcast(self.name, dead)
        # told directly to up to 32 members (everyone in a small job): a leave is the fastest failure
        # signal there is, worth a few unicasts once
        for target in self._table.random_live(self.rng, max(32, self.config.gossip_nodes * 2), self.name, None):
            rec = self.member(target)
            if rec is not None:
                self.send_packet(rec.addr, [dead], piggyback=True, dest=target)

    def set_progress(self, step: int, phase: int, step_ms: int, now: float, coll: int = 0,
                     wait_ms: int = 0) -> None:
        """Our trainer's progress at ``now``, ``coll`` collectives into ``step``, waiting ``wait_ms`` per step
        in its collectives (on acks, with its age, and gossip)."""
        self.words.set_progress(step, phase, step_ms, now, coll, wait_ms)

    def learn(self, name: str, addr: str, role: str, now: float) -> bool:
        """A member of the view this node installed that the table has no record of: known at incarnation 0
        (as a push-pull row nobody could vouch for), so it is counted live and probed, and any word of its
        own outranks the record (an ack to our probe, its Alive). Gossip reaches each member with high
        probability only: a joiner's Alive can miss one, and push-pull would bring it only within
        ``pushpull_period`` (30 s), while that member held an agreed member for unknown (its live count
        one short, the member unreachable in its quorum counts). Returns whether the record is new."""
        if name == self.name or self.member(name) is not None:
            return False
        self._table.set(MemberInfo(name, addr, 0, ALIVE, ROLES.index(role)), now)
        self._count("view_members_learned")
        self._events.append(MemberJoined(name, addr, 0, role, now))
        return True

    def unlearn(self, name: str, now: float) -> bool:
        """A member the view no longer lists that this node knows by hearsay only (incarnation 0: a view's
        or an unvouched push-pull row's word, never its own; an ack or its Alive would have raised it):
        forgotten with its place in the view, which no probe of ours may otherwise ever correct (a
        joiner that learned a dead member from a view that still listed it would count it live for good).
        A member that spoke for itself is left to SWIM. Returns whether it was forgotten."""
        rec = self.member(name)
        if rec is None or name == self.name or rec.incarnation != 0 or not rec.live:
            return False
        self._table.set(MemberInfo(name, rec.addr, 0, DEAD, rec.role), now)
        self._table.forget(name, 0)
        self._suspicions.pop(name, None)
        self._count("view_members_unlearned")
        return True

    def set_probe_targets(self, names: Iterable[str] | None) -> None:
        """Restrict probing to ``names`` (the agreement overlay's subjects), or None for everyone."""
        self.prober.schedule.set_targets(None if names is None else tuple(sorted(set(names) - {self.name})))

    # ------------------------------------------------------------------ network input
    def receive(self, data: bytes, now: float, reliable: bool = False) -> None:
        limit = self.config.max_stream if reliable else self.config.mtu
        try:
            msgs = decode_packet(data, limit)
        except DecodeError as exc:
            self._count("rx_dropped_" + exc.reason)
            return
        self._now = now
        if self.left:
            return
        handlers = _HANDLERS
        on_other = self.on_other
        heard, me = self._book.heard, self.name
        for msg in msgs:
            # handle(), inlined: Suspect/Dead/Alive rumours arrive in bulk, and progress records (a few ride
            # on every ping and ack) go to the book without a call of their own
            t = type(msg)
            if t is Progress:
                if msg.name != me:  # type: ignore[attr-defined]
                    heard(msg, now, False, 0)  # type: ignore[arg-type]
                continue
            h = handlers.get(t)
            if h is not None:
                h(self, msg, now)
            elif on_other is not None:
                on_other(msg, now)
            else:
                self._count("rx_unexpected")

    def handle(self, msg: Message, now: float) -> None:
        """Process one decoded message: SWIM's own by the table of handlers, any other by ``on_other``."""
        h = _HANDLERS.get(type(msg))
        if h is not None:
            h(self, msg, now)
        elif self.on_other is not None:
            self.on_other(msg, now)
        else:
            self._count("rx_unexpected")

    # ------------------------------------------------------------------ timers
    def set_timer(self, when: float, kind: int, arg: object) -> int:
        self._token += 1
        heapq.heappush(self._timers, (when, self._token, kind, arg))
        return self._token

    def _broadcast(self, key: str, msg: Message, merge: bool = False) -> None:
        """Queue a broadcast; gossip rounds run only while something is queued."""
        self._queue.queue(key, msg, merge)
        if not self._gossip_armed:
            self._gossip_armed = True
            self.set_timer(self._now + self.rng.random() * self.config.gossip_interval, GOSSIP, None)

    def tick(self, now: float) -> None:
        """Run every timer whose deadline is at or before ``now``."""
        self._now = now
        self.prober.tick(now, self.left)
        timers, cancelled = self._timers, self._cancelled
        while timers and timers[0][0] <= now:
            when, token, kind, arg = heapq.heappop(timers)
            if token in cancelled:
                cancelled.discard(token)
                continue
            late = now - when > self.config.starve_slack
            if late:
                self._count("timers_late")
            if self.left and kind not in (GOSSIP,):
                continue
            if kind == PROBE:
                self.prober.start_round(now, late)
            elif kind == DIRECT:
                self.prober.direct_timeout(arg, now, late)  # type: ignore[arg-type]
            elif kind == INDIRECT_END:
                self.prober.probe_end(arg, now, late)  # type: ignore[arg-type]
            elif kind == GOSSIP:
                self._gossip(now)
            elif kind == PUSHPULL:
                self.set_timer(now + self.config.pushpull_period(self.n_live), PUSHPULL, None)
                antientropy.pushpull_round(self)
            elif kind == SUSPICION:
                self._suspicion_timer(arg, now, late)  # type: ignore[arg-type]
            elif kind == RELAY_NACK:
                self.prober.relay_nack(arg)  # type: ignore[arg-type]
            elif kind == REAP:
                self._reap(arg, now)  # type: ignore[arg-type]

    def set_focus(self, names: Iterable[str], turns: Iterable[str] = (), now: float | None = None) -> None:
        """Members probed every round in addition to the round robin (``names``: subjects that may have
        failed), and members probed one per round in turn (``turns``: e.g. to refresh their progress).
        A first member in focus brings the next round forward to ``probe_interval`` after the last one
        (rounds are ``probe_batch`` intervals apart only while nothing is in focus). ``now``: the time of
        the caller's input (default: this machine's latest)."""
        if now is not None and now > self._now:
            self._now = now
        self.prober.set_focus(names, turns, self._now)

    def broadcast(self, key: str, msg: Message, now: float, merge: bool = False) -> None:
        """Disseminate ``msg`` (piggyback + gossip); a later broadcast with the same key replaces it
        (``merge``: keeping its transmit count, see :meth:`BroadcastQueue.queue`)."""
        self._now = now
        self._broadcast(key, msg, merge)

    def send_to(self, name: str, msg: Message, now: float, extra: tuple[Message, ...] = ()) -> bool:
        """Send ``msg`` (and ``extra`` messages, plus piggyback) to a known member in one packet; False
        if its address is unknown."""
        rec = self.member(name)
        if rec is None:
            return False
        self._now = now
        self.send_packet(rec.addr, [msg, *extra], piggyback=True, dest=name)
        return True

    def send_addr(self, addr: str, msg: Message, reliable: bool = False, before: tuple[Message, ...] = (),
                  progress: bool = False) -> None:
        """``msg`` to ``addr``: on the stream (``reliable``, after ``before``), or in a datagram with queued
        news, and with progress records where ``progress`` (a hello: it goes to our observers, who read them)."""
        if reliable:
            self._sends.append(Send(addr, encode_packet([*before, msg]), True))
        else:
            self.send_packet(addr, [msg], piggyback=True, progress=progress)

    def unproven(self, target: str, now: float) -> bool:
        """True while the startup grace lasts for a member never heard from: its silence is not judged."""
        if self._heard is not None and now >= self._grace_until:
            self._heard = None  # grace over: every silence counts from now on
        return not self.has_heard(target)

    def heard_from(self, name: str) -> None:
        if self._heard is not None:
            self._heard.add(name)

    # ------------------------------------------------------------------ dissemination of state
    def on_alive(self, msg: Alive, now: float, proven: bool = False) -> None:
        auth = None if proven else self.words.book  # proven: from an ack to our probe (taken unsigned, not relayed)
        if msg.name == self.name:
            if msg.incarnation > self.incarnation and not self.left:
                if auth is not None and not auth.check(msg.name, msg):
                    return self._count("rx_alive_unsigned")  # another's word for our incarnation: nothing
                self._refute(msg.incarnation, "alive-conflict", now)
            return
        if self._heard is not None:
            self._heard.add(msg.name)
        table = self._table
        cur = table.own.get(msg.name)  # member(), inlined
        if cur is None:
            cur = table.base.get(msg.name)
        elif cur is GONE:
            cur = None
        if cur is not None and msg.incarnation <= cur.incarnation:
            if auth is not None and msg.sig and msg.incarnation == cur.incarnation:
                antientropy.keep_signed(self, msg, cur)  # one we hold unsigned (view 0's, an ack's): to relay
            return
        if auth is not None and not auth.vouched(msg.name, msg):
            return self._count("rx_alive_unsigned")
        self._alives[msg.name] = msg
        rec = MemberInfo(msg.name, msg.addr, msg.incarnation, ALIVE, msg.role)
        self._table.set(rec, now)
        self._suspicions.pop(msg.name, None)
        if auth is not None or self.words.book is None:
            self._broadcast(msg.name, msg)
        if cur is None or cur.status >= DEAD:
            self._events.append(MemberJoined(msg.name, msg.addr, msg.incarnation, ROLES[msg.role], now))
        elif cur.status == SUSPECT:
            self._events.append(MemberAlive(msg.name, msg.incarnation, now))

    def on_suspect(self, msg: Suspect, now: float) -> None:
        if msg.name == self.name:
            if not self.left and msg.incarnation >= self.incarnation and not self._refused(msg):
                self._refute(msg.incarnation, msg.src, now)  # (older rumours: already refuted)
            return
        if self._heard is not None and msg.src != self.name:
            # another member, which judges only members it heard from (or after its own grace), found it
            # silent: it was up, so its silence counts here too
            self._heard.add(msg.name)
        # member() and MemberInfo.live, inlined: most Suspects are repeats of news already known
        table = self._table
        cur = table.own.get(msg.name)
        if cur is None:
            cur = table.base.get(msg.name)
        if cur is None or cur.status > SUSPECT or msg.incarnation < cur.incarnation:
            return  # unknown, or dead/left (the forgotten marker GONE is DEAD), or older news
        susp = self._suspicions.get(msg.name)
        if cur.status == SUSPECT and susp is not None and msg.incarnation == cur.incarnation:
            if msg.src in susp.accusers or len(susp.accusers) > susp.k or self._refused(msg):
                return
            susp.accusers.add(msg.src)
            self._broadcast(msg.name, msg)
            if not susp.verifying:
                self._arm(msg.name, susp)
            return
        if self._refused(msg):
            return
        susp = Suspicion.begin(self.config, table.n_live, msg.incarnation, now, msg.src)
        self._suspicions[msg.name] = susp
        self._table.set(MemberInfo(cur.name, cur.addr, msg.incarnation, SUSPECT, cur.role), now)
        self._broadcast(msg.name, msg)
        self._events.append(MemberSuspected(msg.name, msg.incarnation, msg.src, now))
        self._arm(msg.name, susp)

    def _arm(self, name: str, susp: Suspicion) -> None:
        self._token += 1
        susp.token = self._token
        heapq.heappush(self._timers, (susp.deadline(), self._token, SUSPICION, (name, self._token)))

    def _suspicion_timer(self, arg: tuple[str, int], now: float, late: bool) -> None:
        name, token = arg
        susp = self._suspicions.get(name)
        if susp is None or susp.token != token or susp.verifying:
            return
        rec = self.member(name)
        if rec is None or rec.status != SUSPECT or rec.incarnation != susp.incarnation:
            return
        if late:
            # We slept through the refutation window: give the network time to tell us.
            self.awareness.apply(+2)
            self.rearm_suspicion(name, now)
            return
        if susp.defer(self.config, self.name):
            self._arm(name, susp)
            return
        if self.config.verify_timeout > 0:
            susp.verifying = True
            self.prober.probe(name, now, verify=True)
        else:
            self.declare_dead(name, rec.incarnation, now)

    def rearm_suspicion(self, name: str, now: float) -> None:
        susp = self._suspicions.get(name)
        if susp is None:
            return
        susp.restart(now)
        self._arm(name, susp)

    def declare_dead(self, name: str, incarnation: int, now: float) -> None:
        self.on_dead(sign_if(self.words.book, Dead(name, incarnation, self.name)), now)

    def _refused(self, msg: Suspect | Dead) -> bool:
        auth = self.words.book  # signed: the accuser's own word (see KeyBook.accusation)
        return auth is not None and not auth.accusation(msg, msg.src)

    def on_dead(self, msg: Dead, now: float) -> None:
        if msg.name == self.name:
            if not self.left and msg.incarnation >= self.incarnation and not self._refused(msg):
                self._refute(msg.incarnation, msg.src, now)
            return
        if self._heard is not None and msg.src != self.name:
            self._heard.add(msg.name)  # as in on_suspect: another member judged it
        table = self._table
        cur = table.own.get(msg.name)  # member() and MemberInfo.live, inlined as in on_suspect
        if cur is None:
            cur = table.base.get(msg.name)
        if cur is None or cur.status > SUSPECT or msg.incarnation < cur.incarnation:
            return
        leaving = msg.src == msg.name
        if leaving and self.words.book is not None and not self.words.book.check(msg.name, msg):
            return self._count("rx_leave_unsigned")  # a departure is the member's own signed word or nothing
        if not leaving and self._refused(msg):
            return
        table.set(MemberInfo(cur.name, cur.addr, msg.incarnation, LEFT if leaving else DEAD, cur.role), now)
        self._suspicions.pop(msg.name, None)
        self._broadcast(msg.name, msg)
        if leaving:
            self._events.append(MemberLeft(msg.name, msg.incarnation, now))
        else:
            self._events.append(MemberFailed(msg.name, msg.incarnation, msg.src, now))
        self.set_timer(now + self.config.dead_reap, REAP, (msg.name, msg.incarnation))

    def _reap(self, arg: tuple[str, int], now: float) -> None:
        name, inc = arg
        if self._table.forget(name, inc):
            self._book.forget(name)
            self._alives.pop(name, None)
            self.prober.first_acked.pop(name, None)

    def _refute(self, accused_inc: int, accuser: str, now: float) -> None:
        if accused_inc >= MAX_INCARNATION:
            self._count("rx_incarnation_exhausted")
            return
        self.incarnation = max(self.incarnation, accused_inc) + 1
        self._table.set(MemberInfo(self.name, self.addr, self.incarnation, ALIVE, self.role), now)
        self.words.renew()
        alive = self.words.alive()
        self._broadcast(self.name, alive)
        self.awareness.apply(+1)
        self._events.append(SelfRefuted(self.incarnation, accuser, now))
        acc = self.member(accuser)
        if acc is not None and acc.name != self.name:
            self.send_packet(acc.addr, [alive], piggyback=True, dest=acc.name)

    def on_progress(self, msg: Progress, now: float, direct: bool = False, stall_ms: int = 0) -> None:
        if msg.name != self.name:
            self._book.heard(msg, now, direct, stall_ms)

    # ------------------------------------------------------------------ gossip and anti-entropy
    def _gossip(self, now: float) -> None:
        cfg = self.config
        if not len(self._queue):
            self._gossip_armed = False
            return
        self.set_timer(now + cfg.gossip_interval, GOSSIP, None)
        targets = self._table.random_live(self.rng, cfg.gossip_nodes, self.name, None)
        # Recently dead members still hear gossip, so a falsely declared node learns and refutes.
        changed_at = self._table.changed_at
        if changed_at and self.rng.random() < 0.5:
            for name, at in list(changed_at.items())[-4:]:
                rec = self.member(name)
                if rec is not None and rec.status == DEAD and now - at < cfg.gossip_to_dead:
                    targets.append(name)
                    break
        queue = self._queue
        for target in targets:
            rec = self.member(target)
            if rec is None:
                continue
            parts = self._take_news(cfg.mtu - PACKET_OVERHEAD, target)
            if not parts:
                if not len(queue):
                    break
                continue  # only news about this target itself was left
            self._sends.append(Send(rec.addr, encode_parts(parts)))

    # ------------------------------------------------------------------ sending
    def send_packet(self, addr: str, msgs: list[Message], piggyback: bool, dest: str | None = None,
                    progress: bool = True) -> None:
        parts = [encode_message(msgs[0])] if len(msgs) == 1 else [encode_message(m) for m in msgs]
        if piggyback:
            book, mine = self._book, self.words.progress
            # progress rides SWIM's packets, the agreement's (without it there, recoveries at N = 16 came
            # later: the hang check then probes for fresher records) and hellos to our observers (who read
            # them); not what goes by address alone (view and join requests, a new process's every 0.5 s)
            if progress and (book.names or mine.version):  # ours, then others' in turn
                if mine.version > 0:
                    parts.append(encode_message(self.words.signed_progress()))
                parts.extend(encode_message(m) for m in book.take_turns(self.config.progress_piggyback))
            if len(self._queue):
                budget = self.config.mtu - PACKET_OVERHEAD - sum(len(p) for p in parts)
                parts.extend(self._take_news(budget, dest))
        self._sends.append(Send(addr, encode_parts(parts)))

    def _take_news(self, budget: int, dest: str | None) -> list[bytes]:
        """Queued broadcasts for a packet to member ``dest``. An Alive about ``dest`` itself is left for
        the others: it tells ``dest`` nothing and would spend one of the few transmissions (3 in a
        cluster of 4) that must reach them. Suspect and Dead about it still go (it refutes them)."""
        queue = self._queue
        skip = dest if dest is not None and isinstance(queue.pending(dest), Alive) else None
        return queue.take(budget, self._retransmit_limit(), skip)

    def _retransmit_limit(self) -> int:
        n = self._table.n_live
        if n != self._limit_n:
            self._limit_n, self._limit = n, self.config.retransmit_limit(n)
        return self._limit

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1


_HANDLERS: dict[type, Callable[[Membership, Any, float], None]] = {
    Ping: lambda m, msg, now: m.prober.on_ping(msg, now), Ack: lambda m, msg, now: m.prober.on_ack(msg, now),
    Alive: Membership.on_alive, Suspect: Membership.on_suspect, Dead: Membership.on_dead,
    Progress: Membership.on_progress, IndirectPing: lambda m, msg, now: m.prober.on_indirect(msg, now),
    Nack: lambda m, msg, now: m.prober.on_nack(msg, now), PushPull: antientropy.on_pushpull,
}
"""SWIM's message handlers (:meth:`Membership.handle`), by message type."""
