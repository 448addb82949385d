"""A member's own word in SWIM: the records only it may speak, signed as they go out.

What it decides: how a :class:`~gossiprec.core.membership.Membership` signs what it says about itself
with its :class:`~gossiprec.core.auth.KeyBook` (its Alive at its incarnation, kept for its push-pull
rows; its Progress, once per version, when first sent), what changes when the key book is set (both
signed anew, an Alive queued unsigned replaced), and whether another member's gossiped progress is that
member's own word. Without a key book nothing is signed or checked. Why these records are signed is
:mod:`gossiprec.core.auth`'s; when they are sent, the membership's.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from gossiprec.core.auth import KeyBook, sign_if
from gossiprec.core.wire import Alive, Progress

if TYPE_CHECKING:
    from gossiprec.core.membership import Membership


def use_book(m: Membership, book: KeyBook | None) -> None:
    """Set ``m``'s key book (:attr:`Membership.auth`)."""
    m._auth = book
    m._book.vouch = None if book is None else partial(vouch_progress, m)
    p = m._my_progress  # signed by this key when it is next sent (see progress)
    m._my_progress = Progress(p.name, p.incarnation, p.version, p.step, p.phase, p.step_ms, p.coll)
    own = alive(m)  # our push-pull rows carry it
    if isinstance(m._queue.pending(m.name), Alive):  # queued before we had a key: signed now
        m._broadcast(m.name, own)


def alive(m: Membership) -> Alive:
    """Our Alive at our incarnation, signed, and kept as the one our push-pull rows carry."""
    own = m._alives[m.name] = Alive(m.name, m.addr, m.incarnation, m.role)
    return sign_if(m._auth, own)


def progress(m: Membership) -> Progress:
    """Our progress as it goes out, signed: once per version, when it is first sent (the trainer may
    report far more often than we send; until then the record is ours alone, so signing it in place
    is safe)."""
    p = m._my_progress
    if not p.sig and m._auth is not None:
        m._auth.sign(p)
    return p


def vouch_progress(m: Membership, msg: Progress) -> bool:
    """Whether a gossiped progress record (news to us) is its owner's own word, as an Alive is
    (:meth:`KeyBook.vouched`: a member whose key is not bound yet is taken, and counted). A refusal
    is counted: forged progress could otherwise freeze a healthy rank, or put it ahead of the others,
    and have the hang check accuse it."""
    auth = m._auth
    if auth is None or auth.vouched(msg.name, msg):
        return True
    m._count("rx_progress_unsigned")
    return False
