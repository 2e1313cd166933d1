"""Structured logs: one line per event, ``event`` first, ids as fields.

Several lines are logged per handoff, on the event loop, so a line must be cheap: the record
keeps the fields unformatted until a handler formats them (text or JSON, never both), and
:func:`configure` turns off the caller, thread and process look-ups that ``logging`` would
otherwise do for every record.

>>> format_fields("transfer.done", {"transfer_id": "t1", "bytes": 4096})
'transfer.done transfer_id=t1 bytes=4096'
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["configure", "log_event"]

logger = logging.getLogger("kvxferd")


def format_fields(event: str, fields: dict[str, Any]) -> str:
    parts = [event]
    for k, v in fields.items():
        text = v if isinstance(v, str) else json.dumps(v) if isinstance(v, dict | list) else str(v)
        if " " in text or not text:
            text = json.dumps(text)
        parts.append(f"{k}={text}")
    return " ".join(parts)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "event": getattr(record, "event", record.getMessage()),
        }
        data.update(getattr(record, "fields", {}))
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


class _TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:  # strftime once per second, not once per line
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(second))
        fields = getattr(record, "fields", None)
        message = format_fields(record.msg, fields) if fields is not None else record.getMessage()
        line = f"{self._stamp}.{int(record.msecs):03d} {record.levelname.lower():7s} {message}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(level: str, json_lines: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if json_lines else _TextFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    # No caller (a stack walk), thread or process names in the records: nothing prints them,
    # and skipping them is the logging HOWTO's own advice for code that logs often.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def log_event(event: str, level: int = logging.INFO, exc_info: bool | BaseException = False, **fields: Any) -> None:
    """Log one event with its fields (e.g. ``transfer_id=...``)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"event": event, "fields": fields}, exc_info=exc_info)
