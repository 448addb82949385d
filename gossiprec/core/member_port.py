"""The membership's port: what a :class:`~gossiprec.core.membership.Membership` offers its parts.

Push-pull (:mod:`~gossiprec.core.antientropy`) and this member's own words
(:mod:`~gossiprec.core.own_words`) see their membership only through :class:`MembershipPort`: its
identity, clock and member table (read), the signed Alives and progress it keeps for relaying, and its
services (sending, broadcasting, taking a record as if it had arrived).
"""

from __future__ import annotations

from typing import Callable, Protocol

from gossiprec.core.auth import KeyBook
from gossiprec.core.records import MemberInfo, RandomSource
from gossiprec.core.wire import Alive, Dead, Message, Progress, Suspect


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
    def auth(self) -> KeyBook | None: ...
    @property
    def counters(self) -> dict[str, int]: ...
    @property
    def now(self) -> float:
        """The time of the membership's latest input."""
    @property
    def my_progress(self) -> Progress:
        """This member's own progress record (unsigned until it is first sent)."""

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

    # ------------------------------------------------------------------ services
    def broadcast(self, key: str, msg: Message, now: float, merge: bool = False) -> None: ...
    def send_addr(self, addr: str, msg: Message, reliable: bool = False, before: tuple[Message, ...] = ()) -> None:
        ...
    def set_progress_check(self, check: Callable[[Progress], bool] | None) -> None:
        """Whether a gossiped progress record is its owner's own word (None: every record is)."""
    def on_alive(self, msg: Alive, now: float, proven: bool = False) -> None:
        """Take an Alive as if it had arrived (``proven``: its incarnation is proven here, unsigned)."""
    def on_suspect(self, msg: Suspect, now: float) -> None: ...
    def on_dead(self, msg: Dead, now: float) -> None: ...
    def on_progress(self, msg: Progress, now: float, direct: bool = False, stall_ms: int = 0) -> None: ...
