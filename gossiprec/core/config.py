"""One frozen configuration for the protocol core, with named profiles.

Every field documents its unit and, where it has one, the formula it feeds. Profiles:

- ``lan``: training clusters (sub-millisecond RTT, dedicated fabric). Probes every 100 ms with 100 ms
  timeouts; a silent node is declared dead in about 2 s at N = 1,000.
- ``wan``: for links with tens of milliseconds of RTT. The rule: every timeout (a wait for an answer
  or for evidence before judging) is the ``lan`` one times :data:`WAN_FACTOR` (5): ``probe_timeout``,
  ``indirect_timeout``, ``verify_timeout``, ``suspicion_floor``, and every duration of
  :class:`AgreementConfig`. On top of that, :class:`Config` probes ten times less often
  (``probe_interval`` 1 s), gossips and tolerates timer lateness four times slower (``gossip_interval``,
  ``starve_slack``) and retransmits once more per order of magnitude (``retransmit_mult`` 4). Counts,
  booleans and ratios are never scaled.
- ``sim``: ``lan`` (the simulator uses the production timings by default so that its figures are the
  figures users get).

:class:`Config` holds the membership layer's parameters (SWIM, Lifeguard, dissemination),
:class:`AgreementConfig` the agreement layer's (observers, cut detection, consensus, hangs, fencing,
reports); both know the same profiles.

Nothing here reads the environment or files: that happens once, at the edge (``gossiprec.agent.settings``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, ClassVar

from gossiprec.errors import ConfigError

PROFILES = ("lan", "wan", "sim")
WAN_FACTOR = 5.0
"""The ``wan`` profile's factor on timeouts (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class Config:
    """Protocol parameters. Times are seconds (float), sizes bytes, counts plain integers."""

    cluster: str = "gossiprec"
    """Cluster name; part of every packet's associated data, so two clusters never mix."""

    # --- SWIM probing -------------------------------------------------------------------------------
    probe_interval: float = 0.1
    """Seconds between the starts of two probes by one node (scaled by the health multiplier)."""
    probe_batch: int = 2
    """Round-robin targets probed together while no member is in focus (none may have failed, none
    needs a progress refresh): the node then wakes every ``probe_batch * probe_interval`` and probes
    that many targets, the same probes per second with fewer wake-ups (an idle agent's cost is mostly
    wake-ups). With a member in focus, rounds are ``probe_interval`` apart again, one target each."""
    probe_timeout: float = 0.1
    """Seconds to wait for a direct ack before asking ``indirect_checks`` helpers (scaled by health)."""
    indirect_timeout: float = 0.1
    """Seconds, after the indirect requests are sent, to wait for any ack (scaled by health)."""
    indirect_checks: int = 3
    """k: helpers asked to probe a target that missed its direct ack."""
    nack_fraction: float = 0.8
    """A helper answers Nack when the target is silent for nack_fraction * probe_timeout."""

    # --- Lifeguard -----------------------------------------------------------------------------------
    awareness_max: int = 8
    """Local health multiplier ceiling: timeouts and probe interval are scaled by (score + 1) <= max."""
    accuse_health_limit: int = 4
    """A node whose health score is at or above this does not accuse others (it suspects itself)."""
    suspicion_mult: float = 2.0
    """suspicion_min = max(suspicion_floor, suspicion_mult * log10(max(N, 10)) * probe_interval)."""
    suspicion_floor: float = 1.2
    """Lower bound of suspicion_min in seconds. Must exceed the longest pause that must not be fatal
    (1 s for the ``lan`` goal) minus the earliest suspicion (probe_timeout + indirect_timeout)."""
    suspicion_max_mult: float = 3.0
    """suspicion_max = suspicion_max_mult * suspicion_min: the timeout with no confirmation."""
    suspicion_confirmations: int = 3
    """K: independent confirmations after which the timeout has shrunk to suspicion_min.
    timeout(C) = max(min, max - (max - min) * log(C + 1) / log(K + 1))."""
    verify_timeout: float = 0.1
    """Before declaring a suspect dead, a node probes it itself (direct + indirect) for this long."""
    verify_defer: float = 0.4
    """Members that only heard of a suspicion wait this much longer than the accusers before they verify
    it themselves; the accusers' verdict usually reaches them first (saves N probes per failure)."""
    startup_grace: float = 0.0
    """Seconds after this node starts during which the silence of members it has never heard from (no
    ping, ack or Alive of theirs received) is not judged: they are probed (an answer proves them up), but
    an unanswered probe is neither reported nor suspected. The members of a job's view 0 start one by one,
    and on a saturated machine the last agents come up many seconds after the first. Once heard from, or
    once the grace ends, a member is judged like any other. 0 in the core's profiles (the simulator starts
    every node at once); agents default it to 30 s (``gossiprec.agent.settings.AGENT_STARTUP_GRACE``;
    the ``[protocol]`` table overrides it)."""
    starve_slack: float = 0.25
    """A timer that fires later than this past its deadline means this process was starved (paused,
    swapped, GC): it raises its own health score instead of accusing the peer."""

    # --- Dissemination -------------------------------------------------------------------------------
    retransmit_mult: int = 3
    """lambda: each broadcast is sent retransmit_mult * ceil(log10(N + 1)) times."""
    gossip_interval: float = 0.05
    """Seconds between gossip rounds (sent only while the broadcast queue is not empty)."""
    gossip_nodes: int = 3
    """Random members each gossip round goes to."""
    gossip_to_dead: float = 5.0
    """Seconds a dead member still receives gossip (so it learns it was declared dead and rejoins)."""
    dead_reap: float = 60.0
    """Seconds after which a dead or left member's record is forgotten."""
    pushpull_interval: float = 30.0
    """Seconds between anti-entropy state exchanges at N <= pushpull_ref_nodes; scaled linearly
    above (interval * N / pushpull_ref_nodes) so that the bytes per node per second stay flat."""
    pushpull_ref_nodes: int = 100
    """See pushpull_interval."""
    mtu: int = 1400
    """Largest datagram (bytes of encoded payload); compound packets are filled up to it."""
    max_stream: int = 64 * 1024 * 1024
    """Largest reliable (stream) message in bytes; state sync for 10,000 members is about 0.5 MB."""
    progress_piggyback: int = 2
    """Other members' progress records carried on each ping and ack (round robin)."""

    # --- Identity ------------------------------------------------------------------------------------
    max_name: int = 128
    """Longest node name in bytes."""

    def __post_init__(self) -> None:
        problems = []
        positive = (
            "probe_interval", "probe_timeout", "indirect_timeout", "suspicion_mult", "suspicion_floor",
            "verify_timeout", "gossip_interval", "pushpull_interval", "starve_slack",
        )
        if not (isinstance(self.startup_grace, (int, float)) and self.startup_grace >= 0):
            problems.append(f"startup_grace must be >= 0 s, got {self.startup_grace!r}")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                problems.append(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(self.probe_batch, int) or isinstance(self.probe_batch, bool) or self.probe_batch < 1:
            problems.append(f"probe_batch must be an integer >= 1, got {self.probe_batch!r}")
        for name in ("indirect_checks", "gossip_nodes", "retransmit_mult", "progress_piggyback"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                problems.append(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.awareness_max, int) or self.awareness_max < 1:
            problems.append(f"awareness_max must be an integer >= 1, got {self.awareness_max!r}")
        if not 0 < self.nack_fraction < 1:
            problems.append(f"nack_fraction must be in (0, 1), got {self.nack_fraction!r}")
        if self.suspicion_max_mult < 1:
            problems.append(f"suspicion_max_mult must be >= 1, got {self.suspicion_max_mult!r}")
        if self.suspicion_confirmations < 1:
            problems.append("suspicion_confirmations must be >= 1")
        if not 576 <= self.mtu <= 65000:
            problems.append(f"mtu must be within 576..65000 bytes, got {self.mtu!r}")
        for name in ("dead_reap", "gossip_to_dead"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                problems.append(f"{name} must be a non-negative number of seconds, got {value!r}")
        if not isinstance(self.suspicion_max_mult, (int, float)) or not math.isfinite(self.suspicion_max_mult):
            problems.append(f"suspicion_max_mult must be a finite number, got {self.suspicion_max_mult!r}")
        confirmations: object = self.suspicion_confirmations  # (a bad value may be of any type)
        if not isinstance(confirmations, int):
            problems.append(f"suspicion_confirmations must be an integer, got {self.suspicion_confirmations!r}")
        if not isinstance(self.pushpull_ref_nodes, int) or self.pushpull_ref_nodes < 1:
            problems.append(f"pushpull_ref_nodes must be an integer >= 1, got {self.pushpull_ref_nodes!r}")
        if not isinstance(self.max_stream, int) or self.max_stream < self.mtu:
            problems.append(f"max_stream must be an integer >= mtu, got {self.max_stream!r}")
        if not isinstance(self.max_name, int) or not 1 <= self.max_name <= 128:
            problems.append(f"max_name must be within 1..128 bytes (the wire limit), got {self.max_name!r}")
        if not self.cluster or len(self.cluster.encode()) > 64:
            problems.append("cluster must be a non-empty name of at most 64 bytes")
        if problems:
            raise ConfigError("invalid gossiprec config: " + "; ".join(problems))

    WAN_TIMEOUTS: ClassVar[tuple[str, ...]] = (
        "probe_timeout", "indirect_timeout", "verify_timeout", "suspicion_floor")
    """The timeouts the ``wan`` profile multiplies by :data:`WAN_FACTOR`."""

    # --- Formulas (pure, table-tested) --------------------------------------------------------------
    def suspicion_min(self, n: int) -> float:
        """Seconds: the suspicion timeout once ``suspicion_confirmations`` peers agree."""
        return max(self.suspicion_floor, self.suspicion_mult * math.log10(max(n, 10)) * self.probe_interval)

    def suspicion_max(self, n: int) -> float:
        """Seconds: the suspicion timeout with no independent confirmation."""
        return self.suspicion_max_mult * self.suspicion_min(n)

    def retransmit_limit(self, n: int) -> int:
        """How many times one broadcast is piggybacked or gossiped by each node that holds it."""
        return self.retransmit_mult * math.ceil(math.log10(n + 1))

    def pushpull_period(self, n: int) -> float:
        """Seconds between anti-entropy exchanges of one node at cluster size ``n``."""
        return self.pushpull_interval * max(1.0, n / self.pushpull_ref_nodes)

    # --- Construction -------------------------------------------------------------------------------
    @classmethod
    def profile(cls, name: str, **overrides: Any) -> "Config":
        """A named profile (``lan``, ``wan``, ``sim``) with optional field overrides."""
        if name not in PROFILES:
            raise ConfigError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}")
        base = cls()
        if name == "wan":
            base = replace(
                base, probe_interval=1.0, gossip_interval=0.2, starve_slack=1.0, retransmit_mult=4,
                **{n: getattr(base, n) * WAN_FACTOR for n in cls.WAN_TIMEOUTS},
            )
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(sorted(unknown))}")
        return replace(base, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class AgreementConfig:
    """Agreement-layer parameters: observers, cut detection, consensus, hang checks, fencing, state reports.

    Times are seconds (float), counts plain integers. The ``wan`` profile multiplies every time by
    :data:`WAN_FACTOR`; counts, booleans and the ratio ``hang_mult`` stay as they are (see
    :meth:`profile`)."""

    k: int = 10
    """Observers per member (capped at N - 1)."""
    alert_after: float = 0.9
    """An observer alerts after its probes of a subject failed, with no success, this long. Must exceed
    the longest pause that must not be fatal minus the earliest failure (1 s - 0.2 s)."""
    confirm_after: float = 0.4
    """Silence enough to confirm an alert that another observer already raised about the subject: a failed
    probe of ours, and this long since the subject last answered one (the first accusation still needs
    ``alert_after`` of failed probes, so a 1 s pause is over before anyone confirms)."""
    settle: float = 0.15
    """No proposal until the alert tally has been quiet this long (batches correlated failures)."""
    settle_departed: float = 0.005
    """Settle window when the only news is members announcing their own departure (a trainer exit):
    departures announced less than this apart go in one view change."""
    unstable_timeout: float = 2.0
    """A subject between the L and H watermarks stops blocking proposals after this long."""
    fallback_timeout: float = 0.6
    """Undecided this long after voting: start a classic Paxos round (plus a random 0..fallback_jitter);
    a coordinator whose round has not decided starts the next after 2 * fallback_timeout (plus jitter)."""
    fallback_jitter: float = 0.4
    """Largest random delay added to each fallback timeout, so that members seldom coordinate at once."""
    retry_interval: float = 0.1
    """Coordinator re-sends Prepare/Accept to silent members after this long, then twice as long each
    time within one round and phase, up to 8 times it."""
    fence_after: float = 3.0
    """Waiting this long without a decision (or without a live majority) fences this member."""
    hang_floor: float = 0.6
    """Seconds: the shortest stall judged a hang, whatever the step time. A trainer that pauses longer
    than this without reporting (a long GC, blocking I/O outside ``checkpointing``) is taken for hung;
    raise it for such jobs."""
    hang_mult: float = 3.0
    """A rank is hung once stalled behind the frontier for max(hang_floor, hang_mult * median step time)
    (a ratio, not a time). A trainer its agent sees stopped (SIGSTOP, a debugger) for max(hang_floor,
    hang_mult * its step time) is hung wherever it stopped: its agent leaves the view."""
    step_floor_ms: int = 1
    """Milliseconds: the shortest training step the plausibility checks assume (a property of the job,
    not of the network: no profile scales it). Synchronous training keeps every rank within one step of
    the others, so a rank reported ahead of at least two others by more than ``2 + 2 * (dt +
    progress_stale) / step`` steps (``dt``: how far apart in time the two reports are; ``progress_stale``:
    how old a report still counted may be; ``step``: the median step time, at least this) is the anomaly
    (a buggy counter), not the ranks waiting for it; and a trainer's report that jumps ahead of
    its previous one by more than ``2 + 2 * elapsed / step`` steps is refused."""
    checkpoint_timeout: float = 600.0
    """A trainer that reports phase ``checkpoint`` (saving one, see ``ResilientTrainer.checkpointing``) is
    judged hung only after this long, not after the step-time threshold."""
    answered_within: float = 0.5
    """A rank is judged hung only on its answer to one of our probes heard since its threshold passed and
    this recently (hung: alive but stuck; a silent one is the probes' business); it is probed this long
    before its threshold passes, and again once it has."""
    progress_stale: float = 1.0
    """A member's progress last heard longer ago than this is stale: the hang check neither counts it in
    the frontier nor judges it (it may have crashed)."""
    straggler_floor_ms: int = 10
    """Milliseconds per step: the least magnitude reported as a straggler, whatever the step time. A rank's
    magnitude is how long the other ranks wait for it per step: the median of their waits inside
    collectives minus its own (``gossiprec/core/stragglers.py``)."""
    straggler_ratio: float = 0.10
    """A rank is a straggler once the others wait for it at least max(straggler_floor_ms, straggler_ratio *
    median step time) per step (a ratio, not a time) ..."""
    straggler_samples: int = 3
    """... in this many consecutive samples (hang check rounds in which its step moved on) ..."""
    straggler_steps: int = 6
    """... spanning at least this many of its steps (the trainer averages its wait over its last 8 steps, and
    the first sample over the threshold comes when half of them lag at most: the figure then holds the whole
    lag); then it is reported once (a ``Straggler`` event, a warning),
    until its magnitude falls below half the threshold."""
    straggler_warmup_steps: int = 16
    """Steps of each view (from the first step of a rank this member sees in it) that the straggler check
    ignores: a job's first steps, and those after a recovery (a spare warming up, figures that still hold
    the steps before the change), are uneven without any straggler."""
    evict_stragglers: bool = False
    """Replace a persistent straggler by a spare, as a hung rank is (an alert of reason ``straggler``):
    one the others wait for at least max(straggler_floor_ms, straggler_evict_ratio * median step time)
    per step in ``straggler_evict_samples`` consecutive samples. False: stragglers are only reported."""
    straggler_evict_ratio: float = 0.25
    """With ``evict_stragglers``: the magnitude, as a part of the median step time, that eviction needs
    (a ratio, not a time)."""
    straggler_evict_samples: int = 16
    """With ``evict_stragglers``: the consecutive samples at that magnitude after which a straggler is
    alerted for removal."""
    retract_after: int = 3
    """Consecutive successful probes after which an observer withdraws its alert."""
    join_retry: float = 0.5
    """A member outside the view (a joiner, or one removed) asks its joiner observers again this often."""
    rejoin_after: float = 2.0
    """A member removed from the view asks to join again (as a spare) after this long, and once its
    trainer dropped its state (a trainer removed as hung cannot: it is killed instead, and its agent
    leaves); a process still within ``hello_for`` of its start asks at once: its trainer is new,
    nothing of it must be stopped first."""
    hello_for: float = 3.0
    """For this long after it starts, a process that holds a view listing it says so to its observers
    (every ``join_retry``): one that restarted is told the current view, and its old process's place is
    removed (reason ``restarted``) instead of silently taken over."""
    unfence_after: float = 1.0
    """A fenced member that is still in its view, reaches a majority of it again and has nothing pending
    unfences after this long (it first asks two members for newer view news)."""
    catchup_interval: float = 0.3
    """At most one catch-up (asking two members for the view) per this long, and at most one view pushed
    to each member that alerts in an older epoch."""
    direct_votes_max: int = 32
    """Views up to this size also send each member's own vote and its own alerts to every member
    directly (one hop instead of a few gossip rounds; 0: gossip only)."""
    watch_first: float = 0.5
    """The first watchdog round (fencing, re-alerts, re-aggregation, hang checks) comes this long after
    the machine starts."""
    watch_interval: float = 0.25
    """Then every this long (riding on a tick up to ``WATCH_EARLY`` early, see :mod:`gossiprec.core.node`).
    A lagging subject's hang threshold passing before the next round gets a wake-up of its own."""
    realert_interval: float = 1.0
    """Our own alerts are gossiped again this often until the view changes (gossip is best effort: an
    alert some member missed would stall the change)."""
    reaggregate_first: float = 0.25
    """After a view change, re-send incomplete report/plan-digest bitmaps this long after the install,
    then at doubling intervals, at most ``reaggregate_gap_max`` apart ..."""
    reaggregate_gap_max: float = 2.0
    """(see ``reaggregate_first``)"""
    reaggregate_for: float = 10.0
    """... for this long."""
    report_hold: float = 2.0
    """When a view is installed while this member's trainer may still commit the step it is in (its
    collective in flight, or already in the optimizer step), its state report waits until the trainer
    has committed that step or stopped (begun recovering), at most this long: a report made at once
    would miss a step committed a moment later, and the plan would roll every survivor back to the step
    before and make them receive state they hold. A trainer on the progress page is also waited for until
    it has taken the view in: before that its collective may still complete (nobody of its group lost)
    and its commit drop the step the report named. 0: report at once."""
    report_poll: float = 0.005
    """While a state report is held, look at the trainer this often."""

    RATIOS: ClassVar[frozenset[str]] = frozenset({"hang_mult", "straggler_ratio", "straggler_evict_ratio"})
    """Float fields that are not times (the ``wan`` profile leaves them as they are)."""

    def __post_init__(self) -> None:
        problems = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool):
                if type(value) is not bool:
                    problems.append(f"{f.name} must be true or false, got {value!r}")
            elif f.type in ("int", int):
                least = 0 if f.name in ("direct_votes_max", "straggler_warmup_steps") else 1
                if type(value) is not int or value < least:
                    problems.append(f"{f.name} must be an integer >= {least}, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                    or value == float("inf"):
                problems.append(f"{f.name} must be a finite number >= 0, got {value!r}")
        if not problems:
            # zero would re-arm a timer at the instant it fired, forever
            for name in ("hang_floor", "watch_interval", "report_poll"):
                if getattr(self, name) <= 0:
                    problems.append(f"{name} must be > 0 s, got {getattr(self, name)!r}")
        if problems:
            raise ConfigError("invalid agreement settings: " + "; ".join(problems))

    @classmethod
    def times(cls) -> tuple[str, ...]:
        """The fields that are times in seconds (every float field but :attr:`RATIOS`)."""
        return tuple(f.name for f in fields(cls) if f.type in ("float", float) and f.name not in cls.RATIOS)

    @classmethod
    def profile(cls, name: str, **overrides: Any) -> "AgreementConfig":
        """A named profile (those of :meth:`Config.profile`) with optional field overrides. ``lan`` and
        ``sim`` are the defaults; ``wan`` multiplies every time (:meth:`times`) by :data:`WAN_FACTOR`,
        the factor the ``wan`` :class:`Config` applies to its timeouts."""
        if name not in PROFILES:
            raise ConfigError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}")
        base = cls()
        if name == "wan":
            base = replace(base, **{n: getattr(base, n) * WAN_FACTOR for n in cls.times()})
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown agreement setting(s): {', '.join(sorted(unknown))}")
        return replace(base, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def remaining_suspicion(
    confirmations: int, k: int, elapsed: float, min_s: float, max_s: float
) -> float:
    """Seconds left on a suspicion timer (Lifeguard's dynamic suspicion, as memberlist computes it).

    The total timeout shrinks from ``max_s`` with no confirmation towards ``min_s`` at ``k`` independent
    confirmations, logarithmically: ``max(min, max - (max - min) * log(C + 1) / log(K + 1))``.
    """
    frac = math.log(confirmations + 1) / math.log(k + 1) if k > 0 else 1.0
    total = max(min_s, max_s - (max_s - min_s) * frac)
    return total - elapsed
