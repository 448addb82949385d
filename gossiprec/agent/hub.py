"""The agent's event hub: every machine event (and :class:`AgentLeaving`) handed to each subscriber.

Subscribers (control clients, the launcher, the metrics follower, tests) each get a bounded queue, a
:class:`Subscription`. Publishing never blocks the pump: a subscriber that falls behind by more than
its queue holds is closed (``overflowed``) and its backlog dropped; it must resynchronise (a control
client reconnects and subscribes again).
"""

from __future__ import annotations

import asyncio
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


class Subscription:
    """A bounded queue of events. :meth:`get` returns None once closed; on overflow it is closed
    (``overflowed`` set) and its backlog dropped: a consumer that falls behind must resynchronise."""

    def __init__(self, hub: EventHub, maxsize: int) -> None:
        self._hub = hub
        self._items: deque[Any] = deque()
        self._maxsize = maxsize
        self._waiter: asyncio.Future[None] | None = None
        self.overflowed = False
        self.closed = False

    def push(self, event: Any) -> None:
        if self.closed:
            return
        if len(self._items) >= self._maxsize:
            self.overflowed = True
            self._items.clear()
            self.close()
            return
        self._items.append(event)
        self._wake()

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
