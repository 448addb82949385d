"""View 0 without a job spec: the agents find each other through seeds and agree on the first view.

Every agent starts as a *candidate*: its name, address, host, local index on the host (by default its
port) and whether it was started as a spare. It says hello to every seed (the same ``--seed`` list on
every agent) until it knows the job's ``expected`` candidates; a seed answers with the candidates it
knows that the asker has not had from it yet (its list in the order it learnt them, from the count the
hello reports on), so that an agent asking again while others arrive gets only the new rows. View 0 is
then decided by single-decree Paxos whose acceptors are the seeds: any candidate that knows enough
candidates proposes (signing, any seed: see below), the first in rank order at once and the others
``stagger`` seconds apart after it, so that a dead first candidate costs one stagger and two live ones
rarely duel. A value is decided when a majority of the seeds accepted it at one ballot; Paxos then
guarantees that no other value of view 0 is ever decided, whatever the timing, the losses or the late
candidates. A proposer that hears of an accepted value re-proposes it, so a proposer that died after the
decision loses nothing.

The value is the first ``expected`` candidates in rank order: by host (numbers in host names compared
as numbers, so ``node2`` comes before ``node10``), then local index, then name; candidates started as
spares after all others. The first ``expected - spares`` are trainers with ranks 0, 1, ... in that
order, the rest hot spares. Candidates beyond ``expected`` (late or extra) are not in view 0: they join
the running job as spares, like any joiner. Too few candidates: nothing is decided; :class:`BootProgress`
events say who is known, and the agent gives up after its timeout with that list. View 0's topology is
plain DDP over the trainers, or the replica groups of the launched mesh (``--mesh``, :attr:`BootParams.mesh`).
Every agent must be started for the same job: a hello says its size, spares and the mesh's replica group
count (the replicate dimension comes first, so the count fixes the groups), and a candidate started
otherwise is not counted (:class:`~gossiprec.core.events.BootMismatch`).

Signatures (with a :class:`~gossiprec.core.auth.KeyBook`; without one nothing is signed or checked, and
any candidate proposes). A candidate row carries the candidate's public key and its own signature of the
row, so a row is its owner's word however it is relayed (hellos, a seed's answers, promises, the value);
each receiver binds the name to the first key it sees for it and refuses, and counts
(``rx_boot_key_conflict``, ``rx_boot_unsigned``), a row or hello under that name with another key. With
pinned keys only the names they pin take part (``rx_boot_unpinned``). Seeds are named by address, often
one they do not advertise (a host name), so a receiver binds each seed address to the name whose signed
answer first claims it (one name per address, one address per name): a hello says which seed address it
was sent to, and reports 0 rows had from that seed until it is bound, so that the seed answers with its
whole list. Promises and accepteds are signed by the seed and count only under its bound name; an
accepted signs the digest of the value it accepted. Only seeds propose, and a seed takes a prepare or an
accept only from a seed, signed by it, and sent to its own seed address (``rx_boot_not_seed``): each
ballot then has one value, put there after phase 1, as Paxos needs; a candidate of a key holder's own
cannot skip phase 1. A candidate learns it is a seed, and which, from its own signed answer to its own
hello. ``BootDecided`` decides nothing alone: it carries the majority's signed accepteds (its proof), and
each receiver checks them against its own bindings, so a late candidate that takes part in no round
learns view 0 safely. View 0's members keep their keys: the node built from it starts with them bound.

Safety needs only that a majority of the seeds keep their promises for the bootstrap's duration (an
acceptor restarted during the bootstrap forgets them; signing, it has a new key, and receivers that
bound the old one refuse its words). Liveness needs a majority of the seeds up: give several (e.g. the
first agent of three hosts); any minority of them may be dead at the start. Trust on first use, without
pins: a holder of the cluster key that speaks first at a receiver, under a candidate's name or as a
seed address (before that candidate's row or that seed's first signed answer reaches it; a dead seed's
address stays open), is bound there, and a seed address so claimed is a proposer and acceptor that may
lie, which Paxos does not tolerate.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable

import msgpack

from gossiprec.core.auth import KeyBook, sign_if
from gossiprec.core.events import BootMismatch, BootProgress, ViewZeroAgreed
from gossiprec.core.mesh import MeshShape
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
ANSWERS_KEPT = 4
"""Signed answers to hellos a seed keeps for reuse (by seed address and range of its list), in rows: this
many times its list, so that the cache holds a few lists' worth whatever the job's size."""
Ballot = tuple[int, str]
_pack: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True).pack  # (msgpack has no type hints)


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
    key: bytes = b""
    """Its public signing key (empty: unsigned)."""
    sig: bytes = b""
    """Its own signature of the fields above (:meth:`signed_part`)."""

    def row(self) -> tuple[Any, ...]:
        return (self.name, self.addr, self.host, self.local, self.spare, self.key, self.sig)

    @classmethod
    def of(cls, row: tuple[Any, ...] | list[Any]) -> Candidate:
        return cls(str(row[0]), str(row[1]), str(row[2]), int(row[3]), bool(row[4]), bytes(row[5]), bytes(row[6]))

    def signed_part(self) -> bytes:
        """What the candidate's own signature covers (tagged: no other signed message reads the same)."""
        return _pack(["gossiprec.candidate/1", self.name, self.addr, self.host, self.local, self.spare,
                      self.key])

    def signed_by(self, book: KeyBook) -> Candidate:
        c = replace(self, key=book.crypto.public_key, sig=b"")
        return replace(c, sig=book.crypto.sign(c.signed_part()))


