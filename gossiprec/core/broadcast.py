"""Transmit-limited broadcast queue (SWIM dissemination, as memberlist's ``queue.go``).

What it decides: which pending updates ride on the next outgoing packet. Each update is keyed (by the
member it is about); a newer update about the same key replaces the older one, so the queue holds at most
one entry per member. Every time an entry is put on a packet its transmit count grows; once it reaches the
retransmit limit (``lambda * ceil(log10(N + 1))``, see :meth:`Config.retransmit_limit`) it is dropped.
Entries sent the fewest times go first, newest first among equals, so fresh news spreads fastest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gossiprec.core.wire import Message, encode_message


@dataclass(slots=True)
class _Entry:
    key: str
    body: bytes
    msg: Message
    order: int
    transmits: int = 0


@dataclass(slots=True)
class BroadcastQueue:
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _order: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def queue(self, key: str, msg: Message) -> None:
        """Queue ``msg`` about ``key``, replacing any older broadcast about the same key."""
        self._order += 1
        self._entries[key] = _Entry(key, encode_message(msg), msg, self._order)

    def pending(self, key: str) -> Message | None:
        entry = self._entries.get(key)
        return entry.msg if entry is not None else None

    def take(self, budget: int, limit: int, skip: str | None = None) -> list[bytes]:
        """Encoded bodies that fit in ``budget`` bytes; bumps their transmit counts, drops spent ones.

        ``skip`` names a key not to send (e.g. news about the very node the packet goes to is sent by
        the caller itself, first).
        """
        if not self._entries or budget <= 0:
            return []
        entries = sorted(self._entries.values(), key=lambda e: (e.transmits, -e.order))
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
