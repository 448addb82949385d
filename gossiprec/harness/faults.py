"""Faults for a local job's trainers: what kind, at which phase of which step, and the hook that fires them.

A :class:`Fault` is one of ``kill`` (SIGKILL), ``stop`` (SIGSTOP: a hang), ``hang`` (the trainer
sleeps at its phase until it is killed: a hang its own agent cannot see, since the process runs and
answers), ``slow`` (a stall of :data:`SLOW_S`), ``lag`` (a sleep of the injector's ``lag_s`` at its phase
of *every* step from its step on: a straggler, slow but moving), ``hold`` (a stall until the trainer's agent has the
plan of a newer view and the trainer knows that view) or ``pause``
(the whole node, agent and trainer, SIGSTOPped until the others have recovered without it, then
SIGCONTed, the trainer first: the node is cut off, then heals, as a minority would) or ``reprovision``
(the whole node SIGKILLed, then started again with the same job spec once the others have recovered
without it: a host replaced under the same name) or ``crash`` (the whole host dies for good, without a
word: its network cut, then every process on it SIGKILLed; see ``LocalJob.crash``). Without a phase,
the orchestrator sends the signal from outside once the node has committed the fault's step (kill,
stop, pause, reprovision and crash; the last three have no phase). With one, the trainer acts on
itself through :class:`FaultInjector`, its ``on_phase`` hook, at that phase of the step: ``compute``,
``communicate`` (the all-reduce in flight), ``optimizer``, ``committed`` (between steps), ``forward``,
``backprop`` (the backward pass) and ``clip`` (after backward, before the clip-norm all-reduce; these
three fired by a trainer that hooks its model: :mod:`gossiprec.harness.sharded_trainer`), ``checkpoint``
(as a save between steps begins, inside ``rt.checkpointing()``), or ``serve``: a donor,
:data:`SERVE_KILL_DELAY` after a receiver asked it for state, with the receivers slowed by
``slow_fetch`` seconds per chunk so that it dies mid-transfer. Before a kill or stop the injector
records when it fired (the timelines are measured from that moment).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from gossiprec.errors import ConfigError

FAULT_KINDS = ("kill", "stop", "hang", "slow", "lag", "hold", "pause", "reprovision", "crash")
STALLS = ("slow", "lag", "hold")
"""Kinds that only stall the trainer (not failures: not recorded as the fault, nor reported on)."""
OUTSIDE_ONLY = ("pause", "reprovision", "crash")
"""Kinds sent to a whole node from outside (no phase)."""
SLOW_S = 0.3
"""How long a ``slow`` fault stalls its trainer at its phase."""
HOLD_MAX_S = 10.0
"""A ``hold`` fault stalls its trainer until its agent has the plan of a newer epoch (and the trainer knows
that view), at most this long."""
FAULT_PHASES = (
    "compute", "communicate", "optimizer", "committed", "serve", "forward", "backprop", "clip", "checkpoint",
)
SERVE_KILL_DELAY = 0.2
"""A donor with a ``serve`` fault signals itself this long after a receiver asked it for state (it
seals the state and sends the header first; a receiver slowed by ``slow_fetch`` is still reading)."""


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault for node ``node``'s trainer: ``kind`` kill (SIGKILL), stop (SIGSTOP, a hang), hang (it
    sleeps until killed), slow (it stalls :data:`SLOW_S` seconds) or hold (it stalls until its agent has
    the plan of a newer view).

    ``phase`` None: the orchestrator sends the signal once the node has committed ``step`` (kill,
    stop). Otherwise the trainer acts itself at that phase of step ``step`` (see the module docstring;
    for ``serve``, at the first request for a step >= ``step``).
    """

    node: str
    kind: str = "kill"
    step: int = 0
    phase: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.phase is not None and self.phase not in FAULT_PHASES:
            raise ConfigError(f"fault phase must be None (sent by the demo) or one of {FAULT_PHASES}, "
                              f"got {self.phase!r}")
        if self.phase is None and self.kind not in ("kill", "stop", *OUTSIDE_ONLY):
            raise ConfigError(f"a {self.kind} fault happens inside the trainer: give it a phase")
        if self.phase is not None and self.kind in OUTSIDE_ONLY:
            raise ConfigError(f"a {self.kind} fault acts on the whole node from outside: give it no phase")

    def spec(self) -> str:
        """The trainer's ``--fault`` argument: ``KIND@PHASE:STEP``."""
        return f"{self.kind}@{self.phase}:{self.step}"

    @classmethod
    def parse(cls, node: str, text: str) -> Fault:
        try:
            kind, rest = text.split("@", 1)
            phase, step = rest.split(":", 1)
            return cls(node, kind, int(step), phase)
        except ValueError:
            raise ConfigError(f"bad fault {text!r}: write KIND@PHASE:STEP, e.g. kill@communicate:20") from None


