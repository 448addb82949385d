"""What the agent keeps of its trainer's recoveries and steps: Prometheus metrics and the timeline file.

The trainer tells its agent of each finished recovery (the control request ``recovered``, a record of
:data:`~gossiprec.local.protocol.RECOVERY_FIELDS`) and of each comparison of the replicas' digests
(``checked``); the agent reads its trainer's step from the progress it already gets. :class:`RecoveryLog`
turns these into

- **metrics** (when the agent serves them, ``--metrics-port``; :class:`RecoveryMetrics`, in the agent's
  registry): ``gossiprec_recoveries_total{action}``, ``gossiprec_recovery_seconds`` (the RTO) and
  ``gossiprec_recovery_phase_seconds{phase}`` histograms, ``gossiprec_recovery_lost_steps_total``,
  ``gossiprec_recovery_bytes_total{donor}`` and ``gossiprec_recovery_throughput_bytes_per_second{donor}``
  (the last transfer from that donor; a receiver's bytes are shared evenly among the stripes' donors, as
  the plan stripes them), ``gossiprec_replica_checks_total``, ``gossiprec_replica_mismatches_total``,
  ``gossiprec_hang_reports_total`` (alerts this node raised for a hung member), and the trainer's
  ``gossiprec_step{rank}`` and ``gossiprec_step_seconds{rank}`` (mean seconds per step over the last
  sample);
- **the timeline file** (``--timeline``, default ``gossiprec-timeline.jsonl`` in the working directory of
  ``gossiprec agent`` / ``gossiprec run``): JSON lines, each with ``"v": 1``, ``"kind"``, ``"time"`` (unix
  seconds) and ``"node"``; one ``recovery`` line per recovery (the record's fields), and a ``steps`` line
  every :data:`SAMPLE_S` seconds while the trainer steps (``rank``, ``step``, ``step_s``: mean seconds per
  step since the last line, ``behind_ms``: 0, not measured here).

Lines are appended by one thread (:class:`TimelineWriter`), each with one ``write`` on an ``O_APPEND``
descriptor (so agents may share one file), and a slow disk never holds the agent's loop;
at most :data:`MAX_QUEUED` lines wait (more are dropped and counted). A write that fails is counted and
logged once (a warning); the next line tries again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Mapping, Protocol

from gossiprec.local.protocol import RECOVERY_PHASES

log = logging.getLogger(__name__)

TIMELINE_VERSION = 1
SAMPLE_S = 5.0
"""Seconds between two ``steps`` lines."""
MAX_QUEUED = 10_000
"""Lines that may wait for the writer thread; more are dropped (counted)."""
RECOVERY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
"""Histogram buckets of the RTO and its phases (seconds)."""


def timeline_path(setting: str | None) -> str | None:
    """The file a ``timeline`` setting names; None for none (unset, empty or ``-``)."""
    return None if setting is None or setting.strip() in ("", "-") else setting


class TimelineWriter:
    """Appends lines to ``path`` on a thread of its own (started with the first line). ``on_error(key)`` is
    told of each failed write (``timeline_errors``) and dropped line (``timeline_dropped``)."""

    def __init__(self, path: str, on_error: Callable[[str], None] = lambda key: None) -> None:
        self.path = path
        self._on_error = on_error
        self._queue: queue.Queue[str | None] = queue.Queue(MAX_QUEUED)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._warned = False
        self.written = 0

    def write(self, doc: Mapping[str, Any]) -> None:
        """Queue one line (never blocks)."""
        if self._closed:
            return
        try:
            self._queue.put_nowait(json.dumps(doc, separators=(",", ":")) + "\n")
        except queue.Full:
            self._on_error("timeline_dropped")
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gossiprec-timeline", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Write what is queued (waiting at most ``timeout`` seconds) and end the thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                return  # the disk hangs: the daemon thread is left to it
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            line = self._queue.get()
            if line is None:
                return
            lines = [line]
            while not self._queue.empty() and len(lines) < 1000:  # (a burst in one write)
                more = self._queue.get_nowait()
                if more is None:
                    self._append(lines)
                    return
                lines.append(more)
            self._append(lines)

    def _append(self, lines: list[str]) -> None:
        try:
            # one write(2) per line on an O_APPEND descriptor: the agents of one host may share a file
            # (a job's timeline), and their lines must not interleave
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                for line in lines:
                    os.write(fd, line.encode())
                    self.written += 1
            finally:
                os.close(fd)
        except OSError as exc:
            self._on_error("timeline_errors")
            if not self._warned:
                self._warned = True
                log.warning("cannot append to the timeline file %s (%s): recoveries are not written there; "
                            "choose another with --timeline, or --timeline - for none", self.path, exc)


class RecoveryMetrics:
    """The recovery figures in the agent's Prometheus ``registry`` (``prom``: the prometheus_client module)."""

    def __init__(self, prom: Any, registry: Any) -> None:
        reg = registry
        self.recoveries = prom.Counter("gossiprec_recoveries", "Recoveries of this agent's trainer, by plan action.",
                                       ["action"], registry=reg)
        self.rto = prom.Histogram("gossiprec_recovery_seconds", "Recovery time: from the trainer noticing the "
                                  "failure to its first step done.", buckets=RECOVERY_BUCKETS, registry=reg)
        self.phase = prom.Histogram("gossiprec_recovery_phase_seconds", "Seconds of each phase of a recovery.",
                                    ["phase"], buckets=RECOVERY_BUCKETS, registry=reg)
        self.lost_steps = prom.Counter("gossiprec_recovery_lost_steps", "Committed steps the recoveries rolled back.",
                                       registry=reg)
        self.bytes = prom.Counter("gossiprec_recovery_bytes", "State bytes received in recoveries, by donor.",
                                  ["donor"], registry=reg)
        self.throughput = prom.Gauge("gossiprec_recovery_throughput_bytes_per_second",
                                     "Bytes per second of the last transfer from each donor.", ["donor"],
                                     registry=reg)
        self.checks = prom.Counter("gossiprec_replica_checks", "Comparisons of the replicas' digests.", registry=reg)
        self.mismatches = prom.Counter("gossiprec_replica_mismatches", "Comparisons of the replicas that differed.",
                                       registry=reg)
        self.hangs = prom.Counter("gossiprec_hang_reports", "Alerts this node raised for a hung member.",
                                  registry=reg)
        self.step = prom.Gauge("gossiprec_step", "The last step this agent's trainer reported.", ["rank"],
                               registry=reg)
        self.step_seconds = prom.Gauge("gossiprec_step_seconds", "Mean seconds per step of this agent's trainer "
                                       "over the last sample.", ["rank"], registry=reg)
        for action in ("resume", "shrink", "checkpoint", "stop"):
            self.recoveries.labels(action=action)  # (each shows from the start, at 0)
        for name in RECOVERY_PHASES:
            self.phase.labels(phase=name)
        self._rank: str | None = None

    def recovered(self, rec: Mapping[str, Any]) -> None:
        self.recoveries.labels(action=rec["action"]).inc()
        self.rto.observe(rec["rto_s"])
        for name, seconds in rec["phases"].items():
            self.phase.labels(phase=name).observe(seconds)
        self.lost_steps.inc(rec["lost_steps"])
        donors = rec["donors"]
        if donors and rec["bytes"]:
            share = rec["bytes"] / len(donors)
            for donor in donors:
                self.bytes.labels(donor=donor).inc(share)
                if rec["transfer_s"] > 0:
                    self.throughput.labels(donor=donor).set(share * donors.count(donor) / rec["transfer_s"])

    def steps(self, rank: int, step: int, step_s: float | None) -> None:
        label = str(rank)
        if self._rank is not None and self._rank != label:  # a new rank after a recovery: the old one is gone
            self.step.remove(self._rank)
            try:
                self.step_seconds.remove(self._rank)
            except KeyError:
                pass
        self._rank = label
        self.step.labels(rank=label).set(step)
        if step_s is not None:
            self.step_seconds.labels(rank=label).set(step_s)


