"""The trainer's tunables: one frozen, validated :class:`TrainerConfig`, handed to ``ResilientTrainer``.

Every field has a unit and a default with its reason; a bad value raises
:class:`~gossiprec.errors.ConfigError` when the config is built, before any process group or socket
exists. The timeouts derived from ``timeout`` are properties, so their formulas live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from gossiprec.errors import ConfigError
from gossiprec.local.launch import DONOR_OFFSET, STORE_OFFSET
from gossiprec.trainer.collectives.groups import BACKENDS


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    """How a :class:`~gossiprec.trainer.loop.ResilientTrainer` runs; the defaults suit a LAN job."""

    backend: str = "gloo"
    """torch.distributed backend of every epoch's group: ``gloo`` (CPU tensors) or ``nccl``."""
    timeout: float = 30.0
    """Seconds that a recovery's group construction and one collective may take before they fail. The
    state transfer of a recovery gets :attr:`fetch_timeout`, a silent donor :attr:`stall_timeout`, the last
    barrier of ``finish()`` :attr:`finish_timeout`; the first group :attr:`start_timeout`."""
    start_timeout: float = 600.0
    """Seconds ``start()`` waits for every rank of view 0 to join the first group (and a spare or a
    re-provisioned host for its agent to be admitted). Generous: a rank may import torch from a shared
    file system or initialise CUDA for minutes; after it, the error names the ranks that never came."""
    recovery_timeout: float = 120.0
    """Seconds a trainer's recovery waits for a plan it can apply (after a collective failed without a
    view change, or after a plan that could not finish) before it raises
    :class:`~gossiprec.errors.RecoveryError` naming what it tried, so that its exit makes the agents
    agree on a new view; a spare (or a fenced trainer, which waits as one) waits without bound."""
    wait_for_spares: float = 0.0
    """Seconds ``start()`` waits, once the first group is built, for the spares of view 0 to report
    that they are up (0: not at all). A spare still importing torch when a rank fails makes that
    recovery wait for it; a job that wants warm spares from its first step waits here."""
    poll_interval: float = 0.002
    """Seconds between two looks of a waiting collective at its abort event: how fast an agent's view
    change interrupts it. In (0, 1]."""
    wait_report_after: float = 0.25
    """Seconds a collective may wait before this rank reports phase ``waiting``, so that the agents can
    tell it (alive, waiting on peers) from a rank frozen inside the collective. >= 0."""
    store_offset: int = STORE_OFFSET
    """Port of this trainer's TCPStore server: its agent's port + this. Every member uses the same
    offsets, so any member's store follows from the view's member address; no address is gossiped."""
    donor_offset: int = DONOR_OFFSET
    """Port of this trainer's state donor: its agent's port + this (differs from :attr:`store_offset`)."""
    bind_host: str | None = None
    """Address the store and donor servers (and gloo's connections) listen on. None: this member's
    address as the agent gives it, the one the other members reach it at; nothing listens elsewhere."""
    linger: float = 5.0
    """Seconds a rank released by a shrink keeps serving its state to the receivers before it leaves."""
    background_snapshot: bool = True
    """Copy a commit's parameters and optimizer state while the next step computes (only the optimizer
    step may change them in between); False copies everything inside ``commit()``."""
    snapshot_copies: int | None = None
    """Host copies of parameters and optimizer state kept for recovery (:mod:`gossiprec.trainer.state.snapshots`):
    1 (the last commit, overwritten in place; 1x the state in host memory), 2 (the last two commits, so
    that a second plan may still name a step the first one rolled back: 2x) or 0 (none: a commit is the
    live tensors until the next optimizer step; only buffers, RNG and data position are copied). None
    (default): 1. A sharded job needs the step before its last commit too (a failure inside a step can
    leave its replica groups one commit apart): with 1 it holds its last commit as the live tensors
    until every rank has committed it (a one-element all-reduce issued at the start of the next step,
    waited before its optimizer step), then copies it over the one before; with 0 no rank steps its
    optimizer before every rank is ready to (the same all-reduce, issued and waited there: about one
    all-reduce of latency per step), and a rank interrupted in it rolls forward when the plan resumes
    at its step (:mod:`gossiprec.trainer.gate`). Which failures each covers: docs/training-loop.md,
    "Memory of commits"."""
    verify_replicas: bool = True
    """Compare a digest of the state across each replica group at the start, after the first step,
    after every recovery and every :attr:`verify_every` steps; a mismatch raises
    :class:`~gossiprec.trainer.state.digest.ReplicaMismatch`."""
    verify_every: int = 0
    """Steps between two periodic replica checks (0: none beyond those above). >= 0."""
    verify_exclude: tuple[str, ...] = ()
    """Entry-name prefixes the replica checks leave out, for state that legitimately differs across
    replicas and that a receiver may take from any donor (e.g. ``("model/bn.",)`` for BatchNorm
    statistics nobody synchronises). Names are object/path, as ``ReplicaMismatch`` prints them."""
    stateless_data: bool = False
    """The loop registers no data position because every batch is a function of (step, rank); without
    it, objects with no data position are refused (a spare would read other batches)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("timeout", "poll_interval", "wait_report_after", "linger", "start_timeout",
                     "recovery_timeout", "wait_for_spares"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
        for name in ("timeout", "start_timeout", "recovery_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 s, got {getattr(self, name)!r}")
        if self.wait_for_spares < 0:
            raise ConfigError(f"wait_for_spares must be >= 0 s, got {self.wait_for_spares!r}")
        if not 0 < self.poll_interval <= 1.0:
            raise ConfigError(f"poll_interval must be in (0, 1] s, got {self.poll_interval!r}")
        if self.wait_report_after < 0 or self.linger < 0:
            raise ConfigError(f"wait_report_after and linger must be >= 0 s, got {self.wait_report_after!r} "
                              f"and {self.linger!r}")
        for name in ("store_offset", "donor_offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
                raise ConfigError(f"{name} must be an int port offset in [1, 65535], got {value!r}")
        if self.store_offset == self.donor_offset:
            raise ConfigError(f"store_offset and donor_offset must differ, both are {self.store_offset}")
        if self.bind_host is not None and (not isinstance(self.bind_host, str) or not self.bind_host):
            raise ConfigError(f"bind_host must be a host name or address (or None: the agent's), got "
                              f"{self.bind_host!r}")
        for name in ("background_snapshot", "verify_replicas", "stateless_data"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.snapshot_copies is not None and (isinstance(self.snapshot_copies, bool)
                                                 or self.snapshot_copies not in (0, 1, 2)):
            raise ConfigError(f"snapshot_copies must be 0, 1, 2 or None (1), got "
                              f"{self.snapshot_copies!r}")
        if isinstance(self.verify_every, bool) or not isinstance(self.verify_every, int) or self.verify_every < 0:
            raise ConfigError(f"verify_every must be an int >= 0 (0: no periodic check), got {self.verify_every!r}")
        if not isinstance(self.verify_exclude, tuple) or not all(isinstance(x, str) and x for x in self.verify_exclude):
            raise ConfigError(f"verify_exclude must be a tuple of non-empty name prefixes, got {self.verify_exclude!r}")

    @property
    def device(self) -> str:
        """Where the trainer's own small collectives put their tensors (NCCL takes CUDA tensors only)."""
        return "cuda" if self.backend == "nccl" else "cpu"

    @property
    def fetch_timeout(self) -> float:
        """Seconds a recovery's whole state transfer may take: ``max(timeout, 60)``."""
        return max(self.timeout, 60.0)

    @property
    def stall_timeout(self) -> float:
        """Seconds a donor may send nothing before the transfer gives up on it: ``min(timeout, 5)``."""
        return min(self.timeout, 5.0)

    @property
    def finish_timeout(self) -> float:
        """Seconds the last barrier of ``finish()`` may take: ``min(timeout, 10)``."""
        return min(self.timeout, 10.0)