def value_digest(value: Iterable[Candidate]) -> bytes:
    """16-byte id of a value of view 0 (what an acceptor's signed accepted is for)."""
    return hashlib.sha256(_pack(["gossiprec.view0/1", _rows(value)])).digest()[:16]


def boot_keys(value: Iterable[Candidate]) -> dict[str, bytes]:
    """The signing keys of a decided view 0's members (none where it was decided unsigned)."""
    return {c.name: c.key for c in value if c.key}


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
    mesh: MeshShape | None = None
    """The launched device mesh (``--mesh``; its sizes multiply to the trainers), whose replica groups
    are view 0's topology (:meth:`~gossiprec.core.mesh.MeshShape.topology`); None: plain DDP."""
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
        if self.mesh is not None and self.mesh.world_size != self.expected - self.spares:
            raise ConfigError(f"--mesh {self.mesh.text} makes {self.mesh.world_size} ranks but the job has "
                              f"{self.expected - self.spares} trainers ({self.expected} members, {self.spares} "
                              "spares): the sizes must multiply to the trainer count")

    @property
    def quorum(self) -> int:
        return len(self.seeds) // 2 + 1

    def topology(self) -> JobTopology:
        """View 0's topology: the mesh's replica groups (:attr:`mesh`), else plain DDP over the trainers."""
        if self.mesh is not None:
            return self.mesh.topology(allow_shrink=self.allow_shrink, min_replicas=self.min_replicas)
        return JobTopology.ddp(self.expected - self.spares, allow_shrink=self.allow_shrink,
                               min_replicas=self.min_replicas)

    @property
    def shards(self) -> int:
        """The replica groups of view 0 (what a hello says of the mesh: 1 for plain DDP)."""
        return len(self.topology().replica_groups)


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
    """One agent's part in agreeing on view 0: candidate, proposer and (when asked) acceptor. ``book``:
    its key book (None: nothing signed or checked)."""

    def __init__(self, params: BootParams, me: Candidate, now: float, rng: RandomSource,
                 book: KeyBook | None = None) -> None:
        self.params = params
        self.rng = rng
        self.counters: dict[str, int] = {}
        self.book = book
        if book is not None:
            book.counters = self.counters
            me = me.signed_by(book)
        self.me = me
        self.known: dict[str, Candidate] = {me.name: me}
        self._cursor: dict[str, int] = {}
        """Seed address -> how many rows of that seed's list this agent has had from it, in its order."""
        self.decided: tuple[Candidate, ...] | None = None
        self.decided_at: float | None = None
        self.decision: BootDecided | None = None
        """What a late candidate is answered: the value and, signing, its proof."""
        self.seed_of: dict[str, str] = {}
        """Seed address -> the candidate name whose signed word first claimed it here."""
        self.answered: set[str] = set()
        """Seed addresses whose (checked) answer reached this agent: what :mod:`gossiprec.core.bootwords` tells."""
        self.events: list[CoreEvent] = []
        self._out: list[tuple[str, Message, bool]] = []
        # acceptor
        self._promised: Ballot = (0, "")
        self._accepted: tuple[Ballot, tuple[Candidate, ...]] | None = None
        self._answers: dict[tuple[str, int, int], BootKnown] = {}  # signed answers, by (seed address, start, end)
        self._answer_rows = 0  # rows held in _answers
        # proposer
        self._ballot: Ballot = (0, me.name)
        self._highest = 0
        self._phase = ""  # "", "prepare", "accept"
        self._promises: dict[str, BootPromise] = {}
        self._accepts: dict[str, tuple[Any, ...]] = {}  # seed address -> its proof entry
        self._value: tuple[Candidate, ...] = ()
        self._digest = b""
        self._round_due = INF
        self._propose_due = INF
        self._hello_due = now
        self._hello_gap = params.hello_interval
        self._hellos: dict[str, BootHello] = {}
        self._progress_due = now + params.progress_interval
        self._mismatched: set[str] = set()
        self._shards = params.shards
        self._arm_proposal(now)  # a job of one: nothing to wait for

    # ------------------------------------------------------------------ inputs
    def on_message(self, msg: Message, now: float) -> bool:
        """Handle a bootstrap message (False: not one)."""
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            return False
        self._count("boot_rx")
        handler(self, msg, now)
        return True

    def tick(self, now: float) -> None:
        if self.decided is not None:
            return
        if now >= self._hello_due:
            for seed in self.params.seeds:
                # what we have of the seed's list (0 until its first checked answer): it answers the rest
                n = self._cursor.get(seed, 0)
                hello = self._hellos.get(seed)
                if hello is None or hello.known != n:
                    hello = sign_if(self.book, BootHello(self.me.row(), self.params.expected, self.params.spares,
                                                         n, seed, self._shards))
                    self._hellos[seed] = hello
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

    # ------------------------------------------------------------------ signatures
    def _admit(self, row: Any) -> Candidate | None:
        """A candidate row, if it is its owner's signed word under the key bound to its name (bound here
        if it was not); None, counted, if not."""
        c = Candidate.of(row)
        book = self.book
        if book is None or self.known.get(c.name) == c:  # the same row: checked when it was first seen
            return c
        if not c.key or not c.sig:
            self._count("rx_boot_unsigned")
            return None
        if book.pinned and c.name not in book.pinned:
            self._count("rx_boot_unpinned")  # with pins, only the agents they name take part
            return None
        bound = book.key_of(c.name)
        if bound is not None and bound != c.key:
            self._count("rx_boot_key_conflict")
            return None
        if not book.crypto.verify(c.key, c.signed_part(), c.sig):
            self._count("rx_boot_sig_invalid")
            return None
        book.bind(c.name, c.key)
        return c

    def _value_of(self, rows: Iterable[Any]) -> tuple[Candidate, ...] | None:
        """A value of view 0: ``expected`` distinct candidates, each row its owner's signed word."""
        value = tuple(self._admit(r) for r in rows)
        if (len(value) != self.params.expected or any(c is None for c in value)
                or len({c.name for c in value if c is not None}) != len(value)):
            self._count("boot_bad_value")
            return None
        return value  # type: ignore[return-value]

    def _signed(self, author: str, msg: Message) -> bool:
        if self.book is None:
            return True
        if not author or not msg.sig:  # type: ignore[attr-defined]
            self._count("rx_boot_unsigned")
            return False
        return self.book.check(author, msg)

    def _seed(self, seed: str, signer: str, msg: Message) -> bool:
        """Whether ``msg`` is the signed word of the seed at address ``seed``: by ``signer``, the name bound
        to that address (bound on first use; a name stands for one seed only)."""
        if seed not in self.params.seeds or not self._signed(signer, msg):
            return False
        if self.book is None:
            return True
        have = self.seed_of.get(seed)
        if have == signer:
            return True
        if have is not None or signer in self.seed_of.values():
            self._count("rx_boot_key_conflict")
            return False
        self.seed_of[seed] = signer
        return True

    # ------------------------------------------------------------------ candidates
    def _learn(self, rows: Iterable[Any], now: float) -> None:
        self._add([c for c in map(self._admit, rows) if c is not None], now)

    def _add(self, cands: Iterable[Candidate], now: float) -> None:
        before = len(self.known)
        for c in cands:
            if c.name not in self.known:
                self.known[c.name] = c  # (only ever added: its order is the order of a seed's answers)
            elif self.known[c.name] != c:
                self._count("boot_conflicts")
        if len(self.known) != before:
            self._hello_gap = self.params.hello_interval  # news: keep the seeds up to date quickly
            self._arm_proposal(now)

    def _proposers(self) -> set[str] | None:
        """Signing, the names that may propose: the seeds, as bound here (None: unsigned, any candidate)."""
        return set(self.seed_of.values()) if self.book is not None else None

    def _arm_proposal(self, now: float) -> None:
        if self.decided is not None or self._phase or self._propose_due != INF:
            return
        proposers = self._proposers()
        if proposers is not None and self.me.name not in proposers:
            return  # not a seed (or not known to be one yet: our own signed answer to our hello says so)
        value = choose(self.known.values(), self.params)
        if value is None:
            return
        order = sorted((c for c in self.known.values() if proposers is None or c.name in proposers), key=rank_order)
        position = order.index(self.me)
        self._propose_due = now + position * self.params.stagger

    def _progress(self, now: float) -> None:
        names = sorted(self.known)
        self.events.append(BootProgress(len(names), self.params.expected, tuple(names), now))

    # ------------------------------------------------------------------ seed (registrar + acceptor)
    def _on_hello(self, msg: BootHello, now: float) -> None:
        c = self._admit(msg.candidate)
        if c is None or not self._signed(c.name, msg):
            return
        if (msg.expected, msg.spares, msg.shards) != (self.params.expected, self.params.spares, self._shards):
            if c.name not in self._mismatched:
                self._mismatched.add(c.name)
                self.events.append(BootMismatch(c.name, c.addr, msg.expected, msg.spares, self.params.expected,
                                                self.params.spares, now, msg.shards, self._shards))
                # our own hello back, so that the candidate sees the mismatch too and says so
                self._send(c.addr, sign_if(self.book, BootHello(self.me.row(), self.params.expected,
                                                                self.params.spares, 0, c.addr, self._shards)), True)
            self._count("boot_mismatch")
            return
        self._add([c], now)
        if self.decision is not None:
            self._send(c.addr, self.decision, True)
        elif msg.known != len(self.known):
            # the rows of our list from the asker's count on (all of them if it counts more than we hold:
            # a list of another life of this address); each answer is signed once and reused
            seed = msg.to if msg.to in self.params.seeds else ""
            start, end = (msg.known if msg.known < len(self.known) else 0), len(self.known)
            answer = self._answers.get((seed, start, end))
            if answer is None:
                if self._answer_rows + end - start > ANSWERS_KEPT * end:
                    self._answers, self._answer_rows = {}, 0
                self._answer_rows += end - start
                answer = sign_if(self.book, BootKnown(seed, self.me.name, _rows(list(self.known.values())[start:]),
                                                      start))
                self._answers[(seed, start, end)] = answer
            self._send(c.addr, answer, True)

    def _on_known(self, msg: BootKnown, now: float) -> None:
        self._learn(msg.candidates, now)  # each row its owner's word, whoever relays it
        if self._seed(msg.seed, msg.signer, msg):  # binds the seed's address here (its first signed answer)
            self.answered.add(msg.seed)
            have = self._cursor.get(msg.seed, 0)
            if msg.start <= have:  # contiguous with what we had (an answer lost or late leaves a gap: asked again)
                self._cursor[msg.seed] = max(have, msg.start + len(msg.candidates))
            self._arm_proposal(now)  # we may have learnt that we are a seed

    def _from_proposer(self, msg: BootPrepare | BootAccept) -> bool:
        """Signing, a prepare or accept counts only from a seed, signed by it: a candidate of the forger's
        own would otherwise skip phase 1 and get a value of its choosing accepted."""
        proposers = self._proposers()
        if proposers is None:
            return True
        if msg.proposer not in proposers or self.seed_of.get(msg.to) != self.me.name:
            self._count("rx_boot_not_seed")  # from a non-seed, or to a seed address that is not ours
            return False
        return self._signed(msg.proposer, msg)

    def _on_prepare(self, msg: BootPrepare, now: float) -> None:
        if not self._from_proposer(msg):
            return
        ballot = (msg.round, msg.proposer)
        ok = ballot > self._promised
        if ok:
            self._promised = ballot
        (a_round, a_prop), value = self._accepted if self._accepted is not None else ((0, ""), ())
        reply = BootPromise(msg.to, ok, *(ballot if ok else self._promised), a_round, a_prop,
                            _rows(value), _rows(self.known.values()), self.me.name)
        self._send(msg.reply_to, sign_if(self.book, reply), True)

    def _on_accept(self, msg: BootAccept, now: float) -> None:
        if not self._from_proposer(msg):
            return
        ballot = (msg.round, msg.proposer)
        ok = ballot >= self._promised
        digest = b""
        if ok:
            value = self._value_of(msg.value)
            if value is None:
                return
            if self._accepted is not None and self._accepted[0] == ballot and self._accepted[1] != value:
                self._count("boot_bad_value")  # one value per ballot, whatever its proposer says
                return
            self._promised = ballot
            self._accepted = (ballot, value)
            digest = value_digest(value)
            self._add(value, now)
        reply = BootAccepted(msg.to, ok, *(ballot if ok else self._promised), digest, self.me.name)
        self._send(msg.reply_to, sign_if(self.book, reply), True)

    # ------------------------------------------------------------------ proposer
    def _prepare(self, now: float) -> None:
        self._propose_due = INF
        self._highest = max(self._highest, self._ballot[0])
        self._ballot = (self._highest + 1, self.me.name)
        self._phase = "prepare"
        self._promises.clear()
        self._accepts.clear()
        self._round_due = now + self.params.round_timeout * (1.0 + self.rng.random())
        self._count("boot_rounds")
        for seed in self.params.seeds:
            self._send(seed, sign_if(self.book, BootPrepare(self._ballot[0], self.me.name, seed, self.me.addr)), True)

    def _on_promise(self, msg: BootPromise, now: float) -> None:
        self._learn(msg.known, now)  # the signer's own row among them: its key, to check the promise with
        if not self._seed(msg.acceptor, msg.signer, msg):
            return
        self._learn(msg.accepted, now)
        self._highest = max(self._highest, msg.round, msg.accepted_round)
        if self._phase != "prepare":
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
        if prior.accepted:  # re-proposed as it was accepted (each row its owner's signed word)
            value: tuple[Candidate, ...] | None = tuple(Candidate.of(r) for r in prior.accepted)
        else:
            value = choose(self.known.values(), self.params)
        if value is None:
            self._phase = ""
            self._round_due = INF
            return  # the quorum's candidates are still too few: wait for more hellos
        self._value, self._digest = value, value_digest(value)
        self._phase = "accept"
        rows = _rows(value)
        for seed in self.params.seeds:
            self._send(seed, sign_if(self.book, BootAccept(self._ballot[0], self.me.name, seed, self.me.addr, rows)),
                       True)

    def _on_accepted(self, msg: BootAccepted, now: float) -> None:
        if not self._seed(msg.acceptor, msg.signer, msg):
            return
        self._highest = max(self._highest, msg.round)
        if self._phase != "accept":
            return
        if not msg.ok:
            self._beaten(msg, now)
            return
        if (msg.round, msg.proposer) != self._ballot or msg.digest != self._digest:
            return
        signer = self.known.get(msg.signer)
        if signer is None and self.book is not None:
            return  # its row goes into the proof, for receivers that do not know it
        self._accepts[msg.acceptor] = (msg.acceptor, signer.row() if signer is not None else (), msg.sig)
        if len(self._accepts) >= self.params.quorum:
            proof = tuple(self._accepts.values()) if self.book is not None else ()
            decision = BootDecided(_rows(self._value), *self._ballot, proof)
            self._decide(self._value, decision, now)
            # sorted: the same sends in the same order whatever the hash seed (a simulation is replayable)
            for addr in sorted({*self.params.seeds, *(c.addr for c in self.known.values())}):
                self._send(addr, decision, True)

    def _beaten(self, msg: BootPromise | BootAccepted, now: float) -> None:
        """An acceptor holds a higher ballot: let its proposer finish, try again a round later if not."""
        if (msg.round, msg.proposer) > self._ballot:
            self._phase = ""
            self._round_due = now + self.params.round_timeout * (1.0 + self.rng.random())

    def _on_decided(self, msg: BootDecided, now: float) -> None:
        value = self._value_of(msg.value)
        if value is None:
            return
        if self.decided is not None:
            if value != self.decided:  # cannot happen with honest seeds: counted, never installed
                self._count("boot_conflicting_decision")
            return
        if self.book is not None and self._proven(msg, value_digest(value)) < self.params.quorum:
            self._count("rx_boot_decided_unproven")  # decides nothing alone: only its signed quorum does
            return
        self._decide(value, msg, now)

    def _proven(self, msg: BootDecided, digest: bytes) -> int:
        """How many seeds' signed accepteds of ``msg``'s value at its ballot its proof holds (each checked)."""
        seeds: set[str] = set()
        for seed, row, sig in msg.proof:
            signer = self._admit(row) if row else None
            if signer is None or seed in seeds:
                continue
            if self._seed(seed, signer.name, BootAccepted(seed, True, msg.round, msg.proposer, digest,
                                                          signer.name, sig)):
                seeds.add(seed)
        return len(seeds)

    def _decide(self, value: tuple[Candidate, ...], decision: BootDecided, now: float) -> None:
        if self.decided is not None:
            return
        self.decided, self.decided_at, self.decision = value, now, decision
        self._phase, self._round_due, self._propose_due = "", INF, INF
        self.events.append(ViewZeroAgreed(tuple(c.name for c in sorted(value, key=rank_order)),
                                          any(c.name == self.me.name for c in value), now))

    def _send(self, addr: str, msg: Message, reliable: bool) -> None:
        self._out.append((addr, msg, reliable))

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1


