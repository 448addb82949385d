"""Figures from a simulation run: detection latency per (failed node, survivor) pair, false positives,
load per node. Pure bookkeeping fed by the cluster's event stream."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from gossiprec.core.events import MemberAlive, MemberFailed, MemberJoined, MemberLeft
from gossiprec.errors import InvariantViolation


def quantiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p99 / max with the nearest-rank method (None when there is nothing to summarise)."""
    if not values:
        return {"p50": None, "p99": None, "max": None}
    s = sorted(values)

    def rank(q: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

    return {"p50": round(rank(0.50), 4), "p99": round(rank(0.99), 4), "max": round(s[-1], 4)}


@dataclass(slots=True)
class DetectionMetrics:
    """Observer of membership events; the figures are defined in ``gossiprec sim --help``."""

    names: list[str]
    index_of: dict[str, int]
    fault_time: dict[int, float] = field(default_factory=dict)
    fault_incarnation: dict[int, int] = field(default_factory=dict)
    detected: dict[tuple[int, int], float] = field(default_factory=dict)
    declared_dead: set[int] = field(default_factory=set)
    first_declared_at: dict[int, float] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    incarnation_of: Any = None  # callable idx -> current real incarnation

    def crashed(self, idx: int, now: float, incarnation: int) -> None:
        self.fault_time[idx] = now
        self.fault_incarnation[idx] = incarnation

    def restarted(self, idx: int) -> None:
        self.fault_time.pop(idx, None)
        self.fault_incarnation.pop(idx, None)

    def __call__(self, now: float, observer: int, ev: Any) -> None:
        t = type(ev)
        if t is MemberFailed or t is MemberLeft:
            subject = self.index_of.get(ev.name)
            if subject is None:
                return
            if subject in self.fault_time and ev.incarnation >= self.fault_incarnation[subject]:
                key = (subject, observer)
                if key not in self.detected:
                    self.detected[key] = now - self.fault_time[subject]
            elif t is MemberFailed:
                self.declared_dead.add(subject)
                self.first_declared_at.setdefault(subject, now)
        elif (t is MemberJoined or t is MemberAlive) and self.incarnation_of is not None:
            subject = self.index_of.get(ev.name)
            if subject is not None and ev.incarnation > self.incarnation_of(subject):
                msg = (f"node {observer} believes {ev.name} is at incarnation {ev.incarnation}, "
                       f"above its real {self.incarnation_of(subject)}")
                self.violations.append(msg)
                raise InvariantViolation(msg)

    def summary(self, survivors: Sequence[int], excused: set[int]) -> dict[str, Any]:
        latencies: list[float] = []
        undetected = 0
        for subject in self.fault_time:
            for obs in survivors:
                if obs == subject:
                    continue
                lat = self.detected.get((subject, obs))
                if lat is None:
                    undetected += 1
                else:
                    latencies.append(lat)
        false_pos = sorted(self.declared_dead - set(self.fault_time) - excused)
        return {
            "detect_s": quantiles(latencies),
            "detected_pairs": len(latencies),
            "undetected": undetected,
            "false_positives": len(false_pos),
            "false_positive_nodes": [self.names[i] for i in false_pos[:20]],
        }


@dataclass(slots=True)
class Progress:
    """Prints a line to stderr every tenth of the virtual duration (off with --quiet)."""

    enabled: bool
    started: float = field(default_factory=time.perf_counter)

    def __call__(self, cluster: Any, t: float, total: float) -> None:
        if self.enabled:
            wall = time.perf_counter() - self.started
            rate = cluster.events_processed / wall if wall > 0 else 0.0
            print(f"  t={t:7.1f}/{total:.0f} virtual s  events={cluster.events_processed:,}  "
                  f"{rate:,.0f} events/s  wall={wall:.1f}s", file=sys.stderr, flush=True)
