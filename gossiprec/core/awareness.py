"""Lifeguard local health awareness (LHA): how much this node trusts its own timely processing.

What it decides: a score in ``[0, max - 1]``; probe intervals and timeouts are multiplied by
``score + 1``, so a node that is starved of CPU, or whose network is degraded, slows down instead of
accusing healthy peers. Inputs (deltas chosen by the membership machine):

- a probe that succeeded: -1;
- a probe that failed while fewer nacks came back than helpers were asked (our side is at fault): +1 per
  missing nack;
- being suspected by others and having to refute: +1;
- a timer that fired much later than its deadline (this process was paused): +2.

A node whose score reaches ``accuse_health_limit`` does not start suspicions of its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Awareness:
    max_multiplier: int
    score: int = 0

    def apply(self, delta: int) -> int:
        """Apply a delta, clamp into range, return the new score."""
        score = self.score + delta  # on every probe: comparisons, not min()/max() calls
        top = self.max_multiplier - 1
        self.score = score = 0 if score < 0 else (top if score > top else score)
        return score

    def scale(self, seconds: float) -> float:
        """``seconds * (score + 1)``."""
        return seconds * (self.score + 1)
