"""The bootstrap without a job spec, simulated: candidates that start late or never, seeds that are
dead, lost datagrams, extra candidates; then the job's own protocol from the agreed view 0.

:func:`run_bootstrap` builds ``nodes`` candidates (``expected`` of them fill view 0, the others are
extra), each a :class:`~gossiprec.core.bootstrap.Booting` machine that becomes a full
:class:`~gossiprec.core.node.Node` once view 0 is decided, on the simulator's virtual clock. Invariants,
checked from what was delivered (not from any node's own bookkeeping): every view 0 any agent installs
is one value, and that value was accepted at one ballot by a majority of the seeds (the accepts and
their answers as they crossed the network). ``seed_rx_bytes``: the bytes delivered to each live seed
until the last candidate learnt view 0; ``seed_answer_rows``: the candidate rows that the seeds' answers
to hellos (:class:`~gossiprec.core.wire.BootKnown`) carried until then, every seed together.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, cast

from gossiprec.core.auth import DigestCrypto, KeyBook
from gossiprec.core.bootstrap import BootParams, Booting, Bootstrap, Candidate, rank_order, view_zero
from gossiprec.core.config import AgreementConfig, Config
from gossiprec.core.events import ViewZeroAgreed
from gossiprec.core.node import Node
from gossiprec.core.records import MemberInfo
from gossiprec.core.view import View
from gossiprec.core.wire import BootAccept, BootAccepted, BootKnown, decode_packet
from gossiprec.errors import ConfigError, DecodeError
from gossiprec.sim.cluster import Action, SimCluster
from gossiprec.sim.network import NetworkModel


@dataclass(frozen=True, slots=True)
class BootSimParams:
    nodes: int = 8
    """Candidates started (``nodes - expected`` of them are extra: late joiners)."""
    expected: int = 8
    spares: int = 1
    seeds: int = 3
    """The first ``seeds`` candidates' addresses are the seed list."""
    dead_seeds: int = 1
    """How many seeds never start (the first ones)."""
    start_spread: float = 2.0
    """Candidates start at uniform random times in [0, start_spread) seconds."""
    loss: float = 0.0
    duration: float = 20.0
    seed: int = 1

    def validate(self) -> None:
        if self.expected < 1:  # more than ``nodes``: too few candidates, nothing may be decided
            raise ConfigError(f"expected must be >= 1, got {self.expected}")
        if not 1 <= self.seeds <= self.nodes or not 0 <= self.dead_seeds < self.seeds:
            raise ConfigError("seeds must be in [1, nodes] and dead_seeds in [0, seeds)")


