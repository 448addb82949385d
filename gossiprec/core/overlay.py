"""The monitoring overlay (Rapid): each member is watched by K observers on K pseudo-random rings.

What it decides: for a view, who observes whom, and the H / L watermarks for each subject.

Ring ``r`` orders the view's members by ``sha256(config_id, r, node)``; in every ring a member's
predecessor observes it. So each member has up to K observers and K subjects (fewer distinct ones when
N is small), spread at random over the cluster, and the whole overlay is a pure function of the view:
every agent derives the same one.

Watermarks, per subject with ``d`` distinct observers:

- ``H = ceil(0.9 * d)``: alerts needed to propose its removal. At K = 10 this is Rapid's 9 of 10: a
  healthy node is evicted only if nine independent observers, spread over racks by the hash, all lose it.
- ``L = max(1, min(H - 1, max(2, floor(0.3 * d))))``: from L alerts on, the subject is *unstable*, and
  no proposal is made while any subject is unstable (for at most ``unstable_timeout``), so correlated
  failures (a rack) accumulate into one proposal instead of a cascade of view changes. L is at least 2
  whenever H allows it: one observer alone (say, a node whose inbound link died and that accuses
  everyone) never makes a subject unstable, so it cannot drag healthy members into the implicit-alert
  rule of the cut detector.

Choice of K: 10 for any N > 10 (Rapid's evaluation; the probability that 9 of 10 random observers
falsely agree is negligible, and the load per node is K probes per K probe intervals, flat in N); for
small jobs K = N - 1, so that in a job of 8 each member is watched by all 7 others and needs 7 alerts.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass, field
from typing import Iterable


def ring_key(config_id: str, ring: int, node: str) -> bytes:
    return hashlib.blake2b(f"{config_id}|{ring}|{node}".encode(), digest_size=8).digest()


def watermarks(d: int) -> tuple[int, int]:
    """(H, L) for a subject with ``d`` distinct observers."""
    if d <= 0:
        return 1, 1
    h = max(1, math.ceil(0.9 * d - 1e-9))
    low = max(1, min(h - 1, max(2, math.floor(0.3 * d)))) if h > 1 else 1
    return h, low


@dataclass(slots=True)
class Overlay:
    config_id: str
    nodes: tuple[str, ...]
    k: int
    _rings: list[tuple[list[bytes], list[str]]] = field(default_factory=list)
    _observers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _subjects: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _joiner_obs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Joiner observers computed so far (a joiner knocks every ``join_retry``; each answer needs them)."""

    @classmethod
    def build(cls, config_id: str, nodes: Iterable[str], k_max: int = 10) -> "Overlay":
        nodes = tuple(sorted(nodes))
        n = len(nodes)
        k = max(0, min(k_max, n - 1))
        ov = cls(config_id, nodes, k)
        obs: dict[str, list[str]] = {x: [] for x in nodes}
        sub: dict[str, list[str]] = {x: [] for x in nodes}
        complete = n - 1 <= k_max  # small job: everyone watches everyone (random rings would repeat)
        for r in range(k):
            keyed = sorted((ring_key(config_id, r, x), x) for x in nodes)
            keys = [kk for kk, _ in keyed]
            order = [x for _, x in keyed]
            ov._rings.append((keys, order))
            for i, x in enumerate(order):
                pred = order[i - 1]
                if pred != x and pred not in obs[x]:
                    obs[x].append(pred)
                    sub[pred].append(x)
        if complete:
            obs = {x: [y for y in nodes if y != x] for x in nodes}
            sub = {x: [y for y in nodes if y != x] for x in nodes}
        ov._observers = {x: tuple(v) for x, v in obs.items()}
        ov._subjects = {x: tuple(v) for x, v in sub.items()}
        return ov

    def observers(self, node: str) -> tuple[str, ...]:
        return self._observers.get(node, ())

    def subjects(self, node: str) -> tuple[str, ...]:
        return self._subjects.get(node, ())

    def joiner_observers(self, joiner: str) -> tuple[str, ...]:
        """The would-be predecessors of a node that is not (yet) in the view: its temporary observers."""
        got = self._joiner_obs.get(joiner)
        if got is not None:
            return got
        out: list[str] = []
        for r, (keys, order) in enumerate(self._rings):
            pos = bisect.bisect_left(keys, ring_key(self.config_id, r, joiner))
            pred = order[pos - 1]
            if pred not in out:
                out.append(pred)
        if not self._rings and self.nodes:
            out = [self.nodes[0]]
        if len(self._joiner_obs) >= 4 * len(self.nodes) + 64:
            self._joiner_obs.clear()  # bounded: names from the network must not grow it without end
        got = self._joiner_obs[joiner] = tuple(out)
        return got

    def thresholds(self, subject: str, joining: bool = False) -> tuple[int, int]:
        d = len(self.joiner_observers(subject) if joining else self.observers(subject))
        return watermarks(d)
