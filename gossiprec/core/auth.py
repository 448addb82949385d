"""Per-member signatures: a member can speak only for itself.

What it decides: whether a message that names its author was signed by that author's own key, and
which key each member name is bound to. The cluster key (the transport's seal) proves only "someone
holds the key"; this layer stops one key holder from speaking in other members' names.

Keys. Every agent makes an Ed25519 key pair at start (:mod:`gossiprec.security.signing`; the core
only sees the :class:`Crypto` it is handed: sans-IO). Its public key travels in a
:class:`~gossiprec.core.wire.KeyClaim`: gossiped at start, every ``CLAIM_SOON`` seconds for
``CLAIM_SOON_FOR``, then every ``CLAIM_EVERY``, and ahead of a join's push-pull, every catch-up answer
and every message sent straight to every member (alerts, votes): a first contact is not lost for want
of a key. The
:class:`KeyBook` binds a name to the first key claimed for it (pinned keys are bound from the start
and never replaced); a claim naming a bound member with another key is refused and counted. A member
removed from the view loses its binding, so a restarted process (a new key) can rejoin.

What is signed, and checked against the named author: SWIM's Alive (the member: only it raises its
incarnation or moves its address; push-pull rows carry that signature, see
:mod:`~gossiprec.core.antientropy`), its Progress (the member: only it reports its training progress,
which the hang check judges; push-pull rows carry that signature too, see
:mod:`~gossiprec.core.progress`), Suspect and an observer's Dead (the accuser), alerts (observer),
graceful leaves (the member), fast votes (voter, one :class:`~gossiprec.core.wire.Vote` each; unsigned
bitmaps are ignored), state reports for a view's plan and plan digests (the member, one
:class:`~gossiprec.core.wire.StateClaim` and one :class:`~gossiprec.core.wire.PlanConfirm` each; unsigned
bitmaps are ignored; relays carry these three in bundles of many members' signatures of one payload, each
checked as its member's single message would be, see :mod:`gossiprec.core.bundles`), prepares and accepts
(coordinator), promises and accepteds (acceptor), the job's end (the trainer), catch-up views (sender,
who must be a member of the view the receiver holds), and the bootstrap without a job spec (each
candidate row by its candidate, which carries its key there instead of a claim; hellos; the seeds'
answers, promises and accepteds; the seeds' prepares and accepts: see :mod:`gossiprec.core.bootstrap`,
where view 0's keys come bound). A ``Decided`` (and a ``BootDecided``) decides nothing alone: each member
counts the signed quorum itself (see :mod:`gossiprec.core.consensus`). The signature covers the message's
wire row without its ``sig`` field (the type id included, so one kind never passes as another); relayed
messages carry their author's signature, so every copy is checked however it came. Results are cached by
signature: each distinct signed item is verified once, however many times gossip delivers it.

Trust on first use: a holder of the cluster key present *before* a member's first claim reaches a
receiver (at job start or at the bootstrap, or while a removed member rejoins) can bind that name to
its own key there; pinned keys close that window. Without a :class:`KeyBook` (``Node(auth=None)``) nothing is signed
or checked.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Mapping, Protocol, TypeVar

import msgpack

from gossiprec.core.codec import ROWS
from gossiprec.core.wire import KeyClaim, Message

CLAIM_EVERY = 30.0
"""Seconds between re-broadcasts of a member's own key claim (late receivers and rejoins bind it)."""
CLAIM_SOON = 1.0
"""Seconds between claims just after a process started (its first claims may have found nobody) ..."""
CLAIM_SOON_FOR = 5.0
"""... for this long."""
CACHE_MAX = 1 << 14
"""Verified signatures remembered (cleared when full; a miss only costs one more verification)."""


class Crypto(Protocol):
    """One member's signing key and the signature scheme (injected by the pump)."""

    public_key: bytes

    def sign(self, data: bytes) -> bytes: ...

    def verify(self, key: bytes, data: bytes, sig: bytes) -> bool: ...


@dataclass(slots=True)
class DigestCrypto:
    """A cheap deterministic stand-in for the simulator and unit tests: the "public key" is a keyed
    hash's key, so it proves nothing against anyone who learns it. It keeps every signing code path
    exercised at a fraction of Ed25519's cost; real agents never use it."""

    public_key: bytes

    @classmethod
    def for_name(cls, name: str) -> "DigestCrypto":
        return cls(hashlib.blake2b(name.encode(), digest_size=16, person=b"gossiprec-sim").digest())

    def sign(self, data: bytes) -> bytes:
        return hashlib.blake2b(data, key=self.public_key, digest_size=16).digest()

    def verify(self, key: bytes, data: bytes, sig: bytes) -> bool:
        return hmac.compare_digest(hashlib.blake2b(data, key=key, digest_size=16).digest(), sig)


