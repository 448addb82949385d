"""How the pump sets its one timer on the event loop, and what it does when the timer fires early.

The pump asks for a wake-up at the machine's next deadline, a time on the agent's clock. Two ways:

- :class:`PlainTimer` (``--no-align-timers``): ``loop.call_later`` for the time left. A timer that
  fires before the deadline (clocks apart, rounding) is simply set again for the rest.
- :class:`AlignedTimer` (the default): on uvloop, whose timers run on a cached millisecond clock in
  ``time.monotonic()``'s scale and fire within the millisecond after the one they are set for, the
  timer aims at the millisecond the deadline falls in. It then fires at most about a millisecond early,
  and the callback sleeps out the rest (:data:`FINISH_EARLY_S` at most) instead of going around the
  loop: set again, a millisecond timer would round to 0 or 1 ms, a spin or a late tick. On another loop
  it sets the timer like the plain one but keeps the sleep-out.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Callable, Protocol

FINISH_EARLY_S = 0.002
"""A timer that fires at most this early sleeps out the rest in place (:class:`AlignedTimer`)."""

Clock = Callable[[], float]


class LoopTimer(Protocol):
    """Sets the pump's timer; :meth:`settle` decides what to do when it fired."""

    def arm(self, loop: asyncio.AbstractEventLoop, deadline: float,
            callback: Callable[[], None]) -> asyncio.TimerHandle: ...

    def settle(self, deadline: float, now: float) -> float | None:
        """The time to tick at (``now`` or a little later), or None: not due, set the timer again."""
        ...


class PlainTimer:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def arm(self, loop: asyncio.AbstractEventLoop, deadline: float,
            callback: Callable[[], None]) -> asyncio.TimerHandle:
        return loop.call_later(max(0.0, deadline - self.clock()), callback)

    def settle(self, deadline: float, now: float) -> float | None:
        return now if deadline <= now else None


class AlignedTimer(PlainTimer):
    def __init__(self, clock: Clock, ms_clock: bool) -> None:
        super().__init__(clock)
        self.ms_clock = ms_clock
        """The loop's timers run on a millisecond clock in the agent clock's scale (uvloop)."""

    def arm(self, loop: asyncio.AbstractEventLoop, deadline: float,
            callback: Callable[[], None]) -> asyncio.TimerHandle:
        if self.ms_clock:
            return loop.call_at(math.floor(deadline * 1000.0) / 1000.0, callback)
        return super().arm(loop, deadline, callback)

    def settle(self, deadline: float, now: float) -> float | None:
        if deadline <= now:
            return now
        if deadline - now > FINISH_EARLY_S:
            return None  # not a timer firing early: a deadline that moved, or another wake-up
        time.sleep(deadline - now)
        return self.clock()


def loop_timer(loop: asyncio.AbstractEventLoop, clock: Clock, align: bool) -> LoopTimer:
    """The timer for ``loop``: aligned (uvloop's millisecond clock when it shares ``clock``'s scale)
    when ``align``, else plain."""
    if not align:
        return PlainTimer(clock)
    ms_clock = type(loop).__module__.startswith("uvloop") and abs(loop.time() - clock()) < 0.05
    return AlignedTimer(clock, ms_clock)
