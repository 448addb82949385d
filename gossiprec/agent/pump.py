"""The agent's pump: a thin asyncio loop around the sans-IO protocol machine.

Theory of operation
-------------------
An :class:`Agent` owns these things and moves data between them; it decides nothing itself: the
*machine*, any :class:`~gossiprec.core.machine.Machine` (by default the whole core, built by
:func:`~gossiprec.agent.jobspec.node_factory`); a :class:`~gossiprec.agent.transport.Transport` (sealed
UDP and TCP, or an in-memory network in tests); the :class:`~gossiprec.local.server.ControlServer` for
the training process and the :class:`~gossiprec.local.progress.ProgressPage` beside it, where the
trainer writes its step, phase and state without waking the agent (read before every packet and tick
handed to the machine); the trainer's exit bell (:class:`~gossiprec.local.bell.BellWatcher`), which
rings when the trainer dies, before the kernel has torn its memory down, so the agent leaves at once
and stops; and an :class:`~gossiprec.agent.hub.EventHub` that hands every machine event to subscribers.

Every input (a message, a control request, a join) is handed to the machine with ``now =
clock()`` (``time.monotonic`` unless given), then :meth:`Agent._flush` sends what the machine wants
sent, re-arms the timer at ``machine.next_deadline()`` if that moved and publishes the events. The
timer is one event-loop callback (:mod:`gossiprec.agent.timers`), not a task; it ticks the machine
when the deadline is due. An idle agent's CPU goes mostly to wake-ups, each on cold caches, so the pump
wakes only for deadlines and packets and does little per wake-up: a deadline that moved later re-arms
the timer instead of waking for nothing, no timeout machinery runs per sleep, and the keyring check
(one ``stat`` every ``keyring_check_s``; a bad file keeps the keys in memory) rides on the protocol
timer. Anything the machine raises is counted and logged (rate limited): nothing from the network can
stop the agent.

Life cycle: ``async with Agent(settings) as agent`` (or ``await agent.run()``, which also handles
SIGTERM/SIGINT/SIGHUP when asked). Leaving the block, :meth:`Agent.stop` or a signal performs a
graceful leave: ``machine.leave(now)`` is flushed at once, the agent keeps pumping for ``leave_drain``
seconds (a few gossip intervals) so the leave spreads, waits briefly for reliable messages in flight,
then closes everything. :meth:`Agent.abort` closes every socket at once without leaving (a crash, for
tests). Every task belongs to the agent's TaskGroup (or the transport's / control server's own),
entered in :meth:`start` and awaited in :meth:`aclose`, in the same task. The incarnation is wall-clock
milliseconds, so a restarted node always comes back newer than every record of its previous life.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import signal
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Callable

from gossiprec.agent.hub import AgentLeaving, EventHub, Subscription
from gossiprec.agent.jobspec import node_factory
from gossiprec.core.bootstrap import Booting
from gossiprec.core.bootwords import boot_state, boot_words
from gossiprec.core.events import BootProgress
from gossiprec.agent.logs import log_event
from gossiprec.agent.remote import RemoteOps, is_query
from gossiprec.agent.recoveries import RecoveryLog, sample_steps, timeline_path
from gossiprec.agent.settings import (
    AgentSettings, default_control_path, default_node_name, join_host_port, split_host_port,
)
from gossiprec.agent.status import agent_status, member_rows, status_name
from gossiprec.agent.timers import Clock, LoopTimer, PlainTimer, loop_timer
from gossiprec.agent.transport import (
    NetTransport, Throttle, Transport, TransportFactory, TransportLimits, routable_ip,
)
from gossiprec.core.machine import Machine, MachineFactory
from gossiprec.errors import ProtocolError
from gossiprec.local.bell import BellWatcher, stopped
from gossiprec.local.protocol import state_problem
from gossiprec.local.progress import ProgressPage, page_path_for
from gossiprec.local.server import ControlServer
from gossiprec.security.keyring import Keyring, KeyringError

log = logging.getLogger(__name__)

STOPPED_LOOK_S = 0.1
"""How often the agent looks whether its trainer is stopped (one read of ``/proc/<pid>/stat``)."""

_STATE_KEYS = ("committed_step", "inflight_step", "state_bytes", "transfer_port")
"""The fields of ``trainer_state`` in the status reply (the control socket's ``state`` message)."""


# --- the agent --------------------------------------------------------------------------------------
class Agent:
    """One node: machine + transport + control socket + timer. See the module docstring."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        machine_factory: MachineFactory | None = None,
        keyring: Keyring | None = None,
        limits: TransportLimits | None = None,
        leave_drain: float | None = None,
        keyring_check_s: float = 1.0,
        join_retry_s: float = 1.0,
        handle_signals: bool = False,
        rng: random.Random | None = None,
        clock: Clock = time.monotonic,
        transport_factory: TransportFactory = NetTransport,
    ) -> None:
        self.settings = settings
        self.config = settings.protocol_config()
        self.agreement = settings.agreement_config()
        self.machine_factory = machine_factory if machine_factory is not None else node_factory(settings)
        self.keyring = keyring
        self.leave_drain = leave_drain if leave_drain is not None else max(0.1, 4 * self.config.gossip_interval)
        self.keyring_check_s = keyring_check_s
        self.join_retry_s = join_retry_s
        self.handle_signals = handle_signals
        self.rng = rng if rng is not None else random.Random()
        self.clock = clock
        """The time every input is handed to the machine with. It must run at the event loop's pace, as
        the timer is set on the loop: time.monotonic on a real loop, loop.time on a virtual one."""
        self.transport_factory = transport_factory
        self._limits = limits
        self.machine: Machine | None = None
        self.transport: Transport | None = None
        self.remote: RemoteOps | None = None
        """Answers operators' ``--agent`` queries (:mod:`gossiprec.agent.remote`)."""
        self.control: ControlServer | None = None
        self.name = settings.name or ""
        self.addr = ""
        self.control_path = ""
        self.incarnation = 0
        self.started_at = 0.0
        self.layout: dict[Any, Any] | None = None
        self.leave_reason: str | None = None
        self.boot_failure: str | None = None
        """Why view 0 could not be agreed (an agent started with ``nnodes``), once it gave up."""
        self.counters: dict[str, int] = {}
        self.hub = EventHub()
        self._progress = (-1, 0, 0)
        self._coll = 0
        """The collectives the trainer entered in its current step, as its page last said."""
        self.wait_ms = 0
        """The trainer's mean wait per step inside its collectives (ms), as its page last said."""
        self.trainer_state: dict[str, Any] | None = None
        self.trainer_trained = False
        """Whether the trainer ever reported a committed step with state (sticky: a trainer that held state
        and reports none since must also say it dropped it, by reporting the idle phase)."""
        self._page: ProgressPage | None = None
        """The trainer's progress page (see :mod:`gossiprec.local.progress`), read by :meth:`_sync_page`."""
        self._page_seq = 0
        self._seen_group: int | None = None
        """The newest group epoch the trainer has taken in, as its page last said (None: no page read)."""
        self._bell: BellWatcher | None = None
        """Waits on the trainer's exit bell (see :mod:`gossiprec.local.bell`) once the trainer armed it."""
        self._stopped_since: tuple[int, float] | None = None
        """(pid, since when) while the trainer holding the bell is seen stopped at every look."""
        self._stopped_due = -math.inf
        self._state = "new"
        self._closing = False
        self._stack: AsyncExitStack | None = None
        self._closed_evt = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        """The time (on :attr:`clock`) the timer is armed for (inf: not armed)."""
        self._loop_timer: LoopTimer = PlainTimer(clock)
        self._keyring_due = math.inf
        self._pump_waiters: list[asyncio.Future[None]] = []
        self._throttle = Throttle(log)
        self._signals: list[int] = []
        self.recoveries = RecoveryLog(timeline_path(settings.timeline), lambda: self.name, self._count)
        """The trainer's recoveries and steps, for the metrics and the timeline file (gossiprec.agent.recoveries)."""
        self.metrics: Any = None
        """The Prometheus endpoint (gossiprec.agent.metrics.MetricsServer) when ``metrics_port`` is set."""

    # ------------------------------------------------------------------ life cycle
    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: Any) -> None:
        await self.aclose(graceful=True)

    async def start(self) -> None:
        """Bind, build the machine, open the control socket, start the timer and join the seeds."""
        if self._state != "new":
            raise ProtocolError("an Agent starts once; create a new one")
        self._state = "starting"
        s = self.settings
        self._loop = loop = asyncio.get_running_loop()
        self._loop_timer = loop_timer(loop, self.clock, s.align_timers)
        stack = AsyncExitStack()
        await stack.__aenter__()
        self._stack = stack
        stack.callback(self._disarm)  # runs last: the timer outlives nothing it pumps
        try:
            if self.keyring is None and not s.insecure:
                assert s.keyring is not None
                self.keyring = Keyring.load(s.keyring)
            limits = self._limits or TransportLimits(
                max_datagram_payload=self.config.mtu,
                max_stream_payload=min(self.config.max_stream, 8 * 1024 * 1024))
            self._limits = limits
            transport = self.transport_factory(s.bind_host, s.port, cluster=self.config.cluster,
                                               on_message=self._on_message, keyring=self.keyring,
                                               insecure=s.insecure, limits=limits)
            self.transport = transport
            self.remote = RemoteOps(self, transport.send, self.counters, keyed=self.keyring is not None
                                    and not s.insecure, clock=self.clock, max_message=limits.max_stream_payload)
            await transport.start()
            stack.push_async_callback(transport.aclose)
            port = transport.port
            self.name = s.name or default_node_name(port)
            self.addr = await self._advertise(port)
            transport.set_local_addr(self.addr)  # datagrams sealed for another member are refused
            self.incarnation = int(time.time() * 1000)
            self.started_at = self.clock()
            seeds = tuple(a for a in s.seed_addrs() if a != self.addr)
            self.machine = self.machine_factory(self.config, self.name, self.addr,
                                                incarnation=self.incarnation, role=s.role,
                                                now=self.started_at, rng=self.rng, seeds=seeds)
            self.control_path = s.control_socket or default_control_path(port)
            self.control = ControlServer(self.control_path, self, private_dir=s.control_socket is None)
            await stack.enter_async_context(self.control)
            # in the control socket's directory, which bind_unix_socket checked
            self._page = ProgressPage.create(page_path_for(self.control_path), with_bell=s.exit_bell)
            stack.callback(self._close_page)
            stack.callback(self.recoveries.close)
            tg = await stack.enter_async_context(asyncio.TaskGroup())
            tg.create_task(sample_steps(self, self.recoveries, self._closed_evt, self.settings.timeline_interval),
                           name="gossiprec-steps")
            if self.keyring is not None and self.keyring.path is not None:
                self._keyring_due = self.clock() + self.keyring_check_s
            if isinstance(self.machine, Booting):
                tg.create_task(self._boot_watch(self.machine), name="gossiprec-bootstrap")
            elif seeds:
                tg.create_task(self._join_loop(list(seeds)), name="gossiprec-join")
            if s.metrics_port is not None:
                from gossiprec.agent.metrics import serve_agent_metrics
                self.metrics = await serve_agent_metrics(self, stack, tg)
            if self.handle_signals:
                self._install_signals()
            self._state = "running"
            self._flush()
        except BaseException:
            self._closing = True
            self._state = "closed"
            self._closed_evt.set()  # (ends the step sampler, which the task group waits for)
            self._disarm()
            await stack.aclose()
            raise
        log.info("agent started", extra={"fields": {
            "node": self.name, "addr": self.addr, "incarnation": self.incarnation,
            "role": s.role, "rank": s.rank, "control": self.control_path,
            "secure": not s.insecure, "profile": s.profile}})

    async def aclose(self, graceful: bool = True) -> None:
        """Leave (if ``graceful`` and not aborted), drain, close every socket and task."""
        if self._state in ("new", "closed", "closing", "leaving"):
            self._state = "closed" if self._state == "new" else self._state
            return  # never started, or another caller is already closing it
        if graceful and self._state == "running":
            self._state = "leaving"
            self.leave_now("shutdown")
            await self._sleep(self.leave_drain)
            if self.transport is not None and self._limits is not None:
                await self.transport.drain(self._limits.connect_timeout)
        self._state = "closing"
        self._closing = True
        self._closed_evt.set()
        self._disarm()
        self.hub.close_all()
        self._remove_signals()
        self._release_waiters()
        try:
            if self._stack is not None:
                await self._stack.aclose()
        finally:
            self._state = "closed"
            log.info("agent stopped", extra={"fields": {"node": self.name, "reason": self.leave_reason}})

    async def run(self) -> None:
        """Start, serve until :meth:`stop` (or a signal when ``handle_signals``), then leave and close."""
        async with self:
            await self._stop_requested.wait()

    def stop(self) -> None:
        """Ask :meth:`run` to leave gracefully and return."""
        self._stop_requested.set()

    def abort(self) -> None:
        """Crash on purpose: close every socket now, no leave. :meth:`aclose` finishes the cleanup."""
        if self._state in ("new", "closed", "closing"):
            return
        if self._state != "leaving":
            self._state = "aborted"
        self._closing = True
        if self.leave_reason is None:
            self.leave_reason = "aborted"
        if self.transport is not None:
            self.transport.abort()
        self._closed_evt.set()
        self._disarm()
        self._stop_requested.set()

    def leave_now(self, reason: str, failed: bool = False) -> None:
        """Broadcast this node's departure at once (``machine.leave``), keep pumping until closed.

        ``failed=True`` is the launcher's alarm (the training process died): peers must see this node
        gone within a gossip round instead of waiting for a probe timeout.
        """
        m = self.machine
        if m is None or self._closing or self.leave_reason is not None:
            return
        now = self.clock()
        self.leave_reason = reason
        if failed:
            log.warning("leaving the cluster at once: %s", reason, extra={"fields": {"node": self.name}})
        else:
            log.info("leaving the cluster: %s", reason, extra={"fields": {"node": self.name}})
        self.hub.publish(AgentLeaving(self.name, reason, failed, now))
        try:
            m.leave(now)
        except Exception:
            self._count("machine_errors")
            log.exception("machine.leave failed")
        self._flush()

    @property
    def leaving(self) -> bool:
        return self.leave_reason is not None

    @property
    def state(self) -> str:
        """Where the agent is in its life: new, starting, running, leaving, aborted, closing, closed."""
        return self._state

    @property
    def my_progress(self) -> tuple[int, int, int]:
        """The trainer's (step, phase index, step_ms) as the machine last got it."""
        return self._progress

    @property
    def progress_page_path(self) -> str | None:
        """Where the trainer's progress page is (None before start and after close)."""
        return self._page.path if self._page is not None else None

    # ------------------------------------------------------------------ the pump
    def _on_message(self, payload: bytes, reliable: bool) -> None:
        m = self.machine
        if m is None or self._closing:
            self._count("rx_before_start" if m is None else "rx_after_close")
            return
        if is_query(payload):  # an operator's members/status query, not the protocol's
            if self.remote is not None:
                self.remote.on_query(payload, reliable, getattr(self.transport, "datagram_source", None))
            return
        self._sync_page()
        try:
            m.receive(payload, self.clock(), reliable)
        except Exception:
            self._count("machine_errors")
            self._throttle.warn("receive", "machine.receive raised; message dropped", exc_info=True)
        self._flush()

    def _flush(self) -> None:
        """Send what the machine wants sent, re-arm the timer, publish the machine's events."""
        m, t = self.machine, self.transport
        if m is None or t is None:
            return
        try:
            sends = m.take_sends()
            if sends:
                send = t.send
                for s in sends:
                    send(s.addr, s.payload, s.reliable)
            events = m.take_events()
            deadline = m.next_deadline()
        except Exception:
            self._count("machine_errors")
            self._throttle.warn("flush", "machine output failed", exc_info=True)
            self._arm(self.clock() + 0.01)  # retry soon; do not spin on a persistent bug
            return
        self._arm(deadline)  # before publishing: nothing below may leave the machine without a timer
        if events:
            hub = self.hub
            for ev in events:
                hub.publish(ev)
                if type(ev) is BootProgress and isinstance(m, Booting):
                    log.info("bootstrap: %s", boot_words(boot_state(m.boot)),
                             extra={"fields": {"node": self.name}})
                else:
                    log_event(log, ev)
        if self._pump_waiters:
            self._release_waiters()

    def _release_waiters(self) -> None:
        if self._pump_waiters:
            waiters, self._pump_waiters = self._pump_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    # ------------------------------------------------------------------ the timer
    def _arm(self, deadline: float) -> None:
        """Fire :meth:`_on_timer` at ``deadline``; re-arm only when it changed (earlier or later).

        The keyring check rides on the machine's timer (the first tick after it is due); only a machine
        silent for a whole extra ``keyring_check_s`` gets a wake-up of its own for it.
        """
        keyring_cap = self._keyring_due + self.keyring_check_s
        if keyring_cap < deadline:
            deadline = keyring_cap
        loop = self._loop
        if deadline == self._timer_at or self._closing or loop is None:
            return
        h = self._timer
        if h is not None:
            h.cancel()
        self._timer_at = deadline
        if deadline == math.inf:
            self._timer = None
            return
        self._timer = self._loop_timer.arm(loop, deadline, self._on_timer)

    def _disarm(self) -> None:
        h, self._timer = self._timer, None
        self._timer_at = math.inf
        if h is not None:
            h.cancel()

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        if self._closing:
            return
        m = self.machine
        assert m is not None
        self._sync_page()
        now = self.clock()
        if now >= self._stopped_due:
            self._stopped_due = now + STOPPED_LOOK_S
            self._check_stopped(now)
        try:
            if now >= self._keyring_due:
                self._keyring_due = now + self.keyring_check_s
                self.reload_keyring()
            deadline = m.next_deadline()
            at = self._loop_timer.settle(deadline, now)
            if at is None:
                self._arm(deadline)  # the keyring's wake-up, or a deadline that moved
                return
            now = at
            m.tick(now)
        except Exception:
            self._count("machine_errors")
            self._throttle.warn("tick", "machine.tick raised", exc_info=True)
            self._arm(now + 0.01)  # retry soon; do not spin on a persistent bug
            return
        self._flush()

    async def _boot_watch(self, machine: Booting) -> None:
        """View 0 agreed, or give up after ``bootstrap_timeout`` naming who was found (the agent stops)."""
        s = self.settings
        try:
            await self.wait_until(lambda: self._closing or machine.boot.decided is not None, s.bootstrap_timeout)
        except TimeoutError:
            known = sorted(machine.boot.known)
            self.boot_failure = (
                f"view 0 not agreed within {s.bootstrap_timeout:g} s: {len(known)} of "
                f"{machine.boot.params.expected} agents found ({', '.join(known)}); start the missing ones with "
                f"the same --nnodes {s.nnodes} --nproc-per-node {s.nproc_per_node} --spares {s.spares} and "
                f"--seed list, and check that a majority of the seeds ({', '.join(machine.boot.params.seeds)}) is up")
            log.error("bootstrap failed: %s", self.boot_failure, extra={"fields": {"node": self.name}})
            self.stop()
            return
        if not self._closing and machine.boot.decided is not None:
            boot = machine.boot
            member = any(c.name == self.name for c in boot.decided or ())
            log.info("view 0 agreed through the seeds: %d members%s", len(boot.decided or ()),
                     "" if member else "; this agent is not one of them and joins as a spare",
                     extra={"fields": {"node": self.name}})

    async def _join_loop(self, seeds: list[str]) -> None:
        delay = self.join_retry_s
        while not self._closing and not self.leaving:
            if self.live_count() > 1:
                return
            m = self.machine
            assert m is not None
            log.info("joining through %s", ", ".join(seeds))
            try:
                m.join(seeds, self.clock())
            except Exception:
                self._count("machine_errors")
                log.exception("machine.join failed")
            self._flush()
            try:
                await self.wait_until(lambda: self._closing or self.live_count() > 1, delay)
            except TimeoutError:
                log.warning("no seed answered within %.1f s (%s); retrying", delay, ", ".join(seeds))
                delay = min(delay * 2, 30.0)

    def reload_keyring(self, force: bool = False) -> bool:
        """Reload the keyring file if it changed (or always, ``force``). Errors keep the current keys."""
        ring = self.keyring
        if ring is None or ring.path is None:
            return False
        try:
            if force:
                ring.reload()
                changed = True
            else:
                changed = ring.load_if_changed()
        except KeyringError as exc:
            self._count("keyring_errors")
            self._throttle.warn("keyring", "keyring reload failed, keeping the current keys: %s", exc)
            return False
        if changed:
            self._count("keyring_reloads")
            pid = ring.keyset.primary_id
            log.info("keyring reloaded: %d key(s), primary %s", len(ring), pid.hex() if pid else None)
        return changed

    async def _sleep(self, seconds: float) -> None:
        """Sleep, returning early when the agent closes."""
        try:
            async with asyncio.timeout(seconds):
                await self._closed_evt.wait()
        except TimeoutError:
            pass

    # ------------------------------------------------------------------ waiting (launcher, tests)
    def subscribe(self, maxsize: int = 10_000) -> Subscription:
        """Every machine event from now on (plus :class:`AgentLeaving`)."""
        return self.hub.subscribe(maxsize)

    async def wait_until(self, cond: Callable[[], bool], timeout: float) -> None:
        """Return once ``cond()`` holds, re-checking after every pump; TimeoutError after ``timeout``."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            while not cond():
                if self._state == "closed":
                    raise ProtocolError("the agent is closed")
                fut: asyncio.Future[None] = loop.create_future()
                self._pump_waiters.append(fut)
                await fut

    async def wait_for_event(self, pred: Callable[[Any], bool], timeout: float,
                             sub: Subscription | None = None) -> Any:
        """The first event matching ``pred``, from ``sub`` (subscribe before acting to miss nothing)."""
        own = sub is None
        s = self.subscribe() if sub is None else sub
        try:
            async with asyncio.timeout(timeout):
                while True:
                    ev = await s.get()
                    if ev is None:
                        raise ProtocolError("the agent closed before the event came")
                    if pred(ev):
                        return ev
        finally:
            if own:
                s.close()

    # ------------------------------------------------------------------ views of the state
    def member_status(self, name: str) -> str | None:
        """``alive``/``suspect``/``dead``/``left`` for a known member, else None."""
        m = self.machine
        if m is None:
            return None
        for rec in m.members():
            if rec.name == name:
                return str(status_name(rec.status))
        return None

    def live_count(self) -> int:
        """Members this node holds alive or suspect, itself included (0 before start)."""
        return self.machine.n_live if self.machine is not None else 0

    # ------------------------------------------------------------------ ControlBackend
    @property
    def node_name(self) -> str:
        return self.name

    def control_report(self, step: int, phase: int, step_ms: int) -> None:
        m = self.machine
        if m is None:
            return
        m.set_progress(step, phase, step_ms, self.clock())  # (the control socket carries no collective count)
        self._progress = (step, phase, step_ms)
        self._coll = 0

    def control_set_state(self, committed_step: int, inflight_step: int | None, state_bytes: int,
                          transfer_port: int | None) -> None:
        """The trainer's donatable state, reported to the plan of each new view."""
        self.trainer_state = dict(zip(_STATE_KEYS, (committed_step, inflight_step, state_bytes, transfer_port)))
        if committed_step > 0 and state_bytes > 0:
            self.trainer_trained = True
        if self.machine is not None:
            self.machine.set_state(committed_step, inflight_step, state_bytes)

    def control_finished(self, step: int) -> None:
        """The trainer finished training at ``step``: tell the cluster the job is done."""
        m = self.machine
        if m is None or self._closing:
            return
        self._sync_page()
        m.finish(step, self.clock())
        self._flush()

    def control_recovered(self, record: dict[str, Any]) -> None:
        self.recoveries.recovered(record)

    def control_checked(self, ok: bool) -> None:
        self.recoveries.checked(ok)

    def trainer_step(self) -> tuple[int, int] | None:
        """(rank, step) of the trainer, when it holds a rank of the view and has stepped."""
        self._sync_page()
        view = self.machine.view if self.machine is not None else None
        me = view.member(self.name) if view is not None else None
        step = self._progress[0]
        return (me.rank, step) if me is not None and me.rank is not None and step >= 0 else None

    def _sync_page(self) -> None:
        """Take the trainer's newest progress and state from the page, if it changed since the last look.

        Called before the machine handles a packet or a timer, so whatever it sends carries the
        trainer's progress as of now, and from the status and members requests.
        """
        page = self._page
        if page is None or page.seq() == self._page_seq or self.machine is None:
            return
        if self._bell is None or self._bell.outcome is not None:  # no watcher waiting: has a trainer armed it?
            pid = page.bell_pid()
            if pid and (self._bell is None or self._bell.pid != pid):
                self._watch_bell(page.path, pid)
        rec = page.read()
        if rec is None:
            self._count("progress_page_busy")  # a write under way at every try: keep the last record
            return
        self._page_seq = rec.seq
        try:
            if rec.has_state:  # before the progress: a commit and the next phase seen together, in order
                state = (rec.committed_step, None if rec.inflight_step < 0 else rec.inflight_step,
                         rec.state_bytes, None if rec.transfer_port < 0 else rec.transfer_port)
                problem = state_problem(*state)
                if problem is not None:
                    raise ProtocolError(problem)
                if self.trainer_state != dict(zip(_STATE_KEYS, state)):
                    self.control_set_state(*state)
            if ((rec.step, rec.phase, rec.step_ms) != self._progress or rec.coll != self._coll
                    or rec.wait_ms != self.wait_ms):
                now = self.clock()
                since = now - (time.monotonic() - rec.since)  # the page's stamps are CLOCK_MONOTONIC
                self.machine.set_progress(rec.step, rec.phase, rec.step_ms, min(since, now), rec.coll, rec.wait_ms)
                self._progress = (rec.step, rec.phase, rec.step_ms)
                self._coll = rec.coll
                self.wait_ms = rec.wait_ms
            if rec.seen_group != self._seen_group:  # (after the progress: the report it releases carries it)
                self.machine.set_trainer_seen(rec.seen_group)
                self._seen_group = rec.seen_group
        except ProtocolError as exc:
            self._count("progress_page_invalid")
            self._throttle.warn("page", f"the trainer's progress page holds invalid values, ignored: {exc}")

    def _watch_bell(self, path: str, pid: int) -> None:
        if self._bell is not None:
            self._bell.stop()
        loop = self._loop
        assert loop is not None

        def ring(p: int) -> None:  # on the watcher's thread
            try:
                loop.call_soon_threadsafe(self._bell_rang, p)
            except RuntimeError:
                pass  # the loop is closed: the agent is gone already

        try:
            self._bell = BellWatcher(path, pid, ring)
        except OSError as exc:
            self._bell = None
            log.warning("cannot watch the trainer's exit bell (%s): its death is seen when it has exited", exc)

    def _bell_rang(self, pid: int) -> None:
        """The trainer died holding its exit bell: leave at once (as the launcher does on its exit), stop."""
        if self._closing or self._bell is None or self._bell.pid != pid:
            return
        self._count("trainer_exit_bell")
        self.leave_now(f"the training process (pid {pid}) is dying (its exit bell rang)", failed=True)
        self.stop()

    def _check_stopped(self, now: float) -> None:
        """Leave once the trainer has been stopped (SIGSTOP, a debugger) at every look for as long as
        the hang check gives a stalled rank. Its progress is frozen like everyone's when it stops inside
        a collective (the others wait in the same one), so no observer can tell it from a stall that all
        ranks share; only this host sees the process state. The launcher then kills the stopped trainer
        once the node is out of the view (see :mod:`gossiprec.agent.launcher`)."""
        pid = self._page.bell_pid() if self._page is not None and self._bell is not None else 0
        if not pid or self.leave_reason is not None or not stopped(pid):
            self._stopped_since = None
            return
        if self._stopped_since is None or self._stopped_since[0] != pid:
            self._stopped_since = (pid, now)
            return
        acfg = self.agreement
        limit = max(acfg.hang_floor, acfg.hang_mult * self._progress[2] / 1000.0)
        if now - self._stopped_since[1] >= limit:
            self._count("trainer_stopped")
            self.leave_now(f"the training process (pid {pid}) has been stopped (SIGSTOP or a debugger) for "
                           f"{now - self._stopped_since[1]:.1f} s: a spare takes its rank", failed=True)

    def _close_page(self) -> None:
        if self._bell is not None:
            self._bell.stop()
        page, self._page = self._page, None
        if page is not None:
            page.close()
            Path(page.path).unlink(missing_ok=True)

    def control_members(self) -> list[dict[str, Any]]:
        self._sync_page()
        return member_rows(self, self.clock())

    def control_status(self) -> dict[str, Any]:
        self._sync_page()
        return agent_status(self, self.clock())

    def control_set_layout(self, layout: dict[Any, Any]) -> None:
        self.layout = layout

    def control_layout(self) -> dict[Any, Any] | None:
        return self.layout

    def control_subscribe(self) -> Subscription:
        return self.subscribe()

    def control_follow(self, queue: int, probes: bool) -> Subscription:
        # one event per probe: far too many for a person, unless asked (left out before they queue)
        return self.hub.follow(queue, frozenset() if probes else frozenset({"ProbeResult"}))

    # ------------------------------------------------------------------ helpers
    async def _advertise(self, port: int) -> str:
        s = self.settings
        if s.advertise:
            host, p = split_host_port(s.advertise, default_port=0)
            return join_host_port(host, p or port)
        if s.bind_host not in ("0.0.0.0", "::"):
            return join_host_port(s.bind_host, port)
        return join_host_port(await routable_ip(s.seed_addrs()), port)

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig, handler in ((signal.SIGTERM, self.stop), (signal.SIGINT, self.stop),
                             (signal.SIGHUP, lambda: self.reload_keyring(force=True))):
            try:
                loop.add_signal_handler(sig, handler)
                self._signals.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass

    def _remove_signals(self) -> None:
        if not self._signals:
            return
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        self._signals.clear()

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1
