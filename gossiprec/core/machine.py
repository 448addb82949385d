"""The protocol machine as its pumps see it: the one interface the agent daemon and the simulator drive.

A machine owns no socket, clock or thread. A pump feeds it datagrams (:meth:`Machine.receive`) and
timer expiries (:meth:`Machine.tick`), each with the current time, then takes what it wants sent and
what happened (:meth:`Machine.take_sends`, :meth:`Machine.take_events`) and sleeps until
:meth:`Machine.next_deadline`. The trainer side (progress, donatable state, the job's end) comes in
through the setters. :class:`~gossiprec.core.node.Node` implements it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

if TYPE_CHECKING:
    from gossiprec.core.election import Plan
    from gossiprec.core.events import CoreEvent
    from gossiprec.core.records import MemberInfo, Send
    from gossiprec.core.view import View


class Machine(Protocol):
    """What a pump needs of a protocol machine."""

    # read-only to a pump (the machine alone changes them): properties, so that a machine may derive them
    # (:class:`~gossiprec.core.bootstrap.Booting` forwards them to its node) or hold them as plain attributes
    @property
    def counters(self) -> dict[str, int]: ...
    @property
    def view(self) -> View | None:
        """The view this member holds (None until a joiner is admitted)."""
    @property
    def plan(self) -> Plan | None:
        """The recovery plan of :attr:`view`, once every holder has reported."""
    @property
    def fenced(self) -> str:
        """Why this member must not train now ("" when it may)."""
    @property
    def finished(self) -> int | None:
        """The step at which the job's trainers finished, once known."""

    # inputs
    def receive(self, data: bytes, now: float, reliable: bool = False) -> None: ...
    def tick(self, now: float) -> None: ...
    def join(self, seed_addrs: Iterable[str], now: float) -> None: ...
    def leave(self, now: float) -> None: ...
    def set_progress(self, step: int, phase: int, step_ms: int, now: float, coll: int = 0,
                     wait_ms: int = 0) -> None: ...
    def set_state(self, committed_step: int, inflight_step: int | None, state_bytes: int) -> None: ...
    def set_trainer_seen(self, group_epoch: int) -> None: ...
    def finish(self, step: int, now: float) -> None: ...

    # outputs
    def next_deadline(self) -> float: ...
    def take_sends(self) -> list[Send]: ...
    def take_events(self) -> list[CoreEvent]: ...

    # what it knows
    @property
    def incarnation(self) -> int: ...
    @property
    def n_live(self) -> int: ...
    def has_heard(self, name: str) -> bool: ...
    def members(self) -> list[MemberInfo]: ...
    def progress(self, name: str) -> Any: ...
    def health(self) -> int: ...
    def behind(self) -> dict[str, int]: ...


MachineFactory = Callable[..., Machine]
"""``factory(config, name, addr, *, incarnation, role, now, rng, seeds) -> Machine``."""
