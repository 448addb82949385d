"""Records of the membership machine: immutable data, shared by the core, the simulator and the agent
(a member's liveness record, its progress as last heard, a datagram to send) and the randomness the
core is given. Its events are in :mod:`gossiprec.core.events`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gossiprec.core.wire import ALIVE, SUSPECT, value_class


class RandomSource(Protocol):
    """The subset of :class:`random.Random` the core uses (injected, never global)."""

    def random(self) -> float: ...
    def randrange(self, start: int, stop: int | None = ..., step: int = ...) -> int: ...
    def sample(self, population, k: int): ...  # type: ignore[no-untyped-def]


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """Immutable: shared between the tables of many simulated nodes."""

    name: str
    addr: str
    incarnation: int
    status: int = ALIVE
    role: int = 0

    @property
    def live(self) -> bool:
        return self.status <= SUSPECT


@dataclass(frozen=True, slots=True)
class ProgressInfo:
    incarnation: int
    version: int
    step: int
    phase: int
    step_ms: int
    seen_at: float
    """When anything about this member's progress was last heard (freshness)."""
    since: float
    """When this (step, phase, coll) was first heard: the start of a stall, as far as this member can tell."""
    coll: int = 0
    """Collectives its trainer had entered in ``step`` (see :attr:`gossiprec.core.wire.Progress.coll`)."""
    wait_ms: int = 0
    """Its trainer's mean wait inside collectives per step (see :attr:`gossiprec.core.wire.Progress.wait_ms`)."""


@value_class
class Send:
    addr: str
    payload: bytes
    reliable: bool = False
