"""The bootstrap in words: what an agent still waits for before view 0 is decided.

:func:`boot_state` reads a :class:`~gossiprec.core.bootstrap.Bootstrap` (pure: no clock, no I/O) and
:func:`boot_words` says it in one line for people, e.g. ``3 of 4 agents found (n0, n1, n2); waiting
for: seed 10.0.0.4:7946 (silent); seeds answering: 2 of 3``. The agent logs that
line with every :class:`~gossiprec.core.events.BootProgress` and ``gossiprec status`` / ``members``
print it while view 0 is not decided.

A missing agent has no name until it says hello, so the words name only what this agent can know: a
seed that never answered (by its address, as the ``--seed`` list gives it) and is not the address of a
candidate found stands for a missing agent; the others are counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gossiprec.core.bootstrap import Bootstrap


@dataclass(frozen=True, slots=True)
class BootState:
    """What the bootstrap of one agent knows and waits for."""

    found: tuple[str, ...]
    """Names of the candidates found (this agent's own included), sorted."""
    expected: int
    """Members of view 0 (spares included)."""
    seeds: tuple[str, ...]
    """The seed addresses (the acceptors), as configured."""
    answering: tuple[str, ...]
    """Seed addresses whose answer reached this agent, or that are the address of a candidate found."""
    missing_seeds: tuple[str, ...]
    """The other seeds (silent): agents still missing."""
    decided: int | None
    """Members of view 0 once it is decided, else None."""

    @property
    def quorum(self) -> int:
        return len(self.seeds) // 2 + 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the words (``text``): what ``status`` carries."""
        return {"found": list(self.found), "expected": self.expected, "seeds": list(self.seeds),
                "answering": list(self.answering), "missing_seeds": list(self.missing_seeds),
                "decided": self.decided, "text": boot_words(self)}


def boot_state(boot: Bootstrap) -> BootState:
    """The state of ``boot`` now."""
    seeds = tuple(boot.params.seeds)
    addrs = {c.addr for c in boot.known.values()}
    # a seed counts as answering once its answer arrived, or once it is a candidate found here (unsigned,
    # a seed answers a hello only when it knows another number of candidates than the hello says)
    answering = tuple(s for s in seeds if s in boot.answered or s in addrs)
    missing = tuple(s for s in seeds if s not in answering)
    return BootState(tuple(sorted(boot.known)), boot.params.expected, seeds, answering, missing,
                     len(boot.decided) if boot.decided is not None else None)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def boot_words(st: BootState) -> str:
    """One line for people: found of expected, what is waited for, which seeds answer."""
    if st.decided is not None:
        return f"view 0 agreed: {_plural(st.decided, 'member')}"
    found = len(st.found)
    shown = ", ".join(st.found[:8]) + (", ..." if found > 8 else "")
    head = f"{found} of {_plural(st.expected, 'agent')} found ({shown})"
    named: tuple[str, ...] = ()
    if found < st.expected:
        missing = st.expected - found
        named = st.missing_seeds[:missing]
        parts = [f"seed {a} (silent)" for a in named]
        rest = missing - len(named)
        if rest:
            parts.append(f"{_plural(rest, 'more agent')} not heard of yet")
        waiting = "waiting for: " + ", ".join(parts)
    else:
        waiting = (f"waiting for: view 0 to be agreed by a majority of the seeds "
                   f"({st.quorum} of {len(st.seeds)})")
    others = [s for s in st.missing_seeds if s not in named]  # silent, and not named above
    seeds = f"seeds answering: {len(st.answering)} of {len(st.seeds)}" + (
        f" (silent: {', '.join(others)})" if others else "")
    return f"{head}; {waiting}; {seeds}"
