"""The follower: a thread that reads the agent's event stream and keeps what it says for the loop.

A ``ViewInstalled`` for a newer epoch, or ``Fenced``, aborts the current group
(:class:`~gossiprec.trainer.groups.EpochGroups`): a waiting all-reduce raises within a poll slice and
the trainer enters its recovery, which waits for the newest ``PlanReady`` kept here (``status`` is
polled as a fallback: :meth:`Follower.absorb_status`). A lost agent connection aborts the group too.
``JobFinished`` ends the wait of a spare; failure events are kept for the recovery's timeline.

Every field is written by the follower's thread (or the status poll) and read by the loop under
:attr:`Follower.cond`, which is notified on every change.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from gossiprec.core.election import Plan
from gossiprec.local.client import ControlClient
from gossiprec.local.protocol import ControlError
from gossiprec.trainer.settings import CONTROL_TIMEOUT

FAILURE_EVENTS = frozenset({"MemberFailed", "MemberLeft", "AlertRaised", "MemberSuspected"})


class Follower:
    """Follows the agent at ``control_path`` on its own connection until ``closed`` is set.

    ``abort(reason)`` aborts the current group (agent lost, fenced); ``abort_older(epoch, reason)`` the
    groups of epochs before ``epoch`` (a newer view); ``on_plan(plan)`` is told of each plan as it
    arrives (a donor prepares its stripes). All three run on the follower's thread.
    """

    def __init__(self, control_path: str, closed: threading.Event, *, abort: Callable[[str], None],
                 abort_older: Callable[[int, str], None], on_plan: Callable[[Plan], None]) -> None:
        self.control_path = control_path
        self.cond = threading.Condition()
        self.newest_view = -1
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
        self.failure_events: list[float] = []
        self.last_view_at: float | None = None
        self._closed = closed
        self._abort = abort
        self._abort_older = abort_older
        self._on_plan = on_plan
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
                if ev is not None:
                    self.on_event(ev)

    def set_lost(self, why: str) -> None:
        with self.cond:
            self.lost = why
            self.cond.notify_all()
        self._abort(why)

    def on_event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        now = time.monotonic()
        if kind in FAILURE_EVENTS:
            at = float(ev["at"]) if isinstance(ev.get("at"), (int, float)) else now
            with self.cond:
                self.failure_events = [*self.failure_events[-63:], at]
            return
        if kind == "ViewInstalled":
            epoch = int(ev["epoch"])
            with self.cond:
                if epoch > self.newest_view:
                    self.newest_view = epoch
                    self.last_view_at = float(ev.get("at", now))
                if ev.get("stopped"):
                    self.stopped = str(ev["stopped"])
                self.cond.notify_all()
            self._abort_older(epoch, f"view {epoch} installed")
        elif kind == "PlanReady":
            plan = Plan.from_wire(ev.get("plan"))
            with self.cond:
                self.plans[plan.epoch] = plan
                self.planned_at[plan.epoch] = float(ev.get("at", now))
                self.newest_view = max(self.newest_view, plan.epoch)
                self.cond.notify_all()
            self._on_plan(plan)
        elif kind == "JobFinished":
            with self.cond:
                self.finished = int(ev.get("step", -1))
                self.cond.notify_all()
        elif kind == "Fenced":
            with self.cond:
                self.fenced = str(ev.get("reason", "fenced"))
                self.cond.notify_all()
            self._abort(f"fenced: {self.fenced}")

    def absorb_status(self, st: dict[str, Any], epoch: int) -> None:
        """What a ``status`` reply tells (the fallback to events): the newest view, whether it stopped
        the job (when newer than ``epoch``), and its plan if not known yet."""
        wire = st.get("plan_wire")
        plan = Plan.from_wire(wire) if wire is not None else None
        view = st.get("view") or {}
        with self.cond:
            self.newest_view = max(self.newest_view, int(view.get("epoch", -1)))
            if view.get("stopped") and int(view.get("epoch", -1)) > epoch:
                self.stopped = str(view["stopped"])
            if plan is not None and plan.epoch not in self.plans:
                self.plans[plan.epoch] = plan
                self.planned_at[plan.epoch] = time.monotonic()

    def trouble(self, epoch: int) -> bool:
        """Whether the loop at ``epoch`` must recover before it goes on."""
        return self.newest_view > epoch or bool(self.fenced) or bool(self.lost)

    def superseded(self, epoch: int) -> str:
        """Why the group of ``epoch`` must not be built any more ("" if it may)."""
        if self.newest_view > epoch:
            return f"view {self.newest_view} supersedes the plan of epoch {epoch}"
        return self.fenced or self.lost

    def detection_since(self, since: float) -> tuple[float | None, float | None]:
        """(the first failure event after ``since``, when the newest view was installed), or None each."""
        with self.cond:
            seen = [t for t in self.failure_events if t > since]
            return (min(seen) if seen else None), self.last_view_at
