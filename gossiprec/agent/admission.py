"""What the TCP accept loop decides before it spends anything on a connection.

A connection that never authenticates (idle, slow, garbage, evicted) is waste. Evicting one costs a task
spawned and cancelled (~130 us); refusing at accept costs an accept and a close (~40 us). A source that
reconnects as fast as it is closed turns either into a loop that takes a core, so two bounds decide at
accept, before a task exists:

* per source, a backoff: a source whose unauthenticated connection was evicted for holding more than its
  share, or closed idle, has its new connections refused for a window that doubles with each strike
  (10 ms up to 1 s), and forgiven when one of its connections authenticates;
* globally, a budget of wasted connections a second (a
  :class:`~gossiprec.security.refusals.TokenBucket`): when it is spent the accept loop stops accepting
  until :data:`PAUSE_QUANTUM` of it has refilled, so further connections wait in the kernel's backlog at
  no cost to the agent (a genuine peer's connection waits there too, behind at most a backlog of the
  attacker's).
"""

from __future__ import annotations

from collections import OrderedDict

BACKOFF_FIRST = 0.01
"""Seconds of refusal after a source's first strike; doubles with each further strike."""
BACKOFF_MAX = 1.0
"""Longest refusal window for one source (seconds)."""
PAUSE_QUANTUM = 0.02
"""Seconds of refill a spent budget waits for before accepting again."""
MAX_SOURCES = 4096
"""Sources whose strikes are remembered; the oldest is forgotten past this."""


class SourceBackoff:
    """Refusal windows for sources that keep sending connections that do not authenticate."""

    def __init__(self) -> None:
        self._strikes: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def refuses(self, source: str, now: float) -> bool:
        entry = self._strikes.get(source)
        return entry is not None and now < entry[1]

    def strike(self, source: str, now: float) -> None:
        strikes = min(self._strikes.get(source, (0, 0.0))[0] + 1, 16)
        self._strikes[source] = (strikes, now + min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (strikes - 1)))
        self._strikes.move_to_end(source)
        while len(self._strikes) > MAX_SOURCES:
            self._strikes.popitem(last=False)

    def forgive(self, source: str) -> None:
        self._strikes.pop(source, None)

    def __len__(self) -> int:
        return len(self._strikes)
