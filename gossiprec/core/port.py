"""The node's port: what a :class:`~gossiprec.core.node.Node` offers the parts it is made of.

The observer, the hang check, the aggregates, the catch-up, the fencing and the decider each keep their
own state and see their node only through :class:`NodePort`: its identity, clock, current view and
trainer state (read), and its services (timers, events, sending, installing a view). Membership they use
through :class:`~gossiprec.core.membership.Membership`'s own public interface.
"""

from __future__ import annotations

from typing import Any, MutableMapping, Protocol

from gossiprec.core.auth import KeyBook
from gossiprec.core.consensus import Consensus
from gossiprec.core.events import CoreEvent
from gossiprec.core.overlay import Overlay
from gossiprec.core.records import RandomSource
from gossiprec.core.view import Change, View
from gossiprec.core.wire import Alert, Message


class NodePort(Protocol):
    """A node as its parts see it."""

    # ------------------------------------------------------------------ identity
    @property
    def name(self) -> str: ...
    @property
    def addr(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def rack(self) -> str: ...
    @property
    def start_incarnation(self) -> int:
        """The incarnation this process started at (its Hello says so)."""
    @property
    def auth(self) -> KeyBook | None: ...
    @property
    def rng(self) -> RandomSource: ...
    @property
    def memo(self) -> MutableMapping[Any, Any]:
        """Pure functions of views, cached (may be shared by the nodes of a simulation)."""
    @property
    def counters(self) -> dict[str, int]: ...

    # ------------------------------------------------------------------ state (read)
    @property
    def now(self) -> float:
        """The time of the node's latest input."""
    @property
    def view(self) -> View | None: ...
    @property
    def installed_at(self) -> float:
        """When the current view was installed."""
    @property
    def my_progress(self) -> tuple[int, int, int]:
        """The trainer's (step, phase, step time in ms), as it last reported."""
    @property
    def trainer_state(self) -> tuple[int, int | None, int]:
        """What the trainer could serve: (committed step, in-flight step, bytes)."""
    @property
    def trainer_seen(self) -> int | None:
        """The newest group epoch the trainer has taken in (None: its trainer does not say)."""
    @property
    def finished(self) -> int | None:
        """The step at which the job's trainers finished, once known."""
    @property
    def fenced(self) -> str:
        """Why this member is fenced ("" when it is not)."""
    @property
    def spec_conflict(self) -> str:
        """Set when another view 0 was seen: fenced for good."""
    @property
    def consensus(self) -> Consensus:
        """The current view's agreement."""
    @property
    def withheld(self) -> bool:
        """The cut is ready but not proposed (it keeps no reachable majority)."""

    def alerts_about(self, subject: str) -> int:
        """How many observers' alerts about ``subject`` this member counts in the current view."""

    # ------------------------------------------------------------------ services
    def set_timer(self, when: float, kind: int) -> None:
        """Arm a timer of a kind of :mod:`gossiprec.core.timers` (the node runs the part's handler)."""
    def emit(self, event: CoreEvent) -> None:
        """Add an event to the node's output."""
    def broadcast(self, key: str, msg: Message) -> None:
        """Gossip a message of the agreement layer (a later one with the same key replaces it)."""
    def send_to(self, node: str, msg: Message) -> None:
        """Send to one member (ourselves included: handled at once)."""
    def one_hop_to_all(self, msg: Message, extra: tuple[Message, ...] = (), skip: str = "") -> None:
        """In a small view: ``msg`` (and ``extra``) straight to every other member but ``skip``."""
    def key_claim(self) -> tuple[Message, ...]:
        """Our key claim, ahead of a message signed with it."""
    def count_alert(self, msg: Alert, now: float) -> None:
        """Tally an alert (our own too) in the cut detector, as if it had arrived."""
    def overlay(self, view: View) -> Overlay: ...
    def next_view(self, view: View, digest: bytes, changes: list[Change]) -> View: ...
    def install(self, view: View, now: float, fast: bool, decided_here: bool, removed: tuple[str, ...],
                joined: tuple[str, ...]) -> None:
        """Install ``view`` (decided here, or learnt from a peer)."""
    def install_decided(self, now: float) -> None:
        """Install the view that the current view's consensus decided."""
    def spec_mismatch(self, peer: str, theirs: str, other: View | None, now: float, proven: bool = True) -> None:
        """Another view 0 than ours was seen: fence for good (``proven``: in a member's signed word; else
        only reported)."""
