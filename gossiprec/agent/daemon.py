"""The agent: a thin asyncio pump around the sans-IO protocol machine.

Theory of operation
-------------------
An :class:`Agent` owns these things and moves data between them; it decides nothing itself:

- the *machine* (today :class:`~gossiprec.core.membership.Membership`, built by :func:`build_machine`;
  any object with the :class:`Machine` interface will do, so the agreement layer's bigger machine is a
  one-line change of factory),
- the :class:`~gossiprec.agent.transport.Transport` (sealed UDP datagrams and TCP messages),
- the :class:`~gossiprec.local.control.ControlServer` (Unix socket for the training process) and the
  :class:`~gossiprec.local.progress.ProgressPage` beside it, where the trainer writes its step, phase and
  state without waking the agent: the pump reads it before every packet and tick it hands the machine,
- the trainer's exit bell (:class:`~gossiprec.local.bell.BellWatcher`, a thread started once the trainer
  has armed it): when the trainer dies the kernel rings it before tearing the trainer's memory down,
  and the agent leaves at once (:meth:`Agent.leave_now`) and stops, like the launcher does when its
  child exits, only tens of milliseconds earlier,
- an :class:`EventHub` that hands every machine event to subscribers (control clients, the launcher,
  tests) through bounded queues.

The pump: every input (a message from the transport, a control request, a join) is handed to the
machine with ``now = time.monotonic()``, then :meth:`Agent._flush` sends what the machine wants sent,
re-arms the timer at ``machine.next_deadline()`` if that moved (earlier or later) and publishes the
machine's events. The timer is one event-loop callback (``loop.call_at``), not a task: when it
fires it calls ``machine.tick(now)`` if the deadline is due and flushes, which arms it again. Inputs
run synchronously in the transport's callbacks, so a packet is processed as soon as the event loop
sees it. Anything the machine raises on an input or a tick is counted and logged (rate limited);
nothing from the network can stop the agent.

Idle cost: an idle agent's CPU goes mostly to wake-ups, each of which runs on cold caches (on a
loaded 2-core VM ~125 us before any protocol work, ~0.4% of a core at the lan profile's ~30 wake-ups
per second), so the pump wakes only for the machine's deadlines and for packets and does little per
wake-up: a deadline that moved later (an answered probe) re-arms the timer instead of waking for
nothing, no timeout/cancellation machinery runs per sleep, a timer that fires a fraction of a
millisecond early does not spin through the loop (see :meth:`Agent._arm`), and the keyring check
rides on the protocol timer instead of a task of its own.

Life cycle: ``async with Agent(settings) as agent`` (or ``await agent.run()``, which also handles
SIGTERM/SIGINT/SIGHUP when asked). Leaving the block, :meth:`Agent.stop` or a signal performs a
graceful leave: ``machine.leave(now)`` is flushed at once, the agent keeps pumping for
``leave_drain`` seconds (a few gossip intervals) so the leave spreads, waits briefly for reliable
messages in flight, then closes the control socket and the transport. :meth:`Agent.abort` closes every
socket at once without leaving (a crash, for tests). Every task belongs to the agent's TaskGroup (or
to the transport's / control server's own), entered in :meth:`start` and awaited in :meth:`aclose`;
both must run in the same task, as ``async with`` does.

A new process takes wall-clock milliseconds as its incarnation, so a restarted node always comes back
newer than every record of its previous life. The keyring file is checked for changes every
``keyring_check_s`` seconds (one ``stat``, on the timer; and reloaded on SIGHUP); a bad file keeps the
keys in memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import signal
import sys
import time
from collections import deque
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterable, Protocol, TypeVar

from gossiprec import __version__
from gossiprec.core.config import Config
from gossiprec.core.membership import Membership
from gossiprec.core.records import MemberInfo
from gossiprec.core.wire import PHASES, ROLES, STATUS_NAMES
from gossiprec.errors import ConfigError, GossiprecError, ProtocolError
from gossiprec.local.bell import BellWatcher
from gossiprec.local.control import ControlServer, event_to_dict, state_problem
from gossiprec.security.keyring import Keyring, KeyringError
from gossiprec.local.progress import ProgressPage, page_path_for
from gossiprec.agent.transport import Throttle, Transport, TransportLimits, routable_ip
from gossiprec.agent.settings import (
    AgentSettings, add_agent_arguments, default_control_path, default_node_name, join_host_port,
    settings_from_args, split_host_port,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_FINISH_EARLY_S = 0.002
"""A timer that fires at most this early sleeps out the rest in place (see Agent._on_timer)."""
_STATE_KEYS = ("committed_step", "inflight_step", "state_bytes", "transfer_port")
"""The fields of ``trainer_state`` in the status reply (the control socket's ``state`` message)."""


# --- the machine seam -------------------------------------------------------------------------------
class Machine(Protocol):
    """What the agent needs of a protocol machine (Membership today, the agreement machine later)."""

    counters: dict[str, int]

    def receive(self, data: bytes, now: float, reliable: bool = False) -> None: ...
    def tick(self, now: float) -> None: ...
    def next_deadline(self) -> float: ...
    def take_sends(self) -> list[Any]: ...
    def take_events(self) -> list[Any]: ...
    def join(self, seed_addrs: Iterable[str], now: float) -> None: ...
    def leave(self, now: float) -> None: ...
    def set_progress(self, step: int, phase: int, step_ms: int) -> None: ...
    def members(self) -> list[Any]: ...
    def progress(self, name: str) -> Any | None: ...
    def health(self) -> int: ...


MachineFactory = Callable[..., Machine]
"""``factory(config, name, addr, *, incarnation, role, now, rng, seeds) -> Machine``."""


def build_machine(config: Config, name: str, addr: str, *, incarnation: int, role: str, now: float,
                  rng: random.Random, seeds: tuple[str, ...] = ()) -> Machine:
    """Membership alone (failure detection without agreement), for tools and tests.

    ``seeds`` (``host:port``, this node's own address removed) is for machines that join by
    themselves; Membership is joined by the agent's join loop through :meth:`Machine.join`.
    """
    return Membership(config, name, addr, incarnation=incarnation, rng=rng, now=now, role=role)


def node_factory(settings: AgentSettings) -> MachineFactory:
    """The machine agents run by default: the whole core (:class:`~gossiprec.core.node.Node`).

    With a job spec (``--job``) every agent starts from the same view 0; a node not listed there, or
    an agent started without a job spec, joins the running job through its seeds (as a spare).
    """
    from gossiprec.core.node import Node
    from gossiprec.agent.jobspec import load_view0

    view0 = load_view0(settings.job) if settings.job else None
    agreement = settings.agreement_config()

    def make(config: Config, name: str, addr: str, *, incarnation: int, role: str, now: float,
             rng: random.Random, seeds: tuple[str, ...] = ()) -> Machine:
        view = view0
        host = rack = ""
        if view is not None:
            me = view.member(name)
            if me is None:
                view = None  # not in view 0: join as a spare
            else:
                if me.addr != addr:
                    raise ConfigError(f"job spec lists {name} at {me.addr}, but this agent is reachable at "
                                      f"{addr}; fix --advertise or the job spec")
                role, host, rack = me.role, me.host, me.rack
        if view is not None:
            members = {m.node: MemberInfo(m.node, m.addr, 1) for m in view.members if m.node != name}
            return Node(config, name, addr, incarnation=incarnation, rng=rng, now=now, view=view, role=role,
                        host=host, rack=rack, members=members, agreement=agreement)
        # not in view 0: joins the running job through its seeds; the view admits it as a spare
        return Node(config, name, addr, incarnation=incarnation, rng=rng, now=now, view=None, role=role,
                    seeds=seeds, agreement=agreement)

    return make


@dataclass(frozen=True, slots=True)
class AgentLeaving:
    """Published by the agent itself when it starts to leave (before its sockets close)."""

    name: str
    reason: str
    failed: bool
    at: float


# --- events to subscribers --------------------------------------------------------------------------
class Subscription:
    """A bounded queue of events. :meth:`get` returns None once closed; on overflow it is closed
    (``overflowed`` set) and its backlog dropped: a consumer that falls behind must resynchronise."""

    def __init__(self, hub: EventHub, maxsize: int) -> None:
        self._hub = hub
        self._items: deque[Any] = deque()
        self._maxsize = maxsize
        self._waiter: asyncio.Future[None] | None = None
        self.overflowed = False
        self.closed = False

    def push(self, event: Any) -> None:
        if self.closed:
            return
        if len(self._items) >= self._maxsize:
            self.overflowed = True
            self._items.clear()
            self.close()
            return
        self._items.append(event)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> Any | None:
        while not self._items:
            if self.closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> Any | None:
        return self._items.popleft() if self._items else None

    def close(self) -> None:
        self.closed = True
        self._hub.discard(self)
        self._wake()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Any:
        ev = await self.get()
        if ev is None:
            raise StopAsyncIteration
        return ev


class EventHub:
    def __init__(self) -> None:
        self._subs: set[Subscription] = set()

    def subscribe(self, maxsize: int = 10_000) -> Subscription:
        sub = Subscription(self, maxsize)
        self._subs.add(sub)
        return sub

    def discard(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    def publish(self, event: Any) -> None:
        for sub in list(self._subs):
            sub.push(event)

    def close_all(self) -> None:
        for sub in list(self._subs):
            sub.close()

    def __len__(self) -> int:
        return len(self._subs)


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
    ) -> None:
        self.settings = settings
        self.config = settings.protocol_config()
        self.machine_factory = machine_factory if machine_factory is not None else node_factory(settings)
        self.keyring = keyring
        self.leave_drain = leave_drain if leave_drain is not None else max(0.1, 4 * self.config.gossip_interval)
        self.keyring_check_s = keyring_check_s
        self.join_retry_s = join_retry_s
        self.handle_signals = handle_signals
        self.rng = rng if rng is not None else random.Random()
        self._limits = limits
        self.machine: Machine | None = None
        self.transport: Transport | None = None
        self.control: ControlServer | None = None
        self.name = settings.name or ""
        self.addr = ""
        self.control_path = ""
        self.incarnation = 0
        self.started_at = 0.0
        self.layout: dict[Any, Any] | None = None
        self.leave_reason: str | None = None
        self.counters: dict[str, int] = {}
        self.hub = EventHub()
        self._progress = (-1, 0, 0)
        self.trainer_state: dict[str, Any] | None = None
        self._page: ProgressPage | None = None
        """The trainer's progress page (see :mod:`gossiprec.local.progress`), read by :meth:`_sync_page`."""
        self._page_seq = 0
        self._bell: BellWatcher | None = None
        """Waits on the trainer's exit bell (see :mod:`gossiprec.local.bell`) once the trainer armed it."""
        self._state = "new"
        self._closing = False
        self._stack: AsyncExitStack | None = None
        self._closed_evt = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        """Monotonic time the timer is armed for (inf: not armed)."""
        self._keyring_due = math.inf
        self._ms_clock = False
        """The loop's timers run on a millisecond clock in time.monotonic()'s scale (uvloop)."""
        self._pump_waiters: list[asyncio.Future[None]] = []
        self._throttle = Throttle(log)
        self._signals: list[int] = []
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
        self._ms_clock = (type(loop).__module__.startswith("uvloop")
                          and abs(loop.time() - time.monotonic()) < 0.05)
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
            self.transport = Transport(s.bind_host, s.port, cluster=self.config.cluster,
                                       on_message=self._on_message, keyring=self.keyring,
                                       insecure=s.insecure, limits=limits)
            await stack.enter_async_context(self.transport)
            port = self.transport.port
            self.name = s.name or default_node_name(port)
            self.addr = await self._advertise(port)
            self.incarnation = int(time.time() * 1000)
            self.started_at = time.monotonic()
            seeds = tuple(a for a in s.seed_addrs() if a != self.addr)
            self.machine = self.machine_factory(self.config, self.name, self.addr,
                                                incarnation=self.incarnation, role=s.role,
                                                now=self.started_at, rng=self.rng, seeds=seeds)
            self.control_path = s.control_socket or default_control_path(port)
            self.control = ControlServer(self.control_path, self)
            await stack.enter_async_context(self.control)
            self._page = ProgressPage.create(page_path_for(self.control_path))  # the socket's directory: checked
            stack.callback(self._close_page)
            tg = await stack.enter_async_context(asyncio.TaskGroup())
            if self.keyring is not None and self.keyring.path is not None:
                self._keyring_due = time.monotonic() + self.keyring_check_s
            if seeds:
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
            if self.transport is not None:
                await self.transport.drain(self.transport.limits.connect_timeout)
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
        now = time.monotonic()
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

    # ------------------------------------------------------------------ the pump
    def _on_message(self, payload: bytes, reliable: bool) -> None:
        m = self.machine
        if m is None or self._closing:
            self._count("rx_before_start" if m is None else "rx_after_close")
            return
        self._sync_page()
        try:
            m.receive(payload, time.monotonic(), reliable)
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
            self._arm(time.monotonic() + 0.01)  # retry soon; do not spin on a persistent bug
            return
        self._arm(deadline)  # before publishing: nothing below may leave the machine without a timer
        if events:
            hub = self.hub
            for ev in events:
                hub.publish(ev)
                _log_event(ev)
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
        if self._ms_clock:
            # uvloop's timers run on a cached millisecond clock in time.monotonic()'s scale and fire
            # within the millisecond after the one they are set for. Aim at the millisecond the
            # deadline falls in: the timer fires at most ~1 ms early and _on_timer sleeps out the rest
            # (measured: ticks 0.36 ms late on average, was 0.46; aiming a millisecond later saves
            # those short sleeps but makes ticks ~1.2 ms late; a plain call_later fires up to ~1 ms
            # early and then spins through the loop until the deadline).
            self._timer = loop.call_at(math.floor(deadline * 1000.0) / 1000.0, self._on_timer)
        else:
            self._timer = loop.call_later(max(0.0, deadline - time.monotonic()), self._on_timer)

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
        now = time.monotonic()
        try:
            if now >= self._keyring_due:
                self._keyring_due = now + self.keyring_check_s
                self.reload_keyring()
            deadline = m.next_deadline()
            if deadline > now:
                if deadline - now > _FINISH_EARLY_S:
                    self._arm(deadline)  # the keyring's wake-up, or a deadline that moved
                    return
                # A millisecond timer fired just before the deadline: sleep out the fraction instead
                # of going around the loop (a re-arm rounds to 0 or 1 ms: a spin or a late tick).
                time.sleep(deadline - now)
                now = time.monotonic()
            m.tick(now)
        except Exception:
            self._count("machine_errors")
            self._throttle.warn("tick", "machine.tick raised", exc_info=True)
            self._arm(now + 0.01)  # retry soon; do not spin on a persistent bug
            return
        self._flush()

    async def _join_loop(self, seeds: list[str]) -> None:
        delay = self.join_retry_s
        while not self._closing and not self.leaving:
            if self._live_count() > 1:
                return
            m = self.machine
            assert m is not None
            log.info("joining through %s", ", ".join(seeds))
            try:
                m.join(seeds, time.monotonic())
            except Exception:
                self._count("machine_errors")
                log.exception("machine.join failed")
            self._flush()
            try:
                await self.wait_until(lambda: self._closing or self._live_count() > 1, delay)
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
                return str(_status_name(rec.status))
        return None

    def _live_count(self) -> int:
        m = self.machine
        if m is None:
            return 0
        n = getattr(m, "n_live", None)
        if isinstance(n, int):
            return n
        return sum(1 for rec in m.members() if getattr(rec, "live", True))

    # ------------------------------------------------------------------ ControlBackend
    @property
    def node_name(self) -> str:
        return self.name

    def control_report(self, step: int, phase: int, step_ms: int) -> None:
        m = self.machine
        if m is None:
            return
        m.set_progress(step, phase, step_ms, time.monotonic())
        self._progress = (step, phase, step_ms)

    def control_set_state(self, committed_step: int, inflight_step: int | None, state_bytes: int,
                          transfer_port: int | None) -> None:
        """The trainer's donatable state; machines without a plan (plain membership) ignore it."""
        self.trainer_state = dict(zip(_STATE_KEYS, (committed_step, inflight_step, state_bytes, transfer_port)))
        set_state = getattr(self.machine, "set_state", None)
        if set_state is not None:
            set_state(committed_step, inflight_step, state_bytes)

    def control_finished(self, step: int) -> None:
        """The trainer finished training at ``step``: tell the cluster the job is done."""
        finish = getattr(self.machine, "finish", None)
        if finish is None or self._closing:
            return
        self._sync_page()
        finish(step, time.monotonic())
        self._flush()

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
            if (rec.step, rec.phase, rec.step_ms) != self._progress:
                self.machine.set_progress(rec.step, rec.phase, rec.step_ms, min(rec.since, time.monotonic()))
                self._progress = (rec.step, rec.phase, rec.step_ms)
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

    def _close_page(self) -> None:
        if self._bell is not None:
            self._bell.stop()
        page, self._page = self._page, None
        if page is not None:
            page.close()
            Path(page.path).unlink(missing_ok=True)

    def control_members(self) -> list[dict[str, Any]]:
        self._sync_page()
        m = self.machine
        if m is None:
            return []
        now = time.monotonic()
        rows: list[dict[str, Any]] = []
        for rec in m.members():
            row: dict[str, Any] = {
                "name": rec.name, "addr": rec.addr, "incarnation": rec.incarnation,
                "status": _status_name(rec.status), "role": _role_name(getattr(rec, "role", 0)),
                "self": rec.name == self.name,
            }
            if rec.name == self.name:
                step, phase, step_ms = self._progress
                row.update(step=step, phase=PHASES[phase], step_ms=step_ms, progress_age_s=0.0)
            else:
                p = m.progress(rec.name)
                if p is not None:
                    row.update(step=p.step, phase=PHASES[p.phase] if 0 <= p.phase < len(PHASES) else p.phase,
                               step_ms=p.step_ms, progress_age_s=round(now - p.seen_at, 6))
                else:
                    row.update(step=-1, phase=None, step_ms=0, progress_age_s=None)
            rows.append(row)
        return rows

    def _unheard_count(self, members: list[Any]) -> int:
        """Members not heard from yet during the startup grace: their silence is not judged until they
        are (or until the grace ends), so a crash of one is seen only then."""
        has_heard = getattr(self.machine, "has_heard", None)
        return 0 if has_heard is None else sum(1 for rec in members if not has_heard(rec.name))

    def control_status(self) -> dict[str, Any]:
        self._sync_page()
        m = self.machine
        s = self.settings
        members = m.members() if m is not None else []
        return {
            "node": self.name, "addr": self.addr, "cluster": self.config.cluster,
            "version": __version__, "incarnation": getattr(m, "incarnation", self.incarnation),
            "role": s.role, "rank": s.rank, "profile": s.profile, "secure": not s.insecure,
            "health": m.health() if m is not None else None,
            "live": self._live_count(), "known": len(members), "unheard": self._unheard_count(members),
            "state": self._state, "leaving": self.leaving, "leave_reason": self.leave_reason,
            "uptime_s": round(time.monotonic() - self.started_at, 3) if self.started_at else 0.0,
            "layout_registered": self.layout is not None,
            "trainer_state": self.trainer_state,
            "progress_page": self._page.path if self._page is not None else None,
            "machine": dict(m.counters) if m is not None else {},
            "agent": dict(self.counters),
            "transport": self.transport.stats() if self.transport is not None else {},
            "control": dict(self.control.counters) if self.control is not None else {},
            "subscribers": len(self.hub),
            **self._view_status(),
        }

    def _view_status(self) -> dict[str, Any]:
        """The agreed view and plan, when the machine runs the agreement core."""
        view = getattr(self.machine, "view", None)
        if view is None:
            return {"view": None}
        plan = getattr(self.machine, "plan", None)
        return {
            "view": {"epoch": view.epoch, "config_id": view.config_id,
                     "members": [{"node": m.node, "role": m.role, "rank": m.rank} for m in view.members],
                     "replica_groups": [list(g) for g in view.topology.replica_groups],
                     "stopped": view.stopped},
            "fenced": getattr(self.machine, "fenced", "") or None,
            "plan": plan.to_dict() if plan is not None else None,
        }

    def control_set_layout(self, layout: dict[Any, Any]) -> None:
        self.layout = layout

    def control_layout(self) -> dict[Any, Any] | None:
        return self.layout

    def control_subscribe(self) -> Subscription:
        return self.subscribe()

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


def _status_name(status: Any) -> Any:
    return STATUS_NAMES[status] if type(status) is int and 0 <= status < len(STATUS_NAMES) else status


def _role_name(role: Any) -> Any:
    return ROLES[role] if type(role) is int and 0 <= role < len(ROLES) else role


_QUIET_EVENTS = frozenset({"ProbeResult"})


def _log_event(ev: Any) -> None:
    name = type(ev).__name__
    level = logging.DEBUG if name in _QUIET_EVENTS else logging.INFO
    if log.isEnabledFor(level):
        log.log(level, "event %s", name, extra={"fields": event_to_dict(ev)})


# --- process entry ----------------------------------------------------------------------------------
def install_event_loop() -> str:
    """Use uvloop's event loop policy when importable; returns ``"uvloop"`` or ``"asyncio"``."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    uvloop.install()
    return "uvloop"


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when available."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            base += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return base


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if fields:
            doc.update(fields)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(fmt: str = "text", level: str = "info", stream: Any = None) -> None:
    """Log ``gossiprec.*`` to stderr as text or JSON lines. Called by the CLI only (never at import)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("gossiprec")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


async def serve(settings: AgentSettings, **agent_kwargs: Any) -> int:
    """Run one agent until SIGTERM/SIGINT; 0 after a graceful leave."""
    agent = Agent(settings, handle_signals=True, **agent_kwargs)
    await agent.run()
    return 0


def _cmd_agent(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"gossiprec agent: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    try:
        return run_async(serve(settings))
    except GossiprecError as exc:
        print(f"gossiprec agent: error: {exc}", file=sys.stderr)
        return 1


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``agent`` sub-command (sets ``func``: ``args.func(args) -> exit code``)."""
    p = subparsers.add_parser(
        "agent", help="run a membership agent without a training process",
        description="Run a gossiprec agent: failure detection and progress gossip for this node. "
                    "SIGTERM/SIGINT leave the cluster gracefully; SIGHUP reloads the keyring.")
    add_agent_arguments(p)
    p.set_defaults(func=_cmd_agent)
    return p  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gossiprec agent")
    add_agent_arguments(parser)
    return _cmd_agent(parser.parse_args(argv))


if __name__ == "__main__":
    # Run the package's copy of this module, not __main__'s, so loggers and classes are the real ones.
    from gossiprec.agent.daemon import main as _main

    sys.exit(_main())
