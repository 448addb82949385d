"""Agreement scenarios: the full core (:class:`~gossiprec.core.node.Node`) under faults, with the
invariants of masterless agreement checked on every event.

Invariants (any breach raises :class:`~gossiprec.errors.InvariantViolation` with the seed and the
command that replays it):

1. at most one view per epoch (one config id per epoch across all members);
2. no view decided without a quorum of its predecessor (audited from what the network delivered to the
   deciding member, by :mod:`gossiprec.sim.quorum`: votes from ``fast_quorum`` members on the fast path,
   Accepted from a ``majority`` in a classic round, counted by the audit itself);
3. every member that computes the plan of an epoch computes the same plan (same digest);
4. the minority side of a partition never decides;
5. no decision removes a majority of its predecessor view.

Liveness is checked by the scenario's expectations (e.g. "after the faults stop, the majority decides
within a bounded time"), reported in the figures and asserted by the tests.

Training model: trainers advance in lockstep (compute, communicate, optimizer per step). A hung or
crashed trainer blocks the others inside ``communicate`` of the current step until the view without
it is installed; each trainer's committed step (reported to the plan) is the last completed one. A
trainer whose node installs a new view stops (its collective is aborted; one in the optimizer step
commits first) and reports ``recovering`` until its node has the plan of that view; training resumes
once no trainer recovers, redoing the interrupted step.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, cast

from gossiprec.core.auth import Crypto, DigestCrypto, KeyBook
from gossiprec.core.config import AgreementConfig, Config
from gossiprec.core.events import AlertRaised, Fenced, PlanReady, Straggler, Unfenced, ViewInstalled
from gossiprec.core.machine import Machine
from gossiprec.core.node import Node
from gossiprec.core.records import MemberInfo
from gossiprec.core.topology import JobTopology
from gossiprec.core.view import View, ViewMember
from gossiprec.core.wire import PHASES
from gossiprec.errors import ConfigError, InvariantViolation
from gossiprec.sim.cluster import CRASHED, Action, SimCluster
from gossiprec.sim.costs import IDLE_FROM, RECOVERY, TAIL_S, CostMeter, CryptoCosts
from gossiprec.sim.metrics import Progress, quantiles
from gossiprec.sim.network import NetworkModel
from gossiprec.sim.quorum import QuorumAudit

SCENARIOS = ("crash", "rack", "hang", "straggler", "partition", "split", "oneway", "flap", "donor", "join",
             "delay", "flappart", "stall", "restart", "respawn", "heal", "mass", "rackflap", "quiet", "blip",
             "mute")
COMPUTE, COMMUNICATE, OPTIMIZER, RECOVERING = (PHASES.index(p) for p in ("compute", "communicate", "optimizer",
                                                                           "recovering"))
ABORT_DELAY = 0.002
"""Seconds from a view's install to its trainer leaving the interrupted collective (a poll slice)."""


