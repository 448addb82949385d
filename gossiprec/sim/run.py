"""Membership scenarios for the simulator: build a cluster, inject faults, return the figures.

``run_membership(SimParams(...))`` is what ``gossiprec sim`` calls. All randomness derives from
``params.seed``; the result (minus ``wall_s``) is identical for identical parameters.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, cast

from gossiprec.core.config import Config
from gossiprec.core.membership import Membership
from gossiprec.core.records import MemberInfo
from gossiprec.errors import ConfigError, InvariantViolation
from gossiprec.sim.cluster import Action, SimCluster
from gossiprec.sim.metrics import DetectionMetrics, Progress
from gossiprec.sim.network import NetworkModel


@dataclass(frozen=True, slots=True)
class SimParams:
    nodes: int = 100
    seed: int = 1
    duration: float = 30.0
    profile: str = "lan"
    crash: int = 0
    crash_at: float | None = None
    restart_after: float | None = None
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    latency: float = 0.0002
    jitter: float = 0.0001
    pause_frac: float = 0.0
    pause_max: float = 1.0
    pause_every: float = 20.0
    config_overrides: tuple[tuple[str, Any], ...] = ()

    def validate(self) -> None:
        if self.nodes < 2:
            raise ConfigError("--nodes must be at least 2")
        if not 0 <= self.crash < self.nodes:
            raise ConfigError(f"--crash must be within 0..{self.nodes - 1}")
        if self.duration <= 0:
            raise ConfigError("--duration must be positive")
        if not 0 <= self.pause_frac <= 1:
            raise ConfigError("--pause-frac must be within 0..1")
        if self.pause_max <= 0 or self.pause_every <= 0:
            raise ConfigError("--pause-max and --pause-every must be positive")
        self.network().validate()

    def network(self) -> NetworkModel:
        return NetworkModel(latency=self.latency, jitter=self.jitter, loss=self.loss,
                            duplicate=self.duplicate, reorder=self.reorder)

    def fault_time(self) -> float:
        return self.crash_at if self.crash_at is not None else min(5.0, self.duration / 3)

    def replay_command(self) -> str:
        parts = [f"python -m gossiprec sim --nodes {self.nodes} --seed {self.seed} --duration {self.duration}"]
        defaults = SimParams()
        for name in ("profile", "crash", "crash_at", "restart_after", "loss", "duplicate", "reorder",
                     "pause_frac", "pause_max", "pause_every"):
            value = getattr(self, name)
            if value != getattr(defaults, name):
                parts.append(f"--{name.replace('_', '-')} {value}")
        return " ".join(parts)


def membership_factory(params: SimParams, config: Config, names: list[str]) -> Callable[..., Membership]:
    base = {name: MemberInfo(name, name, 1) for name in names}
    order = tuple(names)
    n = len(names)

    def make(idx: int, now: float, incarnation: int, rng: random.Random) -> Membership:
        name = names[idx]
        if incarnation == 1:
            return Membership(config, name, name, incarnation=1, rng=rng, now=now, members=base,
                              member_order=order, members_live=n)
        # A restarted process knows only seeds and rejoins.
        m = Membership(config, name, name, incarnation=incarnation, rng=rng, now=now)
        seeds = [names[(idx + k) % n] for k in (1, 2, 3)]
        m.join(seeds, now)
        return m

    return make


def run_membership(params: SimParams, show_progress: bool = False) -> dict[str, Any]:
    params.validate()
    config = Config.profile("sim" if params.profile == "sim" else params.profile,
                            **dict(params.config_overrides))
    names = [f"n{i}" for i in range(params.nodes)]
    wall0 = time.perf_counter()
    cpu0 = time.process_time()
    cluster = SimCluster(params.nodes, membership_factory(params, config, names), seed=params.seed,
                         model=params.network(), names=names)
    metrics = DetectionMetrics(names, cluster.index_of,
                               incarnation_of=lambda i: cluster.nodes[i].machine.incarnation)
    cluster.observers.append(metrics)
    plan_rng = random.Random(cluster.rng.getrandbits(64))
    ever_crashed: set[int] = set()

    # crashes
    t_fault = params.fault_time()
    victims = plan_rng.sample(range(params.nodes), params.crash)

    def do_crash() -> None:
        for v in victims:
            cluster.crash(v)
            ever_crashed.add(v)
            metrics.crashed(v, cluster.now, cluster.nodes[v].incarnation)

    if victims:
        cluster.at(t_fault, do_crash)
        if params.restart_after is not None:
            def do_restart() -> None:
                for v in victims:
                    cluster.restart(v)
                    metrics.restarted(v)
            cluster.at(t_fault + params.restart_after, do_restart)

    # pauses: a fraction of nodes pause at random moments (Poisson), for up to pause_max seconds
    candidates = [i for i in range(params.nodes) if i not in set(victims)]
    pausers = plan_rng.sample(candidates, int(round(params.pause_frac * params.nodes)))
    for p in pausers:
        t = plan_rng.expovariate(1.0 / params.pause_every)
        while t < params.duration:
            d = plan_rng.uniform(0.05, params.pause_max)
            cluster.at(t, cast(Action, lambda p=p, d=d: cluster.pause(p, d)))  # for mypy (default args)
            t += d + plan_rng.expovariate(1.0 / params.pause_every)

    # membership size over time
    size_series: list[tuple[float, float, int, int]] = []

    def sample() -> None:
        live = [cluster.nodes[i].machine.n_live for i in cluster.up_nodes()]
        if live:
            size_series.append((round(cluster.now, 3), sum(live) / len(live), min(live), max(live)))

    step = max(0.25, params.duration / 200)
    t = 0.0
    while t <= params.duration:
        cluster.at(t, sample)
        t += step

    progress = Progress(show_progress)
    chunk = params.duration / 10
    try:
        for k in range(1, 11):
            cluster.run_until(chunk * k)
            progress(cluster, chunk * k, params.duration)
    except InvariantViolation as exc:
        raise InvariantViolation(
            f"{exc} (seed={params.seed}; replay: {params.replay_command()})") from exc
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0

    survivors = [i for i in cluster.up_nodes() if i not in ever_crashed]
    excused = {n.index for n in cluster.nodes if n.longest_pause > 1.0} | ever_crashed
    steady = [n for n in cluster.nodes if n.index not in ever_crashed]
    dur = params.duration
    per_node_bytes = [n.sent_bytes / dur for n in steady]
    per_node_msgs = [n.sent_msgs / dur for n in steady]
    result: dict[str, Any] = {
        "nodes": params.nodes,
        "seed": params.seed,
        "profile": params.profile,
        "virtual_s": dur,
        "wall_s": round(wall, 3),
        "events": cluster.events_processed,
        "events_per_wall_s": round(cluster.events_processed / wall) if wall > 0 else None,
        # CPU seconds of this (single-threaded) process: the figure that other load on the machine does
        # not inflate; wall_s does.
        "cpu_s": round(cpu, 3),
        "events_per_cpu_s": round(cluster.events_processed / cpu) if cpu > 0 else None,
        "crashed": len(victims),
        "paused_nodes": len(pausers),
        "loss": params.loss,
    }
    result.update(metrics.summary(survivors, excused))
    result.update({
        "msgs_per_node_s": round(sum(per_node_msgs) / len(per_node_msgs), 2),
        "bytes_per_node_s": round(sum(per_node_bytes) / len(per_node_bytes), 1),
        "bytes_per_node_s_max": round(max(per_node_bytes), 1),
        "invariant_violations": len(metrics.violations),
        "config": {k: v for k, v in asdict(config).items() if k in (
            "probe_interval", "probe_timeout", "suspicion_floor", "suspicion_mult", "gossip_interval")},
    })
    result["_series"] = {
        "membership": size_series,
        "detect": sorted(metrics.detected.values()),
    }
    return result
