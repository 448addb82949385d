"""How long this rank waits for its peers inside collectives, per step: the straggler check's figure.

A fast rank waits in each collective for the slowest one; the straggler itself waits about nothing. The
trainer reports a rolling mean over the last few steps (one slow step is no straggler), started again
whenever its groups change (a recovery), and without the first step on new groups.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gossiprec.trainer.collectives.groups import EpochGroup

WAIT_WINDOW = 8
"""Steps over which the wait inside collectives is averaged before it is reported to the agent."""


class WaitMeter:
    """The wait of each committed step, from the current group's running total (``waited_s``)."""

    def __init__(self, window: int = WAIT_WINDOW) -> None:
        self._waited: deque[float] = deque(maxlen=window)
        """Seconds waited inside collectives in each of the last few steps."""
        self._mark: tuple[EpochGroup | None, float] = (None, 0.0)
        """The current group and its wait total at the last commit."""
        self.wait_ms = 0
        """The figure to report: the newest rolling mean in milliseconds (kept while a step gives none)."""

    def commit(self, group: EpochGroup | None, counted: bool) -> int:
        """A step committed on ``group`` (``counted``: a previous commit dates its start): the figure to
        report, the rolling mean in milliseconds (the previous one when this step gives none: the first
        on new groups, or one with no previous commit)."""
        waited = group.waited_s if group is not None else 0.0
        previous, before = self._mark
        same = group is not None and group is previous
        if not same:
            self._waited.clear()  # new groups (a recovery): the figure starts again
        self._mark = (group, waited)
        if counted and same:
            self._waited.append(waited - before)
            self.wait_ms = int(1000 * sum(self._waited) / len(self._waited))
        return self.wait_ms
