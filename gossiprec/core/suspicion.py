"""One member under suspicion, as this node holds it: Lifeguard's dynamic suspicion timeout.

What it decides: when this node's suspicion of a member runs out. A suspicion starts with the first
accusation this node hears (or makes), at ``suspicion_max(N)``, and shrinks logarithmically towards
``suspicion_min(N)`` with every *independent* accuser, reaching it at ``K = min(suspicion_confirmations,
N - 2)`` confirmations (:func:`~gossiprec.core.config.remaining_suspicion`). A member that only heard of
the suspicion waits ``verify_defer`` longer (``extra``) before it verifies for itself, so that the
accusers' verdict usually reaches it first. What happens then (verification, death, refutation) is
:class:`~gossiprec.core.membership.Membership`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gossiprec.core.config import Config, remaining_suspicion


@dataclass(slots=True)
class Suspicion:
    incarnation: int
    start: float
    min_s: float
    max_s: float
    k: int
    accusers: set[str] = field(default_factory=set)
    token: int = 0
    """Token of its current timer (an older timer of the same suspicion is ignored)."""
    verifying: bool = False
    deferred: bool = False
    extra: float = 0.0

    @classmethod
    def begin(cls, config: Config, n: int, incarnation: int, now: float, accuser: str) -> "Suspicion":
        """The first accusation, in a cluster of ``n`` live members."""
        return cls(incarnation, now, config.suspicion_min(n), config.suspicion_max(n),
                   max(1, min(config.suspicion_confirmations, n - 2)), {accuser})

    def deadline(self) -> float:
        total = self.start + remaining_suspicion(len(self.accusers) - 1, self.k, 0.0, self.min_s, self.max_s)
        return total + self.extra

    def defer(self, config: Config, me: str) -> bool:
        """At the timer: whether this node waits ``verify_defer`` longer before it verifies (once). Only
        members that saw the failure themselves check first; the others give the accusers' verdict (Dead)
        time to arrive, so that N members do not all probe a dead node at once."""
        if config.verify_defer > 0 and not self.deferred and me not in self.accusers:
            self.deferred = True
            self.extra = config.verify_defer
            return True
        return False

    def restart(self, now: float) -> None:
        """Start over from ``now`` with the first accuser only (this node was late, or the suspect
        answered its verification)."""
        self.verifying = False
        self.deferred = False
        self.extra = 0.0
        self.start = now
        self.accusers = set(list(sorted(self.accusers))[:1])