def newest_plan_epoch(rt: Any) -> int:
    """The epoch of the newest plan the agent of ``rt`` (a ResilientTrainer) has, once the trainer's own
    follower knows that view too: what a ``hold`` fault waits for (a hold that ended on the agent's word
    alone let the held commit run before the trainer knew of the view, a commit that overwrites its one
    copy; seen under load)."""
    plan = rt.control.status().get("plan")
    return min(int(plan["epoch"]) if plan else -1, int(rt._follower.newest_group))


class FaultInjector:
    """The trainer's ``on_phase`` hook: signals this process at the faults' phases (once each; every fault
    due at one call fires then, in the order given), and sleeps ``slow_fetch`` seconds per received
    chunk (stretches a transfer), and ``lag_s`` seconds at a ``lag`` fault's phase of every step from its
    step on. Before a signal it writes
    ``{kind, phase, step, t}`` (``t``: ``time.monotonic()``) to ``record``."""

    def __init__(self, faults: Sequence[Fault], record: Path, slow_fetch: float = 0.0,
                 send: Callable[[int, int], None] = os.kill,
                 plan_epoch: Callable[[], int] = lambda: -1, lag_s: float = 0.0) -> None:
        self.faults = list(faults)
        self.lag_s = lag_s
        self.record = record
        self.slow_fetch = slow_fetch
        self.send = send
        self.plan_epoch = plan_epoch
        """The epoch of the newest plan this trainer's agent has (what a ``hold`` fault waits for)."""
        self._lock = threading.Lock()

    def __call__(self, step: int, phase: str) -> None:
        if phase == "fetch":
            if self.slow_fetch > 0:
                time.sleep(self.slow_fetch)
            return
        with self._lock:
            due = [f for f in self.faults if f.phase == phase and step >= f.step]
            if phase == "serve":
                due = due[:1]
            for f in due:
                if f.kind != "lag":  # (a lag fault acts at every step)
                    self.faults.remove(f)
        if not due:
            return
        if phase == "serve":  # answer first, die while sending
            timer = threading.Timer(SERVE_KILL_DELAY, self.fire, (due[0], step))
            timer.daemon = True
            timer.start()
            return
        for f in due:  # in the order given: a slow fault before a kill delays the kill
            self.fire(f, step)

    def fire(self, fault: Fault, step: int) -> None:
        if fault.kind in STALLS:  # a stall, not a failure: not recorded as the fault
            if fault.kind in ("slow", "lag"):
                time.sleep(SLOW_S if fault.kind == "slow" else self.lag_s)
                return
            start, deadline = self.plan_epoch(), time.monotonic() + HOLD_MAX_S
            while self.plan_epoch() <= start and time.monotonic() < deadline:
                time.sleep(0.005)
            return
        self.record.write_text(json.dumps({"kind": fault.kind, "phase": fault.phase, "step": step,
                                           "t": time.monotonic()}))
        if fault.kind == "hang":  # alive and answering, stuck here: its launcher kills it once it is removed
            while True:
                time.sleep(3600)
        self.send(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)