class RecoveryLog:
    """One agent's recoveries and step samples, in its metrics (once :meth:`attach` ed) and its timeline file
    (``path``; None: none). ``node()`` is the agent's name; ``count(key)`` its counters."""

    def __init__(self, path: str | None, node: Callable[[], str], count: Callable[[str], None] = lambda key: None,
                 *, wall: Callable[[], float] = time.time) -> None:
        self.node = node
        self.wall = wall
        self.metrics: RecoveryMetrics | None = None
        self.writer = TimelineWriter(path, count) if path is not None else None
        self.count = count
        self.last: dict[str, Any] | None = None
        """The last recovery line."""
        self._base: tuple[int, int, float] | None = None
        """(rank, step, monotonic time) of the last steps line."""

    def attach(self, prom: Any, registry: Any) -> RecoveryMetrics:
        self.metrics = RecoveryMetrics(prom, registry)
        return self.metrics

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _line(self, kind: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        return {"v": TIMELINE_VERSION, "kind": kind, "time": round(self.wall(), 6), "node": self.node(), **fields}

    def recovered(self, record: Mapping[str, Any]) -> None:
        """A ``recovered`` request's record (checked by :func:`~gossiprec.local.protocol.recovered_args`)."""
        line = self._line("recovery", record)
        self.last = line
        self.count("recoveries")
        if self.metrics is not None:
            self.metrics.recovered(record)
        if self.writer is not None:
            self.writer.write(line)

    def checked(self, ok: bool) -> None:
        if self.metrics is not None:
            self.metrics.checks.inc()
            if not ok:
                self.metrics.mismatches.inc()

    def observe(self, ev: Any) -> None:
        """A machine event (the metrics follower's): an alert this node raised for a hung member counts."""
        if self.metrics is not None and type(ev).__name__ == "AlertRaised" and ev.reason == "hung":
            self.metrics.hangs.inc()

    def sample(self, rank: int, step: int, now: float) -> dict[str, Any] | None:
        """The trainer of ``rank`` is at ``step`` (at monotonic ``now``): its step gauges, and a ``steps`` line
        when it stepped since the last one (returned; None when it did not)."""
        base = self._base
        step_s: float | None = None
        if base is not None and base[0] == rank and step > base[1]:
            step_s = (now - base[2]) / (step - base[1])
        if self.metrics is not None:
            self.metrics.steps(rank, step, step_s)
        if base is not None and base[0] == rank and step == base[1]:
            return None  # no step since the last line: the mean is unknown (the base stays)
        self._base = (rank, step, now)
        if step_s is None:
            return None  # the first look (or a new rank, or a rollback): a base for the next
        line = self._line("steps", {"rank": rank, "step": step, "step_s": round(step_s, 6), "behind_ms": 0.0})
        if self.writer is not None:
            self.writer.write(line)
        return line


class StepSource(Protocol):
    def trainer_step(self) -> tuple[int, int] | None:
        """(rank, step) of this agent's trainer, None when it has no rank or has not stepped."""
        ...


async def sample_steps(source: StepSource, rec: RecoveryLog, closed: asyncio.Event, interval: float = SAMPLE_S) -> None:
    """Sample the trainer's step every ``interval`` seconds until ``closed`` is set."""
    while not closed.is_set():
        try:
            await asyncio.wait_for(closed.wait(), interval)
            return
        except TimeoutError:
            pass
        at = source.trainer_step()
        if at is not None:
            rec.sample(at[0], at[1], time.monotonic())
