"""The agent's event log at its default CI level (``warning``) says why members leave the view: every
alert this agent raises, its fences, stragglers, and every view that removes someone; routine events stay
at info (and probes at debug)."""

from __future__ import annotations

import logging

import pytest

from gossiprec.agent.logs import log_event
from gossiprec.core.events import AlertRaised, Fenced, ViewInstalled


def _levels(caplog: pytest.LogCaptureFixture, *events: object) -> list[tuple[int, str]]:
    logger = logging.getLogger("gossiprec.test.events")
    with caplog.at_level(logging.DEBUG, logger="gossiprec.test.events"):
        for ev in events:
            log_event(logger, ev)
    return [(r.levelno, r.getMessage()) for r in caplog.records]


def test_what_removes_or_stops_a_member_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    removal = ViewInstalled(3, "c", ("n0", "n1"), ("n2",), (), False, True, 1.0)
    join = ViewInstalled(4, "d", ("n0", "n1", "n2"), (), ("n2",), False, True, 2.0)
    got = _levels(caplog, AlertRaised("n2", "hung", 0.5), Fenced(3, "no quorum", 0.7), removal, join)
    assert got == [(logging.WARNING, "event AlertRaised"), (logging.WARNING, "event Fenced"),
                   (logging.WARNING, "event ViewInstalled"), (logging.INFO, "event ViewInstalled")]
    assert caplog.records[0].fields == {"event": "AlertRaised", "subject": "n2", "reason": "hung", "at": 0.5}  # type: ignore[attr-defined]
