"""Deterministic discrete-event simulation of a cluster of sans-IO protocol machines.

What it does: runs N copies of the very same core state machine in one process, on a virtual clock,
with one seeded :class:`random.Random` from which every other random choice derives (the network's and
each node's). Same seed, same events, same output, byte for byte.

Event loop: a calendar queue of ``(time, seq, kind, node, payload)`` entries, popped in ``(time, seq)``
order exactly as one heap would (see :meth:`SimCluster._push`). A delivery calls ``receive`` on the
destination; a timer calls ``tick``; after either, the node's outgoing sends become future deliveries
(through :class:`~gossiprec.sim.network.Network`), its events go to the observers (metrics, invariant
checkers) and its next deadline is (re)scheduled. Faults are events too: crash (the node stops, its
timers and inbound traffic vanish), pause (nothing runs; inbound traffic piles up and is delivered, in
arrival order, when it resumes, followed by its overdue timers), restart (a fresh machine with a newer
incarnation that rejoins through seeds).

CPU charges (``charge``, off by default): after a node handled a packet or a timer, ``charge(index,
now)`` says how many virtual seconds of CPU that took it (the signatures it made and checked, see
:mod:`gossiprec.sim.costs`); the node is busy until then. What it sent and emitted leaves at the end
of that time, and what reaches it meanwhile (packets, its due timer) queues and is handled in arrival
order once it is free (a ``WAKE`` entry at the end of the busy time), each charged again.

Observers are called with ``(now, node_index, event)`` for every event a machine emits, wiretaps with
``(now, node_index, payload, reliable)`` for every packet just before a machine receives it (what the
network delivered, for checkers that must not trust the machines' own accounts), and ``check(now)`` may
raise :class:`~gossiprec.errors.InvariantViolation`; the runner prints the seed and the command that
replays it.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic, Protocol, Sequence, TypeVar

from gossiprec.sim.network import Network, NetworkModel

if TYPE_CHECKING:
    from gossiprec.core.events import CoreEvent
    from gossiprec.core.records import Send

DELIVER, TIMER, ACTION, DELIVER_RELIABLE, WAKE = 0, 1, 2, 3, 4
UP, CRASHED, PAUSED = "up", "crashed", "paused"
INF = math.inf
BUCKETS_PER_S = 1000.0
"""Width of a calendar-queue bucket: 1 ms of virtual time (a LAN round trip is ~0.5 ms)."""
_FAR = 1 << 62
"""Bucket of an infinite (or otherwise unbucketable) time: after every finite one."""


class SimMachine(Protocol):
    """What the simulator drives of a machine: its inputs and outputs (a
    :class:`~gossiprec.core.machine.Machine` has them, and so has a membership layer alone)."""

    def receive(self, data: bytes, now: float, reliable: bool = False) -> None: ...
    def tick(self, now: float) -> None: ...
    def next_deadline(self) -> float: ...
    def take_sends(self) -> Sequence[Send]: ...
    def take_events(self) -> Sequence[CoreEvent]: ...


Action = Callable[[], object]
"""What :meth:`SimCluster.at` runs (its result, if any, is dropped)."""

M = TypeVar("M", bound=SimMachine)
"""The machines of one cluster (scenarios read more of them than the simulator does)."""

NodeFactory = Callable[[int, float, int, random.Random], M]
"""(node index, now, incarnation, rng) -> a new machine for that node (the simulator drives only its
inputs and outputs: ``receive``, ``tick``, ``next_deadline``, ``take_sends``, ``take_events``)."""


@dataclass(slots=True)
class SimNode(Generic[M]):
    index: int
    name: str
    machine: M
    state: str = UP
    timer_at: float = INF
    backlog: list[tuple[float, bytes, bool]] = field(default_factory=list)
    sent_msgs: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    busy_until: float = 0.0
    """With CPU charges: the virtual time until which the node is busy (see ``SimCluster.charge``)."""
    queue: deque[tuple[float, bytes, bool]] = field(default_factory=deque)
    """Packets that reached the node while it was busy: (arrival, payload, reliable), in arrival order."""
    tick_due: float = INF
    """The deadline of a timer that fell due while the node was busy (INF: none)."""
    waking: bool = False
    """A WAKE entry is pending for this node."""
    incarnation: int = 1
    crashed_at: float | None = None
    paused_total: float = 0.0
    longest_pause: float = 0.0


class SimCluster(Generic[M]):
    def __init__(
        self,
        n: int,
        factory: NodeFactory[M],
        *,
        seed: int,
        model: NetworkModel | None = None,
        names: list[str] | None = None,
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.network = Network(model or NetworkModel(), random.Random(self.rng.getrandbits(64)))
        self.now = 0.0
        self.events_processed = 0
        # Calendar queue: ``_near`` is a heap of every entry whose bucket (int(time * BUCKETS_PER_S)) is at
        # most ``_cur``; later entries wait unsorted in ``_buckets`` (bucket -> list), whose keys are in the
        # heap ``_bucket_heap``. A bucket is heapified into ``_near`` when the clock reaches it. Buckets are
        # monotonic in time, so this pops in exactly (time, seq) order, like one big heap, but each pop
        # works on a small, recently touched heap (10,000 nodes keep ~10,000 timers pending).
        self._near: list[tuple[float, int, int, int, Any]] = []
        self._cur = -1
        self._buckets: dict[int, list[tuple[float, int, int, int, Any]]] = {}
        self._bucket_heap: list[int] = []
        self._seq = 0
        self.factory = factory
        self.names = names or [f"n{i}" for i in range(n)]
        self.index_of = {name: i for i, name in enumerate(self.names)}
        self.observers: list[Callable[[float, int, Any], None]] = []
        self.wiretaps: list[Callable[[float, int, bytes, bool], None]] = []
        self.checkers: list[Callable[[float], None]] = []
        self.charge: Callable[[int, float], float] | None = None
        """(node index, now) -> virtual CPU seconds the input it just handled cost it (see the module)."""
        self.nodes: list[SimNode[M]] = []
        for i in range(n):
            machine = factory(i, 0.0, 1, random.Random(self.rng.getrandbits(64)))
            self.nodes.append(SimNode(i, self.names[i], machine))
        for node in self.nodes:
            self._flush(node)

    # ------------------------------------------------------------------ scheduling
    def _push(self, when: float, kind: int, node: int, payload: Any) -> None:
        self._seq += 1
        entry = (when, self._seq, kind, node, payload)
        try:
            b = int(when * BUCKETS_PER_S)
        except (OverflowError, ValueError):
            b = _FAR
        if b <= self._cur:
            heapq.heappush(self._near, entry)
            return
        bucket = self._buckets.get(b)
        if bucket is None:
            self._buckets[b] = [entry]
            heapq.heappush(self._bucket_heap, b)
        else:
            bucket.append(entry)

    def _advance(self) -> bool:
        """Move the next non-empty bucket into the (empty) near heap; False when nothing is pending."""
        if not self._bucket_heap:
            return False
        b = heapq.heappop(self._bucket_heap)
        near = self._buckets.pop(b)
        heapq.heapify(near)
        self._near = near
        self._cur = b
        return True

    def pending(self) -> int:
        """Entries (deliveries, timers, actions) waiting in the queue."""
        return len(self._near) + sum(len(b) for b in self._buckets.values())

    def at(self, when: float, action: Action) -> None:
        """Run ``action`` at virtual time ``when`` (fault injection, measurements)."""
        self._push(when, ACTION, -1, action)

    def _flush(self, node: SimNode[M]) -> None:
        # The hot path of the whole simulator (once per event): locals only, heappush inlined.
        machine = node.machine
        sends = machine.take_sends()
        if sends:
            now = self.now
            arrivals = self.network.arrivals
            index_of = self.index_of
            near = self._near
            cur = self._cur
            buckets = self._buckets
            push = heapq.heappush
            seq = self._seq
            src = node.index
            total = 0
            for send in sends:
                payload = send.payload
                size = len(payload)
                total += size
                dst = index_of.get(send.addr)
                if dst is None:
                    continue
                reliable = send.reliable
                kind = DELIVER_RELIABLE if reliable else DELIVER
                for t in arrivals(now, src, dst, size, reliable):
                    seq += 1
                    b = int(t * BUCKETS_PER_S)  # _push, inlined (arrival times are finite)
                    if b <= cur:
                        push(near, (t, seq, kind, dst, payload))
                    else:
                        bucket = buckets.get(b)
                        if bucket is None:
                            buckets[b] = [(t, seq, kind, dst, payload)]
                            push(self._bucket_heap, b)
                        else:
                            bucket.append((t, seq, kind, dst, payload))
            self._seq = seq
            node.sent_msgs += len(sends)
            node.sent_bytes += total
        events = machine.take_events()
        if events:
            now = self.now
            for obs in self.observers:
                for ev in events:
                    obs(now, node.index, ev)
        deadline = machine.next_deadline()
        if deadline != node.timer_at:
            node.timer_at = deadline
            if deadline != INF:
                now = self.now
                self._push(deadline if deadline > now else now, TIMER, node.index, deadline)

    # ------------------------------------------------------------------ running
    def run_until(self, t_end: float) -> None:
        nodes = self.nodes
        checkers = self.checkers
        flush = self._flush
        charge = self.charge
        charged = self._charged_flush
        pop = heapq.heappop
        near = self._near
        processed = self.events_processed
        taps = self.wiretaps
        try:
            while True:
                if not near:
                    if not self._advance():
                        break
                    near = self._near
                if near[0][0] > t_end:
                    break
                when, _, kind, idx, payload = pop(near)
                self.now = when
                processed += 1
                if kind == DELIVER or kind == DELIVER_RELIABLE:
                    node = nodes[idx]
                    state = node.state
                    if state is UP:
                        if charge is not None and (node.busy_until > when or node.queue):
                            node.queue.append((when, payload, kind == DELIVER_RELIABLE))
                            if not node.waking:
                                self._wake_at(node)
                        else:
                            node.received_bytes += len(payload)
                            if taps:
                                for tap in taps:
                                    tap(when, idx, payload, kind == DELIVER_RELIABLE)
                            node.machine.receive(payload, when, kind == DELIVER_RELIABLE)
                            if charge is None:
                                flush(node)
                            else:
                                charged(node, when)
                    elif state is PAUSED:
                        node.backlog.append((when, payload, kind == DELIVER_RELIABLE))
                elif kind == TIMER:
                    node = nodes[idx]
                    if payload == node.timer_at:
                        state = node.state
                        if state is UP:
                            node.timer_at = INF
                            if charge is not None and (node.busy_until > when or node.queue):
                                node.tick_due = min(node.tick_due, payload)
                                if not node.waking:
                                    self._wake_at(node)
                            else:
                                node.machine.tick(when)
                                if charge is None:
                                    flush(node)
                                else:
                                    charged(node, when)
                        elif state is PAUSED:
                            node.timer_at = INF  # re-armed on resume
                elif kind == WAKE:
                    self._wake(nodes[idx])
                else:
                    self.events_processed = processed  # visible to the action
                    payload()
                    near = self._near
                if checkers:
                    for check in checkers:
                        check(when)
        finally:
            self.events_processed = processed
        self.now = max(self.now, t_end)

    # ------------------------------------------------------------------ CPU charges
    def _charged_flush(self, node: SimNode[M], when: float) -> None:
        """Flush what ``node`` just did at ``when``, once the CPU it was charged for that is spent."""
        assert self.charge is not None
        c = self.charge(node.index, when)
        if c > 0:
            node.busy_until = when + c
            self.now = when + c  # its sends and events leave when it is done
            try:
                self._flush(node)
            finally:
                self.now = when
        else:
            self._flush(node)

    def _wake_at(self, node: SimNode[M]) -> None:
        node.waking = True
        self._push(max(node.busy_until, self.now), WAKE, node.index, None)

    def _wake(self, node: SimNode[M]) -> None:
        """A busy node is free: handle what waited for it, in arrival order, until it is busy again."""
        node.waking = False
        if node.state is not UP:
            return  # crashed (its queue is gone) or paused (the queue is handled on resume)
        now = self.now
        queue = node.queue
        while node.busy_until <= now:
            due = node.tick_due
            if due != INF and (not queue or due <= queue[0][0]):
                node.tick_due = INF
                node.machine.tick(now)
            elif queue:
                _, data, reliable = queue.popleft()
                node.received_bytes += len(data)
                for tap in self.wiretaps:
                    tap(now, node.index, data, reliable)
                node.machine.receive(data, now, reliable)
            else:
                return
            self._charged_flush(node, now)
        if queue or node.tick_due != INF:
            self._wake_at(node)

    # ------------------------------------------------------------------ faults
    def crash(self, idx: int) -> None:
        node = self.nodes[idx]
        if node.state == CRASHED:
            return
        node.state = CRASHED
        node.crashed_at = self.now
        node.backlog.clear()
        node.queue.clear()
        node.tick_due = INF
        node.timer_at = INF

    def pause(self, idx: int, duration: float) -> None:
        node = self.nodes[idx]
        if node.state is not UP:
            return
        node.state = PAUSED
        node.paused_total += duration
        node.longest_pause = max(node.longest_pause, duration)
        self.at(self.now + duration, lambda: self._resume(idx))

    def _resume(self, idx: int) -> None:
        node = self.nodes[idx]
        if node.state is not PAUSED:
            return
        node.state = UP
        backlog, node.backlog = [*node.queue, *node.backlog], []
        node.queue.clear()
        node.tick_due = INF
        for _, data, reliable in backlog:
            node.received_bytes += len(data)
            for tap in self.wiretaps:
                tap(self.now, idx, data, reliable)
            node.machine.receive(data, self.now, reliable)
        node.machine.tick(self.now)
        node.timer_at = INF
        if self.charge is not None:
            self._charged_flush(node, self.now)
        else:
            self._flush(node)

    def restart(self, idx: int, incarnation: int | None = None) -> None:
        """A fresh process on the same node, with a newer incarnation (virtual milliseconds)."""
        node = self.nodes[idx]
        inc = incarnation if incarnation is not None else max(node.incarnation + 1, int(self.now * 1000) + 2)
        node.incarnation = inc
        node.state = UP
        node.backlog.clear()
        node.queue.clear()
        node.tick_due = INF
        node.timer_at = INF
        node.machine = self.factory(idx, self.now, inc, random.Random(self.rng.getrandbits(64)))
        if self.charge is not None:
            node.busy_until = self.now
            self._charged_flush(node, self.now)
        else:
            self._flush(node)

    def up_nodes(self) -> list[int]:
        return [n.index for n in self.nodes if n.state is UP]