@dataclass(frozen=True, slots=True)
class AgreeParams:
    scenario: str = "crash"
    nodes: int = 16
    spares: int = 2
    seed: int = 1
    duration: float = 20.0
    fault_at: float = 3.0
    heal_after: float = 8.0
    loss: float = 0.0
    step_time: float = 0.3
    profile: str = "lan"
    crash: int = 1
    train: bool = True
    """Simulate lockstep training progress (needed for hang/straggler; off in the size sweep, where the
    committed step is fixed and only detection, agreement and the plan are measured)."""
    signing: str = "digest"
    """Per-member signatures (:func:`sim_keys`): "digest" (cheap, deterministic, insecure), "ed25519"
    (the agents' own scheme), or "none"."""
    crypto_costs: CryptoCosts | None = None
    """Charge each agent Ed25519's CPU for every signature it makes and checks (``--real-crypto``, see
    :mod:`gossiprec.sim.costs`; with "digest" signing): the result then has the cost figures."""

    def validate(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ConfigError(f"unknown scenario {self.scenario!r}; choose one of {', '.join(SCENARIOS)}")
        if self.nodes < 3:
            raise ConfigError("agreement scenarios need at least 3 nodes")
        if not 0 <= self.spares < self.nodes:
            raise ConfigError("--spares must be within 0..nodes-1")
        if self.signing not in SIGNING:
            raise ConfigError(f"signing must be one of {', '.join(SIGNING)}, got {self.signing!r}")
        if self.crypto_costs is not None and self.signing != "digest":
            raise ConfigError("charged crypto costs need the digest stand-in (signing='digest')")

    def replay_command(self) -> str:
        return (f"python -m gossiprec sim --scenario {self.scenario} --nodes {self.nodes} "
                f"--spares {self.spares} --seed {self.seed} --duration {self.duration} --loss {self.loss}")


SIGNING = ("digest", "ed25519", "none")


def sim_keys(names: list[str], signing: str,
             wrap: Callable[[int, Crypto], Crypto] | None = None) -> Callable[[str], KeyBook | None]:
    """Each simulated member's key book. Every key is pinned (as a job spec may pin them), so no key
    claims are gossiped; "digest" signs with a keyed hash (the same code paths at a fraction of the
    cost, no security), "ed25519" with the agents' real scheme. ``wrap(index, crypto)``: the crypto a
    member's key book uses (a metered one, :mod:`gossiprec.sim.costs`)."""
    if signing == "none":
        return lambda name: None
    if signing == "ed25519":
        from gossiprec.security.signing import Ed25519Crypto
        cryptos: dict[str, Crypto] = {name: Ed25519Crypto.generate() for name in names}
    else:
        cryptos = {name: DigestCrypto.for_name(name) for name in names}
    pinned = {name: c.public_key for name, c in cryptos.items()}
    if wrap is not None:
        index = {name: i for i, name in enumerate(names)}
        return lambda name: KeyBook(name, wrap(index[name], cryptos[name]), pinned=pinned, claims=False)
    return lambda name: KeyBook(name, cryptos[name], pinned=pinned, claims=False)


class AgreementChecker:
    """Observes every event; raises InvariantViolation at the first breach."""

    def __init__(self, cluster: SimCluster[Machine], params: AgreeParams,
                 identity: Callable[[str], tuple[str, str, str]]) -> None:
        """``identity(name) -> (addr, host, rack)``: what each simulated node announces when it joins."""
        self.cluster = cluster
        self.params = params
        self.quorum = QuorumAudit(cluster, identity)
        cluster.wiretaps.append(self.quorum.delivered)
        self.view_of_epoch: dict[int, str] = {}
        self.plan_of_epoch: dict[int, str] = {}
        self.installs: dict[int, dict[int, float]] = {}
        self.plans: dict[int, dict[int, float]] = {}
        self.fenced: dict[int, float] = {}
        self.decided_fast: dict[int, bool] = {}
        self.minority: set[int] = set()
        self.minority_active = False
        self.removed_at: dict[str, tuple[int, float]] = {}
        self.removals: dict[str, set[int]] = {}
        """Name -> every epoch whose view removed it (a node removed, back, removed again: two)."""
        self.violations: list[str] = []
        self.joined: set[str] = set()
        self.fenced_now: set[int] = set()
        self.unfenced_at: dict[int, float] = {}

    def fail(self, msg: str) -> None:
        self.violations.append(msg)
        raise InvariantViolation(f"{msg} (seed={self.params.seed}; replay: {self.params.replay_command()})")

    def __call__(self, now: float, idx: int, ev: Any) -> None:
        t = type(ev)
        if t is ViewInstalled:
            prev = self.view_of_epoch.setdefault(ev.epoch, ev.config_id)
            if prev != ev.config_id:
                self.fail(f"two views for epoch {ev.epoch}: {prev} and {ev.config_id}")
            self.installs.setdefault(ev.epoch, {})[idx] = now
            problem = self.quorum.installed(idx, ev)
            if problem is not None:
                self.fail(problem)
            before = len(ev.members) - len(ev.joined) + len(ev.removed)
            if before - len(ev.removed) < before // 2 + 1:
                self.fail(f"epoch {ev.epoch} removed {len(ev.removed)} of {before} members: a majority")
            if ev.decided_here:
                self.decided_fast[ev.epoch] = self.decided_fast.get(ev.epoch, False) or ev.fast
                if self.minority_active and idx in self.minority:
                    self.fail(f"{self.cluster.names[idx]} on the minority side decided epoch {ev.epoch}")
            for r in ev.removed:
                self.removed_at.setdefault(r, (ev.epoch, now))
                self.removals.setdefault(r, set()).add(ev.epoch)
            self.joined.update(ev.joined)
            if ev.group_epoch < ev.epoch:
                # a view that left every group as it was: its trainers' plan is the group view's, in hand
                self.plans.setdefault(ev.epoch, {})[idx] = now
        elif t is PlanReady:
            prev = self.plan_of_epoch.setdefault(ev.epoch, ev.digest)
            if prev != ev.digest:
                self.fail(f"two plans for epoch {ev.epoch}: {prev[:12]} and {ev.digest[:12]}")
            self.plans.setdefault(ev.epoch, {})[idx] = now
        elif t is Fenced:
            self.fenced.setdefault(idx, now)
            self.fenced_now.add(idx)
        elif t is Unfenced:
            self.fenced_now.discard(idx)
            self.unfenced_at[idx] = now


def build_cluster(params: AgreeParams) -> tuple[SimCluster[Machine], list[str], dict[str, Any]]:
    config = Config.profile("lan" if params.profile == "sim" else params.profile)
    acfg = AgreementConfig()
    n = params.nodes
    names = [f"n{i:05d}" for i in range(n)]
    trainers = n - params.spares
    racks = 4 if params.scenario == "rackflap" else 20  # a rack is 5% of the nodes (25% in rackflap)
    late = set(range(trainers, n)) if params.scenario == "join" else set()
    from_spec: set[int] = set()
    """Nodes whose next process starts from the job spec (view 0, as an agent restarted by its launcher)."""
    members = []
    for i, name in enumerate(names):
        if i in late:
            continue
        rack = f"r{i % racks}"
        if i < trainers:
            members.append(ViewMember(name, name, "trainer", i, f"h{i}", rack))
        else:
            members.append(ViewMember(name, name, "spare", None, f"h{i}", rack))
    view0 = View.initial(members, JobTopology.ddp(trainers, allow_shrink=True))
    base = {name: MemberInfo(name, name, 1) for name in names}
    order = tuple(names)
    memo: dict[Any, Any] = {}
    extra: dict[str, Any] = {"view0": view0, "racks": racks, "late": late, "from_spec": from_spec}

    def member_of(idx: int) -> ViewMember:
        name = names[idx]
        return view0.member(name) or ViewMember(name, name, "spare", None, f"h{idx}", f"r{idx % racks}")

    index = {name: i for i, name in enumerate(names)}
    meter = CostMeter(params.crypto_costs, n) if params.crypto_costs is not None else None
    extra["meter"] = meter
    keys = sim_keys(names, params.signing, meter.wrap if meter is not None else None)

    def identity(name: str) -> tuple[str, str, str]:
        m = member_of(index[name])
        return name, m.host, m.rack  # a node's address is its name

    extra["identity"] = identity

    def make(idx: int, now: float, incarnation: int, rng: random.Random) -> Node:
        name = names[idx]
        m = member_of(idx)
        if (incarnation == 1 or idx in from_spec) and idx not in late:
            node = Node(config, name, name, incarnation=incarnation, rng=rng, now=now, view=view0, agreement=acfg,
                        host=m.host, rack=m.rack, role=m.role, members=base, member_order=order,
                        members_live=n, memo=memo, auth=keys(name))
        else:
            seeds = tuple(names[(idx + k) % n] for k in (1, 2, 3))
            node = Node(config, name, name, incarnation=incarnation, rng=rng, now=now, view=None,
                        agreement=acfg, host=m.host, rack=m.rack, role="spare", seeds=seeds, memo=memo,
                        auth=keys(name))
        node.set_state(0, None, 1 << 20)
        return node

    model = NetworkModel(loss=params.loss)
    cluster: SimCluster[Machine] = SimCluster(n, make, seed=params.seed, model=model, names=names)
    if meter is not None:
        cluster.charge = meter.charge
    return cluster, names, extra


def _plan_watch(cluster: SimCluster[Machine], checker: AgreementChecker, meter: CostMeter, victims: list[int],
                t_fault: float) -> Callable[[float, int, Any], None]:
    """An observer that moves the cost meter from the recovery to its tail when the plan of the view
    without every killed member is ready on every live member, and to "after" ``TAIL_S`` later."""
    names = cluster.names
    alive: list[int] = []

    def watch(now: float, idx: int, ev: Any) -> None:
        quiet = type(ev) is ViewInstalled and ev.group_epoch < ev.epoch  # (see AgreementChecker: its plan)
        if (type(ev) is not PlanReady and not quiet) or meter.phase != RECOVERY or not victims or now < t_fault:
            return
        removed = checker.removed_at
        if not all(names[v] in removed for v in victims) or \
                ev.epoch < max(removed[names[v]][0] for v in victims):
            return
        plans = checker.plans[ev.epoch]
        if not alive or len(plans) + len(victims) >= len(alive):  # (a cheap bound first: N checks)
            alive[:] = [i for i, node in enumerate(cluster.nodes) if node.state != CRASHED and i not in victims]
            if all(i in plans for i in alive):
                meter.snapshot(now, cluster.nodes)
                cluster.at(now + TAIL_S, lambda: meter.snapshot(cluster.now, cluster.nodes))

    return watch


def run_agreement(params: AgreeParams, show_progress: bool = False) -> dict[str, Any]:
    """Run one agreement scenario; ``show_progress`` prints a line to stderr every tenth of the virtual
    duration (running in ten chunks processes exactly the same events)."""
    params.validate()
    wall0 = time.perf_counter()
    cpu0 = time.process_time()
    cluster, names, extra = build_cluster(params)
    view0: View = extra["view0"]
    checker = AgreementChecker(cluster, params, extra["identity"])
    cluster.observers.append(checker)
    rng = random.Random(cluster.rng.getrandbits(64))
    n = params.nodes
    trainers = [i for i in range(n) if (m := view0.member(names[i])) is not None and m.role == "trainer"]
    victims: list[int] = []
    hung: set[int] = set()
    slow: set[int] = set()
    slow_node: list[int] = []
    stall_until = -1.0
    expect_removed: set[int] = set()
    expect_kept: set[int] = set(range(n))
    t_fault = params.fault_at
    last_fault = t_fault
    """The last fault's time (a heal, a restart): the settle time counts from there."""
    sc = params.scenario
    meter: CostMeter | None = extra["meter"]
    if meter is not None:
        cluster.at(min(IDLE_FROM, t_fault / 2), lambda: meter.snapshot(cluster.now, cluster.nodes))
        cluster.at(t_fault, lambda: meter.snapshot(cluster.now, cluster.nodes))

    # --- faults -----------------------------------------------------------------------------------
    # (an action that is a list display runs its calls for their effects: mypy's func-returns-value)
    if sc == "crash":
        victims = rng.sample(range(n), params.crash)
        cluster.at(t_fault, lambda: [cluster.crash(v) for v in victims])  # type: ignore[func-returns-value]
    elif sc == "rack":
        rack: str | int = f"r{rng.randrange(extra['racks'])}"  # an int in "rackflap"
        victims = [i for i in range(n) if f"r{i % extra['racks']}" == rack]
        cluster.at(t_fault, lambda: [cluster.crash(v) for v in victims])  # type: ignore[func-returns-value]
    elif sc == "hang":
        victims = [rng.choice(trainers)]
        hung.add(victims[0])
    elif sc == "straggler":
        slow.add(rng.choice(trainers))
    elif sc in ("partition", "split"):
        order = list(range(n))
        rng.shuffle(order)
        cut = n // 2 if sc == "split" else (n - 1) // 2
        minority = set(order[:cut])
        majority = set(order[cut:])
        checker.minority = set(minority) if sc == "partition" else set(range(n))

        def part() -> None:
            checker.minority_active = True
            cluster.network.partition([minority, majority])

        def heal() -> None:
            checker.minority_active = False  # after healing, deciding again is the point
            cluster.network.heal()

        cluster.at(t_fault, part)
        cluster.at(t_fault + params.heal_after, heal)
        victims = sorted(minority) if sc == "partition" else []
    elif sc == "oneway":
        victims = [rng.randrange(n)]
        v = victims[0]
        cluster.at(t_fault, lambda: [cluster.network.block(o, v)  # type: ignore[func-returns-value]
                                     for o in range(n) if o != v])
    elif sc == "blip":
        # a node crashes, and as it does two others are starved for 0.2-1.5 s (a loaded host): everything
        # they send or get is 0.5-1.5 s late, so they suspect each other for a while and the cut without
        # the crashed node first looks as if it kept no reachable majority; it must be proposed once they
        # hear each other again, not withheld until they fence for good
        victims = [rng.randrange(n)]
        starved = rng.sample([i for i in range(n) if i != victims[0]], 2)
        back = t_fault + rng.uniform(0.2, 1.5)
        cluster.at(t_fault, lambda: [cluster.crash(victims[0]),  # type: ignore[func-returns-value]
                                     *(cluster.network.set_node_delay(i, 0.5, 1.5)  # type: ignore[func-returns-value]
                                       for i in starved)])
        cluster.at(back, lambda: [cluster.network.set_node_delay(i, 0.0, 0.0)  # type: ignore[func-returns-value]
                                  for i in starved])
    elif sc == "mute":
        # a node stops hearing anyone (its agent starved, its inbound link gone) for 1.2-2.5 s, so it
        # accuses its subjects, then crashes: its alerts can never be retracted. The others must remove it
        # alone, without taking its stale word against the members their cut keeps (a 3-member job
        # fenced both healthy members that way, under load)
        victims = [rng.randrange(n)]
        mute = victims[0]
        cluster.at(t_fault, lambda: [cluster.network.block(o, mute)  # type: ignore[func-returns-value]
                                     for o in range(n) if o != mute])
        cluster.at(t_fault + rng.uniform(1.2, 2.5), lambda: cluster.crash(mute))
    elif sc == "flap":
        victims = [rng.randrange(n)]
        cluster.at(t_fault, lambda: cluster.network.set_node_loss(victims[0], 0.8, 0.8))
    elif sc == "delay":
        # one node's every packet held back 0.3-0.8 s: removed once at most, never back and forth
        v = rng.randrange(n)
        slow_node.append(v)
        cluster.at(t_fault, lambda: cluster.network.set_node_delay(v, 0.3, 0.8))
    elif sc == "flappart":
        # partitions that heal and re-split differently every 0.5-4 s (sometimes healed for a moment),
        # then a final heal at fault_at + heal_after: nothing decided may remove a majority, and after the
        # heal every node is back, unfenced, in one view
        t = t_fault
        end = t_fault + params.heal_after
        while t < end:
            order = list(range(n))
            rng.shuffle(order)
            cut = rng.randint(1, n // 2)
            groups = [set(order[:cut]), set(order[cut:])]
            cluster.at(t, cast(Action, lambda g=groups: cluster.network.partition(g)))  # for mypy (default args)
            t += rng.uniform(0.5, 4.0)
            if rng.random() < 0.3 and t < end:
                cluster.at(t, cluster.network.heal)
                t += rng.uniform(0.03, 0.3)
        cluster.at(end, cluster.network.heal)
        last_fault = end
    elif sc == "heal":
        # exact halves, healed before either side's SWIM has declared the other dead: every node fences,
        # nobody may decide, and after the heal every node unfences in the intact view
        order = list(range(n))
        rng.shuffle(order)
        halves = [set(order[: n // 2]), set(order[n // 2:])]
        cluster.at(t_fault, lambda: cluster.network.partition(halves))
        last_fault = t_fault + params.heal_after
        cluster.at(last_fault, cluster.network.heal)
    elif sc == "stall":
        # the whole job waits 1.3-5 s in one collective (a slow file system, a long GC, a cut link) and
        # resumes: no one is hung
        stall_until = t_fault + rng.uniform(1.3, 5.0)
    elif sc in ("restart", "respawn"):
        # a trainer's agent dies and its launcher starts it again from the job spec (view 0): at once
        # (0.2-1.2 s, before anyone removed it) or after its removal (6-8 s)
        v = rng.choice(trainers)
        victims = [v]
        extra["from_spec"].add(v)
        back = t_fault + (rng.uniform(0.2, 1.2) if sc == "restart" else rng.uniform(6.0, 8.0))
        cluster.at(t_fault, lambda: cluster.crash(v))
        cluster.at(back, lambda: cluster.restart(v))
        hung.add(v)  # its new trainer reports no progress: the job waits for the view without the old one
        last_fault = back
    elif sc == "mass":
        victims = rng.sample(range(n), (2 * n) // 5)  # 40% at once
        cluster.at(t_fault, lambda: [cluster.crash(v) for v in victims])  # type: ignore[func-returns-value]
    elif sc == "rackflap":
        rack = rng.randrange(extra["racks"])
        victims = [i for i in range(n) if i % extra["racks"] == rack]
        flapper = rng.choice([i for i in range(n) if i not in victims])
        victims.append(flapper)
        cluster.at(t_fault, lambda: [cluster.crash(v) for v in victims[:-1]])  # type: ignore[func-returns-value]
        cluster.at(t_fault, lambda: cluster.network.set_node_loss(flapper, 0.8, 0.8))
    elif sc == "donor":
        first = rng.choice(trainers)
        victims = [first]

        def second() -> None:
            # a donor dies while the plan of the first view change is being carried out
            alive_trainers = [i for i in trainers if i != first and cluster.nodes[i].state != CRASHED]
            d = rng.choice(alive_trainers)
            victims.append(d)
            cluster.crash(d)

        cluster.at(t_fault, lambda: cluster.crash(first))
        extra["second"] = second
    elif sc == "join":
        for i in sorted(extra["late"]):
            cluster.crash(i)  # not started yet
            cluster.at(t_fault, cast(Action, lambda i=i: cluster.restart(i, incarnation=2)))  # for mypy (default args)
        victims = []

    # --- lockstep training model ---------------------------------------------------------------------
    state = {"step": 0, "phase": COMPUTE}
    third = params.step_time / 3
    recovering: dict[int, int] = {}
    """Trainer node -> the epoch whose plan it waits for (it stopped when its node installed that view)."""

    def is_trainer(i: int) -> bool:
        view = cluster.nodes[i].machine.view
        return view is not None and (m := view.member(names[i])) is not None and m.role == "trainer"

    def report(i: int) -> None:
        node = cluster.nodes[i]
        if node.state == CRASHED or not is_trainer(i) or (i in hung and cluster.now >= t_fault):
            return
        machine = node.machine
        step, phase = state["step"], state["phase"]
        step_ms = int(params.step_time * 1000)
        wait_ms = 0
        if i in recovering:
            phase = RECOVERING
        elif slow and cluster.now >= t_fault and i not in slow:
            # synchronous training keeps a slow rank in step with the others; they wait for it in every
            # collective (30% of a step), it waits for no one: what the straggler check compares
            wait_ms = int(0.3 * step_ms)
        machine.set_progress(step, phase, step_ms, cluster.now, 0, wait_ms)
        machine.set_state(max(0, step - 1), None, 1 << 20)

    stragglers: dict[str, int] = {}
    """Subject -> Straggler reports about it (one per observer per episode)."""

    def on_event(now: float, idx: int, ev: Any) -> None:
        if not (params.train or sc in ("hang", "straggler")):
            return
        t = type(ev)
        if t is Straggler:
            stragglers[ev.node] = stragglers.get(ev.node, 0) + 1
        machine = cluster.nodes[idx].machine
        if (t is Fenced or (t is ViewInstalled and machine.view is not None and names[idx] not in machine.view)) \
                and not (idx in hung and now >= t_fault):
            machine.set_state(0, None, 0)  # a trainer that answers drops its state to wait as a spare
        if t is ViewInstalled and is_trainer(idx) and ev.group_epoch == ev.epoch:  # (else no group changed)
            if not recovering and state["phase"] == OPTIMIZER:  # the step's collective was done: commit it
                state["step"] += 1
                state["phase"] = COMPUTE
            recovering[idx] = ev.epoch
            cluster.at(now + ABORT_DELAY, lambda: report(idx))
        elif t is PlanReady and recovering.get(idx) == ev.epoch:
            del recovering[idx]
            if not recovering:
                state["phase"] = COMPUTE  # redo the interrupted step
            cluster.at(now, lambda: report(idx))

    cluster.observers.append(on_event)
    alerted: dict[int, float] = {}
    """Survivor -> its first alert about a victim after the fault (detection, as each observer saw it)."""

    def on_alert(now: float, idx: int, ev: Any) -> None:
        if type(ev) is AlertRaised and now >= t_fault and idx not in alerted \
                and any(ev.subject == names[v] for v in victims):
            alerted[idx] = now

    cluster.observers.append(on_alert)
    if meter is not None:
        cluster.observers.append(_plan_watch(cluster, checker, meter, victims, t_fault))

    def blocked() -> bool:
        if cluster.now < t_fault:
            return False
        if cluster.now < stall_until:
            return True
        for v in victims if sc in ("crash", "rack", "hang", "donor", "oneway", "flap", "restart", "respawn", "mass",
                                   "rackflap", "blip", "mute") else []:
            # blocked while some live trainer still has v as a trainer in its view
            for i in trainers:
                node = cluster.nodes[i]
                if node.state == CRASHED or i in victims:
                    continue
                view = node.machine.view
                if view is not None and v < len(names) and (m := view.member(names[v])) is not None \
                        and m.role == "trainer":
                    return True
        return False

    def train() -> None:
        cluster.at(cluster.now + third, train)
        for i in [i for i in recovering if cluster.nodes[i].state == CRASHED or not is_trainer(i)]:
            del recovering[i]  # died or dropped while recovering: nobody waits for it
            if not recovering:
                state["phase"] = COMPUTE
        if recovering:
            pass  # the job waits for every trainer's plan
        elif not blocked():
            state["phase"] += 1
            if state["phase"] > OPTIMIZER:
                state["phase"] = COMPUTE
                state["step"] += 1
        elif state["phase"] != COMMUNICATE:
            # the healthy ranks run on to the next collective and wait in it; the failed rank never
            # gets there (it stopped earlier in this step, or in the previous one)
            if state["phase"] > COMMUNICATE:
                state["step"] += 1
            state["phase"] = COMMUNICATE
        for i in range(n):
            report(i)

    if params.train or sc in ("hang", "straggler"):
        cluster.at(third, train)
    if "second" in extra:
        def watch_for_first_view() -> None:
            if 1 in checker.installs:
                extra["second"]()
            else:
                cluster.at(cluster.now + 0.01, watch_for_first_view)
        cluster.at(t_fault, watch_for_first_view)

    # --- settling: after the last fault, every live node holds one view that lists exactly the live nodes,
    # and none is fenced (nodes expected out, or free to be either way, are not counted)
    dont_care = set(slow_node)
    if sc in ("hang", "oneway", "flap"):
        dont_care |= set(victims)
    elif sc == "rackflap":
        dont_care.add(victims[-1])  # the flapping node
    settle: dict[str, float] = {}

    def settled() -> bool:
        epoch = None
        live = set()
        for node in cluster.nodes:
            if node.state == CRASHED or node.index in dont_care:
                continue
            m = node.machine
            if m.view is None or m.fenced or (epoch is not None and m.view.epoch != epoch):
                return False
            epoch = m.view.epoch
            live.add(node.name)
            view = m.view
        if sc in ("restart", "respawn") and not all(names[v] in checker.removals for v in victims):
            return False  # the old process's place must go first
        return epoch is not None and {x for x in view.nodes if index_of[x] not in dont_care} == live

    index_of = cluster.index_of

    def watch_settle() -> None:
        if settled():
            settle["at"] = cluster.now
        else:
            cluster.at(cluster.now + 0.05, watch_settle)

    cluster.at(last_fault, watch_settle)

    progress = Progress(show_progress)
    for k in range(1, 11):
        cluster.run_until(params.duration * k / 10)
        progress(cluster, params.duration * k / 10, params.duration)
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0

    # --- figures -----------------------------------------------------------------------------------
    if sc not in ("partition", "split", "straggler", "join"):
        expect_removed = set(victims)
    expect_kept = set(range(n)) - set(victims)
    survivors = [i for i in range(n) if cluster.nodes[i].state != CRASHED and i not in set(victims)]
    final_epoch = max(checker.view_of_epoch, default=0)
    agree = []
    plan = []
    plan_at: dict[int, float] = {}
    """Survivor -> when the plan of the view without the failed nodes was ready there (real costs)."""
    if expect_removed:
        # fault -> every survivor installed the view that removes the last expected victim
        removal_epochs = {checker.removed_at[names[v]][0] for v in expect_removed if names[v] in checker.removed_at}
        if len(removal_epochs) and all(names[v] in checker.removed_at for v in expect_removed):
            last_epoch = max(removal_epochs)
            per_node = checker.installs.get(last_epoch, {})
            if all(i in per_node for i in survivors):
                agree.append(max(per_node[i] for i in survivors) - t_fault)
            # the plan of that view, or of the first later one every survivor planned for (a removed
            # node that rejoins at once can supersede the removal's view before all have planned)
            for epoch in sorted(e for e in checker.plans if e >= last_epoch):
                plans = checker.plans[epoch]
                if all(i in plans for i in survivors):
                    plan.append(max(plans[i] for i in survivors) - t_fault)
                    plan_at = plans
                    break
            else:
                plan_at = checker.plans.get(last_epoch, {})  # not ready everywhere: where it was
    removed_names = set(checker.removed_at)
    healthy_removed = sorted(names[i] for i in expect_kept if names[i] in removed_names and i not in slow_node
                             and sc not in ("partition", "flappart"))
    result = {
        "scenario": sc,
        "nodes": n,
        "spares": params.spares,
        "seed": params.seed,
        "virtual_s": params.duration,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "events": cluster.events_processed,
        "detect_s": round(min(alerted.values()) - t_fault, 4) if alerted else None,
        "agree_s": quantiles(agree),
        "plan_s": quantiles(plan),
        "views_decided": final_epoch,
        "fast_path_ratio": round(sum(checker.decided_fast.values()) / max(1, len(checker.decided_fast)), 3),
        "invariant_violations": len(checker.violations),
        "expected_removed": sorted(names[v] for v in expect_removed),
        "removed": sorted(removed_names),
        "removed_all_expected": all(names[v] in removed_names for v in expect_removed),
        "removal_epochs": sorted({checker.removed_at[names[v]][0] for v in expect_removed
                                  if names[v] in checker.removed_at}),
        "removal_epoch_of": {name: checker.removed_at[name][0] for name in sorted(checker.removed_at)},
        "dont_care": sorted(names[i] for i in dont_care),  # may end in the view or out of it (a flapper, say)
        "healthy_removed": healthy_removed,
        "stragglers": dict(sorted(stragglers.items())),
        "fenced": sorted(names[i] for i in checker.fenced),
        "joined": sorted(checker.joined),
        "training_step": state["step"],
        "most_removals": max((len(e) for e in checker.removals.values()), default=0),
        # last fault (a heal, a restart) -> every live node in one view of exactly the live nodes, unfenced
        "settle_s": round(settle["at"] - last_fault, 3) if "at" in settle else None,
        "settled_at_end": settled(),
        "fenced_at_end": sorted(names[i] for i in range(n) if cluster.nodes[i].state != CRASHED
                                and i not in dont_care and cluster.nodes[i].machine.fenced),
    }
    if meter is not None:
        meter.snapshot(cluster.now, cluster.nodes, end=True)
        result.update(meter.figures(survivors, t_fault, plan_at))
    return result