_pack = msgpack.Packer(use_bin_type=True).pack


def signed_bytes(msg: Message) -> bytes:
    """What a signature of ``msg`` covers: its wire row without the trailing ``sig`` field (the codec's
    own row getter: every check of a gossiped record runs this, a cache hit included)."""
    row = ROWS[type(msg)](msg)
    row.pop()
    return _pack(row)  # type: ignore[no-any-return]


def claims_of(book: "KeyBook | None") -> tuple[Message, ...]:
    """Our key claim, to ride ahead of messages a receiver checks; nothing where keys are pinned or unused."""
    return (KeyClaim(book.me, book.crypto.public_key),) if book is not None and book.claims else ()


M = TypeVar("M", bound=Message)


def sign_if(book: "KeyBook | None", msg: M) -> M:
    """``msg`` signed by ``book``'s key (in place), or as it is without a key book."""
    if book is not None:
        book.sign(msg)
    return msg


@dataclass(slots=True)
class KeyBook:
    """This member's key, and the keys it has bound to other members' names."""

    me: str
    crypto: Crypto
    pinned: Mapping[str, bytes] = field(default_factory=dict)
    """Keys fixed by the operator (or the simulator): bound from the start, never replaced; may be shared
    by many key books (it is only read)."""
    claims: bool = True
    """Whether this member gossips its key (off where every key is pinned)."""
    keys: dict[str, bytes] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    _verified: dict[bytes, tuple[str, bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.keys[self.me] = self.crypto.public_key

    def key_of(self, name: str) -> bytes | None:
        key = self.pinned.get(name)
        return key if key is not None else self.keys.get(name)

    def _count(self, what: str) -> None:
        self.counters[what] = self.counters.get(what, 0) + 1

    # ------------------------------------------------------------------ bindings
    def bind(self, name: str, key: bytes) -> bool:
        """A claim that ``name`` signs with ``key``. Returns True when it is news (now bound)."""
        have = self.key_of(name)
        if have == key:
            return False
        if have is not None:
            self._count("rx_key_conflict")
            return False
        self.keys[name] = key
        return True

    def forget(self, names: set[str] | frozenset[str]) -> None:
        """Drop the bindings of members that left the view (never pinned ones, never our own)."""
        for name in names:
            if name != self.me:
                self.keys.pop(name, None)

    # ------------------------------------------------------------------ signing and checking
    def sign(self, msg: Message) -> Message:
        """``msg`` with its ``sig`` field set to our signature (call before the message is shared)."""
        data = signed_bytes(msg)
        msg.sig = sig = self.crypto.sign(data)  # type: ignore[attr-defined]
        self._remember(sig, self.me, data)  # our own words come back by gossip, and are checked locally
        return msg

    def check(self, author: str, msg: Message) -> bool:
        """Whether ``msg`` carries a valid signature by ``author``'s bound key; a refusal is counted."""
        sig: bytes = msg.sig  # type: ignore[attr-defined]
        data = signed_bytes(msg)
        hit = self._verified.get(sig)
        if hit is not None and hit[0] == author and hit[1] == data:
            return True
        key = self.key_of(author)
        if key is None:
            self._count("rx_sig_unknown_author")
            return False
        if not sig or not self.crypto.verify(key, data, sig):
            self._count("rx_sig_invalid")
            return False
        self._remember(sig, author, data)
        return True

    def vouched(self, author: str, msg: Message) -> bool:
        """For SWIM's rumours and progress records: :meth:`check`, except that a rumour by a member whose
        key is not bound here yet (its claims have not arrived) is taken, and counted: trust on first use
        leaves that name open to any key holder anyway, while refusing it would hold a live member suspect
        (its refutation refused), keep a failure from spreading, or leave the hang check blind, until the
        next claim comes."""
        if self.key_of(author) is None:
            self._count("rx_sig_unbound")
            return True
        return self.check(author, msg)

    def accusation(self, msg: Message, accuser: str) -> bool:
        """Whether a SWIM accusation (a Suspect, an observer's Dead) counts: ``accuser``'s own signed word
        (:meth:`vouched`). A refusal is counted."""
        if not self.vouched(accuser, msg):
            self._count("rx_accusation_unsigned")
            return False
        return True

    def _remember(self, sig: bytes, author: str, data: bytes) -> None:
        if len(self._verified) >= CACHE_MAX:
            self._verified.clear()
        self._verified[sig] = (author, data)
