"""Log output of the agent processes: text for people or JSON lines for log shippers.

Structured fields travel in a record's ``extra={"fields": {...}}``: the text formatter appends them as
``key=value``, the JSON formatter merges them into the line's object (:mod:`gossiprec.local.logformat`,
shared with the trainer). Machine events are logged with
their fields (:func:`log_event`), the per-probe ones at debug level only. Nothing here runs at import:
:func:`configure_logging` is called by the command-line entry points.
"""

from __future__ import annotations

import logging
from typing import Any

from gossiprec.local.logformat import JsonFormatter as JsonFormatter, TextFormatter as TextFormatter, log_handler
from gossiprec.local.protocol import event_to_dict

_QUIET_EVENTS = frozenset({"ProbeResult"})
"""Events logged at debug level: one per probe, far too many for info."""
_LOUD_EVENTS = {"JobSpecMismatch": logging.ERROR, "BootMismatch": logging.ERROR,
                "AlertRaised": logging.WARNING, "Fenced": logging.WARNING, "Straggler": logging.WARNING}
"""Events that say the job was started wrongly (errors), and the ones that say why a member is removed or
stopped (warnings: an operator, or a flaky test's logs at ``warning``, must show who accused whom, and why)."""


def configure_logging(fmt: str = "text", level: str = "info", stream: Any = None) -> None:
    """Log ``gossiprec.*`` to stderr as text or JSON lines. Called by the CLI only (never at import)."""
    handler = log_handler(fmt, stream)
    root = logging.getLogger("gossiprec")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def log_event(logger: logging.Logger, ev: Any) -> None:
    """One line per machine event, its fields attached (encoded only when the level is enabled)."""
    name = type(ev).__name__
    level = logging.DEBUG if name in _QUIET_EVENTS else _LOUD_EVENTS.get(name, logging.INFO)
    if name == "ViewInstalled" and getattr(ev, "removed", ()):  # type: ignore[arg-type]  # mypy: and's bool context
        level = logging.WARNING  # a member removed: the job recovers
    if logger.isEnabledFor(level):
        logger.log(level, "event %s", name, extra={"fields": event_to_dict(ev)})
