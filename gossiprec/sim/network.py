"""The simulated network: latency, loss, duplication, reordering and partitions, all from one seeded RNG.

What it decides: for a datagram sent at ``now`` from ``src`` to ``dst``, the list of arrival times
(empty when dropped, two when duplicated). Reliable (stream) messages are never lost or duplicated but
are cut by partitions, like a TCP connection that cannot be established.

Partitions are directed: ``block(a, b)`` stops traffic from every node in ``a`` to every node in ``b``;
a symmetric partition blocks both directions. Nodes are integers; groups are frozensets of integers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from math import log as _log


@dataclass(frozen=True, slots=True)
class NetworkModel:
    """Parameters. Times are seconds, probabilities are per datagram."""

    latency: float = 0.0002
    """Fixed one-way delay (LAN: 0.2 ms)."""
    jitter: float = 0.0001
    """Mean of an exponential delay added to every datagram."""
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    """Probability that a datagram is held back by an extra uniform delay of up to ``reorder_delay``."""
    reorder_delay: float = 0.005
    bandwidth_delay_per_kb: float = 0.00001
    """Extra delay per KiB of payload (10 us/KiB: about 100 MB/s), so that big state syncs take time."""

    def validate(self) -> None:
        from gossiprec.errors import ConfigError

        for name in ("loss", "duplicate", "reorder"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ConfigError(f"network {name} must be a probability in [0, 1), got {v!r}")
        for name in ("latency", "jitter", "reorder_delay", "bandwidth_delay_per_kb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"network {name} must be >= 0 seconds")


@dataclass(slots=True)
class Network:
    model: NetworkModel
    rng: random.Random
    _blocked: dict[int, set[int]] = field(default_factory=dict)
    _group_of: dict[int, int] = field(default_factory=dict)
    _blocked_groups: set[tuple[int, int]] = field(default_factory=set)
    _loss_to: dict[int, float] = field(default_factory=dict)
    _loss_from: dict[int, float] = field(default_factory=dict)
    _delay_of: dict[int, tuple[float, float]] = field(default_factory=dict)

    def partition(self, groups: list[frozenset[int]] | list[set[int]], one_way: bool = False) -> None:
        """Cut traffic between groups (all pairs of groups, or only from group i to later groups)."""
        self._group_of = {}
        self._blocked_groups = set()
        for gi, group in enumerate(groups):
            for node in group:
                self._group_of[node] = gi
        for a in range(len(groups)):
            for b in range(len(groups)):
                if a == b:
                    continue
                if one_way and a > b:
                    continue
                self._blocked_groups.add((a, b))

    def heal(self) -> None:
        self._group_of = {}
        self._blocked_groups = set()
        self._blocked = {}
        self._loss_to = {}
        self._loss_from = {}
        self._delay_of = {}

    def block(self, src: int, dst: int) -> None:
        """Cut the one direction ``src -> dst``."""
        self._blocked.setdefault(src, set()).add(dst)

    def set_node_loss(self, node: int, inbound: float, outbound: float) -> None:
        """Extra loss on one node's links (a flapping NIC), in addition to the model's."""
        self._loss_to[node] = inbound
        self._loss_from[node] = outbound

    def set_node_delay(self, node: int, low: float, high: float) -> None:
        """Every datagram and stream message to or from ``node`` is held back by an extra uniform
        ``low..high`` seconds (a node on a congested or failing link; both ends of a pair count once)."""
        self._delay_of[node] = (low, high)

    def cut(self, src: int, dst: int) -> bool:
        if self._blocked_groups:
            ga = self._group_of.get(src)
            gb = self._group_of.get(dst)
            if ga is not None and gb is not None and (ga, gb) in self._blocked_groups:
                return True
        blocked = self._blocked.get(src)
        return blocked is not None and dst in blocked

    def arrivals(self, now: float, src: int, dst: int, size: int, reliable: bool) -> list[float]:
        if self._blocked_groups or self._blocked:
            if self.cut(src, dst):
                return []
        m = self.model
        rng = self.rng
        delay = m.latency + size * m.bandwidth_delay_per_kb / 1024.0
        if m.jitter:
            # rng.expovariate(1.0 / m.jitter), inlined: the same expression, so the same float
            delay += -_log(1.0 - rng.random()) / (1.0 / m.jitter)
        if self._delay_of:
            slow = self._delay_of.get(src) or self._delay_of.get(dst)
            if slow is not None:
                delay += slow[0] + rng.random() * (slow[1] - slow[0])
        if reliable:
            return [now + delay + m.latency]
        loss = m.loss
        if self._loss_to or self._loss_from:
            extra = max(self._loss_to.get(dst, 0.0), self._loss_from.get(src, 0.0))
            loss = 1.0 - (1.0 - loss) * (1.0 - extra)
        if loss and rng.random() < loss:
            return []
        if m.reorder and rng.random() < m.reorder:
            delay += rng.random() * m.reorder_delay
        if m.duplicate and rng.random() < m.duplicate:
            return [now + delay, now + delay + rng.random() * m.reorder_delay]
        return [now + delay]
