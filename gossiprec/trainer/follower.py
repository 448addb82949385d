"""The follower: a thread that reads the agent's event stream and keeps what it says for the loop.

A ``ViewInstalled`` for a newer group epoch, or ``Fenced``, aborts the current group
(:class:`~gossiprec.trainer.collectives.groups.EpochGroups`): a waiting all-reduce raises within a poll slice and
the trainer enters its recovery, which waits for the newest ``PlanReady`` kept here (``status`` is
polled as a fallback: :meth:`Follower.absorb_status`). A lost agent connection aborts the group too. A
view that left every trainer's group as it was (a spare joined or left: its ``group_epoch`` is an older
view's) only updates the members: the trainer's groups, plans and epoch go by group epoch.
``JobFinished`` ends the wait of a spare; ``Fenced`` holds a recovery until ``Unfenced`` (the node is
in an agreed view again). Failure events are kept for the recovery's timeline: a recovery is dated by
the first failure event about a member the agreed view no longer holds, counted from when that member
was last seen alive (so a suspicion of a starved member during start-up, refuted since, never dates
the failure of another one).

Every field is written by the follower's thread (or the status poll) and read by the loop under
:attr:`Follower.cond`, which is notified on every change.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from gossiprec.core.election import Plan
from gossiprec.core.events import (
    AlertRaised, CoreEvent, Fenced, JobFinished, MemberAlive, MemberFailed, MemberLeft, MemberSuspected, PlanReady,
    Unfenced, ViewInstalled,
)
from gossiprec.errors import DecodeError
from gossiprec.local.client import ControlClient
from gossiprec.local.protocol import ControlError, ViewBrief, decode_event
from gossiprec.trainer.settings import CONTROL_TIMEOUT

FAILURE_EVENTS = (MemberFailed, MemberLeft, AlertRaised, MemberSuspected)
"""The events that date a failure's detection (the recovery's timeline)."""


class Follower:
    """Follows the agent at ``control_path`` on its own connection until ``closed`` is set.

    ``abort(reason)`` aborts the current group (agent lost, fenced); ``abort_older(epoch, reason)`` the
    groups of epochs before ``epoch`` (a newer view); ``on_plan(plan)`` is told of each plan as it
    arrives (a donor prepares its stripes); ``see_group(epoch)`` is told of each rise of
    :attr:`newest_group`, after :meth:`trouble` says so (the agent's state report waits for it: see
    :mod:`gossiprec.local.progress`). All four run on the follower's thread (``see_group`` also on the
    status poll's).
    """

    def __init__(self, control_path: str, closed: threading.Event, *, abort: Callable[[str], None],
                 abort_older: Callable[[int, str], None], on_plan: Callable[[Plan], None],
                 see_group: Callable[[int], None] = lambda epoch: None) -> None:
        self.control_path = control_path
        self.cond = threading.Condition()
        self.newest_group = -1
        """The newest group epoch known (see :attr:`View.group_epoch <gossiprec.core.view.View.group_epoch>`)."""
        self.view_epoch = -1
        """The newest view epoch known (its members are :attr:`members`)."""
        self.group_of: dict[int, int] = {}
        """View epoch -> its group epoch, for each view installed."""
        self.plans: dict[int, Plan] = {}
        self.planned_at: dict[int, float] = {}
        """When each plan was ready (the agent's clock: ``time.monotonic()`` on this host)."""
        self.fenced = ""
        self.lost = ""
        """Why the connection to the agent is gone ("" while it is not)."""
        self.stopped = ""
        """Why the agreed view stopped the job (no spare, no shrink), if it did."""
        self.finished: int | None = None
        """The step at which the job's trainers finished, once the agent heard of it."""
        self.failures: dict[str, list[float]] = {}
        """When each member was reported failing (suspected, failed, left, alerted about), newest last."""
        self.alive_at: dict[str, float] = {}
        """When each member was last reported alive again (a refuted suspicion, a rejoin)."""
        self.members: frozenset[str] | None = None
        """The members of the newest view installed (None before the first ``ViewInstalled``)."""
        self.last_view_at: float | None = None
        self._closed = closed
        self._abort = abort
        self._abort_older = abort_older
        self._on_plan = on_plan
        self._see_group = see_group
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name="gossiprec-events", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            client = ControlClient(self.control_path, timeout=CONTROL_TIMEOUT)
            client.subscribe()
        except ControlError as exc:
            self.set_lost(f"cannot follow the agent's events: {exc}")
            return
        with client:
            while not self._closed.is_set():
                try:
                    ev = client.next_event(timeout=0.2)
                except ControlError as exc:
                    if not self._closed.is_set():
                        self.set_lost(f"agent connection lost: {exc}")
                    return
                if ev is None:
                    continue
                try:
                    event = decode_event(ev)
                except DecodeError as exc:  # the agent of this very version sent it: a bug, say so
                    self.set_lost(f"the agent sent an event this trainer cannot read ({exc})")
                    return
                if event is not None:
                    self.on_event(event)

    def set_lost(self, why: str) -> None:
        with self.cond:
            self.lost = why
            self.cond.notify_all()
        self._abort(why)

    def on_event(self, ev: CoreEvent) -> None:
        if isinstance(ev, FAILURE_EVENTS):
            who = ev.subject if isinstance(ev, AlertRaised) else ev.name
            with self.cond:
                self.failures[who] = [*self.failures.get(who, [])[-15:], ev.at]
            return
        if isinstance(ev, MemberAlive):
            with self.cond:
                self.alive_at[ev.name] = ev.at
            return
        if isinstance(ev, ViewInstalled):
            with self.cond:
                self.group_of[ev.epoch] = ev.group_epoch
                if ev.epoch > self.view_epoch:
                    self.view_epoch = ev.epoch
                    self.members = frozenset(ev.members)
                if ev.group_epoch > self.newest_group:
                    self.newest_group = ev.group_epoch
                    self.last_view_at = ev.at
                if ev.stopped:
                    self.stopped = ev.stopped
                self.cond.notify_all()
                newest = self.newest_group
            self._see_group(newest)  # first: the agent's report for the view waits for it
            self._abort_older(ev.group_epoch, f"view {ev.epoch} installed")
        elif isinstance(ev, PlanReady):
            plan = ev.plan
            with self.cond:
                self.plans[plan.epoch] = plan
                self.planned_at[plan.epoch] = ev.at
                self.newest_group = newest = max(self.newest_group, plan.epoch)
                self.cond.notify_all()
            self._see_group(newest)
            self._on_plan(plan)
        elif isinstance(ev, JobFinished):
            with self.cond:
                self.finished = ev.step
                self.cond.notify_all()
        elif isinstance(ev, Fenced):
            with self.cond:
                self.fenced = ev.reason or "fenced"
                self.cond.notify_all()
            self._abort(f"fenced: {self.fenced}")
        elif isinstance(ev, Unfenced):
            with self.cond:
                self.fenced = ""
                self.newest_group = newest = max(self.newest_group, self.group_of.get(ev.epoch, ev.epoch))
                self.cond.notify_all()
            self._see_group(newest)

    def absorb_status(self, st: dict[str, Any], epoch: int) -> None:
        """What a ``status`` reply tells (the fallback to events): the newest view, whether it stopped
        the job (when newer than ``epoch``), whether this node is fenced, and its plan if not known yet."""
        wire = st.get("plan_wire")
        plan = Plan.from_wire(wire) if wire is not None else None
        view = ViewBrief.from_wire(st["view"]) if st.get("view") else None
        with self.cond:
            if view is not None:
                if view.epoch > self.view_epoch or self.members is None:
                    self.members = frozenset(m.node for m in view.members)
                    self.view_epoch = max(self.view_epoch, view.epoch)
                self.group_of[view.epoch] = view.group_epoch
                self.newest_group = max(self.newest_group, view.group_epoch)
                if view.stopped and view.group_epoch > epoch:
                    self.stopped = view.stopped
                if "fenced" in st:  # the agent's word now: a Fenced or Unfenced event may be missed or late
                    self.fenced = str(st["fenced"] or "")
            if plan is not None and plan.epoch not in self.plans:
                self.plans[plan.epoch] = plan
                self.planned_at[plan.epoch] = time.monotonic()
            newest = self.newest_group
        self._see_group(newest)

    def plan_after(self, epoch: int, deadline: float, *, poll: Callable[[], object] | None = None) -> Plan | None:
        """The plan of the newest view after ``epoch``, once it is in (waits until ``deadline``, calling
        ``poll`` every 0.1 s as a fallback); None when the node is fenced, the agent is lost, or the job
        stopped or finished first, or at the deadline. (The gate's look ahead: the recovery proper is
        :meth:`~gossiprec.trainer.recovery.Recovery.recover`'s.)"""
        next_poll = time.monotonic() + 0.1
        while True:
            with self.cond:
                if self.fenced or self.lost or self.stopped or self.finished is not None:
                    return None
                plan = self.newest_plan(epoch)
                if plan is not None:
                    return plan
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(min(left, 0.05))
            if poll is not None and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + 0.1
                poll()

    def newest_plan(self, epoch: int) -> Plan | None:
        """The plan of the newest view, if it is in and after ``epoch`` (call holding :attr:`cond`)."""
        newest = max(self.plans, default=-1)
        return self.plans[newest] if newest > epoch and newest >= self.newest_group else None

    def poll_status(self, control: ControlClient, epoch: int) -> bool:
        """Ask the agent's status (the fallback to events, see :meth:`absorb_status`); False, and the
        connection marked lost, when the agent cannot be asked."""
        try:
            st = control.status()
        except ControlError as exc:
            self.set_lost(str(exc))
            return False
        self.absorb_status(st, epoch)
        return True

    def trouble(self, epoch: int) -> bool:
        """Whether the loop at ``epoch`` must recover before it goes on."""
        return self.newest_group > epoch or bool(self.fenced) or bool(self.lost)

    def superseded(self, epoch: int) -> str:
        """Why the group of ``epoch`` must not be built any more ("" if it may)."""
        if self.newest_group > epoch:
            return f"group epoch {self.newest_group} supersedes the plan of epoch {epoch}"
        return self.fenced or self.lost

    def detection_since(self, since: float) -> tuple[float | None, float | None]:
        """(the first failure event after ``since`` about a member the newest view no longer holds, counted
        from when that member was last alive; when the newest view was installed), or None each."""
        with self.cond:
            members = self.members
            seen = [t for who, times in self.failures.items() if members is None or who not in members
                    for t in times if t > max(since, self.alive_at.get(who, since))]
            return (min(seen) if seen else None), self.last_view_at
