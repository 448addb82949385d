"""Transmit-limited broadcast queue (SWIM dissemination, as memberlist's ``queue.go``).

What it decides: which pending updates ride on the next outgoing packet. Each update is keyed (by the
member it is about); a newer update about the same key replaces the older one, so the queue holds at most
one entry per member. Every time an entry is put on a packet its transmit count grows; once it reaches the
retransmit limit (``lambda * ceil(log10(N + 1))``, see :meth:`Config.retransmit_limit`) it is dropped.
Entries sent the fewest times go first, newest first among equals, so fresh news spreads fastest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

from gossiprec.core.wire import Message, encode_message


@dataclass(slots=True)
class _Entry:
    key: str
    body: bytes
    msg: Message
    order: int
    transmits: int = 0
    newness: int = 0
    """``-order``: the sort key (transmits, newness) puts the fewest sends first, newest first among equals."""


_SORT_KEY = attrgetter("transmits", "newness")


MERGE_SENDS = 3
"""Sends a merged aggregate still has left after it grew (see :meth:`BroadcastQueue.queue`)."""


@dataclass(slots=True)
class BroadcastQueue:
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _order: int = 0
    _limit: int = 8  # the retransmit limit of the latest take()

    def __len__(self) -> int:
        return len(self._entries)

    def queue(self, key: str, msg: Message, merge: bool = False) -> None:
        """Queue ``msg`` about ``key``, replacing any older broadcast about the same key.

        ``merge``: ``msg`` is a grown aggregate of the pending one (an OR-merged bitmap): it replaces the
        body and keeps the transmit count, lowered so that at least ``MERGE_SENDS`` sends remain for the
        new bits. Resetting the count on every merge would make each member resend an aggregate once
        per contributor, O(N log N) sends per member for one vote; keeping it whole would let bits that
        arrive late die out. Every member that learns a bit forwards it at least ``MERGE_SENDS`` times and
        every packet carries the whole union, so the bits spread epidemically.
        """
        self._order += 1
        old = self._entries.get(key) if merge else None
        if old is not None:
            old.body = encode_message(msg)
            old.msg = msg
            old.transmits = max(0, min(old.transmits, self._limit - MERGE_SENDS))
            return
        self._entries[key] = _Entry(key, encode_message(msg), msg, self._order, 0, -self._order)

    def pending(self, key: str) -> Message | None:
        entry = self._entries.get(key)
        return entry.msg if entry is not None else None

    def take(self, budget: int, limit: int, skip: str | None = None) -> list[bytes]:
        """Encoded bodies that fit in ``budget`` bytes; bumps their transmit counts, drops spent ones.

        ``skip`` names a key not to send (e.g. news about the very node the packet goes to is sent by
        the caller itself, first).
        """
        self._limit = limit
        if not self._entries or budget <= 0:
            return []
        entries = sorted(self._entries.values(), key=_SORT_KEY)
        out: list[bytes] = []
        for entry in entries:
            size = len(entry.body)
            if size > budget:
                if budget < 16:
                    break
                continue
            if entry.key == skip:
                continue
            out.append(entry.body)
            budget -= size
            entry.transmits += 1
            if entry.transmits >= limit:
                del self._entries[entry.key]
        return out

    def clear(self) -> None:
        self._entries.clear()
