"""Structured logs: one line per event, ``event`` first, ids as fields.

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
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        line = f"{ts}.{int(record.msecs):03d} {record.levelname.lower():7s} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(level: str, json_lines: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if json_lines else _TextFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def log_event(event: str, level: int = logging.INFO, exc_info: bool = False, **fields: Any) -> None:
    """Log one event with its fields (e.g. ``transfer_id=...``)."""
    if logger.isEnabledFor(level):
        logger.log(
            level,
            format_fields(event, fields),
            extra={"event": event, "fields": fields},
            exc_info=exc_info,
        )
