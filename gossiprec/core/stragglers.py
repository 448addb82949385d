"""The straggler check: which of this member's subjects the others wait for, and by how much.

What it decides: a :class:`~gossiprec.core.events.Straggler` report (once per episode) about a subject,
its magnitude, and, with ``evict_stragglers``, that a persistent straggler is to be replaced (an alert
of reason ``straggler``, which removes it as a hang does). Inputs: for each rank of the hang check's
sample (this member, its subjects and its observers), its step, its step time and ``wait_ms``: the mean
milliseconds per step its trainer spent waiting inside its collectives over its last few steps.

Rule: in synchronous training every rank waits in each collective for the last one to arrive, so the
rank the others wait for is the one that waits least. A subject's *magnitude* is the median of its
peers' waits minus its own wait (milliseconds per step that the others wait for it). A sample is taken
each time the check runs and the subject's step has moved on since the last one, once the subject is
``straggler_warmup_steps`` past the first step of it this member saw in the view (a job's first steps and
those after a recovery are uneven without any straggler). A subject is a
straggler once its magnitude has been at least ``max(straggler_floor_ms, straggler_ratio * median step
time)`` for ``straggler_samples`` consecutive samples spanning at least ``straggler_steps`` of its steps
(enough for the average its trainer reports, over its last 8 steps, to hold the whole lag): the floor
and the ratio keep the ordinary jitter of a busy machine (a rank descheduled now and then) out, the
count keeps a single slow step out. It is
reported once; the episode ends when its magnitude falls below half the threshold (so a rank near the
threshold is not reported again and again). With ``evict_stragglers``, a straggler (reported) whose
magnitude stays at least ``max(straggler_floor_ms, straggler_evict_ratio * median step time)`` for
``straggler_evict_samples`` consecutive samples is alerted for removal (a spare takes its rank, as after
a hang); the alert is retracted when the magnitude falls below that threshold.

Sans-IO: no clock of its own; the caller passes what it read and acts on the verdicts.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping

from gossiprec.core.config import AgreementConfig


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the check says about ``subject``: ``kind`` "report" (a new straggler episode), "evict"
    (a persistent straggler: alert its removal) or "retract" (an eviction alert no longer holds);
    ``behind_ms``: its magnitude (ms per step the others wait for it); ``step``: its step then."""

    subject: str
    kind: str
    behind_ms: int
    step: int


def behind_of(waits: Mapping[str, int]) -> dict[str, int]:
    """Each rank's magnitude: the median of the others' waits minus its own (ms per step; one rank
    alone: 0). ``waits``: rank name -> its mean wait per step inside collectives (ms)."""
    out: dict[str, int] = {}
    for name, own in waits.items():
        peers = [w for n, w in waits.items() if n != name]
        out[name] = int(round(statistics.median(peers) - own)) if peers else 0
    return out


class StragglerCheck:
    """The straggler check of one member (run by its hang check, see :mod:`gossiprec.core.hangs`)."""

    __slots__ = ("acfg", "runs", "since", "evict_runs", "reported", "evicting", "last_step", "first_step",
                 "behind")

    def __init__(self, acfg: AgreementConfig) -> None:
        self.acfg = acfg
        self.runs: dict[str, int] = {}
        """Subject -> consecutive samples at or above the report threshold."""
        self.since: dict[str, int] = {}
        """Subject -> its step at the first of those samples."""
        self.evict_runs: dict[str, int] = {}
        """Subject -> consecutive samples at or above the eviction threshold."""
        self.reported: set[str] = set()
        """Subjects in a straggler episode (reported once)."""
        self.evicting: set[str] = set()
        """Subjects alerted for removal as stragglers."""
        self.last_step: dict[str, int] = {}
        """Subject -> its step at its last sample (a sample counts only when it moved on)."""
        self.first_step: dict[str, int] = {}
        """Subject -> the first of its steps seen in this view (the warm-up counts from it)."""
        self.behind: dict[str, int] = {}
        """Subject -> its magnitude at its last sample (ms per step; what metrics and ``members`` show)."""

    def start_view(self) -> None:
        """A new view: new groups, maybe new ranks; every count starts again (an eviction alert is the
        view's business: it ends with it)."""
        self.runs.clear()
        self.since.clear()
        self.evict_runs.clear()
        self.reported.clear()
        self.evicting.clear()
        self.last_step.clear()
        self.first_step.clear()
        self.behind.clear()

    def judge(self, ranks: Mapping[str, tuple[int, int, int]], subjects: Iterable[str]) -> list[Verdict]:
        """``ranks``: name -> (step, step_ms, wait_ms) of the fresh records of the sample (trainers in
        training, not recovering); ``subjects``: the ones this member judges. Returns the verdicts."""
        acfg = self.acfg
        times = [ms for _, ms, _ in ranks.values() if ms > 0]
        if len(ranks) < 2 or not times:
            return []
        step_ms = statistics.median(times)
        report_at = max(acfg.straggler_floor_ms, acfg.straggler_ratio * step_ms)
        evict_at = max(acfg.straggler_floor_ms, acfg.straggler_evict_ratio * step_ms)
        behind = behind_of({n: w for n, (_, _, w) in ranks.items()})
        out: list[Verdict] = []
        for s in subjects:
            row = ranks.get(s)
            if row is None:
                continue
            step = row[0]
            if step < self.first_step.setdefault(s, step) + acfg.straggler_warmup_steps:
                continue  # warming up (the job's first steps, or those after a recovery)
            if self.last_step.get(s) == step:
                continue  # no new sample: the same step's figures again
            self.last_step[s] = step
            b = self.behind[s] = behind[s]
            if b >= report_at:
                n = self.runs[s] = self.runs.get(s, 0) + 1
                if n == 1:
                    self.since[s] = step
                first = self.since[s]
                if n >= acfg.straggler_samples and step - first >= acfg.straggler_steps and s not in self.reported:
                    self.reported.add(s)
                    out.append(Verdict(s, "report", b, step))
            else:
                self.runs[s] = 0
                if b < report_at / 2:
                    self.reported.discard(s)  # the episode is over
            if not acfg.evict_stragglers:
                continue
            if b >= evict_at:
                n = self.evict_runs[s] = self.evict_runs.get(s, 0) + 1
                if n >= acfg.straggler_evict_samples and s in self.reported and s not in self.evicting:
                    self.evicting.add(s)
                    out.append(Verdict(s, "evict", b, step))
            else:
                self.evict_runs[s] = 0
                if s in self.evicting:
                    self.evicting.discard(s)
                    out.append(Verdict(s, "retract", b, step))
        return out
