"""The agent's event hub: every machine event (and :class:`AgentLeaving`) handed to each subscriber.

Subscribers (control clients, the launcher, the metrics follower, tests) each get a bounded queue, a
:class:`Subscription`. Publishing never blocks the pump: a subscriber that falls behind by more than
its queue holds is closed (``overflowed``) and its backlog dropped; it must resynchronise (a control
client reconnects and subscribes again). A *lossy* subscription (:meth:`EventHub.follow`, what
``gossiprec events`` reads) is never closed for that: it drops what does not fit and queues one
:class:`Gap` in its place, saying how many it dropped, and stamps each event with the wall-clock time
it was published (:class:`Stamped`), so that a slow reader costs at most its queue.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class AgentLeaving:
    """Published by the agent itself when it starts to leave (before its sockets close)."""

    name: str
    reason: str
    failed: bool
    at: float


@dataclass(frozen=True, slots=True)
class Gap:
    """Queued in a lossy subscription in place of the events that did not fit: ``dropped`` of them,
    the first at wall time ``at``."""

    dropped: int
    at: float


@dataclass(frozen=True, slots=True)
class Stamped:
    """An event of a lossy subscription with the wall-clock time (unix seconds) it was published."""

    time: float
    event: Any


class Subscription:
    """A bounded queue of events. :meth:`get` returns None once closed; on overflow it is closed
    (``overflowed`` set) and its backlog dropped: a consumer that falls behind must resynchronise."""

    def __init__(self, hub: EventHub, maxsize: int, *, lossy: bool = False,
                 skip: frozenset[str] = frozenset()) -> None:
        self._hub = hub
        self.skip = skip
        """Class names of events this subscription does not take (a lossy one's reader asked not to)."""
        self.lossy = lossy
        """Drop what does not fit (counted in a :class:`Gap`) instead of closing; items are
        :class:`Stamped` (and :class:`Gap`)."""
        self.dropped = 0
        self._items: deque[Any] = deque()
        self._maxsize = maxsize
        self._waiter: asyncio.Future[None] | None = None
        self.overflowed = False
        self.closed = False

    def push(self, event: Any) -> None:
        if self.closed or (self.skip and type(event).__name__ in self.skip):
            return
        if self.lossy:
            self._push_lossy(event)
            return
        if len(self._items) >= self._maxsize:
            self.overflowed = True
            self._items.clear()
            self.close()
            return
        self._items.append(event)
        self._wake()

    def _push_lossy(self, event: Any) -> None:
        now = time.time()
        items = self._items
        if len(items) < self._maxsize:
            items.append(Stamped(now, event))
        else:  # full: one Gap at the tail (the one slot above maxsize) counts everything dropped
            self.dropped += 1
            last = items[-1]
            if isinstance(last, Gap):
                items[-1] = Gap(last.dropped + 1, last.at)
            else:
                items.append(Gap(1, now))
        self._wake()

    def __len__(self) -> int:
        return len(self._items)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> Any | None:
        while not self._items:
            if self.closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> Any | None:
        return self._items.popleft() if self._items else None

    def close(self) -> None:
        self.closed = True
        self._hub.discard(self)
        self._wake()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Any:
        ev = await self.get()
        if ev is None:
            raise StopAsyncIteration
        return ev


class EventHub:
    """The set of open subscriptions; :meth:`publish` pushes one event to each."""

    def __init__(self) -> None:
        self._subs: set[Subscription] = set()

    def subscribe(self, maxsize: int = 10_000) -> Subscription:
        sub = Subscription(self, maxsize)
        self._subs.add(sub)
        return sub

    def follow(self, maxsize: int = 1000, skip: frozenset[str] = frozenset()) -> Subscription:
        """A lossy subscription (see :class:`Subscription`) of the events not named in ``skip``: for
        people watching, who may read slowly."""
        sub = Subscription(self, maxsize, lossy=True, skip=skip)
        self._subs.add(sub)
        return sub

    def discard(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    def publish(self, event: Any) -> None:
        for sub in list(self._subs):
            sub.push(event)

    def close_all(self) -> None:
        for sub in list(self._subs):
            sub.close()

    def __len__(self) -> int:
        return len(self._subs)
