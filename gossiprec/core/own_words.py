"""A member's own word in SWIM: the records only it may speak, signed as they go out.

What it decides: this member's progress record (its trainer's step, phase, step time and collectives,
and since when that position is current: see :meth:`OwnWords.set_progress`), and how a
:class:`~gossiprec.core.membership.Membership` signs what it says about itself with its
:class:`~gossiprec.core.auth.KeyBook` (its Alive at its incarnation, kept for its push-pull rows; its
Progress, once per version, when first sent), what changes when the key book is set (both signed anew,
an Alive queued unsigned replaced), and whether another member's gossiped progress is that member's own
word. Without a key book nothing is signed or checked. Why these records are signed is
:mod:`gossiprec.core.auth`'s; when they are sent, the membership's.
"""

from __future__ import annotations

from gossiprec.core.auth import KeyBook, sign_if
from gossiprec.core.member_port import MembershipPort
from gossiprec.core.probing import MAX_MS
from gossiprec.core.wire import PHASES, Alive, Progress
from gossiprec.errors import ProtocolError


class OwnWords:
    """One membership's own words: its key book and its progress record."""

    __slots__ = ("m", "book", "progress", "since")

    def __init__(self, m: MembershipPort, now: float) -> None:
        self.m = m
        self.book: KeyBook | None = None
        """Per-member signatures (None: nothing signed or checked)."""
        self.progress = Progress(m.name, m.incarnation, 0, -1, 0, 0)
        """Our progress record: signed by :meth:`signed_progress` when first sent."""
        self.since = now
        """When our own (step, phase) became current (its age goes out on our acks, ``stall_ms``)."""

    def use_book(self, book: KeyBook | None) -> None:
        """Set the key book (:attr:`Membership.auth`)."""
        m = self.m
        self.book = book
        m.set_progress_check(None if book is None else self.vouch_progress)
        p = self.progress  # signed by this key when it is next sent (see signed_progress)
        self.progress = Progress(p.name, p.incarnation, p.version, p.step, p.phase, p.step_ms, p.coll, p.wait_ms)
        own = self.alive()  # our push-pull rows carry it
        if isinstance(m.pending(m.name), Alive):  # queued before we had a key: signed now
            m.broadcast(m.name, own, m.now)

    def set_progress(self, step: int, phase: int, step_ms: int, now: float, coll: int = 0,
                     wait_ms: int = 0) -> None:
        """Our trainer's progress at ``now`` (see :meth:`Membership.set_progress`); raises
        :class:`~gossiprec.errors.ProtocolError` on a value out of range, nothing kept."""
        if not (isinstance(step, int) and -1 <= step <= 2**62):
            raise ProtocolError(f"step must be an integer -1..2**62, got {step!r}")
        if not (isinstance(phase, int) and 0 <= phase < len(PHASES)):
            raise ProtocolError(f"phase must be 0..{len(PHASES) - 1} ({', '.join(PHASES)}), got {phase!r}")
        if not isinstance(step_ms, int) or step_ms < 0 or not isinstance(coll, int) or coll < 0:
            raise ProtocolError(f"step_ms must be a non-negative integer, and coll too; got {step_ms!r}, {coll!r}")
        if not isinstance(wait_ms, int) or wait_ms < 0:
            raise ProtocolError(f"wait_ms must be a non-negative integer, got {wait_ms!r}")
        step_ms, coll, wait_ms = min(step_ms, MAX_MS), min(coll, 2**32 - 1), min(wait_ms, MAX_MS)
        p = self.progress
        if (step, phase, coll) != (p.step, p.phase, p.coll):
            self.since = now
        self.progress = Progress(self.m.name, self.m.incarnation, p.version + 1, step, phase, step_ms, coll, wait_ms)

    def renew(self) -> None:
        """Our incarnation changed: our progress record is at the new one."""
        p, m = self.progress, self.m
        self.progress = Progress(m.name, m.incarnation, p.version, p.step, p.phase, p.step_ms, p.coll, p.wait_ms)

    def alive(self) -> Alive:
        """Our Alive at our incarnation, signed, and kept as the one our push-pull rows carry."""
        m = self.m
        own = Alive(m.name, m.addr, m.incarnation, m.role)
        m.keep_alive(own)
        return sign_if(self.book, own)

    def signed_progress(self) -> Progress:
        """Our progress as it goes out, signed: once per version, when it is first sent (the trainer may
        report far more often than we send; until then the record is ours alone, so signing it in place
        is safe)."""
        p = self.progress
        if not p.sig and self.book is not None:
            self.book.sign(p)
        return p

    def vouch_progress(self, msg: Progress) -> bool:
        """Whether a gossiped progress record (news to us) is its owner's own word, as an Alive is
        (:meth:`KeyBook.vouched`: a member whose key is not bound yet is taken, and counted). A refusal
        is counted: forged progress could otherwise freeze a healthy rank, or put it ahead of the others,
        and have the hang check accuse it."""
        auth = self.book
        if auth is None or auth.vouched(msg.name, msg):
            return True
        counters = self.m.counters
        counters["rx_progress_unsigned"] = counters.get("rx_progress_unsigned", 0) + 1
        return False