def run_bootstrap(params: BootSimParams) -> dict[str, Any]:
    """One simulated bootstrap; the figures and any broken invariant (with the seed)."""
    params.validate()
    wall0 = time.perf_counter()
    names = [f"n{i:02d}" for i in range(params.nodes)]
    hosts = {name: f"host{i // 2}" for i, name in enumerate(names)}  # two agents per host
    seeds = tuple(names[:params.seeds])
    boot = BootParams(params.expected, params.spares, seeds)
    config, agreement = Config.profile("sim"), AgreementConfig.profile("sim")
    memo: dict[Any, Any] = {}

    def make(idx: int, now: float, incarnation: int, rng: random.Random) -> Booting:
        name = names[idx]
        me = Candidate(name, name, hosts[name], idx % 2)
        crypto = DigestCrypto.for_name(name)

        def make_node(view: View | None, at: float, keys: dict[str, bytes]) -> Node:
            auth = KeyBook(name, crypto, keys=dict(keys))  # as an agent: view 0's keys, nothing pinned
            if view is not None:
                members = {m.node: MemberInfo(m.node, m.addr, 1) for m in view.members if m.node != name}
                m = view.member(name)
                assert m is not None
                node = Node(config, name, name, incarnation=incarnation, rng=rng, now=at, view=view, role=m.role,
                            host=m.host, members=members, agreement=agreement, memo=memo, auth=auth)
            else:
                node = Node(config, name, name, incarnation=incarnation, rng=rng, now=at, view=None, role="spare",
                            host=me.host, seeds=tuple(s for s in seeds if s != name), agreement=agreement, memo=memo,
                            auth=auth)
            node.set_state(0, None, 1 << 20)
            return node

        join = tuple(s for s in seeds if s != name)
        return Booting(Bootstrap(boot, me, now, rng, KeyBook(name, crypto)), make_node, join, incarnation,
                       config.max_stream)

    cluster = SimCluster(params.nodes, make, seed=params.seed, model=NetworkModel(loss=params.loss), names=names)
    rng = random.Random(cluster.rng.getrandbits(64))
    started: dict[str, float] = {}
    for i, name in enumerate(names):
        cluster.crash(i)
        if i < params.dead_seeds:
            continue
        t = rng.random() * params.start_spread
        started[name] = t
        cluster.at(t, cast(Action, lambda i=i: cluster.restart(i, incarnation=1)))  # for mypy (default args)

    # the independent check: what crossed the network
    accepts: dict[tuple[int, str], tuple[Any, ...]] = {}
    accepted: dict[tuple[int, str], set[str]] = {}
    agreed: dict[str, tuple[float, tuple[str, ...]]] = {}
    violations: list[str] = []
    majority = len(seeds) // 2 + 1  # counted here, not taken from the machines' own parameters

    seed_rx: list[tuple[float, int, int]] = []  # (when, seed index, bytes) delivered to a seed
    answer_rows: list[tuple[float, int]] = []  # (when, candidate rows) of each seed's answer delivered

    def tap(now: float, dst: int, data: bytes, reliable: bool) -> None:
        if dst < params.seeds:
            seed_rx.append((now, dst, len(data)))
        try:
            msgs = decode_packet(data, 1 << 24)
        except DecodeError:
            return
        for m in msgs:
            if isinstance(m, BootKnown):
                answer_rows.append((now, len(m.candidates)))
            elif isinstance(m, BootAccept):
                accepts[(m.round, m.proposer)] = tuple(sorted(str(r[0]) for r in m.value))
            elif isinstance(m, BootAccepted) and m.ok:
                accepted.setdefault((m.round, m.proposer), set()).add(m.acceptor)

    def observe(now: float, idx: int, ev: Any) -> None:
        if not isinstance(ev, ViewZeroAgreed):
            return
        members = tuple(sorted(ev.members))
        agreed[names[idx]] = (now, ev.members)
        quorum = [b for b, who in accepted.items() if len(who & set(seeds)) >= majority and accepts.get(b) == members]
        if not quorum:
            violations.append(f"t={now:.3f} {names[idx]} installed view 0 {members} that no majority of the "
                              f"seeds accepted at one ballot (seed {params.seed})")
        others = {v for _, v in agreed.values()}
        if len(others) > 1:
            violations.append(f"t={now:.3f} two views 0: {sorted(others)} (seed {params.seed})")

    cluster.wiretaps.append(tap)
    cluster.observers.append(observe)
    cluster.run_until(params.duration)

    value = next(iter({v for _, v in agreed.values()}), ())
    live = set(started)
    in_view = [n for n in value]
    decided_at = [t for t, _ in agreed.values()]
    # every live candidate of view 0 holds a view with the others; the extra ones joined it as spares
    views = {names[i]: cluster.nodes[i].machine.view for i in range(params.nodes)}
    held = {n: (v.epoch, sorted(m.node for m in v.members)) for n, v in views.items() if v is not None}
    joined_extra = [n for n in live if n not in in_view and n in held and n in held[n][1]]
    first = min(started.values()) if started else 0.0
    done_at = max(decided_at) if decided_at else params.duration
    seed_rx_bytes = [sum(b for t, i, b in seed_rx if i == k and t <= done_at)
                     for k in range(params.dead_seeds, params.seeds)]
    return {
        "seed": params.seed, "nodes": params.nodes, "expected": params.expected, "seeds": params.seeds,
        "dead_seeds": params.dead_seeds, "loss": params.loss,
        "decided": bool(value), "members": list(value),
        "rank_order_ok": list(value) == [c.name for c in sorted(
            (Candidate(n, n, hosts[n], names.index(n) % 2) for n in value), key=rank_order)],
        "agreed_by": len(agreed), "live": len(live),
        "agree_s": (max(decided_at) - first) if decided_at else None,
        "last_start_s": max(started.values()) if started else None,
        "seed_rx_bytes": seed_rx_bytes,
        "seed_answer_rows": sum(n for t, n in answer_rows if t <= done_at),
        "extra_joined": len(joined_extra), "extra_live": len([n for n in live if n not in in_view]),
        "view0_config": view_zero((Candidate(n, n, hosts[n], names.index(n) % 2) for n in value), boot).config_id
        if value else None,
        "invariant_violations": violations,
        "wall_s": round(time.perf_counter() - wall0, 3),
    }