_HANDLERS: dict[type, Callable[[Bootstrap, Any, float], None]] = {
    BootHello: Bootstrap._on_hello, BootKnown: Bootstrap._on_known, BootPrepare: Bootstrap._on_prepare,
    BootPromise: Bootstrap._on_promise, BootAccept: Bootstrap._on_accept, BootAccepted: Bootstrap._on_accepted,
    BootDecided: Bootstrap._on_decided,
}
BOOT_TYPES = frozenset(_HANDLERS)


class Booting:
    """The machine of an agent started without a job spec: a :class:`Bootstrap` until view 0 is decided,
    then the node ``make_node(view, now, keys)`` builds (``view`` None: not in view 0, it joins as a
    spare; ``keys``: view 0's members' signing keys, to bind from the start), which it passes everything
    on to. Bootstrap messages that still arrive are answered for
    ``linger`` seconds (a late candidate learns the decision) and dropped after."""

    def __init__(self, boot: Bootstrap, make_node: Callable[[View | None, float, dict[str, bytes]], Machine],
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

    def set_progress(self, step: int, phase: int, step_ms: int, now: float, coll: int = 0,
                     wait_ms: int = 0) -> None:
        self._input("set_progress", (step, phase, step_ms, now, coll, wait_ms))

    def set_state(self, committed_step: int, inflight_step: int | None, state_bytes: int) -> None:
        self._input("set_state", (committed_step, inflight_step, state_bytes))

    def set_trainer_seen(self, group_epoch: int) -> None:
        self._input("set_trainer_seen", (group_epoch,))

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

    def behind(self) -> dict[str, int]:
        return self.node.behind() if self.node is not None else {}

    # ------------------------------------------------------------------ inside
    def _after(self, now: float) -> None:
        # messages to ourselves (we may be a seed) go through the network like any other: what a quorum
        # accepted is then always on the wire, where the simulator's checker reads it
        boot = self.boot
        if self.node is None and boot.decided is not None and not self._left:
            me = boot.me.name
            view = view_zero(boot.decided, boot.params) if any(c.name == me for c in boot.decided) else None
            self.node = self._make_node(view, now, boot_keys(boot.decided))
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
