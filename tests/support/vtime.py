"""A virtual-time event loop for tests: waiting costs no wall time.

:class:`VirtualClockLoop` is asyncio's selector loop with one change: when it would sleep (nothing
ready, the next timer some time away), it polls its file descriptors instead and, if none is ready,
moves its clock on by the time it would have slept. Its clock is ``time.monotonic()`` plus everything
skipped, so it never runs backwards, and work that takes real time still takes that time. Timers,
``asyncio.timeout`` and the agent's own timer (``loop.call_at``/``call_later``) all follow it; an agent
given ``clock=loop.time`` hands its machine the same time.

Sound as long as everything a test waits for is produced inside the loop: in-memory transports
(:mod:`tests.support.memnet`), Unix sockets between a client and a server of the same loop (the
kernel makes written bytes readable at once). Not for waits on other threads or processes: the clock
would run ahead of them.
"""

from __future__ import annotations

import asyncio
import functools
import selectors
import time
from typing import Any, Callable, Coroutine, TypeVar

T = TypeVar("T")


class _SkippingSelector(selectors.DefaultSelector):
    """Polls instead of sleeping; a sleep it skips moves the loop's clock on."""

    loop: VirtualClockLoop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout <= 0:
            return super().select(timeout)  # no timer at all: wait for real I/O; or a plain poll
        ready = super().select(0)
        if not ready:
            self.loop.skipped += timeout
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """See the module docstring. ``skipped`` is the time skipped so far, in seconds."""

    def __init__(self) -> None:
        selector = _SkippingSelector()
        selector.loop = self
        self.skipped = 0.0
        super().__init__(selector)

    def time(self) -> float:
        return time.monotonic() + self.skipped


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on a fresh :class:`VirtualClockLoop` (like ``asyncio.run``)."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(main)


def virtual_time(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Decorate an ``async def`` test to run it on a :class:`VirtualClockLoop` (pytest sees a plain
    test function with the same fixtures)."""

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        run(test(*args, **kwargs))

    return wrapper
