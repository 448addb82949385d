"""Refusals: what an opener's refusal says, how refusals are counted and logged, and the small bounded
state that decides replays and rates (sans-IO: the caller passes ``now``).

:class:`OpenError` carries one of :data:`REASONS`; a :class:`RejectCounter` counts them by reason (every
reason present, for metrics); :class:`RejectLog` writes at most one line per reason per interval, with
the count of those it held back. :class:`ReplayWindow` is the anti-replay bitmap of one datagram sender;
:class:`TokenBucket` bounds how often an opener does work a forger can force on it (deriving the subkey
of a sender it has not seen). :mod:`gossiprec.security.crypto` uses them and re-exports them.
"""

from __future__ import annotations

import logging
from typing import Iterator, Mapping

from gossiprec.errors import ConfigError, SecurityError

REASONS: tuple[str, ...] = ("too_large", "truncated", "bad_magic", "bad_version", "wrong_receiver",
                            "unknown_key", "throttled", "auth_failed", "replay")
"""Every reason an :class:`OpenError` can carry."""

log = logging.getLogger("gossiprec.security.crypto")


class OpenError(SecurityError):
    """A packet or frame was refused. ``reason`` is one of :data:`REASONS`; ``detail`` says more."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class RejectCounter(Mapping[str, int]):
    """Counts of refused packets by reason; every reason present (0 until seen) for metrics."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = dict.fromkeys(REASONS, 0)

    def record(self, reason: str) -> None:
        self._counts[reason] = self._counts.get(reason, 0) + 1

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def __getitem__(self, reason: str) -> int:
        return self._counts[reason]

    def __iter__(self) -> Iterator[str]:
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)

    def __repr__(self) -> str:
        return f"RejectCounter({self._counts!r})"


class RejectLog:
    """At most one log line per reason per ``interval_s``; lines carry how many were suppressed.

    The caller passes ``now`` (seconds, any monotonic clock); nothing here reads a clock.
    """

    def __init__(self, logger: logging.Logger | None = None, interval_s: float = 10.0) -> None:
        if interval_s <= 0:
            raise ConfigError("RejectLog interval_s must be > 0")
        self.logger = logger if logger is not None else log
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def note(self, err: OpenError, now: float, peer: object = None) -> bool:
        """Log ``err`` unless its reason was logged less than ``interval_s`` ago. True if logged."""
        last = self._last.get(err.reason)
        if last is not None and now - last < self.interval_s:
            self._suppressed[err.reason] = self._suppressed.get(err.reason, 0) + 1
            return False
        n = self._suppressed.pop(err.reason, 0)
        self._last[err.reason] = now
        more = f" (+{n} more since the last report)" if n else ""
        src = f" from {peer}" if peer is not None else ""
        self.logger.warning("refused packet%s: %s%s", src, err, more)
        return True


class ReplayWindow:
    """Sliding anti-replay window (RFC 4303 / WireGuard style) over a 64-bit counter.

    Per sender id: the highest counter seen and a bitmap of the ``size`` counters below it; duplicates
    and counters older than the window are refused, reordering within it is accepted. The opener keeps
    one per sender in a bounded LRU.
    """

    __slots__ = ("size", "highest", "bitmap", "_mask")

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self.highest = -1
        self.bitmap = 0  # bit i set: counter (highest - i) was accepted
        self._mask = (1 << size) - 1

    def check(self, counter: int) -> str | None:
        """None if ``counter`` may be accepted, else why not. Changes nothing."""
        if counter > self.highest:
            return None
        back = self.highest - counter
        if back >= self.size:
            return f"counter {counter} is older than the window (highest {self.highest}, window {self.size})"
        if (self.bitmap >> back) & 1:
            return f"counter {counter} was already accepted"
        return None

    def update(self, counter: int) -> None:
        """Mark ``counter`` accepted; call only after :meth:`check` passed and the packet authenticated."""
        if counter > self.highest:
            shift = counter - self.highest
            self.bitmap = ((self.bitmap << shift) | 1) & self._mask if shift < self.size else 1
            self.highest = counter
        else:
            self.bitmap |= 1 << (self.highest - counter)


class TokenBucket:
    """``rate`` tokens a second up to ``burst``; :meth:`take` spends one if there is one.

    The caller passes ``now`` (seconds, any monotonic clock); nothing here reads a clock.
    """

    __slots__ = ("rate", "burst", "_tokens", "_at")

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._tokens = float(burst)
        self._at: float | None = None

    def _refill(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now if self._at is None or now > self._at else self._at

    @property
    def tokens(self) -> float:
        """Tokens left at the last call."""
        return self._tokens

    def take(self, now: float) -> bool:
        self._refill(now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def spend(self, now: float) -> None:
        """Spend one whether or not there is one (never below zero: what was done is done, and the
        :meth:`pause` that follows is at most one quantum)."""
        self._refill(now)
        self._tokens = max(0.0, self._tokens - 1.0)

    def pause(self, now: float, quantum: float) -> float:
        """Seconds until a token is back (0: one is here now); once spent, waits until ``quantum``
        seconds' worth is back, so that a caller held off wakes ~1/quantum times a second, not once
        per token."""
        self._refill(now)
        if self._tokens >= 1.0:
            return 0.0
        return (min(self.burst, max(1.0, self.rate * quantum)) - self._tokens) / self.rate
