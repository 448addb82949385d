"""Whom SWIM probes, and when: the probe schedule, its round robin, and the records of one probe.

What it decides: the members each probe round goes to. A round probes the next live candidate of a
shuffled round robin over the probe targets (the agreement overlay's subjects, or every member), with
O(1) memory: a random affine permutation ``i -> (a * i + b) mod n``, ``gcd(a, n) = 1``, drawn anew for
every pass. While nothing is in focus a round takes ``probe_batch`` candidates and rounds are that many
intervals apart (fewer wake-ups, the same rate per member); members in *focus* (they may have failed) are
probed every round besides, and members to *refresh* one per round in turn. A first member in focus
brings the next round forward to one interval after the last. The interval is ``probe_interval`` scaled
by this node's health. The probe protocol itself (direct, indirect, verification, Lifeguard's
self-blame) is :class:`~gossiprec.core.prober.Prober`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gossiprec.core.members import MemberTable
from gossiprec.core.records import RandomSource

MAX_MS = 2**31 - 1
"""The largest millisecond count the wire carries (ages, step times)."""


def age_ms(seconds: float) -> int:
    """An age for the wire: whole milliseconds, clamped to the field's range."""
    ms = int(seconds * 1000.0)  # on every ack: comparisons, not min()/max() calls
    return ms if 0 <= ms <= MAX_MS else (0 if ms < 0 else MAX_MS)


@dataclass(slots=True)
class Probe:
    """One probe of ours, from its ping to its ack or the end of its indirect window."""

    target: str
    addr: str
    start: float
    verify: bool
    """A suspect's verification by this node (direct and indirect at once, then dead or refuted)."""
    incarnation: int
    timer: int = 0
    """Token of its direct timeout on the timer heap (0: it waits in the FIFO of direct deadlines)."""
    expected_nacks: int = 0
    nacks: int = 0
    acked: bool = False
    indirect_sent: bool = False


@dataclass(slots=True)
class Relay:
    """A probe we make for another member (an indirect ping): its ack goes back to the requester."""

    requester_addr: str
    orig_seq: int
    nack: bool
    done: bool = False


class RoundRobin:
    """A shuffled round robin over ``n`` candidates (indices), redrawn at the end of every pass or when
    restarted (the candidates changed)."""

    __slots__ = ("a", "b", "i", "n")

    def __init__(self) -> None:
        self.a, self.b, self.i, self.n = 1, 0, 0, 0

    def restart(self) -> None:
        self.i = self.n = 0

    def next_index(self, n: int, rng: RandomSource) -> int:
        """The next index, in ``0..n-1`` of the pass it belongs to (a pass drawn for an earlier ``n``
        runs to its end first)."""
        if self.i >= self.n:
            self.n = n
            self.i = 0
            a = rng.randrange(1, max(2, n))
            while math.gcd(a, n) != 1:
                a = rng.randrange(1, max(2, n))
            self.a, self.b = a, rng.randrange(0, n)
        idx = (self.a * self.i + self.b) % self.n
        self.i += 1
        return idx


class ProbeSchedule:
    """The probe rounds of one membership machine (it arms their timer; this decides their members)."""

    __slots__ = ("targets", "order", "focus", "turns", "turn", "round_at", "next_at", "token")

    def __init__(self, first_at: float) -> None:
        self.targets: tuple[str, ...] | None = None
        """The probe targets (None: every member)."""
        self.order = RoundRobin()
        self.focus: list[str] = []
        self.turns: list[str] = []
        self.turn = 0
        self.round_at = -math.inf
        """When the last probe round started."""
        self.next_at = first_at
        """When the next probe round starts (its timer's token: ``token``)."""
        self.token = 0

    def set_targets(self, names: tuple[str, ...] | None) -> None:
        self.targets = names
        self.order.restart()

    def set_focus(self, focus: set[str], turns: set[str]) -> bool:
        """Members probed every round, and members probed in turn; True if there are any."""
        self.focus = sorted(focus)
        self.turns = sorted(turns - focus)
        self.turn = 0
        return bool(self.focus or self.turns)

    def batch(self, probe_batch: int) -> int:
        """Round-robin candidates this round takes."""
        return 1 if self.focus or self.turns else probe_batch

    def next_target(self, table: MemberTable, rng: RandomSource, me: str) -> str | None:
        """The next live candidate of the shuffled round robin, or None."""
        targets = self.targets
        base, extra = table.base_order, table.extra_order
        n_names = len(targets) if targets is not None else len(base) + len(extra)
        if n_names == 0:
            return None
        order = self.order
        for _ in range(min(n_names, 64) + 1):
            idx = order.next_index(n_names, rng)
            name: str | None
            if targets is not None:
                name = targets[idx] if idx < len(targets) else None
            elif idx < len(base):
                name = base[idx]
            elif idx - len(base) < len(extra):
                name = extra[idx - len(base)]
            else:
                name = None
            if name is None or name == me:
                continue
            rec = table.member(name)
            if rec is not None and rec.live:
                return name
        return None

    def extras(self, target: str | None) -> list[str]:
        """The members in focus, then the next one in turn (``target``, the round robin's, aside)."""
        out = [name for name in self.focus if name != target]
        turns = self.turns
        if turns:
            self.turn = (self.turn + 1) % len(turns)
            turn = turns[self.turn]
            if turn != target:
                out.append(turn)
        return out
