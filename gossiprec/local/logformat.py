"""Log lines as the agent writes them, text for people or JSON lines for log shippers, for both sides.

The agent (:mod:`gossiprec.agent.logs`) and a trainer under ``gossiprec run`` (which hands the agent's
format down in ``GOSSIPREC_LOG_FORMAT`` and ``GOSSIPREC_LOG_LEVEL``, the launch contract) write the same
lines. Structured fields travel in a record's ``extra={"fields": {...}}``: the text formatter appends them
as ``key=value``, the JSON formatter merges them into the line's object.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_LAYOUT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            base += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return base


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if fields:
            doc.update(fields)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def log_handler(fmt: str = "text", stream: Any = None) -> logging.Handler:
    """A handler writing ``fmt`` lines (``text`` or ``json``) to ``stream`` (default stderr)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_LAYOUT))
    return handler
