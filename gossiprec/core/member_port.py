"""The membership's port: what a :class:`~gossiprec.core.membership.Membership` offers its parts.

Push-pull (:mod:`~gossiprec.core.antientropy`), this member's own words (:mod:`~gossiprec.core.own_words`)
and the probe protocol (:mod:`~gossiprec.core.prober`) see their membership only through
:class:`MembershipPort`: its identity, clock, health and member table (read), the signed Alives and
progress it keeps for relaying, and its services (timers, sending, broadcasting, events, taking a record
as if it had arrived, judging a suspect).
"""

from __future__ import annotations

from typing import Callable, Protocol

from gossiprec.core.auth import KeyBook
from gossiprec.core.awareness import Awareness
from gossiprec.core.config import Config
from gossiprec.core.events import MemberEvent
from gossiprec.core.members import MemberTable
from gossiprec.core.records import MemberInfo, RandomSource
from gossiprec.core.wire import Alive, Dead, Message, Progress, Suspect

PROBE, DIRECT, INDIRECT_END, GOSSIP, PUSHPULL, SUSPICION, RELAY_NACK, REAP = range(8)
"""The membership's timer kinds: a probe round; a direct probe's deadline (off the FIFO); the end of an
indirect window; a gossip round; a push-pull; a suspicion's timeout; a relay's nack; forgetting a dead
member."""


class MembershipPort(Protocol):
    """A membership as its parts see it."""

    # ------------------------------------------------------------------ identity and state (read)
    @property
    def name(self) -> str: ...
    @property
    def addr(self) -> str: ...
    @property
    def role(self) -> int: ...
    @property
    def incarnation(self) -> int: ...
    @property
    def rng(self) -> RandomSource: ...
    @property
    def config(self) -> Config: ...
    @property
    def awareness(self) -> Awareness:
        """This member's health score (Lifeguard)."""
    @property
    def table(self) -> MemberTable:
        """The member table (read)."""
    @property
    def auth(self) -> KeyBook | None: ...
    @property
    def counters(self) -> dict[str, int]: ...
    @property
    def now(self) -> float:
        """The time of the membership's latest input."""
    @property
    def my_progress(self) -> Progress:
        """This member's own progress record (unsigned until it is first sent)."""
    @property
    def progress_since(self) -> float:
        """When this member's own (step, phase) became current."""

    def member(self, name: str) -> MemberInfo | None: ...
    def members(self) -> list[MemberInfo]: ...
    def random_peers(self, n: int) -> list[str]:
        """Up to ``n`` random live members other than this one."""
    def signed_alive(self, name: str) -> Alive | None:
        """The latest Alive of ``name`` kept (signed where the cluster signs): what push-pull rows carry."""
    def keep_alive(self, alive: Alive) -> None:
        """Keep ``alive`` as its member's latest Alive."""
    def said(self, name: str) -> Progress | None:
        """``name``'s latest progress record as its owner said it (what is relayed)."""
    def signed_progress(self) -> Progress:
        """This member's own progress record, signed, as it goes out."""
    def pending(self, key: str) -> Message | None:
        """The broadcast queued under ``key``, if any."""

    def unproven(self, target: str, now: float) -> bool:
        """Whether ``target``'s silence is not judged yet (never heard from, in the startup grace)."""

    # ------------------------------------------------------------------ services
    def set_timer(self, when: float, kind: int, arg: object) -> int:
        """Arm a timer of ``kind`` (above) with ``arg``; returns its token."""
    def cancel_timer(self, token: int) -> None: ...
    def send_packet(self, addr: str, msgs: list[Message], piggyback: bool, dest: str | None = None,
                    progress: bool = True) -> None:
        """``msgs`` in one datagram (``piggyback``: with queued news for member ``dest``, and with progress
        records unless ``progress`` is False)."""
    def emit(self, event: MemberEvent) -> None: ...
    def heard_from(self, name: str) -> None:
        """``name`` was heard from directly (see :meth:`unproven`)."""
    def rearm_suspicion(self, name: str, now: float) -> None:
        """Restart the suspicion of ``name`` (its verification was inconclusive)."""
    def declare_dead(self, name: str, incarnation: int, now: float) -> None: ...
    def broadcast(self, key: str, msg: Message, now: float, merge: bool = False) -> None: ...
    def send_addr(self, addr: str, msg: Message, reliable: bool = False, before: tuple[Message, ...] = (),
                  progress: bool = False) -> None:
        ...
    def set_progress_check(self, check: Callable[[Progress], bool] | None) -> None:
        """Whether a gossiped progress record is its owner's own word (None: every record is)."""
    def on_alive(self, msg: Alive, now: float, proven: bool = False) -> None:
        """Take an Alive as if it had arrived (``proven``: its incarnation is proven here, unsigned)."""
    def on_suspect(self, msg: Suspect, now: float) -> None: ...
    def on_dead(self, msg: Dead, now: float) -> None: ...
    def on_progress(self, msg: Progress, now: float, direct: bool = False, stall_ms: int = 0) -> None: ...
