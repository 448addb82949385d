"""How a rank talks to its agent: progress reports and what it could donate, on the page or the socket.

The agent offers a progress page (:mod:`gossiprec.local.progress`), a shared mapping the trainer writes
without a system call or a wake-up of the agent, and whose exit bell tells the agent of this process's
death before its memory is torn down. Where there is none (or it cannot be opened) the same messages go
over the control socket, never waited for. A socket that fails means the agent is lost: the link says
so through ``on_lost`` (the follower's lost signal, which makes the loop recover and the recovery stop).

What a rank reports is ``(step, phase)``, the collectives entered in that step (the position the agents
compare across ranks to find the one the others wait for), the last step time and the mean wait inside
collectives per step (the straggler check's figure; the page only); what it announces is
the committed step it could serve (and a newer one held in flight), its size and the donor's port.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from gossiprec.core.aggregate import FINISHING
from gossiprec.core.wire import PHASES
from gossiprec.errors import ConfigError
from gossiprec.local.progress import ProgressPage
from gossiprec.local.protocol import ControlError, MemberBrief, ViewBrief

if TYPE_CHECKING:
    from gossiprec.local.client import ControlClient

log = logging.getLogger(__name__)

_PHASE_INDEX = {name: i for i, name in enumerate(PHASES)}
WAITING = "waiting"
"""The phase a rank reports while its collective waits on peers (used when the wire protocol has it)."""


class AgentLink:
    """The rank's side of its agent's page or control socket (see the module docstring).

    ``control``: the connected control client; ``on_lost(why)``: the agent cannot be reached.
    """

    def __init__(self, control: ControlClient, on_lost: Callable[[str], None]) -> None:
        self.control = control
        self._on_lost = on_lost
        self._page: ProgressPage | None = None
        """The agent's progress page; None: reports and state go through the control socket."""
        self.step_ms = 0
        """The last step time reported (ms): the period between two commits."""
        self.wait_ms = 0
        """The mean time per step spent waiting inside collectives over the last few steps (ms; on the
        page only: the agents' straggler check compares it across ranks)."""
        self.at: tuple[int, str] = (-1, "idle")
        """The (step, phase) last reported."""
        self._resume_phase = "idle"
        """The phase last reported other than ``waiting`` (what a slow collective's end reports again)."""
        self._coll = 0
        """Collectives entered in the reported step, on every group."""
        self._seen_group = -1
        """The newest group epoch the follower has taken in (written on the page, see :meth:`see_group`)."""

    def open_page(self, status: Mapping[str, Any]) -> None:
        """Report on the page the agent's ``status`` names, if any (and arm its exit bell); a page that
        cannot be opened leaves the socket in use."""
        if not status.get("progress_page"):
            return
        try:
            self._page = page = ProgressPage.open(str(status["progress_page"]))
            page.see_group(self._seen_group)  # (views the follower took in before the page was open)
            # the agent hears of this process's death from the kernel, before its memory is torn down
            log.debug("exit bell %s", "armed" if page.arm_bell() else "not armed (not the main thread, "
                      "another trainer in this process holds it, or no robust mutexes here)")
        except ConfigError as exc:
            log.warning("progress goes through the control socket: %s", exc)

    def admitted(self, status: Mapping[str, Any], deadline: float, *,
                 start_timeout: float) -> tuple[ViewBrief, MemberBrief]:
        """The agent's view and this node in it, once the agent is admitted (from ``status``, then polled
        until ``deadline``; ``start_timeout`` is named in the error)."""
        node = str(self.control.node)
        said = False
        while True:
            view = ViewBrief.from_wire(status["view"]) if status.get("view") else None
            me = view.member(node) if view is not None else None
            if view is not None and me is not None:
                return view, me
            if time.monotonic() >= deadline:
                where = f"it holds view {view.epoch} without this node" if view is not None else "it has no view"
                raise ConfigError(f"node {node}'s agent was not admitted to the job within "
                                  f"{start_timeout:.0f} s ({where}): check its --seeds and --job, and "
                                  "that the job's agents are up")
            if not said:
                log.info("waiting for node %s's agent to be admitted to the job (%s)", node,
                         "no view yet" if view is None else f"view {view.epoch} does not hold it yet")
                said = True
            time.sleep(0.2)
            status = self.control.status()

    def wait_for_spares(self, view: ViewBrief, wait: float, trouble: Callable[[], bool]) -> None:
        """Up to ``wait`` seconds, until every spare of ``view`` has reported (is warm); ``trouble()``: the
        rank must recover first (stop waiting)."""
        spares = {m.node for m in view.members if m.role == "spare"}
        if not spares or wait <= 0:
            return
        self.report(0, "idle")
        deadline = time.monotonic() + wait
        cold = spares
        while time.monotonic() < deadline:
            try:
                rows = self.control.members()
            except ControlError:
                return
            cold = spares - {str(r["name"]) for r in rows if int(r.get("step", -1) or 0) >= 0
                             and r.get("phase") is not None}
            if not cold or trouble():
                return
            time.sleep(0.05)
        log.warning("spares %s not up after %.0f s (wait_for_spares): training starts without them",
                    sorted(cold), wait)

    def report(self, step: int, phase: str) -> None:
        """Progress: ``step`` in ``phase`` (the collective count starts again with a new step)."""
        if step != self.at[0]:
            self._coll = 0  # the count is per step
        self.at = (step, phase)
        if phase != WAITING:
            self._resume_phase = phase
        page = self._page
        if page is not None:
            page.report(step, _PHASE_INDEX[phase], self.step_ms, self._coll, self.wait_ms)
            return
        try:
            self.control.report(step, phase, self.step_ms, wait=False)
        except ControlError as exc:
            self._on_lost(str(exc))

    def see_group(self, group_epoch: int) -> None:
        """The follower has taken in the view of group epoch ``group_epoch`` (from its thread): the agent
        holds its state report for that view until the page says so (see :mod:`gossiprec.local.progress`).
        Without a page there is nothing to tell: that agent reports at once."""
        self._seen_group = max(self._seen_group, group_epoch)
        page = self._page
        if page is not None:
            page.see_group(group_epoch)

    def finishing(self, step: int) -> None:
        """Step ``step`` is about to be committed: unless the page already shows it in a phase that may
        commit, say so first, so that the agent holds a new view's report until the commit (see
        :mod:`gossiprec.local.progress`)."""
        if self.at[0] != step or _PHASE_INDEX[self.at[1]] not in FINISHING:
            self.report(step, "optimizer")

    def restart_count(self) -> None:
        """A step begins (again, after a recovery): its collective count starts from 0."""
        self._coll = 0

    def on_slow(self, step: int) -> Callable[[], None] | None:
        """What a collective of ``step`` that waits on peers calls: report it as waiting (None when the
        wire protocol has no such phase)."""
        return (lambda: self.report(step, WAITING)) if WAITING in PHASES else None

    def resumed(self) -> None:
        """A slow collective completed: the rank no longer reads as waiting (a later stall must not)."""
        step, phase = self.at
        if phase == WAITING:
            self.report(step, self._resume_phase)

    def entered(self, *, communicating: bool = False) -> None:
        """A collective is entered: the position the agents compare moves on (on the page only).
        ``communicating``: a step still in ``compute`` is reported as communicating from now on."""
        self._coll += 1
        step, phase = self.at
        if communicating and phase == "compute" and step >= 0:
            self.report(step, "communicate")
            return
        page = self._page
        if page is not None and step >= 0:
            page.report(step, _PHASE_INDEX[phase], self.step_ms, self._coll)

    def set_state(self, committed: int, inflight: int | None, nbytes: int, port: int | None) -> None:
        """What this rank could serve: committed step ``committed`` (and ``inflight``, a newer step held
        too), ``nbytes`` of it (0: nothing), from the donor on ``port``."""
        page = self._page
        if page is not None:
            page.set_state(committed, inflight, nbytes, port)
            return
        try:
            self.control.set_state(committed, inflight, nbytes, port, wait=False)
        except ControlError as exc:
            self._on_lost(str(exc))

    def tell_state(self, committed: int, inflight: int | None, nbytes: int, port: int | None) -> None:
        """:meth:`set_state` over the control socket whether or not the page is open, a failure ignored:
        the recovery's word of what this rank holds after a plan, which the agent applies at once (the
        page's own state replaces it at the page's next write)."""
        try:
            self.control.set_state(committed, inflight, nbytes, port, wait=False)
        except ControlError:
            pass

    def recovered(self, record: Mapping[str, Any]) -> None:
        """A finished recovery (:meth:`~gossiprec.trainer.recovery.RecoveryRecord.to_wire`), for the agent's
        metrics and timeline file: over the control socket, never waited for, a failure ignored (figures,
        not control: a lost agent is noticed by the reports)."""
        try:
            self.control.recovered(record, wait=False)
        except ControlError as exc:
            log.debug("could not tell the agent of the recovery: %s", exc)

    def checked(self, ok: bool) -> None:
        """How a comparison of the replicas ended, for the agent's counters (as :meth:`recovered`)."""
        try:
            self.control.checked(ok, wait=False)
        except ControlError as exc:
            log.debug("could not tell the agent of the replica check: %s", exc)

    def close(self) -> None:
        """Close the page (the socket is the caller's)."""
        page, self._page = self._page, None
        if page is not None:
            page.close()
